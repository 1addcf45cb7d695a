#pragma once
// titans/backend/cuda/attention_state.cuh: the attention layer's state and projected prefix on
// the CUDA backend.

#include <cstdint>
#include <optional>

#include "../../attention/config.hpp"
#include "../../attention/state.hpp"
#include "../../types.hpp"
#include "runtime.cuh"

namespace titans {

namespace backend {
template <class Backend, class T>
struct AttentionKernels;
struct Cuda;
}  // namespace backend

/// State of B streams of one Attention<T, backend::Cuda> (math §6-7), in device memory: per
/// sequence b, the rotated keys and the values of its last min(w - 1, position) tokens, rows
/// [off, off + rows) of window buffers of cap x D (sequence b's buffer at b * cap * D); its own
/// CUDA stream and cuBLAS handle; workspaces reused across calls (grown, never per token).
/// A call appends its rows after the kept ones and moves the kept rows to the buffers' start
/// only when their end is reached, as the CPU state does.
///
/// Made by Attention<T, backend::Cuda>::make_state(B); copyable (a deep device copy, a snapshot
/// of the streams). Every call on it returns with its stream idle.
template <class T>
class CudaAttentionState {
public:
    CudaAttentionState() = default;

    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (absolute position of the next token).
    [[nodiscard]] std::int64_t position() const { return position_; }
    /// The configuration the state was made for.
    [[nodiscard]] const AttentionConfig& config() const { return cfg_; }
    /// True for a state from make_state (the kept rows lie inside the buffers).
    [[nodiscard]] bool well_formed() const {
        return batch_ >= 1 && ctx_.has_value() && rows_ >= 0 && off_ >= 0 &&
               off_ + rows_ <= cap_ &&
               k_.size() == static_cast<std::size_t>(batch_ * cap_ * cfg_.inner_dim());
    }
    /// Rows kept per sequence: min(w - 1, position).
    [[nodiscard]] long long kept_rows() const { return rows_; }
    /// A host copy of sequence b's kept keys (rotated if rope): min(w - 1, position) x D,
    /// oldest first (synchronous download).
    [[nodiscard]] Matrix<T> keys(int b) const { return kept(k_, b); }
    /// A host copy of sequence b's kept values, as keys.
    [[nodiscard]] Matrix<T> values(int b) const { return kept(v_, b); }

    // Internal (public only because nvcc's device lambdas name the types of their enclosing
    // function's parameters).
    using Buf = backend::cuda::DeviceBuffer<T>;
    /// What a transaction keeps: the position, offset, rows and capacity at begin, and the
    /// window buffers themselves once a call had to move the kept rows (swapped, not copied).
    struct Undo {
        bool open = false, saved = false;
        std::int64_t position = 0;
        long long off = 0, rows = 0, cap = 0;
        Buf k, v;
    };
    /// Per-call workspaces (scratch: a copy starts with none, an assignment keeps its own).
    struct Work {
        Work() = default;
        Work(const Work&) {}
        Work& operator=(const Work&) { return *this; }
        Work(Work&&) = default;
        Work& operator=(Work&&) = default;
        ~Work() = default;
        Buf qkv, o;
        backend::cuda::DeviceBuffer<int> flag;
    };

private:
    template <class, class>
    friend struct backend::AttentionKernels;

    Matrix<T> kept(const Buf& buf, int b) const {
        const long long D = cfg_.inner_dim();
        Matrix<T> out(rows_, D);
        if (out.size() > 0) {
            backend::cuda::check(cudaMemcpy(out.data(), buf.data() + (b * cap_ + off_) * D,
                                            static_cast<std::size_t>(out.size()) * sizeof(T),
                                            cudaMemcpyDeviceToHost),
                                 "cudaMemcpy (attention window to host)");
        }
        return out;
    }

    AttentionConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
    Buf k_, v_;  // B x cap x D each
    long long cap_ = 0, off_ = 0, rows_ = 0;
    Undo undo_;
    std::optional<backend::cuda::StreamContext> ctx_;  // made by make_state
    mutable Work work_;
};

/// A prefix projected once on the GPU (Attention<T, Cuda>::project_prefix): k = P W_K and
/// v = P W_V, rows x D dense in device memory, visible to every query.
template <class T>
struct CudaAttentionPrefix {
    backend::cuda::DeviceBuffer<T> k, v;
    std::ptrdiff_t n_rows = 0, width = 0;
    PrefixSharing sharing = PrefixSharing::Shared;
    [[nodiscard]] std::ptrdiff_t rows() const { return n_rows; }
    [[nodiscard]] PrefixView<T> view() const {
        return {View<const T>{k.data(), n_rows, width, width},
                View<const T>{v.data(), n_rows, width, width}, sharing};
    }
};

}  // namespace titans
