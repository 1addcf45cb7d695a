// The attention layer's training pass on the CUDA backend (math §9) against the CPU backend:
// random widths, heads, windows (1-6, and beyond the stream), RoPE on and off, batches 1-3,
// no prefix, a shared prefix and one per sequence, pieces of 0-9 rows chained through
// d_state_in / d_state_out. CPU double is the reference: CUDA double within 1e-12, CUDA float
// within 1e-5 of the same problem rounded to float, run in double. The refusals change
// nothing; the backward's functors (attention/attention_row_backward.hpp) also run on the
// host against the CPU kernel's backward.

#include <titans/attention/attention_row_backward.hpp>
#include <titans/backend/cuda/cuda.cuh>

#include "block_cases.hpp"
#include "cuda_common.hpp"
#include "segment_backward_case.hpp"

namespace {

using namespace titans_test;
using titans::Attention;
using titans::AttentionStateGradient;
using titans::PrefixSharing;
using titans::backend::Cuda;

/// A training case: the configuration, parameters, the pieces of a stream (sequence-major,
/// B x len rows each), their upstream gradients, the prefix, the gradients the call adds to.
struct AttnTrainCase {
    AttentionConfig cfg;
    AttentionParams<double> params, g0;
    int B = 1;
    std::vector<Matrixd> x, dy;
    Matrixd prefix;
    PrefixSharing sharing = PrefixSharing::Shared;
};

/// Rounded through T (the float run and its double reference see the same numbers).
template <class T>
Matrixd rounded(const Matrixd& m) {
    return m.cast<T>().template cast<double>();
}

/// Pieces of 1-9 tokens (sometimes none), or of 16-80 when `long_pieces` (the warp tiles').
template <class T>
AttnTrainCase attn_train_case(Rng& rng, int index, int max_pieces, bool long_pieces = false) {
    AttnTrainCase c;
    c.cfg.n_heads = uniform_int(rng, 1, 3);
    c.cfg.rope = index % 2 == 0;
    c.cfg.d_head = c.cfg.rope ? 2 * uniform_int(rng, 1, 3) : uniform_int(rng, 1, 5);
    c.cfg.d_model = uniform_int(rng, 2, 9);
    c.cfg.window = index % 7 == 3 ? 64 : uniform_int(rng, 1, 6);  // 64: beyond any stream
    c.cfg.rope_base = uniform(rng, 2.0, 100.0);
    c.cfg.validate();
    c.params = cast_attention<double>(
        cast_attention<T>(AttentionParams<double>::random(c.cfg, rng())));
    c.g0 = cast_attention<double>(
        cast_attention<T>(AttentionParams<double>::random(c.cfg, rng())));
    c.B = uniform_int(rng, 1, 3);
    const int pieces = uniform_int(rng, 1, max_pieces);
    for (int k = 0; k < pieces; ++k) {
        const int n = long_pieces                 ? uniform_int(rng, 16, 80)
                      : uniform_int(rng, 0, 4) == 0 ? 0
                                                    : uniform_int(rng, 1, 9);
        c.x.push_back(rounded<T>(random_matrix(c.B * n, c.cfg.d_model, rng)));
        c.dy.push_back(rounded<T>(random_matrix(c.B * n, c.cfg.d_model, rng)));
    }
    const int kind = (index / 2) % 3;  // 0 none, 1 shared, 2 per sequence
    const int np = uniform_int(rng, 1, 3);
    if (kind == 1) c.prefix = rounded<T>(random_matrix(np, c.cfg.d_model, rng));
    if (kind == 2) {
        c.prefix = rounded<T>(random_matrix(c.B * np, c.cfg.d_model, rng));
        c.sharing = PrefixSharing::PerSequence;
    }
    return c;
}

/// What a chained training pass returns, in double: each piece's dx and d_state_in, the
/// gradients (g0 plus the pass's), the prefix's gradient summed over the pieces.
struct AttnTrainResult {
    std::vector<Matrixd> dx, dk_in, dv_in;
    AttentionParams<double> g;
    Matrixd dprefix;
};

template <class T>
Matrix<T> poisoned(Eigen::Index rows, Eigen::Index cols) {
    return Matrix<T>::Constant(rows, cols, std::numeric_limits<T>::quiet_NaN());
}

/// The pieces forward with traces from a fresh state, then backward last first, each with the
/// next one's d_state_in as its d_state_out (chain = false: one piece, no state adjoints).
template <class T, class Backend>
AttnTrainResult train(const AttnTrainCase& c, bool chain = true) {
    Attention<T, Backend> attn(c.cfg, cast_attention<T>(c.params));
    auto st = attn.make_state(c.B);
    const Matrix<T> prefix = c.prefix.cast<T>();
    const Matrix<T>* pp = c.prefix.rows() > 0 ? &prefix : nullptr;
    const std::size_t K = c.x.size();
    std::vector<typename Attention<T, Backend>::Trace> traces(K);
    for (std::size_t k = 0; k < K; ++k) {
        Matrix<T> y = poisoned<T>(1, 1);
        attn.forward(st, Matrix<T>(c.x[k].cast<T>()), y, traces[k], pp, c.sharing);
    }
    AttnTrainResult r;
    r.dx.resize(K);
    r.dk_in.resize(K);
    r.dv_in.resize(K);
    auto g = cast_attention<T>(c.g0);
    Matrixd dp = Matrixd::Zero(c.prefix.rows(), c.cfg.d_model);
    AttentionStateGradient<T> d_next;
    for (std::size_t k = K; k-- > 0;) {
        Matrix<T> dx = poisoned<T>(3, 2), dpk = poisoned<T>(2, 3);
        AttentionStateGradient<T> d_in;
        d_in.keys.assign(1, poisoned<T>(2, 2));
        d_in.values.assign(1, poisoned<T>(2, 2));
        attn.backward(traces[k], Matrix<T>(c.dy[k].cast<T>()), dx, g, &dpk,
                      chain ? &d_in : nullptr, chain ? &d_next : nullptr);
        r.dx[k] = dx.template cast<double>();
        if (c.prefix.rows() > 0) dp += dpk.template cast<double>();
        if (chain) {
            REQUIRE(d_in.keys.size() == static_cast<std::size_t>(c.B));
            Matrixd dk(0, c.cfg.inner_dim()), dv(0, c.cfg.inner_dim());
            for (int b = 0; b < c.B; ++b) {  // stacked over the sequences
                const auto i = static_cast<std::size_t>(b);
                Matrixd sk(dk.rows() + d_in.keys[i].rows(), dk.cols());
                sk << dk, d_in.keys[i].template cast<double>();
                Matrixd sv(dv.rows() + d_in.values[i].rows(), dv.cols());
                sv << dv, d_in.values[i].template cast<double>();
                dk = sk;
                dv = sv;
            }
            r.dk_in[k] = dk;
            r.dv_in[k] = dv;
            d_next = std::move(d_in);
        }
    }
    r.g = cast_attention<double>(g);
    r.dprefix = dp;
    return r;
}

/// The largest rel_error of every output of a against b (each tensor relative to its own
/// largest entry, at least floor).
double worst_error(const AttnTrainResult& a, const AttnTrainResult& b,
                   const AttentionConfig& cfg, double floor) {
    double e = 0.0;
    for (std::size_t k = 0; k < a.dx.size(); ++k) {
        e = std::max(e, rel_error(a.dx[k], b.dx[k], floor));
        e = std::max(e, rel_error(a.dk_in[k], b.dk_in[k], floor));
        e = std::max(e, rel_error(a.dv_in[k], b.dv_in[k], floor));
    }
    e = std::max(e, rel_error(a.dprefix, b.dprefix, floor));
    AttentionParams<double>::tensors(a.g, cfg, [&](const std::string& name, const auto& t) {
        AttentionParams<double>::tensors(b.g, cfg, [&](const std::string& n2, const auto& t2) {
            if (n2 == name) e = std::max(e, rel_error(Matrixd(t), Matrixd(t2), floor));
        });
    });
    return e;
}

template <class T>
void attn_parity_sweep(const char* name, int cases, int max_pieces, bool chain,
                  bool long_pieces = false) {
    for (int i = 0; i < parity_cases(cases); ++i) {
        Rng rng(seed_for(name, static_cast<std::uint64_t>(i)));
        const AttnTrainCase c = attn_train_case<T>(rng, i, max_pieces, long_pieces);
        INFO("case " << i << " heads " << c.cfg.n_heads << " d_head " << c.cfg.head_dim()
                     << " window " << c.cfg.window << " rope " << c.cfg.rope << " B " << c.B
                     << " pieces " << c.x.size() << " prefix " << c.prefix.rows());
        const AttnTrainResult ref = train<double, titans::backend::Cpu>(c, chain);
        const AttnTrainResult got = train<T, Cuda>(c, chain);
        CHECK(note_error<T>(std::string("attention training ") + (chain ? "chained" : "single"),
                            worst_error(got, ref, c.cfg, 1e-6)) <= bound<T>());
    }
}

}  // namespace

TEMPLATE_TEST_CASE("cuda attention train: one piece", "[cuda]", float, double) {
    attn_parity_sweep<TestType>("cuda attention train: one piece", 40, 1, false);
}

TEMPLATE_TEST_CASE("cuda attention train: chained", "[cuda]", float, double) {
    attn_parity_sweep<TestType>("cuda attention train: chained", 40, 4, true);
}

// Pieces of 16 tokens and more: the forward and the backward in warp tiles (head widths up
// to 6, padded to 32), chained, against the CPU.
TEMPLATE_TEST_CASE("cuda attention train: warp tiles", "[cuda]", float, double) {
#if TITANS_CUDA_EMULATION
    const void* query = reinterpret_cast<const void*>(
        &titans::backend::cuda::warp_query_backward_kernel<TestType, false, 32>);
    const long before = cuda_emulation::launches(query);
#endif
    attn_parity_sweep<TestType>("cuda attention train: warp tiles", 10, 3, true, true);
#if TITANS_CUDA_EMULATION
    CHECK(cuda_emulation::launches(query) > before);
#endif
}

// MAC's segment attention forward (Attention::segment) against the CPU's: parts of 1-7 rows
// and of 18-48 (queries at stride 2 over the interleaved segment, the shared prefix, the kept
// rows), in warp tiles where they apply (Auto), in scalar tiles (Scalar) and a thread per row
// and head (Off): y and the segment buffers the part wrote.
TEMPLATE_TEST_CASE("cuda attention: segment forward", "[cuda]", float, double) {
    namespace tc = titans::backend::cuda;
    using T = TestType;
    for (const auto mode : {tc::TiledAttentionMode::Auto, tc::TiledAttentionMode::Scalar,
                            tc::TiledAttentionMode::Off}) {
        const TiledModeScope scope(mode);
#if TITANS_CUDA_EMULATION
        const void* warp = reinterpret_cast<const void*>(&tc::warp_tiled_attention_kernel<T, false, 32>);
        const void* scalar = reinterpret_cast<const void*>(&tc::tiled_attention_kernel<T>);
        const long warp0 = cuda_emulation::launches(warp), scalar0 = cuda_emulation::launches(scalar);
#endif
        for (const bool long_parts : {false, true}) {
            for (int i = 0; i < parity_cases(12); ++i) {
                Rng rng(seed_for("cuda attention: segment forward", static_cast<std::uint64_t>(i)));
                const SegmentBackwardCase c = segment_backward_case(rng, i, long_parts);
                INFO("case " << i << " mode " << static_cast<int>(mode) << " B " << c.B << " C "
                             << c.C << " o " << c.o << " m " << c.m << " np " << c.P.rows()
                             << " rope " << c.cfg.rope);
                const SegmentForwardResult ref = run_segment_forward<double, titans::backend::Cpu>(c);
                const SegmentForwardResult got = run_segment_forward<T, Cuda>(c);
                CHECK(std::max({rel_error(got.y, ref.y, 1e-6), rel_error(got.seg_k, ref.seg_k, 1e-6),
                                rel_error(got.seg_v, ref.seg_v, 1e-6)}) <= bound<T>());
            }
        }
#if TITANS_CUDA_EMULATION
        CHECK((cuda_emulation::launches(warp) > warp0) == (mode == tc::TiledAttentionMode::Auto));
        CHECK((cuda_emulation::launches(scalar) > scalar0) ==
              (mode != tc::TiledAttentionMode::Off));  // (Auto: the short parts)
#endif
    }
}

// The training pass with the tiles off: the per-row backward (a thread per query row, window
// row and prefix row) still matches the CPU.
TEMPLATE_TEST_CASE("cuda attention train: per-row", "[cuda]", float, double) {
    const TiledModeScope off(titans::backend::cuda::TiledAttentionMode::Off);
    attn_parity_sweep<TestType>("cuda attention train: per-row", 12, 4, true);
}

TEST_CASE("cuda attention train: can fail", "[cuda]") {
    // A window one row off, the same problem otherwise: the comparison sees it.
    int seen = 0;
    for (int i = 0; i < 20 && seen < 3; ++i) {
        Rng rng(seed_for("cuda attention train: can fail", static_cast<std::uint64_t>(i)));
        AttnTrainCase c = attn_train_case<double>(rng, i, 1);
        if (c.x[0].rows() / c.B <= c.cfg.window + 1 || c.cfg.window >= 6) continue;
        const AttnTrainResult ref = train<double, titans::backend::Cpu>(c, false);
        c.cfg.window += 1;
        const AttnTrainResult off = train<double, Cuda>(c, false);
        c.cfg.window -= 1;
        CHECK(worst_error(off, ref, c.cfg, 1e-6) > 1e-6);
        ++seen;
    }
    CHECK(seen > 0);
}

TEMPLATE_TEST_CASE("cuda attention train: refusals", "[cuda]", float, double) {
    using T = TestType;
    Rng rng(seed_for("cuda attention train: refusals"));
    AttnTrainCase c = attn_train_case<T>(rng, 2, 1);  // a shared prefix
    c.x[0] = rounded<T>(random_matrix(c.B * 4, c.cfg.d_model, rng));
    Attention<T, Cuda> gpu(c.cfg, cast_attention<T>(c.params));
    Attention<T> cpu(c.cfg, cast_attention<T>(c.params));
    auto sg = gpu.make_state(c.B);
    auto sc = cpu.make_state(c.B);
    typename Attention<T, Cuda>::Trace tg, empty_g;
    typename Attention<T>::Trace tc, empty_c;
    const Matrix<T> x = c.x[0].cast<T>(), prefix = c.prefix.cast<T>();
    Matrix<T> y;
    gpu.forward(sg, x, y, tg, &prefix);
    cpu.forward(sc, x, y, tc, &prefix);
    auto g = cast_attention<T>(c.g0);
    const auto before = g;
    Matrix<T> dx = poisoned<T>(2, 2), dp = poisoned<T>(1, 1);
    const Matrix<T> bad_dy = Matrix<T>::Ones(x.rows() + 1, x.cols());
    const Matrix<T> dy = Matrix<T>::Ones(x.rows(), x.cols());
    REQUIRE_THROWS_AS(cpu.backward(tc, bad_dy, dx, g, &dp), titans::ShapeError);
    REQUIRE_THROWS_AS(gpu.backward(tg, bad_dy, dx, g, &dp), titans::ShapeError);
    REQUIRE_THROWS_AS(cpu.backward(empty_c, dy, dx, g, &dp), titans::ShapeError);
    REQUIRE_THROWS_AS(gpu.backward(empty_g, dy, dx, g, &dp), titans::ShapeError);
    {  // a moved-from trace reads as empty; a trace whose sizes were changed is refused
        typename Attention<T, Cuda>::Trace moved = tg, kept = std::move(moved);
        CHECK(moved.empty());
        REQUIRE_THROWS_NAMING(gpu.backward(moved, dy, dx, g, &dp), titans::ShapeError,
                              "trace is empty");
        kept.kept += 1;
        REQUIRE_THROWS_NAMING(gpu.backward(kept, dy, dx, g, &dp), titans::ShapeError,
                              "trace.kept");
        kept = tg;
        kept.prefix.r += 1;
        REQUIRE_THROWS_NAMING(gpu.backward(kept, dy, dx, g, &dp), titans::ShapeError,
                              "trace.prefix.mem.size()");
    }
    AttentionStateGradient<T> bad;  // one sequence too many
    bad.keys.assign(static_cast<std::size_t>(c.B + 1), Matrix<T>::Zero(3, c.cfg.inner_dim()));
    bad.values = bad.keys;
    REQUIRE_THROWS_AS(cpu.backward(tc, dy, dx, g, &dp, nullptr, &bad), titans::ShapeError);
    REQUIRE_THROWS_AS(gpu.backward(tg, dy, dx, g, &dp, nullptr, &bad), titans::ShapeError);
    titans::AttentionParams<T>::tensors(g, c.cfg, [&](const std::string& name, const auto& t) {
        titans::AttentionParams<T>::tensors(before, c.cfg, [&](const std::string& n2,
                                                                const auto& t2) {
            if (n2 == name) CHECK(identical(t, t2));
        });
    });
    CHECK(dx.rows() == 2);
    CHECK(std::isnan(static_cast<double>(dx(0, 0))));
    CHECK(std::isnan(static_cast<double>(dp(0, 0))));
    // And the accepted call afterwards writes them.
    gpu.backward(tg, dy, dx, g, &dp);
    CHECK(dx.rows() == x.rows());
    CHECK(dp.rows() == prefix.rows());
    CHECK(dx.allFinite());
}

namespace {

/// The backward functors of attention/attention_row_backward.hpp run on the host, a loop over
/// their elements, against the CPU kernel's prefix_window_attention_backward per sequence;
/// with `window_off` they are given a window one row longer than the reference's.
template <class T>
double functor_error(Rng& rng, int window_off, double* ref_scale = nullptr) {
    using titans::detail::AttentionBackwardOperands;
    using Index = Eigen::Index;
    const int H = uniform_int(rng, 1, 3), dh = uniform_int(rng, 1, 5), w = uniform_int(rng, 1, 6);
    const int B = uniform_int(rng, 1, 3);
    const Index D = static_cast<Index>(H) * dh, N = uniform_int(rng, 1, 9);
    const Index h = uniform_int(rng, 0, w - 1), cap = h + N, p = uniform_int(rng, 0, 3);
    const bool shared = uniform_int(rng, 0, 1) == 1;
    const Index prows = shared ? p : B * p;
    const T scale = T(1) / std::sqrt(static_cast<T>(dh));
    const Matrix<T> qkv = random_matrix(B * N, 3 * D, rng).cast<T>();
    const Matrix<T> kp = random_matrix(prows, D, rng).cast<T>();
    const Matrix<T> vp = random_matrix(prows, D, rng).cast<T>();
    const Matrix<T> dout = random_matrix(B * N, D, rng).cast<T>();
    Matrix<T> kw = random_matrix(B * cap, D, rng).cast<T>(), vw = kw;
    vw = random_matrix(B * cap, D, rng).cast<T>();
    const titans::detail::AppendWindow<T> append{qkv.data(), kw.data(), vw.data(), N, D, cap, h};
    for (unsigned i = 0; i < B * N * D; ++i) append(i);
    Matrix<T> stats(3, B * N * H), dqkv = Matrix<T>::Zero(B * N, 3 * D);
    Matrix<T> dkw(B * cap, D), dvw(B * cap, D), dkv(prows, 2 * D);
    const T* kpp = prows > 0 ? kp.data() : qkv.data();
    const T* vpp = prows > 0 ? vp.data() : qkv.data();
    const AttentionBackwardOperands<T> ops{
        qkv.data(), kpp, vpp, shared ? prows : p, D, D, shared, kw.data(), vw.data(), cap, h,
        N, D, H, dh, w + window_off, scale, dout.data(), &stats(0, 0), &stats(1, 0),
        &stats(2, 0)};
    const titans::detail::QueryRowsBackward<T> qf{ops, dqkv.data(), 3 * D};
    for (unsigned i = 0; i < B * N * H; ++i) qf(i);
    const titans::detail::KeyRowsBackward<T> kf{ops, dkw.data(), dvw.data()};
    for (unsigned i = 0; i < B * cap * H; ++i) kf(i);
    const titans::detail::PrefixRowsBackward<T> pf{ops, B, dkv.data(), 2 * D};
    for (unsigned i = 0; i < prows * H; ++i) pf(i);
    // The reference, per sequence.
    Matrix<T> dkp = Matrix<T>::Zero(prows, D), dvp = Matrix<T>::Zero(prows, D);
    double err = 0.0, big = 0.0;
    auto compare = [&](const auto& a, const auto& b) {
        err = std::max(err, (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff());
        big = std::max(big, b.template cast<double>().cwiseAbs().maxCoeff());
    };
    for (int b = 0; b < B; ++b) {
        const Index n = shared ? p : p, p0 = shared ? 0 : b * p;
        Matrix<T> dq, dkp_b = Matrix<T>::Zero(n, D), dvp_b = Matrix<T>::Zero(n, D);
        Matrix<T> dks = Matrix<T>::Zero(cap, D), dvs = Matrix<T>::Zero(cap, D);
        const Matrix<T> q = qkv.block(b * N, 0, N, D);
        titans::prefix_window_attention_backward<T>(
            q, kp.middleRows(p0, n), vp.middleRows(p0, n), kw.middleRows(b * cap, cap),
            vw.middleRows(b * cap, cap), H, dh, w, h, dout.middleRows(b * N, N), dq, dkp_b,
            dvp_b, dks, dvs);
        compare(dqkv.block(b * N, 0, N, D), dq);
        compare(dkw.middleRows(b * cap, cap), dks);
        compare(dvw.middleRows(b * cap, cap), dvs);
        dkp.middleRows(p0, n) += dkp_b;
        dvp.middleRows(p0, n) += dvp_b;
    }
    if (prows > 0) {
        compare(dkv.leftCols(D), dkp);
        compare(dkv.rightCols(D), dvp);
    }
    if (ref_scale != nullptr) *ref_scale = big;
    return err / std::max(big, 1e-30);
}

}  // namespace

TEMPLATE_TEST_CASE("cuda attention train: host functors", "[cuda]", float, double) {
    using T = TestType;
    int caught = 0, offs = 0;
    for (int i = 0; i < 60; ++i) {
        Rng rng(seed_for("cuda attention train: host functors", static_cast<std::uint64_t>(i)));
        Rng again = rng;
        CHECK(note_error<T>("attention training host functors", functor_error<T>(rng, 0)) <=
              (std::is_same_v<T, double> ? 1e-13 : 1e-5));
        // The same draw with a window one row too long: seen unless no query's window is cut.
        const double off = functor_error<T>(again, 1);
        ++offs;
        caught += off > 1e-4 ? 1 : 0;
    }
    CHECK(caught >= offs / 3);
}

// MAC's segment attention reversed (Attention::segment_backward: attention_segment_backward.cuh,
// queries at stride 2 over the interleaved segment) against the CPU's (the host form, double):
// du, dh, the kept rows' adjoint, the attention's flat gradient and P's, added to what they held;
// every offset, with and without RoPE, a prefix and the later rows' adjoint, batches 1-3; in
// tiles and with the tiles off (a thread per query row, segment row and prefix row).
TEMPLATE_TEST_CASE("cuda attention train: segment backward", "[cuda]", float, double) {
    using T = TestType;
    for (const auto mode : {titans::backend::cuda::TiledAttentionMode::Auto,
                            titans::backend::cuda::TiledAttentionMode::Off}) {
        const TiledModeScope scope(mode);
        for (int i = 0; i < parity_cases(30); ++i) {
            Rng rng(seed_for("cuda attention train: segment backward", static_cast<std::uint64_t>(i)));
            const SegmentBackwardCase c = segment_backward_case(rng, i);
            INFO("case " << i << " tiles " << (mode == titans::backend::cuda::TiledAttentionMode::Auto)
                         << " B " << c.B << " C " << c.C << " o " << c.o << " m " << c.m
                         << " np " << c.P.rows() << " rope " << c.cfg.rope);
            const SegmentBackwardResult ref = run_segment_backward<double, titans::backend::Cpu>(c);
            const SegmentBackwardResult got = run_segment_backward<T, Cuda>(c);
            CHECK(note_error<T>("segment attention backward", segment_backward_error(got, ref, 1e-6)) <=
                  bound<T>());
            if (c.after_k.rows() > 0) {  // the comparison sees the later adjoint dropped
                SegmentBackwardCase off = c;
                off.after_k.resize(0, c.after_k.cols());
                off.after_v.resize(0, c.after_v.cols());
                CHECK(segment_backward_error(run_segment_backward<T, Cuda>(off), ref, 1e-6) > 1e-4);
            }
        }
    }
    // Segments of 24-48 tokens: parts of 18 rows and more in warp tiles (queries at stride 2
    // over the interleaved segment).
#if TITANS_CUDA_EMULATION
    const void* query = reinterpret_cast<const void*>(
        &titans::backend::cuda::warp_query_backward_kernel<T, false, 32>);
    const long before = cuda_emulation::launches(query);
#endif
    for (int i = 0; i < parity_cases(12); ++i) {
        Rng rng(seed_for("cuda attention train: long segments", static_cast<std::uint64_t>(i)));
        const SegmentBackwardCase c = segment_backward_case(rng, i, true);
        INFO("long case " << i << " B " << c.B << " C " << c.C << " o " << c.o << " m " << c.m
                          << " np " << c.P.rows() << " rope " << c.cfg.rope);
        CHECK(note_error<T>("segment attention backward",
                            segment_backward_error(run_segment_backward<T, Cuda>(c),
                                                   run_segment_backward<double, titans::backend::Cpu>(c),
                                                   1e-6)) <= bound<T>());
    }
#if TITANS_CUDA_EMULATION
    CHECK(cuda_emulation::launches(query) > before);
#endif
}
