#pragma once
// titans/train/adamw.hpp: AdamW, the optimiser of the outer parameters (math §9).

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../types.hpp"
#include "gradients.hpp"

namespace titans {

/// Settings of AdamW (Loshchilov & Hutter, 2019). Aggregate; the learning rate is given per
/// step (WarmupCosine computes it).
struct AdamWConfig {
    double beta1 = 0.9;           ///< decay of the first moment, in [0, 1)
    double beta2 = 0.999;         ///< decay of the second moment, in [0, 1)
    double eps = 1e-8;            ///< added to the root of the second moment, finite, > 0
    double weight_decay = 0.01;   ///< decoupled decay λ, finite, >= 0
    /// Decay vectors too (tensors with one row or one column: norm weights, gate vectors).
    /// Off by default: only matrices are decayed, as is usual for norms and biases.
    bool decay_vectors = false;

    /// ConfigError naming the first invalid field.
    void validate() const {
        constexpr const char* w = "AdamWConfig";
        detail::require<ConfigError>(beta1 >= 0 && beta1 < 1, w, "beta1", beta1, "a value in [0, 1)");
        detail::require<ConfigError>(beta2 >= 0 && beta2 < 1, w, "beta2", beta2, "a value in [0, 1)");
        detail::require<ConfigError>(std::isfinite(eps) && eps > 0, w, "eps", eps,
                                     "a finite value > 0");
        detail::require<ConfigError>(std::isfinite(weight_decay) && weight_decay >= 0, w,
                                     "weight_decay", weight_decay, "a finite value >= 0");
    }

    /// Serialization hook: v(name, field) for every field.
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AdamWConfig>);
        v(std::string("beta1"), self.beta1);
        v(std::string("beta2"), self.beta2);
        v(std::string("eps"), self.eps);
        v(std::string("weight_decay"), self.weight_decay);
        v(std::string("decay_vectors"), self.decay_vectors);
    }
};

/// AdamW over the tensors of a parameter struct (any of ours: FeedForwardParams, BlockParams,
/// ModelParams, ...; its tensors() visitor names the tensors, and the gradients are a struct of
/// the same type). Step t = steps() + 1, for each tensor p with gradient g, elementwise:
///
///     m <- β1 m + (1 - β1) g,        v <- β2 v + (1 - β2) g²
///     p <- p (1 - lr λ) - lr (m / (1 - β1^t)) / (sqrt(v / (1 - β2^t)) + ε)
///
/// (λ only for matrices unless decay_vectors). The moments are kept per tensor name, in T.
///
///     titans::AdamW<float> opt({.weight_decay = 0.1});
///     titans::WarmupCosine lr{.peak = 3e-3, .warmup = 100, .total = 2000};
///     titans::clip_gradient_norm(grads, cfg, 1.0);
///     opt.step(params, grads, cfg, lr(opt.steps() + 1));
template <class T>
class AdamW {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::AdamW: T must be float or double");

public:
    using Scalar = T;
    /// The moments of one tensor, shaped as the tensor.
    struct Moments {
        Matrix<T> m, v;
    };

    explicit AdamW(AdamWConfig config = {}) : cfg_(config) { cfg_.validate(); }

    /// An optimiser resumed from saved state (what titans::io::load_optimizer does): `steps`
    /// taken, the moments by tensor name. ConfigError / ShapeError (m and v of different
    /// shapes) / NonFiniteError.
    AdamW(AdamWConfig config, std::int64_t steps, std::map<std::string, Moments> moments)
        : cfg_(config), steps_(steps), moments_(std::move(moments)) {
        cfg_.validate();
        detail::require<ConfigError>(steps_ >= 0, "AdamW", "steps", steps_, ">= 0");
        for (const auto& [name, mo] : moments_) {
            if (mo.m.rows() != mo.v.rows() || mo.m.cols() != mo.v.cols()) {
                throw ShapeError(detail::concat("AdamW: moments of '", name, "' differ in shape"));
            }
            if (!mo.m.allFinite() || !mo.v.allFinite() || (mo.v.array() < 0).any()) {
                throw NonFiniteError(detail::concat("AdamW: moments of '", name,
                                                    "' have a NaN, infinite or negative entry"));
            }
        }
    }

    [[nodiscard]] const AdamWConfig& config() const { return cfg_; }
    /// Steps taken.
    [[nodiscard]] std::int64_t steps() const { return steps_; }
    /// The moments by tensor name (empty before the first step).
    [[nodiscard]] const std::map<std::string, Moments>& moments() const { return moments_; }

    /// One step at learning rate lr (finite, >= 0) on every tensor Params::tensors(params, cfg,
    /// .) names. Throws, changing nothing: ConfigError (lr), ShapeError (grads not shaped as
    /// params, or tensors other than those of the earlier steps), NonFiniteError (a gradient
    /// entry NaN or infinite).
    template <class Params, class Config>
    void step(Params& params, const Params& grads, const Config& cfg, double lr) {
        detail::require<ConfigError>(std::isfinite(lr) && lr >= 0, "AdamW::step", "lr", lr,
                                     "a finite value >= 0");
        const auto ps = detail::tensor_slots(params, cfg);
        const auto gs = detail::tensor_slots(grads, cfg);
        check(ps, gs);
        const std::int64_t t = steps_ + 1;
        const double bias1 = 1 - std::pow(cfg_.beta1, static_cast<double>(t));
        const double bias2 = 1 - std::pow(cfg_.beta2, static_cast<double>(t));
        for (std::size_t i = 0; i < ps.size(); ++i) {
            Moments& mo = moments_[ps[i].name];
            if (mo.m.size() == 0) {
                mo.m = Matrix<T>::Zero(ps[i].rows, ps[i].cols);
                mo.v = Matrix<T>::Zero(ps[i].rows, ps[i].cols);
            }
            const bool decay = cfg_.decay_vectors || std::min(ps[i].rows, ps[i].cols) > 1;
            update(ps[i].array(), gs[i].array(), mo, lr, decay ? cfg_.weight_decay : 0.0, bias1,
                   bias2);
        }
        steps_ = t;
    }

private:
    template <class P, class G>
    void update(P p, const G& g, Moments& mo, double lr, double decay, double bias1,
                double bias2) const {
        using A = Eigen::Array<T, Eigen::Dynamic, 1>;
        Eigen::Map<A> m(mo.m.data(), mo.m.size()), v(mo.v.data(), mo.v.size());
        const T b1 = static_cast<T>(cfg_.beta1), b2 = static_cast<T>(cfg_.beta2);
        m = b1 * m + (T(1) - b1) * g;
        v = b2 * v + (T(1) - b2) * g.square();
        const T step = static_cast<T>(lr / bias1);
        const T root2 = static_cast<T>(std::sqrt(bias2));
        const T eps = static_cast<T>(cfg_.eps);
        if (decay > 0) p *= static_cast<T>(1 - lr * decay);
        p -= step * m / (v.sqrt() / root2 + eps);
    }

    /// Everything step() refuses, before anything changes.
    template <class PS, class GS>
    void check(const PS& ps, const GS& gs) const {
        constexpr const char* where = "AdamW::step";
        for (std::size_t i = 0; i < ps.size(); ++i) {
            const auto& p = ps[i];
            const auto& g = gs[i];
            detail::check_slot_shape(p, g, where, "grads");
            if (!g.array().allFinite()) {
                throw NonFiniteError(detail::concat(where, ": grads '", g.name,
                                                    "' has a NaN or infinite entry"));
            }
            if (steps_ == 0) continue;
            const auto it = moments_.find(p.name);
            if (it == moments_.end() || it->second.m.rows() != p.rows ||
                it->second.m.cols() != p.cols) {
                throw ShapeError(detail::concat(where, ": tensor '", p.name, "' (", p.rows, " x ",
                                                p.cols, ") is not one this optimiser has stepped "
                                                "(expected the parameters of its earlier steps)"));
            }
        }
        if (steps_ > 0 && ps.size() != moments_.size()) {
            throw ShapeError(detail::concat(where, ": params have ", ps.size(),
                                            " tensors, expected ", moments_.size(),
                                            " (the parameters of the earlier steps)"));
        }
    }

    AdamWConfig cfg_;
    std::int64_t steps_ = 0;
    std::map<std::string, Moments> moments_;
};

}  // namespace titans
