#pragma once
// titans/attention/kernels_decl.hpp: the attention layer's kernels and training pass on a
// backend, declared (primary templates that fail to compile or say "not available"); each
// backend specialises them in its own folder (backend/cpu/attention_kernels.hpp, ...).

#include "../backend/backend.hpp"

namespace titans {
namespace backend {

/// The attention layer's training pass (math §9), as MemoryTraining: a Trace,
/// forward(cfg, prepared, state, x, y, prefix, sharing, trace) (the prefix rows a view in the
/// backend's memory, 0 rows: none), check_trace(cfg, trace, where)
/// and backward(cfg, prepared, trace, dy, dx, grads, dprefix, d_out, d_in) (dx written; the
/// parameters' gradients added to grads, the layer's flat slice, and the prefix rows' to
/// dprefix unless it is empty, both in the backend's memory).
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

}  // namespace backend
}  // namespace titans
