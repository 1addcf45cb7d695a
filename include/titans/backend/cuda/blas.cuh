#pragma once
// titans/backend/cuda/blas.cuh: row-major (strided-batched) GEMM on cuBLAS, float and double.

#include <cstdint>

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

/// C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch, every matrix row-major: op(A_i) is
/// m x k, op(B_i) k x n, C_i m x n. Row-major C is column-major C^T = op(B)^T op(A)^T, so
/// the call swaps the operands. cuBLAS picks its own algorithm (TF32 only when the handle's
/// math mode allows it).
template <class T>
void gemm(cublasHandle_t h, bool trans_a, bool trans_b, int m, int n, int k, T alpha,
          Operand<T> a, Operand<T> b, T beta, T* c, int ldc, long long c_stride, int batch) {
    if (m == 0 || n == 0 || batch == 0) {
        return;
    }
    const cublasOperation_t oa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t ob = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    if constexpr (sizeof(T) == 4) {
        check(cublasSgemmStridedBatched(h, ob, oa, n, m, k, &alpha, b.data, b.ld, b.batch_stride,
                                        a.data, a.ld, a.batch_stride, &beta, c, ldc, c_stride,
                                        batch),
              "cublasSgemmStridedBatched");
    } else {
        check(cublasDgemmStridedBatched(h, ob, oa, n, m, k, &alpha, b.data, b.ld, b.batch_stride,
                                        a.data, a.ld, a.batch_stride, &beta, c, ldc, c_stride,
                                        batch),
              "cublasDgemmStridedBatched");
    }
}

}  // namespace titans::backend::cuda
