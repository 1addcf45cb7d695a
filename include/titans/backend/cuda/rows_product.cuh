#pragma once
// titans/backend/cuda/rows_product.cuh: C = alpha A B + beta C for a few rows of A (a decoded
// token's products: one row per sequence), batched, opt-in (set_rows_product).
//
// A decoded token of the four-block model makes 21 products of 1 to a few rows by a weight of
// d x (d to 4d); cuBLAS took 3.9-8.6 us each on an H200 (137 us of a 408 us token, Nsight
// Compute), where reading the weight once takes 0.2-0.9 us. Such a product is a stream through
// B: here warps all over the GPU each read a piece of it, many loads in flight, and add up in a
// fixed order. Block (x, y) takes the 32 columns [32 x, 32 x + 32) (lane = column: a warp's
// loads of a row of B are one coalesced 128-byte line for float) and, per pass, the
// rows_product_span rows of B from y's: warp w loads rows_product_depth rows of its column at
// once, then multiplies them by every row of A; passes stride by gridDim.y spans. The block's
// 8 warps' sums are added in warp order (a thread per (row of C, column)); with one block in y
// it writes C, otherwise its partial sums, and the block of the column tile that finishes last
// (a counter per tile, zero before and after a launch) adds the partials in order of y. Every
// sum's order is fixed by k alone: the same bits every call, with or without call graphs. A
// batch of products (the memory's, a product per (sequence, head) pair) takes blockIdx.z.
//
//     titans::backend::cuda::set_rows_product(true);  // or TITANS_ROWS_PRODUCT=1
//     y = model.forward(state, x);  // each product of <= 8 rows: this kernel, not cuBLAS

#include <atomic>
#include <cstddef>

#include "launch.cuh"
#include "partial_scratch.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// Process-wide switch for the few-row product: off by default (not yet timed against cuBLAS
/// on a GPU; docs/cuda.md), on from the start when the environment sets TITANS_ROWS_PRODUCT=1.
inline std::atomic<bool>& rows_product_flag() {
    static std::atomic<bool> flag{env_switch("TITANS_ROWS_PRODUCT")};
    return flag;
}
inline void set_rows_product(bool on) { rows_product_flag().store(on); }
[[nodiscard]] inline bool rows_product() { return rows_product_flag().load(); }

/// At most this many rows of A take the few-row product; the warps of its block; the rows of
/// B a warp loads before it uses them; the rows of B a block's pass takes; the most blocks in
/// y (past it, a block's warps take more passes).
inline constexpr int rows_product_max = 8;
inline constexpr int rows_product_warps = 8;
inline constexpr int rows_product_depth = 16;
inline constexpr int rows_product_span = rows_product_warps * rows_product_depth;
inline constexpr int rows_product_splits_max = 64;

/// What rows_product_kernel reads and writes: product z < gridDim.z of A (m x k, row stride
/// lda, at a + z sa), B (k x n, ldb, at b + z sb), C (m x n, ldc, at c + z sc), all row-major;
/// with more than one block in y, part (gridDim.z x gridDim.y x m x n) and done (gridDim.z x
/// gridDim.x counters, zero before and after a launch). beta == 0: C is written, not read.
template <class T>
struct RowsProduct {
    const T* a;
    long long lda, sa;
    const T* b;
    long long ldb, sb;
    T* c;
    long long ldc, sc;
    T* part;
    unsigned* done;
    int m, n, k;
    T alpha, beta;
};

#if TITANS_CUDA_DEVICE_CODE
/// acc[r] += A[r, i + u] v[u] for u < K and every row r < m, in order of u: K rows of B's
/// column, already loaded, into the row sums.
template <class T, int K>
__device__ __forceinline__ void rows_product_add(const RowsProduct<T>& p, long long i,
                                                 const T (&v)[K], T (&acc)[rows_product_max]) {
    TITANS_UNROLL
    for (int r = 0; r < rows_product_max; ++r) {
        if (r < p.m) {
            const T* a = p.a + r * p.lda + i;
            TITANS_UNROLL
            for (int u = 0; u < K; ++u) acc[r] += a[u] * v[u];
        }
    }
}

/// This thread's sums for column `col` over the rows of B its warp `w` takes (see the file
/// comment): rows_product_depth loads in flight, then their products with every row of A.
template <class T>
__device__ void rows_product_sums(const RowsProduct<T>& p, int col, int w,
                                  T (&acc)[rows_product_max]) {
    constexpr int K = rows_product_depth;
    const T* b = p.b + col;
    const long long stride = static_cast<long long>(gridDim.y) * rows_product_span;
    for (long long i = static_cast<long long>(blockIdx.y) * rows_product_span + w * K; i < p.k;
         i += stride) {
        if (i + K <= p.k) {
            T v[K];
            TITANS_UNROLL
            for (int u = 0; u < K; ++u) v[u] = b[(i + u) * p.ldb];
            rows_product_add(p, i, v, acc);
        } else {
            for (long long j = i; j < p.k; ++j) {
                const T v[1] = {b[j * p.ldb]};
                rows_product_add(p, j, v, acc);
            }
        }
    }
}

/// C[r, col] = alpha s + beta C[r, col] (C not read where beta is 0).
template <class T>
__device__ __forceinline__ void rows_product_store(const RowsProduct<T>& p, int r, int col, T s) {
    T* c = p.c + r * p.ldc + col;
    *c = p.beta == T(0) ? p.alpha * s : p.alpha * s + p.beta * *c;
}

/// The last block of column tile x: C's entries from the partials of the gridDim.y blocks
/// (p.part: this block's), added in order of y.
template <class T>
__device__ void rows_product_sum_parts(const RowsProduct<T>& p, int r, int col) {
    const volatile T* at = p.part - static_cast<long long>(blockIdx.y) * p.m * p.n +
                           static_cast<long long>(r) * p.n + col;  // (other blocks')
    const long long m = static_cast<long long>(p.m) * p.n;  // block y's entry: at[y * m]
    rows_product_store(p, r, col, sum_parts_in_order(at, m, gridDim.y));
}

/// C = alpha A B + beta C for m <= rows_product_max rows (see the file comment); blocks of
/// rows_product_warps warps.
template <class T>
__global__ void rows_product_kernel(RowsProduct<T> p) {
    constexpr int R = rows_product_max, W = rows_product_warps;
    const long long z = blockIdx.z;
    p.a += z * p.sa;
    p.b += z * p.sb;
    p.c += z * p.sc;
    if (gridDim.y > 1) {  // this block's partials and its column tile's counter
        p.part += (z * gridDim.y + blockIdx.y) * p.m * p.n;
        p.done += z * gridDim.x + blockIdx.x;
    }
    __shared__ T red[W * R * 32];
    __shared__ bool last;
    const int lane = static_cast<int>(threadIdx.x) % 32, w = static_cast<int>(threadIdx.x) / 32;
    const int col = static_cast<int>(blockIdx.x) * 32 + lane;
    T acc[R];
    TITANS_UNROLL
    for (int r = 0; r < R; ++r) acc[r] = T(0);
    if (col < p.n) {
        rows_product_sums(p, col, w, acc);
    }
    TITANS_UNROLL
    for (int r = 0; r < R; ++r) red[(w * R + r) * 32 + lane] = acc[r];
    __syncthreads();
    const int r = w;  // this thread now adds row r's sums of the W warps, in warp order
    const bool mine = r < p.m && col < p.n;
    T s = T(0);
    if (mine) {
        for (int q = 0; q < W; ++q) s += red[(q * R + r) * 32 + lane];
    }
    if (gridDim.y == 1) {
        if (mine) rows_product_store(p, r, col, s);
        return;
    }
    if (mine) p.part[static_cast<long long>(r) * p.n + col] = s;
    __threadfence();  // this block's partials visible before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(p.done, 1u) == gridDim.y - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    if (mine) rows_product_sum_parts(p, r, col);
    if (threadIdx.x == 0) {
        *p.done = 0;  // for the next launch
    }
}
#endif

/// Whether a batch of products C = op(A) op(B) of m rows takes rows_product (the switch on,
/// neither operand transposed, 1 to rows_product_max rows, a batch within a grid's z).
[[nodiscard]] inline bool rows_product_applies(bool trans_a, bool trans_b, int m, int batch) {
    return rows_product() && !trans_a && !trans_b && batch >= 1 && batch <= 65535 && m >= 1 &&
           m <= rows_product_max;
}

/// Launches rows_product_kernel on `stream` for `batch` products p (p.m in
/// 1..rows_product_max; part and done from this thread's PartialScratch where a product takes
/// more than one block in y).
template <class T>
void rows_product(cudaStream_t stream, RowsProduct<T> p, int batch) {
    const long long spans =
        (static_cast<long long>(p.k) + rows_product_span - 1) / rows_product_span;
    const unsigned gx = static_cast<unsigned>((p.n + 31) / 32);
    const unsigned gy = static_cast<unsigned>(
        spans < 1 ? 1 : spans < rows_product_splits_max ? spans : rows_product_splits_max);
    if (gy > 1) {
        auto& s = PartialScratch<T>::mine();
        const auto z = static_cast<std::size_t>(batch);
        s.reserve(z * gy * static_cast<std::size_t>(p.m) * static_cast<std::size_t>(p.n), z * gx);
        p.part = s.part.data();
        p.done = s.done.data();
    }
    launch(rows_product_kernel<T>, dim3(gx, gy, static_cast<unsigned>(batch)),
           rows_product_warps * 32, stream, p);
    check_launch("the few-row product");
}

}  // namespace titans::backend::cuda
