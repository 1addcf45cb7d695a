#pragma once
// titans/backend/backend.hpp: what a compute backend is (policy, kernels, capability traits).
//
// A backend is a tag type (titans::backend::Cpu, later titans::backend::Cuda) passed as the
// `Backend` template parameter of the algorithms (NeuralMemory<T, Backend>). The algorithms
// never name a backend: they use MemoryKernels<Backend, T>, whose primary template below fails
// to compile, and ask BackendTraits<Backend> for capabilities. Each backend specialises both
// in its own folder (backend/cpu/, backend/cuda/). The concept MemoryBackend lists what a
// specialisation must provide; see docs/design.md.

#include <concepts>
#include <cstdint>
#include <memory>
#include <vector>

#include "../memory/config.hpp"
#include "../memory/params.hpp"
#include "../types.hpp"
#include "../view.hpp"

namespace titans {

template <class T>
struct Diagnostics;

namespace backend {

template <class>
inline constexpr bool dependent_false = false;

/// Capability traits of a backend. Specialised per backend.
template <class Backend>
struct BackendTraits {
    static_assert(dependent_false<Backend>,
                  "titans: no BackendTraits specialization for this backend policy "
                  "(include the backend's header, e.g. <titans/backend/cpu/cpu.hpp>)");
};

/// Matrices in a backend's memory and the copies between it and the host (concept
/// TransferBackend below). The layers use it at the public API edge (backend/edge.hpp) when
/// the backend cannot read host memory; checkpoints reach device states through it.
template <class Backend, class T>
struct Transfer {
    static_assert(dependent_false<Backend>,
                  "titans: no Transfer specialization for this backend policy");
};

/// What Transfer<B, T> must provide:
///   Buffer                      an owning rows x cols matrix in the backend's memory (movable)
///   allocate(rows, cols)        a Buffer (contents unspecified)
///   upload(host)                a Buffer holding a copy of the host view's entries
///   view(buffer)                the View<T> of a Buffer's entries, in the backend's memory
///                               (View<const T> of a const Buffer)
///   download(from, host)        copies a backend view into a host view of the same shape
template <class B, class T>
concept TransferBackend = requires(typename Transfer<B, T>::Buffer& buf,
                                   const typename Transfer<B, T>::Buffer& cbuf,
                                   View<const T> host, View<T> out, std::ptrdiff_t n) {
    typename Transfer<B, T>::Buffer;
    { Transfer<B, T>::allocate(n, n) } -> std::same_as<typename Transfer<B, T>::Buffer>;
    { Transfer<B, T>::upload(host) } -> std::same_as<typename Transfer<B, T>::Buffer>;
    { Transfer<B, T>::view(buf) } -> std::same_as<View<T>>;
    { Transfer<B, T>::view(cbuf) } -> std::same_as<View<const T>>;
    Transfer<B, T>::download(host, out);
};

/// The kernels of the neural memory on a backend. Specialised per backend and scalar type.
template <class Backend, class T>
struct MemoryKernels {
    static_assert(dependent_false<Backend>,
                  "titans: no MemoryKernels specialization for this backend policy");
};

/// The memory's training pass (math §9) on a backend: a Trace (what the backward needs: the
/// input and the memory at every chunk start; members cfg, x, batch, start, filled, as
/// NeuralMemory::validate_trace reads them), forward(cfg, prepared, state, x, y, trace),
/// check_trace(cfg, trace, where) (ShapeError unless the trace's buffers have the sizes forward
/// leaves) and backward(cfg, prepared, trace, dy, dx, grads). Backends that have one specialise
/// it with `available = true` (the CPU and CUDA do; NeuralMemory's training calls require it).
template <class Backend, class T>
struct MemoryTraining {
    static constexpr bool available = false;
    /// Whether it also has the staged reverse MAC's training drives (Reverse, start,
    /// forward_part, read_weights_backward; models/mac_training.hpp).
    static constexpr bool staged = false;
    struct Trace {};
};

/// The attention layer's training pass (math §9), as MemoryTraining: a Trace,
/// forward(cfg, prepared, state, x, y, prefix, sharing, trace), check_trace(cfg, trace, where)
/// and backward(cfg, prepared, trace, dy, dx, grads, dprefix).
template <class Backend, class T>
struct AttentionTraining {
    static constexpr bool available = false;
    struct Trace {};
};

/// The kernels of the attention layer (concept AttentionBackend, attention/attention.hpp).
template <class Backend, class T>
struct AttentionKernels {
    static_assert(dependent_false<Backend>,
                  "titans: no AttentionKernels specialization for this backend policy");
};

/// The kernels of RMSNorm (concept NormBackend, layers/rms_norm.hpp) and of FeedForward
/// (concept FeedForwardBackend, layers/feed_forward.hpp) on a backend.
template <class Backend, class T>
struct NormKernels {
    static_assert(dependent_false<Backend>,
                  "titans: no NormKernels specialization for this backend policy");
};
template <class Backend, class T>
struct FeedForwardKernels {
    static_assert(dependent_false<Backend>,
                  "titans: no FeedForwardKernels specialization for this backend policy");
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
