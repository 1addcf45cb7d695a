#pragma once
// titans/backend/cuda/memory_decode.cuh: a few rows of a depth-2 memory with lagged retrieval
// in one launch (issue 33's decode): per (sequence, head) pair and row, the read through the
// chunk's start memory and the key pass of math §2, with W1 read once for both.
//
// A decoded token ran them as five batched cuBLAS products (the read's two, the keys' two
// forward and one back) and four element-wise kernels, each of them a pass over the pairs'
// memory: at B = 1024 the weights (128 KB a pair in float at d_h 64, e 4) were streamed from
// device memory three times a token, and at B = 1 the nine launches were a third of a token's.
// Here a block per pair streams W1 once (the row's query and key through it together) and W2
// twice (the forward products, then the error back through it, mostly from L2):
//   hq = act(q W1), y = hq W2 (+ q);
//   z1 = k W1, A_1 = act(z1), Delta_2 = A_1 W2 (+ k) - v, Delta_1 = (Delta_2 W2^T) . act'(z1).
// Sums in T by FMAs in a fixed order (no atomics): deterministic, not the order of cuBLAS.

#include <algorithm>
#include <cstddef>

#include "../../activation.hpp"
#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "fast_math.cuh"
#include "launch.cuh"
#include "memory_conv.cuh"
#include "memory_device.cuh"

namespace titans::backend::cuda {

/// Where decode_rows_kernel reads and writes: row r of pair p of q, k, v and y at
/// x + p * ps + r * dh (ps: the pair stride of the call's pair-major rows; q and k divided by
/// their L2 norm in place first when `norm`), the gate logits' row r at lp + p * lps + 3 r,
/// the pending rows A_0 (the keys, width d_h), A_1 (h), Delta_1 (h), Delta_2 (d_h) and the
/// gate logits (3, when gates is given) at their row o + r of the pair's b rows, W1 (d_h x h)
/// and W2 (h x d_h) of each pair, row-major. When `save` is given, each pending entry's old
/// value goes first to the same place in the matching array of `save` (the transaction's undo
/// rows, the state's save_rows in the same launch). When `raise` is given (a deferring call
/// scope's flag), an entry of the rows' q, k (normalised), v, gate logits or y, or of the
/// pending rows written, that is not finite raises it: the memory's checks of those rows, in
/// the same launch.
/// With conv.u given (a call decoded whole, first launch), each pair's block first does the
/// conv kernel's work on its own columns (conv_column over every row of the call, the tail
/// advanced; gate_column): the columns of its q, k, v and gate logits are its alone.
template <class T>
struct DecodeRows {
    /// The pending arrays: A_0, A_1, Delta_1, Delta_2 and the gate logits (null: none).
    struct Pending {
        T *a0, *a1, *d1, *d2, *gates;
    };
    T *q, *k;
    const T* v;
    T* y;
    long long ps;
    const T *w1, *w2;
    Pending live, save;
    const T* lp;
    long long lps;
    int b, o, m, dh, h;
    Activation act;
    bool residual, norm;
    unsigned* raise;
    ConvTile<T> conv;
};

/// The slices of d_h rows of W1 decode_rows_kernel's `threads` threads split a column's
/// products into (a thread a column and slice; 1 where h >= threads).
TITANS_HOST_DEVICE constexpr int decode_w1_slices(int h, int threads) {
    return h < threads ? threads / h : 1;
}

/// Shared memory decode_rows_kernel takes with `threads` threads: q, k, the error (d_h each),
/// hq, A_1, act'(z1) (h each) and the partial sums of the products through W1 (2 x slices x h)
/// or, after them, through W2 (2 x slices x d_h), whichever is larger.
template <class T>
std::size_t decode_shared_bytes(int dh, int h, int threads) {
    const int slices = dh <= threads ? threads / dh : 1;
    const int parts = 2 * std::max(slices * dh, decode_w1_slices(h, threads) * h);
    return static_cast<std::size_t>(3 * dh + 3 * h + parts) * sizeof(T);
}

/// The rows of W2 a warp of decode_rows_kernel takes at once in the error's way back.
inline constexpr int decode_rows_per_warp = 4;

/// decode_rows_kernel's threads a block for P pairs (a block each): 256, or in float 512 where
/// P <= decode_wide_pairs, 16 warps on a pair's chains of loads where the pairs leave SMs idle
/// (at B = 1 a block an SM a head). 80 registers a thread in float (64 with spills where 512 is
/// declared as a launch bound) allow one block of 512 an SM, three of 256: many pairs keep
/// 256. In double 256 (124 registers a thread).
inline constexpr long long decode_wide_pairs = 128;
template <class T>
constexpr int decode_block_threads(long long P) {
    return sizeof(T) == 4 && P <= decode_wide_pairs ? 512 : 256;
}
/// The most threads decode_block_threads gives T (the shared memory decode_applies bounds).
template <class T>
inline constexpr int decode_most_threads = decode_block_threads<T>(1);

#if TITANS_CUDA_DEVICE_CODE
/// Entry i of a pending array = v, its old value into `saved` first when that is given.
template <class T>
__device__ void put_pending(T* live, T* saved, long long i, T v) {
    if (saved != nullptr) {
        saved[i] = live[i];
    }
    live[i] = v;
}

/// Row r of pair p: the second layer's products hq W2 and A_1 W2 into y's row and Delta_2's
/// (column c by `slices` threads over consecutive slices of the h rows of W2, then their sums
/// in slice order), then Delta_1 = (Delta_2 W2^T) . act'(z1) (a warp per row of W2, its reads
/// coalesced, 4 rows at once). blockDim.x: a multiple of 32.
template <class T>
__device__ bool decode_second_layer(const DecodeRows<T>& d, long long p, int r, T* sh) {
    const int dh = d.dh, h = d.h, threads = static_cast<int>(blockDim.x);
    const int slices = dh <= threads ? threads / dh : 1, span = (h + slices - 1) / slices;
    T *qs = sh, *ks = sh + dh, *es = sh + 2 * dh, *hq = sh + 3 * dh, *a1 = hq + h, *g1 = a1 + h;
    T* part = g1 + h;  // [2][slices][dh]
    const T* w2 = d.w2 + p * h * dh;
    for (int i = static_cast<int>(threadIdx.x); i < slices * dh; i += threads) {
        const int c = i % dh, s = i / dh, j1 = (s + 1) * span < h ? (s + 1) * span : h;
        T sy = T(0), sz = T(0);
        TITANS_PRAGMA(unroll 16)  // 16 rows' loads in flight before their products
        for (int j = s * span; j < j1; ++j) {
            sy += hq[j] * w2[static_cast<long long>(j) * dh + c];
            sz += a1[j] * w2[static_cast<long long>(j) * dh + c];
        }
        part[s * dh + c] = sy;
        part[(slices + s) * dh + c] = sz;
    }
    __syncthreads();
    const long long row = p * d.ps + static_cast<long long>(r) * dh;
    bool bad = false;  // a non-finite v or y entry of this thread's
    for (int c = static_cast<int>(threadIdx.x); c < dh; c += threads) {
        T y = T(0), z = T(0);
        for (int s = 0; s < slices; ++s) {
            y += part[s * dh + c];
            z += part[(slices + s) * dh + c];
        }
        d.y[row + c] = d.residual ? y + qs[c] : y;
        const T e = d.residual ? (z - d.v[row + c]) + ks[c] : z - d.v[row + c];
        bad = bad || not_finite(d.y[row + c]) || not_finite(d.v[row + c]) || not_finite(e);
        es[c] = e;
        put_pending(d.live.d2, d.save.d2, (p * d.b + d.o + r) * dh + c, e);
    }
    __syncthreads();
    // A warp per row of W2, decode_rows_per_warp rows at once (their loads in flight together):
    // warp w takes rows w, w + warps, w + 2 warps, ...
    constexpr int R = decode_rows_per_warp;
    const int lane = static_cast<int>(threadIdx.x % 32), warps = threads / 32;
    for (int j0 = static_cast<int>(threadIdx.x / 32); j0 < h; j0 += R * warps) {
        T s[R];
        TITANS_UNROLL
        for (int u = 0; u < R; ++u) s[u] = T(0);
        for (int c = lane; c < dh; c += 32) {
            TITANS_UNROLL
            for (int u = 0; u < R; ++u) {
                const int j = j0 + u * warps;
                if (j < h) s[u] += es[c] * w2[static_cast<long long>(j) * dh + c];
            }
        }
        TITANS_UNROLL
        for (int u = 0; u < R; ++u) {
            const int j = j0 + u * warps;  // the same for the whole warp
            if (j >= h) break;
            const T t = warp_sum(s[u]);
            if (lane == 0) {
                put_pending(d.live.d1, d.save.d1, (p * d.b + d.o + r) * h + j, t * g1[j]);
                bad = bad || not_finite(t * g1[j]);
            }
        }
    }
    return bad;
}

/// Pair p's columns of the conv kernel's work (d.conv, one tile a sequence): its q, k, v
/// columns (head p % H of sequence p / H) and its 3 gate logits.
template <class T>
__device__ void decode_conv(const DecodeRows<T>& d, long long p) {
    const ConvTile<T>& a = d.conv;
    const long long s = p / a.H;
    const int hd = static_cast<int>(p % a.H), cols = a.C / a.D * a.dh, gates = a.G / a.H;
    for (int i = static_cast<int>(threadIdx.x); i < cols + gates;
         i += static_cast<int>(blockDim.x)) {
        if (i < cols) {  // part i / dh (q, k, v) of the head's columns
            const int c = i / a.dh * a.D + hd * a.dh + i % a.dh;
            if (conv_compiled_k(a.conv, a.K) == 4) {
                conv_column<T, 4>(a, s, 0, a.N, c);
            } else {
                conv_column<T, 0>(a, s, 0, a.N, c);
            }
        } else {
            gate_column(a, s, 0, a.N, (i - cols) * a.H + hd);
        }
    }
    __syncthreads();  // the block's rows of q, k, v and lp written before they are read
}

/// The row's first-layer products zq = q W1 and z1 = k W1 (qs, ks in shared memory), then
/// hq = act(zq), A_1 = act(z1) and act'(z1) into shared memory and A_1 into its pending row.
/// Thread (s, j) sums column j over slice s of W1's rows (decode_w1_slices: at 512 threads and
/// h 256, two slices of 32 rows, each thread's 16-load batches twice, where one thread a column
/// waited on four) into `part`; thread j then adds the slices in order. Returns whether a value
/// written is not finite.
template <class T>
__device__ bool decode_first_layer(const DecodeRows<T>& d, long long p, long long pending,
                                   T* sh) {
    const int dh = d.dh, h = d.h, threads = static_cast<int>(blockDim.x);
    const int slices = decode_w1_slices(h, threads), span = (dh + slices - 1) / slices;
    T *qs = sh, *ks = sh + dh, *hq = sh + 3 * dh, *a1 = hq + h, *g1 = a1 + h;
    T* part = g1 + h;  // [2][slices][h]
    const T* w1 = d.w1 + p * dh * h;
    for (int i = static_cast<int>(threadIdx.x); i < slices * h; i += threads) {
        const int j = i % h, s = i / h, i1 = (s + 1) * span < dh ? (s + 1) * span : dh;
        T zq = T(0), zk = T(0);
        TITANS_PRAGMA(unroll 16)  // 16 loads of W1 in flight before their products
        for (int r = s * span; r < i1; ++r) {
            const T w = w1[static_cast<long long>(r) * h + j];
            zq += qs[r] * w;
            zk += ks[r] * w;
        }
        part[s * h + j] = zq;
        part[(slices + s) * h + j] = zk;
    }
    __syncthreads();
    bool bad = false;
    for (int j = static_cast<int>(threadIdx.x); j < h; j += threads) {
        T zq = T(0), zk = T(0);
        for (int s = 0; s < slices; ++s) {
            zq += part[s * h + j];
            zk += part[(slices + s) * h + j];
        }
        const detail::ValueGrad<T> a = kernel_activate_with_grad(d.act, zk);
        hq[j] = kernel_activate(d.act, zq);
        a1[j] = a.value;
        g1[j] = a.grad;
        put_pending(d.live.a1, d.save.a1, pending * h + j, a.value);
        bad = bad || not_finite(a.value);
    }
    return bad;
}

/// A block per pair (blockIdx.x), its m rows one after the other: the read and the key pass
/// of the file comment (the conv first, when d.conv.u is given). Dynamic shared memory:
/// decode_shared_bytes; decode_block_threads<T>(gridDim.x) threads.
template <class T>
__global__ void decode_rows_kernel(DecodeRows<T> d) {
    const long long p = blockIdx.x;
    if (d.conv.u != nullptr) {
        decode_conv(d, p);
    }
    const int dh = d.dh, threads = static_cast<int>(blockDim.x);
    T* sh = dynamic_shared<T>();
    T *qs = sh, *ks = sh + dh;
    bool bad = false;  // a non-finite entry among those this thread read or wrote
    for (int r = 0; r < d.m; ++r) {
        const long long row = p * d.ps + static_cast<long long>(r) * dh;
        if (d.norm && threadIdx.x < 64) {  // warp 0 the query, warp 1 the key
            l2_row((threadIdx.x < 32 ? d.q : d.k) + row, dh, static_cast<int>(threadIdx.x % 32));
        }
        __syncthreads();
        const long long pending = p * d.b + d.o + r;
        for (int c = static_cast<int>(threadIdx.x); c < dh; c += threads) {
            qs[c] = d.q[row + c];
            ks[c] = d.k[row + c];
            put_pending(d.live.a0, d.save.a0, pending * dh + c, ks[c]);
            bad = bad || not_finite(qs[c]) || not_finite(ks[c]);
        }
        if (d.live.gates != nullptr && threadIdx.x < 3) {
            const T g = d.lp[p * d.lps + 3 * r + threadIdx.x];
            put_pending(d.live.gates, d.save.gates, pending * 3 + threadIdx.x, g);
            bad = bad || not_finite(g);
        }
        __syncthreads();
        bad = decode_first_layer(d, p, pending, sh) || bad;
        __syncthreads();
        bad = decode_second_layer(d, p, r, sh) || bad;
        __syncthreads();  // before the next row overwrites q, k and the vectors
    }
    if (bad && d.raise != nullptr) {
        atomicMax(d.raise, 1u);
    }
}
#endif

}  // namespace titans::backend::cuda
