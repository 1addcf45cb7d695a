// The attention layer, every block kind and the model on the CUDA backend against the CPU
// backend (math §6-7): random widths, heads, windows and RoPE settings, every way of passing a
// prefix, random, constant, periodic, huge and tiny streams in random pieces (empty ones
// included), the kept window, transactions, the
// exact position of a non-finite output. CPU double is the reference: CUDA double within
// 1e-12, CUDA float within 1e-5 of the same problem rounded to float, run in double.

#include <titans/backend/cuda/cuda.cuh>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "block_cases.hpp"
#include "cuda_common.hpp"

namespace {

using namespace titans_test;
using titans::Attention;
using titans::PrefixSharing;
using titans::backend::Cuda;

/// A random attention configuration: width 4-24, heads 1-3, d_head derived or explicit (even
/// with RoPE), windows from 1 to beyond the stream.
AttentionConfig random_config(Rng& rng) {
    AttentionConfig c;
    c.n_heads = uniform_int(rng, 1, 3);
    c.rope = uniform_int(rng, 0, 1) == 1;
    if (uniform_int(rng, 0, 2) == 0) {
        c.d_head = c.rope ? 2 * uniform_int(rng, 1, 4) : uniform_int(rng, 1, 8);
        c.d_model = uniform_int(rng, 4, 24);
    } else {
        c.d_model = c.n_heads * (c.rope ? 2 * uniform_int(rng, 1, 4) : uniform_int(rng, 1, 8));
    }
    c.window = pick(rng, std::vector<int>{1, 2, 3, 5, 8, 16, 64});
    c.rope_base = pick(rng, std::vector<double>{10000.0, 100.0, 10.0});
    c.validate();
    return c;
}

/// Everything a case feeds both backends, rounded through T.
struct AttentionInputs {
    AttentionConfig cfg;
    AttentionParams<double> params;
    int B = 1, N = 1;
    Matrixd x, shared, per_seq, kp, vp;
};

template <class T>
AttentionInputs attention_inputs(Rng& rng, int index) {
    AttentionInputs in;
    in.cfg = random_config(rng);
    in.params = cast_attention<double>(
        cast_attention<T>(AttentionParams<double>::random(in.cfg, rng())));
    in.B = uniform_int(rng, 1, 3);
    in.N = uniform_int(rng, 1, 40);
    const int np = uniform_int(rng, 0, 4), d = in.cfg.d_model;
    // Float leaves out the huge streams: scores near 1e6 lose more than 1e-5 of the softmax to
    // float's own rounding of the inputs (the problem's conditioning, not the backend's).
    const int kind = std::is_same_v<T, float> && index % 5 == 3 ? 0 : index;
    in.x = round_through<T>(stream_kind(random_matrix(in.B * in.N, d, rng, -2.0, 2.0), in.B, kind));
    in.shared = round_through<T>(random_matrix(np, d, rng, -1.5, 1.5));
    in.per_seq = round_through<T>(random_matrix(in.B * np, d, rng, -1.5, 1.5));
    in.kp = round_through<T>(in.shared * in.params.w_k);
    in.vp = round_through<T>(in.shared * in.params.w_v);
    return in;
}

/// One piece through both layers, the prefix passed in way `mode` (none, shared rows,
/// per-sequence rows, projected once, the caller's projections).
template <class T>
void attention_piece(const Attention<double>& cpu, typename Attention<double>::State& sc,
                     const Attention<T, Cuda>& gpu, typename Attention<T, Cuda>::State& sg,
                     const AttentionInputs& in, const Matrixd& piece, int mode, Matrixd& yc,
                     Matrix<T>& yg) {
    const Matrix<T> p = piece.cast<T>(), sh = in.shared.cast<T>(), ps = in.per_seq.cast<T>();
    yg = Matrix<T>::Constant(p.rows(), p.cols(), std::numeric_limits<T>::quiet_NaN());
    switch (mode) {
        case 0:
            yc = cpu.forward(sc, piece);
            yg = gpu.forward(sg, p);
            break;
        case 1:
            cpu.forward(sc, piece, yc, &in.shared);
            gpu.forward(sg, p, yg, &sh);
            break;
        case 2:
            cpu.forward(sc, piece, yc, &in.per_seq, PrefixSharing::PerSequence);
            gpu.forward(sg, p, yg, &ps, PrefixSharing::PerSequence);
            break;
        case 3:
            cpu.forward(sc, piece, yc, cpu.project_prefix(in.shared));
            gpu.forward(sg, p, yg, gpu.project_prefix(sh));
            break;
        default:
            cpu.forward_projected(sc, piece, yc, in.kp, in.vp);
            gpu.forward_projected(sg, p, yg, in.kp.cast<T>(), in.vp.cast<T>());
            break;
    }
}

/// Largest relative difference of the kept windows (keys rotated, values) of every sequence.
template <class T>
double window_error(const typename Attention<double>::State& sc,
                    const typename Attention<T, Cuda>::State& sg) {
    double e = 0;
    for (int b = 0; b < sc.batch(); ++b) {
        e = std::max(e, rel_error(sg.keys(b).template cast<double>(), Matrixd(sc.keys(b))));
        e = std::max(e, rel_error(sg.values(b).template cast<double>(), Matrixd(sc.values(b))));
    }
    return e;
}

template <class T>
double attention_case(int index, double tol_) {
    Rng rng(seed_for(std::string("cuda attention ") + type_name<T>(),
                     static_cast<std::uint64_t>(index)));
    const AttentionInputs in = attention_inputs<T>(rng, index);
    const Attention<double> cpu(in.cfg, in.params);
    const Attention<T, Cuda> gpu(in.cfg, cast_attention<T>(in.params));
    auto sc = cpu.make_state(in.B);
    auto sg = gpu.make_state(in.B);
    INFO("case " << index << ": d " << in.cfg.d_model << " H " << in.cfg.n_heads << " d_h "
                 << in.cfg.head_dim() << " window " << in.cfg.window << " rope " << in.cfg.rope
                 << " B " << in.B << " N " << in.N << " prefix " << in.shared.rows());
    double worst = 0;
    int t0 = 0, call = index;
    for (int len : random_pieces(rng, in.N, in.cfg.window)) {
        Matrixd yc;
        Matrix<T> yg;
        const int mode = call++ % 5;
        attention_piece<T>(cpu, sc, gpu, sg, in, take_tokens(in.x, in.B, in.N, t0, t0 + len),
                           mode, yc, yg);
        const double e = rel_error(yg.template cast<double>(), yc);
        INFO("piece at " << t0 << " of " << len << " tokens, prefix mode " << mode);
        CHECK(e <= tol_);
        worst = std::max(worst, e);
        t0 += len;
    }
    REQUIRE(sg.position() == sc.position());
    REQUIRE(sg.kept_rows() == sc.keys(0).rows());
    const double ew = window_error<T>(sc, sg);
    CHECK(ew <= tol_);
    // Three calls rolled back together, then one more piece: as if they never ran.
    REQUIRE(gpu.begin(sg));
    for (int k = 0; k < 3; ++k) {
        (void)gpu.forward(sg, in.x.cast<T>());
    }
    gpu.rollback(sg);
    REQUIRE(sg.position() == sc.position());
    Matrixd yc;
    Matrix<T> yg;
    attention_piece<T>(cpu, sc, gpu, sg, in, in.x, 1, yc, yg);
    const double er = rel_error(yg.template cast<double>(), yc);
    CHECK(er <= tol_);
    return std::max({worst, ew, er});
}

template <class T>
void attention_sweep(int cases) {
    cases = parity_cases(cases);
    double worst = 0;
    for (int i = 0; i < cases; ++i) {
        worst = std::max(worst, attention_case<T>(i, bound<T>()));
    }
    std::printf("cuda attention (%s): %d cases, worst relative error %.3g (bound %.0e)\n",
                type_name<T>(), cases, worst, bound<T>());
}

}  // namespace

// The layer's sweep (pieces of 16 queries and more in warp tiles, d_h up to 8 padded to 32).
TEMPLATE_TEST_CASE("cuda attention: parity", "[cuda]", float, double) {
#if TITANS_CUDA_EMULATION
    const void* warp = reinterpret_cast<const void*>(
        &titans::backend::cuda::warp_tiled_attention_kernel<TestType, false, 32>);
    const long before = cuda_emulation::launches(warp);
#endif
    attention_sweep<TestType>(60);
#if TITANS_CUDA_EMULATION
    CHECK(cuda_emulation::launches(warp) > before);
#endif
}

// A token whose projections overflow: CUDA and the CPU in the same precision (float's 1e30
// would not overflow the double reference) throw the same NonFiniteError (the same sequence
// and position), and the GPU's state continues as if the call never ran.
TEMPLATE_TEST_CASE("cuda attention: non-finite", "[cuda]", float, double) {
    using T = TestType;
    Rng rng(seed_for(std::string("cuda attention non-finite ") + type_name<T>()));
    const AttentionConfig cfg{.d_model = 8, .n_heads = 2, .window = 4, .rope = true};
    const auto params = cast_attention<double>(
        cast_attention<T>(AttentionParams<double>::random(cfg, rng())));
    const Attention<double> cpu(cfg, params);
    const Attention<T> cpu_t(cfg, cast_attention<T>(params));
    const Attention<T, Cuda> gpu(cfg, cast_attention<T>(params));
    const int B = 3, N = 9;
    auto sc = cpu.make_state(B);
    auto st = cpu_t.make_state(B);
    auto sg = gpu.make_state(B);
    const Matrixd x0 = round_through<T>(random_matrix(B * N, 8, rng));
    CHECK(rel_error(gpu.forward(sg, x0.cast<T>()).template cast<double>(), cpu.forward(sc, x0)) <=
          bound<T>());
    (void)cpu_t.forward(st, x0.cast<T>());
    Matrixd bad = round_through<T>(random_matrix(B * N, 8, rng));
    bad.row(1 * N + 5).setConstant(std::is_same_v<T, float> ? 1e30 : 1e200);  // sequence 1
    const Matrix<T> bad_t = bad.cast<T>();
    const std::string cpu_message = nonfinite_message([&] { (void)cpu_t.forward(st, bad_t); });
    const std::string gpu_message = nonfinite_message([&] { (void)gpu.forward(sg, bad_t); });
    INFO("CPU: " << cpu_message << "\nCUDA: " << gpu_message);
    REQUIRE(cpu_message.find("sequence 1, position 14") != std::string::npos);
    CHECK(gpu_message == cpu_message);
    CHECK(sg.position() == N);
    const Matrixd x1 = round_through<T>(random_matrix(B * N, 8, rng));
    CHECK(rel_error(gpu.forward(sg, x1.cast<T>()).template cast<double>(), cpu.forward(sc, x1)) <=
          bound<T>());
    CHECK(window_error<T>(sc, sg) <= bound<T>());
}

// RoPE runs in the window append's launch (RopeThen, attention_row.hpp): a forward call with
// RoPE makes as many launches as the same call without it (counted by the emulator), in a
// piece of 40 rows and in a decoded token, and both match the CPU. A decoded token's keys and
// values go into the window from the scalar tiles' kernel itself (TiledAttentionArgs::k_win,
// RoPE there too): 2 kernels, the attention and the output's check.
TEMPLATE_TEST_CASE("cuda attention: RoPE in the append", "[cuda]", float, double) {
    using T = TestType;
    Rng rng(seed_for(std::string("cuda attention rope append ") + type_name<T>()));
    [[maybe_unused]] long launches[2][2] = {};
    for (int rope = 0; rope < 2; ++rope) {
        const AttentionConfig cfg{.d_model = 16, .n_heads = 2, .window = 8, .rope = rope == 1};
        const auto params = cast_attention<double>(
            cast_attention<T>(AttentionParams<double>::random(cfg, rng())));
        const Attention<double> cpu(cfg, params);
        const Attention<T, Cuda> gpu(cfg, cast_attention<T>(params));
        const int B = 2;
        auto sc = cpu.make_state(B);
        auto sg = gpu.make_state(B);
        for (int piece = 0; piece < 2; ++piece) {
            const int N = piece == 0 ? 40 : 1;
            const Matrixd x = round_through<T>(random_matrix(B * N, cfg.d_model, rng));
#if TITANS_CUDA_EMULATION
            const long k0 = cuda_emulation::total_launches();
#endif
            const Matrixd yg = gpu.forward(sg, x.cast<T>()).template cast<double>();
#if TITANS_CUDA_EMULATION
            launches[rope][piece] = cuda_emulation::total_launches() - k0;
#endif
            INFO("rope " << rope << " N " << N);
            CHECK(rel_error(yg, cpu.forward(sc, x)) <= bound<T>());
        }
    }
#if TITANS_CUDA_EMULATION
    CHECK(launches[1][0] == launches[0][0]);
    CHECK(launches[1][1] == launches[0][1]);
    CHECK(launches[1][1] == 2);
#endif
}

namespace {

/// The CPU reference run stayed tame (finite, below 100): a diverging test-time memory
/// amplifies float rounding without bound, so such draws compare nothing. An empty piece's
/// output (0 rows) is tame.
bool tame(const Matrixd& y) {
    return y.size() == 0 || (y.allFinite() && y.cwiseAbs().maxCoeff() <= 100.0);
}

/// x through both blocks in the same random pieces; the worst relative difference (or -1 for
/// an untame draw).
template <class T, class Cpu, class Gpu>
double stream_error(const Cpu& cpu, typename Cpu::State& sc, const Gpu& gpu,
                    typename Gpu::State& sg, const Matrixd& x, int B, int span, Rng& rng) {
    const int N = static_cast<int>(x.rows()) / B;
    double worst = 0;
    int t0 = 0;
    for (int len : random_pieces(rng, N, span)) {
        const Matrixd piece = take_tokens(x, B, N, t0, t0 + len);
        const Matrixd yc = cpu.forward(sc, piece);
        const Matrixd yg = gpu.forward(sg, piece.cast<T>()).template cast<double>();
        if (!tame(yc)) {
            return -1;
        }
        worst = std::max(worst, rel_error(yg, yc));
        t0 += len;
    }
    return worst;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda blocks: parity", "[cuda]", float, double) {
    using T = TestType;
    double worst = 0;
    int compared = 0;
    const int per_kind = parity_cases(8);
    for (BlockKind kind : titans::all_block_kinds) {
        for (int i = 0; i < per_kind; ++i) {
            Rng rng(seed_for(std::string("cuda blocks ") + type_name<T>() + titans::to_string(kind),
                             static_cast<std::uint64_t>(i)));
            BlockOptions o;
            o.kind = kind;
            o.use_ffn = i % 3 != 1;
            o.n_persistent = uniform_int(rng, 0, 3);
            o.retrieval = kind == BlockKind::MAC || i % 3 == 2 ? titans::Retrieval::InChunk
                                                               : titans::Retrieval::Lagged;
            const BlockConfig cfg = random_block_config<T>(o, rng);
            const BlockParams<double> params = random_block_params<T>(cfg, rng);
            const titans::Block<double> cpu(cfg, params);
            const titans::Block<T, Cuda> gpu(cfg, cast_block<T>(params));
            const int B = uniform_int(rng, 1, 3), N = uniform_int(rng, 5, 30);
            INFO(titans::to_string(kind) << " case " << i << " B " << B << " N " << N);
            auto sc = cpu.make_state(B);
            auto sg = gpu.make_state(B);
            const Matrixd x = round_through<T>(random_matrix(B * N, cfg.d_model, rng, -2.0, 2.0));
            const double e = stream_error<T>(cpu, sc, gpu, sg, x, B, cfg.segment, rng);
            if (e < 0) {
                continue;
            }
            CHECK(e <= bound<T>());
            // A rolled-back transaction, then the mixer alone and a copy advanced alone.
            REQUIRE(gpu.begin(sg));
            (void)gpu.forward(sg, x.cast<T>());
            gpu.rollback(sg);
            const Matrixd u = take_tokens(x, B, N, 0, 3);
            const Matrixd mc = cpu.mix(sc, u);
            const double em = rel_error(gpu.mix(sg, u.cast<T>()).template cast<double>(), mc);
            auto copy = sg;
            (void)gpu.forward(copy, x.cast<T>());
            CHECK(copy.position() == sg.position() + N);
            const Matrixd yc = cpu.forward(sc, x);
            const double ey = rel_error(gpu.forward(sg, x.cast<T>()).template cast<double>(), yc);
            if (tame(mc) && tame(yc)) {
                CHECK(em <= bound<T>());
                CHECK(ey <= bound<T>());
                worst = std::max({worst, e, em, ey});
                ++compared;
            }
        }
    }
    std::printf("cuda blocks (%s): %d of %d cases compared, worst relative error %.3g (bound %.0e)\n",
                type_name<T>(), compared, 5 * per_kind, worst, bound<T>());
    CHECK(4 * compared >= 3 * 5 * per_kind);  // three in four compared
}

TEMPLATE_TEST_CASE("cuda model: parity", "[cuda]", float, double) {
    using T = TestType;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM},
                                                      {BlockKind::MAG, BlockKind::MAC}};
    int compared = 0;  // comparisons made (a diverging draw compares nothing)
    for (std::size_t s = 0; s < 3; ++s) {
        Rng rng(seed_for(std::string("cuda model ") + type_name<T>(), s));
        const int vocab = 13, B = uniform_int(rng, 1, 3), N = uniform_int(rng, 6, 24);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const titans::Model<double> cpu(mc.cfg, mc.params);
        const titans::Model<T, Cuda> gpu(mc.cfg, cast_model<T>(mc.params));
        auto sc = cpu.make_state(B);
        auto sg = gpu.make_state(B);
        INFO("stack " << s << " B " << B << " N " << N);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        const Matrixd lc = cpu.forward_tokens(sc, ids);
        const Matrixd lg = gpu.forward_tokens(sg, ids).template cast<double>();
        if (tame(lc)) {
            CHECK(rel_error(lg, lc) <= bound<T>());
            ++compared;
        }
        const Matrixd x = round_through<T>(random_matrix(B * N, 8, rng));
        const double e = stream_error<T>(cpu, sc, gpu, sg, x, B, 4, rng);
        if (e >= 0) {
            CHECK(e <= bound<T>());
            ++compared;
        }
        CHECK(sg.position == sc.position);
    }
    CHECK(compared >= 3);
}

namespace {

/// One draw of tiled_attention's operands (host, rounded through T): n queries of B sequences,
/// each against a prefix (shared or per sequence) and its own m key rows, query t at key
/// position pos0 + stride t.
struct TiledCase {
    int B = 1, H = 1, dh = 1, window = 1;
    long long n = 1, p = 0, pos0 = 0, stride = 1, m = 1;
    bool shared = true;
    Matrixd q, kp, vp, ks, vs;  // q B n x D; kp, vp (shared ? p : B p) x D; ks, vs B m x D
};

/// Draws c's queries, keys and values at c's shape, rounded through T: entries within 1.5,
/// and for some indices peaked softmaxes (entries within 8); in float only at narrow heads
/// and not for gradients: at d_h 160 entries of 8 give scores near 200, whose own rounding
/// to float moves the softmax by ~1e-5, and a peaked softmax's dS = P (dP - delta) cancels
/// (delta ~ the dominant key's dP) to values near float's rounding of dP (the problem's
/// conditioning, not the kernel's; double takes them all).
template <class T>
void tiled_draw(Rng& rng, int index, bool gradients, TiledCase& c) {
    const long long D = static_cast<long long>(c.H) * c.dh;
    const bool peaked =
        index % 7 == 6 && (std::is_same_v<T, double> || (c.dh <= 17 && !gradients));
    const double big = peaked ? 8.0 : 1.5;
    c.q = round_through<T>(random_matrix(c.B * c.n, D, rng, -big, big));
    const long long pr = c.shared ? c.p : c.B * c.p;
    c.kp = round_through<T>(random_matrix(pr, D, rng, -big, big));
    c.vp = round_through<T>(random_matrix(pr, D, rng, -1.0, 1.0));
    c.ks = round_through<T>(random_matrix(c.B * c.m, D, rng, -big, big));
    c.vs = round_through<T>(random_matrix(c.B * c.m, D, rng, -1.0, 1.0));
}

template <class T>
TiledCase tiled_case(Rng& rng, int index, bool gradients = false) {
    TiledCase c;
    c.B = uniform_int(rng, 1, 3);
    c.H = uniform_int(rng, 1, 3);
    // Head widths around the tile sizes' limits: 64 (the headline), 1, odd, and wide ones that
    // shrink the tile (at 160: 16 x 16 in float, 8 x 8 in double).
    c.dh = pick(rng, std::vector<int>{1, 3, 8, 17, 64, 64, 100, 160});
    c.window = pick(rng, std::vector<int>{1, 2, 5, 16, 33, 64, 65, 200});
    c.n = pick(rng, std::vector<long long>{1, 2, 7, 16, 31, 64, 65, 100, 130});
    c.p = pick(rng, std::vector<long long>{0, 0, 1, 5, 64, 70});
    c.stride = index % 3 == 2 ? 2 : 1;  // MAC's interleaved segment: queries at odd positions
    c.pos0 = c.stride == 2 ? 2 * uniform_int(rng, 0, 20) + 1 : uniform_int(rng, 0, 90);
    c.m = c.pos0 + c.stride * (c.n - 1) + 1 + uniform_int(rng, 0, 3);  // rows past the last unread
    c.shared = uniform_int(rng, 0, 1) == 1;
    tiled_draw<T>(rng, index, gradients, c);
    return c;
}

/// A TiledCase's shape, for a failing check's message.
std::string describe(const TiledCase& c) {
    std::ostringstream o;
    o << "B " << c.B << " H " << c.H << " d_h " << c.dh << " window " << c.window << " n " << c.n
      << " p " << c.p << " shared " << c.shared << " pos0 " << c.pos0 << " stride " << c.stride;
    return o.str();
}

/// The CPU's prefix_window_attention per sequence, in double.
Matrixd tiled_reference(const TiledCase& c) {
    const long long D = static_cast<long long>(c.H) * c.dh;
    Matrixd out(c.B * c.n, D);
    for (int b = 0; b < c.B; ++b) {
        const long long p0 = c.shared ? 0 : b * c.p;
        titans::prefix_window_attention<double>(
            c.q.middleRows(b * c.n, c.n), c.kp.middleRows(p0, c.p), c.vp.middleRows(p0, c.p),
            c.ks.middleRows(b * c.m, c.m), c.vs.middleRows(b * c.m, c.m), c.H, c.dh, c.window,
            c.pos0, out.middleRows(b * c.n, c.n), c.stride);
    }
    return out;
}

/// Which kernel tiled_device runs: tiled_attention (Scalar), warp_tiled_attention, its
/// products in FMAs (Warp) or on the tensor cores (Tf32), or decode_split (Split: one query a
/// sequence at stride 1).
enum class TileKernel { Scalar, Warp, Tf32, Split };

/// The kernel `kind` on the device (tiled_attention in the shape tiled_shape picks); the output
/// rows, or an empty matrix where that kernel does not apply.
template <class T>
Matrix<T> tiled_device(const TiledCase& c, TileKernel kind = TileKernel::Scalar) {
    namespace cu = titans::backend::cuda;
    const cu::TiledShape shape = cu::tiled_shape(c.dh, c.n, sizeof(T));
    const bool fits = kind == TileKernel::Scalar ? shape.fits()
                      : kind == TileKernel::Split
                          ? c.n == 1 && c.stride == 1 && c.dh <= cu::decode_split_dh_max
                          : cu::warp_tiles_fit(c.B, c.n, c.H, c.dh, sizeof(T));
    if (!fits) {
        return {};
    }
    const long long D = static_cast<long long>(c.H) * c.dh;
    const auto up = [](const Matrixd& h) {
        const Matrix<T> t = h.cast<T>();
        // One entry at least: an empty prefix still passes a valid pointer it never reads.
        return t.size() == 0 ? cu::DeviceBuffer<T>(1)
                             : cu::upload_array(t.data(), static_cast<std::size_t>(t.size()));
    };
    const cu::DeviceBuffer<T> q = up(c.q), kp = up(c.kp), vp = up(c.vp), ks = up(c.ks),
                              vs = up(c.vs);
    cu::DeviceBuffer<T> o(static_cast<std::size_t>(c.B * c.n * D));
    const cu::TiledAttentionArgs<T> a{
        q.data(), D, kp.data(), vp.data(), c.p, D, D, c.shared, ks.data(), vs.data(), c.m, D,
        c.n, c.pos0, c.stride, c.H, c.dh, c.window,
        T(1) / std::sqrt(static_cast<T>(c.dh)), o.data(), D};
    if (kind == TileKernel::Scalar) {
        cu::tiled_attention(cu::thread_context().stream(), a, c.B, shape);
    } else if (kind == TileKernel::Split) {
        cu::decode_split(cu::thread_context().stream(), a, c.B);
    } else {
        cu::warp_tiled_attention(cu::thread_context().stream(), a, c.B, kind == TileKernel::Tf32);
    }
    Matrix<T> out(c.B * c.n, D);
    cu::check(cudaMemcpy(out.data(), o.data(), o.size() * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy (test)");
    return out;
}

}  // namespace

// The tiled kernel alone against the CPU's prefix_window_attention: head widths 1 to 160
// (tiles of 64 down to 8), windows shorter and longer than a tile, prefixes shared and per
// sequence, queries at stride 1 and at MAC's stride 2 from any position, pieces of 1 to 100
// queries (partial tiles).
TEMPLATE_TEST_CASE("cuda attention: tiled", "[cuda]", float, double) {
    using T = TestType;
    const int cases = parity_cases(40);
    double worst = 0;
    int ran = 0;
    for (int i = 0; i < cases; ++i) {
        Rng rng(seed_for(std::string("cuda tiled attention ") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const TiledCase c = tiled_case<T>(rng, i);
        INFO("case " << i << ": " << describe(c));
        const Matrix<T> got = tiled_device<T>(c);
        REQUIRE(got.size() > 0);  // every width drawn fits a tile
        const double e = rel_error(got.template cast<double>(), tiled_reference(c));
        CHECK(e <= bound<T>());
        worst = std::max(worst, e);
        ++ran;
    }
    std::printf("cuda tiled attention (%s): %d cases, worst relative error %.3g (bound %.0e)\n",
                type_name<T>(), ran, worst, bound<T>());
}

// The split-keys decode kernel alone (attention_decode.cuh) against the CPU's
// prefix_window_attention: the draws of "cuda attention: tiled" cut to one query a sequence at
// stride 1 (head widths 1 to 160, windows 1 to 200, prefixes of 0 to 70 rows shared and per
// sequence, positions 0 to 90: 1 to 6 spans of keys, merged by the block that finishes last),
// then a window of 1000 at position 900 (32 spans at B = 1, H = 1; 5 at B 3, H 3) and a head of
// 256 (8 entries a lane); each twice, the same bits (the counters back at zero).
TEMPLATE_TEST_CASE("cuda attention: split decode", "[cuda]", float, double) {
    using T = TestType;
    const int cases = parity_cases(40);
    double worst = 0;
    for (int i = 0; i < cases + 2; ++i) {
        Rng rng(seed_for(std::string("cuda split decode ") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        TiledCase c = tiled_case<T>(rng, i);
        c.n = 1;
        c.stride = 1;
        if (i >= cases) {  // the long window, then the wide head
            c.B = c.H = i == cases ? 1 : 3;
            c.window = 1000;
            c.pos0 = 900;
            c.dh = i == cases ? 64 : 256;
        }
        c.m = c.pos0 + 1 + uniform_int(rng, 0, 3);
        tiled_draw<T>(rng, i, /*gradients=*/false, c);  // at the one-query shape, peaked too
        INFO("case " << i << ": " << describe(c));
        const Matrix<T> got = tiled_device<T>(c, TileKernel::Split);
        REQUIRE(got.size() > 0);
        const double e = rel_error(got.template cast<double>(), tiled_reference(c));
        CHECK(e <= bound<T>());
        CHECK(tiled_device<T>(c, TileKernel::Split) == got);
        worst = std::max(worst, e);
    }
    std::printf("cuda split decode (%s): %d cases, worst relative error %.3g (bound %.0e)\n",
                type_name<T>(), cases + 2, worst, bound<T>());
}

// The attention layer decoding with the split-keys kernel on (set_split_decode) against the
// CPU: random configurations (RoPE or not, windows 1 to 64, d_h 1 to 8) and a window of 100
// (up to 4 spans), the prefix passed every way, B 1-3, streams of every kind (drawn, constant,
// periodic, x 1e3 in double, x 1e-6), 40 to 130 tokens one at a time (the
// kernel appends each token's rotated key and value itself: the kept window compared too),
// then a piece of 3 (the tiles again); one launch a token's attention, as with the tiles;
// and heads of 256 with the tiles switched off (the split kernel runs all the same, its one
// launch where the plain path appends, then attends).
TEMPLATE_TEST_CASE("cuda attention: split decode layer", "[cuda]", float, double) {
    using T = TestType;
    namespace cu = titans::backend::cuda;
    struct Split {
        bool was = cu::split_decode();
        explicit Split(bool on) { cu::set_split_decode(on); }
        ~Split() { cu::set_split_decode(was); }
    };
    for (int index = 0; index < 7; ++index) {
        Rng rng(seed_for(std::string("cuda split decode layer ") + type_name<T>(),
                         static_cast<std::uint64_t>(index)));
        AttentionInputs in = attention_inputs<T>(rng, index % 5 == 3 ? 0 : index);
        const int tokens = index == 5 ? 130 : index == 6 ? 24 : 40;
        if (index == 5) {
            in.cfg.window = 100;
        }
        if (index == 6) {  // heads of 256, the tiles switched off (below)
            in.cfg.n_heads = 2;
            in.cfg.d_head = 256;
            in.cfg.window = 16;
            in.params = cast_attention<double>(
                cast_attention<T>(AttentionParams<double>::random(in.cfg, rng())));
            in.kp = round_through<T>(in.shared * in.params.w_k);
            in.vp = round_through<T>(in.shared * in.params.w_v);
        }
        struct TileMode {  // the tiles off for case 6: the split kernel runs all the same
            cu::TiledAttentionMode was = cu::tiled_attention();
            explicit TileMode(bool off) {
                if (off) cu::set_tiled_attention(cu::TiledAttentionMode::Off);
            }
            ~TileMode() { cu::set_tiled_attention(was); }
        };
        const bool tiles = index != 6;
        const TileMode mode(!tiles);
        const Attention<double> cpu(in.cfg, in.params);
        const Attention<T, Cuda> gpu(in.cfg, cast_attention<T>(in.params));
        auto sc = cpu.make_state(in.B);
        auto sg = gpu.make_state(in.B), plain = gpu.make_state(in.B);
        // The whole stream drawn at once as the kind index % 5 (drawn, constant, periodic, x 1e3,
        // x 1e-6; float without the huge one, as in attention_inputs): sequence b's token t is
        // row b (tokens + 3) + t.
        const int len = tokens + 3, kind = std::is_same_v<T, float> && index % 5 == 3 ? 0 : index;
        const Matrixd xs = round_through<T>(stream_kind(
            random_matrix(in.B * len, in.cfg.d_model, rng, -2.0, 2.0), in.B, kind));
        INFO("case " << index << ": d_h " << in.cfg.head_dim() << " H " << in.cfg.n_heads
                     << " window " << in.cfg.window << " rope " << in.cfg.rope << " B "
                     << in.B << " prefix " << in.shared.rows());
        double worst = 0;
        for (int t = 0; t <= tokens; ++t) {
            const int N = t == tokens ? 3 : 1;
            Matrixd x(in.B * N, in.cfg.d_model);
            for (int b = 0; b < in.B; ++b) {
                x.middleRows(b * N, N) = xs.middleRows(b * len + t, N);
            }
            Matrixd yc;
            Matrix<T> yg, yp;
            const long s0 = cu::decode_split_launches();
#if TITANS_CUDA_EMULATION
            const long k0 = cuda_emulation::total_launches();
#endif
            {
                const Split on(true);
                attention_piece<T>(cpu, sc, gpu, sg, in, x, t % 5, yc, yg);
            }
#if TITANS_CUDA_EMULATION
            const long k1 = cuda_emulation::total_launches();
#endif
            {
                const Split off(false);
                Matrixd unused;
                auto scratch = cpu.make_state(in.B);  // (the CPU's output is yc above)
                attention_piece<T>(cpu, scratch, gpu, plain, in, x, t % 5, unused, yp);
            }
#if TITANS_CUDA_EMULATION
            if (tiles || N > 1) {
                CHECK(k1 - k0 == cuda_emulation::total_launches() - k1);
            } else {  // the split kernel's one launch; without tiles the plain path appends,
                      // then attends a thread per (row, head)
                CHECK(k1 - k0 < cuda_emulation::total_launches() - k1);
            }
#endif
            CHECK(cu::decode_split_launches() - s0 == (N == 1 ? 1 : 0));
            worst = std::max(worst, rel_error(yg.template cast<double>(), yc));
        }
        CHECK(worst <= bound<T>());
        CHECK(window_error<T>(sc, sg) <= bound<T>());
    }
}

// The split decode attention is on by default, as the process started (the tests that switch
// it restore it; TITANS_SPLIT_DECODE=0 starts it off), and env_switch's reading: the fallback
// where the variable is unset, else whether it is "1".
TEST_CASE("cuda attention: split decode by default", "[cuda]") {
    namespace cu = titans::backend::cuda;
    const char* env = std::getenv("TITANS_SPLIT_DECODE");
    CHECK(cu::split_decode() == (env == nullptr || std::string(env) == "1"));
    const char* name = "TITANS_TEST_SWITCH_NEVER_SET";
    ::unsetenv(name);
    CHECK(cu::env_switch(name, true));
    CHECK_FALSE(cu::env_switch(name));
    ::setenv(name, "0", 1);
    CHECK_FALSE(cu::env_switch(name, true));
    ::setenv(name, "1", 1);
    CHECK(cu::env_switch(name));
    CHECK(cu::env_switch(name, true));
    ::unsetenv(name);
}

// The warp-tiled kernel alone against the CPU on the draws of "cuda attention: tiled" (those of
// 16 queries or more and d_h up to 128: 1 to 100, padded to 32, 64 or 128; pieces of one to
// three blocks of 64 queries, the last partial): FMAs within the parity bound, and in float on
// the tensor cores. TF32 rounds both products' operands to 10-bit mantissas (unit roundoff
// 2^-11 = 4.9e-4); a score s = scale q . k then moves by up to about 1e-3 scale sum |q_e k_e|,
// under 0.05 on these draws (|q|, |k| <= 1.5; peaked draws, whose scores reach 100, are left
// out), and the output by that times its own spread: the bound is 1e-2 (docs/cuda.md).
TEMPLATE_TEST_CASE("cuda attention: warp tiles", "[cuda]", float, double) {
    using T = TestType;
    const int cases = parity_cases(24);  // draws the kernel takes; others are drawn past
    double worst = 0, worst_tf32 = 0;
    int ran = 0;
    for (int i = 0; ran < cases && i < 4 * cases + 8; ++i) {
        Rng rng(seed_for(std::string("cuda warp-tiled attention ") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const TiledCase c = tiled_case<T>(rng, i, /*gradients=*/true);
        INFO("case " << i << ": " << describe(c));
        const Matrix<T> got = tiled_device<T>(c, TileKernel::Warp);
        if (got.size() == 0) {
            CHECK((c.n < 16 || c.dh > 128));
            continue;
        }
        const Matrixd ref = tiled_reference(c);
        const double e = rel_error(got.template cast<double>(), ref);
        CHECK(e <= bound<T>());
        worst = std::max(worst, e);
        if constexpr (std::is_same_v<T, float>) {
            const Matrix<T> tf = tiled_device<T>(c, TileKernel::Tf32);
            const double et = rel_error(tf.template cast<double>(), ref);
            CHECK(et <= 1e-2);
            CHECK((tf.array() != got.array()).any());  // the operands were rounded
            worst_tf32 = std::max(worst_tf32, et);
        }
        ++ran;
    }
    CHECK(ran == cases);
    std::printf("cuda warp-tiled attention (%s): %d cases, worst relative error %.3g (bound "
                "%.0e); TF32 %.3g (bound 1e-2)\n", type_name<T>(), ran, worst, bound<T>(),
                worst_tf32);
    namespace cu = titans::backend::cuda;
    CHECK(cu::warp_tile_width(17) == 32);
    CHECK(cu::warp_tile_width(64) == 64);
    CHECK(cu::warp_tile_width(129) == 0);
    CHECK(cu::warp_tiles_fit(1, 16, 1, 64, sizeof(T)));
    CHECK_FALSE(cu::warp_tiles_fit(1, 15, 1, 64, sizeof(T)));
    CHECK_FALSE(cu::warp_tiles_fit(1, 1000, 1, 129, sizeof(T)));
    CHECK_FALSE(cu::warp_tiles_fit(70000, 1000, 1, 64, sizeof(T)));
    CHECK(cu::warp_tile_bytes(128, sizeof(T)) <= 116 * 1024);
}

// FragmentRows (the warp tiles' A operands on the tensor cores: the forward's Q, in KOrder
// Pair; the backward's Q and dout, K and V): at() places a 16-row tile's entries one to one,
// and quad(g, k) at a lane's first k slot holds m(g, k), m(g + 8, k), m(g, kh), m(g + 8, kh)
// (kh its second slot): what the A fragment takes in slots 0-3, which the GPU loads as 16
// consecutive bytes (the emulation's products read m(r, k) entry by entry instead, so this is
// where the order is pinned); the lanes' quads at a k-step follow each other in lane order.
namespace {

template <titans::backend::cuda::KOrder O>
void check_fragment_rows(int width) {
    namespace cu = titans::backend::cuda;
    using F = cu::FragmentRows<float, O>;
    std::vector<float> at(static_cast<std::size_t>(16 * width));
    std::iota(at.begin(), at.end(), 0.0f);  // m(r, k) = the place it is stored at
    std::vector<int> hits(at.size(), 0);
    for (int r = 0; r < 16; ++r) {
        for (int k = 0; k < width; ++k) {
            const int place = F::at(r, k);
            REQUIRE((place >= 0 && place < 16 * width));
            ++hits[static_cast<std::size_t>(place)];
        }
    }
    CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
    const F m{at.data()};
    for (int k0 = 0; k0 < width; k0 += 8) {
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, q = lane % 4;
            const int k = cu::slot_k<O>(k0, q, 0), kh = cu::slot_k<O>(k0, q, 1);
            const cu::EntryQuad<float> v = m.quad(g, k);
            INFO("width " << width << " pairs " << (O == cu::KOrder::Pair) << " k0 " << k0
                          << " lane " << lane);
            CHECK(v.x[0] == m(g, k));
            CHECK(v.x[1] == m(g + 8, k));
            CHECK(v.x[2] == m(g, kh));
            CHECK(v.x[3] == m(g + 8, kh));
            CHECK(F::at(g, k) == 4 * (k0 / 8 * 32 + lane));
        }
    }
}

}  // namespace

TEST_CASE("cuda attention: fragment-ordered rows", "[cuda]") {
    for (const int width : {32, 64, 128}) {
        check_fragment_rows<titans::backend::cuda::KOrder::Pair>(width);
        check_fragment_rows<titans::backend::cuda::KOrder::Split>(width);
    }
}

// A NaN in a key, a query or a prefix value reaches exactly the (row, head) outputs the CPU's
// reach, on each of the warp tiles' paths. The TF32 forward rounds its weights without
// cvt.rna's guard for NaN (tf32_stored<T, TF32, true>), and the emulation's ex2 returns the GPU's canonical
// NaN, which that rounding turns into -0: a row's NaN has to come through its sum. The other
// outputs match the CPU as in "cuda attention: warp tiles".
TEMPLATE_TEST_CASE("cuda attention: warp tiles keep NaN", "[cuda]", float, double) {
    using T = TestType;
    Rng rng(seed_for(std::string("cuda warp tiles NaN ") + type_name<T>()));
    TiledCase c;
    c.B = 2, c.H = 2, c.dh = 64, c.window = 65, c.n = 130, c.p = 5, c.pos0 = 3;
    c.m = c.pos0 + c.n + 2;
    c.shared = false;
    tiled_draw<T>(rng, 0, false, c);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    c.ks(1 * c.m + 40, 1 * c.dh + 7) = nan;  // sequence 1's key at position 40, head 1
    c.q(0 * c.n + 100, 0 * c.dh + 3) = nan;  // sequence 0's query 100, head 0
    c.vp(0 * c.p + 2, 1 * c.dh + 60) = nan;  // sequence 0's prefix value 2, head 1
    const Matrixd ref = tiled_reference(c);
    std::vector<TileKernel> kinds{TileKernel::Warp};
    if constexpr (std::is_same_v<T, float>) {
        kinds.push_back(TileKernel::Tf32);
    }
    for (const TileKernel kind : kinds) {
        const Matrix<T> got = tiled_device<T>(c, kind);
        REQUIRE(got.rows() == ref.rows());
        Matrixd finite_got = got.template cast<double>(), finite_ref = ref;
        int nan_blocks = 0;
        for (Eigen::Index r = 0; r < ref.rows(); ++r) {
            for (int h = 0; h < c.H; ++h) {
                const bool want = ref.block(r, h * c.dh, 1, c.dh).hasNaN();
                INFO("row " << r << " head " << h << (kind == TileKernel::Tf32 ? " TF32" : ""));
                CHECK(got.block(r, h * c.dh, 1, c.dh).hasNaN() == want);
                if (want) {
                    ++nan_blocks;
                    finite_got.block(r, h * c.dh, 1, c.dh).setZero();
                    finite_ref.block(r, h * c.dh, 1, c.dh).setZero();
                }
            }
        }
        // sequence 0: query 100 in head 0 and all 130 rows in head 1; sequence 1: the 65 rows
        // whose window holds position 40 in head 1
        CHECK(nan_blocks == 1 + 130 + 65);
        CHECK(rel_error(finite_got, finite_ref) <= (kind == TileKernel::Tf32 ? 1e-2 : bound<T>()));
    }
}

// The layer with the tiles switched off (a thread per row and head), and with the scalar tiles
// only (no warp tiles), still matches the CPU,
// and the shapes: at the headline d_h 64, 32 x 32 tiles in float and 16 x 16 in double (48 KB);
// one query against a longer key tile for decode; none where even 8 x 8 does not fit.
TEMPLATE_TEST_CASE("cuda attention: per-row", "[cuda]", float, double) {
    namespace cu = titans::backend::cuda;
    using T = TestType;
    {
        const TiledModeScope off(cu::TiledAttentionMode::Off);
        attention_sweep<T>(12);
    }
    {
        const TiledModeScope scalar(cu::TiledAttentionMode::Scalar);
        attention_sweep<T>(12);
    }
    CHECK(cu::tiled_attention() == cu::TiledAttentionMode::Auto);
    const cu::TiledShape head = cu::tiled_shape(64, 1000, sizeof(T));
    CHECK(head.tk == (std::is_same_v<T, float> ? 32 : 16));
    CHECK(head.tq == head.tk);
    CHECK(static_cast<std::size_t>(cu::tiled_entries(head, 64)) * sizeof(T) <=
          cu::tiled_shared_limit);
    const cu::TiledShape decode = cu::tiled_shape(64, 1, sizeof(T));
    CHECK(decode.tq == 1);
    CHECK(decode.tk >= head.tk);
    CHECK_FALSE(cu::tiled_shape(1000, 10, sizeof(T)).fits());
}

namespace {

/// The gradients of a TiledCase's attention for dout: dq (B n x D), the prefix rows' dk, dv
/// (kp's rows: a shared prefix sums every sequence's) and the sequence rows' (B m x D).
struct TiledGrads {
    Matrixd dq, dkp, dvp, dks, dvs;
    Matrixd stats;  // the query pass's rows' maximum, 1 / sum, delta (B n H x 3)
};

/// Where the warp-tiled backward's softmax statistics come from: its own first pass
/// (Recompute), the warp-tiled forward (Forward, stats_ready), or the forward's with every
/// 1 / sum doubled (Doubled: a backward that reads them must change).
enum class StatsFrom { Recompute, Forward, Doubled };

/// The CPU's prefix_window_attention_backward per sequence, in double.
TiledGrads tiled_reference_backward(const TiledCase& c, const Matrixd& dout) {
    const long long D = static_cast<long long>(c.H) * c.dh;
    TiledGrads g{Matrixd(c.B * c.n, D), Matrixd::Zero(c.kp.rows(), D),
                 Matrixd::Zero(c.kp.rows(), D), Matrixd::Zero(c.B * c.m, D),
                 Matrixd::Zero(c.B * c.m, D), Matrixd()};
    for (int b = 0; b < c.B; ++b) {
        const long long p0 = c.shared ? 0 : b * c.p;
        Matrixd dq, dkp = Matrixd::Zero(c.p, D), dvp = Matrixd::Zero(c.p, D),
                    dks = Matrixd::Zero(c.m, D), dvs = Matrixd::Zero(c.m, D);
        titans::prefix_window_attention_backward<double>(
            c.q.middleRows(b * c.n, c.n), c.kp.middleRows(p0, c.p), c.vp.middleRows(p0, c.p),
            c.ks.middleRows(b * c.m, c.m), c.vs.middleRows(b * c.m, c.m), c.H, c.dh, c.window,
            c.pos0, dout.middleRows(b * c.n, c.n), dq, dkp, dvp, dks, dvs, c.stride);
        g.dq.middleRows(b * c.n, c.n) = dq;
        g.dkp.middleRows(p0, c.p) += dkp;
        g.dvp.middleRows(p0, c.p) += dvp;
        g.dks.middleRows(b * c.m, c.m) = dks;
        g.dvs.middleRows(b * c.m, c.m) = dvs;
    }
    return g;
}

/// The tiled forward, then the tiled backward's query pass and both key passes, on the device
/// in `shape`'s scalar tiles, or in warp tiles (kind Warp or Tf32); the gradients brought back
/// in double.
template <class T>
TiledGrads tiled_device_backward(const TiledCase& c, const Matrixd& dout,
                                 titans::backend::cuda::TiledShape shape,
                                 TileKernel kind = TileKernel::Scalar,
                                 StatsFrom from = StatsFrom::Recompute) {
    namespace cu = titans::backend::cuda;
    const long long D = static_cast<long long>(c.H) * c.dh;
    const auto up = [](const Matrixd& h) {
        const Matrix<T> t = h.cast<T>();
        return t.size() == 0 ? cu::DeviceBuffer<T>(1)
                             : cu::upload_array(t.data(), static_cast<std::size_t>(t.size()));
    };
    const auto down = [](const cu::DeviceBuffer<T>& d, long long rows, long long cols) {
        Matrix<T> h(rows, cols);
        if (h.size() > 0) {
            cu::check(cudaMemcpy(h.data(), d.data(), static_cast<std::size_t>(h.size()) * sizeof(T),
                                 cudaMemcpyDeviceToHost),
                      "cudaMemcpy (test)");
        }
        return Matrixd(h.template cast<double>());
    };
    const cu::DeviceBuffer<T> q = up(c.q), kp = up(c.kp), vp = up(c.vp), ks = up(c.ks),
                              vs = up(c.vs), g = up(dout);
    const auto rows = static_cast<std::size_t>(c.B * c.n);
    cu::DeviceBuffer<T> o(rows * D), stats(3 * rows * c.H), dq(rows * D),
        dkp(std::max<std::size_t>(1, c.kp.rows() * D)), dvp(dkp.size()),
        dks(static_cast<std::size_t>(c.B * c.m * D)), dvs(dks.size());
    cu::TiledAttentionArgs<T> f{
        q.data(), D, kp.data(), vp.data(), c.p, D, D, c.shared, ks.data(), vs.data(), c.m, D,
        c.n, c.pos0, c.stride, c.H, c.dh, c.window,
        T(1) / std::sqrt(static_cast<T>(c.dh)), o.data(), D};
    const cudaStream_t sm = cu::thread_context().stream();
    const long long n_stats = static_cast<long long>(rows) * c.H;
    if (from == StatsFrom::Recompute) {
        cu::tiled_attention(sm, f, c.B, cu::tiled_shape(c.dh, c.n, sizeof(T)));
    } else {
        f.stat_m = stats.data();
        f.stat_inv = stats.data() + n_stats;
        cu::warp_tiled_attention(sm, f, c.B, kind == TileKernel::Tf32);
        f.stat_m = f.stat_inv = nullptr;
    }
    if (from == StatsFrom::Doubled) {
        Matrixd st = down(stats, n_stats, 3);
        st.col(1) *= 2.0;
        const Matrix<T> t = st.cast<T>();
        cu::check(cudaMemcpy(stats.data(), t.data(), stats.size() * sizeof(T),
                             cudaMemcpyHostToDevice),
                  "cudaMemcpy (test)");
    }
    const cu::TiledBackwardArgs<T> a{f,
                                     g.data(),
                                     D,
                                     o.data(),
                                     D,
                                     stats.data(),
                                     stats.data() + n_stats,
                                     stats.data() + 2 * n_stats,
                                     from != StatsFrom::Recompute};
    if (kind == TileKernel::Scalar) {
        cu::tiled_query_backward(sm, a, c.B, shape, dq.data(), D);
        cu::tiled_key_backward(sm, a, c.B, shape, false,
                               cu::TiledKeyGrads<T>{dks.data(), dvs.data(), D});
        cu::tiled_key_backward(sm, a, c.B, shape, true,
                               cu::TiledKeyGrads<T>{dkp.data(), dvp.data(), D});
    } else {
        cu::warp_backward(sm, a, c.B, dq.data(), D, cu::TiledKeyGrads<T>{dks.data(), dvs.data(), D},
                          cu::TiledKeyGrads<T>{dkp.data(), dvp.data(), D},
                          kind == TileKernel::Tf32);
    }
    return TiledGrads{down(dq, c.B * c.n, D),   down(dkp, c.kp.rows(), D),
                      down(dvp, c.kp.rows(), D), down(dks, c.B * c.m, D),
                      down(dvs, c.B * c.m, D),   down(stats, n_stats, 3)};
}

}  // namespace

// The tiled backward alone against the CPU's prefix_window_attention_backward on the draws of
// "cuda attention: tiled" (strides 1 and 2, both prefix sharings, rows no query sees, which
// must come back 0): dq, the prefix rows' dk and dv (a shared prefix summed over the
// sequences) and the sequence rows'.
TEMPLATE_TEST_CASE("cuda attention: tiled backward", "[cuda]", float, double) {
    namespace cu = titans::backend::cuda;
    using T = TestType;
    const int cases = parity_cases(40);
    double worst = 0;
    int ran = 0;
    for (int i = 0; i < cases; ++i) {
        Rng rng(seed_for(std::string("cuda tiled attention backward ") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const TiledCase c = tiled_case<T>(rng, i, /*gradients=*/true);
        const Matrixd dout = round_through<T>(
            random_matrix(c.B * c.n, static_cast<long long>(c.H) * c.dh, rng, -1.0, 1.0));
        INFO("case " << i << ": " << describe(c));
        const cu::TiledShape shape = cu::tiled_backward_shape(c.dh, sizeof(T));
        if (!shape.fits()) {  // double at d_h 160: the per-row backward's case
            CHECK(c.dh > 100);
            continue;
        }
        const TiledGrads got = tiled_device_backward<T>(c, dout, shape);
        const TiledGrads ref = tiled_reference_backward(c, dout);
        const double e = std::max({rel_error(got.dq, ref.dq), rel_error(got.dkp, ref.dkp),
                                   rel_error(got.dvp, ref.dvp), rel_error(got.dks, ref.dks),
                                   rel_error(got.dvs, ref.dvs)});
        CHECK(e <= bound<T>());
        worst = std::max(worst, e);
        ++ran;
    }
    CHECK(ran >= cases / 2);
    std::printf("cuda tiled attention backward (%s): %d cases, worst relative error %.3g (bound "
                "%.0e)\n", type_name<T>(), ran, worst, bound<T>());
    // The shapes: both passes fit 48 KB (d_h 64: 16 x 16 in float, 8 x 8 in double; d_h 160:
    // 8 x 8 in float, none in double), none at d_h 1000.
    const cu::TiledShape head = cu::tiled_backward_shape(64, sizeof(T));
    CHECK(head.tq == (std::is_same_v<T, float> ? 16 : 8));
    CHECK(static_cast<std::size_t>(cu::tiled_key_entries(head, 64)) * sizeof(T) <=
          cu::tiled_shared_limit);
    CHECK(cu::tiled_backward_shape(160, sizeof(T)).fits() == std::is_same_v<T, float>);
    CHECK_FALSE(cu::tiled_backward_shape(1000, sizeof(T)).fits());
}

// The warp-tiled backward (attention_warp_tiles_backward.cuh) against the CPU on the draws of
// "cuda attention: tiled backward" that it takes (16 queries or more; d_h up to 128 in float,
// 64 in double): FMAs within the parity bound, and in float on the tensor cores within 1e-2
// (the forward's TF32 bound; docs/cuda.md). The sequence rows' gradients come back 0 where no
// query sees them.
TEMPLATE_TEST_CASE("cuda attention: warp tiles backward", "[cuda]", float, double) {
    namespace cu = titans::backend::cuda;
    using T = TestType;
    const int cases = parity_cases(24);  // draws the passes take; others are drawn past
    double worst = 0, worst_tf32 = 0;
    int ran = 0;
    for (int i = 0; ran < cases && i < 4 * cases + 8; ++i) {
        Rng rng(seed_for(std::string("cuda warp-tiled attention backward ") + type_name<T>(),
                         static_cast<std::uint64_t>(i)));
        const TiledCase c = tiled_case<T>(rng, i, /*gradients=*/true);
        const long long D = static_cast<long long>(c.H) * c.dh;
        const Matrixd dout = round_through<T>(random_matrix(c.B * c.n, D, rng, -1.0, 1.0));
        INFO("case " << i << ": " << describe(c));
        const cu::TiledAttentionArgs<T> f{nullptr, D, nullptr, nullptr, c.p, D, D, c.shared,
                                          nullptr, nullptr, c.m, D, c.n, c.pos0, c.stride, c.H,
                                          c.dh, c.window, T(1), nullptr, D};
        if (!cu::warp_backward_fits(f, c.B)) {
            CHECK((c.n < 16 || c.dh > (std::is_same_v<T, float> ? 128 : 64)));
            continue;
        }
        const TiledGrads ref = tiled_reference_backward(c, dout);
        // With window 1 and no prefix each query sees one key: P = 1, dS = scale (dP - delta)
        // = 0 exactly, and dq, dk are the rounding of dP - delta, which these kernels sum in
        // another order than delta (noise on both sides). Those are measured against the
        // size of the cancelling terms, scale d_h max|dout| max|v| max|q, k| (the floor).
        const double floor = c.window == 1 && c.p == 0
                                 ? c.dh * dout.cwiseAbs().maxCoeff() * c.vs.cwiseAbs().maxCoeff() *
                                       std::max(c.q.cwiseAbs().maxCoeff(),
                                                c.ks.cwiseAbs().maxCoeff()) /
                                       std::sqrt(static_cast<double>(c.dh))
                                 : 1e-30;
        const auto error = [&](const TiledGrads& got) {
            return std::max({rel_error(got.dq, ref.dq, floor), rel_error(got.dkp, ref.dkp),
                             rel_error(got.dvp, ref.dvp), rel_error(got.dks, ref.dks, floor),
                             rel_error(got.dvs, ref.dvs)});
        };
        const TiledGrads own = tiled_device_backward<T>(c, dout, {}, TileKernel::Warp);
        const double e = error(own);
        CHECK(e <= bound<T>());
        worst = std::max(worst, e);
        // The forward's statistics (stats_ready): the query pass's own to rounding, and the
        // backward reads them (doubling every 1 / sum moves dq).
        const TiledGrads fwd =
            tiled_device_backward<T>(c, dout, {}, TileKernel::Warp, StatsFrom::Forward);
        CHECK(rel_error(fwd.stats, own.stats) <= bound<T>());
        // In the scalar kernels' units (base e: the warp tiles' float softmax runs in base 2
        // and converts), since the arrays are shared with them.
        const cu::TiledShape scalar_shape = cu::tiled_backward_shape(c.dh, sizeof(T));
        if (scalar_shape.fits()) {
            const TiledGrads scalar = tiled_device_backward<T>(c, dout, scalar_shape);
            CHECK(rel_error(fwd.stats, scalar.stats) <= bound<T>());
            CHECK(rel_error(own.stats, scalar.stats) <= bound<T>());
        }
        CHECK(error(fwd) <= bound<T>());
        worst = std::max(worst, error(fwd));
        if (c.window > 1 || c.p > 0) {  // (with one key a query, dS is 0 whatever 1 / sum is)
            const TiledGrads doubled =
                tiled_device_backward<T>(c, dout, {}, TileKernel::Warp, StatsFrom::Doubled);
            CHECK(rel_error(doubled.dq, fwd.dq) > 0.1);
        }
        if constexpr (std::is_same_v<T, float>) {
            const double et = error(tiled_device_backward<T>(c, dout, {}, TileKernel::Tf32));
            CHECK(et <= 1e-2);
            CHECK(et > 2 * e);  // the operands were rounded to TF32
            worst_tf32 = std::max(worst_tf32, et);
        }
        ++ran;
    }
    CHECK(ran == cases);
    std::printf("cuda warp-tiled attention backward (%s): %d cases, worst relative error %.3g "
                "(bound %.0e); TF32 %.3g (bound 1e-2)\n", type_name<T>(), ran, worst, bound<T>(),
                worst_tf32);
    CHECK(cu::warp_backward_bytes(64, sizeof(T)) <= 116 * 1024);
    CHECK(cu::warp_backward_bytes(128, sizeof(T)) == (std::is_same_v<T, float> ? cu::WarpBackwardLayout<float, 128>::bytes : 0));
}

/// Which of the mask's edges a block of 64 queries (c.n, at c.pos0 step c.stride) meets with key
/// tiles of tk: a full window tile whose last key is one past a warp's first row (`late`), or
/// whose first key is one before a warp's last row's window (`early`), the rest of the tile in
/// range. Each must keep its mask (warp_tile_unmasked); one position off, the tile would skip it.
struct MaskEdges {
    bool late = false, early = false;
};
MaskEdges mask_edges(const TiledCase& c, long long tk) {
    MaskEdges e;
    const long long first = c.pos0, last = c.pos0 + c.stride * (c.n - 1);
    for (long long j0 = std::max(first - c.window + 1, 0LL); last + 1 - j0 >= tk; j0 += tk) {
        for (int w = 0; 16 * w < c.n; ++w) {
            const long long lo = first + c.stride * 16 * w, hi = lo + 15 * c.stride;
            e.late = e.late || (j0 + tk - 1 == lo + 1 && j0 > hi - c.window);
            e.early = e.early || (j0 == hi - c.window && j0 + tk - 1 <= lo);
        }
    }
    return e;
}

/// The same edges for the backward's key pass: blocks of 64 keys from key 0, a warp's 16 keys
/// against full tiles of tb queries from the first that may see the block (tiled_window_queries).
MaskEdges key_pass_edges(const TiledCase& c, long long tb) {
    MaskEdges e;
    for (long long j0 = 0; j0 < c.m; j0 += 64) {
        const long long nk = std::min(64LL, c.m - j0);
        const long long lo = j0 - c.pos0, hi = j0 + nk - 1 + c.window - 1 - c.pos0;
        const long long t1 = std::min(hi < 0 ? -1 : hi / c.stride, c.n - 1);
        const long long t0 = std::min(lo <= 0 ? 0 : (lo + c.stride - 1) / c.stride, t1 + 1);
        for (long long key0 = j0; key0 + 15 < j0 + nk; key0 += 16) {
            for (long long t = t0; t + tb <= t1 + 1; t += tb) {
                const long long first = c.pos0 + c.stride * t, last = first + c.stride * (tb - 1);
                e.late = e.late || (key0 + 15 == first + 1 && key0 > last - c.window);
                e.early = e.early || (key0 == last - c.window && key0 + 15 <= first);
            }
        }
    }
    return e;
}

// The warp tiles where a tile is one position from needing no mask (mask_edges,
// key_pass_edges): windows of 60 to 200 and starts of 0 to 130 searched for 64 queries at
// strides 1 and 2, and the first four shapes that meet each edge of the forward's key tiles,
// the backward query pass's and its key pass's run, forward and backward, against the CPU (a
// tile that wrongly skipped its mask lets a row see a key outside its window: errors near 1).
// d_h 8 (padded to 32): key tiles of 64, the backward's tiles 64 in float and 32 in double.
TEMPLATE_TEST_CASE("cuda attention: warp tiles at the mask's edges", "[cuda]", float, double) {
    namespace cu = titans::backend::cuda;
    using T = TestType;
    const int tk = cu::WarpTileLayout<T, 32>::tk, tb = cu::WarpBackwardLayout<T, 32>::tb;
    int hits[6] = {};  // late, early: forward, query pass, key pass
    double worst = 0;
    for (int stride = 1; stride <= 2; ++stride) {
        for (int window = 60; window <= 200; ++window) {
            for (long long pos0 = 0; pos0 <= 130; ++pos0) {
                TiledCase c;
                c.dh = 8, c.n = 64, c.window = window, c.pos0 = pos0, c.stride = stride;
                c.m = pos0 + stride * 63 + 1;
                const MaskEdges f = mask_edges(c, tk), b = mask_edges(c, tb),
                                k = key_pass_edges(c, tb);
                const bool want[6] = {f.late && hits[0] < 4, f.early && hits[1] < 4,
                                      b.late && hits[2] < 4, b.early && hits[3] < 4,
                                      k.late && hits[4] < 4, k.early && hits[5] < 4};
                if (std::none_of(want, want + 6, [](bool x) { return x; })) {
                    continue;
                }
                for (int i = 0; i < 6; ++i) {
                    hits[i] += want[i] ? 1 : 0;
                }
                Rng rng(seed_for("cuda attention mask edges", static_cast<std::uint64_t>(
                                                                  window * 1000 + pos0)));
                c.H = 2;
                tiled_draw<T>(rng, 0, true, c);
                INFO(describe(c));
                const Matrixd ref = tiled_reference(c);
                const double e =
                    rel_error(tiled_device<T>(c, TileKernel::Warp).template cast<double>(), ref);
                CHECK(e <= bound<T>());
                const Matrixd dout =
                    round_through<T>(random_matrix(c.n, 2 * c.dh, rng, -1.0, 1.0));
                const TiledGrads got = tiled_device_backward<T>(c, dout, {}, TileKernel::Warp);
                const TiledGrads cpu = tiled_reference_backward(c, dout);
                const double eb = std::max({rel_error(got.dq, cpu.dq), rel_error(got.dks, cpu.dks),
                                            rel_error(got.dvs, cpu.dvs)});
                CHECK(eb <= bound<T>());
                worst = std::max({worst, e, eb});
                if constexpr (std::is_same_v<T, float>) {
                    const Matrix<T> tf = tiled_device<T>(c, TileKernel::Tf32);
                    CHECK(rel_error(tf.template cast<double>(), ref) <= 1e-2);
                }
            }
        }
    }
    for (int i = 0; i < 6; ++i) {  // every edge was met
        CHECK(hits[i] == 4);
    }
    std::printf("cuda warp-tiled attention at the mask's edges (%s): worst relative error %.3g "
                "(bound %.0e)\n", type_name<T>(), worst, bound<T>());
}
