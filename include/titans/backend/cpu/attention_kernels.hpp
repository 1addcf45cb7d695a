#pragma once
// titans/backend/cpu/attention_kernels.hpp: the attention layer on the CPU (math §6-7).
//
// Per forward call: one GEMM per projection over every token of every sequence, RoPE from one
// table, then per sequence the tiled prefix + window kernel (attention/kernel.hpp) reading its
// keys and values in place from the state's window buffer, and the output projection. A call
// runs inside a transaction (AttentionState's undo record), so a throw leaves the state as it
// was.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "../../detail/tensor_slots.hpp"
#include "../../attention/config.hpp"
#include "../../attention/kernel.hpp"
#include "../../attention/params.hpp"
#include "../../attention/rope.hpp"
#include "../../attention/prefix.hpp"
#include "../../attention/segment.hpp"
#include "../../attention/segment_backward.hpp"
#include "../../detail/check.hpp"
#include "../../detail/float_env.hpp"
#include "../../detail/product.hpp"
#include "../../error.hpp"
#include "../../types.hpp"
#include "../backend.hpp"
#include "attention_state.hpp"
#include "transfer.hpp"
#include "../../attention/kernels_decl.hpp"

namespace titans::backend {

struct Cpu;

template <class T>
struct AttentionKernels<Cpu, T> {
    using Mat = Matrix<T>;
    using Index = Eigen::Index;
    using State = AttentionState<T>;
    /// Projected prefix keys and values (P W_K, P W_V), host matrices.
    using Prefix = AttentionPrefix<T>;
    /// The parameters as the kernels use them: the caller's own (shared, not copied).
    using Prepared = std::shared_ptr<const AttentionParams<T>>;

    static Prepared prepare(const AttentionConfig&,
                            const std::shared_ptr<const AttentionParams<T>>& params) {
        return params;
    }
    /// The parameters from their flat form (AttentionParams::tensors order): a copy.
    static Prepared prepare_flat(const AttentionConfig& cfg, const AttentionParams<T>& shapes,
                                 View<const T> flat) {
        return detail::from_flat(shapes, cfg, flat.data);
    }

    static State make_state(const AttentionConfig& cfg, int batch) {
        State s;
        s.cfg_ = cfg;
        s.batch_ = batch;
        s.position_ = 0;
        s.k_hist_.assign(static_cast<std::size_t>(batch), Mat(0, cfg.inner_dim()));
        s.v_hist_.assign(static_cast<std::size_t>(batch), Mat(0, cfg.inner_dim()));
        return s;
    }

    /// P W_K and P W_V of a checked prefix.
    static Prefix project_prefix(const AttentionConfig& cfg, const Prepared& p,
                                 View<const T> prefix_rows, PrefixSharing sharing) {
        const auto prefix = cpu::as_eigen(prefix_rows);
        Prefix out;
        out.sharing = sharing;
        out.k.resize(prefix.rows(), cfg.inner_dim());
        out.v.resize(prefix.rows(), cfg.inner_dim());
        if (prefix.rows() > 0) {
            out.k.noalias() = prefix * p->w_k;
            out.v.noalias() = prefix * p->w_v;
        }
        return out;
    }

    /// Checked inputs: projects x ((B*N) x d), then attend() inside a transaction (the state is
    /// unchanged if it throws) into y ((B*N) x d, sized). prefix may be null.
    static void forward(const AttentionConfig& cfg, const Prepared& p, State& state,
                        View<const T> xv, View<T> y, const PrefixView<T>* prefix) {
        const int B = state.batch_, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const auto x = cpu::as_eigen(xv);
        const Index N = x.rows() / B;
        if (N == 0) return;
        Mat q(x.rows(), D), k(x.rows(), D), v(x.rows(), D);
        detail::multiply(q, x, p->w_q);
        detail::multiply(k, x, p->w_k);
        detail::multiply(v, x, p->w_v);
        if (cfg.rope) {
            // All sequences are at the same absolute position: one table for all of them.
            detail::RopeTable<T> table(N, dh, state.position_, cfg.rope_base);
            for (int b = 0; b < B; ++b) {
                table.apply(q.middleRows(b * N, N), H, dh);
                table.apply(k.middleRows(b * N, N), H, dh);
            }
        }
        const bool own = begin(state);
        try {
            attend(cfg, *p, state, q, k, v, prefix, cpu::as_eigen(y));
        } catch (...) {
            rollback(state);
            throw;
        }
        if (own) {
            commit(state);
        }
    }

    /// MAC's segment attention on checked views (attention/segment.hpp).
    static void segment(const AttentionConfig& cfg, const Prepared& p, const SegmentCall<T>& c) {
        auto sk = cpu::as_eigen(c.seg_k);
        auto sv = cpu::as_eigen(c.seg_v);
        cpu::as_eigen(c.y) = detail::segment_attention<T>(
            cfg, *p, cpu::as_eigen(c.u), cpu::as_eigen(c.h), cpu::as_eigen(c.prefix.k),
            cpu::as_eigen(c.prefix.v), sk, sv, c.batch, c.segment, c.offset, c.position);
    }

    /// The reverse of segment (attention/segment_backward.hpp) on checked views.
    static void segment_backward(const AttentionConfig& cfg, const Prepared& p,
                                 const SegmentBackwardCall<T>& c) {
        const Eigen::Index d = cfg.d_model, D = cfg.inner_dim();
        const Matrix<T> none;
        const auto or_none = [&](View<const T> v) {
            return v.empty() ? MatrixRef<T>(none) : MatrixRef<T>(cpu::as_eigen(v));
        };
        const detail::SegmentBackwardOperands<T> a{
            cpu::as_eigen(c.u),        cpu::as_eigen(c.h),        cpu::as_eigen(c.dy),
            or_none(c.kept_k),         or_none(c.kept_v),         or_none(c.after_k),
            or_none(c.after_v),        cpu::as_eigen(c.prefix.k), cpu::as_eigen(c.prefix.v),
            or_none(c.persistent),     c.batch,                   c.segment,
            c.offset,                  c.position};
        T* g = c.grads.data;
        const auto part = [&](int k, Eigen::Index r, Eigen::Index cols) {
            return cpu::as_eigen(View<T>{g + k * d * D, r, cols, cols});
        };
        SegmentGradientSink<cpu::MutableMap<T>> sink{part(0, d, D), part(1, d, D), part(2, d, D),
                                                     part(3, D, d),
                                                     cpu::as_eigen(c.dpersistent)};
        Matrix<T> du, dh, dkept_k, dkept_v;
        detail::segment_attention_backward<T>(cfg, *p, a, du, dh, dkept_k, dkept_v, sink);
        cpu::as_eigen(c.du) = du;
        cpu::as_eigen(c.dh) = dh;
        if (!c.dkept_k.empty()) {
            cpu::as_eigen(c.dkept_k) = dkept_k;
            cpu::as_eigen(c.dkept_v) = dkept_v;
        }
    }

    static bool begin(State& state) {
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
    static void commit(State& state) { state.undo_.open = false; }
    static void rollback(State& state) {
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
    /// The attention proper on projected q, k, v (and the prefix's p rows per sequence), then
    /// the new histories and W_O; NonFiniteError if the output is not finite.
    static void attend(const AttentionConfig& cfg, const AttentionParams<T>& params, State& state,
                       const Mat& q, const Mat& k, const Mat& v, const PrefixView<T>* prefix,
                       cpu::MutableMap<T> y) {
        const int B = state.batch_, H = cfg.n_heads, dh = cfg.head_dim();
        const Index N = q.rows() / B;
        const Mat none(0, cfg.inner_dim());
        const auto kp = cpu::as_eigen(prefix != nullptr ? prefix->k : view_of(none));
        const auto vp = cpu::as_eigen(prefix != nullptr ? prefix->v : view_of(none));
        const bool shared = prefix == nullptr || prefix->sharing == PrefixSharing::Shared;
        const Index p = shared ? kp.rows() : kp.rows() / B;
        // Per sequence: keys/values = [kept (h rows) ; this piece (N rows)], read in place from
        // the window buffer; queries at positions h .. h + N - 1 of them.
        const Index h = state.rows_;
        reserve_window(state, N);
        const Index off = state.off_;
        Mat o(q.rows(), cfg.inner_dim());
        for (int b = 0; b < B; ++b) {
            auto& kb = state.k_hist_[static_cast<std::size_t>(b)];
            auto& vb = state.v_hist_[static_cast<std::size_t>(b)];
            kb.middleRows(off + h, N) = k.middleRows(b * N, N);
            vb.middleRows(off + h, N) = v.middleRows(b * N, N);
            const Index pr0 = shared ? 0 : b * p;
            detail::prefix_window_attention_impl<T>(
                q.middleRows(b * N, N), kp.middleRows(pr0, p), vp.middleRows(pr0, p),
                kb.middleRows(off, h + N), vb.middleRows(off, h + N), H, dh, cfg.window, h,
                o.middleRows(b * N, N));
        }
        const Index keep = std::min<Index>(static_cast<Index>(cfg.window) - 1, h + N);
        state.off_ = off + h + N - keep;
        state.rows_ = keep;
        detail::multiply(y, o, params.w_o);
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
    static void reserve_window(State& state, Index N) {
        const Index h = state.rows_, cap = state.k_hist_[0].rows();
        if (state.off_ + h + N <= cap) {
            return;  // appending writes past the kept rows: a rollback still finds them
        }
        const Index rows = h + N + std::max<Index>(state.cfg_.window - 1, 1);
        auto& u = state.undo_;
        const bool save = u.open && !u.saved;
        if (save) {
            u.k.resize(state.k_hist_.size());
            u.v.resize(state.v_hist_.size());
        }
        for (std::size_t b = 0; b < state.k_hist_.size(); ++b) {
            for (auto [buf, old] : {std::pair{&state.k_hist_[b], save ? &u.k[b] : nullptr},
                                    std::pair{&state.v_hist_[b], save ? &u.v[b] : nullptr}}) {
                Mat fresh(rows, buf->cols());
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
};

}  // namespace titans::backend
