#pragma once
// titans/backend/cuda/memory_state.cuh: the state of a stream batch on the CUDA backend.

#include <cstdint>
#include <optional>
#include <vector>

#include "../../memory/config.hpp"
#include "runtime.cuh"

namespace titans {

namespace backend {
template <class Backend, class T>
struct MemoryKernels;
struct Cuda;
}  // namespace backend

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

    // Internal (public only because nvcc's device lambdas name the types of their enclosing
    // function's parameters).
    using Buf = backend::cuda::DeviceBuffer<T>;
    /// What a transaction (begin .. commit / rollback) keeps: the position and conv tails at
    /// begin, and, from the first chunk end inside it, the memory and pending rows as they
    /// were at begin (unchanged until that chunk end).
    struct Undo {
        bool open = false, full = false;
        std::int64_t position = 0;
        Buf tail;
        std::vector<Buf> w, s, a, delta;
        Buf gates;
    };

    /// Per-call workspaces, grown on demand (a read on a const state uses them too). Scratch:
    /// a copy of a state starts with none, and assigning a state keeps the target's own.
    struct Work {
        Work() = default;
        Work(const Work&) {}
        Work& operator=(const Work&) { return *this; }
        Work(Work&&) = default;
        Work& operator=(Work&&) = default;
        ~Work() = default;
        Buf u, logits, q, k, v, lp, yp, yh, t1, scores, g, coef, scratch, diag;
        std::vector<Buf> z, hid, w, s;
        backend::cuda::DeviceBuffer<int> flags;
    };

private:
    template <class, class>
    friend struct backend::MemoryKernels;


    MemoryConfig cfg_{};
    int batch_ = 0;
    int chunk_ = 1;
    std::int64_t position_ = 0;
    std::vector<Buf> w_, s_, a_, delta_;  // per layer, P pairs each
    Buf gates_;                           // P x b x 3 pending gate logits
    Buf tail_;                            // B x (K-1) x 3D pre-conv rows
    Undo undo_;
    std::optional<backend::cuda::StreamContext> ctx_;  // made by make_state
    mutable Work work_;
};

}  // namespace titans
