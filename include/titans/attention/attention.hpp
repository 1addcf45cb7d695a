#pragma once
// titans/attention/attention.hpp: exact multi-head softmax attention with an always-visible
// prefix and a causal sliding window (math §6-7), tiled so that work and memory are linear in
// the sequence length for a fixed window and prefix.
//
//   AttentionConfig            d_model, heads, window, RoPE settings
//   AttentionParams<T>         w_q, w_k, w_v (d x D), w_o (D x d)
//   prefix_window_attention    the core primitive on projected q/k/v, used by every composition
//   AttentionState<T>          per-sequence history (last w-1 keys/values) of a stream batch
//   Attention<T>               the layer: projections, RoPE, streaming, output projection
//
// The masks of math §7 are all instances of one rule. Query i of a piece sits at position
// t = first_query + i of the sequence keys and sees
//     every prefix row (persistent tokens P, MAC's retrieved memory h_t, ...)    and
//     sequence keys j with t - w < j <= t (itself and the w - 1 before it).
// MAG/MAL: prefix = P, window w. MAC: prefix = P ‖ h_t, window >= C (causal inside a segment).
//
// The parts: config.hpp, params.hpp, kernel.hpp (prefix_window_attention), state.hpp; this file
// holds the layer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/product.hpp"
#include "../detail/float_env.hpp"
#include "../detail/random.hpp"
#include "../detail/shared.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../threads.hpp"
#include "../types.hpp"
#include "config.hpp"
#include "kernel.hpp"
#include "params.hpp"
#include "rope.hpp"
#include "state.hpp"

namespace titans {

/// A causal sliding-window multi-head attention layer over a batch of streams, with an optional
/// always-visible prefix (math §6-7: SWA* of MAG, SWA of MAL, and the segment attention of MAC):
///
///     q_t = rope_t(x_t W_Q),  k_t = rope_t(x_t W_K),  v_t = x_t W_V        (sequence tokens)
///     k_P = P W_K,  v_P = P W_V                                             (prefix, not rotated)
///     y_t = [ softmax( q_t [k_P ; k_{t-w+1..t}]^T / sqrt(d_h) ) [v_P ; v_{t-w+1..t}] ]_heads W_O
///
/// rope_t rotates at the token's absolute position t in the stream (only when cfg.rope). Prefix
/// tokens carry no position: they are not rotated and every query sees all of them, so they act
/// as a content-addressed memory (the persistent tokens of math §6).
///
/// Shapes: forward takes x of (B*N) x d_model (B sequences of N tokens, stacked
/// sequence-major) and returns (B*N) x d_model. B is fixed by the state; N may differ between
/// calls: the state keeps the last w - 1 keys/values of every sequence, so feeding a stream in
/// pieces of any length (one token at a time included) gives the outputs of one call.
///
///     titans::AttentionConfig cfg{.d_model = 64, .n_heads = 4, .window = 32, .rope = true};
///     titans::Attention<float> attn(cfg, titans::AttentionParams<float>::random(cfg, 7));
///     auto state = attn.make_state(1);
///     titans::Matrixf y = attn.forward(state, x, &persistent.tokens());  // x: N x 64
///
/// Thread safety: an Attention is immutable after construction; distinct states may be used
/// from distinct threads concurrently.
template <class T>
class Attention {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::Attention: T must be float or double");

public:
    using Scalar = T;
    using State = AttentionState<T>;

    /// Validates both (ConfigError, ShapeError, NonFiniteError) and keeps them.
    Attention(AttentionConfig config, AttentionParams<T> params)
        : Attention(std::move(config),
                    std::make_shared<const AttentionParams<T>>(std::move(params))) {}

    /// Shares `params` (not copied; ConfigError if null), as NeuralMemory does.
    Attention(AttentionConfig config, std::shared_ptr<const AttentionParams<T>> params)
        : cfg_(std::move(config)), params_(detail::require_shared(std::move(params), "Attention")) {
        cfg_.validate_for<T>();
        params_->validate(cfg_);
    }

    [[nodiscard]] const AttentionConfig& config() const { return cfg_; }
    [[nodiscard]] const AttentionParams<T>& params() const { return *params_; }
    /// The parameters as held (shared with the block that owns them, if any).
    [[nodiscard]] const std::shared_ptr<const AttentionParams<T>>& shared_params() const {
        return params_;
    }

    /// A fresh state for `batch` independent sequences: no history, position 0.
    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require_state_batch(
            "Attention::make_state", batch, detail::scalar_name<T>(),
            [&](std::int64_t b) { return cfg_.state_bytes(b, std::int64_t{sizeof(T)}); });
        State s;
        s.cfg_ = cfg_;
        s.batch_ = batch;
        s.position_ = 0;
        s.k_hist_.assign(static_cast<std::size_t>(batch), Matrix<T>(0, cfg_.inner_dim()));
        s.v_hist_.assign(static_cast<std::size_t>(batch), Matrix<T>(0, cfg_.inner_dim()));
        return s;
    }

    /// Processes the next piece of every stream. x: (B*N) x d_model with B = state.batch();
    /// prefix (optional): p x d_model (PrefixSharing::Shared) or (B*p) x d_model
    /// (PrefixSharing::PerSequence), visible to every query. Returns (B*N) x d_model.
    [[nodiscard]] Matrix<T> forward(State& state, const MatrixRef<T>& x,
                                    const Matrix<T>* prefix = nullptr,
                                    PrefixSharing sharing = PrefixSharing::Shared) const {
        Matrix<T> y;
        forward(state, x, y, prefix, sharing);
        return y;
    }

    /// As above, writing into `y` (resized to (B*N) x d_model; not sharing storage with an
    /// input).
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y, const Matrix<T>* prefix = nullptr,
                 PrefixSharing sharing = PrefixSharing::Shared) const {
        constexpr const char* where = "Attention::forward";
        detail::check_position_advance(where, state.position_, x.rows(), state.batch_);
        check_state(state, where);
        check_input(state, x, prefix, sharing, where);
        if (detail::overlaps(x, y) || (prefix != nullptr && detail::overlaps(*prefix, y))) {
            throw ShapeError("Attention::forward: y is also an input, expected a distinct matrix");
        }
        const ThreadScope team(threads_,
                                       work_estimate(x.rows(), prefix ? prefix->rows() : 0));
        Matrix<T> kp(0, cfg_.inner_dim()), vp(0, cfg_.inner_dim());
        Eigen::Index p = 0;
        if (prefix != nullptr && prefix->rows() > 0) {
            kp.noalias() = *prefix * params_->w_k;
            vp.noalias() = *prefix * params_->w_v;
            p = sharing == PrefixSharing::Shared ? prefix->rows() : prefix->rows() / state.batch_;
        }
        run(state, x, y, kp, vp, p, sharing);
    }

    /// As forward with a prefix shared by every sequence whose projections the caller made once:
    /// k_prefix = prefix W_K and v_prefix = prefix W_V (p x D each). A fixed prefix (persistent
    /// tokens) then costs nothing per call (serving); the outputs are the same.
    void forward_projected(State& state, const MatrixRef<T>& x, Matrix<T>& y,
                           const Matrix<T>& k_prefix, const Matrix<T>& v_prefix) const {
        constexpr const char* where = "Attention::forward_projected";
        detail::check_position_advance(where, state.position_, x.rows(), state.batch_);
        check_state(state, where);
        check_input(state, x, nullptr, PrefixSharing::Shared, where);
        const Eigen::Index D = cfg_.inner_dim();
        detail::require<ShapeError>(k_prefix.cols() == D || k_prefix.rows() == 0, where,
                                    "k_prefix.cols()", k_prefix.cols(),
                                    detail::concat("n_heads * d_head = ", D));
        detail::require<ShapeError>(
            v_prefix.rows() == k_prefix.rows() && v_prefix.cols() == k_prefix.cols(), where,
            "v_prefix shape", detail::concat(v_prefix.rows(), " x ", v_prefix.cols()),
            detail::concat("k_prefix's ", k_prefix.rows(), " x ", k_prefix.cols()));
        if (!detail::all_finite(k_prefix) || !detail::all_finite(v_prefix)) {
            throw NonFiniteError(detail::concat(where, ": the prefix has a NaN or infinite entry"));
        }
        if (detail::overlaps(x, y) || detail::overlaps(k_prefix, y) ||
            detail::overlaps(v_prefix, y)) {
            throw ShapeError(detail::concat(where, ": y is also an input, expected a distinct matrix"));
        }
        const ThreadScope team(threads_, work_estimate(x.rows(), k_prefix.rows()));
        run(state, x, y, k_prefix, v_prefix, k_prefix.rows(), PrefixSharing::Shared);
    }

    /// Thread settings of this object's calls, as NeuralMemory::set_threads (titans/threads.hpp).
    void set_threads(Threads t) {
        t.validate("Attention::set_threads");
        threads_ = t;
    }
    [[nodiscard]] const Threads& threads() const { return threads_; }

    /// Approximate multiply-adds of a forward over `rows` tokens with a prefix of `prefix_rows`
    /// (projections and W_O, scores and values over the window and the prefix).
    [[nodiscard]] double work_estimate(Eigen::Index rows, Eigen::Index prefix_rows = 0) const {
        const double d = cfg_.d_model, D = cfg_.inner_dim();
        const double seen = static_cast<double>(cfg_.window) + static_cast<double>(prefix_rows);
        return static_cast<double>(rows) * (4.0 * d * D + 2.0 * D * seen) +
               static_cast<double>(prefix_rows) * 2.0 * d * D;
    }

    /// Throws ConfigError unless `state` can be continued by this layer: made by make_state()
    /// of an attention with the same heads, widths, window and RoPE settings.
    void validate_state(const State& state) const { check_state(state, "Attention"); }

    /// Transactions, as NeuralMemory::begin/commit/rollback: forward calls after begin(state)
    /// are undone together by rollback(state) or kept by commit(state); without one each call
    /// is its own (a call that throws leaves the state as it was). begin returns false if one
    /// is already open.
    bool begin(State& state) const {
        check_state(state, "Attention::begin");
        auto& u = state.undo_;
        if (u.open) {
            return false;
        }
        u.open = true;
        u.saved = false;
        u.position = state.position_;
        u.off = state.off_;
        u.rows = state.rows_;
        return true;
    }
    void commit(State& state) const { state.undo_.open = false; }
    void rollback(State& state) const {
        auto& u = state.undo_;
        if (!u.open) {
            return;
        }
        if (u.saved) {
            for (std::size_t b = 0; b < state.k_hist_.size(); ++b) {
                state.k_hist_[b].swap(u.k[b]);
                state.v_hist_[b].swap(u.v[b]);
            }
        }
        state.position_ = u.position;
        state.off_ = u.off;
        state.rows_ = u.rows;
        u.open = false;
    }

private:
    /// Checked inputs: projects x, then attend() inside a transaction (the state is unchanged
    /// if it throws).
    void run(State& state, const MatrixRef<T>& x, Matrix<T>& y, const Matrix<T>& kp,
             const Matrix<T>& vp, Eigen::Index p, PrefixSharing sharing) const {
        const int B = state.batch_, H = cfg_.n_heads, dh = cfg_.head_dim(), D = cfg_.inner_dim();
        const Eigen::Index N = x.rows() / B;
        y.resize(x.rows(), cfg_.d_model);
        if (N == 0) return;
        // Projections of every token of every sequence at once.
        Matrix<T> q(x.rows(), D), k(x.rows(), D), v(x.rows(), D);
        detail::multiply(q, x, params_->w_q);
        detail::multiply(k, x, params_->w_k);
        detail::multiply(v, x, params_->w_v);
        if (cfg_.rope) {
            // All sequences are at the same absolute position: one table for all of them.
            detail::RopeTable<T> table(N, dh, state.position_, cfg_.rope_base);
            for (int b = 0; b < B; ++b) {
                table.apply(q.middleRows(b * N, N), H, dh);
                table.apply(k.middleRows(b * N, N), H, dh);
            }
        }
        const bool own = begin(state);
        try {
            attend(state, q, k, v, kp, vp, p, sharing, y);
        } catch (...) {
            rollback(state);
            throw;
        }
        if (own) {
            commit(state);
        }
    }

    /// The attention proper on projected q, k, v (and prefix kp, vp of p rows per sequence),
    /// then the new histories and W_O; NonFiniteError if the output is not finite.
    void attend(State& state, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                const Matrix<T>& kp, const Matrix<T>& vp, Eigen::Index p, PrefixSharing sharing,
                Matrix<T>& y) const {
        using Index = Eigen::Index;
        const int B = state.batch_, H = cfg_.n_heads, dh = cfg_.head_dim(), D = cfg_.inner_dim();
        const Index N = q.rows() / B;
        // Per sequence: keys/values = [kept (h rows) ; this piece (N rows)], read in place from
        // the window buffer; queries at positions h .. h + N - 1 of them.
        const Index w1 = static_cast<Index>(cfg_.window) - 1;
        const Index h = state.rows_;
        reserve_window(state, N);
        const Index off = state.off_;
        Matrix<T> o(q.rows(), D);
        for (int b = 0; b < B; ++b) {
            auto& kb = state.k_hist_[static_cast<std::size_t>(b)];
            auto& vb = state.v_hist_[static_cast<std::size_t>(b)];
            kb.middleRows(off + h, N) = k.middleRows(b * N, N);
            vb.middleRows(off + h, N) = v.middleRows(b * N, N);
            const Index pr0 = sharing == PrefixSharing::Shared ? 0 : b * p;
            detail::prefix_window_attention_impl<T>(
                q.middleRows(b * N, N), kp.middleRows(pr0, p), vp.middleRows(pr0, p),
                kb.middleRows(off, h + N), vb.middleRows(off, h + N), H, dh, cfg_.window, h,
                o.middleRows(b * N, N));
        }
        const Index keep = std::min<Index>(w1, h + N);
        state.off_ = off + h + N - keep;
        state.rows_ = keep;
        detail::multiply(y, o, params_->w_o);
        if (!detail::all_finite(y)) {
            const Index r = detail::first_nonfinite_row(y);
            throw NonFiniteError(detail::concat(
                "Attention::forward: the output is not finite at sequence ", r / N, ", position ",
                state.position_ + r % N, " (the projections overflow), expected finite values; "
                "the state is unchanged"));
        }
        state.position_ += N;
    }

    /// Makes room for N more rows after the kept ones in every window buffer: if the buffers'
    /// end is near, the kept rows move to the start of buffers of h + N + w - 1 rows (inside an
    /// open transaction the old buffers are first swapped out, untouched, for rollback).
    static void reserve_window(State& state, Eigen::Index N) {
        const Eigen::Index h = state.rows_, cap = state.k_hist_[0].rows();
        if (state.off_ + h + N <= cap) {
            return;  // appending writes past the kept rows: a rollback still finds them
        }
        const Eigen::Index rows = h + N + std::max<Eigen::Index>(state.cfg_.window - 1, 1);
        auto& u = state.undo_;
        const bool save = u.open && !u.saved;
        if (save) {
            u.k.resize(state.k_hist_.size());
            u.v.resize(state.v_hist_.size());
        }
        for (std::size_t b = 0; b < state.k_hist_.size(); ++b) {
            for (auto [buf, old] : {std::pair{&state.k_hist_[b], save ? &u.k[b] : nullptr},
                                    std::pair{&state.v_hist_[b], save ? &u.v[b] : nullptr}}) {
                Matrix<T> fresh(rows, buf->cols());
                fresh.topRows(h) = buf->middleRows(state.off_, h);
                if (old != nullptr) {
                    old->swap(*buf);
                }
                buf->swap(fresh);
            }
        }
        u.saved = u.saved || save;
        state.off_ = 0;
    }

    void check_state(const State& state, const char* where) const {
        const AttentionConfig& s = state.cfg_;
        const bool same = state.batch_ >= 1 && s.d_model == cfg_.d_model &&
                          s.n_heads == cfg_.n_heads && s.head_dim() == cfg_.head_dim() &&
                          s.window == cfg_.window && s.rope == cfg_.rope &&
                          (!cfg_.rope || s.rope_base == cfg_.rope_base) &&
                          state.k_hist_.size() == static_cast<std::size_t>(state.batch_) &&
                          state.well_formed();
        if (!same) {
            throw ConfigError(detail::concat(
                where, ": state was made for a different configuration (or default-constructed),"
                       " expected a state from make_state() of an attention with this "
                       "configuration"));
        }
    }
    void check_input(const State& state, const MatrixRef<T>& x, const Matrix<T>* prefix,
                     PrefixSharing sharing, const char* where) const {
        if (x.cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", x.cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (x.rows() % state.batch_ != 0) {
            throw ShapeError(detail::concat(where, ": x has ", x.rows(),
                                            " rows, expected a multiple of the state's batch = ",
                                            state.batch_, " (B*N rows, sequence-major)"));
        }
        if (!x.allFinite()) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
        if (prefix == nullptr) return;
        if (prefix->cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": prefix has ", prefix->cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (sharing == PrefixSharing::PerSequence && prefix->rows() % state.batch_ != 0) {
            throw ShapeError(detail::concat(
                where, ": prefix has ", prefix->rows(),
                " rows, expected a multiple of the state's batch = ", state.batch_,
                " (B*p rows, sequence-major, with PrefixSharing::PerSequence)"));
        }
        if (!prefix->allFinite()) {
            throw NonFiniteError(detail::concat(where, ": prefix has a NaN or infinite entry"));
        }
    }

    AttentionConfig cfg_;
    std::shared_ptr<const AttentionParams<T>> params_;
    Threads threads_{};
};

}  // namespace titans
