#pragma once
// titans/backend/cuda/attention_tiled_backward.cuh: the backward of tiled_attention (math §9;
// the flash-attention backward), float and double, deterministic (no atomics).
//
// With s = scale q . k, P = exp(s - m) / l (m the row maximum, l the row sum),
// dP = dout . v, delta = dout . o (= sum_j P_j dP_j) and dS = scale P (dP - delta):
//   dq = sum_j dS_j k_j,   dk_j = sum_q dS_j q,   dv_j = sum_q P_j dout.
// Two kinds of block, each owning what it writes:
//   query tiles  per (query tile, head, sequence): the tile's m and l recomputed over the keys
//                it sees (a pass over them), then dS per key tile and dq += dS K; writes dq
//                and each row's m, 1 / l and delta;
//   key tiles    per (key tile, head, sequence; a shared prefix: one for all): the query tiles
//                that see the keys, P and dS from those statistics, dv += P^T dout and
//                dk += dS^T q; writes dk and dv (0 for rows no query sees).

#include <cstddef>

#include "../../config.hpp"
#include "attention_tiled.cuh"
#include "launch.cuh"

namespace titans::backend::cuda {

/// The operands of the tiled backward: the forward's (f; f.o unused), dout and the forward's
/// output o (row r at + r * stride, head h's columns at + h d_h), and the statistics per (row
/// r, head h) at r H + h that the query pass writes and the key passes read.
template <class T>
struct TiledBackwardArgs {
    TiledAttentionArgs<T> f;
    const T* dout;
    long long dout_stride;
    const T* out;
    long long out_stride;
    T *mx, *inv, *delta;
    /// mx and inv already hold the forward's statistics (the warp-tiled forward's stat_m,
    /// stat_inv): the warp-tiled query pass reads them instead of recomputing them over every
    /// key tile (the scalar passes recompute them regardless).
    bool stats_ready = false;
};

/// Where a key pass writes: the dk and dv rows (row i at + i * stride, head columns at + h d_h).
template <class T>
struct TiledKeyGrads {
    T *dk, *dv;
    long long stride;
};

/// Entries of T a query-pass block takes: Q, dout and dq (TQ x (dh + 1)), K and V (TK x
/// (dh + 1)), the tile's scores (TQ x TK), the row maximum, sum and delta (TQ each).
TITANS_HOST_DEVICE long long tiled_query_entries(TiledShape s, int dh) {
    const long long ld = dh + 1;
    return 3LL * s.tq * ld + 2LL * s.tk * ld + static_cast<long long>(s.tq) * s.tk + 3LL * s.tq;
}

/// Entries of T a key-pass block takes: K, V, dk and dv (TK x (dh + 1)), Q and dout (TQ x
/// (dh + 1)), P and dS (TQ x TK), the rows' m, 1 / l and delta (TQ each).
TITANS_HOST_DEVICE long long tiled_key_entries(TiledShape s, int dh) {
    const long long ld = dh + 1;
    return 4LL * s.tk * ld + 2LL * s.tq * ld + 2LL * s.tq * s.tk + 3LL * s.tq;
}

/// The largest square tile of 64, 32, 16 or 8 whose query-pass and key-pass blocks both fit
/// tiled_shared_limit ({0, 0}: none; the per-row backward then runs).
inline TiledShape tiled_backward_shape(int dh, std::size_t entry_bytes) {
    for (int t = 64; t >= 8; t /= 2) {
        const TiledShape s{t, t};
        const auto most = static_cast<std::size_t>(
            tiled_key_entries(s, dh) > tiled_query_entries(s, dh) ? tiled_key_entries(s, dh)
                                                                  : tiled_query_entries(s, dh));
        if (most * entry_bytes <= tiled_shared_limit) {
            return s;
        }
    }
    return {};
}

/// Whether key position kp is seen by the query at position qp (prefix keys: kp < 0, always).
TITANS_HOST_DEVICE bool tiled_sees(long long kp, long long qp, int window) {
    return kp < 0 || (kp <= qp && kp > qp - window);
}

#if TITANS_CUDA_DEVICE_CODE

/// n rows of dh entries from src (row stride ss) into dst (row stride ld); the caller syncs.
template <class T>
__device__ void tiled_rows(T* dst, int ld, const T* src, long long ss, int n, int dh) {
    for (int i = threadIdx.x; i < n * dh; i += blockDim.x) {
        dst[(i / dh) * ld + i % dh] = src[(i / dh) * ss + i % dh];
    }
}

/// q . k over dh entries of two shared rows.
template <class T>
__device__ T tiled_dot(const T* a, const T* b, int dh) {
    T s = T(0);
    for (int e = 0; e < dh; ++e) {
        s += a[e] * b[e];
    }
    return s;
}

/// The key tiles query tile [t0, t0 + nq) of sequence b sees, in the forward's order (the
/// prefix's, then the window's span): fn(first row, prefix?, nk, key0), the row an index into
/// the prefix's rows or the sequence rows (b seq_rows + j), key0 -1 for prefix keys, else the
/// tile's first key position.
template <class T, class Fn>
__device__ void tiled_key_tiles(const TiledAttentionArgs<T>& a, TiledShape shape, long long b,
                                long long t0, int nq, Fn&& fn) {
    const long long pb = a.shared ? 0 : b * a.p;
    for (long long j0 = 0; j0 < a.p; j0 += shape.tk) {
        fn(pb + j0, true, static_cast<int>(a.p - j0 < shape.tk ? a.p - j0 : shape.tk), -1LL);
    }
    const long long first = a.pos0 + a.qstride * t0, last = first + a.qstride * (nq - 1);
    for (long long j0 = first - a.window + 1 > 0 ? first - a.window + 1 : 0; j0 <= last;
         j0 += shape.tk) {
        fn(b * a.seq_rows + j0, false,
           static_cast<int>(last + 1 - j0 < shape.tk ? last + 1 - j0 : shape.tk), j0);
    }
}

/// Pass 1 of the query pass on one key tile's scores s (nq x tk, -inf where unseen, nk
/// columns used): each row's running maximum mx and sum of exp(s - mx), updated online.
template <class T>
__device__ void tiled_online_stats(const T* s, int tk, int nq, int nk, T* mx, T* sum) {
    const T none = -static_cast<T>(INFINITY);
    for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        const T* row = s + r * tk;
        T m = mx[r];
        for (int c = 0; c < nk; ++c) {
            m = row[c] > m ? row[c] : m;
        }
        T l = m == mx[r] ? sum[r] : sum[r] * std::exp(mx[r] - m);
        for (int c = 0; c < nk; ++c) {
            l += row[c] == none ? T(0) : std::exp(row[c] - m);
        }
        mx[r] = m;
        sum[r] = l;
    }
}

/// Pass 2 of the query pass: a key tile's scores s (nq x tk) become their adjoints in place,
/// dS = scale P (dout . v - delta), P = exp(s - mx) inv (0 where unseen); g holds dout's rows
/// and v the tile's values (leading dimension ld, dh columns).
template <class T>
__device__ void tiled_score_adjoints(T* s, int tk, int nq, const T* g, const T* v, int ld,
                                     int dh, const T* mx, const T* inv, const T* delta,
                                     T scale) {
    const T none = -static_cast<T>(INFINITY);
    for (int i = threadIdx.x; i < nq * tk; i += blockDim.x) {
        const int r = i / tk, c = i % tk;
        T ds = T(0);
        if (s[i] != none) {
            const T p = std::exp(s[i] - mx[r]) * inv[r];
            ds = scale * p * (tiled_dot(g + r * ld, v + c * ld, dh) - delta[r]);
        }
        s[i] = ds;
    }
}

/// dq (nq x dh, leading dimension ld) += dS K over the key tile's nk columns (dS: nq x tk).
template <class T>
__device__ void tiled_add_dq(T* gq, const T* ds, int tk, const T* k, int ld, int nq, int nk,
                             int dh) {
    for (int i = threadIdx.x; i < nq * dh; i += blockDim.x) {
        const int r = i / dh, e = i % dh;
        T acc = gq[r * ld + e];
        for (int c = 0; c < nk; ++c) {
            acc += ds[r * tk + c] * k[c * ld + e];
        }
        gq[r * ld + e] = acc;
    }
}

/// The query pass: one query tile of one head of one sequence (blockIdx x, y, z).
template <class T>
__global__ void __launch_bounds__(tiled_threads)
    tiled_query_backward_kernel(TiledBackwardArgs<T> a, TiledShape shape, T* dq,
                                long long dq_stride) {
    const TiledAttentionArgs<T>& f = a.f;
    const long long b = blockIdx.z, t0 = static_cast<long long>(blockIdx.x) * shape.tq;
    const int h = static_cast<int>(blockIdx.y), dh = f.d_head, ld = dh + 1;
    const int nq = static_cast<int>(f.N - t0 < shape.tq ? f.N - t0 : shape.tq);
    const long long col = static_cast<long long>(h) * dh, r0 = b * f.N + t0;
    T* q = dynamic_shared<T>();
    T* g = q + shape.tq * ld;
    T* gq = g + shape.tq * ld;
    T* k = gq + shape.tq * ld;
    T* v = k + shape.tk * ld;
    T* s = v + shape.tk * ld;
    T* mx = s + shape.tq * shape.tk;
    T* sum = mx + shape.tq;
    T* delta = sum + shape.tq;
    tiled_rows(q, ld, f.q + r0 * f.q_stride + col, f.q_stride, nq, dh);
    tiled_rows(g, ld, a.dout + r0 * a.dout_stride + col, a.dout_stride, nq, dh);
    for (int i = threadIdx.x; i < nq * dh; i += blockDim.x) {
        gq[(i / dh) * ld + i % dh] = T(0);
    }
    for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        mx[r] = -static_cast<T>(INFINITY);
        sum[r] = T(0);
        delta[r] = tiled_dot(a.dout + (r0 + r) * a.dout_stride + col,
                             a.out + (r0 + r) * a.out_stride + col, dh);
    }
    __syncthreads();
    const T none = -static_cast<T>(INFINITY);
    // The scores of key tile (rows at kr, nk of them, first position key0) into s; the tile's
    // values too when `values`.
    auto scores = [&](long long kr, bool pre, int nk, long long key0, bool values) {
        const T* ks = pre ? f.k_prefix : f.k_seq;
        const long long st = pre ? f.kp_stride : f.seq_stride;
        tiled_rows(k, ld, ks + kr * st + col, st, nk, dh);
        if (values) {
            const T* vs = pre ? f.v_prefix : f.v_seq;
            const long long sv = pre ? f.vp_stride : f.seq_stride;
            tiled_rows(v, ld, vs + kr * sv + col, sv, nk, dh);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < nq * shape.tk; i += blockDim.x) {
            const int r = i / shape.tk, c = i % shape.tk;
            const bool seen = c < nk && tiled_sees(key0 < 0 ? -1 : key0 + c,
                                                   f.pos0 + f.qstride * (t0 + r), f.window);
            s[i] = seen ? tiled_dot(q + r * ld, k + c * ld, dh) * f.scale : none;
        }
        __syncthreads();
    };
    // Pass 1: each row's maximum and sum, online.
    tiled_key_tiles(f, shape, b, t0, nq, [&](long long kr, bool pre, int nk, long long key0) {
        scores(kr, pre, nk, key0, false);
        tiled_online_stats(s, shape.tk, nq, nk, mx, sum);
        __syncthreads();
    });
    for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        sum[r] = T(1) / sum[r];  // from here on 1 / l
    }
    __syncthreads();
    // Pass 2: dS per key tile, dq += dS K.
    tiled_key_tiles(f, shape, b, t0, nq, [&](long long kr, bool pre, int nk, long long key0) {
        scores(kr, pre, nk, key0, true);
        tiled_score_adjoints(s, shape.tk, nq, g, v, ld, dh, mx, sum, delta, f.scale);
        __syncthreads();
        tiled_add_dq(gq, s, shape.tk, k, ld, nq, nk, dh);
        __syncthreads();
    });
    for (int i = threadIdx.x; i < nq * dh; i += blockDim.x) {
        dq[(r0 + i / dh) * dq_stride + col + i % dh] = gq[(i / dh) * ld + i % dh];
    }
    for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        const long long at = (r0 + r) * f.H + h;
        a.mx[at] = mx[r];
        a.inv[at] = sum[r];
        a.delta[at] = delta[r];
    }
}

/// The query rows [r0, r1) (flattened b N + t) that may see keys [j0, j0 + nk) of sequence b's
/// window: positions pos0 + qstride t in [j0, j0 + nk - 1 + w - 1].
template <class T>
__device__ void tiled_window_queries(const TiledAttentionArgs<T>& f, long long b, long long j0,
                                     int nk, long long& r0, long long& r1) {
    const long long lo = j0 - f.pos0, hi = j0 + nk - 1 + f.window - 1 - f.pos0;
    long long t0 = lo <= 0 ? 0 : (lo + f.qstride - 1) / f.qstride;
    long long t1 = hi < 0 ? -1 : hi / f.qstride;
    t1 = t1 < f.N - 1 ? t1 : f.N - 1;
    t0 = t0 < t1 + 1 ? t0 : t1 + 1;
    r0 = b * f.N + t0;
    r1 = b * f.N + t1 + 1;
}

/// The query rows [r0, r1) (flattened b N + t) a key pass's block may find seeing its keys:
/// every sequence's rows for a shared prefix (batch sequences), sequence b's for its own
/// prefix, tiled_window_queries' for keys [j0, j0 + nk) of sequence b's window.
template <class T>
__device__ void tiled_key_queries(const TiledAttentionArgs<T>& f, bool prefix, long long batch,
                                  long long b, long long j0, int nk, long long& r0, long long& r1) {
    if (prefix) {
        r0 = f.shared ? 0 : b * f.N;
        r1 = f.shared ? batch * f.N : r0 + f.N;
    } else {
        tiled_window_queries(f, b, j0, nk, r0, r1);
    }
}

/// The key pass: one key tile (blockIdx.x) of one head (y) of sequence z's window (prefix
/// false: its seq_rows rows) or of the prefix (sequence z's p rows, or the shared rows for
/// every sequence's queries when z = 0 and the prefix is shared).
template <class T>
__global__ void __launch_bounds__(tiled_threads)
    tiled_key_backward_kernel(TiledBackwardArgs<T> a, TiledShape shape, bool prefix,
                              long long batch, TiledKeyGrads<T> out) {
    const TiledAttentionArgs<T>& f = a.f;
    const long long b = blockIdx.z, j0 = static_cast<long long>(blockIdx.x) * shape.tk;
    const int h = static_cast<int>(blockIdx.y), dh = f.d_head, ld = dh + 1;
    const long long rows = prefix ? f.p : f.seq_rows;
    const int nk = static_cast<int>(rows - j0 < shape.tk ? rows - j0 : shape.tk);
    const long long col = static_cast<long long>(h) * dh;
    const long long kr = prefix ? (f.shared ? 0 : b * f.p) + j0 : b * f.seq_rows + j0;
    T* k = dynamic_shared<T>();
    T* v = k + shape.tk * ld;
    T* gk = v + shape.tk * ld;
    T* gv = gk + shape.tk * ld;
    T* q = gv + shape.tk * ld;
    T* g = q + shape.tq * ld;
    T* p = g + shape.tq * ld;
    T* ds = p + shape.tq * shape.tk;
    T* st = ds + shape.tq * shape.tk;  // m, 1 / l, delta of the tile's rows
    if (prefix) {
        tiled_rows(k, ld, f.k_prefix + kr * f.kp_stride + col, f.kp_stride, nk, dh);
        tiled_rows(v, ld, f.v_prefix + kr * f.vp_stride + col, f.vp_stride, nk, dh);
    } else {
        tiled_rows(k, ld, f.k_seq + kr * f.seq_stride + col, f.seq_stride, nk, dh);
        tiled_rows(v, ld, f.v_seq + kr * f.seq_stride + col, f.seq_stride, nk, dh);
    }
    for (int i = threadIdx.x; i < nk * dh; i += blockDim.x) {
        gk[(i / dh) * ld + i % dh] = T(0);
        gv[(i / dh) * ld + i % dh] = T(0);
    }
    long long r0 = 0, r1 = 0;
    tiled_key_queries(f, prefix, batch, b, j0, nk, r0, r1);
    __syncthreads();
    for (long long q0 = r0; q0 < r1; q0 += shape.tq) {
        const int nq = static_cast<int>(r1 - q0 < shape.tq ? r1 - q0 : shape.tq);
        tiled_rows(q, ld, f.q + q0 * f.q_stride + col, f.q_stride, nq, dh);
        tiled_rows(g, ld, a.dout + q0 * a.dout_stride + col, a.dout_stride, nq, dh);
        for (int r = threadIdx.x; r < nq; r += blockDim.x) {
            const long long at = (q0 + r) * f.H + h;
            st[3 * r] = a.mx[at];
            st[3 * r + 1] = a.inv[at];
            st[3 * r + 2] = a.delta[at];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < nq * shape.tk; i += blockDim.x) {
            const int r = i / shape.tk, c = i % shape.tk;
            const long long qp = f.pos0 + f.qstride * ((q0 + r) % f.N);
            T pr = T(0), dr = T(0);
            if (c < nk && tiled_sees(prefix ? -1 : j0 + c, qp, f.window)) {
                pr = std::exp(tiled_dot(q + r * ld, k + c * ld, dh) * f.scale - st[3 * r]) *
                     st[3 * r + 1];
                dr = f.scale * pr * (tiled_dot(g + r * ld, v + c * ld, dh) - st[3 * r + 2]);
            }
            p[i] = pr;
            ds[i] = dr;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < nk * dh; i += blockDim.x) {
            const int c = i / dh, e = i % dh;
            T av = gv[c * ld + e], ak = gk[c * ld + e];
            for (int r = 0; r < nq; ++r) {
                av += p[r * shape.tk + c] * g[r * ld + e];
                ak += ds[r * shape.tk + c] * q[r * ld + e];
            }
            gv[c * ld + e] = av;
            gk[c * ld + e] = ak;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < nk * dh; i += blockDim.x) {
        const int c = i / dh, e = i % dh;
        out.dk[(kr + c) * out.stride + col + e] = gk[c * ld + e];
        out.dv[(kr + c) * out.stride + col + e] = gv[c * ld + e];
    }
}

/// dq (written at dq + r dq_stride, head columns) and the statistics of every query row, B
/// sequences, in `shape` (tiled_backward_shape; the grid checked by tiled_grid_fits).
template <class T>
void tiled_query_backward(cudaStream_t stream, const TiledBackwardArgs<T>& a, long long B,
                          TiledShape shape, T* dq, long long dq_stride) {
    if (a.f.N <= 0 || B <= 0) {
        return;
    }
    const dim3 grid(static_cast<unsigned>((a.f.N + shape.tq - 1) / shape.tq),
                    static_cast<unsigned>(a.f.H), static_cast<unsigned>(B));
    launch_shared(tiled_query_backward_kernel<T>, grid, dim3(tiled_threads),
                  static_cast<std::size_t>(tiled_query_entries(shape, a.f.d_head)) * sizeof(T),
                  stream, a, shape, dq, dq_stride);
    check_launch("the tiled attention backward (queries)");
}

/// dk, dv of every window row (seq_rows per sequence, B sequences; prefix false) or of every
/// prefix row (prefix true), written to `out`, after tiled_query_backward.
template <class T>
void tiled_key_backward(cudaStream_t stream, const TiledBackwardArgs<T>& a, long long B,
                        TiledShape shape, bool prefix, TiledKeyGrads<T> out) {
    const long long rows = prefix ? a.f.p : a.f.seq_rows;
    const long long groups = prefix && a.f.shared ? 1 : B;
    if (rows <= 0 || groups <= 0) {
        return;
    }
    const dim3 grid(static_cast<unsigned>((rows + shape.tk - 1) / shape.tk),
                    static_cast<unsigned>(a.f.H), static_cast<unsigned>(groups));
    launch_shared(tiled_key_backward_kernel<T>, grid, dim3(tiled_threads),
                  static_cast<std::size_t>(tiled_key_entries(shape, a.f.d_head)) * sizeof(T),
                  stream, a, shape, prefix, B, out);
    check_launch("the tiled attention backward (keys)");
}

#endif

}  // namespace titans::backend::cuda
