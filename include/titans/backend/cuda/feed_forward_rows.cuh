#pragma once
// titans/backend/cuda/feed_forward_rows.cuh: the feed-forward of a few rows (a decode token's)
// in one launch (math §7): y = act(x W1 [⊙ x W3]) W2, opt-in (set_fused_feed_forward).
//
// A decoded token's feed-forward is one row per sequence: two cuBLAS products and the
// activation between them are three launches (three nodes of a call graph) of a few
// microseconds' work each. Here one kernel does all of it for up to feed_forward_rows_max
// rows: block b takes the hidden units [32 b, 32 b + 32): its slice of x [W1 | W3] (each sum
// over d split into 8 pieces, a warp each, added in order) and the activation into shared
// memory, then its slice's share of the output, x W2 restricted to those rows of W2. A single
// block (hidden width <= 32) writes y; otherwise each block writes its partial output, and
// the block that finishes last (a counter, kept zero across launches) sums the partials in
// block order into y. The order of every sum is fixed: the same bits
// every call, with or without call graphs.
//
// In a block the feed-forward sits between two residual sums, each followed by a norm:
// s = a + s, u = RMSNorm_ffn(s), y = FFN(u), s = y + s, u' = RMSNorm_next(s). Given `pre`
// and `then`, the kernel does all of it: each block first takes the rows' sums and norms
// itself (rms_row, rms_rows.cuh, into its own slice of the scratch; block 0 writes u), and the
// block that writes y then writes s = a + s, s = y + s and u', row by row as rms_rows_kernel
// does: the same bits as the three launches.
//
//     titans::backend::cuda::set_fused_feed_forward(true);  // or TITANS_FUSED_FFN=1
//     y = model.forward(state, x);  // a feed-forward of <= 16 rows: one launch, not three

#include <atomic>

#include "../../detail/activation.hpp"
#include "launch.cuh"
#include "partial_scratch.cuh"
#include "rms_rows.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// Process-wide switch for the one-launch feed-forward of few rows: off by default (not yet
/// faster than cuBLAS's three launches on an H200; docs/cuda.md), on from the start when the
/// environment sets TITANS_FUSED_FFN=1.
inline std::atomic<bool>& fused_feed_forward_flag() {
    static std::atomic<bool> flag{env_switch("TITANS_FUSED_FFN")};
    return flag;
}
inline void set_fused_feed_forward(bool on) { fused_feed_forward_flag().store(on); }
[[nodiscard]] inline bool fused_feed_forward() { return fused_feed_forward_flag().load(); }

/// At most this many rows take the one-launch feed-forward; the hidden units a block takes;
/// its threads.
inline constexpr int feed_forward_rows_max = 16;
inline constexpr int feed_forward_slice = 32;
inline constexpr int feed_forward_threads = 256;
/// The pieces of [0, d) a block's hidden sums are split into, a warp each; the entries of a
/// weight column a thread loads before it uses them (its loads in flight at once).
inline constexpr int feed_forward_parts = feed_forward_threads / feed_forward_slice;
inline constexpr int feed_forward_unroll = 8;

/// What feed_forward_rows_kernel reads and writes: x (rows x d, row stride xs), w13 = [W1 | W3]
/// (SwiGLU) or W1, d x ld13 row-major, w2 (h x d row-major), y (rows x d, row stride ys); with
/// more than one block (or with pre), part (blocks x rows x d) and done (zero before and after
/// a launch). With pre.w set (then.w too), x is pre's norm of pre.add + pre.x (pre.sum set by
/// the kernel, pre.y: u); with then.w set, the residual sum and norm after it (then.add = y,
/// then.x = then.sum = s).
template <class T>
struct FeedForwardRows {
    const T* x;
    long long xs;
    const T* w13;
    int ld13;
    const T* w2;
    T* y;
    long long ys;
    T* part;
    unsigned* done;
    int rows, d, h;
    bool swiglu;
    RmsRows<T> pre, then;
};

#if TITANS_CUDA_DEVICE_CODE
/// s[r] += x[r, i + u] v1[u], g[r] += x[r, i + u] v3[u] for u < K and every row, in order of
/// u: the sums of feed_forward_hidden for K entries of W1's and W3's columns already loaded.
template <class T, int K>
__device__ __forceinline__ void feed_forward_accumulate(const FeedForwardRows<T>& a, int i,
                                                        const T (&v1)[K], const T (&v3)[K],
                                                        T (&s)[feed_forward_rows_max],
                                                        T (&g)[feed_forward_rows_max]) {
    TITANS_UNROLL
    for (int r = 0; r < feed_forward_rows_max; ++r) {
        if (r < a.rows) {
            const T* x = a.x + r * a.xs + i;
            TITANS_UNROLL
            for (int u = 0; u < K; ++u) {
                s[r] += x[u] * v1[u];
                g[r] += x[u] * v3[u];
            }
        }
    }
}

/// Block b's hidden units, each row's act(x W1)(⊙ x W3) for j in [32 b, 32 b + S), into hid
/// (rows x 32). Warp q sums the q-th of feed_forward_parts contiguous pieces of i in [0, d) for
/// the 32 units (lane = unit: coalesced loads of W1's and W3's rows) and every row at once
/// (rows <= 16 sums a thread), feed_forward_unroll entries of W1 and W3 loaded before their
/// products, so that a thread waits for memory d / 64 times, not d; then, row by row, the
/// first warp adds the 8 pieces in order (red: 2 x 256 shared entries). Every sum's order is
/// fixed by d alone.
template <class T>
__device__ void feed_forward_hidden(const FeedForwardRows<T>& a, T* hid, T* red, int j0, int S) {
    constexpr int U = feed_forward_slice, R = feed_forward_rows_max, K = feed_forward_unroll;
    const int jj = static_cast<int>(threadIdx.x) % U, q = static_cast<int>(threadIdx.x) / U;
    const int piece = (a.d + feed_forward_parts - 1) / feed_forward_parts;
    const int i0 = q * piece, i1 = i0 + piece < a.d ? i0 + piece : a.d;
    T s[R], g[R];
    TITANS_UNROLL
    for (int r = 0; r < R; ++r) s[r] = g[r] = T(0);
    if (jj < S) {
        const T* w1 = a.w13 + j0 + jj;
        const T* w3 = w1 + a.h;
        int i = i0;
        for (; i + K <= i1; i += K) {
            T v1[K], v3[K];
            TITANS_UNROLL
            for (int u = 0; u < K; ++u) {
                v1[u] = w1[static_cast<long long>(i + u) * a.ld13];
            }
            if (a.swiglu) {  // (one branch for the K loads, not one each)
                TITANS_UNROLL
                for (int u = 0; u < K; ++u) v3[u] = w3[static_cast<long long>(i + u) * a.ld13];
            } else {
                TITANS_UNROLL
                for (int u = 0; u < K; ++u) v3[u] = T(0);
            }
            feed_forward_accumulate(a, i, v1, v3, s, g);
        }
        for (; i < i1; ++i) {
            const long long at = static_cast<long long>(i) * a.ld13;
            const T v1[1] = {w1[at]}, v3[1] = {a.swiglu ? w3[at] : T(0)};
            feed_forward_accumulate(a, i, v1, v3, s, g);
        }
    }
    TITANS_UNROLL
    for (int r = 0; r < R; ++r) {
        if (r >= a.rows) break;
        red[q * U + jj] = s[r];
        red[feed_forward_threads + q * U + jj] = g[r];
        __syncthreads();
        if (q == 0 && jj < S) {
            T x1 = T(0), x3 = T(0);
            for (int p = 0; p < feed_forward_parts; ++p) {
                x1 += red[p * U + jj];
                x3 += red[feed_forward_threads + p * U + jj];
            }
            hid[r * U + jj] = a.swiglu ? detail::silu(x1) * x3 : detail::gelu(x1);
        }
        __syncthreads();  // red free for the next row
    }
}

/// With a.pre.w set, before the feed-forward: each row's sum pre.add + pre.x and its norm, by
/// every block for itself (rms_row; part: 256 shared entries), the sums into the block's slice
/// of a.part, the norms into pre.y (block 0: u) or the same slice (the others); x then reads
/// them. The slice takes the block's partial output later, once the hidden units are made.
template <class T>
__device__ void feed_forward_before(FeedForwardRows<T>& a, T* part) {
    if (a.pre.w == nullptr) {
        return;
    }
    RmsRows<T> pre = a.pre;
    pre.sum = a.part + static_cast<long long>(blockIdx.x) * a.rows * a.d;
    pre.ss = a.d;
    if (blockIdx.x != 0) {
        pre.y = pre.sum;
        pre.ys = a.d;
    }
    for (int r = 0; r < a.rows; ++r) {
        rms_row(pre, r, part);
    }
    __syncthreads();  // the rows, written by this block's threads, visible to all of them
    a.x = pre.y;
    a.xs = pre.ys;
}

/// With a.then.w set, after the block has written y: each row's residual sum and norm
/// (rms_row with then.add = y; part: 256 shared entries), and first, with a.pre.w set, the
/// sum before the feed-forward into s (then.sum), as feed_forward_before took it.
template <class T>
__device__ void feed_forward_then(const FeedForwardRows<T>& a, T* part) {
    if (a.then.w == nullptr) {
        return;
    }
    __syncthreads();  // y, written by this block's threads, visible to all of them
    const RmsRows<T>& pre = a.pre;
    for (int r = 0; r < a.rows; ++r) {
        if (pre.w != nullptr) {
            for (int j = threadIdx.x; j < a.d; j += blockDim.x) {
                a.then.sum[r * a.then.ss + j] = pre.add[r * pre.as + j] + pre.x[r * pre.xs + j];
            }
        }
        rms_row(a.then, r, part);  // reads the entries of s this thread wrote
    }
}

/// The last block's work: y = the sum of the blocks' partial outputs, in block order.
template <class T>
__device__ void feed_forward_sum_parts(const FeedForwardRows<T>& a) {
    const int n = a.rows * a.d;  // block b's entry i: a.part[b * n + i]
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
        a.y[(i / a.d) * a.ys + i % a.d] = sum_parts_in_order<T>(a.part + i, n, gridDim.x);
    }
}

/// y = act(x W1 [⊙ x W3]) W2 for rows <= feed_forward_rows_max (see the file comment).
template <class T>
__global__ void feed_forward_rows_kernel(FeedForwardRows<T> a) {
    __shared__ T hid[feed_forward_rows_max * feed_forward_slice];
    __shared__ T part[feed_forward_threads];
    __shared__ T red[2 * feed_forward_threads];
    __shared__ bool last;
    const int j0 = static_cast<int>(blockIdx.x) * feed_forward_slice;
    const int S = a.h - j0 < feed_forward_slice ? a.h - j0 : feed_forward_slice;
    feed_forward_before(a, part);
    feed_forward_hidden(a, hid, red, j0, S);
    const bool whole = gridDim.x == 1;
    for (int c = static_cast<int>(threadIdx.x); c < a.d; c += static_cast<int>(blockDim.x)) {
        T acc[feed_forward_rows_max];
        TITANS_UNROLL
        for (int r = 0; r < feed_forward_rows_max; ++r) acc[r] = T(0);
        const T* w2 = a.w2 + static_cast<long long>(j0) * a.d + c;
        int k = 0;
        for (; k + feed_forward_unroll <= S; k += feed_forward_unroll) {  // loads first
            T w[feed_forward_unroll];
            TITANS_UNROLL
            for (int u = 0; u < feed_forward_unroll; ++u) {
                w[u] = w2[static_cast<long long>(k + u) * a.d];
            }
            TITANS_UNROLL
            for (int r = 0; r < feed_forward_rows_max; ++r) {
                TITANS_UNROLL
                for (int u = 0; u < feed_forward_unroll; ++u) {
                    if (r < a.rows) acc[r] += hid[r * feed_forward_slice + k + u] * w[u];
                }
            }
        }
        for (; k < S; ++k) {
            const T w = w2[static_cast<long long>(k) * a.d];
            TITANS_UNROLL
            for (int r = 0; r < feed_forward_rows_max; ++r) {
                if (r < a.rows) acc[r] += hid[r * feed_forward_slice + k] * w;
            }
        }
        TITANS_UNROLL
        for (int r = 0; r < feed_forward_rows_max; ++r) {
            if (r >= a.rows) continue;
            if (whole) {
                a.y[r * a.ys + c] = acc[r];
            } else {
                a.part[(static_cast<long long>(blockIdx.x) * a.rows + r) * a.d + c] = acc[r];
            }
        }
    }
    if (whole) {
        feed_forward_then(a, part);
        return;
    }
    __threadfence();  // this block's partials visible before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(a.done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    feed_forward_sum_parts(a);
    if (threadIdx.x == 0) {
        *a.done = 0;  // for the next launch
    }
    feed_forward_then(a, part);
}
#endif

/// Whether a feed-forward of `rows` rows takes feed_forward_rows (the switch on, 1 to
/// feed_forward_rows_max rows).
[[nodiscard]] inline bool feed_forward_rows_apply(long long rows) {
    return fused_feed_forward() && rows >= 1 && rows <= feed_forward_rows_max;
}

/// Launches feed_forward_rows_kernel on `stream` for a.rows (1 to feed_forward_rows_max) rows,
/// its scratch from this thread's PartialScratch (a.pre.w set: a.then.w too).
template <class T>
void feed_forward_rows(cudaStream_t stream, FeedForwardRows<T> a) {
    const unsigned blocks =
        static_cast<unsigned>((a.h + feed_forward_slice - 1) / feed_forward_slice);
    if (blocks > 1 || a.pre.w != nullptr) {
        auto& s = PartialScratch<T>::mine();
        s.reserve(static_cast<std::size_t>(blocks) * static_cast<std::size_t>(a.rows) *
                      static_cast<std::size_t>(a.d),
                  1);
        a.part = s.part.data();
        a.done = s.done.data();
    }
    launch(feed_forward_rows_kernel<T>, blocks, feed_forward_threads, stream, a);
    check_launch("the feed-forward of few rows");
}

}  // namespace titans::backend::cuda
