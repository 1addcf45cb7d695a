#pragma once
// titans/attention/config.hpp: AttentionConfig, every setting of an Attention layer (math §7),
// its limits and validate().

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../error.hpp"
#include "../limits.hpp"

namespace titans {

/// Every setting of an Attention layer (math §7). Aggregate: use designated initialisers,
///
///     titans::AttentionConfig cfg{.d_model = 256, .n_heads = 4, .window = 128, .rope = true};
///
/// then `cfg.validate()` (the Attention constructor calls it) throws ConfigError naming the
/// first bad field.
struct AttentionConfig {
    int d_model = 64;           ///< d, width of the tokens in and out
    int n_heads = 1;            ///< H
    int d_head = 0;             ///< d_h; 0 means d_model / n_heads
    int window = 64;            ///< w >= 1: a query sees its own position and the w-1 before it
                                ///< (use a window >= the sequence length for full causal attention)
    bool rope = false;          ///< rotary position embedding of q and k (sequence tokens only)
    double rope_base = 10000.0; ///< RoPE base: pair i of a head turns by t * base^(-2i/d_h)

    /// d_h after defaulting.
    [[nodiscard]] int head_dim() const { return d_head > 0 ? d_head : d_model / n_heads; }
    /// D = H * d_h, the width of the concatenated heads.
    [[nodiscard]] int inner_dim() const { return n_heads * head_dim(); }

    /// Field-by-field equality.
    bool operator==(const AttentionConfig&) const = default;

    /// Serialization hook: calls v(name, field) for every setting, in declaration order, with
    /// name a std::string and field an int, double or bool reference (const if Self is).
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AttentionConfig>);
        using S = std::string;
        v(S("d_model"), self.d_model);
        v(S("n_heads"), self.n_heads);
        v(S("d_head"), self.d_head);
        v(S("window"), self.window);
        v(S("rope"), self.rope);
        v(S("rope_base"), self.rope_base);
    }

    /// Elements of the AttentionParams of this configuration (4 d x D), in 64 bits
    /// (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t parameter_count() const {
        return detail::sat_mul(4, d_model, inner_dim64());
    }

    /// Bytes of the state make_state(batch) builds once it is full (the last w - 1 keys and
    /// values of every sequence, plus limits::matrix_overhead_bytes per matrix),
    /// `scalar_bytes` per element, in 64 bits (saturating).
    [[nodiscard]] std::int64_t state_bytes(std::int64_t batch, std::int64_t scalar_bytes) const {
        using detail::sat_add;
        using detail::sat_mul;
        const std::int64_t per_sequence =
            sat_add(sat_mul(2, window - 1, inner_dim64(), scalar_bytes),
                    sat_mul(2, limits::matrix_overhead_bytes));
        return sat_mul(batch, per_sequence);
    }

    /// Throws ConfigError naming the first invalid field and what it must be: every field in
    /// its range (upper limits in titans/limits.hpp), rope_base finite and > 0, and the
    /// parameters and the full batch-1 state within limits::max_allocation_bytes at 4 bytes
    /// (float) per element. validate_for<T>() also counts sizeof(T) and checks rope_base is
    /// representable in T.
    void validate() const {
        constexpr const char* w = "AttentionConfig";
        using detail::require;
        using detail::require_in_range;
        detail::require_head_shape(d_model, n_heads, d_head, w);
        require_in_range(window, 1, limits::max_window, w, "window");
        if (rope) {
            require<ConfigError>(head_dim() % 2 == 0, w, "d_head", head_dim(),
                                 "an even number when rope = true (RoPE rotates pairs)");
        }
        require<ConfigError>(std::isfinite(rope_base) && rope_base > 0, w, "rope_base",
                             rope_base, "a finite value > 0");
        check_budget(4, "float");
    }

    /// validate(), then rope_base representable in T and the parameters and batch-1 state
    /// within the budget at sizeof(T) bytes per element. Called by Attention<T> and
    /// AttentionParams<T>::random / zeros.
    template <class T>
    void validate_for() const {
        validate();
        detail::require_representable<T>(rope_base, "AttentionConfig", "rope_base");
        check_budget(static_cast<std::int64_t>(sizeof(T)), detail::scalar_name<T>());
    }

    /// H * d_h in 64 bits (saturating; 0 rather than a division by zero when n_heads < 1).
    [[nodiscard]] std::int64_t inner_dim64() const {
        const std::int64_t dh = d_head > 0 ? d_head : (n_heads > 0 ? d_model / n_heads : 0);
        return detail::sat_mul(n_heads, dh);
    }

private:
    void check_budget(std::int64_t scalar_bytes, const char* scalar) const {
        constexpr const char* w = "AttentionConfig";
        detail::require_budget(detail::sat_mul(parameter_count(), scalar_bytes), w,
                               "parameter size", scalar, "reduce d_model, n_heads or d_head");
        detail::require_budget(state_bytes(1, scalar_bytes), w, "state size for batch 1", scalar,
                               "reduce window, n_heads or d_head (the state keeps the last "
                               "window - 1 keys and values)");
    }
};

}  // namespace titans
