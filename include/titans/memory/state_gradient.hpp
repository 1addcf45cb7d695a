#pragma once
// titans/memory/state_gradient.hpp: the adjoint of a neural memory's state (math §9, "chained
// pieces"): what NeuralMemory::backward takes for the state a piece leaves and returns for the
// state it started from, so that pieces reversed in turn equal one call.

#include <vector>

#include "../types.hpp"

namespace titans {

/// dL/d(state) of B streams at a chunk boundary: per (sequence b, head h), index b * H + h,
/// the weights W_l and momentum S_l (layer l at index l-1, layer_in(l) x layer_out(l)), and
/// per sequence the conv tail, the last K-1 rows of x [W_Q | W_K | W_V] before the conv
/// ((K-1) x 3D; 0 rows without a conv, where the vector may also be empty). Shapes as
/// current_weights() returns them; a default-constructed one (empty()) means "no gradient".
///
///     titans::MemoryStateGradient<double> d2;
///     mem.backward(trace2, dy2, dx2, grads, &d2);          // the second piece: d2 = dL/d(its start)
///     mem.backward(trace1, dy1, dx1, grads, nullptr, &d2); // the first, with its end's adjoint
template <class T>
struct MemoryStateGradient {
    std::vector<std::vector<Matrix<T>>> weights, momentum;
    std::vector<Matrix<T>> conv_tail;

    [[nodiscard]] bool empty() const { return weights.empty(); }
};

}  // namespace titans
