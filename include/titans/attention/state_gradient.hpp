#pragma once
// titans/attention/state_gradient.hpp: the adjoint of an attention layer's state (math §9,
// "Chained pieces"): what Attention::backward takes for the window a piece leaves and returns
// for the window it started from, so that pieces reversed in turn equal one call.

#include <vector>

#include "../types.hpp"

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
};

}  // namespace titans
