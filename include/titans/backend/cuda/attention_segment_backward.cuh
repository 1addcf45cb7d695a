#pragma once
// titans/backend/cuda/attention_segment_backward.cuh: the reverse of MAC's segment attention
// on CUDA (attention/segment_backward.hpp gives the math and the host form), what
// AttentionKernels<Cuda, T>::segment_backward runs on this thread's stream:
//   1. the forward recomputed: u [W_Q | W_K | W_V] and h [W_K | W_V] (two GEMMs), RoPE, each
//      stream's buffer of n = 2(o+m) rows (the kept rows copied, SegmentAppend), the heads'
//      outputs (SegmentRows);
//   2. g_O += att^T dy straight into the flat gradient, datt = dy W_O^T;
//   3. the softmax reversed with the query stride 2 (query i at buffer row 2(o+i)+1): in tiles
//      (attention_tiled_backward.cuh) when they fit and are on, else a thread per (row, head),
//      per (buffer row, head) and per (prefix row, head) (attention_row_backward.hpp);
//   4. the later adjoint added, the kept rows' adjoint copied out, the part's rows taken apart
//      (SegmentGather), RoPE transposed;
//   5. g_QKV += u^T [dq | dk | dv] + h^T [dk_h | dv_h] (+ P^T [dk_P | dv_P]), du, dh and dP by
//      GEMMs with the weights.
// Deterministic (no atomics); nothing crosses to the host.

#include <cmath>
#include <cstddef>

#include "../../attention/attention_row.hpp"
#include "../../attention/attention_row_backward.hpp"
#include "../../attention/config.hpp"
#include "../../attention/segment_backward.hpp"
#include "attention_rope.cuh"
#include "attention_tiled.cuh"
#include "attention_tiled_backward.cuh"
#include "attention_warp_tiles_backward.cuh"
#include "blas.cuh"
#include "call_scope.cuh"
#include "launch.cuh"

namespace titans::backend::cuda {

/// The stages of segment_backward (public: nvcc's extended lambdas may not sit in private
/// members). w_qkv: [W_Q | W_K | W_V] (d x 3D), w_o: D x d, on the device.
template <class T>
struct SegmentBackward {
    using Buf = DeviceBuffer<T>;

    /// What the stages share: the sizes and the device workspaces.
    struct Pass {
        Pass(const AttentionConfig& cfg, const T* wqkv, const T* wo, int width,
             const SegmentBackwardCall<T>& call)
            : c(call), w_qkv(wqkv), w_o(wo), B(call.batch), m(call.rows), o(call.offset),
              n(2 * (o + m)), rows(B * m), d(width), D(cfg.inner_dim()), H(cfg.n_heads),
              dh(cfg.head_dim()), np(call.prefix.rows()),
              scale(T(1) / std::sqrt(static_cast<T>(cfg.head_dim()))) {}
        const SegmentBackwardCall<T>& c;
        const T *w_qkv, *w_o;
        long long B, m, o, n, rows, d, D, H, dh, np;
        T scale;
        Buf qkv, kvh, kw, vw, att, datt, stats, dqkv, dkw, dvw, dkvh, dkvp, gqkv;
    };

    static void run(const AttentionConfig& cfg, const T* w_qkv, const T* w_o, int d,
                    const SegmentBackwardCall<T>& c) {
        const long long rows = static_cast<long long>(c.batch) * c.rows;
        if (rows == 0) {
            return;
        }
        Pass ps(cfg, w_qkv, w_o, d, c);
        recompute(cfg, ps);
        output_backward(ps);
        attend_backward(ps);
        rows_backward(cfg, ps);
        projections_backward(ps);
        idle(thread_context());  // (the workspaces are freed stream-ordered after it)
    }

    static Buf buffer(long long n) { return Buf(static_cast<std::size_t>(n)); }

    /// Stage 1: qkv (RoPE applied), kvh, the buffers kw, vw (B x n x D) and att (rows x D).
    static void recompute(const AttentionConfig& cfg, Pass& ps) {
        const StreamContext& cx = thread_context();
        const cudaStream_t sm = cx.stream();
        const SegmentBackwardCall<T>& c = ps.c;
        const long long D = ps.D, rows = ps.rows;
        ps.qkv = buffer(rows * 3 * D);
        ps.kvh = buffer(rows * 2 * D);
        gemm<T>(cx.blas(), false, false, int(rows), int(3 * D), int(ps.d), T(1),
                {c.u.data, int(c.u.stride)}, {ps.w_qkv, int(3 * D)}, T(0), ps.qkv.data(),
                int(3 * D), 0, 1);
        gemm<T>(cx.blas(), false, false, int(rows), int(2 * D), int(ps.d), T(1),
                {c.h.data, int(c.h.stride)}, {ps.w_qkv + D, int(3 * D)}, T(0), ps.kvh.data(),
                int(2 * D), 0, 1);
        ps.kw = buffer(ps.B * ps.n * D);
        ps.vw = buffer(ps.B * ps.n * D);
        if (ps.o > 0) {
            copy_blocks(sm, c.kept_k.data, c.kept_k.stride, 2 * ps.o, ps.kw.data(), D, ps.n, ps.B,
                        D);
            copy_blocks(sm, c.kept_v.data, c.kept_v.stride, 2 * ps.o, ps.vw.data(), D, ps.n, ps.B,
                        D);
        }
        rope_then(cfg, sm, ps.qkv.data(), rows, ps.m, c.position,
                  detail::SegmentAppend<T>{ps.qkv.data(), ps.kvh.data(), ps.kw.data(),
                                           ps.vw.data(), D, ps.n, ps.m, ps.o, D});
        ps.att = buffer(rows * D);
        const T* kp = ps.np > 0 ? c.prefix.k.data : ps.qkv.data();  // unread without a prefix
        const T* vp = ps.np > 0 ? c.prefix.v.data : ps.qkv.data();
        each(sm, rows * ps.H,
             detail::SegmentRows<T>{ps.qkv.data(), kp, vp, ps.np, c.prefix.k.stride,
                                    c.prefix.v.stride, ps.kw.data(), ps.vw.data(), D, ps.n, ps.m,
                                    ps.o, D, int(ps.H), int(ps.dh), ps.scale, ps.att.data()});
    }

    /// B blocks of `count` rows (width cols): from + b * count rows (row stride ld_from) to
    /// to + b * per rows (row stride ld_to).
    static void copy_blocks(cudaStream_t sm, const T* from, long long ld_from, long long count,
                            T* to, long long ld_to, long long per, long long B, long long cols) {
        each(sm, B * count * cols, [=] __device__(unsigned i) {
            const long long r = i / u32(cols), col = i % u32(cols);
            const long long b = u32(r) / u32(count), j = u32(r) % u32(count);
            to[(b * per + j) * ld_to + col] = from[r * ld_from + col];
        });
    }

    /// Stage 2: g_O += att^T dy (the flat gradient's W_O block), datt = dy W_O^T.
    static void output_backward(Pass& ps) {
        const StreamContext& cx = thread_context();
        const SegmentBackwardCall<T>& c = ps.c;
        const int D = int(ps.D), d = int(ps.d), rows = int(ps.rows);
        gemm<T>(cx.blas(), true, false, D, d, rows, T(1), {ps.att.data(), D},
                {c.dy.data, int(c.dy.stride)}, T(1), c.grads.data + 3 * ps.d * ps.D, d, 0, 1);
        ps.datt = buffer(ps.rows * ps.D);
        gemm<T>(cx.blas(), false, true, rows, D, d, T(1), {c.dy.data, int(c.dy.stride)},
                {ps.w_o, d}, T(0), ps.datt.data(), D, 0, 1);
    }

    /// Stage 3: dq (into dqkv's q columns), the buffer rows' dk, dv (dkw, dvw) and the prefix
    /// rows' (dkvp: N_p x [dk | dv]).
    static void attend_backward(Pass& ps) {
        const cudaStream_t sm = thread_context().stream();
        const long long rows = ps.rows, D = ps.D, H = ps.H;
        const SegmentBackwardCall<T>& c = ps.c;
        ps.stats = buffer(3 * rows * H);
        ps.dqkv = buffer(rows * 3 * D);
        ps.dkw = buffer(ps.B * ps.n * D);
        ps.dvw = buffer(ps.B * ps.n * D);
        ps.dkvp = buffer(ps.np * 2 * D);
        const T* kp = ps.np > 0 ? c.prefix.k.data : ps.qkv.data();
        const T* vp = ps.np > 0 ? c.prefix.v.data : ps.qkv.data();
        T* mx = ps.stats.data();
        const long long kept = 2 * ps.o + 1, window = 2LL * c.segment;
        if (tiled(ps, kp, vp, kept, window)) {
            return;
        }
        const detail::AttentionBackwardOperands<T> a{
            ps.qkv.data(), kp, vp, ps.np, c.prefix.k.stride, c.prefix.v.stride, true,
            ps.kw.data(), ps.vw.data(), ps.n, kept, ps.m, D, int(H), int(ps.dh), int(window),
            ps.scale, ps.datt.data(), mx, mx + rows * H, mx + 2 * rows * H, 2};
        each(sm, rows * H, detail::QueryRowsBackward<T>{a, ps.dqkv.data(), 3 * D});
        each(sm, ps.B * ps.n * H, detail::KeyRowsBackward<T>{a, ps.dkw.data(), ps.dvw.data()});
        each(sm, ps.np * H, detail::PrefixRowsBackward<T>{a, ps.B, ps.dkvp.data(), 2 * D});
    }

    /// Stage 3 in tiles (tiled_backward_passes) when they are on and fit; false (nothing done)
    /// otherwise.
    static bool tiled(Pass& ps, const T* kp, const T* vp,
                      long long kept, long long window) {
        const StreamContext& cx = thread_context();
        const long long D = ps.D, rows = ps.rows, H = ps.H;
        const SegmentBackwardCall<T>& c = ps.c;
        T* mx = ps.stats.data();
        const TiledBackwardArgs<T> a{
            {ps.qkv.data(), 3 * D, kp, vp, ps.np, c.prefix.k.stride, c.prefix.v.stride, true,
             ps.kw.data(), ps.vw.data(), ps.n, D, ps.m, kept, 2, int(H), int(ps.dh), int(window),
             ps.scale, nullptr, 0},
            ps.datt.data(), D, ps.att.data(), D, mx, mx + rows * H, mx + 2 * rows * H};
        return tiled_backward_passes(cx.stream(), a, ps.B, ps.dqkv.data(), 3 * D,
                                     TiledKeyGrads<T>{ps.dkw.data(), ps.dvw.data(), D},
                                     TiledKeyGrads<T>{ps.dkvp.data(), ps.dkvp.data() + D, 2 * D},
                                     cx.tf32());
    }

    /// Stage 4: the later adjoint added, the kept rows' copied out, the part's rows taken
    /// apart into dqkv's k, v columns and dkvh, RoPE transposed.
    static void rows_backward(const AttentionConfig& cfg, Pass& ps) {
        const cudaStream_t sm = thread_context().stream();
        const SegmentBackwardCall<T>& c = ps.c;
        const long long D = ps.D, all = ps.B * ps.n;
        if (!c.after_k.empty()) {
            add_rows(sm, c.after_k.data, c.after_k.stride, ps.dkw.data(), all, D);
            add_rows(sm, c.after_v.data, c.after_v.stride, ps.dvw.data(), all, D);
        }
        if (!c.dkept_k.empty() && ps.o > 0) {
            copy_out(sm, ps.dkw.data(), ps, c.dkept_k);
            copy_out(sm, ps.dvw.data(), ps, c.dkept_v);
        }
        ps.dkvh = buffer(ps.rows * 2 * D);
        each(sm, ps.rows * D,
             detail::SegmentGather<T>{ps.dkw.data(), ps.dvw.data(), ps.dqkv.data(),
                                      ps.dkvh.data(), ps.n, ps.m, ps.o, D});
        if (cfg.rope) {
            each(sm, ps.rows * 2 * ps.H * (ps.dh / 2),
                 detail::RopeQKTranspose<T>{ps.dqkv.data(), ps.m, D, int(ps.H), int(ps.dh),
                                            c.position, cfg.rope_base});
        }
    }

    /// to (rows x cols, contiguous) += from (row stride ld).
    static void add_rows(cudaStream_t sm, const T* from, long long ld, T* to, long long rows,
                         long long cols) {
        each(sm, rows * cols, [=] __device__(unsigned i) {
            to[i] += from[(i / u32(cols)) * ld + i % u32(cols)];
        });
    }

    /// Rows [0, 2o) of each stream's buffer adjoint into `to` ((B*2o) x D).
    static void copy_out(cudaStream_t sm, const T* from, const Pass& ps, View<T> to) {
        const long long D = ps.D, count = 2 * ps.o, per = ps.n, ld = to.stride;
        T* const dst = to.data;
        each(sm, ps.B * count * D, [=] __device__(unsigned i) {
            const long long r = i / u32(D), col = i % u32(D);
            const long long b = u32(r) / u32(count), j = u32(r) % u32(count);
            dst[r * ld + col] = from[(b * per + j) * D + col];
        });
    }

    /// Stage 5: the projections' gradients added to the flat buffer, du, dh written and dP
    /// added to.
    static void projections_backward(Pass& ps) {
        const StreamContext& cx = thread_context();
        const SegmentBackwardCall<T>& c = ps.c;
        const int D = int(ps.D), d = int(ps.d), rows = int(ps.rows), np = int(ps.np);
        ps.gqkv = buffer(ps.d * 3 * ps.D);
        gemm<T>(cx.blas(), true, false, d, 3 * D, rows, T(1), {c.u.data, int(c.u.stride)},
                {ps.dqkv.data(), 3 * D}, T(0), ps.gqkv.data(), 3 * D, 0, 1);
        gemm<T>(cx.blas(), true, false, d, 2 * D, rows, T(1), {c.h.data, int(c.h.stride)},
                {ps.dkvh.data(), 2 * D}, T(1), ps.gqkv.data() + D, 3 * D, 0, 1);
        if (np > 0) {
            gemm<T>(cx.blas(), true, false, d, 2 * D, np, T(1),
                    {c.persistent.data, int(c.persistent.stride)}, {ps.dkvp.data(), 2 * D}, T(1),
                    ps.gqkv.data() + D, 3 * D, 0, 1);
            gemm<T>(cx.blas(), false, true, np, d, 2 * D, T(1), {ps.dkvp.data(), 2 * D},
                    {ps.w_qkv + D, 3 * D}, T(1), c.dpersistent.data, int(c.dpersistent.stride),
                    0, 1);
        }
        add_column_blocks(cx.stream(), ps.gqkv.data(), ps.d, 3, ps.D, 0, c.grads.data);
        gemm<T>(cx.blas(), false, true, rows, d, 3 * D, T(1), {ps.dqkv.data(), 3 * D},
                {ps.w_qkv, 3 * D}, T(0), c.du.data, int(c.du.stride), 0, 1);
        gemm<T>(cx.blas(), false, true, rows, d, 2 * D, T(1), {ps.dkvh.data(), 2 * D},
                {ps.w_qkv + D, 3 * D}, T(0), c.dh.data, int(c.dh.stride), 0, 1);
    }
};

}  // namespace titans::backend::cuda
