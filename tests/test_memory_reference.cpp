// The library against the plain-loop reference (tests/reference/reference_memory.hpp), math §8:
//   - the chunked update (math §4/§5) against reference::chunk_start_loop in every mode,
//   - chunk = 1 and UpdateMode::PerToken against the true recurrence reference::per_token,
//   - in-chunk / lagged retrieval against memory_forward on weights materialised by streaming,
// in float and double, over random shapes and seeds, on the CPU and on the simulated device
// (tests/backends.hpp). Every check covers the outputs y, the Diagnostics (loss, grad_norm) and
// the weights and momentum of every (sequence, head).
#include "backends.hpp"

using namespace titans_test;
namespace ref = titans::reference;

// chunked update matches reference::chunk_start_loop in every mode: y, weights, momentum,
// diagnostics
TEMPLATE_LIST_TEST_CASE("memory: chunked == loop", "[reference][chunked]", Both) {
    using T = typename TestType::Scalar;
    using Backend = typename TestType::Backend;
    const std::vector<Modes> primary = chunked_primary_modes();  // 5 (gates, retrieval) pairs
    // Every (gates, retrieval) x 32 flag combinations, each twice with different shapes.
    const int combo = GENERATE(range(0, 2 * 5 * 32));
    const Modes m = with_flags(primary[static_cast<std::size_t>((combo / 32) % 5)], combo % 32);
    const Case c = make_case<T>(m, seed_for(std::string("chunked-vs-ref/") + type_name<T>(), combo));
    const ref::Result r = ref::chunk_start_loop(c.cfg, c.params, c.x, c.batch);
    const LibRun<T> lib = run_library<T, Backend>(c);
    check_against_reference(lib, r, c, "chunked vs chunk_start_loop");
}

// chunked update with chunk = 1 and the PerToken update both match the true per-token recurrence
// reference::per_token
TEMPLATE_LIST_TEST_CASE("memory: per-token == ref", "[reference][per-token]", Both) {
    using T = typename TestType::Scalar;
    using Backend = typename TestType::Backend;
    const int combo = GENERATE(range(0, 8 * 32));
    const int primary = combo / 32;
    Modes m;
    m.gates = (primary & 1) != 0 ? GateMode::Constant : GateMode::DataDependent;
    m.retrieval = (primary & 2) != 0 ? Retrieval::InChunk : Retrieval::Lagged;
    m.update = (primary & 4) != 0 ? UpdateMode::PerToken : UpdateMode::Chunked;
    m = with_flags(m, combo % 32);
    // Chunked runs with chunk 1; PerToken keeps its random chunk, which it must ignore.
    const Case c = make_case<T>(m, seed_for(std::string("per-token-vs-ref/") + type_name<T>(), combo),
                                Limits{}, [](Case& d) {
                                    if (d.cfg.update == UpdateMode::Chunked) d.cfg.chunk = 1;
                                });
    const ref::Result r = ref::per_token(c.cfg, c.params, c.x, c.batch);
    const LibRun<T> lib = run_library<T, Backend>(c);
    check_against_reference(lib, r, c,
                            m.update == UpdateMode::PerToken ? "PerToken vs per_token"
                                                             : "chunk=1 vs per_token");
}

// chunked update with chunk > 1 differs measurably from the per-token recurrence (the reference
// comparisons can fail)
TEST_CASE("memory: chunked != per-token", "[reference][sanity]") {
    for (int i = 0; i < 8; ++i) {
        Modes m;
        m.retrieval = (i & 1) != 0 ? Retrieval::InChunk : Retrieval::Lagged;
        m = with_flags(m, i * 5);
        const Case c = make_case<double>(
            m, seed_for("chunked-differs", static_cast<std::uint64_t>(i)),
            Limits{.max_tokens = 30, .max_batch = 2, .max_depth = 3}, [](Case& d) {
                d.cfg.chunk = 5;
                d.cfg.theta_max = 0.3;
                if (d.tokens < 12) {
                    d.tokens = 12;
                    Rng rng(d.seed);
                    d.x = random_matrix(d.batch * d.tokens, d.cfg.d_model, rng);
                }
            });
        INFO(c.describe());
        const LibRun<double> lib = run_library<double>(c);
        const ref::Result pt = ref::per_token(c.cfg, c.params, c.x, c.batch);
        const ref::Result cs = ref::chunk_start_loop(c.cfg, c.params, c.x, c.batch);
        CHECK(rel_error(lib.y, cs.y) <= tol<double>());
        CHECK(rel_error(lib.y, pt.y) > 1e-8);
        CHECK(rel_error(lib.weights[0][0], pt.weights[0][0]) > 1e-8);
    }
}

namespace {

/// Head outputs of the weights W (one list per head) for query row t of sequence q (N x D),
/// concatenated and projected by W_O: the math §5 output of token t, computed with
/// titans::memory_forward in double.
Matrixd output_from_weights(const MemoryConfig& cfg, const titans::MemoryParamsd& p,
                            const std::vector<std::vector<Matrixd>>& W_per_head,
                            const Matrixd& q, Eigen::Index t) {
    const int dh = cfg.head_dim();
    Matrixd yh(1, cfg.inner_dim());
    for (int h = 0; h < cfg.n_heads; ++h) {
        const Matrixd qh = q.block(t, h * dh, 1, dh);
        yh.middleCols(h * dh, dh) =
            titans::memory_forward<double>(W_per_head[static_cast<std::size_t>(h)], qh,
                                           cfg.activation, cfg.residual);
    }
    return yh * p.w_o;
}

}  // namespace

// InChunk output of token i equals memory_forward(W_i, q_i) with W_i from current_weights after
// streaming exactly i+1 tokens; Lagged reads the chunk-start weights
TEMPLATE_LIST_TEST_CASE("memory: InChunk reads W_i", "[reference][retrieval]", Both) {
    using T = typename TestType::Scalar;
    using Backend = typename TestType::Backend;
    const int combo = GENERATE(range(0, 36));
    const std::vector<Modes> primary = all_primary_modes();  // 9 valid (update, gates, retrieval)
    Rng pick_rng(seed_for("in-chunk-materialised-modes", static_cast<std::uint64_t>(combo)));
    const Modes m = random_flags(primary[static_cast<std::size_t>(combo) % primary.size()], pick_rng);
    const Case c = make_case<T>(
        m, seed_for(std::string("in-chunk-materialised/") + type_name<T>(), combo),
        Limits{.max_tokens = 20, .max_batch = 2, .max_depth = 3}, [combo](Case& d) {
            if (d.cfg.update == UpdateMode::Chunked && d.cfg.chunk == 1) {
                d.cfg.chunk = 3 + combo % 3;  // the interesting case: several tokens per chunk
            }
        });
    INFO(c.describe());
    const int B = c.batch, N = c.tokens, H = c.cfg.n_heads, eb = c.cfg.effective_chunk();
    const MemoryParams<T> pT = cast_params<T>(c.params);
    const Matrix<T> xT = c.x.cast<T>();
    NeuralMemory<T, Backend> mem(c.cfg, pT);

    // One call over everything.
    auto st_full = mem.make_state(B);
    const Matrix<T> y_full = mem.forward(st_full, xT);

    // Token by token, materialising W after every token: W_after[t][b][h] = weights after t tokens.
    std::vector<std::vector<std::vector<std::vector<Matrixd>>>> W_after;
    auto st = mem.make_state(B);
    auto snapshot = [&]() {
        std::vector<std::vector<std::vector<Matrixd>>> w(static_cast<std::size_t>(B));
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < H; ++h)
                w[static_cast<std::size_t>(b)].push_back(cast_layers<double>(mem.current_weights(st, b, h)));
        return w;
    };
    W_after.push_back(snapshot());
    for (int t = 0; t < N; ++t) {
        Matrix<T> piece(B, c.cfg.d_model);
        for (int b = 0; b < B; ++b) piece.row(b) = xT.row(b * N + t);
        (void)mem.forward(st, piece);
        W_after.push_back(snapshot());
    }

    double worst = 0.0;
    for (int b = 0; b < B; ++b) {
        const Matrixd xs = c.x.middleRows(static_cast<Eigen::Index>(b) * N, N);
        const ref::QKV qkv = ref::project_qkv(c.cfg, c.params, xs);
        for (int t = 0; t < N; ++t) {
            // InChunk: the weights after token t's own write; Lagged: the chunk-start weights.
            const int after = c.cfg.retrieval == Retrieval::InChunk ? t + 1 : (t / eb) * eb;
            const Matrixd expect = output_from_weights(
                c.cfg, c.params, W_after[static_cast<std::size_t>(after)][static_cast<std::size_t>(b)],
                qkv.q, t);
            const Matrixd got = y_full.row(b * N + t).template cast<double>();
            worst = std::max(worst, rel_error(got, expect));
        }
    }
    CHECK(note_error<T>("retrieval vs memory_forward(materialised W)", worst) <= tol<T>());

    // The materialised weights after the last token agree with the one-call state.
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
            CHECK(rel_error(cast_layers<double>(mem.current_weights(st_full, b, h)),
                            W_after.back()[static_cast<std::size_t>(b)][static_cast<std::size_t>(h)]) <= tol<T>());
}
