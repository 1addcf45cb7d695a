#pragma once
// titans/models/mac_trace.hpp: what MAC's training forward keeps per segment part (math §9,
// "MAC"; mac_training.hpp runs it), in the backend's memory.

#include <vector>

#include "../backend/backend.hpp"
#include "../memory/neural_memory.hpp"
#include "../types.hpp"

namespace titans {

/// One part of a MAC segment in a training forward: the call's rows [t0, t0 + m) of every
/// stream (rows here stream-major, B*m), `offset` tokens into their segment (0 but for a
/// call's first part, which may continue the segment of an earlier call). It keeps, in the
/// backend's memory, the memory's weights read (a snapshot: per (stream, head), the memory at
/// the segment's start), h (the read), y (the attention's output, the memory's input), r (the
/// memory's output), each (B*m) x d, and, for offset > 0, the state's keys and values of the
/// segment's first `offset` tokens ((B*2 offset) x D_att, stream b's at rows b * 2 offset).
template <class T, class Backend>
struct MacSegmentTrace {
    using Buffer = typename backend::Transfer<Backend, T>::Buffer;
    Eigen::Index t0 = 0;
    int offset = 0;
    typename NeuralMemory<T, Backend>::Snapshot weights;
    Buffer h, y, r;
    Buffer kept_k, kept_v;
};

}  // namespace titans
