#pragma once
// titans/attention/state_gradient.hpp: the adjoint of an attention layer's state (math §9,
// "Chained pieces"): what Attention::backward takes for the window a piece leaves and returns
// for the window it started from, so that pieces reversed in turn equal one call.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../detail/check.hpp"
#include "../limits.hpp"
#include "../types.hpp"
#include "config.hpp"

namespace titans {

/// dL/d(state) of B attention streams: per sequence b, the adjoint of the kept keys (rotated,
/// as AttentionState::keys(b) holds them) and of the kept values, both min(w - 1, position) x D
/// (D = n_heads * d_head). The position is an integer and has no adjoint. A default-constructed
/// one (empty()) means "no gradient".
///
///     titans::AttentionStateGradient<double> d2;
///     attn.backward(trace2, dy2, dx2, grads, nullptr, &d2);       // d2 = dL/d(its start)
///     attn.backward(trace1, dy1, dx1, grads, nullptr, nullptr, &d2);  // with its end's adjoint
template <class T>
struct AttentionStateGradient {
    std::vector<Matrix<T>> keys, values;

    [[nodiscard]] bool empty() const { return keys.empty(); }

    /// Every entry 0, shaped as the window `batch` streams at `position` keep in a layer
    /// configured by `cfg` (keys[b], values[b]: min(w - 1, position) x D): the d_state_out to
    /// give backward when only another part of a chained state has a gradient. ConfigError:
    /// cfg invalid, batch outside [1, max_batch], position outside [0, max_position].
    ///
    ///     auto d = titans::AttentionStateGradient<double>::zeros(attn.config(), B, st.position());
    [[nodiscard]] static AttentionStateGradient zeros(const AttentionConfig& cfg, int batch,
                                                      std::int64_t position) {
        constexpr const char* where = "AttentionStateGradient::zeros";
        cfg.validate();
        detail::require_in_range(batch, 1, limits::max_batch, where, "batch");
        detail::require<ConfigError>(position >= 0 && position <= limits::max_position, where,
                                     "position", position, "a value in [0, max_position = 2^62]");
        const auto rows = static_cast<Eigen::Index>(
            std::min<std::int64_t>(cfg.window - 1, position));
        AttentionStateGradient d;
        d.keys.assign(static_cast<std::size_t>(batch), Matrix<T>::Zero(rows, cfg.inner_dim()));
        d.values = d.keys;
        return d;
    }
};

}  // namespace titans
