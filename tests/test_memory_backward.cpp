// The memory's backward pass (math §9): the reverse sweeps of the chunk coefficients against
// central finite differences of chunk_coefficients.hpp, in double.
#include "catch.hpp"
#include "test_common.hpp"
#include "training_pass.hpp"

#include "reference/reference_memory_backward.hpp"

#include <titans/titans.hpp>

#include <limits>
#include <string>
#include <utility>
#include <vector>

using namespace titans_test;

namespace {

/// A scalar of every coefficient of a chunk prefix of n tokens, weighted by fixed adjoints.
struct CoefficientLoss {
    int n;
    Matrixd dbeta, dc, dG, dg, ds;  // rows of n (dG: n x n, row-major walk below)
    double dp_end;
    double operator()(const Matrixd& th, const Matrixd& et, const Matrixd& al) const {
        std::vector<double> beta(n), c(n), G(static_cast<std::size_t>(n * n)), g(n), s(n);
        double be, ce, pe;
        titans::chunk_row_coefficients<double>(n, 0, th.data(), et.data(), al.data(),
                                               beta.data(), c.data(), G.data());
        titans::chunk_end_coefficients<double>(n, th.data(), et.data(), al.data(), g.data(),
                                               s.data(), &be, &ce, &pe);
        double sum = dp_end * pe;
        for (int i = 0; i < n; ++i) {
            sum += dbeta(0, i) * beta[i] + dc(0, i) * c[i] + dg(0, i) * g[i] + ds(0, i) * s[i];
            for (int k = 0; k < n; ++k) sum += dG(i, k) * G[static_cast<std::size_t>(i * n + k)];
        }
        return sum;
    }
};

}  // namespace

TEST_CASE("mem bwd: chunk coefficients", "[train][memory]") {
    for (int trial = 0; trial < 40; ++trial) {
        Rng rng(seed_for("mem bwd: chunk coefficients", trial));
        const int n = uniform_int(rng, 1, 9);
        CoefficientLoss f{n, random_matrix(1, n, rng), random_matrix(1, n, rng),
                          random_matrix(n, n, rng), random_matrix(1, n, rng),
                          random_matrix(1, n, rng), uniform(rng)};
        // G is lower triangular: its upper adjoints must not matter.
        Matrixd th = random_matrix(1, n, rng, 0.01, 0.2), et = random_matrix(1, n, rng, 0.0, 0.95),
                al = random_matrix(1, n, rng, 0.0, 0.5);
        if (trial % 4 == 1) et.setZero();  // eta = 0 and alpha = 1 are valid gates
        if (trial % 4 == 2) al(0, n - 1) = 1.0;
        Matrixd dth = Matrixd::Zero(1, n), det = Matrixd::Zero(1, n), dal = Matrixd::Zero(1, n);
        Matrixd dGrow = f.dG;  // row-major copy for the raw pointer
        std::vector<double> dGv(static_cast<std::size_t>(n * n)), scratch(6 * static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i)
            for (int k = 0; k < n; ++k) dGv[static_cast<std::size_t>(i * n + k)] = dGrow(i, k);
        // beta_end, c_end are beta_{n-1}, c_{n-1}: their adjoints go into dbeta, dc.
        titans::chunk_coefficients_backward<double>(
            n, th.data(), et.data(), al.data(), f.dbeta.data(), f.dc.data(), dGv.data(),
            f.dg.data(), f.ds.data(), f.dp_end, dth.data(), det.data(), dal.data(),
            scratch.data());
        const double h = 1e-6;
        const Matrixd fth = central_diff(th, h, [&] { return f(th, et, al); });
        const Matrixd fet = central_diff(et, h, [&] { return f(th, et, al); });
        const Matrixd fal = central_diff(al, h, [&] { return f(th, et, al); });
        INFO("trial " << trial << " n " << n);
        CHECK(rel_error(dth, fth, 1.0) < 1e-8);
        CHECK(rel_error(det, fet, 1.0) < 1e-8);
        CHECK(rel_error(dal, fal, 1.0) < 1e-8);
    }
}

// ---------------------------------------------------------------------------------------------
// NeuralMemory::backward: every tensor and x against finite differences of the library's own
// forward, over several chunks with a partial last one, every update / gate / retrieval mode and
// the option flags (conv, q/k normalisation, residual, SiLU / GELU, clipping); b = 1 against the
// per-token oracle; the refusals.

namespace {

/// Modes from m and the low 7 bits, small shapes (draw_backward_shapes), chunk 1..4, tokens
/// for two to four chunks with a partial last one, random values (bit 64: a constant stream).
BackwardCase draw_mem_case(const Modes& m, int bits, Rng& rng) {
    BackwardCase c;
    MemoryConfig& g = c.cfg;
    g.gates = m.gates;
    g.retrieval = m.retrieval;
    g.update = m.update;
    g.use_conv = (bits & 1) == 0;
    g.normalize_qk = (bits & 2) == 0;
    g.residual = (bits & 4) != 0;
    g.activation = (bits & 8) ? Activation::GELU : Activation::SiLU;
    g.qkv_activation = (bits & 16) ? Activation::Identity : Activation::SiLU;
    g.max_grad_norm = (bits & 32) ? pick(rng, std::vector<double>{0.05, 0.3, 1.0}) : 0.0;
    g.chunk = pick(rng, std::vector<int>{1, 2, 3, 4});
    draw_backward_shapes(c, rng);
    // Several chunks and a partial one (b = 1: a few tokens).
    const int b = g.effective_chunk();
    const int tokens = b == 1 ? uniform_int(rng, 2, 6) : b * uniform_int(rng, 1, 3) + uniform_int(rng, 1, b - 1);
    c.x = random_matrix(c.batch * tokens, g.d_model, rng);
    if ((bits & 64) != 0) {  // a constant stream: one row repeated
        c.x.rowwise() = c.x.row(0);
    }
    c.dy = random_matrix(c.batch * tokens, g.d_model, rng);
    return c;
}

/// L = sum(dy . y) of a fresh forward, and its gradients from the training pass.
double mem_loss(const BackwardCase& c) {
    return fresh_loss<titans::NeuralMemory<double>>(c.cfg, c.p, c.batch, c.x, c.dy);
}
MemoryParams<double> mem_gradients(const BackwardCase& c, Matrixd& dx) {
    return fresh_gradients<titans::NeuralMemory<double>>(c.cfg, c.p, c.batch, c.x, c.dy, dx);
}

/// The worst tensor's error (tensor_error) of the training pass against finite differences.
double mem_fd_error(BackwardCase& c) {
    Matrixd dx;
    const MemoryParams<double> g = mem_gradients(c, dx);
    const auto loss = [&]() { return mem_loss(c); };
    const double atol = fd_floor(loss());
    const double worst = params_fd_error(c.p, g, c.cfg, atol, loss);
    const double ex = tensor_error(c.x.data(), dx.data(), c.x.size(), atol, loss);
    if (ex > 1e-6) UNSCOPED_INFO("x: " << ex);
    return std::max(worst, ex);
}

}  // namespace

TEST_CASE("mem bwd: FD, every mode", "[train][memory]") {
    const std::vector<Modes> modes = all_primary_modes();
    const int i = GENERATE(range(0, 56));
    const std::uint64_t seed = seed_for("mem bwd: FD, every mode", static_cast<std::uint64_t>(i));
    Rng rng(seed);
    const Modes& m = modes[static_cast<std::size_t>(i) % modes.size()];
    BackwardCase c = draw_mem_case(m, (i * 37) % 128, rng);
    INFO("seed=" << seed << " case=" << i << " chunk=" << c.cfg.chunk << " rows=" << c.x.rows());
    CHECK(note_error<double>("memory backward", mem_fd_error(c)) <= 1e-6);
}

TEST_CASE("mem bwd: b=1 vs per-token oracle", "[train][memory]") {
    // The per-token update and the chunked update with b = 1 are the same function; both must
    // match reverse mode through the per-token recurrence (tests/reference) to rounding.
    const int i = GENERATE(range(0, 16));
    const std::uint64_t seed = seed_for("mem bwd: b=1 vs oracle", static_cast<std::uint64_t>(i));
    Rng rng(seed);
    Modes m;
    m.gates = i % 2 == 0 ? GateMode::DataDependent : GateMode::Constant;
    m.retrieval = (i / 2) % 2 == 0 ? Retrieval::Lagged : Retrieval::InChunk;
    m.update = (i / 4) % 2 == 0 ? UpdateMode::PerToken : UpdateMode::Chunked;
    BackwardCase c = draw_mem_case(m, (i * 53) % 128, rng);
    c.cfg.chunk = 1;
    INFO("seed=" << seed << " case=" << i);
    Matrixd dx;
    const MemoryParams<double> g = mem_gradients(c, dx);
    const titans::reference::Gradients r =
        titans::reference::per_token_backward(c.cfg, c.p, c.x, c.batch, c.dy);
    std::vector<std::string> names;
    std::vector<Matrixd> a, b;
    MemoryParams<double>::tensors(g, c.cfg, [&](const std::string& name, const auto& t) {
        names.push_back(name);
        a.emplace_back(t);
    });
    MemoryParams<double>::tensors(r.params, c.cfg,
                                  [&](const std::string&, const auto& t) { b.emplace_back(t); });
    REQUIRE(a.size() == b.size());
    for (std::size_t k = 0; k < a.size(); ++k) {
        INFO(names[k]);
        CHECK(note_error<double>("memory backward vs oracle", rel_error(a[k], b[k], 1e-6)) <= 1e-10);
    }
    CHECK(note_error<double>("memory backward vs oracle", rel_error(dx, r.x, 1e-6)) <= 1e-10);
}

TEST_CASE("mem bwd: forward, sums, refusals", "[train][memory]") {
    Rng rng(seed_for("mem bwd: forward, sums, refusals"));
    Modes m;
    m.retrieval = Retrieval::InChunk;
    BackwardCase c = draw_mem_case(m, 0, rng);
    titans::NeuralMemory<double> mem(c.cfg, c.p);
    // The training forward: the same bits and state as forward.
    auto s1 = mem.make_state(c.batch), s2 = mem.make_state(c.batch);
    titans::NeuralMemory<double>::Trace trace;
    Matrixd y1, y2;
    mem.forward(s1, c.x, y1);
    mem.forward(s2, c.x, y2, trace);
    CHECK(identical(y1, y2));
    CHECK(trace.rows() == c.x.rows());
    CHECK(identical(mem.current_weights(s1, 0, 0)[0], mem.current_weights(s2, 0, 0)[0]));
    // Gradients add up: two backward calls give twice one; dx is written, not added.
    auto g = MemoryParams<double>::zeros(c.cfg);
    Matrixd dx1, dx2;
    mem.backward(trace, c.dy, dx1, g);
    const auto once = g;
    mem.backward(trace, c.dy, dx2, g);
    CHECK(identical(dx1, dx2));
    CHECK(identical(g.w_q, (2 * once.w_q).eval()));
    CHECK(identical(g.memory_init[0][0], (2 * once.memory_init[0][0]).eval()));
    // Refusals leave everything as it was.
    titans::NeuralMemory<double>::Trace empty;
    CHECK_THROWS_AS(mem.backward(empty, c.dy, dx1, g), titans::ShapeError);
    const Matrixd short_dy = c.dy.topRows(c.dy.rows() - 1);
    CHECK_THROWS_AS(mem.backward(trace, short_dy, dx1, g), titans::ShapeError);
    Matrixd bad_dy = c.dy;
    bad_dy(0, 0) = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_AS(mem.backward(trace, bad_dy, dx1, g), titans::NonFiniteError);
    auto wrong = g;
    wrong.w_o.resize(1, 1);
    CHECK_THROWS_AS(mem.backward(trace, c.dy, dx1, wrong), titans::ShapeError);
    CHECK(wrong.w_o.rows() == 1);
    auto nan = g;
    nan.w_k(0, 0) = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_AS(mem.backward(trace, c.dy, dx1, nan), titans::NonFiniteError);
    CHECK(identical(nan.w_q, g.w_q));
    CHECK(identical(g.w_q, (2 * once.w_q).eval()));
    MemoryConfig other = c.cfg;
    other.chunk = c.cfg.chunk + 1;
    titans::NeuralMemory<double> mem2(other, c.p);
    CHECK_THROWS_AS(mem2.backward(trace, c.dy, dx1, g), titans::ConfigError);
}


// The training forward fills Diagnostics as forward does, bit for bit, in every mode, from a
// fresh state and from one some tokens in (mid-chunk too); a refused call leaves diag as it was.
TEST_CASE("mem bwd: training diagnostics", "[train][memory]") {
    const std::vector<Modes> modes = all_primary_modes();
    for (int i = 0; i < 2 * static_cast<int>(modes.size()); ++i) {
        Rng rng(seed_for("mem bwd: training diagnostics", static_cast<std::uint64_t>(i)));
        const BackwardCase c = draw_mem_case(modes[static_cast<std::size_t>(i) % modes.size()],
                                             (i * 53) % 128, rng);
        INFO("case " << i << " chunk " << c.cfg.chunk << " rows " << c.x.rows());
        titans::NeuralMemory<double> mem(c.cfg, c.p);
        auto s1 = mem.make_state(c.batch), s2 = mem.make_state(c.batch);
        if (i % 2 == 1) {  // start a whole number of chunks in, or mid-chunk
            const int lead = i % 4 == 1 ? c.cfg.effective_chunk() : uniform_int(rng, 1, 5);
            const Matrixd head = random_matrix(c.batch * lead, c.cfg.d_model, rng);
            (void)mem.forward(s1, head);
            (void)mem.forward(s2, head);
        }
        titans::Diagnostics<double> d1, d2;
        Matrixd y1, y2;
        titans::NeuralMemory<double>::Trace trace;
        mem.forward(s1, c.x, y1, &d1);
        mem.forward(s2, c.x, y2, trace, &d2);
        CHECK(identical(y1, y2));
        REQUIRE(d2.loss.rows() == c.x.rows());
        REQUIRE(d2.loss.cols() == c.cfg.n_heads);
        CHECK(identical(d1.loss, d2.loss));
        CHECK(identical(d1.grad_norm, d2.grad_norm));
        CHECK(d2.loss.maxCoeff() > 0.0);
        // Refused (a NaN input): diag, y and the trace as they were.
        const titans::Diagnostics<double> before = d2;
        Matrixd bad = c.x;
        bad(bad.rows() - 1, 0) = std::numeric_limits<double>::quiet_NaN();
        auto s3 = mem.make_state(c.batch);
        CHECK_THROWS_AS(mem.forward(s3, bad, y2, trace, &d2), titans::NonFiniteError);
        CHECK(identical(d2.loss, before.loss));
        CHECK(identical(d2.grad_norm, before.grad_norm));
        CHECK(identical(y2, y1));
        CHECK(trace.rows() == c.x.rows());
    }
}

namespace {

/// Cuts of [0, N): at chunk boundaries (the last one may end mid-chunk; an empty piece if
/// `empty`) or, if `anywhere`, of random lengths 0..b+2 (mid-chunk starts and ends, empty
/// pieces, pieces inside one chunk).
std::vector<Eigen::Index> memory_cuts(Eigen::Index N, int b, bool anywhere, bool empty, Rng& rng) {
    std::vector<Eigen::Index> cuts{0};
    if (anywhere) {
        while (cuts.back() < N) {
            cuts.push_back(std::min<Eigen::Index>(N, cuts.back() + uniform_int(rng, 0, b + 2)));
        }
        return cuts;
    }
    while (cuts.back() + b < N) cuts.push_back(cuts.back() + b * uniform_int(rng, 1, 2));
    cuts.back() = std::min(cuts.back(), N);
    if (cuts.back() != N) cuts.push_back(N);
    if (empty) {
        const auto at = static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(cuts.size()) - 2));
        cuts.insert(cuts.begin() + static_cast<std::ptrdiff_t>(at) + 1, cuts[at]);
    }
    return cuts;
}

/// The state gradient backward returns for a trace from `at` tokens in: zeros()'s shapes for
/// that state (its pending rows included), finite.
void check_state_gradient_at(const titans::NeuralMemory<double>& mem, const BackwardCase& c,
                             Eigen::Index at) {
    const int B = c.batch;
    const Eigen::Index N = c.x.rows() / B;
    auto st = mem.make_state(B);
    (void)mem.forward(st, take_tokens(c.x, B, N, 0, at));
    titans::NeuralMemory<double>::Trace tr;
    Matrixd y, dx;
    mem.forward(st, take_tokens(c.x, B, N, at, N), y, tr);
    titans::MemoryStateGradient<double> d;
    auto g = MemoryParams<double>::zeros(c.cfg);
    mem.backward(tr, take_tokens(c.dy, B, N, at, N), dx, g, &d);
    const auto z = titans::MemoryStateGradient<double>::zeros(
        c.cfg, B, static_cast<int>(at % c.cfg.effective_chunk()));
    REQUIRE(d.pending_a.size() == z.pending_a.size());
    REQUIRE(d.pending_delta.size() == z.pending_delta.size());
    REQUIRE(d.pending_gates.size() == z.pending_gates.size());
    for (std::size_t k = 0; k < z.pending_a.size(); ++k) {
        for (std::size_t l = 0; l < z.pending_a[k].size(); ++l) {
            CHECK(d.pending_a[k][l].rows() == z.pending_a[k][l].rows());
            CHECK(d.pending_a[k][l].cols() == z.pending_a[k][l].cols());
            CHECK(d.pending_delta[k][l].cols() == z.pending_delta[k][l].cols());
        }
    }
    CHECK(d.finite());
}

}  // namespace

// Pieces cut at chunk boundaries (the last one may end mid-chunk) or, from case 24, anywhere
// (the memory left mid-chunk: the pending rows' adjoints chain too), forward in order and
// backward last first, each given the next one's d_state_in as its d_state_out: the same dx
// and gradients as one call, to rounding. Short pieces (under the conv's K-1 rows) pass the
// tail's adjoint through; so do empty ones. Random and constant streams.
TEST_CASE("mem bwd: chained pieces", "[train][memory]") {
    const std::vector<Modes> modes = all_primary_modes();
    for (int i = 0; i < 48; ++i) {
        Rng rng(seed_for("mem bwd: chained pieces", static_cast<std::uint64_t>(i)));
        BackwardCase c = draw_mem_case(modes[static_cast<std::size_t>(i) % modes.size()],
                                       (i * 29) % 128, rng);
        const int B = c.batch, b = c.cfg.effective_chunk();
        const Eigen::Index N = c.x.rows() / B;
        const bool anywhere = i >= 24;
        const std::vector<Eigen::Index> cuts = memory_cuts(N, b, anywhere, i % 3 == 1, rng);
        if (i % 4 == 2) {  // a constant stream: every token of a sequence the same row
            for (int s = 0; s < B; ++s) {
                c.x.middleRows(s * N, N).rowwise() = c.x.row(s * N);
            }
        }
        INFO("case " << i << " chunk " << b << " rows " << N << " pieces " << cuts.size() - 1);
        titans::NeuralMemory<double> mem(c.cfg, c.p);
        Matrixd dx_all;
        const MemoryParams<double> g_all = mem_gradients(c, dx_all);
        auto g = MemoryParams<double>::zeros(c.cfg);
        const Matrixd dx = chained_pieces<titans::MemoryStateGradient<double>>(mem, B, c.x, c.dy,
                                                                               cuts, g, false);
        CHECK(note_error<double>("memory chained pieces", rel_error(dx, dx_all, 1e-6)) <= 1e-12);
        check_gradients_match(g, g_all, c.cfg, 1e-6, "memory chained pieces");
        if (anywhere) check_state_gradient_at(mem, c, cuts[cuts.size() / 2]);
    }
}

TEST_CASE("mem bwd: state gradient refusals", "[train][memory]") {
    Rng rng(seed_for("mem bwd: state gradient refusals"));
    Modes m;
    BackwardCase c = draw_mem_case(m, 0, rng);  // conv on
    c.cfg.chunk = 2;
    c.cfg.conv_kernel = std::max(c.cfg.conv_kernel, 2);  // a tail to refuse (K = 1 keeps none)
    c.p = MemoryParams<double>::random(c.cfg, rng());
    c.x = random_matrix(c.batch * 7, c.cfg.d_model, rng);  // 3 chunks and a partial one
    c.dy = random_matrix(c.batch * 7, c.cfg.d_model, rng);
    titans::NeuralMemory<double> mem(c.cfg, c.p);
    const int B = c.batch;
    const Eigen::Index N = c.x.rows() / B;
    auto st = mem.make_state(B);
    titans::NeuralMemory<double>::Trace t1, t2;
    Matrixd y, dx;
    mem.forward(st, take_tokens(c.x, B, N, 0, 2), y, t1);
    mem.forward(st, take_tokens(c.x, B, N, 2, N), y, t2);
    auto g = MemoryParams<double>::zeros(c.cfg);
    titans::MemoryStateGradient<double> d;
    mem.backward(t2, take_tokens(c.dy, B, N, 2, N), dx, g, &d);
    REQUIRE(d.weights.size() == static_cast<std::size_t>(B * c.cfg.n_heads));
    REQUIRE(d.conv_tail.size() == static_cast<std::size_t>(B));
    const auto before = g;
    // t2 ends mid-chunk (at 7): its end's state gradient has one pending row per pair, or none.
    auto bad = titans::MemoryStateGradient<double>::zeros(c.cfg, B, 1);
    bad.pending_a[0][0].resize(2, bad.pending_a[0][0].cols());
    REQUIRE_THROWS_NAMING(mem.backward(t2, take_tokens(c.dy, B, N, 2, N), dx, g, nullptr, &bad),
                          titans::ShapeError, "pending_a");
    bad = titans::MemoryStateGradient<double>::zeros(c.cfg, B, 1);
    bad.pending_gates.pop_back();
    REQUIRE_THROWS_NAMING(mem.backward(t2, take_tokens(c.dy, B, N, 2, N), dx, g, nullptr, &bad),
                          titans::ShapeError, "pending_gates");
    bad = titans::MemoryStateGradient<double>::zeros(c.cfg, B, 1);
    bad.pending_delta[0].back()(0, 0) = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_NAMING(mem.backward(t2, take_tokens(c.dy, B, N, 2, N), dx, g, nullptr, &bad),
                          titans::NonFiniteError, "d_state_out");
    // t1 ends at a chunk boundary: no pending rows.
    bad = titans::MemoryStateGradient<double>::zeros(c.cfg, B, 1);
    REQUIRE_THROWS_NAMING(mem.backward(t1, take_tokens(c.dy, B, N, 0, 2), dx, g, nullptr, &bad),
                          titans::ShapeError, "pending");
    bad = d;
    bad.conv_tail.pop_back();
    REQUIRE_THROWS_NAMING(mem.backward(t1, take_tokens(c.dy, B, N, 0, 2), dx, g, nullptr, &bad),
                          titans::ShapeError, "conv_tail");
    bad = d;
    bad.weights[0][0].resize(bad.weights[0][0].rows() + 1, 1);  // never its own shape
    REQUIRE_THROWS_NAMING(mem.backward(t1, take_tokens(c.dy, B, N, 0, 2), dx, g, nullptr, &bad),
                          titans::ShapeError, "weights");
    bad = d;
    bad.momentum[0][0](0, 0) = std::numeric_limits<double>::infinity();
    REQUIRE_THROWS_NAMING(mem.backward(t1, take_tokens(c.dy, B, N, 0, 2), dx, g, nullptr, &bad),
                          titans::NonFiniteError, "d_state_out");
    CHECK(identical(g.w_q, before.w_q));
    REQUIRE_THROWS_NAMING(titans::MemoryStateGradient<double>::zeros(c.cfg, B, 2),
                          titans::ConfigError, "pending");
    REQUIRE_THROWS_NAMING(titans::MemoryStateGradient<double>::zeros(c.cfg, B, -1),
                          titans::ConfigError, "pending");
}

TEST_CASE("mem bwd: zero state gradient", "[train][memory]") {
    Rng rng(seed_for("mem bwd: zero state gradient"));
    const std::vector<Modes> modes = all_primary_modes();
    for (std::size_t i = 0; i < modes.size(); ++i) {
        BackwardCase c = draw_mem_case(modes[i], static_cast<int>(i), rng);
        c.cfg.use_conv = i % 2 == 0;
        c.p = MemoryParams<double>::random(c.cfg, rng());
        titans::NeuralMemory<double> mem(c.cfg, c.p);
        const int B = c.batch, b = c.cfg.effective_chunk();
        const Eigen::Index N = c.x.rows() / B, cut = std::min<Eigen::Index>(b, N);
        auto st = mem.make_state(B);
        titans::NeuralMemory<double>::Trace t1, t2;
        Matrixd y, dx_none, dx_zero, dx2;
        mem.forward(st, take_tokens(c.x, B, N, 0, cut), y, t1);
        mem.forward(st, take_tokens(c.x, B, N, cut, N), y, t2);
        // zeros() has the shapes backward returns for the state t1 ends in (t2's start).
        auto g2 = MemoryParams<double>::zeros(c.cfg);
        titans::MemoryStateGradient<double> d_mid;
        mem.backward(t2, take_tokens(c.dy, B, N, cut, N), dx2, g2, &d_mid);
        const auto z = titans::MemoryStateGradient<double>::zeros(c.cfg, B);
        INFO("case " << i << " conv " << c.cfg.use_conv << " batch " << B);
        REQUIRE(z.weights.size() == d_mid.weights.size());
        REQUIRE(z.conv_tail.size() == d_mid.conv_tail.size());
        for (std::size_t k = 0; k < z.weights.size(); ++k) {
            for (std::size_t l = 0; l < z.weights[k].size(); ++l) {
                CHECK(z.weights[k][l].rows() == d_mid.weights[k][l].rows());
                CHECK(z.weights[k][l].cols() == d_mid.weights[k][l].cols());
                CHECK(z.momentum[k][l].size() == d_mid.momentum[k][l].size());
                CHECK(z.weights[k][l].isZero(0.0));
            }
        }
        CHECK(z.conv_tail[0].rows() == d_mid.conv_tail[0].rows());
        CHECK(z.conv_tail[0].cols() == d_mid.conv_tail[0].cols());
        CHECK(z.index(c.cfg, B - 1, c.cfg.n_heads - 1) == z.weights.size() - 1);
        // Given as t1's end adjoint it is accepted and changes nothing: bit-identical results.
        auto g_none = MemoryParams<double>::zeros(c.cfg), g_zero = g_none;
        mem.backward(t1, take_tokens(c.dy, B, N, 0, cut), dx_none, g_none);
        mem.backward(t1, take_tokens(c.dy, B, N, 0, cut), dx_zero, g_zero, nullptr, &z);
        CHECK(identical(dx_none, dx_zero));
        CHECK(identical(g_none.w_q, g_zero.w_q));
        CHECK(identical(g_none.w_v, g_zero.w_v));
    }
    MemoryConfig cfg;
    REQUIRE_THROWS_NAMING(titans::MemoryStateGradient<double>::zeros(cfg, 0), titans::ConfigError,
                          "batch");
    cfg.depth = 0;
    REQUIRE_THROWS_NAMING(titans::MemoryStateGradient<double>::zeros(cfg, 1), titans::ConfigError,
                          "depth");
}

// ---------------------------------------------------------------------------------------------
// The staged API (NeuralMemory::begin_trace, forward_part, Reverse, read_weights_backward): a
// read of the memory mid-stream trained through a tap, against finite differences of the
// library's forward; the staged forward and an untapped Reverse equal the one-call passes bit
// for bit; the refusals.

namespace {

/// A mid-stream read: the stream's rows [0, p), then h = read_weights(W_p, xr) of the memory
/// after p tokens, then rows [p, N), all one trace, after a lead-in piece xl of its own trace
/// (so the staged one may start mid-chunk). L = sum(dyl . yl) + sum(dy . y) + sum(dh . h).
struct TappedRead {
    BackwardCase c;
    Matrixd xr, dh, xl, dyl;
    Eigen::Index p = 0;

    using Mem = titans::NeuralMemory<double>;
    using Weights = std::vector<std::vector<Matrixd>>;

    [[nodiscard]] Eigen::Index rows() const { return c.x.rows() / c.batch; }

    /// The forward: yl, y of the stream, the weights read and h; traces filled.
    Matrixd run(const Mem& mem, Mem::Trace& lead, Mem::Trace& trace, Weights& W, Matrixd& h,
                Matrixd& yl) const {
        const int B = c.batch;
        const Eigen::Index N = rows();
        auto st = mem.make_state(B);
        mem.forward(st, xl, yl, lead);
        mem.begin_trace(st, N, trace);
        Matrixd y(c.x.rows(), c.cfg.d_model), yk;
        mem.forward_part(st, take_tokens(c.x, B, N, 0, p), yk, trace);
        put_tokens(y, yk, B, N, 0, p);
        W.clear();
        for (int b = 0; b < B; ++b) {
            for (int hh = 0; hh < c.cfg.n_heads; ++hh) W.push_back(mem.current_weights(st, b, hh));
        }
        h = mem.read_weights(W, xr, B);
        mem.forward_part(st, take_tokens(c.x, B, N, p, N), yk, trace);
        put_tokens(y, yk, B, N, p, N);
        return y;
    }

    [[nodiscard]] double loss() const {
        const Mem mem(c.cfg, c.p);
        Mem::Trace lead, trace;
        Weights W;
        Matrixd h, yl;
        const Matrixd y = run(mem, lead, trace, W, h, yl);
        return dyl.cwiseProduct(yl).sum() + c.dy.cwiseProduct(y).sum() + dh.cwiseProduct(h).sum();
    }

    /// The staged backward: the rows above p, the read's backward tapped at p, the rest, then
    /// the lead-in piece from the staged trace's state gradient.
    MemoryParams<double> gradients(Matrixd& dx, Matrixd& dxr, Matrixd& dxl) const {
        const int B = c.batch;
        const Eigen::Index N = rows();
        const Mem mem(c.cfg, c.p);
        Mem::Trace lead, trace;
        Weights W, dW;
        Matrixd h, yl, dx_hi, dx_lo;
        run(mem, lead, trace, W, h, yl);
        auto g = MemoryParams<double>::zeros(c.cfg);
        Mem::Reverse rev(mem, trace, c.dy);
        rev.down_to(p, dx_hi);
        mem.read_weights_backward(W, xr, B, dh, dxr, dW, g);
        rev.tap(dW);
        rev.down_to(0, dx_lo);
        titans::MemoryStateGradient<double> d_lead;
        rev.finish(g, &d_lead);
        mem.backward(lead, dyl, dxl, g, nullptr, &d_lead);
        dx.resize(c.x.rows(), c.cfg.d_model);
        put_tokens(dx, dx_hi, B, N, p, N);
        put_tokens(dx, dx_lo, B, N, 0, p);
        return g;
    }
};

}  // namespace

TEST_CASE("mem bwd: staged read vs FD", "[train][memory]") {
    const std::vector<Modes> modes = all_primary_modes(), chunked = chunked_primary_modes();
    for (int i = 0; i < 28; ++i) {
        Rng rng(seed_for("mem bwd: staged read vs FD", static_cast<std::uint64_t>(i)));
        TappedRead t;
        const bool mid = i >= 21;  // the staged trace starts mid-chunk, the read often at its row 0
        t.c = draw_mem_case(mid ? chunked[static_cast<std::size_t>(i) % chunked.size()]
                                : modes[static_cast<std::size_t>(i) % modes.size()],
                            (i * 53) % 128, rng);
        if (mid && t.c.cfg.chunk == 1) {
            t.c.cfg.chunk = uniform_int(rng, 2, 5);
            t.c.p = MemoryParams<double>::random(t.c.cfg, rng());
        }
        const Eigen::Index N = t.rows();
        const int b = t.c.cfg.effective_chunk();
        // The read at the start, at the end, or anywhere between (mid-chunk included).
        t.p = i % 5 == 0 || (mid && i % 2 == 0) ? 0
              : i % 5 == 1                      ? N
                                                : uniform_int(rng, 1, static_cast<int>(N) - 1);
        const int r = uniform_int(rng, 1, 3);
        t.xr = random_matrix(t.c.batch * r, t.c.cfg.d_model, rng);
        t.dh = random_matrix(t.c.batch * r, t.c.cfg.d_model, rng);
        const int lead = mid ? uniform_int(rng, 1, b - 1) + (i % 3 == 0 ? b : 0)
                         : i % 3 == 0 ? 0
                                      : uniform_int(rng, 1, b + 1);
        t.xl = random_matrix(t.c.batch * lead, t.c.cfg.d_model, rng);
        t.dyl = random_matrix(t.c.batch * lead, t.c.cfg.d_model, rng);
        INFO("case " << i << " chunk " << b << " rows " << N << " read at " << t.p << " lead "
                     << lead);
        Matrixd dx, dxr, dxl;
        const MemoryParams<double> g = t.gradients(dx, dxr, dxl);
        const auto loss = [&] { return t.loss(); };
        const double atol = fd_floor(loss());
        double worst = params_fd_error(t.c.p, g, t.c.cfg, atol, loss);
        worst = std::max(worst, tensor_error(t.c.x.data(), dx.data(), t.c.x.size(), atol, loss));
        worst = std::max(worst, tensor_error(t.xr.data(), dxr.data(), t.xr.size(), atol, loss));
        worst = std::max(worst, tensor_error(t.xl.data(), dxl.data(), t.xl.size(), atol, loss));
        CHECK(note_error<double>("memory staged read", worst) <= 1e-6);
    }
}

TEST_CASE("mem bwd: staged == one call", "[train][memory]") {
    const std::vector<Modes> modes = all_primary_modes();
    for (int i = 0; i < 12; ++i) {
        Rng rng(seed_for("mem bwd: staged == one call", static_cast<std::uint64_t>(i)));
        BackwardCase c = draw_mem_case(modes[static_cast<std::size_t>(i) % modes.size()],
                                       (i * 41) % 128, rng);
        const titans::NeuralMemory<double> mem(c.cfg, c.p);
        const int B = c.batch;
        const Eigen::Index N = c.x.rows() / B;
        titans::NeuralMemory<double>::Trace one, staged;
        Matrixd y_one, y(c.x.rows(), c.cfg.d_model), yk, dx_one, dx(c.x.rows(), c.cfg.d_model), dk;
        auto s1 = mem.make_state(B), s2 = mem.make_state(B);
        mem.forward(s1, c.x, y_one, one);
        mem.begin_trace(s2, N, staged);
        std::vector<Eigen::Index> cuts{0};  // pieces of any length, empty ones too
        while (cuts.back() < N) cuts.push_back(std::min<Eigen::Index>(N, cuts.back() + uniform_int(rng, 0, 3)));
        for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
            mem.forward_part(s2, take_tokens(c.x, B, N, cuts[k], cuts[k + 1]), yk, staged);
            put_tokens(y, yk, B, N, cuts[k], cuts[k + 1]);
        }
        INFO("case " << i << " rows " << N << " pieces " << cuts.size() - 1);
        // Pieces agree with one call to rounding (as streaming does, math §8).
        CHECK(note_error<double>("memory staged forward", rel_error(y, y_one)) <= 1e-12);
        CHECK(rel_error(mem.current_weights(s1, B - 1, 0), mem.current_weights(s2, B - 1, 0)) <= 1e-12);
        auto g_one = MemoryParams<double>::zeros(c.cfg), g = g_one, g_same = g_one;
        titans::MemoryStateGradient<double> d_one, d_same;
        mem.backward(one, c.dy, dx_one, g_one, &d_one);
        {  // One stage: backward's own sweep, bit for bit.
            titans::NeuralMemory<double>::Reverse rev(mem, one, c.dy);
            rev.down_to(0, dk);
            rev.finish(g_same, &d_same);
            CHECK(identical(dk, dx_one));
            CHECK(identical(g_same.w_q, g_one.w_q));
            CHECK(identical(g_same.memory_init[0][0], g_one.memory_init[0][0]));
            CHECK(identical(d_same.weights[0][0], d_one.weights[0][0]));
        }
        titans::NeuralMemory<double>::Reverse rev(mem, staged, c.dy);
        for (std::size_t k = cuts.size() - 1; k-- > 0;) {  // stages at the same cuts
            rev.down_to(cuts[k], dk);
            put_tokens(dx, dk, B, N, cuts[k], cuts[k + 1]);
        }
        rev.finish(g);
        CHECK(note_error<double>("memory staged reverse", rel_error(dx, dx_one, 1e-6)) <= 1e-12);
        check_gradients_match(g, g_one, c.cfg, 1e-6, "memory staged reverse");
    }
}

TEST_CASE("mem bwd: staged API refusals", "[train][memory]") {
    Rng rng(seed_for("mem bwd: staged API refusals"));
    BackwardCase c = draw_mem_case(Modes{}, 0, rng);
    c.cfg.chunk = 3;
    c.p = MemoryParams<double>::random(c.cfg, rng());
    const int B = c.batch;
    const Eigen::Index N = 7;
    c.x = random_matrix(B * N, c.cfg.d_model, rng);
    c.dy = random_matrix(B * N, c.cfg.d_model, rng);
    using Mem = titans::NeuralMemory<double>;
    const Mem mem(c.cfg, c.p);
    auto st = mem.make_state(B);
    Mem::Trace tr;
    Matrixd y = Matrixd::Constant(1, 1, 5.0), dx;
    REQUIRE_THROWS_NAMING(mem.begin_trace(st, -1, tr), titans::ShapeError, "rows");
    mem.begin_trace(st, N, tr);
    // Past the trace's rows: refused, nothing changes.
    REQUIRE_THROWS_NAMING(mem.forward_part(st, random_matrix(B * (N + 1), c.cfg.d_model, rng), y, tr),
                          titans::ShapeError, "rows left");
    CHECK(st.position() == 0);
    CHECK(y(0, 0) == 5.0);
    mem.forward_part(st, take_tokens(c.x, B, N, 0, 4), y, tr);
    // A state fed outside the trace, a trace begun mid-chunk.
    auto other = mem.make_state(B);
    REQUIRE_THROWS_NAMING(mem.forward_part(other, take_tokens(c.x, B, N, 4, 5), y, tr),
                          titans::ConfigError, "position");
    // An unfilled trace has no Reverse.
    REQUIRE_THROWS_AS(Mem::Reverse(mem, tr, take_tokens(c.dy, B, N, 0, 4)), titans::ShapeError);
    mem.forward_part(st, take_tokens(c.x, B, N, 4, N), y, tr);
    Mem::Reverse rev(mem, tr, c.dy);
    REQUIRE_THROWS_NAMING(rev.down_to(N + 1, dx), titans::ShapeError, "p");
    REQUIRE_THROWS_NAMING(rev.down_to(-1, dx), titans::ShapeError, "p");
    rev.down_to(5, dx);
    CHECK(rev.position() == 5);
    std::vector<std::vector<Matrixd>> dW;
    for (int k = 0; k < B * c.cfg.n_heads; ++k) dW.push_back(mem.current_weights(st, 0, 0));
    auto bad = dW;
    bad.pop_back();
    REQUIRE_THROWS_NAMING(rev.tap(bad), titans::ShapeError, "size");
    bad = dW;
    bad[0][0](0, 0) = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_NAMING(rev.tap(bad), titans::NonFiniteError, "dW");
    auto g = MemoryParams<double>::zeros(c.cfg);
    REQUIRE_THROWS_NAMING(rev.finish(g), titans::ConfigError, "position");
    rev.tap(dW);
    rev.down_to(0, dx);
    rev.finish(g);
    REQUIRE_THROWS_NAMING(rev.finish(g), titans::ConfigError, "spent");
    // read_weights_backward: dy of the wrong shape, NaN; grads unchanged.
    const Matrixd xr = random_matrix(B * 2, c.cfg.d_model, rng);
    const auto before = g;
    std::vector<std::vector<Matrixd>> dWr;
    REQUIRE_THROWS_NAMING(mem.read_weights_backward(dW, xr, B, random_matrix(B * 3, c.cfg.d_model, rng),
                                                    dx, dWr, g),
                          titans::ShapeError, "dy");
    Matrixd dy_nan = random_matrix(B * 2, c.cfg.d_model, rng);
    dy_nan(0, 0) = std::numeric_limits<double>::infinity();
    REQUIRE_THROWS_NAMING(mem.read_weights_backward(dW, xr, B, dy_nan, dx, dWr, g),
                          titans::NonFiniteError, "dy");
    auto short_w = dW;
    short_w.pop_back();
    REQUIRE_THROWS_NAMING(mem.read_weights_backward(short_w, xr, B, random_matrix(B * 2, c.cfg.d_model, rng),
                                                    dx, dWr, g),
                          titans::ShapeError, "weights");
    CHECK(identical(g.w_q, before.w_q));
    CHECK(dWr.empty());
    // The Reverse on views: dy and dx of the wrong shape, without storage or with a short row
    // stride are refused naming them; a refused down_to leaves the Reverse where it was.
    using titans::View;
    const Eigen::Index d = c.cfg.d_model;
    const View<const double> dyv = titans::view_of(std::as_const(c.dy));
    REQUIRE_THROWS_NAMING(Mem::Reverse(mem, tr, View<const double>{dyv.data, dyv.rows - 1, d, d}),
                          titans::ShapeError, "dy is");
    REQUIRE_THROWS_NAMING(Mem::Reverse(mem, tr, View<const double>{nullptr, dyv.rows, d, d}),
                          titans::ShapeError, "dy has a null pointer");
    if (d > 1) {
        REQUIRE_THROWS_NAMING(Mem::Reverse(mem, tr, View<const double>{dyv.data, dyv.rows, d, 1}),
                              titans::ShapeError, "dy has a null pointer or a row stride of 1");
    }
    Mem::Reverse vrev(mem, tr, dyv);
    Matrixd dxv = Matrixd::Constant(B * (N - 3), d, 7.0);
    REQUIRE_THROWS_NAMING(vrev.down_to(3, View<double>{dxv.data(), B * (N - 3) - 1, d, d}),
                          titans::ShapeError, "dx is");
    REQUIRE_THROWS_NAMING(vrev.down_to(3, View<double>{nullptr, B * (N - 3), d, d}),
                          titans::ShapeError, "dx has a null pointer");
    CHECK(vrev.position() == N);
    CHECK((dxv.array() == 7.0).all());
    vrev.down_to(3, titans::view_of(dxv));
    Mem::Reverse hrev(mem, tr, c.dy);
    Matrixd dxh;
    hrev.down_to(3, dxh);
    CHECK(identical(dxv, dxh));
}
