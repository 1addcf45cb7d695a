// The memory memorises (math §2-3: it learns key -> value at test time), and the read-only
// retrieval NeuralMemory::read().
//
// Setup: one head, x = [key | value] (d_model = 2 d_h), no conv, identity q/k/v activation,
// L2-normalised q and k, constant gates, w_k = w_q = [I; 0] (the key half), w_v = [0; I] (the
// value half), w_o = [I 0] (the head output lands in the first d_h columns). A sequence of N
// pairs is written for several epochs; read(state, [key | noise]) returns M(key / |key|).
//
// Rates (found by a scan, documented here):
//   (a) random pairs, d_h = 16, N = 6, depth 1, theta = 0.4, eta = 0.5, chunk 2: the recall
//       error after epoch 3 is at most ~0.4 times the error after epoch 1 (150 seeds scanned);
//       the test asks for < 0.6 times;
//   (b) v = cos(3 k) (even: no linear map fits it), d_h = 4, N = 24, 40 epochs, chunk 4:
//       depth 1 with theta = 0.05, eta = 0.5 stalls at the least-squares optimum of a linear
//       memory (~0.7-0.9 relative error); depth 2 (expansion 4, SiLU) with theta = 0.1,
//       eta = 0.5 reaches ~0.02-0.15.
#include "test_common.hpp"

#include <Eigen/Cholesky>

using namespace titans_test;
namespace ref = titans::reference;

namespace {

struct PairMemory {
    MemoryConfig cfg;
    titans::MemoryParamsd params;
};

PairMemory pair_memory(int dh, int depth, double theta, double eta, int chunk, std::uint64_t seed) {
    PairMemory m;
    MemoryConfig& c = m.cfg;
    c.d_model = 2 * dh;
    c.n_heads = 1;
    c.d_head = dh;
    c.depth = depth;
    c.expansion = 4;
    c.activation = Activation::SiLU;
    c.use_conv = false;
    c.qkv_activation = Activation::Identity;
    c.normalize_qk = true;
    c.gates = GateMode::Constant;
    c.constant_theta = theta;
    c.constant_eta = eta;
    c.constant_alpha = 0.0;
    c.update = UpdateMode::Chunked;
    c.retrieval = Retrieval::Lagged;
    c.chunk = chunk;
    m.params = titans::MemoryParamsd::random(c, seed);
    Matrixd top = Matrixd::Zero(2 * dh, dh), bottom = Matrixd::Zero(2 * dh, dh);
    top.topRows(dh).setIdentity();
    bottom.bottomRows(dh).setIdentity();
    m.params.w_q = top;
    m.params.w_k = top;
    m.params.w_v = bottom;
    m.params.w_o = top.transpose();
    return m;
}

/// N unit keys (d_h wide) from rng.
Matrixd unit_keys(Rng& rng, int N, int dh) {
    Matrixd K = random_matrix(N, dh, rng);
    for (int i = 0; i < N; ++i) K.row(i).normalize();
    return K;
}

/// ||read(K) - V||^2 / ||V||^2 with queries [K | noise] (the value half must be ignored).
double recall_error(const NeuralMemory<double>& mem, const NeuralMemory<double>::State& st,
                    const Matrixd& K, const Matrixd& V, Rng& rng) {
    Matrixd xq(K.rows(), 2 * K.cols());
    xq << K, random_matrix(K.rows(), K.cols(), rng);
    const Matrixd y = mem.read(st, xq);
    REQUIRE(y.rows() == K.rows());
    REQUIRE(y.cols() == 2 * K.cols());
    CHECK(y.rightCols(K.cols()).cwiseAbs().maxCoeff() == 0.0);  // w_o maps into the first half
    return (y.leftCols(K.cols()) - V).squaredNorm() / V.squaredNorm();
}

/// Writes [K | V] `epochs` times; returns the recall error after every epoch.
std::vector<double> memorise(const PairMemory& pm, const Matrixd& K, const Matrixd& V, int epochs,
                             Rng& rng) {
    NeuralMemory<double> mem(pm.cfg, pm.params);
    auto st = mem.make_state(1);
    Matrixd x(K.rows(), 2 * K.cols());
    x << K, V;
    std::vector<double> err;
    for (int e = 0; e < epochs; ++e) {
        (void)mem.forward(st, x);
        err.push_back(recall_error(mem, st, K, V, rng));
    }
    return err;
}

}  // namespace

// memorisation: the recall error of random key/value pairs falls as the memory sees them again
// (epoch 3 < 0.6 x epoch 1)
TEST_CASE("memorisation: recall improves", "[memorization]") {
    const int rep = GENERATE(range(0, 6));
    Rng rng(seed_for("memorise-random-pairs", static_cast<std::uint64_t>(rep)));
    const int dh = 16, N = 6;
    const Matrixd K = unit_keys(rng, N, dh);
    const Matrixd V = random_matrix(N, dh, rng);
    const PairMemory pm = pair_memory(dh, 1, 0.4, 0.5, 2, rng());
    const std::vector<double> err = memorise(pm, K, V, 3, rng);
    INFO("rep=" << rep << " recall error per epoch: " << err[0] << " " << err[1] << " " << err[2]);
    CHECK(err[1] < err[0]);
    CHECK(err[2] < err[1]);
    CHECK(err[2] < 0.6 * err[0]);
    // Before any write the memory knows nothing about V (sanity of the measure).
    NeuralMemory<double> mem(pm.cfg, pm.params);
    const auto fresh = mem.make_state(1);
    CHECK(recall_error(mem, fresh, K, V, rng) > err[0]);
}

// memorisation of a nonlinear map v = cos(3k): a depth-2 memory beats the depth-1 matrix memory and
// every linear map (least-squares optimum)
TEST_CASE("memorisation: nonlinear map", "[memorization]") {
    const int rep = GENERATE(range(0, 3));
    Rng rng(seed_for("memorise-nonlinear", static_cast<std::uint64_t>(rep)));
    const int dh = 4, N = 24, epochs = 40;
    const Matrixd K = unit_keys(rng, N, dh);
    const Matrixd V = K.unaryExpr([](double k) { return std::cos(3.0 * k); });
    // The best any linear memory M(k) = k W can do: least squares.
    const Matrixd W_ls = (K.transpose() * K).ldlt().solve(K.transpose() * V);
    const double ls_error = (K * W_ls - V).squaredNorm() / V.squaredNorm();

    const std::uint64_t init_seed = rng();
    const std::vector<double> lin = memorise(pair_memory(dh, 1, 0.05, 0.5, 4, init_seed), K, V, epochs, rng);
    const std::vector<double> deep = memorise(pair_memory(dh, 2, 0.1, 0.5, 4, init_seed), K, V, epochs, rng);
    INFO("rep=" << rep << " least-squares linear error " << ls_error << ", depth 1: " << lin.back()
                << ", depth 2: " << deep.back() << " (after epoch 1: " << lin.front() << ", "
                << deep.front() << ")");
    CHECK(lin.back() >= ls_error * (1.0 - 1e-9));  // no linear memory beats least squares
    CHECK(deep.back() < 0.5 * ls_error);
    CHECK(deep.back() < 0.5 * lin.back());
    CHECK(deep.back() < 0.5 * deep.front());
}

// read() returns memory_forward(current_weights, q) through W_O, with q projected like forward's
// queries (conv continuing the stream), in every mode
TEMPLATE_TEST_CASE("read: == memory_forward", "[memorization][read]", float, double) {
    using T = TestType;
    const std::vector<Modes> primary = all_primary_modes();
    const int combo = GENERATE(range(0, 18));
    Rng rng(seed_for(std::string("read-vs-current-weights/") + type_name<T>(), static_cast<std::uint64_t>(combo)));
    const Modes m = random_flags(primary[static_cast<std::size_t>(combo % 9)], rng);
    const Case c = make_case<T>(m, rng(), Limits{.max_tokens = 20, .max_batch = 2, .max_depth = 3});
    const int B = c.batch, N = c.tokens, Nq = uniform_int(rng, 1, 6), dh = c.cfg.head_dim();
    INFO(c.describe() << " queries=" << Nq);
    const MemoryParams<T> pT = cast_params<T>(c.params);
    NeuralMemory<T> mem(c.cfg, pT);
    auto st = mem.make_state(B);
    (void)mem.forward(st, c.x.cast<T>().eval());
    const Matrixd xq = round_through<T>(random_matrix(static_cast<Eigen::Index>(B) * Nq, c.cfg.d_model, rng));
    const Matrix<T> y = mem.read(st, xq.cast<T>().eval());
    REQUIRE(y.rows() == xq.rows());
    REQUIRE(y.cols() == c.cfg.d_model);
    for (int b = 0; b < B; ++b) {
        // q of the queries as the continuation of sequence b's stream.
        Matrixd xs(N + Nq, c.cfg.d_model);
        xs << c.x.middleRows(static_cast<Eigen::Index>(b) * N, N), xq.middleRows(static_cast<Eigen::Index>(b) * Nq, Nq);
        const ref::QKV p = ref::project_qkv(c.cfg, c.params, xs);
        Matrixd yh(Nq, c.cfg.inner_dim());
        for (int h = 0; h < c.cfg.n_heads; ++h) {
            const auto W = cast_layers<double>(mem.current_weights(st, b, h));
            const Matrixd qh = p.q.block(N, h * dh, Nq, dh);
            yh.middleCols(h * dh, dh) = titans::memory_forward<double>(W, qh, c.cfg.activation, c.cfg.residual);
        }
        const Matrixd expect = yh * c.params.w_o;
        CHECK(note_error<T>("read vs memory_forward(current_weights)",
                            rel_error(y.middleRows(static_cast<Eigen::Index>(b) * Nq, Nq), expect)) <= tol<T>());
    }
    // An empty read is fine too.
    CHECK(mem.read(st, Matrix<T>(0, c.cfg.d_model)).rows() == 0);

    // read_weights: the same weights handed in, the query path without the conv.
    std::vector<std::vector<Matrix<T>>> weights;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < c.cfg.n_heads; ++h) weights.push_back(mem.current_weights(st, b, h));
    const Matrix<T> yw = mem.read_weights(weights, xq.cast<T>().eval(), B);
    titans::MemoryConfig no_conv = c.cfg;
    no_conv.use_conv = false;
    for (int b = 0; b < B; ++b) {
        const ref::QKV p = ref::project_qkv(no_conv, c.params, xq.middleRows(static_cast<Eigen::Index>(b) * Nq, Nq));
        Matrixd yh(Nq, c.cfg.inner_dim());
        for (int h = 0; h < c.cfg.n_heads; ++h) {
            const auto W = cast_layers<double>(weights[static_cast<std::size_t>(b * c.cfg.n_heads + h)]);
            yh.middleCols(h * dh, dh) = titans::memory_forward<double>(W, p.q.middleCols(h * dh, dh).eval(),
                                                                       c.cfg.activation, c.cfg.residual);
        }
        CHECK(note_error<T>("read_weights vs memory_forward(weights)",
                            rel_error(yw.middleRows(static_cast<Eigen::Index>(b) * Nq, Nq), yh * c.params.w_o)) <= tol<T>());
    }
    if (!c.cfg.use_conv) CHECK(identical(yw, y));  // without a conv, read() is read_weights(current)
    weights.pop_back();
    CHECK_THROWS_AS(mem.read_weights(weights, xq.cast<T>().eval(), B), titans::ShapeError);
    weights.push_back(mem.current_weights(st, B - 1, c.cfg.n_heads - 1));
    weights.back().back().resize(1, 1);
    CHECK_THROWS_AS(mem.read_weights(weights, xq.cast<T>().eval(), B), titans::ShapeError);
    CHECK_THROWS_AS(mem.read_weights(weights, xq.cast<T>().eval(), 0), titans::ConfigError);

    // snapshot / read_snapshot (MAC's segment-start read, kept in the backend's memory): the
    // same bits as read_weights through current_weights; to and from host weights unchanged.
    typename NeuralMemory<T>::Snapshot snap;
    mem.snapshot(st, snap);
    REQUIRE(snap.pairs() == static_cast<std::size_t>(B * c.cfg.n_heads));
    const Matrix<T> xqT = xq.cast<T>();
    Matrix<T> ys(xqT.rows(), c.cfg.d_model);
    mem.read_snapshot(snap, titans::view_of(xqT), B, titans::view_of(ys));
    CHECK(identical(ys, yw));
    const auto host = mem.snapshot_weights(snap);
    const auto current = mem.current_weights(st);
    REQUIRE(host.size() == current.size());
    for (std::size_t i = 0; i < host.size(); ++i) {
        CHECK(rel_error(host[i], current[i]) == 0.0);
    }
    const auto again = mem.make_snapshot(host, B);
    Matrix<T> ya(xqT.rows(), c.cfg.d_model);
    mem.read_snapshot(again, titans::view_of(xqT), B, titans::view_of(ya));
    CHECK(identical(ya, yw));
    if (B > 1) {  // a snapshot of B streams read as B - 1: refused, naming it
        Matrix<T> yb(xqT.rows() / B * (B - 1), c.cfg.d_model);
        const Matrix<T> xb = xqT.topRows(yb.rows());
        REQUIRE_THROWS_NAMING(mem.read_snapshot(snap, titans::view_of(xb), B - 1, titans::view_of(yb)),
                              titans::ShapeError, "snapshot.pairs()");
    }
    auto bad = host;
    bad.back().back().resize(1, 1);
    CHECK_THROWS_AS(mem.make_snapshot(bad, B), titans::ShapeError);
}

// read() leaves the state unchanged: a later forward gives the same outputs, diagnostics, weights
// and position as without the read
TEST_CASE("read: state unchanged", "[memorization][read]") {
    const std::vector<Modes> primary = all_primary_modes();
    for (std::size_t i = 0; i < primary.size(); ++i) {
        Rng rng(seed_for("read-leaves-state", i));
        const Modes m = random_flags(primary[i], rng);
        const Case c = make_case<double>(m, rng(), Limits{.max_tokens = 20, .max_batch = 2, .max_depth = 3},
                                         [](Case& d) {
                                             if (d.cfg.update == UpdateMode::Chunked) d.cfg.chunk = 5;  // reads mid-chunk
                                         });
        INFO(c.describe());
        const int B = c.batch;
        NeuralMemory<double> mem(c.cfg, c.params);
        auto with_read = mem.make_state(B);
        auto without = mem.make_state(B);
        const Matrixd x1 = random_matrix(3 * B, c.cfg.d_model, rng);
        const Matrixd x2 = random_matrix(7 * B, c.cfg.d_model, rng);
        (void)mem.forward(with_read, x1);
        (void)mem.forward(without, x1);
        const Matrixd q = random_matrix(4 * B, c.cfg.d_model, rng);
        const Matrixd r1 = mem.read(with_read, q);
        const Matrixd r2 = mem.read(with_read, q);
        CHECK(identical(r1, r2));
        CHECK(with_read.position() == without.position());
        Diagnostics<double> d1, d2;
        const Matrixd y1 = mem.forward(with_read, x2, &d1);
        const Matrixd y2 = mem.forward(without, x2, &d2);
        CHECK(identical(y1, y2));
        CHECK(identical(d1.loss, d2.loss));
        CHECK(with_read.position() == without.position());
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < c.cfg.n_heads; ++h) {
                const auto wa = mem.current_weights(with_read, b, h), wb = mem.current_weights(without, b, h);
                const auto sa = mem.current_momentum(with_read, b, h), sb = mem.current_momentum(without, b, h);
                for (std::size_t l = 0; l < wa.size(); ++l) {
                    CHECK(identical(wa[l], wb[l]));
                    CHECK(identical(sa[l], sb[l]));
                }
            }
    }
}
