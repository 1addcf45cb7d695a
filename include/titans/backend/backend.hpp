#pragma once
// titans/backend/backend.hpp: what a compute backend is (policy, kernels, capability traits).
//
// A backend is a tag type (titans::backend::Cpu, titans::backend::Cuda) passed as the
// `Backend` template parameter of the algorithms (NeuralMemory<T, Backend>). The algorithms
// never name a backend: they use their family's kernels (MemoryKernels<Backend, T> in
// memory/kernels_decl.hpp, AttentionKernels in attention/, NormKernels and FeedForwardKernels
// in layers/), whose primary templates fail to compile, and ask BackendTraits<Backend> for
// capabilities. Each backend specialises them in its own folder (backend/cpu/,
// backend/cuda/). This header names no layer family (tools/check_layering.sh); see
// docs/design.md.

#include <concepts>
#include <cstdint>
#include <memory>
#include <vector>

#include "../types.hpp"
#include "../view.hpp"

namespace titans {

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
///   accumulate(host, to)        to += host, entry by entry (to in the backend's memory, the
///                               same shape; one upload): how host gradients join a buffer
/// Optional: scratch(rows, cols) and upload_scratch(host), a Buffer for the call in progress
/// only (CUDA's: lent by the thread's call arena inside a deferring CallScope,
/// backend/cuda/call_scope.cuh); call_scratch and call_upload below fall back on allocate and
/// upload.
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
    Transfer<B, T>::accumulate(host, out);
};

/// A rows x cols buffer for a temporary of the call in progress, which no state or trace keeps:
/// Transfer<B, T>::scratch where B has it (on CUDA, no allocation once a decode call is warm),
/// else allocate.
template <class B, class T>
typename Transfer<B, T>::Buffer call_scratch(std::ptrdiff_t rows, std::ptrdiff_t cols) {
    if constexpr (requires { Transfer<B, T>::scratch(rows, cols); }) {
        return Transfer<B, T>::scratch(rows, cols);
    } else {
        return Transfer<B, T>::allocate(rows, cols);
    }
}
/// upload(host) into a buffer for the call in progress only, as call_scratch.
template <class B, class T>
typename Transfer<B, T>::Buffer call_upload(View<const T> host) {
    if constexpr (requires { Transfer<B, T>::upload_scratch(host); }) {
        return Transfer<B, T>::upload_scratch(host);
    } else {
        return Transfer<B, T>::upload(host);
    }
}

}  // namespace backend
}  // namespace titans
