#pragma once
// titans/train/gradients.hpp: the gradients of a parameter struct taken as one vector (math
// §9): its global norm and the clipping of that norm; and the tensors of a parameter struct as
// flat slots, which the optimiser pairs with the gradients'.

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../detail/check.hpp"
#include "../error.hpp"
#include "../limits.hpp"

namespace titans {

namespace detail {

/// The scalar type of a parameter struct: P::Scalar where the struct names it (a user's own
/// struct), else T of a template P<T> (FeedForwardParams<T>, ModelParams<T>, ...).
template <class P>
struct ParamsScalar {
    using type = typename P::Scalar;
};
template <template <class> class P, class T>
struct ParamsScalar<P<T>> {
    using type = T;
};

/// One tensor of a parameter struct as its visitor names it: entries [data, data + size()),
/// contiguous (Matrix<T> and RowVector<T> both are). X is T or const T.
template <class X>
struct TensorSlot {
    std::string name;
    X* data;
    Eigen::Index rows, cols;
    [[nodiscard]] Eigen::Index size() const { return rows * cols; }
    [[nodiscard]] auto array() const {
        using T = std::remove_const_t<X>;
        using A = Eigen::Array<T, Eigen::Dynamic, 1>;
        using Map = std::conditional_t<std::is_const_v<X>, Eigen::Map<const A>, Eigen::Map<A>>;
        return Map(data, size());
    }
};

/// The tensors Params::tensors(p, cfg, .) visits, in its order (p const or not).
template <class Params, class Config>
[[nodiscard]] auto tensor_slots(Params& p, const Config& cfg) {
    using T = typename ParamsScalar<std::remove_const_t<Params>>::type;
    using X = std::conditional_t<std::is_const_v<Params>, const T, T>;
    std::vector<TensorSlot<X>> out;
    std::remove_const_t<Params>::tensors(p, cfg, [&](const std::string& name, auto& m) {
        out.push_back(TensorSlot<X>{name, m.data(), m.rows(), m.cols()});
    });
    return out;
}

/// ShapeError (naming `what` and the tensor) unless slot g has the shape of slot p.
template <class P, class G>
void check_slot_shape(const P& p, const G& g, const char* where, const char* what) {
    if (g.rows != p.rows || g.cols != p.cols) {
        throw ShapeError(concat(where, ": ", what, " '", g.name, "' is ", g.rows, " x ", g.cols,
                                ", expected ", p.rows, " x ", p.cols,
                                " (the shape of the parameter)"));
    }
}

/// ShapeError "<where>: <what> do not fit cfg: <reason>" unless `p` holds every tensor
/// Params::tensors(., cfg, .) names at the shape `cfg` gives it; ConfigError "<where>: cfg:
/// ..." if cfg has a validate() that refuses it. Reads p only (const visits). Our parameter
/// structs are checked by their validate(cfg); where it stops at a NaN, the shapes are compared
/// with those of Params::zeros(cfg) instead (allocated only then). A user's own struct without
/// validate(cfg) is checked by its const tensors() visit only (the pairing with another struct
/// is the caller's check).
template <class Params, class Config>
void check_fits(const Params& p, const Config& cfg, const char* where, const char* what) {
    if constexpr (requires { cfg.validate(); }) {
        with_context(concat(where, ": cfg: "), [&] { cfg.validate(); });
    }
    with_context(concat(where, ": ", what, " do not fit cfg: "), [&] {
        if constexpr (requires { p.validate(cfg); }) {
            try {
                p.validate(cfg);
                return;
            } catch (const NonFiniteError&) {  // the shapes after the NaN are unchecked
            }
        }
        if constexpr (requires { Params::zeros(cfg); }) {
            const Params zeros = Params::zeros(cfg);
            const auto expected = tensor_slots(zeros, cfg);
            const auto got = tensor_slots(p, cfg);
            for (std::size_t i = 0; i < got.size(); ++i) {
                const auto &e = expected[i], &g = got[i];
                if (g.rows != e.rows || g.cols != e.cols) {
                    throw ShapeError(concat("'", g.name, "' is ", g.rows, " x ", g.cols,
                                            ", expected ", e.rows, " x ", e.cols));
                }
            }
        } else {
            (void)tensor_slots(p, cfg);  // the struct's own structure checks
        }
    });
}

/// The gradients a backward adds to: ShapeError unless every tensor of grads has the shape of
/// params' tensor of the same name, NonFiniteError if an entry is NaN or infinite. Reads grads
/// only (a const visit).
template <class Params, class Config>
void check_same_tensors(const Params& params, const Params& grads, const Config& cfg,
                        const char* where, const char* what) {
    const auto ps = tensor_slots(params, cfg);
    const auto gs = tensor_slots(grads, cfg);
    for (std::size_t i = 0; i < ps.size(); ++i) {
        check_slot_shape(ps[i], gs[i], where, what);
        if (!gs[i].array().allFinite()) {
            throw NonFiniteError(concat(where, ": ", what, " '", gs[i].name,
                                        "' has a NaN or infinite entry"));
        }
    }
}

/// Whether every entry of every tensor of p is finite.
template <class Params, class Config>
[[nodiscard]] bool tensors_finite(const Params& p, const Config& cfg) {
    for (const auto& s : tensor_slots(p, cfg)) {
        if (!s.array().allFinite()) return false;
    }
    return true;
}

/// to += from, tensor by tensor (same shapes).
template <class Params, class Config>
void add_tensors(const Params& from, Params& to, const Config& cfg) {
    const auto fs = tensor_slots(from, cfg);
    const auto ts = tensor_slots(to, cfg);
    for (std::size_t i = 0; i < fs.size(); ++i) {
        ts[i].array() += fs[i].array();
    }
}

}  // namespace detail

namespace detail {

/// The Euclidean norm of every entry of `slots` as scale * sqrt(sum): scale the largest |entry|
/// (0 if all are 0; inf or NaN if an entry is), sum the squares of the entries / scale, in
/// double, so neither part overflows or underflows for finite entries.
template <class Slots>
[[nodiscard]] std::pair<double, double> scaled_norm(const Slots& slots) {
    double scale = 0.0;
    for (const auto& s : slots) {
        for (Eigen::Index i = 0; i < s.size(); ++i) {
            const double a = std::abs(static_cast<double>(s.data[i]));
            if (!(a <= scale)) scale = a;  // NaN propagates
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

}  // namespace detail

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
