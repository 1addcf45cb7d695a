#pragma once
// titans/backend/cpu/attention_state.hpp: AttentionState<T>, the state of a stream batch of
// one Attention layer on the CPU backend: the per-sequence history (last w - 1 keys and
// values) and the position.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../attention/config.hpp"
#include "../../attention/kernels_decl.hpp"
#include "../../detail/visit.hpp"
#include "../../types.hpp"

namespace titans {

namespace backend {
template <class Backend, class T>
struct AttentionKernels;
}  // namespace backend

/// The state of B independent streams of one Attention layer: per sequence, the rotated keys
/// and the values of its last min(w - 1, position) tokens (all a later query can still see),
/// and the absolute position of the next token. Made by Attention::make_state(B); copyable (a
/// copy is a snapshot of the streams).
template <class T>
class AttentionState {
public:
    AttentionState() = default;

    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (absolute position of the next token).
    [[nodiscard]] std::int64_t position() const { return position_; }
    /// Keys (rotated if rope) kept for sequence b: min(w - 1, position) x D, oldest first (a
    /// view into the state's window buffer, valid until the next call on the state).
    [[nodiscard]] auto keys(int b) const {
        return k_hist_[static_cast<std::size_t>(b)].middleRows(off_, rows_);
    }
    /// Values kept for sequence b: min(w - 1, position) x D, oldest first (a view, as keys).
    [[nodiscard]] auto values(int b) const {
        return v_hist_[static_cast<std::size_t>(b)].middleRows(off_, rows_);
    }
    /// True if every sequence keeps the same number of key and value rows, D wide, within its
    /// buffer (always, except after loading inconsistent tensors through tensors()).
    [[nodiscard]] bool well_formed() const {
        if (rows_ < 0 || off_ < 0 || k_hist_.size() != static_cast<std::size_t>(batch_) ||
            v_hist_.size() != k_hist_.size()) {
            return false;
        }
        for (std::size_t b = 0; b < k_hist_.size(); ++b) {
            for (const Matrix<T>* m : {&k_hist_[b], &v_hist_[b]}) {
                if (m->rows() < off_ + rows_ || m->cols() != cfg_.inner_dim()) {
                    return false;
                }
            }
        }
        return true;
    }
    /// Rows of sequence b's key and value buffers from the kept rows on: the kept rows plus
    /// free room; right after tensors() loaded the state, exactly the rows loaded.
    [[nodiscard]] std::pair<Eigen::Index, Eigen::Index> loaded_rows(int b) const {
        const auto i = static_cast<std::size_t>(b);
        return {k_hist_[i].rows() - off_, v_hist_[i].rows() - off_};
    }
    /// Rows of sequence b's kept keys and values: both min(w - 1, position) when well_formed(),
    /// else (just loaded from inconsistent tensors) the rows loaded.
    [[nodiscard]] std::pair<Eigen::Index, Eigen::Index> window_rows(int b) const {
        return well_formed() ? std::pair{rows_, rows_} : loaded_rows(b);
    }
    /// The configuration the state was made for.
    [[nodiscard]] const AttentionConfig& config() const { return cfg_; }

    /// Serialization hook (checkpoints): calls v(name, x) for everything a resumed stream needs
    /// to continue bit-identically, x a Matrix<T>& or std::int64_t& (const if Self is):
    ///     position   std::int64_t
    ///     k.{b}      keys (rotated if rope) of sequence b: min(w - 1, position) x D
    ///     v.{b}      values of sequence b:                 min(w - 1, position) x D
    /// The ROW COUNT of k.{b} and v.{b} varies with position (0 rows at position 0): a loader
    /// must accept any h x D with h = min(w - 1, position) and assign (resize) the member.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AttentionState>);
        v(std::string("position"), self.position_);
        if constexpr (std::is_const_v<Self>) {  // exact copies of the kept rows (const lvalues)
            for (std::size_t b = 0; b < self.k_hist_.size(); ++b) {
                const Matrix<T> kept(self.keys(static_cast<int>(b)));
                v(detail::visit_name("k", b), kept);
            }
            for (std::size_t b = 0; b < self.v_hist_.size(); ++b) {
                const Matrix<T> kept(self.values(static_cast<int>(b)));
                v(detail::visit_name("v", b), kept);
            }
        } else {  // the buffers themselves, compacted to the kept rows (a loader assigns them)
            self.compact();
            for (std::size_t b = 0; b < self.k_hist_.size(); ++b) {
                v(detail::visit_name("k", b), self.k_hist_[b]);
            }
            for (std::size_t b = 0; b < self.v_hist_.size(); ++b) {
                v(detail::visit_name("v", b), self.v_hist_[b]);
            }
            // A loader may have assigned any row counts: equal ones become the kept rows,
            // unequal ones leave the state malformed (well_formed() false).
            self.rows_ = self.k_hist_.empty() ? 0 : self.k_hist_[0].rows();
            for (std::size_t b = 0; b < self.k_hist_.size(); ++b) {
                if (self.k_hist_[b].rows() != self.rows_ || self.v_hist_[b].rows() != self.rows_) {
                    self.rows_ = -1;
                }
            }
        }
    }

private:
    template <class, class>
    friend struct backend::AttentionKernels;

    AttentionConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
    // Window buffers, B of cap x D: sequence b's kept keys / values are rows [off_, off_ +
    // rows_), rows_ = min(w - 1, position). A call appends its rows after them (the kernel
    // reads [off_, off_ + rows_ + N) in place) and advances off_; when the buffer's end is
    // reached, the kept rows move to its start (amortised O(D) per token, not O(w D)).
    std::vector<Matrix<T>> k_hist_, v_hist_;
    Eigen::Index off_ = 0, rows_ = 0;
    // The open transaction (Attention::begin): position, offset and row count at its start;
    // the buffers are swapped out (not copied) only if a call must move the kept rows.
    struct Undo {
        bool open = false, saved = false;
        std::int64_t position = 0;
        Eigen::Index off = 0, rows = 0;
        std::vector<Matrix<T>> k, v;
    } undo_;

    /// Moves the kept rows to the start of exactly-sized buffers (off_ = 0, rows == rows_).
    void compact() {
        for (std::size_t b = 0; b < k_hist_.size(); ++b) {
            k_hist_[b] = Matrix<T>(k_hist_[b].middleRows(off_, rows_));
            v_hist_[b] = Matrix<T>(v_hist_[b].middleRows(off_, rows_));
        }
        off_ = 0;
    }
};

}  // namespace titans
