#pragma once
// titans/detail/norm_scale.hpp: sums of squares that cannot overflow, for the norms of math §1
// and §7 (RMSNorm, the memory's q / k L2 normalisation) on every backend.
//
// A row whose plain sum of squares overflows T (finite entries above ~sqrt(max / d)) is taken
// again scaled by 2^-e, e the exponent of its largest magnitude: the scaling is exact (a power
// of two), the largest scaled entry lies in [1, 2), so the scaled sum lies in [1, 4 d) and
// cannot overflow. The kernels use the plain sum wherever it is finite, so ordinary rows keep
// their bits; the scaled one only where the plain one is infinite.

#include <cfloat>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../types.hpp"

namespace titans::detail {

/// T's largest finite and smallest normal value (usable in device code, unlike numeric_limits
/// without relaxed constexpr).
template <class T>
TITANS_HOST_DEVICE T largest_finite() {
    if constexpr (std::is_same_v<T, float>) return FLT_MAX; else return DBL_MAX;
}
template <class T>
TITANS_HOST_DEVICE T smallest_normal() {
    if constexpr (std::is_same_v<T, float>) return FLT_MIN; else return DBL_MIN;
}

/// The scale exponent of a row with largest magnitude amax > 0 (finite): amax in [2^e, 2^(e+1)).
/// 0 for a zero, infinite or NaN amax (ilogb's FP_ILOGB0 / FP_ILOGBNAN may be INT_MIN, whose
/// negation in scale_down would overflow): such a row's scaled sum is then its plain one, and a
/// non-finite row stays non-finite for the caller's check.
template <class T>
TITANS_HOST_DEVICE int scale_exponent(T amax) {
    if (!(amax > T(0)) || !(amax <= largest_finite<T>())) return 0;
    return std::ilogb(amax);
}

/// v 2^-e: exact unless the result is subnormal (then within half its last place, and negligible
/// beside the row's largest entry, 2^-e amax >= 1).
template <class T>
TITANS_HOST_DEVICE T scale_down(T v, int e) {
    return std::ldexp(v, -e);
}

/// RMSNorm's 1 / sqrt(mean(x^2) + eps) of a row scaled by 2^-e (scaled_ss = Σ (x_j 2^-e)^2,
/// inv_d = 1 / d), times 2^e: 1 / rms(x) = scaled_inv_rms(...) 2^-e, and x_j / rms(x) =
/// (x_j 2^-e) scaled_inv_rms(...). eps 2^-2e may round to 0: it is then below the rounding of
/// the scaled mean.
template <class T>
TITANS_HOST_DEVICE T scaled_inv_rms(T scaled_ss, T inv_d, T eps, int e) {
    return T(1) / std::sqrt(scaled_ss * inv_d + std::ldexp(eps, -2 * e));
}

/// For a row x (any Eigen row expression) with a nonzero finite entry: e = scale_exponent of
/// its largest magnitude and Σ (x_j 2^-e)^2, in [1, 4 d).
template <class Row>
std::pair<typename Row::Scalar, int> scaled_squared_norm(const Row& x) {
    using T = typename Row::Scalar;
    const int e = scale_exponent(x.cwiseAbs().maxCoeff());
    T ss = T(0);
    for (Eigen::Index j = 0; j < x.size(); ++j) {
        const T z = scale_down(x(j), e);
        ss += z * z;
    }
    return {ss, e};
}

/// norm_parts (below) of the d contiguous entries at x, summed in order, for device code (the
/// CUDA training pass's q / k norms): returns n and sets e.
template <class T>
TITANS_HOST_DEVICE T row_norm_parts(const T* x, long long d, int& e) {
    T ss = T(0);
    for (long long j = 0; j < d; ++j) ss += x[j] * x[j];
    e = 0;
    if (ss <= largest_finite<T>()) return std::sqrt(ss);
    T amax = T(0);
    for (long long j = 0; j < d; ++j) amax = std::fabs(x[j]) > amax ? std::fabs(x[j]) : amax;
    e = scale_exponent(amax);
    ss = T(0);
    for (long long j = 0; j < d; ++j) {
        const T z = scale_down(x[j], e);
        ss += z * z;
    }
    return std::sqrt(ss);
}

/// math §10's gradient norm of one token, g = sqrt(sum_l ||a_l||^2 ||delta_l||^2), as s 2^k
/// (s in [1, 4 sqrt(depth)) when g > 0): for rows whose plain sum of products overflows T
/// (e.g. float inputs above ~1e10, where ||a|| ||delta|| passes ~1e19), which made the clip
/// factor c / sqrt(inf) = 0 and silently froze the memory.
template <class T>
struct GradNorm {
    T s = T(0);
    int k = 0;
    /// c / g: the clip factor (may round to 0 or be subnormal where g is beyond T's range).
    [[nodiscard]] TITANS_HOST_DEVICE T clip_factor(T c) const { return std::ldexp(c / s, -k); }
    /// g itself, infinite where it exceeds T's range.
    [[nodiscard]] TITANS_HOST_DEVICE T value() const { return std::ldexp(s, k); }
    /// ||x|| / g for a row x of n contiguous entries (nonzero g).
    [[nodiscard]] TITANS_HOST_DEVICE T ratio(const T* x, long long n) const;
};

/// One layer's rows for scaled_grad_norm: a (na entries) and delta (nd entries), contiguous.
template <class T>
struct GradRows {
    const T* a;
    long long na;
    const T* d;
    long long nd;
};

/// ||x|| = m 2^e with m in [1, 2) (m = 0, e = 0 for a zero row), from row_norm_parts.
template <class T>
TITANS_HOST_DEVICE T row_norm_mantissa(const T* x, long long n, int& e) {
    int es = 0;
    const T nx = row_norm_parts(x, n, es);
    const int f = scale_exponent(nx);
    e = es + f;
    return std::ldexp(nx, -f);
}

template <class T>
TITANS_HOST_DEVICE T GradNorm<T>::ratio(const T* x, long long n) const {
    int e = 0;
    const T m = row_norm_mantissa(x, n, e);
    return std::ldexp(m / s, e - k);
}

/// One layer's norms for scaled_grad_norm_of: ||a_l|| = ma 2^ea and ||delta_l|| = md 2^ed, each
/// mantissa in [1, 2), or 0 for a zero row (row_norm_mantissa's form).
template <class T>
struct NormPair {
    T ma = T(0);
    int ea = 0;
    T md = T(0);
    int ed = 0;
};

/// g from each layer's norms (parts(l), a NormPair<T> for l in [0, depth)) as GradNorm: each
/// ||a_l|| ||delta_l|| as q_l 2^k_l (q_l in [1, 4)), k the largest k_l, s = sqrt(sum_l (q_l
/// 2^(k_l - k))^2). Two passes (the largest exponent first).
template <class T, class Parts>
TITANS_HOST_DEVICE GradNorm<T> scaled_grad_norm_of(int depth, const Parts& parts) {
    GradNorm<T> g;
    bool any = false;
    for (int pass = 0; pass < 2; ++pass) {
        T sum = T(0);
        for (int l = 0; l < depth; ++l) {
            const NormPair<T> n = parts(l);
            if (!(n.ma > T(0)) || !(n.md > T(0))) continue;
            if (pass == 0) {
                g.k = any && g.k > n.ea + n.ed ? g.k : n.ea + n.ed;
                any = true;
            } else {
                const T q = std::ldexp(n.ma * n.md, n.ea + n.ed - g.k);
                sum += q * q;
            }
        }
        if (pass == 1) g.s = std::sqrt(sum);
    }
    return g;
}

/// g of rows(l) (a GradRows<T> per layer l in [0, depth)) as GradNorm (scaled_grad_norm_of of
/// the rows' row_norm_mantissa), for the rows where the plain sum of products overflowed, so
/// its cost does not matter.
template <class T, class Rows>
TITANS_HOST_DEVICE GradNorm<T> scaled_grad_norm(int depth, const Rows& rows) {
    return scaled_grad_norm_of<T>(depth, [&](int l) {
        const GradRows<T> r = rows(l);
        NormPair<T> n;
        n.ma = row_norm_mantissa(r.a, r.na, n.ea);
        n.md = row_norm_mantissa(r.d, r.nd, n.ed);
        return n;
    });
}

/// scaled_grad_norm of row i of the layers' tapes a and delta (row-major matrices, one per
/// layer: a_l's and delta_l's rows of token i).
template <class T>
GradNorm<T> scaled_grad_norm_row(const std::vector<Matrix<T>>& a,
                                 const std::vector<Matrix<T>>& delta, Eigen::Index i) {
    return scaled_grad_norm<T>(static_cast<int>(a.size()), [&](int l) {
        const auto li = static_cast<std::size_t>(l);
        return GradRows<T>{a[li].row(i).data(), a[li].cols(), delta[li].row(i).data(),
                           delta[li].cols()};
    });
}

/// ||x|| of a row x with finite entries, as n 2^e: the plain sqrt(Σ x_j^2) with e = 0 where
/// that sum is finite (so such rows keep their bits), else sqrt(Σ (x_j 2^-e)^2) with e > 0 the
/// scale exponent (the sum overflowed, so max |x_j| >= 2^56 and e >= 56): x / ||x|| is then
/// (x 2^-e) / n, and n is never below 1.
template <class Row>
std::pair<typename Row::Scalar, int> norm_parts(const Row& x) {
    using T = typename Row::Scalar;
    const T ss = x.squaredNorm();
    if (ss <= largest_finite<T>()) return {std::sqrt(ss), 0};
    const auto [scaled_ss, e] = scaled_squared_norm(x);
    return {std::sqrt(scaled_ss), e};
}

}  // namespace titans::detail
