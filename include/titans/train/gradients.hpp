#pragma once
// titans/train/gradients.hpp: the gradients of a parameter struct taken as one vector (math
// §9): its global norm and the clipping of that norm (the tensors as flat slots:
// detail/tensor_slots.hpp).

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../detail/tensor_slots.hpp"
#include "../error.hpp"

namespace titans {

/// The Euclidean norm of every tensor of `grads` taken as one vector (the tensors
/// Params::tensors(grads, cfg, .) names), computed in double with scaling, so it neither
/// overflows nor underflows for finite entries; +inf or NaN if an entry is.
template <class Params, class Config>
[[nodiscard]] double gradient_norm(const Params& grads, const Config& cfg) {
    const auto slots = detail::tensor_slots(grads, cfg);
    double scale = 0.0;
    for (const auto& s : slots) {
        for (Eigen::Index i = 0; i < s.size(); ++i) {
            const double a = std::abs(static_cast<double>(s.data[i]));
            if (!(a <= scale)) scale = a;  // NaN propagates
        }
    }
    if (scale == 0.0 || !std::isfinite(scale)) return scale;
    double sum = 0.0;
    for (const auto& s : slots) {
        for (Eigen::Index i = 0; i < s.size(); ++i) {
            const double a = static_cast<double>(s.data[i]) / scale;
            sum += a * a;
        }
    }
    return scale * std::sqrt(sum);
}

/// Global gradient-norm clipping: if gradient_norm(grads, cfg) exceeds max_norm, scales every
/// tensor by max_norm / norm (so the norm becomes max_norm). Returns the norm before clipping.
/// Throws ConfigError (max_norm not finite and > 0), NonFiniteError (a gradient entry NaN or
/// infinite; grads unchanged then).
///
///     const double norm = titans::clip_gradient_norm(grads, cfg, 1.0);
template <class Params, class Config>
double clip_gradient_norm(Params& grads, const Config& cfg, double max_norm) {
    detail::require<ConfigError>(std::isfinite(max_norm) && max_norm > 0, "clip_gradient_norm",
                                 "max_norm", max_norm, "a finite value > 0");
    const double norm = gradient_norm(std::as_const(grads), cfg);
    if (!std::isfinite(norm)) {
        throw NonFiniteError("clip_gradient_norm: grads have a NaN or infinite entry");
    }
    if (norm > max_norm) {
        using T = typename detail::ParamsScalar<Params>::type;
        const T factor = static_cast<T>(max_norm / norm);
        for (const auto& s : detail::tensor_slots(grads, cfg)) s.array() *= factor;
    }
    return norm;
}

}  // namespace titans
