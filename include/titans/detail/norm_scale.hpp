#pragma once
// titans/detail/norm_scale.hpp: sums of squares that cannot overflow, for the norms of math §7
// (RMSNorm, the memory's q / k L2 normalisation) on every backend.
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
template <class T>
TITANS_HOST_DEVICE int scale_exponent(T amax) {
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

}  // namespace titans::detail
