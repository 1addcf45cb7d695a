#pragma once
// titans/memory/snapshot.hpp: the memory's weights kept at one moment of a stream, on the host
// (the CPU's MemoryKernels::Snapshot; other backends keep theirs in their own memory).

#include <cstddef>
#include <utility>
#include <vector>

#include "../detail/visit.hpp"
#include "../types.hpp"

namespace titans {

/// The weights of every (sequence b, head h) of a memory state at one moment (MAC keeps the
/// memory of its segment's start this way, math §7): weights[b * H + h][l - 1] is layer l,
/// layer_in(l) x layer_out(l). Made by NeuralMemory::snapshot, read by read_snapshot.
template <class T>
struct MemorySnapshot {
    std::vector<std::vector<Matrix<T>>> weights;
    int heads = 1;

    /// Pairs (sequence, head) held: batch * n_heads.
    [[nodiscard]] std::size_t pairs() const { return weights.size(); }

    /// Serialization hook: v("{b}.{h}.{l}", weights[b * H + h][l]) for every pair and layer.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        const auto H = static_cast<std::size_t>(self.heads);
        for (std::size_t i = 0; i < self.weights.size(); ++i) {
            for (std::size_t l = 0; l < self.weights[i].size(); ++l) {
                v(detail::visit_name(i / H, i % H, l), self.weights[i][l]);
            }
        }
    }
};

}  // namespace titans
