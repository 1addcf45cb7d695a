#pragma once
// titans/train/schedule.hpp: WarmupCosine, the learning rate of a training step (math §9).

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <type_traits>

#include "../error.hpp"

namespace titans {

/// The learning rate at step t = 1, 2, ...: a linear warm-up from 0 to `peak` over `warmup`
/// steps, then a half cosine from `peak` down to `floor * peak` at step `total`, then
/// `floor * peak`:
///
///     lr(t) = peak t / warmup                                     t <= warmup
///           = peak (floor + (1 - floor) (1 + cos(pi s)) / 2),     s = (t - warmup) / (total - warmup)
///           = peak floor                                          t >= total
///
/// `total = 0` (or total <= warmup) means no decay: `peak` after the warm-up.
///
///     titans::WarmupCosine lr{.peak = 3e-3, .warmup = 100, .total = 2000};
///     double rate = lr(step);
struct WarmupCosine {
    double peak = 1e-3;         ///< the rate at the end of the warm-up, finite, >= 0
    std::int64_t warmup = 0;    ///< steps of linear warm-up, >= 0
    std::int64_t total = 0;     ///< the step where the decay ends; 0: no decay
    double floor = 0.1;         ///< the final rate as a fraction of peak, in [0, 1]

    /// ConfigError naming the first invalid field.
    void validate() const {
        constexpr const char* w = "WarmupCosine";
        detail::require<ConfigError>(std::isfinite(peak) && peak >= 0, w, "peak", peak,
                                     "a finite value >= 0");
        detail::require<ConfigError>(warmup >= 0, w, "warmup", warmup, ">= 0");
        detail::require<ConfigError>(total >= 0, w, "total", total, ">= 0 (0: no decay)");
        detail::require<ConfigError>(floor >= 0 && floor <= 1, w, "floor", floor,
                                     "a value in [0, 1]");
    }

    /// The rate at step t >= 1. ConfigError for t < 1 or an invalid field (validate(): a
    /// schedule built with bad fields never yields a rate). With the fields valid, t - warmup
    /// and total - warmup are only formed when positive, so no int64 value overflows.
    [[nodiscard]] double operator()(std::int64_t t) const {
        validate();
        detail::require<ConfigError>(t >= 1, "WarmupCosine", "step", t, ">= 1");
        if (t <= warmup) return peak * static_cast<double>(t) / static_cast<double>(warmup);
        if (total <= warmup) return peak;
        if (t >= total) return peak * floor;
        const double s = static_cast<double>(t - warmup) / static_cast<double>(total - warmup);
        return peak * (floor + (1 - floor) * 0.5 * (1 + std::cos(std::numbers::pi * s)));
    }

    /// Serialization hook: v(name, field) for peak, warmup, total, floor.
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, WarmupCosine>);
        v(std::string("peak"), self.peak);
        v(std::string("warmup"), self.warmup);
        v(std::string("total"), self.total);
        v(std::string("floor"), self.floor);
    }
};

}  // namespace titans
