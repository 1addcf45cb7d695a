#pragma once
// titans/attention/state.hpp: AttentionState<T>, the per-sequence history (last w - 1 keys
// and values, position) of a batch of streams, and PrefixSharing.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/float_env.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../types.hpp"
#include "config.hpp"

namespace titans {

/// How Attention::forward reads its prefix argument.
enum class PrefixSharing {
    Shared,       ///< prefix is p x d, the same rows for every sequence (persistent tokens P)
    PerSequence,  ///< prefix is (B*p) x d stacked sequence-major, rows [b*p, (b+1)*p) for
                  ///< sequence b (e.g. MAC's P ‖ h_t, where h_t differs per sequence)
};

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
    /// Keys (rotated if rope) kept for sequence b: min(w - 1, position) x D, oldest first.
    [[nodiscard]] const Matrix<T>& keys(int b) const { return k_hist_[static_cast<std::size_t>(b)]; }
    /// Values kept for sequence b: min(w - 1, position) x D, oldest first.
    [[nodiscard]] const Matrix<T>& values(int b) const { return v_hist_[static_cast<std::size_t>(b)]; }
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
        for (std::size_t b = 0; b < self.k_hist_.size(); ++b) {
            v(detail::visit_name("k", b), self.k_hist_[b]);
        }
        for (std::size_t b = 0; b < self.v_hist_.size(); ++b) {
            v(detail::visit_name("v", b), self.v_hist_[b]);
        }
    }

private:
    friend class Attention<T>;

    AttentionConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
    std::vector<Matrix<T>> k_hist_, v_hist_;  // B of h x D, h = min(w - 1, position)
    // The open transaction (Attention::begin): position and histories at its start, the
    // histories swapped out (not copied) by the first call that replaces them.
    struct Undo {
        bool open = false, saved = false;
        std::int64_t position = 0;
        std::vector<Matrix<T>> k, v;
    } undo_;
};

}  // namespace titans
