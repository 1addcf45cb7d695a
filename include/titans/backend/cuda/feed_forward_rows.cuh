#pragma once
// titans/backend/cuda/feed_forward_rows.cuh: the feed-forward of a few rows (a decode token's)
// in one launch (math §7): y = act(x W1 [⊙ x W3]) W2, opt-in (set_fused_feed_forward).
//
// A decoded token's feed-forward is one row per sequence: two cuBLAS products and the
// activation between them are three launches (three nodes of a call graph) of a few
// microseconds' work each. Here one kernel does all of it for up to feed_forward_rows_max
// rows: block b takes the hidden units [64 b, 64 b + 64): its slice of x [W1 | W3] and the
// activation into shared memory, then its slice's share of the output, x W2 restricted to
// those rows of W2. A single block (hidden width <= 64) writes y; otherwise each block writes
// its partial output, and the block that finishes last (a counter, kept zero across launches)
// sums the partials in block order into y. The order of every sum is fixed: the same bits
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
#include "rms_rows.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// Process-wide switch for the one-launch feed-forward of few rows: off by default until timed
/// on a GPU (docs/cuda.md), on from the start when the environment sets TITANS_FUSED_FFN=1.
inline std::atomic<bool>& fused_feed_forward_flag() {
    static std::atomic<bool> flag{env_switch("TITANS_FUSED_FFN")};
    return flag;
}
inline void set_fused_feed_forward(bool on) { fused_feed_forward_flag().store(on); }
[[nodiscard]] inline bool fused_feed_forward() { return fused_feed_forward_flag().load(); }

/// At most this many rows take the one-launch feed-forward; the hidden units a block takes;
/// its threads.
inline constexpr int feed_forward_rows_max = 16;
inline constexpr int feed_forward_slice = 64;
inline constexpr int feed_forward_threads = 256;

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
/// Block b's hidden units, each row's act(x W1)(⊙ x W3) for j in [64 b, 64 b + S), into hid
/// (rows x 64): a thread per unit and row group, each sum in order over d.
template <class T>
__device__ void feed_forward_hidden(const FeedForwardRows<T>& a, T* hid, int j0, int S) {
    const int jj = static_cast<int>(threadIdx.x) % feed_forward_slice;
    const int lanes = static_cast<int>(blockDim.x) / feed_forward_slice;
    if (jj >= S) {
        return;
    }
    const T* w1 = a.w13 + j0 + jj;
    const T* w3 = w1 + a.h;
    for (int r = static_cast<int>(threadIdx.x) / feed_forward_slice; r < a.rows; r += lanes) {
        const T* x = a.x + r * a.xs;
        T s = T(0), g = T(0);
        for (int i = 0; i < a.d; ++i) {
            const long long at = static_cast<long long>(i) * a.ld13;
            s += x[i] * w1[at];
            if (a.swiglu) g += x[i] * w3[at];
        }
        hid[r * feed_forward_slice + jj] = a.swiglu ? detail::silu(s) * g : detail::gelu(s);
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

/// y = act(x W1 [⊙ x W3]) W2 for rows <= feed_forward_rows_max (see the file comment).
template <class T>
__global__ void feed_forward_rows_kernel(FeedForwardRows<T> a) {
    __shared__ T hid[feed_forward_rows_max * feed_forward_slice];
    __shared__ T part[feed_forward_threads];
    __shared__ bool last;
    const int j0 = static_cast<int>(blockIdx.x) * feed_forward_slice;
    const int S = a.h - j0 < feed_forward_slice ? a.h - j0 : feed_forward_slice;
    feed_forward_before(a, part);
    feed_forward_hidden(a, hid, j0, S);
    __syncthreads();
    const bool whole = gridDim.x == 1;
    for (int c = static_cast<int>(threadIdx.x); c < a.d; c += static_cast<int>(blockDim.x)) {
        T acc[feed_forward_rows_max];
        TITANS_UNROLL
        for (int r = 0; r < feed_forward_rows_max; ++r) acc[r] = T(0);
        for (int k = 0; k < S; ++k) {
            const T w = a.w2[static_cast<long long>(j0 + k) * a.d + c];
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
    const volatile T* blocks = a.part;  // (written by other blocks: not through this SM's L1)
    const int n = a.rows * a.d;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) {
        const int r = i / a.d, c = i % a.d;
        T s = T(0);
        for (unsigned b = 0; b < gridDim.x; ++b) {
            s += blocks[(static_cast<long long>(b) * a.rows + r) * a.d + c];
        }
        a.y[r * a.ys + c] = s;
    }
    if (threadIdx.x == 0) {
        *a.done = 0;  // for the next launch
    }
    feed_forward_then(a, part);
}
#endif

/// This host thread's partial sums and counter for feed_forward_rows (its launches are all on
/// the thread's stream, one after another): grown, never shrunk; the counter zeroed once.
template <class T>
struct FeedForwardRowsScratch {
    DeviceBuffer<T> part;
    DeviceBuffer<unsigned> done;

    static FeedForwardRowsScratch& mine() {
        thread_local FeedForwardRowsScratch s;
        return s;
    }
    /// Room for n partial entries (what the recorded work holds runs first if it grows).
    void reserve(std::size_t n) {
        if (done.size() == 0) {
            settle_recorded();
            done = DeviceBuffer<unsigned>(1);
            set_now(done.data(), 0, sizeof(unsigned), "cudaMemset (feed-forward counter)");
        }
        if (part.size() < n) {
            settle_recorded();  // the old buffer may be read by recorded work
            part.reserve(n);
        }
    }
};

/// Whether a feed-forward of `rows` rows takes feed_forward_rows (the switch on, 1 to
/// feed_forward_rows_max rows).
[[nodiscard]] inline bool feed_forward_rows_apply(long long rows) {
    return fused_feed_forward() && rows >= 1 && rows <= feed_forward_rows_max;
}

/// Launches feed_forward_rows_kernel on `stream` for a.rows (1 to feed_forward_rows_max) rows,
/// its scratch from this thread's FeedForwardRowsScratch (a.pre.w set: a.then.w too).
template <class T>
void feed_forward_rows(cudaStream_t stream, FeedForwardRows<T> a) {
    const unsigned blocks =
        static_cast<unsigned>((a.h + feed_forward_slice - 1) / feed_forward_slice);
    if (blocks > 1 || a.pre.w != nullptr) {
        auto& s = FeedForwardRowsScratch<T>::mine();
        s.reserve(static_cast<std::size_t>(blocks) * static_cast<std::size_t>(a.rows) *
                  static_cast<std::size_t>(a.d));
        a.part = s.part.data();
        a.done = s.done.data();
    }
    launch(feed_forward_rows_kernel<T>, blocks, feed_forward_threads, stream, a);
    check_launch("the feed-forward of few rows");
}

}  // namespace titans::backend::cuda
