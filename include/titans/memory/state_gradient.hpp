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

/// dL/d(state) of B streams: per (sequence b, head h), index b * H + h, the chunk-start
/// weights W^s_l and momentum S^s_l (layer l at index l-1, layer_in(l) x layer_out(l)), and
/// per sequence the conv tail, the last K-1 rows of x [W_Q | W_K | W_V] before the conv
/// ((K-1) x 3D; 0 rows without a conv, where the vector may also be empty). A state p tokens
/// into a chunk (p = state.pending() > 0) also keeps its p pending rows, and has their
/// adjoints: per pair and layer pending_a (p x layer_in(l): the key pass's A_{l-1} rows),
/// pending_delta (p x layer_out(l): its errors Delta_l) and pending_gates (p x 3: the gate
/// logits theta, eta, alpha; none for constant gates), as MemoryState::tensors names them.
/// At a chunk boundary (p = 0) the pending parts are empty and W^s, S^s are the memory
/// current_weights() returns; empty pending parts given for p > 0 mean zero adjoints. A
/// default-constructed one (empty()) means "no gradient".
///
///     titans::MemoryStateGradient<double> d2;
///     mem.backward(trace2, dy2, dx2, grads, &d2);          // the second piece: d2 = dL/d(its start)
///     mem.backward(trace1, dy1, dx1, grads, nullptr, &d2); // the first, with its end's adjoint
template <class T>
struct MemoryStateGradient {
    std::vector<std::vector<Matrix<T>>> weights, momentum;
    std::vector<Matrix<T>> conv_tail;
    std::vector<std::vector<Matrix<T>>> pending_a, pending_delta;  // per pair, per layer
    std::vector<Matrix<T>> pending_gates;                         // per pair: p x 3

    [[nodiscard]] bool empty() const { return weights.empty(); }

    /// Whether every entry (weights, momentum, conv tails, pending rows) is finite.
    [[nodiscard]] bool finite() const {
        return detail::all_finite_each(weights) && detail::all_finite_each(momentum) &&
               detail::all_finite_each(conv_tail) && detail::all_finite_each(pending_a) &&
               detail::all_finite_each(pending_delta) && detail::all_finite_each(pending_gates);
    }

    /// The index of (sequence b, head h) in `weights` and `momentum`: b * n_heads + h.
    [[nodiscard]] static std::size_t index(const MemoryConfig& cfg, int b, int h) {
        return static_cast<std::size_t>(b) * static_cast<std::size_t>(cfg.n_heads) +
               static_cast<std::size_t>(h);
    }

    /// Every entry 0, shaped as the state of `batch` streams of a memory configured by `cfg`,
    /// `pending` tokens into a chunk (state.pending()): the d_state_out to give backward when
    /// only another part of a chained state has a gradient, or to add one's own into
    /// (weights / momentum[index(cfg, b, h)][l - 1]: layer_in(l) x layer_out(l); conv_tail[b]:
    /// (K-1) x 3D with a conv, 0 x 3D without; for pending > 0 pending_a / pending_delta
    /// [index][l - 1]: pending x layer_in(l) / layer_out(l), pending_gates[index]: pending x 3
    /// unless the gates are constant). ConfigError: cfg invalid, batch outside
    /// [1, max_batch], pending outside [0, chunk) (0 for UpdateMode::PerToken).
    ///
    ///     auto d = titans::MemoryStateGradient<double>::zeros(mem.config(), state.batch(),
    ///                                                        state.pending());
    ///     d.weights[d.index(mem.config(), b, h)][0](i, j) = 1.0;  // dL/dW^s_1[i, j] of (b, h)
    [[nodiscard]] static MemoryStateGradient zeros(const MemoryConfig& cfg, int batch,
                                                   int pending = 0) {
        cfg.validate();
        detail::require_in_range(batch, 1, limits::max_batch, "MemoryStateGradient::zeros",
                                 "batch");
        detail::require_in_range(pending, 0, cfg.effective_chunk() - 1,
                                 "MemoryStateGradient::zeros", "pending");
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
        if (pending > 0) {
            std::vector<Matrix<T>> a, delta;
            for (int l = 1; l <= cfg.depth; ++l) {
                a.push_back(Matrix<T>::Zero(pending, cfg.layer_in(l)));
                delta.push_back(Matrix<T>::Zero(pending, cfg.layer_out(l)));
            }
            d.pending_a.assign(pairs, a);
            d.pending_delta.assign(pairs, delta);
            if (cfg.gates != GateMode::Constant) {
                d.pending_gates.assign(pairs, Matrix<T>::Zero(pending, 3));
            }
        }
        return d;
    }
};

}  // namespace titans
