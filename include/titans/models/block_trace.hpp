#pragma once
// titans/models/block_trace.hpp: what a block's training forward keeps for its backward
// (block_training.hpp runs both).

#include <cstdint>
#include <vector>

#include "../attention/attention.hpp"
#include "../backend/backend.hpp"
#include "../detail/trace.hpp"
#include "../layers/feed_forward.hpp"
#include "../layers/rms_norm.hpp"
#include "../memory/neural_memory.hpp"
#include "../types.hpp"
#include "block_config.hpp"
#include "mac_trace.hpp"

namespace titans {

/// What Block's training forward keeps for backward (math §9): each sub-layer's trace, for MAG
/// the gated output's factor a and the gate's argument, for MAC u and each segment's reads and
/// outputs. Shapes: rows = B*N of the call.
template <class T, class Backend>
struct BlockTrace {
    BlockConfig cfg;
    int batch = 0;
    std::int64_t start = 0;  // the block's position at the call (0: P went through this call)
    Eigen::Index rows = 0;
    detail::TraceFilled filled;  // a moved-from trace is empty
    typename RMSNorm<T, Backend>::Trace norm_mix, norm_ffn, norm_y, norm_m;
    typename NeuralMemory<T, Backend>::Trace memory;     // over [P; u] per sequence (MAC: y)
    typename Attention<T, Backend>::Trace attention;  // MAG, SWA: u with prefix P; MAL: [P; M]
    typename FeedForward<T, Backend>::Trace ffn;
    /// MAG, in the backend's memory: a = RMSNorm_y(attention output) and the gate's argument
    /// RMSNorm_m(memory output) (the gate is σ of it).
    typename backend::Transfer<Backend, T>::Buffer a, gate;
    typename backend::Transfer<Backend, T>::Buffer u;  // MAC: RMSNorm_mix(x)
    std::vector<MacSegmentTrace<T, Backend>> segments;  // MAC

    [[nodiscard]] bool empty() const { return !filled; }
};

}  // namespace titans
