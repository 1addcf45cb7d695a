// The Titans compositions (math §6-7): Block<T> of every kind (LMM, MAC, MAG, MAL) against the
// plain whole-sequence reference of tests/reference/reference_blocks.hpp (block output, mixer
// output, memory state, position), causality, the order of MAC's memory write (y, not the block
// input), the window edges of MAG / MAL and what the persistent tokens can reach, streaming in
// pieces, Model<T> (a mixed stack with a vocabulary) and the error paths. The tests of behaviour
// run on the CPU and on the simulated device (tests/backends.hpp).
//
// Float tests draw parameters and inputs in double, round them to float, run the float library
// and compare with the double reference run on the rounded values cast back to double.
#include "backends.hpp"
#include "block_cases.hpp"

#include "reference/reference_blocks.hpp"

#include <limits>
#include <memory>
#include <string>
#include <vector>

using namespace titans_test;
using titans::AttentionConfig;
using titans::AttentionParams;
using titans::Block;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;
using titans::BlockState;
using titans::ConfigError;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::Model;
using titans::ModelConfig;
using titans::ModelParams;
using titans::NonFiniteError;
using titans::RowVectord;
using titans::ShapeError;

namespace {

constexpr BlockKind kAllKinds[] = {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL,
                                   BlockKind::SWA};
constexpr int kKinds = 5;


struct BlockCase {
    BlockConfig cfg;
    BlockParams<double> params;
    Matrixd x;
    int batch = 1;
    int tokens = 0;
    std::uint64_t seed = 0;

    [[nodiscard]] std::string describe() const {
        const MemoryConfig& m = cfg.memory;
        const AttentionConfig& a = cfg.attention;
        std::ostringstream os;
        os << "seed=" << seed << " kind=" << titans::to_string(cfg.kind) << " d=" << cfg.d_model
           << " | memory H=" << m.n_heads << " d_h=" << m.head_dim() << " depth=" << m.depth
           << " e=" << m.expansion << " act=" << titans::to_string(m.activation)
           << " residual=" << m.residual << " conv=" << m.use_conv << "(K=" << m.conv_kernel
           << ") qkv=" << titans::to_string(m.qkv_activation) << " norm=" << m.normalize_qk
           << " gates=" << titans::to_string(m.gates) << " update=" << titans::to_string(m.update)
           << " retrieval=" << titans::to_string(m.retrieval) << " chunk=" << m.chunk
           << " | attention H=" << a.n_heads << " d_h=" << a.head_dim() << " window=" << a.window
           << " rope=" << a.rope << "(" << a.rope_base << ") | segment=" << cfg.segment
           << " N_p=" << cfg.n_persistent << " ffn=" << cfg.use_ffn << "("
           << titans::to_string(cfg.ffn.kind) << ", h=" << cfg.ffn.hidden_dim() << ")"
           << " eps=" << cfg.norm_eps << " | B=" << batch << " N=" << tokens;
        return os.str();
    }
};

/// The reference's dynamics stay tame (finite, below `bound`): a diverging test-time memory
/// amplifies rounding without limit, so relative tolerances would say nothing there.
bool tame(const titans::reference::BlockResult& r, double bound = 100.0) {
    auto ok = [bound](const Matrixd& m) {
        return m.allFinite() && (m.size() == 0 || m.cwiseAbs().maxCoeff() <= bound);
    };
    if (!ok(r.out) || !ok(r.mix)) return false;
    for (const auto& per_b : r.weights)
        for (const auto& per_h : per_b)
            for (const Matrixd& w : per_h)
                if (!ok(w)) return false;
    return true;
}

/// Counts a case feature; printed at exit with TITANS_TEST_ERRORS=1 (shows what was covered).
void count_case(const std::string& what) {
    std::lock_guard<std::mutex> lock(error_log.mu);
    ++error_log.counts[what];
}

void count_coverage(const BlockConfig& c) {
    const std::string k = std::string("block cases ") + titans::to_string(c.kind) + ": ";
    count_case(k + "drawn");
    if (c.attention.rope && c.kind != BlockKind::LMM) count_case(k + "rope");
    if (c.n_persistent == 0) count_case(k + "N_p = 0");
    if (c.use_ffn) count_case(k + "ffn");
    if (c.memory.depth == 2) count_case(k + "depth 2");
    if (c.memory.retrieval == Retrieval::InChunk) count_case(k + "retrieval InChunk");
    if (c.memory.update == UpdateMode::PerToken) count_case(k + "update PerToken");
    if (c.memory.gates == GateMode::PerChunk) count_case(k + "gates PerChunk");
    if (c.memory.gates == GateMode::Constant) count_case(k + "gates Constant");
    if (c.memory.use_conv) count_case(k + "conv");
}

/// N in [lo, max] and not a multiple of the segment / window or of the memory chunk (> 1).
int draw_tokens(const BlockConfig& cfg, Rng& rng, int lo, int max_tokens) {
    const int span = cfg.kind == BlockKind::MAC ? cfg.segment : cfg.attention.window;
    const int chunk = cfg.memory.effective_chunk();
    for (int attempt = 0;; ++attempt) {
        const int n = uniform_int(rng, std::min(lo, max_tokens), max_tokens);
        if (attempt > 100) return n;
        if (n % span == 0) continue;
        if (chunk > 1 && n % chunk == 0) continue;
        return n;
    }
}

/// A random case (config, rounded parameters, rounded input (B*N) x d with N > span + 1 when
/// max_tokens allows), redrawn while the reference diverges.
template <class T>
BlockCase make_block_case(const BlockOptions& o, std::uint64_t seed) {
    for (int attempt = 0;; ++attempt) {
        Rng rng(seed);
        BlockCase c;
        c.seed = seed;
        c.cfg = random_block_config<T>(o, rng);
        c.params = random_block_params<T>(c.cfg, rng);
        c.batch = o.batch;
        c.tokens = draw_tokens(c.cfg, rng, c.cfg.segment + 2, o.max_tokens);
        c.x = round_through<T>(random_matrix(static_cast<Eigen::Index>(c.batch) * c.tokens,
                                             c.cfg.d_model, rng));
        if (attempt == 20 || tame(titans::reference::block_forward(c.cfg, c.params, c.x, c.batch))) {
            count_coverage(c.cfg);
            return c;
        }
        count_case("block cases redrawn (diverging reference dynamics)");
        seed = mix64(seed);
    }
}

// ---------------------------------------------------------------------------------------------
// Running the library.

template <class T>
using Weights = std::vector<std::vector<std::vector<Matrix<T>>>>;  // [b][h][l-1]

template <class T, class Bk>
Weights<T> block_weights(const Block<T, Bk>& blk, const BlockState<T, Bk>& st) {
    if (!titans::has_memory(blk.config().kind)) return {};  // SWA: none (the reference's too)
    Weights<T> w(static_cast<std::size_t>(st.batch()));
    for (int b = 0; b < st.batch(); ++b)
        for (int h = 0; h < blk.config().memory.n_heads; ++h)
            w[static_cast<std::size_t>(b)].push_back(blk.memory().current_weights(st.memory(), b, h));
    return w;
}

template <class T, class Bk>
Weights<T> memory_weights(const NeuralMemory<T, Bk>& mem,
                          const typename NeuralMemory<T, Bk>::State& st) {
    Weights<T> w(static_cast<std::size_t>(st.batch()));
    for (int b = 0; b < st.batch(); ++b)
        for (int h = 0; h < mem.config().n_heads; ++h)
            w[static_cast<std::size_t>(b)].push_back(mem.current_weights(st, b, h));
    return w;
}

/// Largest per-(b, h) rel_error of two weight sets.
template <class TA, class TB>
double weights_error(const Weights<TA>& a, const std::vector<std::vector<std::vector<Matrix<TB>>>>& b) {
    if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
    double e = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        if (a[i].size() != b[i].size()) return std::numeric_limits<double>::infinity();
        for (std::size_t h = 0; h < a[i].size(); ++h) e = std::max(e, rel_error(a[i][h], b[i][h]));
    }
    return e;
}


/// Largest |a - b| over row r.
template <class A, class B>
double row_diff(const A& a, const B& b, Eigen::Index r) {
    return (a.row(r).template cast<double>() - b.row(r).template cast<double>()).cwiseAbs().maxCoeff();
}

std::string kind_name(BlockKind k) { return titans::to_string(k); }

}  // namespace

// =============================================================================================
// Blocks against the reference.

// every block kind (LMM, MAC, MAG, MAL, SWA) equals the plain reference: block output, mixer output,
// memory state and position (B 1-2, with/without FFN, N_p 0/2, lagged/in-chunk retrieval, depth
// 1-2)
TEMPLATE_LIST_TEST_CASE("blocks: == reference", "[blocks]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    const int combo = GENERATE(range(0, 10 * kKinds));
    const BlockKind kind = kAllKinds[combo % kKinds];
    const int i = combo / kKinds;  // 0..9
    BlockOptions o;
    o.kind = kind;
    o.batch = 1 + (i & 1);
    o.use_ffn = ((i >> 1) & 1) == 0;
    o.n_persistent = ((i >> 2) & 1) == 0 ? 2 : 0;
    o.retrieval = ((i / 2 + i) % 2 == 0) ? Retrieval::Lagged : Retrieval::InChunk;
    const BlockCase c = make_block_case<T>(o, seed_for(std::string("blocks/reference/") + type_name<T>(),
                                                        static_cast<std::uint64_t>(combo)));
    INFO(c.describe());
    const std::string cat = kind_name(kind);

    const Block<T, Bk> blk(c.cfg, cast_block<T>(c.params));
    auto st = blk.make_state(c.batch);
    const Matrix<T> out = blk.forward(st, c.x.cast<T>());
    const titans::reference::BlockResult ref =
        titans::reference::block_forward(c.cfg, c.params, c.x, c.batch);
    CHECK(note_error<T>(cat + ": block output vs reference", rel_error(out, ref.out)) <= tol<T>());
    CHECK(note_error<T>(cat + ": memory weights vs reference",
                        weights_error(block_weights(blk, st), ref.weights)) <= tol<T>());
    CHECK(st.position() == c.tokens);
    CHECK(st.batch() == c.batch);

    // The mixer alone on the same normalised input (no residual to dilute its error).
    const Matrixd u = round_through<T>(ref.u);
    auto st_mix = blk.make_state(c.batch);
    const Matrix<T> o_mix = blk.mix(st_mix, u.cast<T>());
    const titans::reference::BlockResult ref_mix =
        titans::reference::block_mix(c.cfg, c.params, u, c.batch);
    CHECK(note_error<T>(cat + ": mixer output vs reference", rel_error(o_mix, ref_mix.mix)) <= tol<T>());
    CHECK(st_mix.position() == c.tokens);
    // The window edges w-1, w, w+1 (MAG / MAL) and the first rows of the second and third
    // segments (MAC) are rows of the comparison above (N > span + 1); check them by name too.
    const Eigen::Index span = kind == BlockKind::MAC ? c.cfg.segment : c.cfg.attention.window;
    const double scale = ref_mix.mix.cwiseAbs().maxCoeff();
    for (Eigen::Index t : {span - 1, span, span + 1}) {
        if (t >= c.tokens) continue;
        INFO("row " << t << " of sequence 0");
        CHECK(rel_error(o_mix.row(t), ref_mix.mix.row(t), scale) <= tol<T>());
    }
}

// BlockConfig::make sets every width and MAC's in-chunk retrieval; the seeded parameters have the
// documented shapes
TEMPLATE_TEST_CASE("blocks: make and shapes", "[blocks]", float, double) {
    using T = TestType;
    for (BlockKind kind : kAllKinds) {
        const BlockConfig c = BlockConfig::make(kind, 12, 2, 2, 5, 3);
        INFO(kind_name(kind));
        CHECK(c.memory.d_model == 12);
        CHECK(c.attention.d_model == 12);
        CHECK(c.ffn.d_model == 12);
        CHECK(c.memory.chunk == 3);
        CHECK(c.segment == 5);
        CHECK(c.attention.window == 5);
        CHECK(c.memory.retrieval == (kind == BlockKind::MAC ? Retrieval::InChunk : Retrieval::Lagged));
        const auto p = BlockParams<T>::random(c, 3);
        CHECK(p.persistent.rows() == (kind == BlockKind::LMM ? 0 : c.n_persistent));
        CHECK(p.norm_y.cols() == (kind == BlockKind::MAG ? 12 : 0));
        CHECK_NOTHROW(static_cast<void>(Block<T>(c, p)));
    }
}

// =============================================================================================
// Causality.

// every block kind is causal: perturbing token j of one sequence leaves every earlier output of it
// and the whole other sequence bit-for-bit unchanged
TEMPLATE_LIST_TEST_CASE("blocks: causal", "[blocks]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int combo = 0; combo < 2 * kKinds; ++combo) {
        BlockOptions o;
        o.kind = kAllKinds[combo % kKinds];
        o.batch = 2;
        o.use_ffn = combo < kKinds;
        o.n_persistent = 2;
        o.retrieval = combo % 3 == 0 ? Retrieval::InChunk : Retrieval::Lagged;
        o.max_tokens = 20;
        const BlockCase c = make_block_case<T>(o, seed_for(std::string("blocks/causality/") + type_name<T>(),
                                                            static_cast<std::uint64_t>(combo)));
        INFO(c.describe());
        Rng rng(c.seed + 17);
        const Block<T, Bk> blk(c.cfg, cast_block<T>(c.params));
        const Matrix<T> x = c.x.cast<T>();
        const int N = c.tokens;
        auto st = blk.make_state(2);
        const Matrix<T> out = blk.forward(st, x);
        for (int j : {0, uniform_int(rng, 1, N - 2), N - 1}) {
            for (int b : {0, 1}) {
                INFO("perturbed sequence " << b << " token " << j);
                Matrix<T> xj = x;
                xj.row(b * N + j).array() += T(0.5);
                auto sj = blk.make_state(2);
                const Matrix<T> outj = blk.forward(sj, xj);
                for (int t = 0; t < j; ++t) {
                    INFO("row " << t);
                    CHECK(identical(outj.row(b * N + t), out.row(b * N + t)));
                }
                CHECK(row_diff(outj, out, b * N + j) > 1e-3);  // the perturbed token itself
                const int other = 1 - b;
                CHECK(identical(outj.middleRows(other * N, N), out.middleRows(other * N, N)));
            }
        }
    }
}

// =============================================================================================
// MAC: the memory is written with the attention outputs y.

// MAC writes its memory with the attention outputs y: the block's memory state equals a separate
// NeuralMemory fed with the reference y, and differs from one fed with the block's normalised input
// u (or raw input x)
TEMPLATE_LIST_TEST_CASE("MAC: writes memory with y", "[blocks]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int i = 0; i < 6; ++i) {
        BlockOptions o;
        o.kind = BlockKind::MAC;
        o.batch = 1 + (i % 2);
        o.use_ffn = i % 3 != 0;
        o.n_persistent = i < 3 ? 2 : 0;
        o.retrieval = (i / 2) % 2 == 0 ? Retrieval::InChunk : Retrieval::Lagged;
        const BlockCase c = make_block_case<T>(o, seed_for(std::string("blocks/mac-order/") + type_name<T>(),
                                                            static_cast<std::uint64_t>(i)));
        INFO(c.describe());
        const Block<T, Bk> blk(c.cfg, cast_block<T>(c.params));
        auto st = blk.make_state(c.batch);
        (void)blk.forward(st, c.x.cast<T>());
        const Weights<T> lib = block_weights(blk, st);
        const auto ref = titans::reference::block_forward(c.cfg, c.params, c.x, c.batch);

        const NeuralMemory<T, Bk> mem(c.cfg.memory, cast_params<T>(c.params.memory));
        auto feed = [&](const Matrixd& input) {
            auto s = mem.make_state(c.batch);
            (void)mem.forward(s, input.cast<T>());
            return memory_weights(mem, s);
        };
        const double e_y = weights_error(lib, feed(ref.y));
        const double e_u = weights_error(lib, feed(ref.u));
        const double e_x = weights_error(lib, feed(c.x));
        note_error<T>("MAC: memory state vs NeuralMemory fed with reference y", e_y);
        CHECK(e_y <= tol<T>());
        CHECK(e_u > 1e-3);
        CHECK(e_x > 1e-3);
        // ... and the memory was written at all.
        Weights<T> init(static_cast<std::size_t>(c.batch));
        for (int b = 0; b < c.batch; ++b)
            for (const auto& w : c.params.memory.memory_init) init[static_cast<std::size_t>(b)].push_back(cast_layers<T>(w));
        CHECK(weights_error(lib, init) > 1e-3);
    }
}

// =============================================================================================
// MAG / MAL: window edges and the reach of the persistent tokens.

namespace {

/// A case whose memory never learns (constant gates, theta = 0, alpha = 0) and has no conv, so
/// that the memory output of a token depends on that token alone: what remains of the mixing is
/// the attention and its window.
template <class T>
BlockCase frozen_memory_case(BlockKind kind, std::uint64_t seed) {
    BlockOptions o;
    o.kind = kind;
    o.batch = 1;
    o.n_persistent = 2;
    o.use_ffn = true;
    BlockCase c = make_block_case<T>(o, seed);
    c.cfg.memory.gates = GateMode::Constant;
    c.cfg.memory.constant_theta = 0.0;
    c.cfg.memory.constant_alpha = 0.0;
    c.cfg.memory.use_conv = false;
    c.cfg.validate();
    return c;
}

template <class T, class Bk>
Matrix<T> run_once(const BlockCase& c, const BlockParams<double>& p, const Matrixd& x) {
    const Block<T, Bk> blk(c.cfg, cast_block<T>(p));
    auto st = blk.make_state(c.batch);
    return blk.forward(st, x.cast<T>());
}

}  // namespace

namespace {

/// With a frozen memory, perturbing token j (0, 1 and N-w-1) changes exactly the outputs
/// j .. j+w-1 of the block and leaves every other row bit-identical.
template <class T, class Bk>
void check_window_reach(const BlockCase& c, const Matrix<T>& out) {
    const int N = c.tokens, w = c.cfg.attention.window;
    for (int j : {0, 1, N - w - 1}) {
        Matrixd xj = c.x;
        xj.row(j).array() += 0.5;
        const Matrix<T> outj = run_once<T, Bk>(c, c.params, xj);
        for (int t = 0; t < N; ++t) {
            INFO("perturbed token " << j << ", row " << t);
            if (t < j || t >= j + w) {
                CHECK(identical(outj.row(t), out.row(t)));
            } else {
                CHECK(row_diff(outj, out, t) > 1e-6);
            }
        }
    }
}

}  // namespace

// MAG window edges: with a frozen memory, token j reaches exactly outputs j .. j+w-1; the
// persistent tokens reach every output, also after position w
TEMPLATE_LIST_TEST_CASE("MAG: window edges", "[blocks]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int i = 0; i < 3; ++i) {
        const BlockCase c = frozen_memory_case<T>(
            BlockKind::MAG, seed_for(std::string("blocks/mag-window/") + type_name<T>(), static_cast<std::uint64_t>(i)));
        INFO(c.describe());
        const int N = c.tokens, w = c.cfg.attention.window;
        REQUIRE(N > w + 1);
        const Matrix<T> out = run_once<T, Bk>(c, c.params, c.x);
        // The frozen-memory block still equals the reference (rows w-1, w, w+1 included).
        const auto ref = titans::reference::block_forward(c.cfg, c.params, c.x, c.batch);
        CHECK(note_error<T>("MAG frozen memory: block output vs reference", rel_error(out, ref.out)) <= tol<T>());
        check_window_reach<T, Bk>(c, out);
        // P is visible to every query: perturbing it changes every output, those after w too.
        BlockParams<double> pp = c.params;
        pp.persistent.array() += 0.5;
        pp = cast_block<double>(cast_block<T>(pp));
        const Matrix<T> out_p = run_once<T, Bk>(c, pp, c.x);
        for (int t = 0; t < N; ++t) {
            INFO("perturbed P, row " << t);
            CHECK(row_diff(out_p, out, t) > 1e-6);
        }
    }
}

// MAL window edges: with a frozen memory, token j reaches exactly outputs j .. j+w-1 and the
// persistent tokens (first positions of the window) reach exactly outputs 0 .. w-2; with a learning
// memory P reaches later outputs through the memory
TEMPLATE_LIST_TEST_CASE("MAL: window edges", "[blocks]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int i = 0; i < 3; ++i) {
        const BlockCase c = frozen_memory_case<T>(
            BlockKind::MAL, seed_for(std::string("blocks/mal-window/") + type_name<T>(), static_cast<std::uint64_t>(i)));
        INFO(c.describe());
        const int N = c.tokens, w = c.cfg.attention.window;
        REQUIRE(N > w + 1);
        const Matrix<T> out = run_once<T, Bk>(c, c.params, c.x);
        const auto ref = titans::reference::block_forward(c.cfg, c.params, c.x, c.batch);
        CHECK(note_error<T>("MAL frozen memory: block output vs reference", rel_error(out, ref.out)) <= tol<T>());
        check_window_reach<T, Bk>(c, out);
        // P sits at positions 0 .. N_p-1 of the window's sequence; token t at N_p + t sees
        // positions > N_p + t - w, so P's last row leaves the window at t = w - 1.
        BlockParams<double> pp = c.params;
        pp.persistent.array() += 0.5;
        pp = cast_block<double>(cast_block<T>(pp));
        const Matrix<T> out_p = run_once<T, Bk>(c, pp, c.x);
        for (int t = 0; t < N; ++t) {
            INFO("perturbed P, row " << t);
            if (t < w - 1) {
                CHECK(row_diff(out_p, out, t) > 1e-6);
            } else {
                CHECK(identical(out_p.row(t), out.row(t)));
            }
        }
        // A learning memory (theta > 0) carries P further than the window.
        BlockCase learn = c;
        learn.cfg.memory.constant_theta = round_scalar<T>(0.1);
        learn.cfg.memory.constant_eta = round_scalar<T>(0.5);
        const Matrix<T> lo = run_once<T, Bk>(learn, learn.params, learn.x);
        const Matrix<T> lp = run_once<T, Bk>(learn, pp, learn.x);
        double later = 0.0;
        for (int t = w - 1; t < N; ++t) later = std::max(later, row_diff(lp, lo, t));
        CHECK(later > 1e-6);
    }
}

// =============================================================================================
// Streaming.

// every block kind streamed token by token and in random pieces (empty pieces included) equals one
// call: outputs, memory state, position (B = 2)
TEMPLATE_LIST_TEST_CASE("blocks: streaming", "[blocks]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    const int combo = GENERATE(range(0, 3 * kKinds));
    BlockOptions o;
    o.kind = kAllKinds[combo % kKinds];
    o.batch = 2;
    o.use_ffn = (combo / kKinds) != 1;
    o.n_persistent = (combo / kKinds) == 2 ? 0 : 2;
    o.retrieval = combo % 3 == 0 ? Retrieval::Lagged : Retrieval::InChunk;
    const BlockCase c = make_block_case<T>(o, seed_for(std::string("blocks/streaming/") + type_name<T>(),
                                                        static_cast<std::uint64_t>(combo)));
    INFO(c.describe());
    const std::string cat = kind_name(o.kind);
    const int B = 2, N = c.tokens;
    const Block<T, Bk> blk(c.cfg, cast_block<T>(c.params));
    const Matrix<T> x = c.x.cast<T>();
    auto st_one = blk.make_state(B);
    const Matrix<T> one = blk.forward(st_one, x);
    REQUIRE(one.rows() == B * N);
    CHECK(st_one.position() == N);
    const Weights<T> w_one = block_weights(blk, st_one);

    Rng rng(c.seed + 99);
    const int span = o.kind == BlockKind::MAC ? c.cfg.segment : c.cfg.attention.window;
    std::vector<std::vector<int>> plans = {std::vector<int>(static_cast<std::size_t>(N), 1),
                                           random_pieces(rng, N, span), random_pieces(rng, N, span)};
    for (std::size_t k = 0; k < plans.size(); ++k) {
        std::ostringstream os;
        for (int len : plans[k]) os << len << ' ';
        INFO((k == 0 ? "token by token" : "pieces: ") << (k == 0 ? std::string() : os.str()));
        auto st = blk.make_state(B);
        Matrix<T> y = Matrix<T>::Constant(B * N, c.cfg.d_model, T(12345));
        int t0 = 0;
        for (int len : plans[k]) {
            const Matrix<T> yp = blk.forward(st, take_tokens(x, B, N, t0, t0 + len));
            REQUIRE(yp.rows() == B * len);
            REQUIRE(yp.cols() == c.cfg.d_model);
            put_tokens(y, yp, B, N, t0, t0 + len);
            t0 += len;
            CHECK(st.position() == t0);
        }
        REQUIRE(t0 == N);
        CHECK(note_error<T>(cat + ": streamed vs one call", rel_error(y, one)) <= tol<T>());
        CHECK(note_error<T>(cat + ": streamed memory state vs one call",
                            weights_error(block_weights(blk, st), w_one)) <= tol<T>());
    }
}

// serving: every block kind fed B = 64 streams one token per call equals one call over the
// whole streams (outputs, memory state), and each stream equals itself run alone (B = 1)
TEMPLATE_TEST_CASE("blocks: decode B=64", "[blocks]", float, double) {
    using T = TestType;
    const int combo = GENERATE(range(0, kKinds));
    BlockOptions o;
    o.kind = kAllKinds[combo];
    o.batch = 64;
    o.max_tokens = 12;
    o.retrieval = combo % 2 == 0 ? Retrieval::Lagged : Retrieval::InChunk;
    const BlockCase c = make_block_case<T>(o, seed_for(std::string("blocks/decode/") + type_name<T>(),
                                                        static_cast<std::uint64_t>(combo)));
    INFO(c.describe());
    const std::string cat = kind_name(o.kind);
    const int B = o.batch, N = c.tokens;
    const Block<T> blk(c.cfg, cast_block<T>(c.params));
    const Matrix<T> x = c.x.cast<T>();
    auto st_one = blk.make_state(B);
    const Matrix<T> one = blk.forward(st_one, x);
    auto st = blk.make_state(B);
    Matrix<T> y = Matrix<T>::Constant(B * N, c.cfg.d_model, T(12345));
    for (int t = 0; t < N; ++t) {
        put_tokens(y, blk.forward(st, take_tokens(x, B, N, t, t + 1)), B, N, t, t + 1);
    }
    CHECK(note_error<T>(cat + ": decode B=64 vs one call", rel_error(y, one)) <= tol<T>());
    CHECK(note_error<T>(cat + ": decode B=64 state vs one call",
                        weights_error(block_weights(blk, st), block_weights(blk, st_one))) <= tol<T>());
    for (int b : {0, 37, 63}) {  // a stream alone gives what it gave among 64
        auto st1 = blk.make_state(1);
        const Matrix<T> alone = blk.forward(st1, Matrix<T>(x.middleRows(b * N, N)));
        CHECK(note_error<T>(cat + ": one stream of 64 vs alone",
                            rel_error(y.middleRows(b * N, N), alone)) <= tol<T>());
    }
}

// =============================================================================================
// Model.


// Model (MAC then MAG, with a vocabulary): logits shape, forward_tokens equals forward on the
// embedded rows and the reference stack; streaming equals one call
TEMPLATE_LIST_TEST_CASE("Model: with vocabulary", "[model]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    for (int i = 0; i < 3; ++i) {
        Rng rng(seed_for(std::string("model/mixed/") + type_name<T>(), static_cast<std::uint64_t>(i)));
        const int vocab = 11, B = 2, N = uniform_int(rng, 9, 17);
        const ModelCase mc = make_model_case<T>(BlockKind::MAC, BlockKind::MAG, 8, vocab, 0, rng);
        INFO("case " << i << " N=" << N);
        const Model<T, Bk> model(mc.cfg, cast_model<T>(mc.params));
        REQUIRE(model.blocks().size() == 2);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);

        auto st = model.make_state(B);
        const Matrix<T> logits = model.forward_tokens(st, ids);
        REQUIRE(logits.rows() == B * N);
        REQUIRE(logits.cols() == vocab);
        CHECK(st.position == N);
        for (const auto& bs : st.blocks) CHECK(bs.position() == N);

        const Matrixd x = titans::reference::embed(mc.params, ids);
        auto st_x = model.make_state(B);
        CHECK(identical(model.forward(st_x, x.cast<T>()), logits));

        const Matrixd ref = titans::reference::model_forward(mc.cfg, mc.params, x, B);
        CHECK(note_error<T>("model (MAC, MAG): logits vs reference", rel_error(logits, ref)) <= tol<T>());

        // Streaming the ids in pieces.
        auto ss = model.make_state(B);
        Matrix<T> streamed = Matrix<T>::Constant(B * N, vocab, T(12345));
        int t0 = 0;
        for (int len : random_pieces(rng, N, 4)) {
            std::vector<int> piece;
            for (int b = 0; b < B; ++b)
                for (int t = t0; t < t0 + len; ++t) piece.push_back(ids[static_cast<std::size_t>(b * N + t)]);
            const Matrix<T> lp = model.forward_tokens(ss, piece);
            REQUIRE(lp.rows() == B * len);
            put_tokens(streamed, lp, B, N, t0, t0 + len);
            t0 += len;
            CHECK(ss.position == t0);
        }
        CHECK(note_error<T>("model (MAC, MAG): streamed vs one call", rel_error(streamed, logits)) <= tol<T>());
    }
}

// Model without a vocabulary (MAL then LMM, d_out 5): vectors in, d_out out, equal to the reference
// stack
TEMPLATE_LIST_TEST_CASE("Model: without vocabulary", "[model]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    Rng rng(seed_for(std::string("model/vectors/") + type_name<T>()));
    const int B = 2, N = 13;
    const ModelCase mc = make_model_case<T>(BlockKind::MAL, BlockKind::LMM, 12, 0, 5, rng);
    const Model<T, Bk> model(mc.cfg, cast_model<T>(mc.params));
    const Matrixd x = round_through<T>(random_matrix(B * N, 12, rng));
    auto st = model.make_state(B);
    const Matrix<T> y = model.forward(st, x.cast<T>());
    REQUIRE(y.rows() == B * N);
    REQUIRE(y.cols() == 5);
    CHECK(note_error<T>("model (MAL, LMM): output vs reference",
                        rel_error(y, titans::reference::model_forward(mc.cfg, mc.params, x, B))) <= tol<T>());
    CHECK(st.position == N);
}

// =============================================================================================
// Errors.

// Every weight is held once: the model owns its parameters, its blocks and their sub-layers
// refer to parts of them (same addresses), copies share them, and the same shared parameters
// give the same outputs as parameters passed by value; a null pointer is refused.
TEMPLATE_TEST_CASE("Model: parameters held once", "[model]", float, double) {
    using T = TestType;
    Rng rng(seed_for(std::string("model/shared/") + type_name<T>()));
    for (BlockKind kind : kAllKinds) {
        INFO("kind " << titans::to_string(kind));
        const ModelCase mc = make_model_case<T>(kind, BlockKind::MAG, 8, 7, 0, rng);
        const auto shared = std::make_shared<const ModelParams<T>>(cast_model<T>(mc.params));
        const Model<T> model(mc.cfg, shared);
        CHECK(&model.params() == shared.get());
        const Block<T>& blk = model.blocks()[0];
        const BlockParams<T>& bp = shared->blocks[0];
        CHECK(&blk.params() == &bp);
        const Model<T> copy = model;
        CHECK(&copy.blocks()[1].params() == &shared->blocks[1]);
        if (titans::has_memory(kind)) {
            CHECK(&blk.memory().params() == &bp.memory);
            CHECK(&copy.blocks()[0].memory().params() == &bp.memory);
        } else {  // an SWA block has no memory to hand out
            REQUIRE_THROWS_NAMING(blk.memory(), ConfigError, "SWA block has no memory");
        }
        CHECK(shared.use_count() > 4);  // the model, its blocks, their sub-layers, the copy

        const Model<T> by_value(mc.cfg, cast_model<T>(mc.params));
        CHECK(&by_value.params() != shared.get());
        const std::vector<int> ids = random_ids(rng, 2 * 9, 7);
        auto s1 = model.make_state(2);
        auto s2 = by_value.make_state(2);
        CHECK(identical(model.forward_tokens(s1, ids), by_value.forward_tokens(s2, ids)));
    }
    const auto cfg = BlockConfig::make(BlockKind::MAG, 8, 2, 2, 4, 4);
    CHECK_THROWS_AS(Block<T>(cfg, std::shared_ptr<const BlockParams<T>>()), ConfigError);
    CHECK_THROWS_AS(Model<T>(ModelConfig::uniform(BlockKind::LMM, 1, 8, 2, 2, 4),
                             std::shared_ptr<const ModelParams<T>>()),
                    ConfigError);
    CHECK_THROWS_AS(titans::NeuralMemory<T>(cfg.memory, std::shared_ptr<const titans::MemoryParams<T>>()),
                    ConfigError);
}

// block errors: BlockConfig, BlockParams and Block::forward / mix / make_state throw the right
// types and name the argument
TEMPLATE_TEST_CASE("block errors: arguments", "[blocks]", float, double) {
    using T = TestType;
    const T nan = std::numeric_limits<T>::quiet_NaN();
    // Configurations.
    const BlockConfig base = BlockConfig::make(BlockKind::MAC, 8, 2, 2, 4, 3);
    REQUIRE_NOTHROW(base.validate());
    {
        BlockConfig c = base;
        c.memory.d_model = 12;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "memory.d_model");
        REQUIRE_THROWS_NAMING((Block<T>(c, BlockParams<T>::random(base, 1))), ConfigError, "memory.d_model");
    }
    {
        BlockConfig c = base;
        c.attention.d_model = 12;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "attention.d_model");
    }
    {
        BlockConfig c = base;
        c.ffn.d_model = 4;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "ffn.d_model");
    }
    {
        BlockConfig c = base;
        c.segment = 0;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "segment");
        REQUIRE_THROWS_NAMING(BlockParams<T>::random(c, 1), ConfigError, "segment");
    }
    {
        BlockConfig c = BlockConfig::make(BlockKind::MAG, 8, 2, 2, 4, 3);
        c.n_persistent = -1;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "n_persistent");
    }
    for (double eps : {0.0, -1e-6}) {
        BlockConfig c = base;
        c.norm_eps = eps;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "norm_eps");
    }
    {
        BlockConfig c = base;
        c.d_model = 0;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "d_model");
    }
    {
        BlockConfig c = base;
        c.memory.chunk = 0;  // a bad nested field is reported by its own validate()
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "chunk");
    }

    // Parameters.
    const BlockConfig mag = BlockConfig::make(BlockKind::MAG, 8, 2, 2, 4, 3);
    const BlockParams<T> good = BlockParams<T>::random(mag, 2);
    REQUIRE_NOTHROW(static_cast<void>(Block<T>(mag, good)));
    {
        BlockParams<T> p = good;
        p.persistent = Matrix<T>::Zero(mag.n_persistent + 1, 8);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "persistent");
        p.persistent = Matrix<T>::Zero(mag.n_persistent, 7);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "persistent");
        p = good;
        p.persistent(0, 1) = nan;
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), NonFiniteError, "persistent");
    }
    {
        BlockParams<T> p = good;
        p.norm_mix = titans::RowVector<T>::Ones(7);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "norm_mix");
        p = good;
        p.norm_ffn = titans::RowVector<T>::Ones(9);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "norm_ffn");
        p = good;
        p.norm_y = titans::RowVector<T>();
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "norm_y");
        p = good;
        p.norm_m(0, 3) = nan;
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), NonFiniteError, "norm_m");
        p = good;
        p.memory.w_q = Matrix<T>::Zero(8, 3);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "w_q");
        p = good;
        p.attention.w_o = Matrix<T>::Zero(8, 9);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "w_o");
        p = good;
        p.ffn.w2 = Matrix<T>::Zero(3, 8);
        REQUIRE_THROWS_NAMING((Block<T>(mag, p)), ShapeError, "w2");
    }

    // forward / mix / make_state.
    for (BlockKind kind : kAllKinds) {
        INFO(kind_name(kind));
        const BlockConfig cfg = BlockConfig::make(kind, 8, 2, 2, 4, 3);
        const Block<T> blk(cfg, BlockParams<T>::random(cfg, 5));
        REQUIRE_THROWS_NAMING(blk.make_state(0), ConfigError, "batch");
        auto st = blk.make_state(2);
        REQUIRE_THROWS_NAMING(blk.forward(st, Matrix<T>::Zero(4, 9)), ShapeError, "x has 9 columns");
        REQUIRE_THROWS_NAMING(blk.forward(st, Matrix<T>::Zero(3, 8)), ShapeError,
                              "multiple of the state's batch");
        Matrix<T> xn = Matrix<T>::Ones(4, 8);
        xn(3, 2) = nan;
        REQUIRE_THROWS_NAMING(blk.forward(st, xn), NonFiniteError, "x has a NaN");
        xn(3, 2) = std::numeric_limits<T>::infinity();
        REQUIRE_THROWS_NAMING(blk.forward(st, xn), NonFiniteError, "x has a NaN or infinite");
        REQUIRE_THROWS_NAMING(blk.mix(st, Matrix<T>::Zero(4, 7)), ShapeError, "Block::mix");
        // A state of another kind, and a default-constructed one.
        const BlockKind other_kind = kind == BlockKind::MAG ? BlockKind::MAL : BlockKind::MAG;
        const BlockConfig ocfg = BlockConfig::make(other_kind, 8, 2, 2, 4, 3);
        auto st_other = Block<T>(ocfg, BlockParams<T>::random(ocfg, 5)).make_state(2);
        REQUIRE_THROWS_NAMING(blk.forward(st_other, Matrix<T>::Ones(4, 8)), ConfigError,
                              "state was made for a different block");
        REQUIRE_THROWS_NAMING(blk.mix(st_other, Matrix<T>::Ones(4, 8)), ConfigError, "Block::mix");
        BlockState<T> st_default;
        REQUIRE_THROWS_NAMING(blk.forward(st_default, Matrix<T>::Ones(4, 8)), ConfigError,
                              "state was made for a different block");
        CHECK(st.position() == 0);  // failed calls leave the state alone
        // The state still works after the failed calls.
        CHECK_NOTHROW(static_cast<void>(blk.forward(st, Matrix<T>::Ones(4, 8))));
        CHECK(st.position() == 2);
    }
}

// block errors: a state of a block of the same kind with another shape is rejected (MAG window, LMM
// memory, MAC segment)
TEMPLATE_TEST_CASE("block errors: state shape", "[blocks]", float, double) {
    using T = TestType;
    const Matrix<T> x = Matrix<T>::Ones(2, 8);
    {
        const BlockConfig a = BlockConfig::make(BlockKind::MAG, 8, 2, 2, 4, 3);
        const BlockConfig b = BlockConfig::make(BlockKind::MAG, 8, 2, 2, 5, 3);
        const Block<T> blk(a, BlockParams<T>::random(a, 1));
        auto st = Block<T>(b, BlockParams<T>::random(b, 1)).make_state(1);
        REQUIRE_THROWS_NAMING(blk.forward(st, x), ConfigError, "state");
    }
    {
        const BlockConfig a = BlockConfig::make(BlockKind::LMM, 8, 2, 2, 4, 3);
        const BlockConfig b = BlockConfig::make(BlockKind::LMM, 8, 2, 1, 4, 3);
        const Block<T> blk(a, BlockParams<T>::random(a, 1));
        auto st = Block<T>(b, BlockParams<T>::random(b, 1)).make_state(1);
        REQUIRE_THROWS_NAMING(blk.forward(st, x), ConfigError, "state");
    }
    {
        // Same widths, heads and memory; only the segment differs. The other block's segment is
        // the LONGER one, so that a library that does not check this reads no memory out of
        // bounds here (a shorter one would make it write past the end of its segment buffers).
        const BlockConfig a = BlockConfig::make(BlockKind::MAC, 8, 2, 2, 3, 3);
        const BlockConfig b = BlockConfig::make(BlockKind::MAC, 8, 2, 2, 6, 3);
        const Block<T> blk(a, BlockParams<T>::random(a, 1));
        auto st = Block<T>(b, BlockParams<T>::random(b, 1)).make_state(1);
        REQUIRE_THROWS_NAMING(blk.forward(st, x), ConfigError, "state");
    }
}

// model errors: token id out of range, forward_tokens without a vocabulary, mismatched or default
// states, bad ModelConfig / ModelParams
TEMPLATE_TEST_CASE("model errors: arguments", "[model]", float, double) {
    using T = TestType;
    ModelConfig cfg;
    cfg.vocab_size = 7;
    cfg.d_model = 8;
    cfg.blocks = {BlockConfig::make(BlockKind::MAC, 8, 2, 1, 3, 2), BlockConfig::make(BlockKind::MAG, 8, 2, 1, 3, 2)};
    const ModelParams<T> params = ModelParams<T>::random(cfg, 3);
    const Model<T> model(cfg, params);
    auto st = model.make_state(1);
    REQUIRE_THROWS_NAMING((model.forward_tokens(st, {1, 7})), ShapeError, "token id");
    REQUIRE_THROWS_NAMING((model.forward_tokens(st, {-1})), ShapeError, "token id");
    CHECK(st.position == 0);
    REQUIRE_THROWS_NAMING(model.make_state(0), ConfigError, "batch");
    REQUIRE_THROWS_NAMING(model.forward(st, Matrix<T>::Ones(2, 5)), ShapeError, "columns");

    // Without a vocabulary.
    ModelConfig vcfg = cfg;
    vcfg.vocab_size = 0;
    const Model<T> vmodel(vcfg, ModelParams<T>::random(vcfg, 3));
    auto vst = vmodel.make_state(1);
    REQUIRE_THROWS_NAMING((vmodel.forward_tokens(vst, {0, 1})), ConfigError, "vocab_size");

    // Mismatched states: other layer count, other kinds in the same count, default.
    ModelConfig one = cfg;
    one.blocks.pop_back();
    auto st_one = Model<T>(one, ModelParams<T>::random(one, 3)).make_state(1);
    REQUIRE_THROWS_NAMING((model.forward_tokens(st_one, {1, 2})), ConfigError, "different model");
    ModelConfig swapped = cfg;
    std::swap(swapped.blocks[0], swapped.blocks[1]);
    auto st_swapped = Model<T>(swapped, ModelParams<T>::random(swapped, 3)).make_state(1);
    REQUIRE_THROWS_NAMING((model.forward_tokens(st_swapped, {1, 2})), ConfigError, "different block");
    titans::ModelState<T> st_default;
    REQUIRE_THROWS_NAMING((model.forward_tokens(st_default, {1, 2})), ConfigError, "different model");

    // ModelConfig.
    {
        ModelConfig c = cfg;
        c.blocks.clear();
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "blocks.size()");
        c = cfg;
        c.blocks[1] = BlockConfig::make(BlockKind::MAG, 12, 2, 1, 3, 2);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "blocks[1].d_model");
        c = cfg;
        c.vocab_size = -1;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "vocab_size");
        c = cfg;
        c.norm_eps = 0.0;
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "norm_eps");
    }
    // ModelParams.
    {
        ModelParams<T> p = params;
        p.blocks.pop_back();
        REQUIRE_THROWS_NAMING((Model<T>(cfg, p)), ShapeError, "blocks");
        p = params;
        p.head = Matrix<T>::Zero(8, 6);
        REQUIRE_THROWS_NAMING((Model<T>(cfg, p)), ShapeError, "head");
        p = params;
        p.embedding = Matrix<T>::Zero(6, 8);
        REQUIRE_THROWS_NAMING((Model<T>(cfg, p)), ShapeError, "embedding");
        p = params;
        p.norm_final = titans::RowVector<T>::Ones(3);
        REQUIRE_THROWS_NAMING((Model<T>(cfg, p)), ShapeError, "norm_final");
        p = params;
        p.blocks[0].persistent(0, 0) = std::numeric_limits<T>::infinity();
        REQUIRE_THROWS_NAMING((Model<T>(cfg, p)), NonFiniteError, "persistent");
    }
}
