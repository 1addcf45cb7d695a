#pragma once
// titans/models/mac_trace.hpp: what MAC's training forward keeps per segment (math §9, "MAC";
// mac_training.hpp runs it).

#include <vector>

#include "../types.hpp"

namespace titans {

/// One part of a MAC segment in a training forward: the call's rows [t0, t0 + m) of every
/// stream (rows here stream-major, B*m), `offset` tokens into their segment (0 but for a
/// call's first part, which may continue the segment of an earlier call). It keeps the memory
/// weights read (per (stream, head): the memory at the segment's start), h (the read), y (the
/// attention's output, the memory's input), r (the memory's output) and, for offset > 0, the
/// state's keys and values of the segment's first `offset` tokens (2 offset x D_att per stream).
template <class T>
struct MacSegmentTrace {
    Eigen::Index t0 = 0;
    int offset = 0;
    std::vector<std::vector<Matrix<T>>> weights;
    Matrix<T> h, y, r;
    std::vector<Matrix<T>> kept_k, kept_v;
};

}  // namespace titans
