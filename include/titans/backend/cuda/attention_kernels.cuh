#pragma once
// titans/backend/cuda/attention_kernels.cuh: the attention layer on CUDA (math §6-7), float
// and double: AttentionKernels<Cuda, T>.
//
// One forward call over B sequences of N tokens:
//   1. one GEMM x [W_Q | W_K | W_V] over every token of every sequence;
//   2-3. the new keys and values appended after each sequence's kept window rows, in one
//      launch with RoPE on q and k (the angles in double, rope_frequency of
//      attention/rope.hpp; a thread rotates a pair of q and of k, then appends it);
//   4. the attention in tiles (attention_tiled.cuh: a block per query tile and head, the keys
//      and values through shared memory, an online softmax), or, where a tile does not fit
//      (d_h in the hundreds) or tiles are switched off, a thread per (row, head) running
//      attention_row; either sees the prefix and the window only, never an N x N matrix.
// Steps 2-4 are the functors of attention/attention_row.hpp (RopeThen of RopeQK and
// AppendWindow, AttendRows), which the CPU tests run in a loop against the CPU layer. Where the
// scalar tiles run with one query tile per (sequence, head) (a decoded token), their kernel
// does steps 2-4 in one launch (TiledAttentionArgs::k_win: the same values); with
// set_split_decode on and one query a sequence (d_h up to 256, tiles or not),
// decode_split_kernel does, the keys split across blocks (attention_decode.cuh);
//   5. one GEMM with W_O; a kernel finds the first non-finite output row (exact sequence and
//      position in the NonFiniteError, read with the call's one synchronisation).

#include <algorithm>
#include <climits>
#include <cmath>
#include <memory>
#include <utility>

#include "../../detail/flat_tensors.hpp"
#include "../../attention/attention_row.hpp"
#include "../../attention/config.hpp"
#include "../../attention/params.hpp"
#include "../../attention/rope.hpp"
#include "../../attention/segment.hpp"
#include "../../attention/segment_backward.hpp"
#include "../../error.hpp"
#include "../backend.hpp"
#include "attention_rope.cuh"
#include "attention_segment_backward.cuh"
#include "attention_decode.cuh"
#include "attention_state.cuh"
#include "attention_tiled.cuh"
#include "attention_warp_tiles.cuh"
#include "blas.cuh"
#include "call_scope.cuh"
#include "launch.cuh"
#include "layer_kernels.cuh"
#include "transfer.cuh"
#include "../../attention/kernels_decl.hpp"

namespace titans::backend {

struct Cuda;

template <class T>
struct AttentionKernels<Cuda, T> {
    using State = CudaAttentionState<T>;
    using Prefix = CudaAttentionPrefix<T>;
    using Buf = cuda::DeviceBuffer<T>;
    /// The context a state's call runs on (call_scope.cuh): its own, or the open CallScope's.
    static const cuda::StreamContext& ctx(const State& st) { return cuda::call_context(*st.ctx_); }
    /// The parameters on the device: [W_Q | W_K | W_V] (d x 3D) and W_O (D x d), row-major.
    struct Params {
        Buf w_qkv, w_o;
        int d = 0, D = 0;
    };
    using Prepared = std::shared_ptr<const Params>;

    static Prepared prepare(const AttentionConfig& cfg,
                            const std::shared_ptr<const AttentionParams<T>>& hp) {
        auto p = std::make_shared<Params>();
        p->d = cfg.d_model;
        p->D = cfg.inner_dim();
        Matrix<T> qkv(p->d, 3 * p->D);
        qkv << hp->w_q, hp->w_k, hp->w_v;
        p->w_qkv = cuda::upload_array(qkv.data(), static_cast<std::size_t>(qkv.size()));
        p->w_o = cuda::upload_array(hp->w_o.data(), static_cast<std::size_t>(hp->w_o.size()));
        return p;
    }
    /// The parameters from their flat form in device memory (AttentionParams::tensors order:
    /// W_Q, W_K, W_V, W_O), laid out on the device.
    static Prepared prepare_flat(const AttentionConfig& cfg, const AttentionParams<T>& shapes,
                                 View<const T> flat) {
        const auto v = detail::flat_views(flat, shapes, cfg);
        auto p = std::make_shared<Params>();
        p->d = cfg.d_model;
        p->D = cfg.inner_dim();
        p->w_qkv = cuda::concat_columns({v[0], v[1], v[2]});
        p->w_o = cuda::concat_columns({v[3]});
        return p;
    }

    static State make_state(const AttentionConfig& cfg, int batch) {
        State s;
        s.cfg_ = cfg;
        s.batch_ = batch;
        s.ctx_.emplace();
        return s;
    }

    /// P W_K and P W_V of checked prefix rows (device), on this thread's stream.
    static Prefix project_prefix(const AttentionConfig& cfg, const Prepared& p,
                                 View<const T> rows, PrefixSharing sharing) {
        Prefix out;
        out.sharing = sharing;
        out.n_rows = rows.rows;
        out.width = cfg.inner_dim();
        const auto n = static_cast<std::size_t>(rows.rows * out.width);
        out.k = Buf(n);
        out.v = Buf(n);
        if (n > 0) {
            const cuda::StreamContext& cx = cuda::thread_context();
            const int D = p->D, m = static_cast<int>(rows.rows);
            const cuda::Operand<T> a{rows.data, static_cast<int>(rows.stride)};
            cuda::gemm<T>(cx.blas(), false, false, m, D, p->d, T(1), a,
                          {p->w_qkv.data() + D, 3 * D}, T(0), out.k.data(), D, 0, 1);
            cuda::gemm<T>(cx.blas(), false, false, m, D, p->d, T(1), a,
                          {p->w_qkv.data() + 2 * D, 3 * D}, T(0), out.v.data(), D, 0, 1);
            cx.synchronize();
        }
        return out;
    }

    /// Checked inputs: x ((B*N) x d, device) through steps 1-5 into y (sized), inside a
    /// transaction (the state is unchanged if it throws). prefix may be null.
    static void forward(const AttentionConfig& cfg, const Prepared& p, State& st,
                        View<const T> x, View<T> y, const PrefixView<T>* prefix) {
        const long long N = x.rows / st.batch_;
        if (N == 0) {
            return;
        }
        const bool own = begin(st);
        try {
            run(cfg, *p, st, x, y, prefix, N);
        } catch (...) {
            rollback(st);
            throw;
        }
        if (own) {
            commit(st);
        }
    }

    /// MAC's segment attention on checked device views (attention/segment.hpp), on this
    /// thread's stream: one GEMM u [W_Q | W_K | W_V], one h [W_K | W_V], RoPE on q and k, the
    /// keys and values interleaved into the segment buffers (SegmentAppend), the attention over
    /// the prefix and the segment so far in tiles with queries at stride 2 (attend_tiled), or a
    /// thread per (row, head) (SegmentRows) where no tile applies, one GEMM with W_O.
    static void segment(const AttentionConfig& cfg, const Prepared& p, const SegmentCall<T>& c) {
        const long long rows = static_cast<long long>(c.batch) * c.rows, D = p->D;
        if (rows == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        const cudaStream_t sm = cx.stream();
        auto part = [&](long long width) {  // the call's temporaries (call_scope.cuh)
            return cuda::call_buffer<T>(static_cast<std::size_t>(rows * width));
        };
        Buf qkv = part(3 * D), kvh = part(2 * D), att = part(D);
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(rows), static_cast<int>(3 * D),
                      p->d, T(1), {c.u.data, static_cast<int>(c.u.stride)},
                      {p->w_qkv.data(), static_cast<int>(3 * D)}, T(0), qkv.data(),
                      static_cast<int>(3 * D), 0, 1);
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(rows), static_cast<int>(2 * D),
                      p->d, T(1), {c.h.data, static_cast<int>(c.h.stride)},
                      {p->w_qkv.data() + D, static_cast<int>(3 * D)}, T(0), kvh.data(),
                      static_cast<int>(2 * D), 0, 1);
        const long long C2 = 2LL * c.segment, stride = c.seg_k.stride;
        cuda::rope_then(cfg, sm, qkv.data(), rows, c.rows, c.position,
                        detail::SegmentAppend<T>{qkv.data(), kvh.data(), c.seg_k.data,
                                                 c.seg_v.data, stride, C2, c.rows, c.offset, D});
        const bool has_p = c.prefix.rows() > 0;  // without one its pointers are never read
        const T* kp = has_p ? c.prefix.k.data : qkv.data();
        const T* vp = has_p ? c.prefix.v.data : qkv.data();
        const T scale = T(1) / std::sqrt(static_cast<T>(cfg.head_dim()));
        // In tiles: query t at interleaved row 2(o + t) + 1 (stride 2), seeing the shared
        // prefix and every buffer row up to its own (a window of the whole buffer).
        const cuda::TiledAttentionArgs<T> a{
            qkv.data(), 3 * D, kp, vp, c.prefix.rows(), c.prefix.k.stride, c.prefix.v.stride,
            true, c.seg_k.data, c.seg_v.data, C2, stride, c.rows, 2LL * c.offset + 1, 2,
            cfg.n_heads, cfg.head_dim(), static_cast<int>(C2), scale, att.data(), D};
        if (attend_tiled(sm, a, c.batch, cx.tf32()) == Tiles::None) {
            cuda::each(sm, rows * cfg.n_heads,
                       detail::SegmentRows<T>{qkv.data(), kp, vp, c.prefix.rows(),
                                              c.prefix.k.stride, c.prefix.v.stride, c.seg_k.data,
                                              c.seg_v.data, stride, C2, c.rows, c.offset, D,
                                              cfg.n_heads, cfg.head_dim(), scale, att.data()});
        }
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(rows), p->d, static_cast<int>(D),
                      T(1), {att.data(), static_cast<int>(D)}, {p->w_o.data(), p->d}, T(0),
                      c.y.data, static_cast<int>(c.y.stride), 0, 1);
        cuda::idle(cx);  // (the workspaces are freed stream-ordered after it)
    }

    /// The reverse of segment on checked device views (attention_segment_backward.cuh), on
    /// this thread's stream.
    static void segment_backward(const AttentionConfig& cfg, const Prepared& p,
                                 const SegmentBackwardCall<T>& c) {
        cuda::SegmentBackward<T>::run(cfg, p->w_qkv.data(), p->w_o.data(), p->d, c);
    }

    static bool begin(State& st) {
        auto& u = st.undo_;
        if (u.open) {
            return false;
        }
        u.open = true;
        u.saved = false;
        u.position = st.position_;
        u.off = st.off_;
        u.rows = st.rows_;
        u.cap = st.cap_;
        return true;
    }
    static void commit(State& st) {
        auto& u = st.undo_;
        u.open = false;
        // the window before a move: not needed past the transaction, the next move's buffers
        keep_spares(st, u.k, u.v);
    }
    /// Old window buffers k, v (emptied) kept for the next move, whose new buffers have the
    /// same size once the calls' length is steady: a decode stream allocates none.
    static void keep_spares(State& st, Buf& k, Buf& v) {
        auto& w = *st.work_;
        if (k.size() > 0) {
            w.spare_k.swap(k);
            w.spare_v.swap(v);
        }
        Buf().swap(k);
        Buf().swap(v);
    }
    /// A buffer of n entries: the spare if it has that size (moved out), else a new one.
    static Buf take_spare(Buf& spare, std::size_t n) {
        if (spare.size() == n) {
            return std::move(spare);
        }
        return Buf(n);
    }
    static void rollback(State& st) {
        auto& u = st.undo_;
        if (!u.open) {
            return;
        }
        if (u.saved) {
            st.k_.swap(u.k);
            st.v_.swap(u.v);
            st.cap_ = u.cap;
        }
        st.position_ = u.position;
        st.off_ = u.off;
        st.rows_ = u.rows;
        u.open = false;
    }

    // Internal (public only because nvcc's device lambdas cannot sit in private members).
    static void run(const AttentionConfig& cfg, const Params& p, State& st, View<const T> x,
                    View<T> y, const PrefixView<T>* prefix, long long N) {
        const cuda::StreamContext& cx = ctx(st);
        const long long rows = x.rows, D = p.D;
        auto& w = *st.work_;
        w.qkv.reserve(static_cast<std::size_t>(rows * 3 * D));
        w.o.reserve(static_cast<std::size_t>(rows * D));
        w.flag.reserve(1);
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(rows), static_cast<int>(3 * D),
                      p.d, T(1), {x.data, static_cast<int>(x.stride)},
                      {p.w_qkv.data(), static_cast<int>(3 * D)}, T(0), w.qkv.data(),
                      static_cast<int>(3 * D), 0, 1);
        reserve_window(st, N);
        const auto f = attend_rows_of(cfg, st, w.qkv.data(), w.o.data(), prefix, N);
        if (!attend_appending(cfg, cx.stream(), st, f)) {
            cuda::rope_then(cfg, cx.stream(), w.qkv.data(), rows, N, st.position_,
                            detail::AppendWindow<T>{w.qkv.data(), st.k_.data(), st.v_.data(), N,
                                                    D, st.cap_, st.off_ + st.rows_});
            attend_rows(cx.stream(), f, st.batch_, cx.tf32());
        }
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(rows), p.d, static_cast<int>(D),
                      T(1), {w.o.data(), static_cast<int>(D)}, {p.w_o.data(), p.d}, T(0), y.data,
                      static_cast<int>(y.stride), 0, 1);
        const long long bad = cuda::output_covered()  // a later check of the call covers y
                                  ? -1
                                  : cuda::checked_row<T>(cx.stream(), y, w.flag.data());
        if (bad >= 0) {
            throw NonFiniteError(detail::concat(
                "Attention::forward: the output is not finite at sequence ", bad / N,
                ", position ", st.position_ + bad % N,
                " (the projections overflow), expected finite values; the state is unchanged"));
        }
        const long long keep = std::min<long long>(cfg.window - 1, st.rows_ + N);
        st.off_ += st.rows_ + N - keep;
        st.rows_ = keep;
        st.position_ += N;
    }

    /// Room for N more rows after the kept ones in every window buffer: when the buffers' end
    /// is near, the kept rows move to the start of buffers of rows + N + w - 1 rows (inside an
    /// open transaction the old buffers are first swapped out, untouched, for rollback).
    static void reserve_window(State& st, long long N) {
        const long long h = st.rows_, D = st.cfg_.inner_dim(), B = st.batch_;
        if (st.off_ + h + N <= st.cap_) {
            return;
        }
        const long long cap = h + N + std::max<long long>(st.cfg_.window - 1, 1);
        // Both new buffers filled before the state changes (an allocation or copy may throw);
        // the spares of the last move where they fit (ordered on the state's stream after
        // the reads of the calls that used them).
        const auto n = static_cast<std::size_t>(B * cap * D);
        auto& w = *st.work_;
        Buf k = take_spare(w.spare_k, n), v = take_spare(w.spare_v, n);
        if (h > 0) {
            move_rows(ctx(st).stream(), k.data(), st.k_.data() + st.off_ * D, B, h * D, cap * D,
                      st.cap_ * D);
            move_rows(ctx(st).stream(), v.data(), st.v_.data() + st.off_ * D, B, h * D, cap * D,
                      st.cap_ * D);
            cuda::idle(ctx(st));  // (the old buffers are freed stream-ordered after it)
        }
        auto& u = st.undo_;
        if (u.open && !u.saved) {
            u.k.swap(st.k_);
            u.v.swap(st.v_);
            u.saved = true;
        }
        st.k_.swap(k);
        st.v_.swap(v);
        st.cap_ = cap;
        st.off_ = 0;
        keep_spares(st, k, v);  // outside a transaction: the old buffers, now in k and v
    }

    /// B runs of n entries, src + b * ss to dst + b * ds (separate buffers). A kernel, not
    /// cudaMemcpy2D: a long window's pitch may pass the device's largest copy pitch.
    static void move_rows(cudaStream_t sm, T* dst, const T* src, long long B, long long n,
                          long long ds, long long ss) {
        cuda::each(sm, B * n, [=] __device__(unsigned i) {
            const long long b = i / cuda::u32(n), j = i % cuda::u32(n);
            dst[b * ds + j] = src[b * ss + j];
        });
    }

    /// The attention of every (row, head) of the call into o (rows x D), over the state's
    /// window (its kept rows, then the piece's) and the prefix, as attend_rows runs it.
    static detail::AttendRows<T> attend_rows_of(const AttentionConfig& cfg, const State& st,
                                                const T* qkv, T* o, const PrefixView<T>* prefix,
                                                long long N) {
        const long long D = cfg.inner_dim();
        const bool has_p = prefix != nullptr && prefix->rows() > 0;
        const bool shared = !has_p || prefix->sharing == PrefixSharing::Shared;
        const long long p = !has_p ? 0 : shared ? prefix->rows() : prefix->rows() / st.batch_;
        // Without a prefix the prefix pointers are never read: qkv keeps them non-null.
        return detail::AttendRows<T>{qkv,
                                     has_p ? prefix->k.data : qkv,
                                     has_p ? prefix->v.data : qkv,
                                     p,
                                     has_p ? prefix->k.stride : 0,
                                     has_p ? prefix->v.stride : 0,
                                     shared,
                                     st.k_.data() + st.off_ * D,
                                     st.v_.data() + st.off_ * D,
                                     st.cap_,
                                     st.rows_,
                                     N,
                                     D,
                                     cfg.n_heads,
                                     cfg.head_dim(),
                                     cfg.window,
                                     T(1) / std::sqrt(static_cast<T>(cfg.head_dim())),
                                     o};
    }

    /// f's attention in a kernel that appends the piece's keys and values itself (and rotates
    /// q and k: TiledAttentionArgs::k_win): the split-keys decode where it applies (switched
    /// on, one query a sequence, d_h up to 256), else the scalar tiles where tiles_for picks
    /// them with one query tile per (sequence, head): a decode call's one launch for steps
    /// 2-4. False, nothing run, elsewhere.
    static bool attend_appending(const AttentionConfig& cfg, cudaStream_t sm, State& st,
                                 const detail::AttendRows<T>& f) {
        const bool split = cuda::decode_split_applies(st.batch_, f.N, 1, f.H, f.d_head, cfg.rope);
        const TilePlan plan = tiles_for(st.batch_, f.N, f.H, f.d_head);
        if (!split && (plan.kind != Tiles::Scalar || f.N > plan.shape.tq)) {
            return false;
        }
        cuda::TiledAttentionArgs<T> a = tiled_args(f);
        a.k_win = st.k_.data() + st.off_ * f.D;
        a.v_win = st.v_.data() + st.off_ * f.D;
        a.kv_offset = f.D;
        a.rope = cfg.rope;
        a.rope_base = cfg.rope_base;
        a.rope_pos0 = st.position_;
        if (split) {
            cuda::decode_split(sm, a, st.batch_);  // (attention_decode.cuh: opt-in)
        } else {
            cuda::tiled_attention(sm, a, st.batch_, plan.shape);
        }
        return true;
    }

    /// o = what f (AttendRows) computes for B sequences: in tiles (attend_tiled) where they
    /// apply, else a thread per (row, head). stat_m, stat_inv (B N H entries each, or nullptr):
    /// where the warp tiles leave each row's softmax statistics for the backward
    /// (TiledAttentionArgs); true when they did.
    static bool attend_rows(cudaStream_t sm, const detail::AttendRows<T>& f, long long B,
                            bool tf32, T* stat_m = nullptr, T* stat_inv = nullptr) {
        cuda::TiledAttentionArgs<T> a = tiled_args(f);
        a.stat_m = stat_m;
        a.stat_inv = stat_inv;
        const Tiles ran = attend_tiled(sm, a, B, tf32);
        if (ran == Tiles::None) {
            cuda::each(sm, B * f.N * f.H, f);
        }
        return ran == Tiles::Warp && stat_m != nullptr;
    }

    /// f's operands for the tiled kernels (queries at stride 1).
    static cuda::TiledAttentionArgs<T> tiled_args(const detail::AttendRows<T>& f) {
        return {f.qkv, 3 * f.D, f.k_prefix, f.v_prefix, f.p, f.k_prefix_stride,
                f.v_prefix_stride, f.shared, f.k_win, f.v_win, f.cap, f.D, f.N, f.kept, 1, f.H,
                f.d_head, f.window, f.scale, f.o, f.D};
    }

    /// Which tiles attend_tiled runs.
    enum class Tiles { None, Scalar, Warp };

    /// Where attend_tiled runs B sequences of N queries over H heads d_h wide, and the scalar
    /// tiles' shape (cuda::tiled_attention() says how: TiledAttentionMode).
    struct TilePlan {
        Tiles kind = Tiles::None;
        cuda::TiledShape shape;
    };
    static TilePlan tiles_for(long long B, long long N, int H, int dh) {
        const cuda::TiledAttentionMode mode = cuda::tiled_attention();
        if (mode == cuda::TiledAttentionMode::Auto &&
            cuda::warp_tiles_fit(B, N, H, dh, sizeof(T))) {
            return {Tiles::Warp, {}};
        }
        const cuda::TiledShape shape = mode == cuda::TiledAttentionMode::Off
                                           ? cuda::TiledShape{}
                                           : cuda::tiled_shape(dh, N, sizeof(T));
        return {cuda::tiled_grid_fits(B, N, H, shape) ? Tiles::Scalar : Tiles::None, shape};
    }

    /// a's attention for B sequences the way cuda::tiled_attention() says
    /// (TiledAttentionMode): in warp tiles (on the tensor cores in float when tf32; they write
    /// a.stat_m, a.stat_inv where set) where they apply, else in scalar tiles where one fits;
    /// Tiles::None, nothing run, otherwise.
    static Tiles attend_tiled(cudaStream_t sm, const cuda::TiledAttentionArgs<T>& a,
                              long long B, bool tf32) {
        const TilePlan plan = tiles_for(B, a.N, a.H, a.d_head);
        if (plan.kind == Tiles::Warp) {
            cuda::warp_tiled_attention(sm, a, B, tf32);
        } else if (plan.kind == Tiles::Scalar) {
            cuda::tiled_attention(sm, a, B, plan.shape);
        }
        return plan.kind;
    }

};

}  // namespace titans::backend
