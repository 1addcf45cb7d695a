#pragma once
// titans/backend/cuda/attention_state.cuh: the attention layer's state and projected prefix on
// the CUDA backend.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../attention/config.hpp"
#include "../../attention/prefix.hpp"
#include "../../detail/visit.hpp"
#include "../../types.hpp"
#include "runtime.cuh"
#include "../../attention/kernels_decl.hpp"

namespace titans {

namespace backend {
template <class Backend, class T>
struct AttentionKernels;
template <class Backend, class T>
struct AttentionTraining;
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
               k_.size() == static_cast<std::size_t>(batch_ * cap_ * cfg_.inner_dim()) &&
               v_.size() == k_.size();
    }
    /// Rows kept per sequence: min(w - 1, position).
    [[nodiscard]] long long kept_rows() const { return rows_; }
    /// Rows of sequence b's kept keys and values: both min(w - 1, position) when well_formed(),
    /// else (just loaded from inconsistent tensors) the rows loaded.
    [[nodiscard]] std::pair<long long, long long> window_rows(int b) const {
        if (well_formed()) {
            return {rows_, rows_};
        }
        const auto i = static_cast<std::size_t>(b);
        return i < loaded_.size() ? loaded_[i] : std::pair<long long, long long>{0, 0};
    }
    /// A host copy of sequence b's kept keys (rotated if rope): min(w - 1, position) x D,
    /// oldest first (synchronous download).
    [[nodiscard]] Matrix<T> keys(int b) const { return kept(k_, b); }
    /// A host copy of sequence b's kept values, as keys.
    [[nodiscard]] Matrix<T> values(int b) const { return kept(v_, b); }

    /// Serialization hook (checkpoints), the CPU state's names (AttentionState::tensors), so a
    /// checkpoint written on one backend restores on the other: position, k.{b}, v.{b} (the
    /// kept rows, min(w - 1, position) x D). Host copies (downloads); a non-const visit takes
    /// what the loader assigned (any row counts) and uploads it into fresh window buffers, or
    /// marks the state malformed (well_formed() false) when the row counts or widths differ.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, CudaAttentionState>);
        v(std::string("position"), self.position_);
        const auto B = static_cast<std::size_t>(self.batch_);
        std::vector<Matrix<T>> k(B), val(B);
        for (std::size_t b = 0; b < B; ++b) {
            k[b] = self.keys(static_cast<int>(b));
            val[b] = self.values(static_cast<int>(b));
        }
        if constexpr (std::is_const_v<Self>) {
            for (std::size_t b = 0; b < B; ++b) {
                v(detail::visit_name("k", b), std::as_const(k[b]));
            }
            for (std::size_t b = 0; b < B; ++b) {
                v(detail::visit_name("v", b), std::as_const(val[b]));
            }
        } else {
            for (std::size_t b = 0; b < B; ++b) {
                v(detail::visit_name("k", b), k[b]);
            }
            for (std::size_t b = 0; b < B; ++b) {
                v(detail::visit_name("v", b), val[b]);
            }
            self.load(k, val);
        }
    }

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
    /// Per-call workspaces (cuda::Scratch: a copy of the state starts with none).
    struct Work {
        Buf qkv, o;
        backend::cuda::DeviceBuffer<unsigned> flag;
        Buf spare_k, spare_v;  // the window's buffers before its last move, for the next one
    };

private:
    template <class, class>
    friend struct backend::AttentionKernels;
    template <class, class>
    friend struct backend::AttentionTraining;

    /// The state's window from host rows (tensors): equal row counts h and D columns give
    /// buffers of h + max(w - 1, 1) rows holding them; anything else a malformed state.
    void load(const std::vector<Matrix<T>>& k, const std::vector<Matrix<T>>& v) {
        const long long D = cfg_.inner_dim();
        const long long h = k.empty() ? 0 : k[0].rows();
        bool same = true;
        loaded_.assign(k.size(), {0, 0});
        for (std::size_t b = 0; b < k.size(); ++b) {
            loaded_[b] = {k[b].rows(), v[b].rows()};
            same = same && k[b].rows() == h && v[b].rows() == h && k[b].cols() == D &&
                   v[b].cols() == D;
        }
        if (!same) {
            rows_ = -1;
            return;
        }
        const long long cap = h + std::max<long long>(cfg_.window - 1, 1);
        // Both buffers filled before the state changes (an allocation or copy may throw).
        Buf kb = upload_rows(k, h, cap), vb = upload_rows(v, h, cap);
        k_.swap(kb);
        v_.swap(vb);
        cap_ = cap;
        off_ = 0;
        rows_ = h;
    }
    /// Per sequence b, its h host rows at b * cap rows of a new buffer of batch x cap rows.
    Buf upload_rows(const std::vector<Matrix<T>>& src, long long h, long long cap) const {
        const long long D = cfg_.inner_dim();
        Buf fresh(static_cast<std::size_t>(batch_ * cap * D));
        for (std::size_t b = 0; b < src.size() && h > 0; ++b) {
            backend::cuda::copy_now(fresh.data() + static_cast<long long>(b) * cap * D,
                                    src[b].data(), static_cast<std::size_t>(h * D) * sizeof(T),
                                    cudaMemcpyHostToDevice,
                                    "cudaMemcpy (attention window from host)");
        }
        return fresh;
    }

    Matrix<T> kept(const Buf& buf, int b) const {
        const long long D = cfg_.inner_dim();
        Matrix<T> out(std::max<long long>(rows_, 0), D);  // none in a malformed state
        backend::cuda::copy_now(out.data(), buf.data() + (b * cap_ + off_) * D,
                                static_cast<std::size_t>(out.size()) * sizeof(T),
                                cudaMemcpyDeviceToHost, "cudaMemcpy (attention window to host)");
        return out;
    }

    AttentionConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
    Buf k_, v_;  // B x cap x D each
    long long cap_ = 0, off_ = 0, rows_ = 0;
    std::vector<std::pair<long long, long long>> loaded_;  // rows loaded by tensors(), per b
    Undo undo_;
    std::optional<backend::cuda::StreamContext> ctx_;  // made by make_state
    mutable backend::cuda::Scratch<Work> work_;
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
