#pragma once
// titans/models/mac_trace.hpp: what MAC's training forward keeps per segment (math §9, "MAC";
// mac_training.hpp runs it).

#include <vector>

#include "../types.hpp"

namespace titans {

/// One MAC segment of a training forward (rows stream-major, B*m): the memory weights read
/// (per (stream, head): W(t0), the memory after the t0 tokens before the segment), h (the
/// read), y (the attention's output, the memory's input) and r (the memory's output).
template <class T>
struct MacSegmentTrace {
    std::vector<std::vector<Matrix<T>>> weights;
    Matrix<T> h, y, r;
};

}  // namespace titans
