#pragma once
// titans/backend/cuda/attention_tiled.cuh: prefix + sliding-window attention in tiles (math
// §6-7; the flash-attention scheme), float and double.
//
// A block per (query tile, head, sequence): the tile's queries and an accumulator of their
// outputs sit in shared memory; the keys and values they see come through in tiles of TK rows
// (the prefix's, then the window's span), and per tile
//     S = scale Q K^T (masked: a query at position t sees the window keys (t - w, t]),
//     m' = max(m, max_j S), P = exp(S - m'), l = l e^(m - m') + sum_j P,
//     O = O e^(m - m') + P V,
// so each key and value is read once per query tile (the per-row kernel reads them once per
// query) and nothing of size N x N exists. At the end O / l. Queries may sit at a stride on
// the key positions (query t at pos0 + stride t): MAC's segment interleaves h_i and s_i, its
// queries at the odd positions. Plain FMAs in T, no atomics: deterministic.
//
// The result equals attention_row's (the CPU's prefix_window_attention) up to rounding: the
// scale is applied before the maximum instead of after, and the sum runs in tiles.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>

#include "../../attention/attention_row.hpp"
#include "../../config.hpp"
#include "launch.cuh"

namespace titans::backend::cuda {

/// How the attention layer runs its attention. Auto: in warp tiles (attention_warp_tiles.cuh:
/// the products on the tensor cores in TF32 where the stream allows it, else in registers)
/// where they apply (warp_tiles_fit), else in these tiles wherever one fits in 48 KB of shared
/// memory (tiled_shape), else a thread per (row, head). Scalar: never in warp tiles. Off: a
/// thread per (row, head) always (a decoded token's attention excepted where set_split_decode
/// is on: attention_decode.cuh). Process-wide, read at every call: tests compare the paths,
/// benchmarks time them.
enum class TiledAttentionMode { Auto, Scalar, Off };

inline std::atomic<TiledAttentionMode>& tiled_attention_flag() {
    static std::atomic<TiledAttentionMode> flag{TiledAttentionMode::Auto};
    return flag;
}
inline void set_tiled_attention(TiledAttentionMode m) { tiled_attention_flag().store(m); }
[[nodiscard]] inline TiledAttentionMode tiled_attention() { return tiled_attention_flag().load(); }

/// The operands of tiled_attention_kernel: row-major buffers in device memory, every pointer
/// at column 0 (head h's columns at + h d_h).
template <class T>
struct TiledAttentionArgs {
    const T* q;                      ///< query row r = b N + t at q + r q_stride
    long long q_stride;
    const T *k_prefix, *v_prefix;    ///< p rows per sequence (b p + j), or p for all (shared)
    long long p, kp_stride, vp_stride;
    bool shared;
    const T *k_seq, *v_seq;          ///< sequence b's key row j at + (b seq_rows + j) seq_stride
    long long seq_rows, seq_stride;
    long long N, pos0, qstride;      ///< query t sees key positions (pos0 + qstride t - w, ...]
    int H, d_head, window;
    T scale;
    T* o;                            ///< output row r at o + r o_stride
    long long o_stride;
    /// Where the warp-tiled forward writes each (row r, head h)'s softmax statistics, at
    /// r H + h: the largest scaled score and 1 / the sum of exp(score - largest), the
    /// backward's mx and inv (nullptr: not written; the scalar tiles never write them).
    T* stat_m = nullptr;
    T* stat_inv = nullptr;
    /// A piece the scalar tiles append themselves (one query tile per (sequence, head): N <=
    /// the shape's tq, qstride 1; nullptr: appended before the launch). Each block first
    /// writes its head's columns of the piece's keys and values (query row r's at
    /// q + r q_stride + kv_offset and + 2 kv_offset) into window rows pos0 .. pos0 + N - 1
    /// (k_win, v_win: k_seq, v_seq), RoPE-rotated at absolute positions rope_pos0 + t when
    /// rope, its queries rotated in its tile.
    T* k_win = nullptr;
    T* v_win = nullptr;
    long long kv_offset = 0;
    bool rope = false;
    double rope_base = 0;
    std::int64_t rope_pos0 = 0;
};

/// A tile's shape: TQ queries against TK keys at a time (0: the tile does not fit).
struct TiledShape {
    int tq = 0, tk = 0;
    [[nodiscard]] bool fits() const { return tq > 0; }
};

/// Threads of a tiled block.
inline constexpr int tiled_threads = 128;
/// The shared memory of a tiled block takes at most this (the default limit of every GPU).
inline constexpr std::size_t tiled_shared_limit = 48 * 1024;

/// Entries of T a block of shape s needs for head width dh: Q and O (TQ x (dh + 1)), K and V
/// (TK x (dh + 1); rows padded by one entry so a warp's column reads hit distinct banks), S
/// (TQ x TK) and the row maximum, sum and rescaling (TQ each).
TITANS_HOST_DEVICE long long tiled_entries(TiledShape s, int dh) {
    const long long ld = dh + 1;
    return 2LL * s.tq * ld + 2LL * s.tk * ld + static_cast<long long>(s.tq) * s.tk + 3LL * s.tq;
}

/// The largest key tile of 64, 32, 16 or 8 rows whose block fits tiled_shared_limit, the query
/// tile as large but no larger than N rounded up to a power of two (decode: N = 1 gives one
/// query against 64 keys). {0, 0} when even 8 x 8 does not fit (d_h in the hundreds).
inline TiledShape tiled_shape(int dh, long long N, std::size_t entry_bytes) {
    int nq = 1;
    while (nq < N && nq < 64) {
        nq *= 2;
    }
    for (int tk = 64; tk >= 8; tk /= 2) {
        const TiledShape s{std::min(tk, nq), tk};
        if (static_cast<std::size_t>(tiled_entries(s, dh)) * entry_bytes <= tiled_shared_limit) {
            return s;
        }
    }
    return {};
}

#if TITANS_CUDA_DEVICE_CODE

/// The shared arrays of a tiled block (see tiled_entries).
template <class T>
struct TiledShared {
    T *q, *o, *k, *v, *s, *mx, *sum, *alpha;
    int ld;
    __device__ TiledShared(T* base, TiledShape sh, int dh) : ld(dh + 1) {
        q = base;
        o = q + sh.tq * ld;
        k = o + sh.tq * ld;
        v = k + sh.tk * ld;
        s = v + sh.tk * ld;
        mx = s + sh.tq * sh.tk;
        sum = mx + sh.tq;
        alpha = sum + sh.tq;
    }
};

/// nk key and value rows (head columns, dh wide) into the block's K and V tiles.
template <class T>
__device__ void tiled_load_kv(const TiledShared<T>& sh, const T* k, long long ks, const T* v,
                              long long vs, int nk, int dh) {
    for (int i = threadIdx.x; i < nk * dh; i += blockDim.x) {
        const int r = i / dh, c = i % dh;
        sh.k[r * sh.ld + c] = k[r * ks + c];
        sh.v[r * sh.ld + c] = v[r * vs + c];
    }
    __syncthreads();
}

/// One key tile against the block's nq queries: the scores (masked ones -inf), the online
/// softmax's new maximum, sum and rescaling per row, then O rescaled plus P V. key0 is the
/// position of the tile's first key (-1: prefix keys, visible to every query); qpos0 and qstep
/// place query r at qpos0 + qstep r.
template <class T>
__device__ void tiled_step(const TiledShared<T>& sh, TiledShape shape, int nq, int nk, int dh,
                           T scale, long long key0, long long qpos0, long long qstep, int window) {
    const T none = -static_cast<T>(INFINITY);
    for (int i = threadIdx.x; i < nq * shape.tk; i += blockDim.x) {
        const int r = i / shape.tk, c = i % shape.tk;
        const long long qp = qpos0 + qstep * r, kp = key0 + c;
        const bool seen = c < nk && (key0 < 0 || (kp <= qp && kp > qp - window));
        T d = T(0);
        if (seen) {
            for (int e = 0; e < dh; ++e) {
                d += sh.q[r * sh.ld + e] * sh.k[c * sh.ld + e];
            }
        }
        sh.s[i] = seen ? d * scale : none;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        T* row = sh.s + r * shape.tk;
        T m = sh.mx[r];
        for (int c = 0; c < nk; ++c) {
            m = row[c] > m ? row[c] : m;
        }
        const T a = m == sh.mx[r] ? T(1) : std::exp(sh.mx[r] - m);  // -inf to finite: 0
        T l = sh.sum[r] * a;
        for (int c = 0; c < nk; ++c) {
            const T e = row[c] == none ? T(0) : std::exp(row[c] - m);
            row[c] = e;
            l += e;
        }
        sh.mx[r] = m;
        sh.sum[r] = l;
        sh.alpha[r] = a;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nq * dh; i += blockDim.x) {
        const int r = i / dh, c = i % dh;
        const T* pr = sh.s + r * shape.tk;
        T acc = sh.o[r * sh.ld + c] * sh.alpha[r];
        for (int j = 0; j < nk; ++j) {
            acc += pr[j] * sh.v[j * sh.ld + c];
        }
        sh.o[r * sh.ld + c] = acc;
    }
    __syncthreads();
}

/// The tile's queries (rows t0 .. t0 + nq - 1 of sequence b, head h) into Q; O, the maxima
/// (-inf) and the sums (0) cleared.
template <class T>
__device__ void tiled_begin(const TiledAttentionArgs<T>& a, const TiledShared<T>& sh,
                            TiledShape shape, long long b, int h, long long t0, int nq) {
    const int dh = a.d_head;
    for (int i = threadIdx.x; i < nq * dh; i += blockDim.x) {
        const int r = i / dh, c = i % dh;
        sh.q[r * sh.ld + c] = a.q[(b * a.N + t0 + r) * a.q_stride + h * dh + c];
        sh.o[r * sh.ld + c] = T(0);
    }
    for (int r = threadIdx.x; r < shape.tq; r += blockDim.x) {
        sh.mx[r] = -static_cast<T>(INFINITY);
        sh.sum[r] = T(0);
    }
    __syncthreads();
}

/// The piece's keys and values of head h of sequence b (its nq rows, the block's one query
/// tile) into the window (TiledAttentionArgs::k_win), rotated by RoPE where a.rope, as are the
/// queries in Q (tiled_begin's), pair by pair as RopeQK rotates them: the same values.
template <class T>
__device__ void tiled_append(const TiledAttentionArgs<T>& a, const TiledShared<T>& sh,
                             long long b, int h, int nq) {
    const int dh = a.d_head, step = a.rope ? 2 : 1, per_row = dh / step;
    const long long col = static_cast<long long>(h) * dh;
    for (int i = threadIdx.x; i < nq * per_row; i += blockDim.x) {
        const int r = i / per_row, c = step * (i % per_row);
        const T* k = a.q + (b * a.N + r) * a.q_stride + a.kv_offset + col + c;
        const T* v = k + a.kv_offset;
        const long long to = (b * a.seq_rows + a.pos0 + r) * a.seq_stride + col + c;
        if (a.rope) {
            const detail::RopePair<T> turn(a.rope_pos0 + r, c / 2, dh, a.rope_base);
            turn.rotate(sh.q + r * sh.ld + c, sh.q + r * sh.ld + c);
            turn.rotate(k, a.k_win + to);
            a.v_win[to + 1] = v[1];
        } else {
            a.k_win[to] = k[0];
        }
        a.v_win[to] = v[0];
    }
    __syncthreads();
}

/// The attention of one query tile of one head of one sequence (blockIdx x, y, z).
template <class T>
__global__ void __launch_bounds__(tiled_threads)
    tiled_attention_kernel(TiledAttentionArgs<T> a, TiledShape shape) {
    const long long b = blockIdx.z, t0 = static_cast<long long>(blockIdx.x) * shape.tq;
    const int h = static_cast<int>(blockIdx.y), dh = a.d_head;
    const int nq = static_cast<int>(a.N - t0 < shape.tq ? a.N - t0 : shape.tq);
    const TiledShared<T> sh(dynamic_shared<T>(), shape, dh);
    tiled_begin(a, sh, shape, b, h, t0, nq);
    if (a.k_win != nullptr) {
        tiled_append(a, sh, b, h, nq);
    }
    const long long col = static_cast<long long>(h) * dh;
    const long long pb = a.shared ? 0 : b * a.p;
    for (long long j0 = 0; j0 < a.p; j0 += shape.tk) {
        const int nk = static_cast<int>(a.p - j0 < shape.tk ? a.p - j0 : shape.tk);
        tiled_load_kv(sh, a.k_prefix + (pb + j0) * a.kp_stride + col, a.kp_stride,
                      a.v_prefix + (pb + j0) * a.vp_stride + col, a.vp_stride, nk, dh);
        tiled_step(sh, shape, nq, nk, dh, a.scale, -1, 0, 0, a.window);
    }
    const long long first = a.pos0 + a.qstride * t0, last = first + a.qstride * (nq - 1);
    const long long lo = first - a.window + 1 > 0 ? first - a.window + 1 : 0;
    const long long seq = b * a.seq_rows;
    for (long long j0 = lo; j0 <= last; j0 += shape.tk) {
        const int nk = static_cast<int>(last + 1 - j0 < shape.tk ? last + 1 - j0 : shape.tk);
        tiled_load_kv(sh, a.k_seq + (seq + j0) * a.seq_stride + col, a.seq_stride,
                      a.v_seq + (seq + j0) * a.seq_stride + col, a.seq_stride, nk, dh);
        tiled_step(sh, shape, nq, nk, dh, a.scale, j0, first, a.qstride, a.window);
    }
    for (int i = threadIdx.x; i < nq * dh; i += blockDim.x) {
        const int r = i / dh, c = i % dh;
        a.o[(b * a.N + t0 + r) * a.o_stride + col + c] = sh.o[r * sh.ld + c] / sh.sum[r];
    }
}

/// Launches tiled_attention_kernel over B sequences in the given shape (shape.fits(); B and
/// the head count within a grid's 65535 in y and z, N / tq within 2^31 - 1: the caller checks
/// with tiled_grid_fits).
template <class T>
void tiled_attention(cudaStream_t stream, const TiledAttentionArgs<T>& a, long long B,
                     TiledShape shape) {
    if (a.N <= 0 || B <= 0) {
        return;
    }
    const dim3 grid(static_cast<unsigned>((a.N + shape.tq - 1) / shape.tq),
                    static_cast<unsigned>(a.H), static_cast<unsigned>(B));
    launch_shared(tiled_attention_kernel<T>, grid, dim3(tiled_threads),
                  static_cast<std::size_t>(tiled_entries(shape, a.d_head)) * sizeof(T), stream, a,
                  shape);
    check_launch("the tiled attention kernel");
}

#endif

/// Whether B sequences of N queries over H heads fit tiled_attention's grid.
inline bool tiled_grid_fits(long long B, long long N, int H, TiledShape shape) {
    return shape.fits() && B <= 65535 && H <= 65535 &&
           (N + shape.tq - 1) / shape.tq <= 2147483647LL;
}

}  // namespace titans::backend::cuda
