// The backward passes of the stateless layers (math §9): RMSNorm and FeedForward (SwiGLU and
// GELU) against central finite differences in double, on the CPU and on the simulated device
// (tests/backends.hpp); the training forward against forward; gradients that add up over calls
// and pieces; the refusals of backward, which leave the gradients as they were.
//
// The loss is L = Σ dy ⊙ y for a fixed random dy, so dL/dy = dy and every derivative of L is
// one backward call.
#include "backends.hpp"

#include <string>
#include <vector>

using namespace titans_test;
using titans::FeedForward;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::RMSNorm;
using titans::RowVector;

namespace {

double dot(const Matrixd& a, const Matrixd& b) { return a.cwiseProduct(b).sum(); }

/// The inputs real streams have: random, one constant row repeated, tiny, huge; and rows at
/// double's extremes: 1e-300 (mean square underflows), 1e300 (1 / rms^3 underflows), 1e308
/// (the sum of squares overflows, 1 / rms is subnormal).
enum class Input { Random, Constant, Tiny, Huge, Smallest, Extreme, Largest };
constexpr double input_scale(Input k) {
    switch (k) {
        case Input::Tiny: return 1e-3;
        case Input::Huge: return 1e3;
        case Input::Smallest: return 1e-300;
        case Input::Extreme: return 1e300;
        case Input::Largest: return 1e308;
        default: return 1.0;
    }
}
Matrixd make_input(Input k, Eigen::Index rows, Eigen::Index d, Rng& rng) {
    if (k == Input::Constant) {
        return Matrixd::Constant(rows, d, uniform(rng, 0.2, 2.0));
    }
    return random_matrix(rows, d, rng) * input_scale(k);
}

FeedForwardConfig small_ffn(FeedForwardKind kind, Rng& rng) {
    return FeedForwardConfig{.d_model = uniform_int(rng, 1, 5), .kind = kind,
                             .hidden = uniform_int(rng, 1, 7)};
}

/// dx and the parameter gradients of one layer call, as host matrices.
struct LayerGrads {
    Matrixd dx;
    std::vector<Matrixd> params;
};

template <class T, class B>
LayerGrads norm_grads(const RMSNorm<T, B>& norm, const Matrix<T>& x, const Matrix<T>& dy) {
    typename RMSNorm<T, B>::Trace trace;
    Matrix<T> y, dx;
    norm.forward(x, y, trace);
    RowVector<T> g = RowVector<T>::Zero(norm.dim());
    norm.backward(trace, dy, dx, g);
    return {dx.template cast<double>(), {Matrixd(g.template cast<double>())}};
}

template <class T, class B>
LayerGrads ffn_grads(const FeedForward<T, B>& ff, const Matrix<T>& x, const Matrix<T>& dy) {
    typename FeedForward<T, B>::Trace trace;
    Matrix<T> y, dx;
    ff.forward(x, y, trace);
    auto g = FeedForwardParams<T>::zeros(ff.config());
    ff.backward(trace, dy, dx, g);
    LayerGrads out{dx.template cast<double>(), {}};
    FeedForwardParams<T>::tensors(g, ff.config(), [&](const std::string&, Matrix<T>& m) {
        out.params.push_back(m.template cast<double>());
    });
    return out;
}

}  // namespace

// dL/dx and dL/dweight of RMSNorm against central differences (d 1..8, eps 1e-6 and 0.5, one
// row and several, random / constant / tiny / huge rows, rows at double's extremes): relative
// error <= 1e-6.
TEMPLATE_LIST_TEST_CASE("norm: backward vs FD", "[backward]", BothD) {
    using B = typename TestType::Backend;
    const Input kind = GENERATE(Input::Random, Input::Constant, Input::Tiny, Input::Huge,
                                Input::Smallest, Input::Extreme, Input::Largest);
    const double eps = GENERATE(1e-6, 0.5);
    const int rep = GENERATE(range(0, 3));
    const std::uint64_t seed = seed_for("norm-fd", static_cast<std::uint64_t>(
                                                       static_cast<int>(kind) * 8 + rep * 2 + (eps > 0.1)));
    Rng rng(seed);
    const int d = uniform_int(rng, 1, 8), rows = uniform_int(rng, 1, 4);
    Matrixd x = make_input(kind, rows, d, rng);
    Matrixd w = random_matrix(1, d, rng, 0.5, 1.5);
    const Matrixd dy = random_matrix(rows, d, rng);
    INFO("seed=" << seed << " d=" << d << " rows=" << rows << " eps=" << eps
                 << " input=" << static_cast<int>(kind));
    const auto loss = [&]() {
        const RMSNorm<double, B> n(RowVector<double>(w), eps);
        return dot(dy, n.forward(x));
    };
    const LayerGrads g = norm_grads(RMSNorm<double, B>(RowVector<double>(w), eps), x, dy);
    const double s = input_scale(kind);
    // Relative to the size of dx's terms, max_r |dy_r ⊙ w| / rms_r: where they cancel (d = 1:
    // dx = eps dy w / rms^3, 1e-9 of them for |x| ~ 1e3) central differences resolve the
    // remainder only to rounding / step, not to 1e-6 of itself.
    double terms = 0.0;
    for (Eigen::Index r = 0; r < rows; ++r) {
        const double inv_rms = static_cast<double>(
            1.0L / std::sqrt(x.row(r).cast<long double>().squaredNorm() / d + eps));
        terms = std::max(terms, inv_rms * dy.row(r).cwiseProduct(w).cwiseAbs().maxCoeff());
    }
    CHECK(note_error<double>("backward:norm dx", rel_error(g.dx, central_diff(x, 1e-5 * s, loss), terms)) <=
          1e-6);
    CHECK(note_error<double>("backward:norm dw", rel_error(g.params[0], central_diff(w, 1e-5, loss))) <=
          1e-6);
}

// dL/dx, dL/dW1, dL/dW3, dL/dW2 of FeedForward (SwiGLU and GELU) against central differences.
TEMPLATE_LIST_TEST_CASE("ffn: backward vs FD", "[backward]", BothD) {
    using B = typename TestType::Backend;
    const FeedForwardKind kind = GENERATE(FeedForwardKind::SwiGLU, FeedForwardKind::GELU);
    const Input input = GENERATE(Input::Random, Input::Constant, Input::Huge);
    const int rep = GENERATE(range(0, 3));
    const std::uint64_t seed = seed_for("ffn-fd", static_cast<std::uint64_t>(
        (static_cast<int>(kind) * 4 + static_cast<int>(input)) * 4 + rep));
    Rng rng(seed);
    const FeedForwardConfig cfg = small_ffn(kind, rng);
    const int rows = uniform_int(rng, 1, 4);
    // Huge inputs saturate the activations: a scale of 30 reaches their tails (|x W| ~ 50).
    const double s = input == Input::Huge ? 30.0 : 1.0;
    Matrixd x = input == Input::Huge ? Matrixd(random_matrix(rows, cfg.d_model, rng) * s)
                                     : make_input(input, rows, cfg.d_model, rng);
    auto p = FeedForwardParams<double>::random(cfg, seed);
    const Matrixd dy = random_matrix(rows, cfg.d_model, rng);
    INFO("seed=" << seed << " d=" << cfg.d_model << " h=" << cfg.hidden << " rows=" << rows
                 << " kind=" << titans::to_string(kind));
    const auto loss = [&]() { return dot(dy, FeedForward<double, B>(cfg, p).forward(x)); };
    const LayerGrads g = ffn_grads(FeedForward<double, B>(cfg, p), x, dy);
    // Ridders' extrapolation, not one central difference: where huge inputs reach GELU's tails
    // (|z| ~ 20) one step's truncation is (z h)^2 / 6 of the gradient, above 1e-6.
    CHECK(note_error<double>("backward:ffn dx", rel_error(g.dx, ridders_diff(x, 1e-4 * s, loss))) <= 1e-6);
    std::size_t i = 0;
    FeedForwardParams<double>::tensors(p, cfg, [&](const std::string& name, Matrixd& m) {
        INFO("d" << name);
        CHECK(note_error<double>("backward:ffn dW", rel_error(g.params[i++], ridders_diff(m, 1e-4, loss))) <=
              1e-6);
    });
}

// The training forward gives forward's bits (RMSNorm also in place); gradients add up: two
// backward calls give twice one, and rows split into two pieces give the whole call's dx and,
// summed, its parameter gradients.
TEMPLATE_LIST_TEST_CASE("layers: grads add up", "[backward]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    Rng rng(seed_for("grads-add"));
    const FeedForwardConfig cfg = small_ffn(FeedForwardKind::SwiGLU, rng);
    const int rows = uniform_int(rng, 2, 6), k = uniform_int(rng, 1, rows - 1);
    const Matrix<T> x = random_matrix(rows, cfg.d_model, rng).cast<T>();
    const Matrix<T> dy = random_matrix(rows, cfg.d_model, rng).cast<T>();
    const RMSNorm<T, B> norm(random_matrix(1, cfg.d_model, rng).cast<T>().eval());
    const FeedForward<T, B> ff(cfg, FeedForwardParams<T>::random(cfg, 7));

    typename RMSNorm<T, B>::Trace nt;
    Matrix<T> y = x;
    norm.forward(y, y, nt);  // in place
    CHECK(identical(y, norm.forward(x)));
    typename FeedForward<T, B>::Trace ft;
    Matrix<T> z;
    ff.forward(x, z, ft);
    CHECK(identical(z, ff.forward(x)));

    // Twice one call.
    RowVector<T> gw = RowVector<T>::Zero(cfg.d_model);
    auto gp = FeedForwardParams<T>::zeros(cfg);
    Matrix<T> dx;
    for (int i = 0; i < 2; ++i) {
        norm.backward(nt, dy, dx, gw);
        ff.backward(ft, dy, dx, gp);
    }
    const LayerGrads n1 = norm_grads(norm, x, dy), f1 = ffn_grads(ff, x, dy);
    CHECK(identical(Matrixd(gw.template cast<double>()), Matrixd(2 * n1.params[0])));
    CHECK(identical(gp.w1.template cast<double>(), 2 * f1.params[0]));
    CHECK(identical(gp.w2.template cast<double>(), 2 * f1.params[2]));

    // Two pieces.
    const LayerGrads a = ffn_grads(ff, x.topRows(k).eval(), dy.topRows(k).eval());
    const LayerGrads b = ffn_grads(ff, x.bottomRows(rows - k).eval(), dy.bottomRows(rows - k).eval());
    CHECK(rel_error(a.dx, f1.dx.topRows(k)) <= tol<T>());
    CHECK(rel_error(b.dx, f1.dx.bottomRows(rows - k)) <= tol<T>());
    for (std::size_t i = 0; i < f1.params.size(); ++i) {
        CHECK(rel_error(a.params[i] + b.params[i], f1.params[i]) <= 10 * tol<T>());
    }
    const LayerGrads na = norm_grads(norm, x.topRows(k).eval(), dy.topRows(k).eval());
    const LayerGrads nb = norm_grads(norm, x.bottomRows(rows - k).eval(), dy.bottomRows(rows - k).eval());
    CHECK(identical(na.dx, n1.dx.topRows(k)));
    CHECK(rel_error(na.params[0] + nb.params[0], n1.params[0]) <= 10 * tol<T>());
}

// The device computes the CPU's bits.
TEMPLATE_TEST_CASE("layers: backward on device", "[backward]", float, double) {
    using T = TestType;
    using Cpu = titans::backend::Cpu;
    Rng rng(seed_for("backward-device"));
    for (const FeedForwardKind kind : {FeedForwardKind::SwiGLU, FeedForwardKind::GELU}) {
        const FeedForwardConfig cfg = small_ffn(kind, rng);
        const Matrix<T> x = random_matrix(5, cfg.d_model, rng).cast<T>();
        const Matrix<T> dy = random_matrix(5, cfg.d_model, rng).cast<T>();
        const auto p = FeedForwardParams<T>::random(cfg, 11);
        const LayerGrads c = ffn_grads(FeedForward<T, Cpu>(cfg, p), x, dy);
        const LayerGrads s = ffn_grads(FeedForward<T, SimulatedDevice>(cfg, p), x, dy);
        CHECK(identical(c.dx, s.dx));
        for (std::size_t i = 0; i < c.params.size(); ++i) CHECK(identical(c.params[i], s.params[i]));
        const RowVector<T> w = random_matrix(1, cfg.d_model, rng).cast<T>();
        const LayerGrads nc = norm_grads(RMSNorm<T, Cpu>(w), x, dy);
        const LayerGrads ns = norm_grads(RMSNorm<T, SimulatedDevice>(w), x, dy);
        CHECK(identical(nc.dx, ns.dx));
        CHECK(identical(nc.params[0], ns.params[0]));
    }
}

// backward refuses an empty trace, a dy of the wrong shape or with a NaN, gradients of the
// wrong shape and a dx sharing dy's storage, and changes nothing then; a failed training
// forward leaves the trace as it was.
TEMPLATE_LIST_TEST_CASE("layers: backward refusals", "[backward][errors]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    Rng rng(seed_for("backward-refusals"));
    const FeedForwardConfig cfg{.d_model = 4, .kind = FeedForwardKind::SwiGLU, .hidden = 6};
    const FeedForward<T, B> ff(cfg, FeedForwardParams<T>::random(cfg, 3));
    const RMSNorm<T, B> norm(4);
    const Matrix<T> x = random_matrix(3, 4, rng).cast<T>();
    Matrix<T> dy = random_matrix(3, 4, rng).cast<T>();
    Matrix<T> y, dx;
    typename FeedForward<T, B>::Trace ft;
    typename RMSNorm<T, B>::Trace nt;
    auto gp = FeedForwardParams<T>::random(cfg, 5);
    const auto gp0 = gp;
    RowVector<T> gw = RowVector<T>::Constant(4, T(0.25));
    const auto unchanged = [&]() {
        return identical(gp.w1, gp0.w1) && identical(gp.w2, gp0.w2) && identical(gp.w3, gp0.w3) &&
               identical(gw, RowVector<T>::Constant(4, T(0.25)));
    };

    CHECK(ft.empty());
    CHECK_THROWS_AS(ff.backward(ft, dy, dx, gp), titans::ShapeError);
    CHECK_THROWS_AS(norm.backward(nt, dy, dx, gw), titans::ShapeError);
    ff.forward(x, y, ft);
    norm.forward(x, y, nt);
    CHECK(ft.rows() == 3);
    CHECK_THROWS_AS(ff.backward(ft, dy.topRows(2), dx, gp), titans::ShapeError);
    CHECK_THROWS_AS(norm.backward(nt, dy.leftCols(3), dx, gw), titans::ShapeError);
    auto bad = FeedForwardParams<T>::zeros(FeedForwardConfig{.d_model = 4, .hidden = 5});
    CHECK_THROWS_AS(ff.backward(ft, dy, dx, bad), titans::ShapeError);
    RowVector<T> gw_bad = RowVector<T>::Zero(5);
    CHECK_THROWS_AS(norm.backward(nt, dy, dx, gw_bad), titans::ShapeError);
    CHECK_THROWS_AS(ff.backward(ft, dy, dy, gp), titans::ShapeError);  // dx is dy
    dy(1, 2) = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_AS(ff.backward(ft, dy, dx, gp), titans::NonFiniteError);
    CHECK_THROWS_AS(norm.backward(nt, dy, dx, gw), titans::NonFiniteError);
    CHECK(unchanged());
    RowVector<T> gw_nan = gw;  // a gradient already NaN is refused too, as FeedForward's
    gw_nan(1) = std::numeric_limits<T>::quiet_NaN();
    dy(1, 2) = T(0.5);
    CHECK_THROWS_AS(norm.backward(nt, dy, dx, gw_nan), titans::NonFiniteError);
    dy(1, 2) = std::numeric_limits<T>::quiet_NaN();

    // A failed training forward keeps the old trace.
    Matrix<T> xn = x;
    xn(0, 0) = std::numeric_limits<T>::infinity();
    CHECK_THROWS_AS(ff.forward(xn, y, ft), titans::NonFiniteError);
    CHECK_THROWS_AS(norm.forward(xn, y, nt), titans::NonFiniteError);
    CHECK(ft.rows() == 3);
    dy(1, 2) = T(0.5);
    ff.backward(ft, dy, dx, gp);
    norm.backward(nt, dy, dx, gw);
    CHECK(!unchanged());
    // A trace of another width.
    const RMSNorm<T, B> wide(5);
    CHECK_THROWS_AS(wide.backward(nt, dy, dx, gw_bad), titans::ShapeError);
}
