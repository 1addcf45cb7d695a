#pragma once
// titans/models/state_gradient.hpp: the adjoints of a block's and a model's state (math §9,
// "Chained pieces"), what Block::backward and Model::backward take for the state a piece leaves
// and return for the state it started from.

#include <vector>

#include "../attention/state_gradient.hpp"
#include "../memory/state_gradient.hpp"

namespace titans {

/// dL/d(MAC's segment state) of B streams at position t, o = t % segment tokens into a
/// segment (math §9, "MAC"): per sequence the adjoint of the keys and values the state keeps
/// for those o tokens, interleaved as the segment buffers hold them ([h_0, s_0, h_1, ...],
/// 2o x D_att, RoPE applied to the s rows), and per (sequence b, head h), index b * H + h, the
/// adjoint of the snapshot, the memory weights at the segment's start (layer l at index l-1,
/// shaped as current_weights()). A default-constructed one (empty()) means "no gradient".
template <class T>
struct MacStateGradient {
    std::vector<Matrix<T>> keys, values;
    std::vector<std::vector<Matrix<T>>> snapshot;

    [[nodiscard]] bool empty() const { return keys.empty() && values.empty() && snapshot.empty(); }
};

/// dL/d(state) of a block's B streams: the memory's part (weights, momentum and conv tails,
/// MemoryStateGradient), the attention window's (MAG, MAL: kept keys and values,
/// AttentionStateGradient) and MAC's segment state (MacStateGradient). A default-constructed
/// one (empty()) means "no gradient"; an empty part means "no gradient" for that part, and a
/// part the block's kind does not have must be empty.
///
///     titans::BlockStateGradient<double> d2;
///     block.backward(trace2, dy2, dx2, grads, &d2);          // d2 = dL/d(its start)
///     block.backward(trace1, dy1, dx1, grads, nullptr, &d2); // the first, with its end's adjoint
template <class T>
struct BlockStateGradient {
    MemoryStateGradient<T> memory;
    AttentionStateGradient<T> attention;
    MacStateGradient<T> mac;

    [[nodiscard]] bool empty() const { return memory.empty() && attention.empty() && mac.empty(); }
};

/// dL/d(state) of a model's B streams: one BlockStateGradient per block, in order (empty():
/// "no gradient").
template <class T>
struct ModelStateGradient {
    std::vector<BlockStateGradient<T>> blocks;

    [[nodiscard]] bool empty() const { return blocks.empty(); }
};

}  // namespace titans
