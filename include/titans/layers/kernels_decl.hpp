#pragma once
// titans/layers/kernels_decl.hpp: the kernels of RMSNorm and FeedForward on a backend, and
// the glue between layers (layers/glue.hpp), declared (primary templates that fail to
// compile); each backend specialises them in its own folder (backend/cpu/layer_kernels.hpp,
// backend/cpu/glue_kernels.hpp, ...).

#include <cstddef>

#include "../backend/backend.hpp"

namespace titans {
namespace backend {

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

/// Row blocks of two matrices matched by copy_rows and add_rows (layers/glue.hpp): for each
/// block i < count, the `rows` rows of `from` starting at i * from_step + from_first and those
/// of `to` starting at i * to_step + to_first (a step of 0 repeats the same rows: a broadcast
/// from, or a sum into to). How a block assembles each sequence's [P; u] and takes it apart.
struct RowBlocks {
    std::ptrdiff_t count = 0, rows = 0;
    std::ptrdiff_t from_step = 0, from_first = 0;
    std::ptrdiff_t to_step = 0, to_first = 0;
};

/// The element-wise and row kernels that join the layers of a block and a model (concept
/// GlueBackend, layers/glue.hpp): residual sums, MAG's gate, finiteness checks, the embedding
/// gather and the head's product.
template <class Backend, class T>
struct GlueKernels {
    static_assert(dependent_false<Backend>,
                  "titans: no GlueKernels specialization for this backend policy");
};

}  // namespace backend
}  // namespace titans
