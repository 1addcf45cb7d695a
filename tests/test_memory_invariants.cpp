// Invariants of the update rule (math §3) and of the layer:
//   theta = 0 (alpha = 0) leaves the memory at memory_init and the momentum at 0, exactly;
//   alpha = 1 erases the past: M_t = S_t;
//   eta = 0 is plain online gradient descent with decay, checked step by step by hand;
//   eta = 0 with alpha = 1 (zero products in the chunk coefficients) still matches the reference;
//   sequences of a batch are independent; outputs are causal (Lagged and InChunk, chunk > 1);
//   the ablation switches (momentum, forget) fix their gate at 0 in every gate mode.
#include "test_common.hpp"

using namespace titans_test;
namespace ref = titans::reference;

namespace {

/// A case with constant gates set to (theta, eta, alpha) and the given update/retrieval.
Case constant_gate_case(const std::string& name, std::uint64_t index, UpdateMode update,
                        Retrieval retrieval, double theta, double eta, double alpha,
                        int chunk = 0) {
    Modes m;
    m.gates = GateMode::Constant;
    m.update = update;
    m.retrieval = retrieval;
    Rng rng(seed_for(name, index));
    m = random_flags(m, rng);
    return make_case<double>(m, rng(), Limits{.max_tokens = 24, .max_batch = 2, .max_depth = 3},
                             [=](Case& c) {
                                 c.cfg.constant_theta = theta;
                                 c.cfg.constant_eta = eta;
                                 c.cfg.constant_alpha = alpha;
                                 c.cfg.momentum = c.cfg.forget = true;  // the gates as given
                                 if (chunk > 0) c.cfg.chunk = chunk;
                             });
}

/// The three (update, retrieval) pairs every invariant is checked in.
struct UpdateRetrieval {
    UpdateMode update;
    Retrieval retrieval;
};
const UpdateRetrieval kUpdateRetrieval[] = {{UpdateMode::Chunked, Retrieval::Lagged},
                                            {UpdateMode::Chunked, Retrieval::InChunk},
                                            {UpdateMode::PerToken, Retrieval::Lagged},
                                            {UpdateMode::PerToken, Retrieval::InChunk}};

bool all_zero(const std::vector<Matrixd>& S) {
    for (const Matrixd& m : S)
        for (Eigen::Index i = 0; i < m.size(); ++i)
            if (m.data()[i] != 0.0) return false;
    return true;
}

bool identical_layers(const std::vector<Matrixd>& a, const std::vector<Matrixd>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t l = 0; l < a.size(); ++l)
        if (!identical(a[l], b[l])) return false;
    return true;
}

/// Head h's key or value row of token t of sequence b (reference projection).
Matrixd head_kv(const Case& c, int b, int h, int t, bool value) {
    const Matrixd xs = c.x.middleRows(static_cast<Eigen::Index>(b) * c.tokens, c.tokens);
    const ref::QKV p = ref::project_qkv(c.cfg, c.params, xs);
    return ref::head_row(value ? p.v : p.k, t, h, c.cfg.head_dim());
}

}  // namespace

// theta = 0 (alpha = 0) leaves current_weights == memory_init and momentum == 0 exactly, and every
// output reads memory_init
TEST_CASE("invariants: theta = 0 freezes", "[invariants]") {
    int index = 0;
    for (const auto& ur : kUpdateRetrieval) {
        for (int rep = 0; rep < 3; ++rep, ++index) {
            Rng rng(seed_for("theta-zero-eta", static_cast<std::uint64_t>(index)));
            Case c = constant_gate_case("theta-zero", static_cast<std::uint64_t>(index), ur.update,
                                        ur.retrieval, 0.0, uniform(rng, 0.0, 1.0), 0.0);
            INFO(c.describe());
            const LibRun<double> lib = run_library<double>(c);
            for (int b = 0; b < c.batch; ++b)
                for (int h = 0; h < c.cfg.n_heads; ++h) {
                    const auto bb = static_cast<std::size_t>(b), hh = static_cast<std::size_t>(h);
                    CHECK(identical_layers(lib.weights[bb][hh], c.params.memory_init[hh]));
                    CHECK(all_zero(lib.momentum[bb][hh]));
                }
            // Outputs: memory_init read at every query.
            const int dh = c.cfg.head_dim();
            double worst = 0.0;
            for (int b = 0; b < c.batch; ++b) {
                const Matrixd xs = c.x.middleRows(static_cast<Eigen::Index>(b) * c.tokens, c.tokens);
                const ref::QKV p = ref::project_qkv(c.cfg, c.params, xs);
                Matrixd yh(c.tokens, c.cfg.inner_dim());
                for (int h = 0; h < c.cfg.n_heads; ++h) {
                    const Matrixd qh = p.q.middleCols(h * dh, dh);
                    yh.middleCols(h * dh, dh) = titans::memory_forward<double>(
                        c.params.memory_init[static_cast<std::size_t>(h)], qh, c.cfg.activation,
                        c.cfg.residual);
                }
                const Matrixd expect = yh * c.params.w_o;
                worst = std::max(worst, rel_error(lib.y.middleRows(static_cast<Eigen::Index>(b) * c.tokens, c.tokens), expect));
            }
            CHECK(worst <= tol<double>());
        }
    }
}

// theta = 0 with alpha > 0 only decays the memory: W_t = (1 - alpha)^t W_0, S_t = 0
TEST_CASE("invariants: theta = 0 only decays", "[invariants]") {
    int index = 0;
    for (const auto& ur : kUpdateRetrieval) {
        Rng rng(seed_for("theta-zero-decay-gates", static_cast<std::uint64_t>(index)));
        const double alpha = uniform(rng, 0.01, 0.2);
        Case c = constant_gate_case("theta-zero-decay", static_cast<std::uint64_t>(index++),
                                    ur.update, ur.retrieval, 0.0, uniform(rng, 0.0, 1.0), alpha);
        INFO(c.describe());
        const LibRun<double> lib = run_library<double>(c);
        const double decay = std::pow(1.0 - alpha, c.tokens);
        for (int h = 0; h < c.cfg.n_heads; ++h) {
            std::vector<Matrixd> expect;
            for (const Matrixd& w : c.params.memory_init[static_cast<std::size_t>(h)]) expect.push_back(decay * w);
            CHECK(rel_error(lib.weights[0][static_cast<std::size_t>(h)], expect) <= tol<double>());
            CHECK(all_zero(lib.momentum[0][static_cast<std::size_t>(h)]));
        }
    }
}

// alpha = 1 erases the past: current_weights == current_momentum (M_t = S_t) in every
// update/retrieval mode, and the run matches the reference
TEST_CASE("invariants: alpha = 1 erases past", "[invariants]") {
    int index = 0;
    for (const auto& ur : kUpdateRetrieval) {
        for (int rep = 0; rep < 3; ++rep, ++index) {
            Rng rng(seed_for("alpha-one-gates", static_cast<std::uint64_t>(index)));
            Case c = constant_gate_case("alpha-one", static_cast<std::uint64_t>(index), ur.update,
                                        ur.retrieval, uniform(rng, 0.02, 0.3),
                                        uniform(rng, 0.0, 1.0), 1.0);
            INFO(c.describe());
            const LibRun<double> lib = run_library<double>(c);
            for (int b = 0; b < c.batch; ++b)
                for (int h = 0; h < c.cfg.n_heads; ++h) {
                    const auto bb = static_cast<std::size_t>(b), hh = static_cast<std::size_t>(h);
                    CHECK(rel_error(lib.weights[bb][hh], lib.momentum[bb][hh]) <= tol<double>());
                    CHECK_FALSE(all_zero(lib.momentum[bb][hh]));
                }
            const ref::Result r = ur.update == UpdateMode::PerToken
                                      ? ref::per_token(c.cfg, c.params, c.x, c.batch)
                                      : ref::chunk_start_loop(c.cfg, c.params, c.x, c.batch);
            check_against_reference(lib, r, c, "alpha = 1 vs reference");
        }
    }
}

// eta = 0 is online gradient descent with decay: W_1 = (1 - alpha) W_0 - theta grad(W_0; k_1, v_1),
// and the next step uses the true gradient (PerToken) or the chunk-start gradient (Chunked)
TEST_CASE("invariants: eta = 0 is online GD", "[invariants]") {
    int index = 0;
    for (const auto& ur : kUpdateRetrieval) {
        for (int rep = 0; rep < 2; ++rep, ++index) {
            Rng rng(seed_for("eta-zero-gates", static_cast<std::uint64_t>(index)));
            const double theta = uniform(rng, 0.05, 0.5), alpha = uniform(rng, 0.0, 0.3);
            Case c = constant_gate_case("eta-zero", static_cast<std::uint64_t>(index), ur.update,
                                        ur.retrieval, theta, 0.0, alpha,
                                        ur.update == UpdateMode::Chunked ? 4 : 0);
            INFO(c.describe());
            REQUIRE(c.tokens >= 1);
            const titans::NeuralMemory<double> mem(c.cfg, c.params);
            const int B = c.batch, N = c.tokens;
            auto st = mem.make_state(B);
            auto tokens = [&](int t0, int t1) {
                Matrixd r(static_cast<Eigen::Index>(B) * (t1 - t0), c.cfg.d_model);
                for (int b = 0; b < B; ++b)
                    r.middleRows(static_cast<Eigen::Index>(b) * (t1 - t0), t1 - t0) =
                        c.x.middleRows(static_cast<Eigen::Index>(b) * N + t0, t1 - t0);
                return r;
            };
            const titans::Activation act = c.cfg.activation;
            const bool res = c.cfg.residual;
            for (int b = 0; b < B; ++b)
                for (int h = 0; h < c.cfg.n_heads; ++h) {
                    // Token 1 by hand.
                    const std::vector<Matrixd>& W0 = c.params.memory_init[static_cast<std::size_t>(h)];
                    const auto g0 = titans::associative_gradient<double>(W0, head_kv(c, b, h, 0, false),
                                                                         head_kv(c, b, h, 0, true), act, res);
                    // math §10: theta * min(1, c / ||g||_F) when max_grad_norm = c > 0.
                    auto clipped = [&](const std::vector<Matrixd>& g) {
                        double n2 = 0;
                        for (const Matrixd& m : g) n2 += m.squaredNorm();
                        const double c_max = c.cfg.max_grad_norm, n = std::sqrt(n2);
                        return c_max > 0 && n > c_max ? theta * c_max / n : theta;
                    };
                    const double th0 = clipped(g0);
                    std::vector<Matrixd> W1, S1;
                    for (std::size_t l = 0; l < W0.size(); ++l) {
                        W1.push_back((1.0 - alpha) * W0[l] - th0 * g0[l]);
                        S1.push_back(-th0 * g0[l]);
                    }
                    if (b == 0 && h == 0) (void)mem.forward(st, tokens(0, 1));
                    CHECK(note_error<double>("eta = 0: one step by hand",
                                             rel_error(mem.current_weights(st, b, h), W1)) <= tol<double>());
                    CHECK(rel_error(mem.current_momentum(st, b, h), S1) <= tol<double>());
                    if (N < 2) continue;
                    // Token 2: gradient at W_1 (true recurrence) or at W_0 (same chunk).
                    const std::vector<Matrixd>& Wg = ur.update == UpdateMode::PerToken ? W1 : W0;
                    const auto g1 = titans::associative_gradient<double>(Wg, head_kv(c, b, h, 1, false),
                                                                         head_kv(c, b, h, 1, true), act, res);
                    std::vector<Matrixd> W2;
                    const double th1 = clipped(g1);
                    for (std::size_t l = 0; l < W0.size(); ++l) W2.push_back((1.0 - alpha) * W1[l] - th1 * g1[l]);
                    auto st2 = st;
                    if (st2.position() == 1) (void)mem.forward(st2, tokens(1, 2));
                    CHECK(note_error<double>("eta = 0: two steps by hand",
                                             rel_error(mem.current_weights(st2, b, h), W2)) <= tol<double>());
                }
        }
    }
}

// chunked update with eta = 0 and alpha = 1 (zero products), and with eta = 1, alpha = 0, matches
// the reference without NaN
TEST_CASE("invariants: extreme gates no NaN", "[invariants]") {
    int index = 0;
    for (Retrieval ret : {Retrieval::Lagged, Retrieval::InChunk}) {
        for (auto [eta, alpha] : {std::pair{0.0, 1.0}, std::pair{1.0, 0.0}, std::pair{0.0, 0.0},
                                  std::pair{1.0, 1.0}}) {
            for (int chunk : {2, 5, 8}) {
                Rng rng(seed_for("extreme-gates-theta", static_cast<std::uint64_t>(index)));
                Case c = constant_gate_case("extreme-gates", static_cast<std::uint64_t>(index++),
                                            UpdateMode::Chunked, ret, uniform(rng, 0.02, 0.1), eta,
                                            alpha, chunk);
                INFO(c.describe() << " eta=" << eta << " alpha=" << alpha);
                const LibRun<double> lib = run_library<double>(c);
                CHECK(lib.y.allFinite());
                const ref::Result r = ref::chunk_start_loop(c.cfg, c.params, c.x, c.batch);
                check_against_reference(lib, r, c, "extreme gates vs chunk_start_loop");
            }
        }
    }
}

// sequences of a batch are independent: changing sequence 1 leaves the outputs, diagnostics and
// memory of sequences 0 and 2 unchanged
TEST_CASE("invariants: batch independence", "[invariants]") {
    const std::vector<Modes> primary = all_primary_modes();
    for (std::size_t i = 0; i < primary.size(); ++i) {
        Rng rng(seed_for("batch-independence", i));
        const Modes m = random_flags(primary[i], rng);
        Case c = make_case<double>(m, rng(), Limits{.max_tokens = 20, .max_batch = 1, .max_depth = 3});
        c.batch = 3;
        c.x = random_matrix(3 * c.tokens, c.cfg.d_model, rng);
        INFO(c.describe());
        const LibRun<double> a = run_library<double>(c);
        Case c2 = c;
        c2.x.middleRows(c.tokens, c.tokens) = random_matrix(c.tokens, c.cfg.d_model, rng);
        const LibRun<double> b = run_library<double>(c2);
        for (int s : {0, 2}) {
            const Eigen::Index r0 = static_cast<Eigen::Index>(s) * c.tokens;
            CHECK(identical(a.y.middleRows(r0, c.tokens), b.y.middleRows(r0, c.tokens)));
            CHECK(identical(a.diag.loss.middleRows(r0, c.tokens), b.diag.loss.middleRows(r0, c.tokens)));
            for (int h = 0; h < c.cfg.n_heads; ++h)
                CHECK(identical_layers(a.weights[static_cast<std::size_t>(s)][static_cast<std::size_t>(h)],
                                       b.weights[static_cast<std::size_t>(s)][static_cast<std::size_t>(h)]));
        }
        // ... while sequence 1 itself did change.
        CHECK_FALSE(identical(a.y.middleRows(c.tokens, c.tokens), b.y.middleRows(c.tokens, c.tokens)));
    }
}

// outputs are causal: changing token j leaves every output and diagnostic before j unchanged
// (Lagged and InChunk, chunk > 1, every gate mode, PerToken)
TEST_CASE("invariants: causal outputs", "[invariants]") {
    const std::vector<Modes> primary = all_primary_modes();
    for (std::size_t i = 0; i < 2 * primary.size(); ++i) {
        Rng rng(seed_for("causality", i));
        const Modes m = random_flags(primary[i % primary.size()], rng);
        const int chunk = pick(rng, std::vector<int>{3, 5, 8});
        Case c = make_case<double>(m, rng(), Limits{.max_tokens = 24, .max_batch = 2, .max_depth = 3},
                                   [chunk](Case& d) {
                                       if (d.cfg.update == UpdateMode::Chunked) d.cfg.chunk = chunk;
                                   });
        if (c.tokens < 3) {
            c.tokens = 17;
            c.x = random_matrix(static_cast<Eigen::Index>(c.batch) * c.tokens, c.cfg.d_model, rng);
        }
        // j inside a chunk (not at its start) when possible: the hard case for in-chunk reads.
        const int j = uniform_int(rng, 1, c.tokens - 1);
        INFO(c.describe() << " j=" << j);
        const LibRun<double> a = run_library<double>(c);
        Case c2 = c;
        for (int b = 0; b < c.batch; ++b) {
            c2.x.row(static_cast<Eigen::Index>(b) * c.tokens + j) = random_matrix(1, c.cfg.d_model, rng);
        }
        const LibRun<double> b2 = run_library<double>(c2);
        for (int b = 0; b < c.batch; ++b) {
            const Eigen::Index r0 = static_cast<Eigen::Index>(b) * c.tokens;
            CHECK(identical(a.y.middleRows(r0, j), b2.y.middleRows(r0, j)));
            CHECK(identical(a.diag.loss.middleRows(r0, j), b2.diag.loss.middleRows(r0, j)));
            CHECK(identical(a.diag.grad_norm.middleRows(r0, j), b2.diag.grad_norm.middleRows(r0, j)));
            CHECK_FALSE(identical(a.y.middleRows(r0 + j, c.tokens - j), b2.y.middleRows(r0 + j, c.tokens - j)));
        }
    }
}

// The ablation switches (MemoryConfig::momentum, forget; the paper's Table 5) in every gate
// mode: the fixed gate's parameters change nothing (outputs, memory, dx and every other
// gradient bit for bit) and get exactly zero gradients; with the switch on the same parameters
// do change the memory; under constant gates a switch off equals its constant set to 0.
TEST_CASE("invariants: ablation switches", "[invariants]") {
    const GateMode modes[] = {GateMode::DataDependent, GateMode::PerChunk, GateMode::Constant};
    const std::pair<bool, bool> switches[] = {{false, true}, {true, false}, {false, false}};
    int index = 0;
    for (const GateMode gates : modes) {
        for (const auto& [momentum, forget] : switches) {
            for (int rep = 0; rep < 2; ++rep, ++index) {
                Modes m;
                m.gates = gates;
                Rng rng(seed_for("ablation switches", static_cast<std::uint64_t>(index)));
                m = random_flags(m, rng);
                m.update = gates == GateMode::PerChunk || rep == 0 ? UpdateMode::Chunked
                                                                    : UpdateMode::PerToken;
                m.retrieval = gates == GateMode::PerChunk ? Retrieval::Lagged
                              : rep == 0                  ? Retrieval::InChunk
                                                          : Retrieval::Lagged;
                Case c = make_case<double>(m, rng(), Limits{.max_tokens = 20, .max_batch = 2},
                                           [&](Case& k) {
                                               k.cfg.momentum = momentum;
                                               k.cfg.forget = forget;
                                           });
                INFO(c.describe());
                titans::MemoryParamsd moved = c.params;
                if (!momentum) {
                    moved.w_eta.array() += 0.7;
                    moved.b_eta.array() -= 1.3;
                }
                if (!forget) {
                    moved.w_alpha.array() -= 0.4;
                    moved.b_alpha.array() += 2.1;
                }
                using Mem = titans::NeuralMemory<double>;
                const auto run = [&](const MemoryConfig& cfg, const titans::MemoryParamsd& p) {
                    const Mem mem(cfg, p);
                    auto st = mem.make_state(c.batch);
                    Mem::Trace trace;
                    Matrixd y, dx;
                    mem.forward(st, c.x, y, trace);
                    auto g = titans::MemoryParamsd::zeros(cfg);
                    const Matrixd dy = Matrixd::Constant(y.rows(), y.cols(), 0.25) + 0.5 * c.x.leftCols(1).replicate(1, y.cols());
                    mem.backward(trace, dy, dx, g);
                    return std::tuple{y, mem.current_weights(st, c.batch - 1, 0), dx, g};
                };
                const auto [y1, w1, dx1, g1] = run(c.cfg, c.params);
                const auto [y2, w2, dx2, g2] = run(c.cfg, moved);
                CHECK(identical(y1, y2));
                CHECK(identical_layers(w1, w2));
                CHECK(identical(dx1, dx2));
                CHECK(identical(g1.w_q, g2.w_q));
                CHECK(identical(g1.w_theta, g2.w_theta));
                CHECK(identical(g1.memory_init[0][0], g2.memory_init[0][0]));
                if (!momentum) CHECK(((g1.w_eta.array() == 0).all() && (g1.b_eta.array() == 0).all()));
                if (!forget) CHECK(((g1.w_alpha.array() == 0).all() && (g1.b_alpha.array() == 0).all()));
                MemoryConfig on = c.cfg;
                on.momentum = on.forget = true;
                if (gates == GateMode::Constant) {
                    MemoryConfig zeroed = on;  // the switch off is its constant at 0
                    if (!momentum) zeroed.constant_eta = 0;
                    if (!forget) zeroed.constant_alpha = 0;
                    const auto [y0, w0, dx0, g0] = run(zeroed, c.params);
                    CHECK(identical(y0, y1));
                    CHECK(identical(dx0, dx1));
                    CHECK(identical(g0.w_k, g1.w_k));
                } else if (c.tokens >= 2) {  // the control: on, the moved parameters matter
                    const auto [y3, w3, dx3, g3] = run(on, c.params);
                    const auto [y4, w4, dx4, g4] = run(on, moved);
                    CHECK_FALSE(identical_layers(w3, w4));
                    CHECK_FALSE(identical_layers(w3, w1));
                }
            }
        }
    }
}
