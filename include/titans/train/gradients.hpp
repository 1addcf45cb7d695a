#pragma once
// titans/train/gradients.hpp: the gradients of a parameter struct taken as one vector (math
// §9): its global norm and the clipping of that norm (the tensors as flat slots:
// detail/tensor_slots.hpp).

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../detail/check.hpp"
#include "../detail/float_env.hpp"
#include "../detail/scaled_norm.hpp"
#include "../detail/tensor_slots.hpp"
#include "../error.hpp"
#include "../limits.hpp"

namespace titans {

/// The Euclidean norm of every tensor of `grads` taken as one vector (the tensors
/// Params::tensors(grads, cfg, .) names), computed in double with scaling, so it neither
/// overflows nor underflows for finite entries unless the norm itself exceeds the largest
/// double (+inf then: double gradients near that limit); +inf or NaN if an entry is.
/// Throws ShapeError ("grads do not fit cfg", naming the tensor and its expected shape) /
/// ConfigError (cfg invalid) first, as detail::check_fits.
template <class Params, class Config>
[[nodiscard]] double gradient_norm(const Params& grads, const Config& cfg) {
    detail::check_fits(grads, cfg, "gradient_norm", "grads");
    const auto [scale, sum] = detail::scaled_norm(detail::tensor_slots(grads, cfg));
    if (scale == 0.0 || !std::isfinite(scale)) return scale;
    return scale * std::sqrt(sum);
}

/// Global gradient-norm clipping: if gradient_norm(grads, cfg) exceeds max_norm, scales every
/// tensor by max_norm / norm (so the norm becomes max_norm). Returns the norm before clipping.
/// Throws, grads unchanged then: ConfigError (max_norm not finite and > 0 or not representable
/// in the scalar type T of grads; cfg invalid), ShapeError (grads do not fit cfg, as
/// gradient_norm), NonFiniteError (a gradient entry NaN or infinite; or, double gradients
/// only, a norm beyond the largest double).
///
///     const double norm = titans::clip_gradient_norm(grads, cfg, 1.0);
template <class Params, class Config>
double clip_gradient_norm(Params& grads, const Config& cfg, double max_norm) {
    using T = typename detail::ParamsScalar<Params>::type;
    constexpr const char* where = "clip_gradient_norm";
    detail::require<ConfigError>(std::isfinite(max_norm) && max_norm > 0, where, "max_norm",
                                 max_norm, "a finite value > 0");
    detail::require_representable<T>(max_norm, where, "max_norm");
    detail::check_fits(std::as_const(grads), cfg, where, "grads");
    const auto [scale, sum] = detail::scaled_norm(detail::tensor_slots(std::as_const(grads), cfg));
    if (!std::isfinite(scale)) {
        throw NonFiniteError(detail::concat(where, ": grads have a NaN or infinite entry"));
    }
    const double norm = scale == 0.0 ? 0.0 : scale * std::sqrt(sum);
    if (!std::isfinite(norm)) {
        throw NonFiniteError(detail::concat(where, ": the norm of grads exceeds the largest ",
                                            detail::scalar_name<T>(), " (every entry finite)"));
    }
    if (norm > max_norm) {
        const T factor = static_cast<T>(max_norm / norm);
        for (const auto& s : detail::tensor_slots(grads, cfg)) s.array() *= factor;
    }
    return norm;
}

}  // namespace titans
