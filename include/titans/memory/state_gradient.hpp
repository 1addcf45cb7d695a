#pragma once
// titans/memory/state_gradient.hpp: the adjoint of a neural memory's state (math §9, "chained
// pieces"): what NeuralMemory::backward takes for the state a piece leaves and returns for the
// state it started from, so that pieces reversed in turn equal one call.

#include <cstddef>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/float_env.hpp"
#include "../limits.hpp"
#include "../types.hpp"
#include "config.hpp"

namespace titans {

/// dL/d(state) of B streams at a chunk boundary: per (sequence b, head h), index b * H + h,
/// the weights W_l and momentum S_l (layer l at index l-1, layer_in(l) x layer_out(l)), and
/// per sequence the conv tail, the last K-1 rows of x [W_Q | W_K | W_V] before the conv
/// ((K-1) x 3D; 0 rows without a conv, where the vector may also be empty). Shapes as
/// current_weights() returns them; a default-constructed one (empty()) means "no gradient".
///
///     titans::MemoryStateGradient<double> d2;
///     mem.backward(trace2, dy2, dx2, grads, &d2);          // the second piece: d2 = dL/d(its start)
///     mem.backward(trace1, dy1, dx1, grads, nullptr, &d2); // the first, with its end's adjoint
template <class T>
struct MemoryStateGradient {
    std::vector<std::vector<Matrix<T>>> weights, momentum;
    std::vector<Matrix<T>> conv_tail;

    [[nodiscard]] bool empty() const { return weights.empty(); }

    /// Whether every entry (weights, momentum, conv tails) is finite.
    [[nodiscard]] bool finite() const {
        return detail::all_finite_each(weights) && detail::all_finite_each(momentum) &&
               detail::all_finite_each(conv_tail);
    }

    /// The index of (sequence b, head h) in `weights` and `momentum`: b * n_heads + h.
    [[nodiscard]] static std::size_t index(const MemoryConfig& cfg, int b, int h) {
        return static_cast<std::size_t>(b) * static_cast<std::size_t>(cfg.n_heads) +
               static_cast<std::size_t>(h);
    }

    /// Every entry 0, shaped as the state of `batch` streams of a memory configured by `cfg`:
    /// the d_state_out to give backward when only another part of a chained state has a
    /// gradient, or to add one's own into (weights / momentum[index(cfg, b, h)][l - 1]:
    /// layer_in(l) x layer_out(l); conv_tail[b]: (K-1) x 3D with a conv, 0 x 3D without).
    /// ConfigError: cfg invalid, batch outside [1, max_batch].
    ///
    ///     auto d = titans::MemoryStateGradient<double>::zeros(mem.config(), state.batch());
    ///     d.weights[d.index(mem.config(), b, h)][0](i, j) = 1.0;  // dL/dW_1[i, j] of (b, h)
    [[nodiscard]] static MemoryStateGradient zeros(const MemoryConfig& cfg, int batch) {
        cfg.validate();
        detail::require_in_range(batch, 1, limits::max_batch, "MemoryStateGradient::zeros",
                                 "batch");
        MemoryStateGradient d;
        std::vector<Matrix<T>> head;
        for (int l = 1; l <= cfg.depth; ++l) {
            head.push_back(Matrix<T>::Zero(cfg.layer_in(l), cfg.layer_out(l)));
        }
        const auto pairs = static_cast<std::size_t>(batch) * static_cast<std::size_t>(cfg.n_heads);
        d.weights.assign(pairs, head);
        d.momentum.assign(pairs, head);
        const int tail = cfg.use_conv ? cfg.conv_kernel - 1 : 0;
        d.conv_tail.assign(static_cast<std::size_t>(batch),
                           Matrix<T>::Zero(tail, 3 * cfg.inner_dim()));
        return d;
    }
};

}  // namespace titans
