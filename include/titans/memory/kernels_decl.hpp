#pragma once
// titans/memory/kernels_decl.hpp: the neural memory's kernels on a backend, declared (the
// primary templates, which fail to compile, and the concept a specialisation meets); each
// backend specialises them in its own folder (backend/cpu/memory_kernels.hpp, ...).

#include <concepts>
#include <cstdint>
#include <memory>
#include <vector>

#include "../backend/backend.hpp"
#include "../types.hpp"
#include "../view.hpp"
#include "config.hpp"
#include "params.hpp"

namespace titans {

template <class T>
struct Diagnostics;

namespace backend {

/// The kernels of the neural memory on a backend. Specialised per backend and scalar type.
template <class Backend, class T>
struct MemoryKernels {
    static_assert(dependent_false<Backend>,
                  "titans: no MemoryKernels specialization for this backend policy");
};

/// The memory's training pass (math §9) on a backend: a Trace (what the backward needs: the
/// input and the memory at every chunk start; members cfg, x, batch, start, filled, as
/// NeuralMemory::validate_trace reads them), forward(cfg, prepared, state, x, y, trace, diag)
/// (diag optional, filled as MemoryKernels::forward fills it),
/// check_trace(cfg, trace, where) (ShapeError unless the trace's buffers have the sizes forward
/// leaves) and backward(cfg, prepared, trace, dy, dx, grads, d_out, d_in) -> bool (dx written;
/// the parameters' gradients added to grads, the layer's flat slice in the backend's memory,
/// only if they and d_in are finite, which it returns). Backends that have one specialise it
/// with `available = true` (the CPU and CUDA do; NeuralMemory's training calls require it).
template <class Backend, class T>
struct MemoryTraining {
    static constexpr bool available = false;
    /// Whether it also has the staged reverse MAC's training drives (Reverse, start,
    /// forward_part, read_weights_backward; models/mac_training.hpp).
    static constexpr bool staged = false;
    /// Whether a trace may start mid-chunk (a state with pending rows; its Trace then has an
    /// `offset` member, and the state gradients carry the pending rows' adjoints).
    static constexpr bool mid_chunk = false;
    struct Trace {};
};

/// What MemoryKernels<B, T> must provide for NeuralMemory<T, B> to run on it:
///   Prepared                      the outer parameters as the kernels use them (uploaded,
///                                 laid out), made once per object
///   prepare(cfg, params)          Prepared from the host parameters (a shared_ptr: the CPU
///                                 keeps the pointer, a device backend uploads)
///   State                         a stream batch's state (memory weights, momentum, pending
///                                 chunk, conv tails, position), owned by the caller, with
///                                 batch(), position() and config() readable on the host
///   make_state(cfg, prepared, B)  a fresh state for B sequences
///   forward(cfg, prepared, state, x, y, diag)
///                                 math §1-5 over a piece of the stream: x (B*N) x d in (a
///                                 View<const T>), y (B*N) x d out (a View<T>, sized by the
///                                 caller), both in the backend's memory; diag optional
///                                 (nullptr)
///   read(cfg, prepared, state, x, y)  read-only retrieval with the memory after the last token
///   read_weights(cfg, prepared, weights, x, batch, y)
///                                 retrieval through given weights (per sequence and head)
///   current_weights / current_momentum(cfg, state, b, h)
///                                 the memory as it is after the last token seen, materialised
///                                 on the host
///   all_weights(cfg, state)       current_weights of every pair, index b * H + h, the same
///                                 values, brought to the host at once (MAC's snapshot)
///   begin(state) -> bool, commit(state), rollback(state)
///                                 a transaction over several forward calls: rollback puts the
///                                 state back as it was at begin (forward opens and commits its
///                                 own when none is open, and rolls back when it throws)
/// and BackendTraits<B> must say whether its results are host accessible and if it supports T.
/// The backward pass of the family (training) will add its members here.
template <class B, class T>
concept MemoryBackend = requires(
    const MemoryConfig& cfg, const std::shared_ptr<const MemoryParams<T>>& hp,
    const typename MemoryKernels<B, T>::Prepared& p, typename MemoryKernels<B, T>::State& s,
    const typename MemoryKernels<B, T>::State& cs, View<const T> x, View<T> y,
    Diagnostics<T>* diag, int i) {
    typename MemoryKernels<B, T>::Prepared;
    typename MemoryKernels<B, T>::State;
    { MemoryKernels<B, T>::prepare(cfg, hp) } ->
        std::same_as<typename MemoryKernels<B, T>::Prepared>;
    { MemoryKernels<B, T>::make_state(cfg, p, i) } ->
        std::same_as<typename MemoryKernels<B, T>::State>;
    MemoryKernels<B, T>::forward(cfg, p, s, x, y, diag);
    MemoryKernels<B, T>::read(cfg, p, cs, x, y);
    MemoryKernels<B, T>::read_weights(cfg, p, std::vector<std::vector<Matrix<T>>>{}, x, i, y);
    { MemoryKernels<B, T>::current_weights(cfg, cs, i, i) } ->
        std::same_as<std::vector<Matrix<T>>>;
    { MemoryKernels<B, T>::current_momentum(cfg, cs, i, i) } ->
        std::same_as<std::vector<Matrix<T>>>;
    { MemoryKernels<B, T>::all_weights(cfg, cs) } ->
        std::same_as<std::vector<std::vector<Matrix<T>>>>;
    { MemoryKernels<B, T>::begin(s) } -> std::convertible_to<bool>;
    MemoryKernels<B, T>::commit(s);
    MemoryKernels<B, T>::rollback(s);
    { cs.batch() } -> std::convertible_to<int>;
    { cs.position() } -> std::convertible_to<std::int64_t>;
    { cs.config() } -> std::convertible_to<const MemoryConfig&>;
    { BackendTraits<B>::host_accessible } -> std::convertible_to<bool>;
    { BackendTraits<B>::template supports<T> } -> std::convertible_to<bool>;
};

}  // namespace backend
}  // namespace titans
