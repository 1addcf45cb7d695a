#pragma once
// titans/detail/scaled_norm.hpp: the Euclidean norm of tensors taken as one vector, scaled so
// that it neither overflows nor underflows (math §9, global clipping): what gradient_norm and
// the backends' glue kernel scaled_norm compute.

#include <algorithm>
#include <cmath>
#include <utility>

#include <Eigen/Core>

#include "float_env.hpp"

namespace titans {

namespace detail {

/// scaled_norm entry by entry, in order: what a slot with a NaN or an infinity takes (a NaN
/// entry makes the sum NaN; an infinity makes the scale inf).
template <class Slots>
[[nodiscard]] std::pair<double, double> scaled_norm_serial(const Slots& slots) {
    double scale = 0.0;
    for (const auto& s : slots) {
        for (Eigen::Index i = 0; i < s.size(); ++i) {
            const double a = std::abs(static_cast<double>(s.data[i]));
            if (std::isnan(a)) return {a, 0.0};  // NaN sticks: no later entry may replace it
            if (!(a <= scale)) scale = a;
        }
    }
    if (scale == 0.0 || !std::isfinite(scale)) return {scale, 0.0};
    double sum = 0.0;
    for (const auto& s : slots) {
        for (Eigen::Index i = 0; i < s.size(); ++i) {
            const double a = static_cast<double>(s.data[i]) / scale;
            sum += a * a;
        }
    }
    return {scale, sum};
}

/// The Euclidean norm of every entry of `slots` as scale * sqrt(sum): scale the largest |entry|
/// (0 if all are 0; inf or NaN if an entry is), sum the squares of the entries / scale, in
/// double, so neither part overflows or underflows for finite entries. Finite slots take
/// Eigen's vectorised max and sum (the max exact, the sum summed in Eigen's order); a slot
/// with a NaN or an infinity takes the entry-by-entry pass (scaled_norm_serial).
template <class Slots>
[[nodiscard]] std::pair<double, double> scaled_norm(const Slots& slots) {
    double scale = 0.0;
    for (const auto& s : slots) {
        if (s.size() == 0) continue;
        if (!all_finite(s.array())) return scaled_norm_serial(slots);
        scale = std::max(scale, static_cast<double>(s.array().abs().maxCoeff()));
    }
    if (scale == 0.0) return {scale, 0.0};
    double sum = 0.0;
    for (const auto& s : slots) {
        if (s.size() == 0) continue;
        sum += (s.array().template cast<double>() / scale).square().sum();
    }
    return {scale, sum};
}

}  // namespace detail

}  // namespace titans
