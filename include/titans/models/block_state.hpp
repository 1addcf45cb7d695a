#pragma once
// titans/models/block_state.hpp: the state of B streams through one block.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../attention/attention.hpp"
#include "../backend/backend.hpp"
#include "../detail/check.hpp"
#include "../detail/visit.hpp"
#include "../layers/glue.hpp"
#include "../memory/neural_memory.hpp"
#include "../types.hpp"
#include "block_config.hpp"

namespace titans {

template <class T, class Backend = backend::Cpu>
class Block;
template <class T, class Backend>
class Model;
template <class T, class Backend>
struct BlockTrace;
namespace detail {
template <class T, class Backend>
struct BlockTraining;
template <class T, class Backend>
struct MacTraining;
template <class T, class Backend>
struct MacMixer;
template <class T, class Backend>
struct MixerTraining;
template <class T, class Backend>
struct ModelParameters;
}  // namespace detail

/// The state of B streams through one block: the memory's state (not SWA), the attention's
/// KV ring buffer (MAG, MAL, SWA), and for MAC the keys/values of the segment in progress and the memory
/// weights at the segment's start. Made by Block::make_state(B); copyable. The memory and
/// attention states are their backend's (MemoryKernels / AttentionKernels<Backend, T>::State).
template <class T, class Backend = backend::Cpu>
class BlockState {
public:
    using MemoryState = typename backend::MemoryKernels<Backend, T>::State;
    using AttentionState = typename backend::AttentionKernels<Backend, T>::State;
    /// MAC's memory at its segment's start, in the backend's memory.
    using Snapshot = typename backend::MemoryKernels<Backend, T>::Snapshot;

    BlockState() = default;
    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (persistent tokens not counted).
    [[nodiscard]] std::int64_t position() const { return position_; }
    [[nodiscard]] const MemoryState& memory() const { return memory_; }
    [[nodiscard]] const AttentionState& attention() const { return attention_; }

    /// Serialization hook (checkpoints): calls v(name, x) for everything a resumed stream needs
    /// to continue bit-identically, x a Matrix<T>& or std::int64_t& (const if Self is):
    ///     position               std::int64_t (block tokens; the memory's own position
    ///                            also counts the persistent tokens for MAG and MAL)
    ///     memory.*               MemoryState::tensors (not SWA)
    ///     attention.*            AttentionState::tensors (MAG, MAL, SWA; its k/v rows vary)
    ///     seg_k.{b}, seg_v.{b}   MAC: keys/values of the segment in progress, 2C x D_att
    ///     snapshot.{b}.{h}.{l}   MAC: memory weights at the segment start, layer_in x layer_out
    /// Load into a state from make_state() of the same block (MAC's P W_K and P W_V belong to
    /// the block, not the state).
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, BlockState>);
        v(std::string("position"), self.position_);
        if (has_memory(self.kind_)) {
            MemoryState::tensors(self.memory_, detail::prefixed("memory", v));
        }
        if (has_window(self.kind_)) {
            AttentionState::tensors(self.attention_, detail::prefixed("attention", v));
        }
        if (self.kind_ == BlockKind::MAC) {
            visit_segment(self, self.seg_k_, "seg_k", v);
            visit_segment(self, self.seg_v_, "seg_v", v);
            Snapshot::tensors(self.snapshot_, detail::prefixed("snapshot", v));
        }
    }

private:
    friend class Block<T, Backend>;
    friend struct detail::BlockTraining<T, Backend>;
    friend struct detail::MacTraining<T, Backend>;
    friend struct detail::MacMixer<T, Backend>;
    friend struct detail::MixerTraining<T, Backend>;
    BlockKind kind_ = BlockKind::LMM;
    BlockConfig cfg_{};  // the block's settings at make_state (what a continuing block must match)
    int batch_ = 0;
    std::int64_t position_ = 0;
    MemoryState memory_;  // SWA: default-constructed (batch 0), never used
    AttentionState attention_;
    // MAC: per sequence the interleaved keys/values [h_0, s_0, h_1, s_1, ...] of the segment
    // in progress ((B*2C) x D_att, sequence b at rows b*2C), and per (sequence, head) the
    // memory weights M_{t-1} at its start, in the backend's memory.
    using Buffer = typename backend::Transfer<Backend, T>::Buffer;
    Buffer seg_k_{}, seg_v_{};
    Snapshot snapshot_{};
    // The open transaction (Block::begin): the position at its start and, for MAC, the segment
    // rows [row0, hi) saved before they were overwritten, all rows once the segment wrapped,
    // and the snapshot before its first refresh. Buffers sized on first use.
    struct Undo {
        bool open = false, wrapped = false, snap_saved = false, sized = false;
        std::int64_t position = 0;
        int row0 = 0, hi = 0;
        Buffer seg_k{}, seg_v{};
        Snapshot snapshot{};
    } undo_;

    /// v("{name}.{b}", sequence b's 2C x D_att rows of buf), a host copy (a download off the
    /// host); when Self is not const what the visitor left goes back (same shape: ShapeError).
    template <class Self, class Buf, class V>
    static void visit_segment(Self& self, Buf& buf, const char* name, V& v) {
        using Transfer = backend::Transfer<Backend, T>;
        const Eigen::Index rows = 2 * static_cast<Eigen::Index>(self.cfg_.segment),
                           D = self.cfg_.attention.inner_dim();
        for (int b = 0; b < self.batch_; ++b) {
            const auto part = Transfer::view(buf).middle_rows(b * rows, rows);
            Matrix<T> m(rows, D);
            Transfer::download(part, view_of(m));
            if constexpr (std::is_const_v<Self>) {
                v(detail::visit_name(name, b), std::as_const(m));
            } else {
                v(detail::visit_name(name, b), m);
                detail::require<ShapeError>(m.rows() == rows && m.cols() == D,
                                            "BlockState::tensors", detail::visit_name(name, b).c_str(),
                                            detail::concat(m.rows(), " x ", m.cols()),
                                            detail::concat(rows, " x ", D));
                const Buffer up = Transfer::upload(view_of(std::as_const(m)));
                backend::GlueKernels<Backend, T>::copy(Transfer::view(up), part);
            }
        }
    }
};

}  // namespace titans
