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

#include <atomic>
#include <cstddef>
#include <string>

#include "../../activation.hpp"
#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "../../error.hpp"
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
    int ranks = 1;  ///< blocks a pair (decode_cluster_kernel; 1: decode_rows_kernel)
};

/// The slices of d_h rows of W1 decode_rows_kernel's `threads` threads split a column's
/// products into (a thread a column and slice; 1 where h >= threads).
TITANS_HOST_DEVICE constexpr int decode_w1_slices(int h, int threads) {
    return h < threads ? threads / h : 1;
}

/// Where the block's second-layer sums (2 x d_h) start in decode_rows_kernel's shared memory,
/// in entries, with `threads` threads a block and `ranks` blocks a pair: after q, k, the error
/// (d_h each), hq, A_1, act'(z1) (h each) and the partial sums of the products through W1 (2 x
/// slices x the block's h / ranks columns) or, after them, through W2 (2 x slices x d_h),
/// whichever is larger.
TITANS_HOST_DEVICE constexpr int decode_sums_at(int dh, int h, int threads, int ranks) {
    const int slices = dh <= threads ? threads / dh : 1, n = (h + ranks - 1) / ranks;
    const int w1 = decode_w1_slices(n, threads) * n;
    return 3 * dh + 3 * h + 2 * (slices * dh > w1 ? slices * dh : w1);
}

/// Shared memory decode_rows_kernel (ranks 1) or decode_cluster_kernel takes: decode_sums_at
/// and the sums.
template <class T>
std::size_t decode_shared_bytes(int dh, int h, int threads, int ranks = 1) {
    return static_cast<std::size_t>(decode_sums_at(dh, h, threads, ranks) + 2 * dh) * sizeof(T);
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
/// decode_rows_kernel's registers a thread at most: 80 in float (three blocks of 256 an SM for
/// many pairs; the compiler's choice was 96 since the kernel serves the clusters' code too), 128
/// in double (no spill).
template <class T>
inline constexpr int decode_registers = sizeof(T) == 4 ? 80 : 128;

/// The most threads decode_block_threads gives T (the shared memory decode_applies bounds).
template <class T>
inline constexpr int decode_most_threads = decode_block_threads<T>(1);

/// The blocks a pair the decode kernel takes as clusters (decode_cluster_kernel): 0 or 1 none
/// (decode_rows_kernel, a block a pair: the default), 2, 4 or 8 that many, each on h / ranks of
/// the hidden columns, where the pairs are few (at most decode_wide_pairs). The default is 4
/// where the environment sets TITANS_DECODE_CLUSTER=1. Process-wide, read at every launch.
inline std::atomic<int>& decode_cluster_flag() {
    static std::atomic<int> flag{env_switch("TITANS_DECODE_CLUSTER") ? 4 : 0};
    return flag;
}
/// Sets decode_cluster_flag; throws ConfigError (the state as it was) for ranks other than 0,
/// 1, 2, 4 and 8.
inline void set_decode_cluster(int ranks) {
    if (ranks != 0 && ranks != 1 && ranks != 2 && ranks != 4 && ranks != 8) {
        throw ConfigError("set_decode_cluster: ranks must be 0, 1, 2, 4 or 8, got " +
                          std::to_string(ranks));
    }
    decode_cluster_flag().store(ranks);
}
[[nodiscard]] inline int decode_cluster() { return decode_cluster_flag().load(); }

/// The blocks a pair a decode launch over P pairs takes: decode_cluster() where it is 2, 4 or
/// 8 and P <= decode_wide_pairs, else 1.
[[nodiscard]] inline int decode_cluster_ranks(long long P) {
    const int r = decode_cluster();
    return r > 1 && P <= decode_wide_pairs ? r : 1;
}

#if TITANS_CUDA_DEVICE_CODE
/// Entry i of a pending array = v, its old value into `saved` first when that is given.
template <class T>
__device__ void put_pending(T* live, T* saved, long long i, T v) {
    if (saved != nullptr) {
        saved[i] = live[i];
    }
    live[i] = v;
}

/// The hidden columns [j0, j1) (of W1; rows of W2) rank `rank` of a pair's `ranks` blocks takes.
struct DecodeColumns {
    int j0, j1;
    __device__ DecodeColumns(int h, int rank, int ranks) {
        const int span = (h + ranks - 1) / ranks;
        j0 = rank * span < h ? rank * span : h;
        j1 = j0 + span < h ? j0 + span : h;
    }
};

/// Rows [j.j0, j.j1) of W2's part of the second layer: the sums over them of hq[j] W2[j][c] and
/// A_1[j] W2[j][c] into sums[c] and sums[dh + c] (column c by `slices` threads over consecutive
/// slices of the rows, then their sums in slice order). Ends with a barrier.
template <class T>
__device__ void decode_w2_sums(const DecodeRows<T>& d, long long p, T* sh, DecodeColumns j,
                               T* sums) {
    const int dh = d.dh, h = d.h, threads = static_cast<int>(blockDim.x);
    const int slices = dh <= threads ? threads / dh : 1, n = j.j1 - j.j0;
    const int span = (n + slices - 1) / slices;
    const T *hq = sh + 3 * dh, *a1 = hq + h;
    T* part = sh + 3 * dh + 3 * h;  // [2][slices][dh]
    const T* w2 = d.w2 + p * h * dh;
    for (int i = static_cast<int>(threadIdx.x); i < slices * dh; i += threads) {
        const int c = i % dh, s = i / dh, ja = j.j0 + s * span;
        const int jb = ja + span < j.j1 ? ja + span : j.j1;
        T sy = T(0), sz = T(0);
        TITANS_PRAGMA(unroll 16)  // 16 rows' loads in flight before their products
        for (int r = ja; r < jb; ++r) {
            sy += hq[r] * w2[static_cast<long long>(r) * dh + c];
            sz += a1[r] * w2[static_cast<long long>(r) * dh + c];
        }
        part[s * dh + c] = sy;
        part[(slices + s) * dh + c] = sz;
    }
    __syncthreads();
    for (int c = static_cast<int>(threadIdx.x); c < dh; c += threads) {
        T y = T(0), z = T(0);
        for (int s = 0; s < slices; ++s) {
            y += part[s * dh + c];
            z += part[(slices + s) * dh + c];
        }
        sums[c] = y;
        sums[dh + c] = z;
    }
    __syncthreads();
}

/// Row r of pair p's read y (+ q with the residual) and error Delta_2 = z - v (+ k), z and y the
/// sums of the pair's `ranks` blocks' decode_w2_sums in rank order (their `sums`, reached in
/// distributed shared memory where ranks > 1), into the error's shared vector; `lead` (one
/// block a pair) also writes y's row and Delta_2's pending row. Returns whether a value it
/// wrote or read (v) is not finite.
template <class T>
__device__ bool decode_outputs(const DecodeRows<T>& d, long long p, int r, T* sh, T* sums,
                               int ranks, bool lead) {
    const int dh = d.dh, threads = static_cast<int>(blockDim.x);
    const T *qs = sh, *ks = sh + dh;
    T* es = sh + 2 * dh;
    const long long row = p * d.ps + static_cast<long long>(r) * dh;
    bool bad = false;
    for (int c = static_cast<int>(threadIdx.x); c < dh; c += threads) {
        T y = T(0), z = T(0);
        for (int q = 0; q < ranks; ++q) {
            const T* from = ranks > 1 ? cluster_shared(sums, static_cast<unsigned>(q)) : sums;
            y += from[c];
            z += from[dh + c];
        }
        const T e = d.residual ? (z - d.v[row + c]) + ks[c] : z - d.v[row + c];
        es[c] = e;
        if (lead) {
            d.y[row + c] = d.residual ? y + qs[c] : y;
            bad = bad || not_finite(d.y[row + c]) || not_finite(d.v[row + c]) || not_finite(e);
            put_pending(d.live.d2, d.save.d2, (p * d.b + d.o + r) * dh + c, e);
        }
    }
    return bad;
}

/// Delta_1 = (Delta_2 W2^T) . act'(z1) of row r at W2's rows [j.j0, j.j1) into its pending row
/// (a warp per row of W2, its reads coalesced, decode_rows_per_warp rows at once: warp w takes
/// rows j0 + w, j0 + w + warps, ...). blockDim.x: a multiple of 32. Returns whether a value
/// written is not finite.
template <class T>
__device__ bool decode_error_back(const DecodeRows<T>& d, long long p, int r, const T* sh,
                                  DecodeColumns j) {
    const int dh = d.dh, h = d.h, threads = static_cast<int>(blockDim.x);
    const T *es = sh + 2 * dh, *g1 = sh + 3 * dh + 2 * h;
    const T* w2 = d.w2 + p * h * dh;
    constexpr int R = decode_rows_per_warp;
    const int lane = static_cast<int>(threadIdx.x % 32), warps = threads / 32;
    bool bad = false;
    for (int jb = j.j0 + static_cast<int>(threadIdx.x / 32); jb < j.j1; jb += R * warps) {
        T s[R];
        TITANS_UNROLL
        for (int u = 0; u < R; ++u) s[u] = T(0);
        for (int c = lane; c < dh; c += 32) {
            TITANS_UNROLL
            for (int u = 0; u < R; ++u) {
                const int jr = jb + u * warps;
                if (jr < j.j1) s[u] += es[c] * w2[static_cast<long long>(jr) * dh + c];
            }
        }
        TITANS_UNROLL
        for (int u = 0; u < R; ++u) {
            const int jr = jb + u * warps;  // the same for the whole warp
            if (jr >= j.j1) break;
            const T t = warp_sum(s[u]);
            if (lane == 0) {
                put_pending(d.live.d1, d.save.d1, (p * d.b + d.o + r) * h + jr, t * g1[jr]);
                bad = bad || not_finite(t * g1[jr]);
            }
        }
    }
    return bad;
}

/// Pair p's columns of the conv kernel's work (d.conv, one tile a sequence): its q, k, v
/// columns (head p % H of sequence p / H) and its 3 gate logits, strided over the pair's
/// `ranks` blocks (a column's thread alone reads and advances its conv tail).
template <class T>
__device__ void decode_conv(const DecodeRows<T>& d, long long p, int rank, int ranks) {
    const ConvTile<T>& a = d.conv;
    const long long s = p / a.H;
    const int hd = static_cast<int>(p % a.H), cols = a.C / a.D * a.dh, gates = a.G / a.H;
    const int threads = static_cast<int>(blockDim.x);
    for (int i = rank * threads + static_cast<int>(threadIdx.x); i < cols + gates;
         i += ranks * threads) {
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

/// The row's first-layer products at the hidden columns [j.j0, j.j1): zq = q W1 and z1 = k W1
/// (qs, ks in shared memory), then hq = act(zq), A_1 = act(z1) and act'(z1) into shared memory
/// and A_1 into its pending row. Thread (s, j) sums column j over slice s of W1's rows
/// (decode_w1_slices of the range: at 512 threads and 256 columns, two slices of 32 rows, each
/// thread's 16-load batches twice, where one thread a column waited on four) into `part`;
/// thread j then adds the slices in order. Returns whether a value written is not finite.
template <class T>
__device__ bool decode_first_layer(const DecodeRows<T>& d, long long p, long long pending,
                                   T* sh, DecodeColumns jr) {
    const int dh = d.dh, h = d.h, threads = static_cast<int>(blockDim.x), n = jr.j1 - jr.j0;
    const int slices = decode_w1_slices(n, threads), span = (dh + slices - 1) / slices;
    T *qs = sh, *ks = sh + dh, *hq = sh + 3 * dh, *a1 = hq + h, *g1 = a1 + h;
    T* part = g1 + h;  // [2][slices][n]
    const T* w1 = d.w1 + p * dh * h;
    for (int i = static_cast<int>(threadIdx.x); i < slices * n; i += threads) {
        const int j = jr.j0 + i % n, s = i / n, i1 = (s + 1) * span < dh ? (s + 1) * span : dh;
        T zq = T(0), zk = T(0);
        TITANS_PRAGMA(unroll 16)  // 16 loads of W1 in flight before their products
        for (int r = s * span; r < i1; ++r) {
            const T w = w1[static_cast<long long>(r) * h + j];
            zq += qs[r] * w;
            zk += ks[r] * w;
        }
        part[s * n + i % n] = zq;
        part[(slices + s) * n + i % n] = zk;
    }
    __syncthreads();
    bool bad = false;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += threads) {
        T zq = T(0), zk = T(0);
        for (int s = 0; s < slices; ++s) {
            zq += part[s * n + i];
            zk += part[(slices + s) * n + i];
        }
        const int j = jr.j0 + i;
        const detail::ValueGrad<T> a = kernel_activate_with_grad(d.act, zk);
        hq[j] = kernel_activate(d.act, zq);
        a1[j] = a.value;
        g1[j] = a.grad;
        put_pending(d.live.a1, d.save.a1, pending * h + j, a.value);
        bad = bad || not_finite(a.value);
    }
    return bad;
}

/// The `ranks` blocks of a pair agree: a cluster barrier (ranks > 1; it also orders what the
/// lead wrote to device memory before it), else the block's.
__device__ inline void decode_barrier(int ranks) {
    if (ranks > 1) {
        cluster_sync();
    } else {
        __syncthreads();
    }
}

/// Pair p's rows for block `rank` of its `ranks` (decode_rows_kernel: 1 a pair; the cluster
/// kernel: decode_cluster_ranks): the read and the key pass of the file comment, each block on
/// its share of the hidden columns (DecodeColumns), the second layer's sums added across the
/// blocks in rank order. The conv first (when d.conv.u is given), its columns strided over the
/// blocks. Each block divides its copy of a row's q and k by their L2 norm in shared memory;
/// the lead (rank 0) alone writes them back, once every block has read the row, and writes
/// the keys', gates', y's and Delta_2's rows.
template <class T>
__device__ void decode_pair(const DecodeRows<T>& d, long long p, int rank, int ranks) {
    const bool lead = rank == 0;
    if (d.conv.u != nullptr) {
        decode_conv(d, p, rank, ranks);
    }
    const int dh = d.dh, threads = static_cast<int>(blockDim.x);
    const DecodeColumns cols(d.h, rank, ranks);
    T* sh = dynamic_shared<T>();
    T *qs = sh, *ks = sh + dh;
    T* sums = sh + decode_sums_at(dh, d.h, threads, ranks);  // 2 x d_h
    bool bad = false;  // a non-finite entry among those this thread read or wrote
    for (int r = 0; r < d.m; ++r) {
        const long long row = p * d.ps + static_cast<long long>(r) * dh;
        decode_barrier(ranks);  // the blocks' conv written; the last row's reads done
        for (int c = static_cast<int>(threadIdx.x); c < dh; c += threads) {
            qs[c] = d.q[row + c];
            ks[c] = d.k[row + c];
        }
        __syncthreads();
        if (d.norm && threadIdx.x < 64) {  // warp 0 the query, warp 1 the key
            l2_row(threadIdx.x < 32 ? qs : ks, dh, static_cast<int>(threadIdx.x % 32));
        }
        __syncthreads();
        const long long pending = p * d.b + d.o + r;
        for (int c = static_cast<int>(threadIdx.x); lead && c < dh; c += threads) {
            put_pending(d.live.a0, d.save.a0, pending * dh + c, ks[c]);
            bad = bad || not_finite(qs[c]) || not_finite(ks[c]);
        }
        if (lead && d.live.gates != nullptr && threadIdx.x < 3) {
            const T g = d.lp[p * d.lps + 3 * r + threadIdx.x];
            put_pending(d.live.gates, d.save.gates, pending * 3 + threadIdx.x, g);
            bad = bad || not_finite(g);
        }
        __syncthreads();
        bad = decode_first_layer(d, p, pending, sh, cols) || bad;
        __syncthreads();
        decode_w2_sums(d, p, sh, cols, sums);
        if (ranks > 1) {
            cluster_sync();  // every block's sums written
        }
        bad = decode_outputs(d, p, r, sh, sums, ranks, lead) || bad;
        for (int c = static_cast<int>(threadIdx.x); lead && d.norm && c < dh; c += threads) {
            d.q[row + c] = qs[c];  // every block has read the row (the barriers above)
            d.k[row + c] = ks[c];
        }
        __syncthreads();
        bad = decode_error_back(d, p, r, sh, cols) || bad;
    }
    if (ranks > 1) {
        cluster_sync();  // no block leaves while another may still read its sums
    }
    if (bad && d.raise != nullptr) {
        atomicMax(d.raise, 1u);
    }
}

/// A block per pair (blockIdx.x), its m rows one after the other: decode_pair. Dynamic shared
/// memory: decode_shared_bytes; decode_block_threads<T>(gridDim.x) threads.
template <class T>
__global__ void TITANS_MAX_REGISTERS(decode_registers<T>) decode_rows_kernel(DecodeRows<T> d) {
    decode_pair(d, blockIdx.x, 0, 1);
}

/// decode_rows_kernel with d.ranks blocks a pair in a cluster (blockIdx.x = p * ranks + rank):
/// each block on h / ranks of the hidden columns, so that a few pairs (B = 1: 8) spread over
/// ranks times the SMs. Dynamic shared memory: decode_shared_bytes(.., d.ranks).
template <class T>
__global__ void decode_cluster_kernel(DecodeRows<T> d) {
    decode_pair(d, blockIdx.x / d.ranks, static_cast<int>(cluster_rank()), d.ranks);
}
#endif

}  // namespace titans::backend::cuda
