#pragma once
// tests/cuda/emulation/cublas_v2.h: the part of cuBLAS the titans CUDA backend uses, emulated
// on the CPU (cuda_runtime.h): handles, streams, math modes, and column-major reference GEMMs
// (single and strided-batched, float and double).
//
// The GEMMs check their arguments as cuBLAS does (CUBLAS_STATUS_INVALID_VALUE for a negative
// size, an unknown operation or a leading dimension below max(1, rows of the stored matrix))
// and take its shortcuts (nothing for m = 0, n = 0 or batchCount = 0; C = beta C without
// reading A and B for k = 0 or alpha = 0; C is not read when beta = 0). Every matrix read or
// written must lie inside one device allocation, else CUBLAS_STATUS_EXECUTION_FAILED (and a
// message: on a GPU that is an illegal address). Products accumulate in T, in order. The
// math mode (TF32) is accepted and ignored: the emulation computes in full precision.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

enum cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };

enum cublasMath_t {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_TENSOR_OP_MATH = 1,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3,
};

struct cublasContext {
    cudaStream_t stream = nullptr;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
    void* workspace = nullptr;  // cublasSetWorkspace's (none: the library's default pool)
    std::size_t workspace_bytes = 0;
};
using cublasHandle_t = cublasContext*;

namespace cuda_emulation {

/// One stored operand of a GEMM: `rows` x `cols` column-major with leading dimension ld,
/// `batch` of them `stride` elements apart.
struct GemmOperand {
    long long rows, cols, ld, stride;
};

/// Whether every matrix of the operand lies inside one device allocation.
template <class T>
bool operand_in_device(const T* p, GemmOperand o, int batch) {
    if (o.rows == 0 || o.cols == 0) {
        return true;
    }
    const long long first = std::min(0LL, o.stride * (batch - 1));
    const long long span = (o.cols - 1) * o.ld + o.rows + std::abs(o.stride) * (batch - 1);
    return is_device_range(p + first, static_cast<std::size_t>(span) * sizeof(T));
}

inline bool valid_op(cublasOperation_t op) {
    return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}

/// C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch (column-major; op(A) m x k, op(B)
/// k x n), with cuBLAS's checks and shortcuts. CUBLAS_OP_C is CUBLAS_OP_T (real types).
/// How many GEMM calls (batched ones once) were submitted so far: what a test counts to see
/// how many products a call makes.
inline std::atomic<long>& gemm_count() {
    static std::atomic<long> n{0};
    return n;
}
inline long gemm_calls() { return gemm_count().load(); }

template <class T>
cublasStatus_t gemm(const char* call, cublasHandle_t h, cublasOperation_t ta,
                    cublasOperation_t tb, int m, int n, int k, const T* alpha, const T* A,
                    int lda, long long sa, const T* B, int ldb, long long sb, const T* beta, T* C,
                    int ldc, long long sc, int batch) {
    if (h == nullptr) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    const bool at = ta != CUBLAS_OP_N, bt = tb != CUBLAS_OP_N;
    if (!valid_op(ta) || !valid_op(tb) || m < 0 || n < 0 || k < 0 || batch < 0 ||
        lda < std::max(1, at ? k : m) || ldb < std::max(1, bt ? n : k) || ldc < std::max(1, m)) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (m == 0 || n == 0 || batch == 0) {
        return CUBLAS_STATUS_SUCCESS;
    }
    if (alpha == nullptr || beta == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const T a = *alpha, b = *beta;
    const bool reads_ab = k > 0 && a != T(0);
    const GemmOperand oa{at ? k : m, at ? m : k, lda, sa}, ob{bt ? n : k, bt ? k : n, ldb, sb},
        oc{m, n, ldc, sc};
    if ((reads_ab && (!operand_in_device(A, oa, batch) || !operand_in_device(B, ob, batch))) ||
        !operand_in_device(C, oc, batch)) {
        std::fprintf(stderr, "CUDA emulation: %s: an operand is not (all) device memory\n", call);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    ++gemm_count();
    submit(h->stream, [=] {  // now, or when the handle's stream is waited for (lazy mode)
        std::vector<T> acc(static_cast<std::size_t>(m));
        for (long long i = 0; i < batch; ++i) {
            const T* Ai = A + i * sa;
            const T* Bi = B + i * sb;
            T* Ci = C + i * sc;
            for (long long j = 0; j < n; ++j) {
                std::fill(acc.begin(), acc.end(), T(0));
                for (long long l = 0; reads_ab && l < k; ++l) {
                    const T blj = bt ? Bi[j + l * ldb] : Bi[l + j * ldb];
                    for (long long r = 0; r < m; ++r) {
                        acc[static_cast<std::size_t>(r)] +=
                            (at ? Ai[l + r * lda] : Ai[r + l * lda]) * blj;
                    }
                }
                for (long long r = 0; r < m; ++r) {
                    T& c = Ci[r + j * ldc];
                    const T ab = a * acc[static_cast<std::size_t>(r)];
                    c = b == T(0) ? ab : ab + b * c;
                }
            }
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace cuda_emulation

inline cublasStatus_t cublasCreate(cublasHandle_t* h) {
    if (h == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *h = new cublasContext{};
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasDestroy(cublasHandle_t h) {
    if (h == nullptr) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
    if (h == nullptr) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    h->stream = s;
    h->workspace = nullptr;  // (as cuBLAS: a new stream resets the workspace to the default)
    h->workspace_bytes = 0;
    return CUBLAS_STATUS_SUCCESS;
}
namespace cuda_emulation {
/// What cublasSetWorkspace gave handle h since its stream was set (nullptr, 0: none).
inline std::pair<void*, std::size_t> blas_workspace(cublasHandle_t h) {
    return {h->workspace, h->workspace_bytes};
}
}  // namespace cuda_emulation
/// The handle's workspace: `bytes` of device memory at w, 256-byte aligned (cuBLAS's rule).
inline cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* w, std::size_t bytes) {
    if (h == nullptr) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if (bytes > 0 && (reinterpret_cast<std::uintptr_t>(w) % 256 != 0 ||
                      !cuda_emulation::is_device_range(w, bytes))) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    h->workspace = w;
    h->workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t* s) {
    if (h == nullptr) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if (s == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *s = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
    if (h == nullptr) {
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    h->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                  int m, int n, int k, const float* alpha, const float* A, int lda,
                                  const float* B, int ldb, const float* beta, float* C, int ldc) {
    return cuda_emulation::gemm("cublasSgemm", h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0,
                                beta, C, ldc, 0, 1);
}
inline cublasStatus_t cublasDgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                  int m, int n, int k, const double* alpha, const double* A,
                                  int lda, const double* B, int ldb, const double* beta, double* C,
                                  int ldc) {
    return cuda_emulation::gemm("cublasDgemm", h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0,
                                beta, C, ldc, 0, 1);
}
inline cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                                cublasOperation_t tb, int m, int n, int k,
                                                const float* alpha, const float* A, int lda,
                                                long long sa, const float* B, int ldb,
                                                long long sb, const float* beta, float* C,
                                                int ldc, long long sc, int batch) {
    return cuda_emulation::gemm("cublasSgemmStridedBatched", h, ta, tb, m, n, k, alpha, A, lda,
                                sa, B, ldb, sb, beta, C, ldc, sc, batch);
}
inline cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                                cublasOperation_t tb, int m, int n, int k,
                                                const double* alpha, const double* A, int lda,
                                                long long sa, const double* B, int ldb,
                                                long long sb, const double* beta, double* C,
                                                int ldc, long long sc, int batch) {
    return cuda_emulation::gemm("cublasDgemmStridedBatched", h, ta, tb, m, n, k, alpha, A, lda,
                                sa, B, ldb, sb, beta, C, ldc, sc, batch);
}
