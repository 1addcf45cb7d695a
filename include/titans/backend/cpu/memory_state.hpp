#pragma once
// titans/backend/cpu/memory_state.hpp: the state of a stream batch on the CPU backend.

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../../detail/visit.hpp"
#include "../../memory/config.hpp"
#include "../../types.hpp"
#include "../../memory/kernels_decl.hpp"

namespace titans {

namespace backend {
template <class Backend, class T>
struct MemoryKernels;
template <class T>
struct MemoryUndo;
template <class Backend, class T>
struct MemoryTraining;
struct Cpu;
}  // namespace backend

/// State of B independent streams of one NeuralMemory on the CPU (math §3-5): per sequence
/// and head the chunk-start memory weights W^s and momentum S^s of every layer, the pending
/// rows (activations, back-propagated errors, gate logits) of the chunk in progress, the conv
/// tails, the absolute position, and the workspaces the hot path reuses (so a forward call
/// allocates per call, never per token).
///
/// Made by NeuralMemory::make_state(B); copyable (a copy is a snapshot of the streams).
/// Between chunk boundaries the memory "after the last token" is not stored but derived from
/// W^s, S^s and the pending rows in closed form: NeuralMemory::current_weights().
template <class T>
class MemoryState {
public:
    MemoryState() = default;

    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (absolute position of the next token).
    [[nodiscard]] std::int64_t position() const { return position_; }
    /// Tokens of the chunk in progress (position mod b; 0 for UpdateMode::PerToken).
    [[nodiscard]] int pending() const {
        return static_cast<int>(position_ % static_cast<std::int64_t>(chunk_));
    }
    /// Chunk-start weights W^s of sequence b, head h (layer l at index l-1).
    [[nodiscard]] const std::vector<Matrix<T>>& chunk_start_weights(int b, int h) const {
        return heads_[index(b, h)].w;
    }
    /// Chunk-start momentum S^s of sequence b, head h.
    [[nodiscard]] const std::vector<Matrix<T>>& chunk_start_momentum(int b, int h) const {
        return heads_[index(b, h)].s;
    }
    /// The configuration the state was made for.
    [[nodiscard]] const MemoryConfig& config() const { return cfg_; }

    /// Serialization hook (checkpoints): calls v(name, x) for everything a resumed stream needs
    /// to continue bit-identically, x a Matrix<T>& or std::int64_t& (const if Self is):
    ///     position                          std::int64_t
    ///     heads.{b}.{h}.w.{l}, .s.{l}       W^s_l, S^s_l: layer_in x layer_out (l = 0..L-1)
    ///     heads.{b}.{h}.a.{l}, .delta.{l}   pending chunk rows: b x layer_in, b x layer_out
    ///     heads.{b}.{h}.gates               pending gate logits: b x 3 (unless Constant)
    ///     conv_tail.{b}                     (K-1) x 3D (if use_conv and K > 1)
    /// with b the chunk size; a, delta and gates only for UpdateMode::Chunked (per token they
    /// are one-row workspaces). Every shape is fixed by the configuration and batch: load into
    /// a state from make_state(). Workspaces (z, hid, t1, t2, scores, G, coef) are not
    /// visited: each call writes them before reading them.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, MemoryState>);
        const MemoryConfig& cfg = self.cfg_;
        const bool pending_rows = cfg.update == UpdateMode::Chunked;
        v(std::string("position"), self.position_);
        for (int b = 0; b < self.batch_; ++b) {
            for (int h = 0; h < cfg.n_heads; ++h) {
                auto& hd = self.heads_[self.index(b, h)];
                for (std::size_t l = 0; l < hd.w.size(); ++l) {
                    v(detail::visit_name("heads", b, h, "w", l), hd.w[l]);
                }
                for (std::size_t l = 0; l < hd.s.size(); ++l) {
                    v(detail::visit_name("heads", b, h, "s", l), hd.s[l]);
                }
                if (!pending_rows) {
                    continue;
                }
                for (std::size_t l = 0; l < hd.a.size(); ++l) {
                    v(detail::visit_name("heads", b, h, "a", l), hd.a[l]);
                }
                for (std::size_t l = 0; l < hd.delta.size(); ++l) {
                    v(detail::visit_name("heads", b, h, "delta", l), hd.delta[l]);
                }
                if (cfg.gates != GateMode::Constant) {
                    v(detail::visit_name("heads", b, h, "gates"), hd.gates);
                }
            }
        }
        if (cfg.use_conv && cfg.conv_kernel > 1) {
            for (int b = 0; b < self.batch_; ++b) {
                v(detail::visit_name("conv_tail", b), self.conv_tail_[static_cast<std::size_t>(b)]);
            }
        }
    }

private:
    template <class, class>
    friend struct backend::MemoryKernels;
    template <class>
    friend struct backend::MemoryUndo;
    template <class, class>
    friend struct backend::MemoryTraining;  // the training pass keeps the incoming conv tails

    struct Head {
        std::vector<Matrix<T>> w, s;          // W^s_l, S^s_l: layer_in(l) x layer_out(l)
        std::vector<Matrix<T>> a, delta;      // pending chunk: A_{l-1} (b x in), Delta_l (b x out)
        Matrix<T> gates;                      // b x 3: logits (theta, eta, alpha) per token
        // Workspaces.
        std::vector<Matrix<T>> z;             // b x out(l): pre-activations, then act'(Z_l)
        std::vector<Matrix<T>> hid;           // b x out(l): retrieval activations
        Matrix<T> t1, t2;                     // b x max width
        Matrix<T> scores, G;                  // b x b
        Matrix<T> coef;                       // 8 x b: theta, eta, alpha, beta, c, g, s
    };

    /// What a transaction (MemoryUndo) saved of one head before overwriting it: rows
    /// [txn_row, saved_hi) of the pending matrices as they were touched, and once a chunk ends
    /// (or per token: at once) W^s, S^s and every pending row. Sized on first use, then reused.
    struct HeadUndo {
        std::vector<Matrix<T>> w, s, a, delta;
        Matrix<T> gates;
        bool all_saved = false;
        int saved_hi = 0;
    };
    /// An open transaction: everything needed to put the streams back as they were at its start.
    struct Undo {
        bool open = false;
        std::int64_t position = 0;
        std::vector<Matrix<T>> conv_tail;
        std::vector<HeadUndo> heads;
    };

    [[nodiscard]] std::size_t index(int b, int h) const {
        return static_cast<std::size_t>(b) * static_cast<std::size_t>(cfg_.n_heads) +
               static_cast<std::size_t>(h);
    }

    MemoryConfig cfg_{};
    int batch_ = 0;
    int chunk_ = 1;
    std::int64_t position_ = 0;
    std::vector<Head> heads_;             // B * H, index b * H + h
    std::vector<Matrix<T>> conv_tail_;    // B of (K-1) x 3D: last pre-conv q|k|v projections
    Undo undo_;                           // the open transaction (not part of the stream)
};

}  // namespace titans
