#pragma once
// titans/models/state_gradient.hpp: the adjoints of a block's and a model's state (math §9,
// "Chained pieces"), what Block::backward and Model::backward take for the state a piece leaves
// and return for the state it started from.

#include <vector>

#include "../attention/state_gradient.hpp"
#include "../memory/state_gradient.hpp"

namespace titans {

/// dL/d(state) of a block's B streams (LMM, MAG, MAL): the memory's part (weights, momentum
/// and conv tails, MemoryStateGradient) and the attention window's (kept keys and values,
/// AttentionStateGradient; empty for LMM). A default-constructed one (empty()) means "no
/// gradient"; an empty part means "no gradient" for that part.
///
///     titans::BlockStateGradient<double> d2;
///     block.backward(trace2, dy2, dx2, grads, &d2);          // d2 = dL/d(its start)
///     block.backward(trace1, dy1, dx1, grads, nullptr, &d2); // the first, with its end's adjoint
template <class T>
struct BlockStateGradient {
    MemoryStateGradient<T> memory;
    AttentionStateGradient<T> attention;

    [[nodiscard]] bool empty() const { return memory.empty() && attention.empty(); }
};

/// dL/d(state) of a model's B streams: one BlockStateGradient per block, in order (empty():
/// "no gradient").
template <class T>
struct ModelStateGradient {
    std::vector<BlockStateGradient<T>> blocks;

    [[nodiscard]] bool empty() const { return blocks.empty(); }
};

}  // namespace titans
