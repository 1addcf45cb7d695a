#pragma once
// titans/backend/cuda/memory_state.cuh: the state of a stream batch on the CUDA backend.

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../detail/visit.hpp"
#include "../../error.hpp"
#include "../../memory/config.hpp"
#include "../../types.hpp"
#include "runtime.cuh"
#include "../../memory/kernels_decl.hpp"

namespace titans {

namespace backend {
template <class Backend, class T>
struct MemoryKernels;
template <class, class>
struct MemoryTraining;
struct Cuda;
}  // namespace backend

namespace backend::cuda {

/// v(name, a host copy of rows x cols entries of buf from `offset`); when buf is not const,
/// the copy (the visitor may have loaded it: same shape, the loader checks) goes back. `where`
/// names the visited object in the ShapeError of a copy that came back reshaped.
template <class T, class B, class V>
void visit_slice(B& buf, long long offset, long long rows, long long cols,
                 const std::string& name, V& v, const char* where = "CudaMemoryState::tensors") {
    Matrix<T> m(rows, cols);
    const auto bytes = static_cast<std::size_t>(rows * cols) * sizeof(T);
    copy_now(m.data(), buf.data() + offset, bytes, cudaMemcpyDeviceToHost,
             "cudaMemcpy (state to host)");
    if constexpr (std::is_const_v<B>) {
        v(name, std::as_const(m));
    } else {
        v(name, m);
        if (m.rows() != rows || m.cols() != cols) {
            throw ShapeError(detail::concat(where, ": ", name, " came back ", m.rows(), " x ",
                                            m.cols(), ", expected ", rows, " x ", cols));
        }
        copy_now(buf.data() + offset, m.data(), bytes, cudaMemcpyHostToDevice,
                 "cudaMemcpy (state from host)");
    }
}

}  // namespace backend::cuda

/// The weights of every (sequence, head) pair of a CUDA memory state at one moment, in device
/// memory (MAC's segment start, NeuralMemory::snapshot): per layer l a buffer of the pairs'
/// layer_in x layer_out weights, pair-major as the state's. Copyable (a deep device copy);
/// tensors() visits "{b}.{h}.{l}" as MemorySnapshot does (host copies, uploaded back when not
/// const).
template <class T>
struct CudaMemorySnapshot {
    MemoryConfig cfg_{};
    std::size_t pairs_ = 0;
    std::vector<backend::cuda::DeviceBuffer<T>> w_;

    [[nodiscard]] std::size_t pairs() const { return pairs_; }

    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        const auto H = static_cast<std::size_t>(self.cfg_.n_heads);
        for (std::size_t p = 0; p < self.pairs_; ++p) {
            for (std::size_t l = 0; l < self.w_.size(); ++l) {
                const long long in = self.cfg_.layer_in(static_cast<int>(l) + 1),
                                out = self.cfg_.layer_out(static_cast<int>(l) + 1);
                backend::cuda::visit_slice<T>(self.w_[l], static_cast<long long>(p) * in * out,
                                              in, out, detail::visit_name(p / H, p % H, l), v,
                                              "CudaMemorySnapshot::tensors");
            }
        }
    }
};

/// State of B streams of one NeuralMemory<T, backend::Cuda> (math §3-5), in device memory:
/// per layer l and (sequence, head) pair p = s * H + h, the chunk-start weights W^s_l and
/// momentum S^s_l (layer_in x layer_out, row-major, pairs contiguous), the pending rows of the
/// chunk in progress (layer inputs A_l, errors Delta_l, gate logits), the conv tails; its own
/// CUDA stream and cuBLAS handle; workspaces reused across calls (grown, never per token).
///
/// Made by NeuralMemory<T, backend::Cuda>::make_state(B); copyable (a deep device copy, a
/// snapshot of the streams). Every call on it returns with its stream idle.
template <class T>
class CudaMemoryState {
public:
    CudaMemoryState() = default;

    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (absolute position of the next token).
    [[nodiscard]] std::int64_t position() const { return position_; }
    /// Tokens of the chunk in progress (position mod b).
    [[nodiscard]] int pending() const {
        return static_cast<int>(position_ % static_cast<std::int64_t>(chunk_));
    }
    /// The configuration the state was made for.
    [[nodiscard]] const MemoryConfig& config() const { return cfg_; }

    /// Serialization hook (checkpoints), the CPU state's names and shapes (MemoryState::
    /// tensors), so a checkpoint written on one backend restores on the other: position;
    /// heads.{b}.{h}.w.{l}, .s.{l}; for UpdateMode::Chunked heads.{b}.{h}.a.{l}, .delta.{l}
    /// (chunk x layer_in, chunk x layer_out) and, unless the gates are constant,
    /// heads.{b}.{h}.gates (chunk x 3); conv_tail.{b} ((K-1) x 3D, if use_conv and K > 1).
    /// Each is a host copy (a download); a non-const visit uploads what the visitor left.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, CudaMemoryState>);
        const MemoryConfig& cfg = self.cfg_;
        const long long H = cfg.n_heads, b = self.chunk_, L = cfg.depth;
        v(std::string("position"), self.position_);
        for (long long s = 0; s < self.batch_; ++s) {
            for (long long h = 0; h < H; ++h) {
                const long long p = s * H + h;
                for (const char* part : {"w", "s"}) {
                    for (long long l = 0; l < L; ++l) {
                        const long long in = cfg.layer_in(static_cast<int>(l) + 1),
                                        out = cfg.layer_out(static_cast<int>(l) + 1);
                        auto& buf = (part[0] == 'w' ? self.w_ : self.s_)[static_cast<std::size_t>(l)];
                        backend::cuda::visit_slice<T>(buf, p * in * out, in, out,
                                    detail::visit_name("heads", s, h, part, l), v);
                    }
                }
                if (cfg.update != UpdateMode::Chunked) {
                    continue;
                }
                for (const char* part : {"a", "delta"}) {
                    for (long long l = 0; l < L; ++l) {
                        const bool a = part[0] == 'a';
                        const long long cols = a ? cfg.layer_in(static_cast<int>(l) + 1)
                                                 : cfg.layer_out(static_cast<int>(l) + 1);
                        auto& buf = (a ? self.a_ : self.delta_)[static_cast<std::size_t>(l)];
                        backend::cuda::visit_slice<T>(buf, p * b * cols, b, cols,
                                    detail::visit_name("heads", s, h, part, l), v);
                    }
                }
                if (cfg.gates != GateMode::Constant) {
                    backend::cuda::visit_slice<T>(self.gates_, p * b * 3, b, 3, detail::visit_name("heads", s, h, "gates"), v);
                }
            }
        }
        if (cfg.use_conv && cfg.conv_kernel > 1) {
            const long long rows = cfg.conv_kernel - 1, cols = 3LL * cfg.inner_dim();
            for (long long s = 0; s < self.batch_; ++s) {
                backend::cuda::visit_slice<T>(self.tail_, s * rows * cols, rows, cols, detail::visit_name("conv_tail", s), v);
            }
        }
    }

    // Internal (public only because nvcc's device lambdas name the types of their enclosing
    // function's parameters).
    using Buf = backend::cuda::DeviceBuffer<T>;
    /// What a transaction (begin .. commit / rollback) keeps: the position and conv tails at
    /// begin; the pending arrays' rows [pending at begin, saved_hi) before this transaction
    /// first wrote them; from the first chunk end inside it, the memory and the rows pending
    /// at begin (unchanged until that chunk end).
    struct Undo {
        bool open = false, full = false;
        int saved_hi = 0;
        std::int64_t position = 0;
        Buf tail;
        std::vector<Buf> w, s, a, delta;
        Buf gates;
    };

    /// Per-call workspaces, grown on demand (a read on a const state uses them too). Scratch:
    /// a copy of a state starts with none, and assigning a state keeps the target's own.
    struct Work {
        Buf u, q, k, v, lp, yp, yh, t1, scores, g, coef, scratch, diag;
        std::vector<Buf> z, hid, w, s;
        backend::cuda::DeviceBuffer<int> flags;
    };

private:
    template <class, class>
    friend struct backend::MemoryKernels;
    template <class, class>
    friend struct backend::MemoryTraining;

    MemoryConfig cfg_{};
    int batch_ = 0;
    int chunk_ = 1;
    std::int64_t position_ = 0;
    std::vector<Buf> w_, s_, a_, delta_;  // per layer, P pairs each
    Buf gates_;                           // P x b x 3 pending gate logits
    Buf tail_;                            // B x (K-1) x 3D pre-conv rows
    Undo undo_;
    std::optional<backend::cuda::StreamContext> ctx_;  // made by make_state
    mutable backend::cuda::Scratch<Work> work_;
};

}  // namespace titans
