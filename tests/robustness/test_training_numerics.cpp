// RMSNorm on rows whose sum of squares overflows or underflows the scalar type (math §7 and its
// backward of math §9): forward, training forward and backward are right for every finite row
// (huge rows near the type's largest value, rows mixing huge and tiny entries, tiny and
// subnormal rows, rows of zeros), against a reference in long double, on the CPU and on the
// simulated device, float and double; and ordinary rows keep the plain formula's bits.
//
// Before the scaled path, a row at 1e38 (float) or 1e308 (double) squared to infinity: the
// forward returned zeros, the backward zeros or NaN, without an error.

#include "../backends.hpp"

#include <titans/detail/norm_scale.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

using namespace titans_test;
using titans::RMSNorm;
using titans::RowVector;

namespace {

using LongMatrix = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// RMSNorm's forward, dx, dweight and, per row, the size of dx's terms (1 / rms max |dy ⊙ w|),
/// in long double (range to 1e4932: no square of a float or double overflows there).
struct NumericsNormReference {
    LongMatrix y, dx, dw;
    std::vector<long double> dx_terms;
};

template <class T>
NumericsNormReference numerics_norm_reference(const Matrix<T>& x, const RowVector<T>& w,
                                              const Matrix<T>& dy, double eps) {
    const LongMatrix xl = x.template cast<long double>(), dyl = dy.template cast<long double>();
    const LongMatrix wl = w.template cast<long double>();
    const auto d = static_cast<long double>(x.cols());
    NumericsNormReference ref{LongMatrix(x.rows(), x.cols()), LongMatrix(x.rows(), x.cols()),
                              LongMatrix::Zero(1, x.cols()), {}};
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
        const long double inv = 1.0L / std::sqrt(xl.row(r).squaredNorm() / d + eps);
        const LongMatrix u = dyl.row(r).cwiseProduct(wl);
        ref.y.row(r) = xl.row(r).cwiseProduct(wl) * inv;
        ref.dx.row(r) = u * inv - xl.row(r) * (inv * inv * inv * u.row(0).dot(xl.row(r)) / d);
        ref.dw += dyl.row(r).cwiseProduct(xl.row(r)) * inv;
        ref.dx_terms.push_back(inv * u.cwiseAbs().maxCoeff());
    }
    return ref;
}

/// max |a - b| / max(|b| over the row, floor) of row r, in long double.
template <class A>
long double numerics_row_error(const A& a, const LongMatrix& b, Eigen::Index r,
                               long double floor) {
    long double num = 0, den = floor;
    for (Eigen::Index j = 0; j < b.cols(); ++j) {
        const auto v = static_cast<long double>(a(r, j));
        if (!std::isfinite(v)) return std::numeric_limits<long double>::infinity();
        num = std::max(num, std::abs(v - b(r, j)));
        den = std::max(den, std::abs(b(r, j)));
    }
    return num / den;
}

/// The rows real streams and hostile ones have, at T's extremes.
enum class NumericsRow { Ordinary, Huge, NearMax, ConstantHuge, HugeAndTiny, OneHuge, Tiny,
                         Subnormal, Zeros, TinyAndOrdinary };
constexpr int numerics_row_kinds = 10;

template <class T>
void numerics_fill_row(NumericsRow kind, Eigen::Ref<Matrix<T>> row, Rng& rng) {
    using L = std::numeric_limits<T>;
    const double big = std::is_same_v<T, float> ? 1e38 : 1e308;
    const double tiny = std::is_same_v<T, float> ? 1e-30 : 1e-300;
    const double sub = std::is_same_v<T, float> ? 1e-40 : 1e-310;
    const double c = uniform(rng, 0.2, 0.9) * big;
    for (Eigen::Index j = 0; j < row.cols(); ++j) {
        const double u = uniform(rng);
        const double s = u < 0 ? -1.0 : 1.0;
        double v = u;
        switch (kind) {
            case NumericsRow::Ordinary: v = u; break;
            case NumericsRow::Huge: v = u * big; break;
            case NumericsRow::NearMax: v = s * uniform(rng, 0.5, 1.0) * double(L::max()); break;
            case NumericsRow::ConstantHuge: v = c; break;
            case NumericsRow::HugeAndTiny: v = u * (j % 2 == 0 ? big : tiny); break;
            case NumericsRow::OneHuge: v = j == 0 ? s * big : u * tiny; break;
            case NumericsRow::Tiny: v = u * tiny; break;
            case NumericsRow::Subnormal: v = u * sub; break;
            case NumericsRow::Zeros: v = s * 0.0; break;  // +0 and -0
            case NumericsRow::TinyAndOrdinary: v = u * (j % 3 == 0 ? 1.0 : tiny); break;
        }
        row(0, j) = static_cast<T>(v);
    }
}

}  // namespace

// Rows of every kind above (each kind in every draw, in a random order), widths across 1..300,
// eps 1e-6, 0.5 and the smallest T allows (where tiny rows are not drowned by eps): forward and
// training forward give the same bits and match the reference row by row; dx row by row
// relative to its terms, dweight overall; a row of zeros gives exact zeros and dx = dy ⊙ w /
// sqrt(eps).
TEMPLATE_LIST_TEST_CASE("numerics: norm extremes", "[numerics][backward]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    const double eps = GENERATE(1e-6, 0.5, double(std::numeric_limits<T>::min()));
    const int draw = GENERATE(range(0, 4));
    const std::uint64_t seed = seed_for("numerics rms extreme", std::uint64_t(draw) * 8 +
                                                                    (eps < 1e-20) * 2 + (eps > 0.1));
    Rng rng(seed);
    const int d = pick(rng, std::vector<int>{1, 2, 3, 7, 16, 33, 64, 300});
    std::vector<int> kinds(2 * numerics_row_kinds);
    for (int i = 0; i < 2 * numerics_row_kinds; ++i) kinds[std::size_t(i)] = i % numerics_row_kinds;
    std::shuffle(kinds.begin(), kinds.end(), rng);
    Matrix<T> x(Eigen::Index(kinds.size()), d);
    for (std::size_t r = 0; r < kinds.size(); ++r) {
        numerics_fill_row<T>(NumericsRow(kinds[r]), x.row(Eigen::Index(r)), rng);
    }
    const RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).template cast<T>();
    const Matrix<T> dy = random_matrix(x.rows(), d, rng).template cast<T>();
    INFO("seed=" << seed << " d=" << d << " eps=" << eps << " " << type_name<T>());
    const RMSNorm<T, B> norm(w, eps);
    const NumericsNormReference ref = numerics_norm_reference(x, w, dy, eps);

    const Matrix<T> y = norm.forward(x);
    Matrix<T> yt, in_place = x, dx;
    typename RMSNorm<T, B>::Trace trace;
    norm.forward(x, yt, trace);
    norm.forward(in_place, in_place);
    CHECK(identical(yt, y));
    CHECK(identical(in_place, y));
    RowVector<T> dw = RowVector<T>::Zero(d);
    norm.backward(trace, dy, dx, dw);
    // Subnormal outputs are only as precise as T's spacing there: no smaller error counts.
    const long double floor = 2.0L * std::numeric_limits<T>::denorm_min() / tol<T>();
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
        INFO("row " << r << " kind " << kinds[std::size_t(r)] << " x(r, 0) = " << x(r, 0));
        CHECK(double(numerics_row_error(y, ref.y, r, floor)) <= tol<T>());
        CHECK(double(numerics_row_error(dx, ref.dx, r, ref.dx_terms[std::size_t(r)])) <= tol<T>());
        if (kinds[std::size_t(r)] == int(NumericsRow::Zeros)) {
            CHECK(y.row(r).cwiseAbs().maxCoeff() == T(0));
        }
    }
    CHECK(double(numerics_row_error(dw, ref.dw, 0, floor)) <= tol<T>());
}

// A constant row of huge entries normalises to sign(x) ⊙ w (x / rms = ±1 exactly in the
// reals), and a row scaled by a power of two gives the same output as the row itself: the
// scaled path is the plain one on the scaled row.
TEMPLATE_LIST_TEST_CASE("numerics: norm scaling", "[numerics]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    Rng rng(seed_for("numerics rms scale"));
    const int d = uniform_int(rng, 2, 80);
    const RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).template cast<T>();
    const RMSNorm<T, B> norm(w, 4 * double(std::numeric_limits<T>::min()));  // eps negligible
    const Matrix<T> x = random_matrix(3, d, rng, 0.5, 1.0).template cast<T>();
    const int top = std::numeric_limits<T>::max_exponent - 1 - 7;  // |x 2^top| <= max / 2^7
    for (int k : {top - 20, top - 2, top}) {
        INFO("2^" << k << " " << type_name<T>());
        const Matrix<T> scaled = x.unaryExpr([k](T v) { return std::ldexp(v, k); });
        CHECK(rel_error(norm.forward(scaled), norm.forward(x)) <= tol<T>());
    }
    const T c = std::ldexp(T(1.5), top);
    const Matrix<T> constant = Matrix<T>::Constant(2, d, c);
    const Matrix<T> y = norm.forward(constant);
    CHECK(rel_error(y.row(0), w) <= tol<T>());
    CHECK(rel_error(y.row(1), w) <= tol<T>());
}

// The scale exponent of a row whose largest magnitude is zero, infinite or NaN is 0 (ilogb gives
// INT_MIN or INT_MAX there, and scale_down negated it: signed overflow, caught by UBSan in the
// CUDA q / k norm of a NaN row), and scale_down is then the identity; finite magnitudes keep
// ilogb's exponent, subnormal ones included.
TEMPLATE_TEST_CASE("numerics: scale exp edges", "[numerics]", float, double) {
    using T = TestType;
    using L = std::numeric_limits<T>;
    for (T v : {T(0), -T(0), L::infinity(), L::quiet_NaN(), -L::infinity()}) {
        INFO(v);
        CHECK(titans::detail::scale_exponent(std::fabs(v)) == 0);
    }
    CHECK(titans::detail::scale_down(T(3), titans::detail::scale_exponent(T(0))) == T(3));
    CHECK(std::isnan(titans::detail::scale_down(L::quiet_NaN(), 0)));
    CHECK(titans::detail::scale_exponent(L::max()) == L::max_exponent - 1);
    CHECK(titans::detail::scale_exponent(L::denorm_min()) == L::min_exponent - L::digits);
    CHECK(titans::detail::scale_exponent(T(1.5)) == 0);
    CHECK(titans::detail::scale_exponent(T(0.75)) == -1);
}

// A huge gradient dy on large rows: dy ⊙ x and <dy ⊙ w, x> overflow T though dx and dweight
// are finite (dy x / rms); the backward takes those rows through x / rms.
TEMPLATE_LIST_TEST_CASE("numerics: norm huge dy", "[numerics][backward]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    const bool f = std::is_same_v<T, float>;
    Rng rng(seed_for("numerics rms huge dy"));
    const int d = uniform_int(rng, 2, 40);
    const Matrix<T> x = (random_matrix(3, d, rng) * (f ? 1e10 : 1e100)).template cast<T>();
    const Matrix<T> dy = (random_matrix(3, d, rng) * (f ? 1e30 : 1e250)).template cast<T>();
    const RowVector<T> w = random_matrix(1, d, rng, 0.5, 1.5).template cast<T>();
    const RMSNorm<T, B> norm(w);
    const NumericsNormReference ref = numerics_norm_reference(x, w, dy, norm.eps());
    typename RMSNorm<T, B>::Trace trace;
    Matrix<T> y, dx;
    norm.forward(x, y, trace);
    RowVector<T> dw = RowVector<T>::Zero(d);
    norm.backward(trace, dy, dx, dw);
    INFO("d=" << d << " " << type_name<T>());
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
        CHECK(double(numerics_row_error(dx, ref.dx, r, ref.dx_terms[std::size_t(r)])) <= tol<T>());
    }
    CHECK(double(numerics_row_error(dw, ref.dw, 0, 0.0L)) <= tol<T>());
}

// The memory's q / k L2 normalisation on inputs whose heads' sums of squares overflow T: with
// no learning (theta = 0) and the identity for phi, the output depends on x only through the
// normalised queries, so x and x 2^k (k up to 110 in float, 1000 in double) give the same
// output, and (training, where the backend has it) dx scaled by 2^-k and the same W_Q
// gradient. Before, such heads were divided by an infinite norm: zero queries, zero gradients.
TEMPLATE_LIST_TEST_CASE("numerics: memory qk norm", "[numerics][memory]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    const bool f = std::is_same_v<T, float>;
    const bool conv = GENERATE(false, true);
    Rng rng(seed_for("numerics memory qk norm", conv));
    MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 2, .chunk = 4};
    cfg.gates = GateMode::Constant;
    cfg.constant_theta = 0.0;
    cfg.qkv_activation = Activation::Identity;
    cfg.use_conv = conv;
    cfg.max_grad_norm = 0;  // the clipping norm's own overflow is another matter
    const NeuralMemory<T, B> mem(cfg, MemoryParams<T>::random(cfg, rng()));
    const Matrix<T> x = random_matrix(8, cfg.d_model, rng).template cast<T>();
    const Matrix<T> dy = random_matrix(8, cfg.d_model, rng).template cast<T>();
    auto state = mem.make_state(1);
    const Matrix<T> y = mem.forward(state, x);
    for (int k : f ? std::vector<int>{70, 110} : std::vector<int>{600, 1000}) {
        INFO("x 2^" << k << " conv " << conv << " " << type_name<T>());
        const Matrix<T> xs = x.unaryExpr([k](T v) { return std::ldexp(v, k); });
        auto st = mem.make_state(1);
        CHECK(rel_error(mem.forward(st, xs), y) <= tol<T>());
        if constexpr (titans::backend::MemoryTraining<B, T>::available) {
            typename NeuralMemory<T, B>::Trace t1, t2;
            Matrix<T> y1, y2, dx1, dx2;
            auto s1 = mem.make_state(1), s2 = mem.make_state(1);
            mem.forward(s1, x, y1, t1);
            mem.forward(s2, xs, y2, t2);
            auto g1 = MemoryParams<T>::zeros(cfg), g2 = g1;
            mem.backward(t1, dy, dx1, g1);
            mem.backward(t2, dy, dx2, g2);
            const Matrix<T> dx2_back = dx2.unaryExpr([k](T v) { return std::ldexp(v, k); });
            CHECK(rel_error(dx2_back, dx1) <= tol<T>());
            CHECK(rel_error(g2.w_q, g1.w_q) <= tol<T>());
            CHECK(g1.w_q.cwiseAbs().maxCoeff() > T(0));
        }
    }
}

// math §10's clipping where the gradient norm's square overflows T: with q / k normalised,
// identity activations and constant gates, scaling x by 2^k scales v and every delta by about
// 2^k (M(k) is O(1) beside v), so the clipped update theta c (a delta^T) / ||grad|| and the
// outputs are the same at a scale whose squared norm is finite (2^s1) and at one where it
// overflows (2^s2); the diagnostics' gradient norm grows by 2^(s2 - s1), the training
// gradients of the projections are the same and dx shrinks by 2^-(s2 - s1). Before the scaled
// norm, g2 = inf gave a clip factor of 0 (the memory silently stopped learning), an infinite
// gradient norm and zero adjoints through the clipping.
TEMPLATE_LIST_TEST_CASE("numerics: clip overflow", "[numerics][memory]", Both) {
    using T = typename TestType::Scalar;
    using B = typename TestType::Backend;
    const bool f = std::is_same_v<T, float>;
    const bool conv = GENERATE(false, true);
    Rng rng(seed_for("numerics memory clip overflow", conv));
    MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 2, .chunk = 4};
    cfg.gates = GateMode::Constant;
    cfg.constant_theta = 0.5;
    cfg.qkv_activation = Activation::Identity;
    cfg.use_conv = conv;
    cfg.max_grad_norm = 1.0;
    const NeuralMemory<T, B> mem(cfg, MemoryParams<T>::random(cfg, rng()));
    const Matrix<T> x = random_matrix(12, cfg.d_model, rng, 0.5, 1.0).template cast<T>();
    const Matrix<T> dy = random_matrix(12, cfg.d_model, rng).template cast<T>();
    const int s1 = f ? 40 : 400, s2 = f ? 80 : 540;
    const auto scaled = [&](int k) { return Matrix<T>(x.unaryExpr([k](T v) { return std::ldexp(v, k); })); };
    titans::Diagnostics<T> d1, d2;
    auto st1 = mem.make_state(1), st2 = mem.make_state(1);
    const Matrix<T> y1 = mem.forward(st1, scaled(s1), &d1);
    const Matrix<T> y2 = mem.forward(st2, scaled(s2), &d2);
    INFO(type_name<T>() << " conv " << conv);
    CHECK(rel_error(y2, y1) <= tol<T>());
    const Matrix<T> g2_back = d2.grad_norm.unaryExpr([&](T v) { return std::ldexp(v, s1 - s2); });
    CHECK(rel_error(g2_back, d1.grad_norm) <= tol<T>());
    CHECK(d1.grad_norm.minCoeff() > T(1));  // every token clipped
    if constexpr (titans::backend::MemoryTraining<B, T>::available) {
        typename NeuralMemory<T, B>::Trace t1, t2;
        Matrix<T> z1, z2, dx1, dx2;
        auto a1 = mem.make_state(1), a2 = mem.make_state(1);
        mem.forward(a1, scaled(s1), z1, t1);
        mem.forward(a2, scaled(s2), z2, t2);
        CHECK(rel_error(z2, z1) <= tol<T>());
        auto g1 = MemoryParams<T>::zeros(cfg), g2 = g1;
        mem.backward(t1, dy, dx1, g1);
        mem.backward(t2, dy, dx2, g2);
        const Matrix<T> dx2_back = dx2.unaryExpr([&](T v) { return std::ldexp(v, s2 - s1); });
        CHECK(rel_error(dx2_back, dx1) <= tol<T>());
        CHECK(rel_error(g2.w_v, g1.w_v) <= tol<T>());
        CHECK(rel_error(g2.w_k, g1.w_k) <= tol<T>());
        CHECK(g1.w_k.cwiseAbs().maxCoeff() > T(0));
    }
}
