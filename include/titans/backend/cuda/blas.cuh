#pragma once
// titans/backend/cuda/blas.cuh: row-major (strided-batched) GEMM on cuBLAS, float and double.

#include <cstdint>
#include <cstring>

#include "call_graph.cuh"
#include "rows_product.cuh"
#include "runtime.cuh"

namespace titans::backend::cuda {

/// One operand of a batched product: matrix i of the batch starts at data + i * batch_stride,
/// row r of it at + r * ld (row-major).
template <class T>
struct Operand {
    const T* data;
    int ld;
    long long batch_stride = 0;
};

namespace tape_detail {
/// A product's arguments as its tape record keeps them (no padding: compared as bytes; alpha
/// and beta as their bits).
template <class T>
struct GemmArgs {
    cublasHandle_t h;
    const T *a, *b;
    T* c;
    long long a_stride, b_stride, c_stride;
    std::uint64_t alpha, beta;
    std::int32_t trans_a, trans_b, m, n, k, lda, ldb, ldc, batch, pad = 0;
};

template <class T>
std::uint64_t bits_of(T v) {
    std::uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
T from_bits(std::uint64_t u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}

/// The product now, on its handle's stream.
template <class T>
cublasStatus_t gemm_now(const GemmArgs<T>& g) {
    const cublasOperation_t oa = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t ob = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const T alpha = from_bits<T>(g.alpha), beta = from_bits<T>(g.beta);
    if constexpr (sizeof(T) == 4) {
        return cublasSgemmStridedBatched(g.h, ob, oa, g.n, g.m, g.k, &alpha, g.b, g.ldb,
                                         g.b_stride, g.a, g.lda, g.a_stride, &beta, g.c, g.ldc,
                                         g.c_stride, g.batch);
    } else {
        return cublasDgemmStridedBatched(g.h, ob, oa, g.n, g.m, g.k, &alpha, g.b, g.ldb,
                                         g.b_stride, g.a, g.lda, g.a_stride, &beta, g.c, g.ldc,
                                         g.c_stride, g.batch);
    }
}

/// A recorded product run on `stream` (its handle's: the tape records one stream).
template <class T>
void run_gemm(const unsigned char* bytes, const Record& r, cudaStream_t) {
    GemmArgs<T> g;
    std::memcpy(&g, bytes + r.at, sizeof(g));
    if (gemm_now(g) != CUBLAS_STATUS_SUCCESS) {
        throw CudaError("titans (CUDA backend): a recorded cuBLAS product failed");
    }
}
}  // namespace tape_detail

/// C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch, every matrix row-major: op(A_i) is
/// m x k, op(B_i) k x n, C_i m x n. Row-major C is column-major C^T = op(B)^T op(A)^T, so
/// the call swaps the operands. cuBLAS picks its own algorithm (TF32 only when the handle's
/// math mode allows it). Recorded on this thread's call tape where it records the handle's
/// stream (call_graph.cuh). With the few-row product switched on (rows_product.cuh), products
/// of at most rows_product_max rows, neither operand transposed, run in rows_product_kernel
/// on the handle's stream instead (FP32 or FP64 sums, never TF32).
template <class T>
void gemm(cublasHandle_t h, bool trans_a, bool trans_b, int m, int n, int k, T alpha,
          Operand<T> a, Operand<T> b, T beta, T* c, int ldc, long long c_stride, int batch) {
    if (m == 0 || n == 0 || batch == 0) {
        return;
    }
    if (rows_product_applies(trans_a, trans_b, m, batch)) {
        cudaStream_t stream{};
        check(cublasGetStream(h, &stream), "cublasGetStream");
        rows_product<T>(stream,
                        {a.data, a.ld, a.batch_stride, b.data, b.ld, b.batch_stride, c, ldc,
                         c_stride, nullptr, nullptr, m, n, k, alpha, beta},
                        batch);
        return;
    }
    const tape_detail::GemmArgs<T> g{h, a.data, b.data, c, a.batch_stride, b.batch_stride,
                                     c_stride, tape_detail::bits_of(alpha),
                                     tape_detail::bits_of(beta), trans_a, trans_b, m, n, k,
                                     a.ld, b.ld, ldc, batch};
    if (call_tape().recording()) {
        cudaStream_t stream{};
        check(cublasGetStream(h, &stream), "cublasGetStream");
        if (record_op(stream, &tape_detail::run_gemm<T>, g)) {
            return;
        }
    }
    settle_recorded();
    check(tape_detail::gemm_now(g), sizeof(T) == 4 ? "cublasSgemmStridedBatched"
                                                   : "cublasDgemmStridedBatched");
}

}  // namespace titans::backend::cuda
