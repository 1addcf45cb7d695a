#pragma once
// tests/test_common.hpp: helpers shared by the titans test files.
//
//   rel_error(a, b)          max|a - b| / max(max|b|, floor), computed in double (inf on a shape
//                            mismatch or a non-finite entry)
//   tol<T>()                 math §8: 1e-12 for double, 1e-5 for float
//   seed_for(name, i)        a seed per test and case; TITANS_TEST_SEED=<n> in the environment
//                            mixes in n, so every run can draw fresh inputs
//   random_matrix(r, c, rng) uniform in [-1, 1] (never all zeros)
//   cast_params<To>(p)       MemoryParams<From> -> MemoryParams<To>
//   Case / make_case<T>()    a random configuration (shapes drawn from a seed, modes given),
//                            random parameters and inputs, with the float-rounded double copies
//                            the reference runs on
//   run_library<T>()         one forward call of the library + every (b, h) weight/momentum
//   note_error<T>(cat, e)    records the largest error per category; with
//                            TITANS_TEST_ERRORS=1 in the environment the maxima are printed at
//                            exit (used to report the observed precision)
//
// Float tests make parameters and inputs in double, round them to float, run the float library
// and run the double reference on the rounded values cast back to double, so both see the
// same numbers.
//
// Which random cases are used is decided by the double reference only, never by the library:
// a draw whose exact test-time learning diverges (|values| > 100) is redrawn, and for float a
// draw whose exact result moves by more than 1e-6 when every input is jiggled by a relative
// 1e-7 (ill-conditioned for a 1e-5 float check) is redrawn too (a few percent of float draws).
// With TITANS_TEST_ERRORS=1 the counts are printed with the error maxima.

#include "catch.hpp"

#include <titans/titans.hpp>

#include "reference/reference_memory.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Catch2 v2 / v3 compatibility.
#if defined(TITANS_CATCH2_V3) && TITANS_CATCH2_V3
#define TITANS_CONTAINS(text) Catch::Matchers::ContainsSubstring(text)
#else
#define TITANS_CONTAINS(text) Catch::Matchers::Contains(text)
#endif

/// `expr` throws `Type` (and so titans::Error) with a message containing `text`.
#define REQUIRE_THROWS_NAMING(expr, Type, text)                        \
    do {                                                               \
        REQUIRE_THROWS_AS(static_cast<void>(expr), Type);              \
        REQUIRE_THROWS_AS(static_cast<void>(expr), titans::Error);     \
        REQUIRE_THROWS_WITH(static_cast<void>(expr), TITANS_CONTAINS(text)); \
    } while (false)

namespace titans_test {

using titans::Activation;
using titans::Diagnostics;
using titans::GateMode;
using titans::Matrix;
using titans::Matrixd;
using titans::MemoryConfig;
using titans::MemoryParams;
using titans::NeuralMemory;
using titans::Retrieval;
using titans::UpdateMode;
using Rng = std::mt19937_64;

// ---------------------------------------------------------------------------------------------
// Tolerances and errors.

template <class T>
constexpr double tol() {
    return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

template <class T>
const char* type_name() {
    return std::is_same_v<T, float> ? "float" : "double";
}

/// max|a - b| / max(max|b|, floor), in double. +inf if the shapes differ or an entry of a or b
/// is NaN or infinite (so a comparison can never pass by accident).
template <class DA, class DB>
double rel_error(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                 double floor = 1e-30) {
    if (a.rows() != b.rows() || a.cols() != b.cols()) {
        return std::numeric_limits<double>::infinity();
    }
    double num = 0.0, den = 0.0;
    for (Eigen::Index i = 0; i < a.rows(); ++i) {
        for (Eigen::Index j = 0; j < a.cols(); ++j) {
            const double x = static_cast<double>(a(i, j));
            const double y = static_cast<double>(b(i, j));
            if (!std::isfinite(x) || !std::isfinite(y)) {
                return std::numeric_limits<double>::infinity();
            }
            num = std::max(num, std::abs(x - y));
            den = std::max(den, std::abs(y));
        }
    }
    return num / std::max(den, floor);
}

/// Largest per-layer rel_error of two weight lists (inf if the layer counts differ).
template <class TA, class TB>
double rel_error(const std::vector<Matrix<TA>>& a, const std::vector<Matrix<TB>>& b,
                 double floor = 1e-30) {
    if (a.size() != b.size() || a.empty()) {
        return std::numeric_limits<double>::infinity();
    }
    double e = 0.0;
    for (std::size_t l = 0; l < a.size(); ++l) {
        e = std::max(e, rel_error(a[l], b[l], floor));
    }
    return e;
}

/// rel_error of two weight lists taken as one tensor: the largest difference over every layer
/// relative to the largest entry over every layer (inf if the layer counts differ).
template <class TA, class TB>
double rel_error_joint(const std::vector<Matrix<TA>>& a, const std::vector<Matrix<TB>>& b,
                       double floor = 1e-30) {
    if (a.size() != b.size() || a.empty()) {
        return std::numeric_limits<double>::infinity();
    }
    double num = 0.0, den = 0.0;
    for (std::size_t l = 0; l < a.size(); ++l) {
        if (a[l].rows() != b[l].rows() || a[l].cols() != b[l].cols()) {
            return std::numeric_limits<double>::infinity();
        }
        for (Eigen::Index i = 0; i < a[l].rows(); ++i)
            for (Eigen::Index j = 0; j < a[l].cols(); ++j) {
                const double x = static_cast<double>(a[l](i, j));
                const double y = static_cast<double>(b[l](i, j));
                if (!std::isfinite(x) || !std::isfinite(y)) {
                    return std::numeric_limits<double>::infinity();
                }
                num = std::max(num, std::abs(x - y));
                den = std::max(den, std::abs(y));
            }
    }
    return num / std::max(den, floor);
}

/// Bitwise-identical values (NaN never equal).
template <class DA, class DB>
bool identical(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b) {
    if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
    for (Eigen::Index i = 0; i < a.rows(); ++i)
        for (Eigen::Index j = 0; j < a.cols(); ++j)
            if (!(a(i, j) == b(i, j))) return false;
    return true;
}

/// As identical, but a NaN equals a NaN (any payload): the outputs of the same arithmetic on
/// rows that overflow.
template <class DA, class DB>
bool identical_or_nan(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b) {
    if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
    for (Eigen::Index i = 0; i < a.rows(); ++i)
        for (Eigen::Index j = 0; j < a.cols(); ++j)
            if (!(a(i, j) == b(i, j)) && !(std::isnan(a(i, j)) && std::isnan(b(i, j))))
                return false;
    return true;
}

/// The largest error seen per category; printed at exit when TITANS_TEST_ERRORS is set.
struct ErrorLog {
    std::mutex mu;
    std::map<std::string, double> max_error;
    std::map<std::string, long> counts;
    ~ErrorLog() {
        const char* env = std::getenv("TITANS_TEST_ERRORS");
        if (env == nullptr || max_error.empty()) return;
        std::fprintf(stderr, "titans tests: largest relative errors observed\n");
        for (const auto& [k, v] : max_error) {
            std::fprintf(stderr, "  %-60s %.3e\n", k.c_str(), v);
        }
        for (const auto& [k, v] : counts) {
            std::fprintf(stderr, "  %-60s %ld\n", k.c_str(), v);
        }
    }
};
inline ErrorLog error_log;

template <class T>
double note_error(const std::string& category, double err) {
    std::lock_guard<std::mutex> lock(error_log.mu);
    double& m = error_log.max_error[std::string(type_name<T>()) + " " + category];
    m = std::max(m, err);
    return err;
}

// ---------------------------------------------------------------------------------------------
// Seeds and random values.

inline std::uint64_t mix64(std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/// TITANS_TEST_SEED from the environment (0 when unset).
inline std::uint64_t base_seed() {
    const char* env = std::getenv("TITANS_TEST_SEED");
    return env == nullptr ? 0 : std::strtoull(env, nullptr, 10);
}

/// A seed per (test name, case index): FNV-1a of the name, mixed with the index and base_seed().
inline std::uint64_t seed_for(const std::string& name, std::uint64_t index = 0) {
    std::uint64_t h = 1469598103934665603ULL;
    for (unsigned char c : name) {
        h = (h ^ c) * 1099511628211ULL;
    }
    return mix64(h ^ mix64(index + 0x1234567ULL) ^ mix64(base_seed() + 0xabcdefULL));
}

inline double uniform(Rng& rng, double lo = -1.0, double hi = 1.0) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
}
inline int uniform_int(Rng& rng, int lo, int hi) {  // inclusive
    return std::uniform_int_distribution<int>(lo, hi)(rng);
}
template <class V>
const typename V::value_type& pick(Rng& rng, const V& values) {
    return values[static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(values.size()) - 1))];
}

/// rows x cols, entries uniform in [lo, hi] (default [-1, 1]).
inline Matrixd random_matrix(Eigen::Index rows, Eigen::Index cols, Rng& rng, double lo = -1.0,
                             double hi = 1.0) {
    Matrixd m(rows, cols);
    std::uniform_real_distribution<double> u(lo, hi);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = u(rng);
    return m;
}

/// Central differences of f() with respect to every entry of m (perturbed in place by ±h and
/// restored): what the backward passes are checked against.
template <class M, class F>
Matrixd central_diff(M& m, double h, F&& f) {
    Matrixd g(m.rows(), m.cols());
    for (Eigen::Index i = 0; i < m.rows(); ++i) {
        for (Eigen::Index j = 0; j < m.cols(); ++j) {
            const double v = m(i, j);
            m(i, j) = v + h;
            const double up = f();
            m(i, j) = v - h;
            const double down = f();
            m(i, j) = v;
            g(i, j) = (up - down) / (2 * h);
        }
    }
    return g;
}

/// Ridders' extrapolation of central differences of f at 0: steps h, h/2, ..., h/2^7, each
/// new difference extrapolated towards step 0 through the earlier ones (Neville's tableau);
/// returns the entry whose extrapolation moved least. Accurate where one step is not: a
/// small derivative next to |f| (roundoff of a small step) together with strong curvature
/// (truncation of a large one).
template <class F>
double ridders_derivative(F&& f, double h) {
    constexpr int n = 8;
    std::array<std::array<double, n>, n> a{};
    double best = 0, err = std::numeric_limits<double>::infinity();
    for (int i = 0; i < n; ++i, h /= 2) {
        a[0][static_cast<std::size_t>(i)] = (f(h) - f(-h)) / (2 * h);
        double fac = 4;
        for (int j = 1; j <= i; ++j, fac *= 4) {
            const auto J = static_cast<std::size_t>(j), I = static_cast<std::size_t>(i);
            a[J][I] = (a[J - 1][I] * fac - a[J - 1][I - 1]) / (fac - 1);
            const double e = std::max(std::abs(a[J][I] - a[J - 1][I]),
                                      std::abs(a[J][I] - a[J - 1][I - 1]));
            if (e <= err) {
                err = e;
                best = a[J][I];
            }
        }
        const auto I = static_cast<std::size_t>(i);
        if (i > 0 && std::abs(a[I][I] - a[I - 1][I - 1]) >= 2 * err) {
            break;  // the tableau's diagonal diverges: smaller steps only add roundoff
        }
    }
    return best;
}

/// ridders_derivative for every entry of m (perturbed in place and restored) from step h: for
/// gradients where one step's truncation is not small (a Gaussian tail, GELU's at |z| ~ 20,
/// where the derivative's relative change over a step is z h).
template <class M, class F>
Matrixd ridders_diff(M& m, double h, F&& f) {
    Matrixd g(m.rows(), m.cols());
    for (Eigen::Index i = 0; i < m.rows(); ++i) {
        for (Eigen::Index j = 0; j < m.cols(); ++j) {
            const double v = m(i, j);
            g(i, j) = ridders_derivative(
                [&](double d) {
                    m(i, j) = v + d;
                    const double r = f();
                    m(i, j) = v;
                    return r;
                },
                h);
        }
    }
    return g;
}

/// Estimates of df/dδ at 0 that fail differently: central at 1e-5 and 1e-6 (roundoff where the
/// derivative is tiny next to |L|), 4th order at 1e-3 and 6th order at 1e-2 (truncation where
/// the curvature is strong, e.g. normalising a short q or k, or a step crossing the clipping
/// threshold), and Ridders' extrapolation from 1e-4 (both at once). The check takes the best:
/// a wrong gradient is off for all of them.
template <class F>
std::array<double, 5> derivative_estimates(F&& f) {
    const double h0 = 1e-5, h1 = 1e-6, h2 = 1e-3, h3 = 1e-2;
    return {(f(h0) - f(-h0)) / (2 * h0), (f(h1) - f(-h1)) / (2 * h1),
            (f(-2 * h2) - 8 * f(-h2) + 8 * f(h2) - f(2 * h2)) / (12 * h2),
            (-f(-3 * h3) + 9 * f(-2 * h3) - 45 * f(-h3) + 45 * f(h3) - 9 * f(2 * h3) + f(3 * h3)) /
                (60 * h3),
            ridders_derivative(f, 1e-4)};
}

/// The absolute error below which finite differences of a loss L cannot tell a gradient from
/// its estimate: the rounding of a central difference at the estimators' step 1e-5,
/// eps |L| / 1e-5 = 2.2e-11 |L| (|L| at least 1). Below it the estimates disagree among
/// themselves: a gradient of 1e-6 |L| (a weight the output barely depends on) is estimated to
/// 1e-5 relative at best, however right it is; a gradient that is exactly 0 (d_h = 1,
/// normalised q, k and every token clipped) would fail on 1e-14 of noise.
inline double fd_floor(double loss) {
    return std::numeric_limits<double>::epsilon() / 1e-5 * std::max(1.0, std::abs(loss));
}

/// For one tensor (entries value[0, n), analytic gradient grad): the best estimator's
/// max(max|grad - fd| - atol, 0) / max(max|fd|, 1e-8), atol normally fd_floor(L).
template <class L>
double tensor_error(double* value, const double* grad, Eigen::Index n, double atol, L&& loss) {
    std::array<double, 5> num{}, den{};
    for (Eigen::Index i = 0; i < n; ++i) {
        const double v0 = value[i];
        const auto fd = derivative_estimates([&](double delta) {
            value[i] = v0 + delta;
            const double r = loss();
            value[i] = v0;
            return r;
        });
        for (std::size_t e = 0; e < fd.size(); ++e) {
            num[e] = std::max(num[e], std::abs(grad[i] - fd[e]));
            den[e] = std::max(den[e], std::abs(fd[e]));
        }
    }
    double best = std::numeric_limits<double>::infinity();
    for (std::size_t e = 0; e < num.size(); ++e) {
        best = std::min(best, std::max(num[e] - atol, 0.0) / std::max(den[e], 1e-8));
    }
    return best;
}

/// The worst tensor_error over every tensor Params::tensors(p, cfg, .) visits (p perturbed in
/// place, restored after), g the analytic gradients; names the tensors above 1e-6.
template <class Params, class Config, class L>
double params_fd_error(Params& p, const Params& g, const Config& cfg, double atol, L&& loss) {
    std::vector<const double*> grads;
    Params::tensors(g, cfg, [&](const std::string&, const auto& m) { grads.push_back(m.data()); });
    std::size_t k = 0;
    double worst = 0;
    Params::tensors(p, cfg, [&](const std::string& name, auto& m) {
        const double e = tensor_error(m.data(), grads[k++], m.size(), atol, loss);
        if (e > 1e-6) UNSCOPED_INFO(name << ": " << e);
        worst = std::max(worst, e);
    });
    return worst;
}

struct BackwardCase {
    MemoryConfig cfg;
    MemoryParams<double> p;
    Matrixd x, dy;
    int batch = 1;
};

/// The memory backward tests' small random cases, after the caller set the modes in c.cfg:
/// H 1..2, d_h 1..3, d_model 2..6, depth 1..3, expansion 1..2, conv kernel 1..3, random gate
/// constants and theta_max, parameters with gate biases and conv taps moved off their initial
/// values (so every gate and tap matters), batch 1..2. The caller draws x and dy.
inline void draw_backward_shapes(BackwardCase& c, Rng& rng) {
    MemoryConfig& g = c.cfg;
    g.n_heads = uniform_int(rng, 1, 2);
    g.d_head = uniform_int(rng, 1, 3);
    g.d_model = uniform_int(rng, 2, 6);
    g.depth = uniform_int(rng, 1, 3);
    g.expansion = uniform_int(rng, 1, 2);
    g.conv_kernel = uniform_int(rng, 1, 3);
    g.theta_max = uniform(rng, 0.1, 0.9);
    g.constant_theta = uniform(rng, 0.1, 0.6);
    g.constant_eta = uniform(rng, 0.0, 0.9);
    g.constant_alpha = uniform(rng, 0.0, 0.4);
    g.momentum = uniform_int(rng, 0, 3) != 0;  // the ablations (Table 5) one draw in four
    g.forget = uniform_int(rng, 0, 3) != 0;
    g.validate();
    c.p = MemoryParams<double>::random(g, rng());
    const int H = g.n_heads;
    c.p.b_theta = random_matrix(1, H, rng);
    c.p.b_eta = random_matrix(1, H, rng, -1.0, 1.5);
    c.p.b_alpha = random_matrix(1, H, rng, -3.0, 0.0);
    for (Matrixd* conv : {&c.p.conv_q, &c.p.conv_k, &c.p.conv_v}) {
        *conv += random_matrix(g.conv_kernel, g.inner_dim(), rng, -0.3, 0.3);
    }
    c.batch = uniform_int(rng, 1, 2);
}

// ---------------------------------------------------------------------------------------------
// Parameter casts.

template <class To, class From>
MemoryParams<To> cast_params(const MemoryParams<From>& p) {
    MemoryParams<To> r;
    r.w_q = p.w_q.template cast<To>();
    r.w_k = p.w_k.template cast<To>();
    r.w_v = p.w_v.template cast<To>();
    r.conv_q = p.conv_q.template cast<To>();
    r.conv_k = p.conv_k.template cast<To>();
    r.conv_v = p.conv_v.template cast<To>();
    r.w_theta = p.w_theta.template cast<To>();
    r.w_eta = p.w_eta.template cast<To>();
    r.w_alpha = p.w_alpha.template cast<To>();
    r.b_theta = p.b_theta.template cast<To>();
    r.b_eta = p.b_eta.template cast<To>();
    r.b_alpha = p.b_alpha.template cast<To>();
    r.memory_init.resize(p.memory_init.size());
    for (std::size_t h = 0; h < p.memory_init.size(); ++h)
        for (const auto& w : p.memory_init[h]) r.memory_init[h].push_back(w.template cast<To>());
    r.w_o = p.w_o.template cast<To>();
    return r;
}

template <class To, class From>
std::vector<Matrix<To>> cast_layers(const std::vector<Matrix<From>>& W) {
    std::vector<Matrix<To>> r;
    for (const auto& w : W) r.push_back(w.template cast<To>());
    return r;
}

/// Rounds a double matrix through T and back (identity for double).
template <class T>
Matrixd round_through(const Matrixd& m) {
    return m.cast<T>().template cast<double>();
}

// ---------------------------------------------------------------------------------------------
// Random configurations.

/// The algorithmic modes of a configuration; the shapes are drawn separately.
struct Modes {
    GateMode gates = GateMode::DataDependent;
    Retrieval retrieval = Retrieval::Lagged;
    UpdateMode update = UpdateMode::Chunked;
    bool residual = false;
    Activation activation = Activation::SiLU;
    bool use_conv = true;
    Activation qkv_activation = Activation::SiLU;
    bool normalize_qk = true;
};

/// The 32 combinations of the five binary options (bit 0 residual, 1 GELU, 2 no conv,
/// 3 Identity qkv activation, 4 no q/k normalisation).
inline Modes with_flags(Modes m, int bits) {
    m.residual = (bits & 1) != 0;
    m.activation = (bits & 2) != 0 ? Activation::GELU : Activation::SiLU;
    m.use_conv = (bits & 4) == 0;
    m.qkv_activation = (bits & 8) != 0 ? Activation::Identity : Activation::SiLU;
    m.normalize_qk = (bits & 16) == 0;
    return m;
}
inline Modes random_flags(Modes m, Rng& rng) { return with_flags(m, uniform_int(rng, 0, 31)); }

/// Every valid (gates, retrieval) pair of the chunked update: PerChunk only with Lagged.
inline std::vector<Modes> chunked_primary_modes() {
    std::vector<Modes> r;
    for (GateMode g : {GateMode::DataDependent, GateMode::Constant, GateMode::PerChunk})
        for (Retrieval ret : {Retrieval::Lagged, Retrieval::InChunk}) {
            if (g == GateMode::PerChunk && ret == Retrieval::InChunk) continue;
            Modes m;
            m.gates = g;
            m.retrieval = ret;
            m.update = UpdateMode::Chunked;
            r.push_back(m);
        }
    return r;
}

/// Every valid (update, gates, retrieval) triple.
inline std::vector<Modes> all_primary_modes() {
    std::vector<Modes> r = chunked_primary_modes();
    for (GateMode g : {GateMode::DataDependent, GateMode::Constant})
        for (Retrieval ret : {Retrieval::Lagged, Retrieval::InChunk}) {
            Modes m;
            m.gates = g;
            m.retrieval = ret;
            m.update = UpdateMode::PerToken;
            r.push_back(m);
        }
    return r;
}

struct Limits {
    int max_tokens = 30;   // N (per sequence)
    int max_batch = 3;     // B
    int max_depth = 3;
    int min_head_dim = 2;  // raised to 3 for float cases (see draw_case)
};

/// A config with the given modes and random shapes: H in 1..3, d_h in min_head_dim..6, d_head
/// explicit or derived, d_model <= 24, depth 1..3, expansion {1, 2, 4}, conv kernel 1..4, chunk in
/// {1, 2, 3, 5, 8}, random gate constants / theta_max.
inline MemoryConfig random_config(const Modes& m, Rng& rng, const Limits& lim = {}) {
    MemoryConfig c;
    c.n_heads = uniform_int(rng, 1, 3);
    const int dh = uniform_int(rng, lim.min_head_dim, 6);
    if (uniform_int(rng, 0, 2) == 0) {
        c.d_head = dh;  // explicit: d_model need not be H * d_h
        c.d_model = uniform_int(rng, lim.min_head_dim, 24);
    } else {
        c.d_head = 0;
        c.d_model = c.n_heads * dh;
    }
    c.depth = uniform_int(rng, 1, lim.max_depth);
    c.expansion = pick(rng, std::vector<int>{1, 2, 4});
    if (c.depth == 3 && c.expansion == 4 && dh > 4) c.expansion = 2;  // keep it small
    c.activation = m.activation;
    c.residual = m.residual;
    c.use_conv = m.use_conv;
    c.conv_kernel = uniform_int(rng, 1, 4);
    c.qkv_activation = m.qkv_activation;
    c.normalize_qk = m.normalize_qk;
    c.gates = m.gates;
    c.theta_max = uniform(rng, 0.02, 0.15);
    c.constant_theta = uniform(rng, 0.02, 0.15);
    c.constant_eta = uniform(rng, 0.0, 0.8);
    c.constant_alpha = uniform(rng, 0.0, 0.3);
    c.update = m.update;
    c.retrieval = m.retrieval;
    c.chunk = pick(rng, std::vector<int>{1, 2, 3, 5, 8});
    // math §10 clipping: off, always active (0.05), often active, rarely active.
    c.max_grad_norm = pick(rng, std::vector<double>{0.0, 0.05, 0.3, 1.0, 4.0});
    c.momentum = uniform_int(rng, 0, 3) != 0;  // the ablations (Table 5) one draw in four
    c.forget = uniform_int(rng, 0, 3) != 0;
    c.validate();
    return c;
}

/// N tokens per sequence, N in [1, max] and not a multiple of the chunk when chunk > 1.
inline int random_tokens(const MemoryConfig& c, Rng& rng, int max_tokens) {
    const int b = c.effective_chunk();
    for (;;) {
        const int n = uniform_int(rng, 1, max_tokens);
        if (b == 1 || n % b != 0) return n;
    }
}

/// Library-initialised parameters with every gate bias made random and non-zero:
/// b_theta in [-1, 1], b_eta in [-1, 1.5], b_alpha in [-4, -1]; w_v (and w_q, w_k when q, k are
/// not normalised) scaled to rows of norm about 1.
inline titans::MemoryParamsd random_params(const MemoryConfig& cfg, Rng& rng) {
    auto p = titans::MemoryParamsd::random(cfg, rng());
    const int H = cfg.n_heads;
    p.b_theta = random_matrix(1, H, rng, -1.0, 1.0);
    p.b_eta = random_matrix(1, H, rng, -1.0, 1.5);
    p.b_alpha = random_matrix(1, H, rng, -4.0, -1.0);
    // Keys and values of norm about 1 (not sqrt(d_h / 3)) keep theta ||k||^2 / (1 - eta) small,
    // i.e. the memory's own dynamics stable, so rounding is not amplified by a diverging run.
    const double s = std::sqrt(3.0 / cfg.head_dim());
    if (!cfg.normalize_qk) {
        p.w_q *= s;
        p.w_k *= s;
    }
    p.w_v *= s;
    return p;
}

/// A complete random case: config, double parameters, x of (B*N) x d_model.
struct Case {
    MemoryConfig cfg;
    titans::MemoryParamsd params;
    Matrixd x;
    int batch = 1;
    int tokens = 0;
    std::uint64_t seed = 0;

    [[nodiscard]] std::string describe() const {
        std::ostringstream os;
        os << "seed=" << seed << " d_model=" << cfg.d_model << " H=" << cfg.n_heads
           << " d_head=" << cfg.d_head << "(" << cfg.head_dim() << ") depth=" << cfg.depth
           << " e=" << cfg.expansion << " act=" << titans::to_string(cfg.activation)
           << " residual=" << cfg.residual << " conv=" << cfg.use_conv << "(K=" << cfg.conv_kernel
           << ") qkv=" << titans::to_string(cfg.qkv_activation) << " norm=" << cfg.normalize_qk
           << " gates=" << titans::to_string(cfg.gates) << " update=" << titans::to_string(cfg.update)
           << " retrieval=" << titans::to_string(cfg.retrieval) << " chunk=" << cfg.chunk
           << " max_grad_norm=" << cfg.max_grad_norm << " momentum=" << cfg.momentum
           << " forget=" << cfg.forget << " B=" << batch << " N=" << tokens;
        return os.str();
    }
};

/// The reference run of a case: reference::per_token for UpdateMode::PerToken, else
/// reference::chunk_start_loop.
inline titans::reference::Result reference_run(const Case& c) {
    return c.cfg.update == UpdateMode::PerToken
               ? titans::reference::per_token(c.cfg, c.params, c.x, c.batch)
               : titans::reference::chunk_start_loop(c.cfg, c.params, c.x, c.batch);
}

/// Whether the exact (double reference) dynamics of a case stay tame: every output, weight,
/// momentum and loss finite and below `bound` in magnitude. A memory whose test-time learning
/// diverges amplifies rounding without limit, so relative tolerances say nothing there.
inline bool well_conditioned(const titans::reference::Result& r, double bound = 100.0) {
    auto ok = [bound](const Matrixd& m) { return m.allFinite() && m.cwiseAbs().maxCoeff() <= bound; };
    if (!ok(r.y) || !ok(r.loss)) return false;
    for (const auto& per_b : r.weights)
        for (const auto& per_h : per_b)
            for (const Matrixd& w : per_h)
                if (!ok(w)) return false;
    for (const auto& per_b : r.momentum)
        for (const auto& per_h : per_b)
            for (const Matrixd& s : per_h)
                if (!ok(s)) return false;
    return true;
}

/// Largest rel_error between two reference results over every output, diagnostic, weight and
/// momentum.
inline double max_rel_difference(const titans::reference::Result& a,
                                 const titans::reference::Result& b) {
    double e = std::max({rel_error(a.y, b.y), rel_error(a.loss, b.loss),
                         rel_error(a.grad_norm, b.grad_norm)});
    for (std::size_t s = 0; s < a.weights.size(); ++s)
        for (std::size_t h = 0; h < a.weights[s].size(); ++h)
            e = std::max({e, rel_error(a.weights[s][h], b.weights[s][h]),
                          rel_error(a.momentum[s][h], b.momentum[s][h])});
    return e;
}

/// How much the exact (double reference) result of a case moves, relative to its size, when
/// every input value (x, every parameter, the gate constants) is multiplied by 1 + eps * u,
/// u uniform in [-1, 1]. Float rounding acts like such perturbations at every step, so a case
/// that amplifies them a lot cannot meet a float tolerance whatever the implementation.
inline double input_sensitivity(const Case& c, const titans::reference::Result& exact, double eps) {
    Rng rng(mix64(c.seed ^ 0x5e5e5e5eULL));
    auto jiggle = [&](auto& m) {
        for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] *= 1.0 + eps * uniform(rng);
    };
    Case p = c;
    for (Matrixd* m : {&p.x, &p.params.w_q, &p.params.w_k, &p.params.w_v, &p.params.conv_q,
                       &p.params.conv_k, &p.params.conv_v, &p.params.w_theta, &p.params.w_eta,
                       &p.params.w_alpha, &p.params.w_o})
        jiggle(*m);
    jiggle(p.params.b_theta);
    jiggle(p.params.b_eta);
    jiggle(p.params.b_alpha);
    for (auto& head : p.params.memory_init)
        for (Matrixd& w : head) jiggle(w);
    for (double* v : {&p.cfg.theta_max, &p.cfg.constant_theta, &p.cfg.constant_eta,
                      &p.cfg.constant_alpha})
        *v = std::min(1.0, *v * (1.0 + eps * uniform(rng)));
    return max_rel_difference(reference_run(p), exact);
}

template <class T>
Case draw_case(const Modes& m, std::uint64_t seed, const Limits& lim);

/// A random case whose parameters and inputs are already rounded through T (so the double
/// reference and the T library see identical values). Draws whose exact dynamics diverge
/// (see well_conditioned) are redrawn from the next seed; the reference decides, never the
/// library under test.
/// `adjust`, if given, edits each draw (e.g. fixes the chunk size) before it is judged.
template <class T>
Case make_case(const Modes& m, std::uint64_t seed, const Limits& lim = {},
               const std::function<void(Case&)>& adjust = {}) {
    for (int attempt = 0;; ++attempt) {
        Case c = draw_case<T>(m, seed, lim);
        if (adjust) adjust(c);
        {
            std::lock_guard<std::mutex> lock(error_log.mu);
            ++error_log.counts["cases drawn"];
        }
        const titans::reference::Result r = reference_run(c);
        bool good = well_conditioned(r);
        if (good && std::is_same_v<T, float>) {
            // Float checks need a case whose exact result moves by at most ~10 x the relative
            // size of a float rounding (2^-24 ~ 6e-8) when the inputs are jiggled by that much.
            good = input_sensitivity(c, r, 1e-7) <= 1e-6;
        }
        if (good || attempt == 20) return c;
        {
            std::lock_guard<std::mutex> lock(error_log.mu);
            ++error_log.counts[std::string(type_name<T>()) + " cases redrawn (diverging or ill-conditioned)"];
        }
        seed = mix64(seed);
    }
}

template <class T>
Case draw_case(const Modes& m, std::uint64_t seed, const Limits& limits) {
    Limits lim = limits;
    if (std::is_same_v<T, float>) {
        // 2-wide heads and 2-wide outputs sum too few terms to average out float cancellation;
        // double cases keep them.
        lim.min_head_dim = std::max(lim.min_head_dim, 3);
    }
    Rng rng(seed);
    Case c;
    c.seed = seed;
    c.cfg = random_config(m, rng, lim);
    for (double* v : {&c.cfg.theta_max, &c.cfg.constant_theta, &c.cfg.constant_eta,
                      &c.cfg.constant_alpha, &c.cfg.max_grad_norm}) {
        *v = static_cast<double>(static_cast<T>(*v));  // the library rounds them to T
    }
    c.params = cast_params<double>(cast_params<T>(random_params(c.cfg, rng)));
    c.batch = uniform_int(rng, 1, lim.max_batch);
    c.tokens = random_tokens(c.cfg, rng, lim.max_tokens);
    c.x = round_through<T>(random_matrix(c.batch * c.tokens, c.cfg.d_model, rng));
    return c;
}

// ---------------------------------------------------------------------------------------------
// Running the library.

template <class T>
struct LibRun {
    Matrix<T> y;
    Diagnostics<T> diag;
    // weights[b][h][l-1], momentum[b][h][l-1] after the last token
    std::vector<std::vector<std::vector<Matrix<T>>>> weights, momentum;
    std::int64_t position = 0;
};

template <class T, class Backend>
void collect_state(const NeuralMemory<T, Backend>& mem,
                   const typename NeuralMemory<T, Backend>::State& st, LibRun<T>& r) {
    r.weights.assign(static_cast<std::size_t>(st.batch()), {});
    r.momentum.assign(static_cast<std::size_t>(st.batch()), {});
    for (int b = 0; b < st.batch(); ++b)
        for (int h = 0; h < mem.config().n_heads; ++h) {
            r.weights[static_cast<std::size_t>(b)].push_back(mem.current_weights(st, b, h));
            r.momentum[static_cast<std::size_t>(b)].push_back(mem.current_momentum(st, b, h));
        }
    r.position = st.position();
}

/// One forward call over the whole of x with a fresh state of `batch` sequences, on Backend.
template <class T, class Backend = titans::backend::Cpu>
LibRun<T> run_library(const MemoryConfig& cfg, const MemoryParams<T>& p, const Matrix<T>& x,
                      int batch) {
    NeuralMemory<T, Backend> mem(cfg, p);
    auto st = mem.make_state(batch);
    LibRun<T> r;
    r.y = mem.forward(st, x, &r.diag);
    collect_state(mem, st, r);
    return r;
}

template <class T, class Backend = titans::backend::Cpu>
LibRun<T> run_library(const Case& c) {
    return run_library<T, Backend>(c.cfg, cast_params<T>(c.params), c.x.cast<T>().eval(), c.batch);
}

/// Checks a library run against a reference result: outputs, Diagnostics, and the weights and
/// momentum of every (b, h). Records the errors under `category`.
template <class T>
void check_against_reference(const LibRun<T>& lib, const titans::reference::Result& ref,
                             const Case& c, const std::string& category) {
    INFO(c.describe());
    const double t = tol<T>();
    // Weights and momentum: per layer in double; in float, relative to the largest entry of any
    // layer, because a layer whose gradient is a near-cancellation in back-propagation (entries
    // 1e-3 of the other layers') carries a float error far above 1e-5 of its own size that says
    // nothing about the implementation.
    auto layers_error = [](const auto& a, const auto& b) {
        return std::is_same_v<T, float> ? rel_error_joint(a, b) : rel_error(a, b);
    };
    CHECK(note_error<T>(category + ": y", rel_error(lib.y, ref.y)) <= t);
    CHECK(note_error<T>(category + ": diag loss", rel_error(lib.diag.loss, ref.loss)) <= t);
    CHECK(note_error<T>(category + ": diag grad_norm", rel_error(lib.diag.grad_norm, ref.grad_norm)) <= t);
    REQUIRE(lib.weights.size() == ref.weights.size());
    for (std::size_t b = 0; b < lib.weights.size(); ++b) {
        REQUIRE(lib.weights[b].size() == ref.weights[b].size());
        for (std::size_t h = 0; h < lib.weights[b].size(); ++h) {
            INFO("b=" << b << " h=" << h);
            CHECK(note_error<T>(category + ": weights", layers_error(lib.weights[b][h], ref.weights[b][h])) <= t);
            CHECK(note_error<T>(category + ": momentum", layers_error(lib.momentum[b][h], ref.momentum[b][h])) <= t);
        }
    }
    CHECK(lib.position == c.tokens);
}

// ---------------------------------------------------------------------------------------------
// Streams in pieces.

/// Rows of tokens [t0, t1) of every sequence of x ((B*N) x cols, sequence-major), stacked
/// sequence-major: (B*(t1-t0)) x cols.
template <class M>
M take_tokens(const M& x, int B, Eigen::Index N, Eigen::Index t0, Eigen::Index t1) {
    M r(static_cast<Eigen::Index>(B) * (t1 - t0), x.cols());
    for (int b = 0; b < B; ++b) {
        r.middleRows(static_cast<Eigen::Index>(b) * (t1 - t0), t1 - t0) = x.middleRows(b * N + t0, t1 - t0);
    }
    return r;
}

/// The inverse of take_tokens: writes piece into rows [t0, t1) of every sequence of x.
template <class M>
void put_tokens(M& x, const M& piece, int B, Eigen::Index N, Eigen::Index t0, Eigen::Index t1) {
    for (int b = 0; b < B; ++b) {
        x.middleRows(b * N + t0, t1 - t0) = piece.middleRows(static_cast<Eigen::Index>(b) * (t1 - t0), t1 - t0);
    }
}

/// x as the streams of case `i` of a sweep: i % 5 == 1 constant (each sequence one row
/// repeated), 2 periodic (a period of 3 rows), 3 huge (x 1e3), 4 tiny (x 1e-6), else as drawn.
inline Matrixd stream_kind(Matrixd x, int B, int i) {
    const Eigen::Index N = x.rows() / B;
    for (int b = 0; b < B && (i % 5 == 1 || i % 5 == 2); ++b) {
        for (Eigen::Index t = 1; t < N; ++t) {
            x.row(b * N + t) = x.row(b * N + (i % 5 == 1 ? 0 : t % 3));
        }
    }
    if (i % 5 == 3) x *= 1e3;
    if (i % 5 == 4) x *= 1e-6;
    return x;
}

/// Random piece lengths summing to N: empty pieces, single tokens, pieces within one span
/// (chunk or segment) and pieces across several, and an empty call at the end.
inline std::vector<int> random_pieces(Rng& rng, int N, int span) {
    std::vector<int> pieces;
    int left = N;
    while (left > 0) {
        int len = 0;
        switch (uniform_int(rng, 0, 4)) {
            case 0: len = 0; break;
            case 1: len = 1; break;
            case 2: len = uniform_int(rng, 1, span + 1); break;
            default: len = uniform_int(rng, span + 1, 3 * span + 2); break;
        }
        len = std::min(len, left);
        pieces.push_back(len);
        left -= len;
    }
    pieces.push_back(0);
    return pieces;
}

}  // namespace titans_test
