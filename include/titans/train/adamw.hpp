#pragma once
// titans/train/adamw.hpp: AdamW, the optimiser of the outer parameters (math §9).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/adamw_update.hpp"
#include "../detail/float_env.hpp"
#include "../error.hpp"
#include "../limits.hpp"
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

    /// validate(), then the rules of the scalar type T the optimiser computes in (what AdamW<T>
    /// checks): every setting representable in T (neither rounding to infinity nor, unless 0,
    /// to 0: an eps that rounds to 0 would divide 0 by 0), and beta1, beta2 still < 1 once
    /// rounded to T (else a moment never moves). ConfigError naming the setting.
    template <class T>
    void validate_for() const {
        validate();
        constexpr const char* w = "AdamWConfig";
        detail::require_representable<T>(beta1, w, "beta1");
        detail::require_representable<T>(beta2, w, "beta2");
        detail::require_representable<T>(eps, w, "eps");
        detail::require_representable<T>(weight_decay, w, "weight_decay");
        const std::string below_one = detail::concat("a value that stays < 1 in ",
                                                     detail::scalar_name<T>());
        detail::require<ConfigError>(static_cast<T>(beta1) < 1, w, "beta1", beta1, below_one);
        detail::require<ConfigError>(static_cast<T>(beta2) < 1, w, "beta2", beta2, below_one);
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
/// A step either completes or throws and changes nothing (parameters, moments, steps()): every
/// argument is checked first, and the update is computed once into scratch to make sure every
/// new parameter and moment is finite in T before any is written.
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

    /// A fresh optimiser. ConfigError as config.validate_for<T>().
    explicit AdamW(AdamWConfig config = {}) : cfg_(config) { cfg_.validate_for<T>(); }

    /// An optimiser resumed from saved state (what titans::io::load_optimizer does): `steps`
    /// taken, the moments by tensor name. Throws as validate_state. Moments with steps = 0 are
    /// accepted and, like any moments, must match the parameters of the next step.
    AdamW(AdamWConfig config, std::int64_t steps, std::map<std::string, Moments> moments)
        : cfg_(config), steps_(steps), moments_(std::move(moments)) {
        validate_state(cfg_, steps_, moments_, "AdamW");
    }

    /// What an AdamW<T> may hold (the resuming constructor's checks, and what
    /// io::save_optimizer checks before writing): ConfigError (config.validate_for<T>(),
    /// steps < 0), ShapeError (a tensor's m and v of different shapes), NonFiniteError (a
    /// moment NaN or infinite, or v negative). `where` starts the messages of the last three.
    static void validate_state(const AdamWConfig& config, std::int64_t steps,
                               const std::map<std::string, Moments>& moments, const char* where) {
        config.validate_for<T>();
        detail::require<ConfigError>(steps >= 0, where, "steps", steps, ">= 0");
        for (const auto& [name, mo] : moments) {
            if (mo.m.rows() != mo.v.rows() || mo.m.cols() != mo.v.cols()) {
                throw ShapeError(detail::concat(where, ": moments of '", name, "' differ in shape (m ",
                                                mo.m.rows(), " x ", mo.m.cols(), ", v ",
                                                mo.v.rows(), " x ", mo.v.cols(),
                                                "), expected one shape"));
            }
            if (!detail::all_finite(mo.m) || !detail::all_finite(mo.v) || (mo.v.array() < 0).any()) {
                throw NonFiniteError(detail::concat(where, ": moments of '", name,
                                                    "' have a NaN, infinite or negative entry"));
            }
        }
    }

    [[nodiscard]] const AdamWConfig& config() const { return cfg_; }
    /// Steps taken.
    [[nodiscard]] std::int64_t steps() const { return steps_; }
    /// The moments by tensor name (empty before the first step).
    [[nodiscard]] const std::map<std::string, Moments>& moments() const { return moments_; }

    /// One step at learning rate lr on every tensor Params::tensors(params, cfg, .) names.
    /// Throws, changing nothing (params, grads, moments, steps()):
    /// - ConfigError: lr not finite and >= 0, or lr / (1 - β1^t) or 1 - lr λ not finite in T;
    ///   steps() at its limit (INT64_MAX); cfg invalid (where it has a validate()).
    /// - ShapeError: params or grads not of the shapes cfg gives ("params do not fit cfg",
    ///   "grads do not fit cfg", naming the tensor or the count and the expected value), grads
    ///   not shaped as params, two tensors of one name, or (the optimiser has moments) tensors
    ///   other than those of its moments.
    /// - NonFiniteError: a NaN or infinite entry in params or grads, or a step whose new
    ///   parameters or moments would not be finite in T (naming the tensor and which: the
    ///   first moment, the second moment, whose g² may overflow float, or the parameter).
    template <class Params, class Config>
    void step(Params& params, const Params& grads, const Config& cfg, double lr) {
        const Factors f = next_step(lr);
        detail::check_fits(std::as_const(params), cfg, where_, "params");  // reads only
        detail::check_fits(grads, cfg, where_, "grads");
        const auto ps = detail::tensor_slots(std::as_const(params), cfg);
        const auto gs = detail::tensor_slots(grads, cfg);
        check(ps, gs);
        check_result(ps, gs, f);
        // Every check passed: the non-const visit resizes nothing now (the structure fits cfg).
        // What may throw (allocations) comes before the first write.
        const auto out = detail::tensor_slots(params, cfg);
        std::map<std::string, Moments> added;  // a fresh optimiser's zero moments
        for (const auto& s : out) {
            if (!moments_.contains(s.name)) {
                added[s.name] = {Matrix<T>::Zero(s.rows, s.cols), Matrix<T>::Zero(s.rows, s.cols)};
            }
        }
        moments_.merge(added);
        for (std::size_t i = 0; i < out.size(); ++i) {
            const auto& s = out[i];
            Moments& mo = moments_.find(s.name)->second;
            const Eigen::Index n = s.size();
            update(f, decays(s.rows, s.cols), In(s.data, n), In(gs[i].data, n), In(mo.m.data(), n),
                   In(mo.v.data(), n), Out(s.data, n), Out(mo.m.data(), n), Out(mo.v.data(), n));
        }
        steps_ = f.t;
    }

    /// The scalars of step steps() + 1 at rate lr (what step() applies; ModelAdamW's kernels
    /// take them). ConfigError (lr, the step counter) if one is not finite in T or the counter
    /// cannot advance.
    [[nodiscard]] detail::AdamWStep<T> next_step(double lr) const {
        detail::require<ConfigError>(std::isfinite(lr) && lr >= 0, where_, "lr", lr,
                                     "a finite value >= 0");
        constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
        detail::require<ConfigError>(steps_ < top, where_, "steps()", steps_,
                                     detail::concat("< ", top, " (the step counter is at its limit)"));
        const std::int64_t t = steps_ + 1;
        const double bias1 = 1 - std::pow(cfg_.beta1, static_cast<double>(t));
        const double bias2 = 1 - std::pow(cfg_.beta2, static_cast<double>(t));
        const detail::AdamWStep<T> f{t,
                        static_cast<T>(cfg_.beta1),
                        static_cast<T>(cfg_.beta2),
                        static_cast<T>(cfg_.eps),
                        static_cast<T>(lr / bias1),
                        static_cast<T>(std::sqrt(bias2)),
                        static_cast<T>(1 - lr * cfg_.weight_decay)};
        const char* type = detail::scalar_name<T>();
        detail::require<ConfigError>(std::isfinite(f.step), where_, "lr", lr,
                                     detail::concat("a rate whose step lr / (1 - beta1^t) = ",
                                                    lr / bias1, " (t = ", t, ") is finite in ",
                                                    type));
        detail::require<ConfigError>(std::isfinite(f.shrink), where_, "lr", lr,
                                     detail::concat("a rate whose decay factor 1 - lr * "
                                                    "weight_decay = ", 1 - lr * cfg_.weight_decay,
                                                    " is finite in ", type));
        return f;
    }

    /// Whether a rows x cols tensor is decayed: λ > 0, and a matrix or decay_vectors.
    [[nodiscard]] bool decays(Eigen::Index rows, Eigen::Index cols) const {
        return cfg_.weight_decay > 0 && (cfg_.decay_vectors || std::min(rows, cols) > 1);
    }

private:
    using A = Eigen::Array<T, Eigen::Dynamic, 1>;
    using In = Eigen::Map<const A>;
    using Out = Eigen::Map<A>;
    static constexpr const char* where_ = "AdamW::step";

    using Factors = detail::AdamWStep<T>;

    /// The update of one tensor's entries (math §9) from p, g, m, v to p1, m1, v1, which may be
    /// p, m, v themselves. The one expression both check_result and step run (and the glue
    /// kernels' adamw: detail::adamw_update), so the check sees the values the step writes.
    static void update(const Factors& f, bool shrink, In p, In g, In m, In v, Out p1, Out m1,
                       Out v1) {
        (void)detail::adamw_update(f, shrink, p, g, m, v, p1, m1, v1);
    }

    /// Everything step() refuses about the tensors, before anything changes.
    template <class PS, class GS>
    void check(const PS& ps, const GS& gs) const {
        std::set<std::string> names;
        for (std::size_t i = 0; i < ps.size(); ++i) {
            const auto& p = ps[i];
            const auto& g = gs[i];
            detail::check_slot_shape(p, g, where_, "grads");
            if (!detail::all_finite(g.array()) || !detail::all_finite(p.array())) {
                throw NonFiniteError(detail::concat(where_, ": ",
                                                    g.array().allFinite() ? "params" : "grads",
                                                    " '", g.name, "' has a NaN or infinite entry"));
            }
            if (!names.insert(p.name).second) {
                throw ShapeError(detail::concat(where_, ": params name the tensor '", p.name,
                                                "' twice, expected distinct names"));
            }
        }
        if (steps_ == 0 && moments_.empty()) return;  // a fresh optimiser takes any tensors
        for (const auto& p : ps) {
            const auto it = moments_.find(p.name);
            if (it == moments_.end() || it->second.m.rows() != p.rows ||
                it->second.m.cols() != p.cols) {
                throw ShapeError(detail::concat(where_, ": params '", p.name, "' (", p.rows, " x ",
                                                p.cols, ") is not a tensor of this optimiser's "
                                                "moments (expected the parameters of its earlier "
                                                "steps)"));
            }
        }
        if (ps.size() != moments_.size()) {
            throw ShapeError(detail::concat(where_, ": params have ", ps.size(),
                                            " tensors, expected ", moments_.size(),
                                            " (the tensors of this optimiser's moments)"));
        }
    }

    /// NonFiniteError, naming the tensor and which value, if the step would make an entry of a
    /// parameter or moment NaN or infinite in T (a g² beyond the largest float, a large rate or
    /// decay, moments far from their gradients): update() run chunk by chunk into scratch.
    template <class PS, class GS>
    void check_result(const PS& ps, const GS& gs, const Factors& f) const {
        constexpr Eigen::Index chunk = 1024;  // a multiple of every packet size
        A p1(chunk), m1(chunk), v1(chunk);
        const A zero = A::Zero(chunk);
        for (std::size_t i = 0; i < ps.size(); ++i) {
            const auto it = moments_.find(ps[i].name);
            const bool has = it != moments_.end();
            for (Eigen::Index at = 0; at < ps[i].size(); at += chunk) {
                const Eigen::Index n = std::min(chunk, ps[i].size() - at);
                update(f, decays(ps[i].rows, ps[i].cols), In(ps[i].data + at, n), In(gs[i].data + at, n),
                       has ? In(it->second.m.data() + at, n) : In(zero.data(), n),
                       has ? In(it->second.v.data() + at, n) : In(zero.data(), n),
                       Out(p1.data(), n), Out(m1.data(), n), Out(v1.data(), n));
                const char* which = !m1.head(n).allFinite()   ? "the first moment m"
                                    : !v1.head(n).allFinite() ? "the second moment v (g²)"
                                    : !p1.head(n).allFinite() ? "the parameter"
                                                              : nullptr;
                if (which != nullptr) {
                    throw NonFiniteError(detail::concat(
                        where_, ": the step would make ", which, " of '", ps[i].name,
                        "' NaN or infinite in ", detail::scalar_name<T>(), ", expected finite "
                        "values (smaller gradients, lr or weight_decay); nothing changed"));
                }
            }
        }
    }

    AdamWConfig cfg_;
    std::int64_t steps_ = 0;
    std::map<std::string, Moments> moments_;
};

}  // namespace titans
