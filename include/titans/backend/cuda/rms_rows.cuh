#pragma once
// titans/backend/cuda/rms_rows.cuh: the RMSNorm of a row by one thread block (math §7), with
// launch.cuh's block_reduce: rms_rows_kernel launches it a block per row; the feed-forward of
// few rows (feed_forward_rows.cuh) calls rms_row itself for the residual sums and norms
// before and after its own work, the same bits as the separate launches.

#include "../../detail/norm_scale.hpp"
#include "launch.cuh"

namespace titans::backend::cuda {

/// Where rms_rows_kernel reads and writes, rows of ld xs, ys, is, as, ss: x, y (may be x),
/// the weight w (d entries), eps, each row's 1 / rms into inv (when given); with `add` given,
/// the row normalised is add + x, written into `sum` first (may be x), and a sum that is not
/// finite raises `raise` (when given: a deferring call scope's flag).
template <class T>
struct RmsRows {
    const T* x;
    long long xs;
    T* y;
    long long ys;
    const T* w;
    int d;
    T eps;
    T* inv;
    long long is;
    const T* add;
    long long as;
    T* sum;
    long long ss;
    unsigned* raise;
};

#if TITANS_CUDA_DEVICE_CODE
/// e and Σ (x_j 2^-e)^2 of row x (length d, nonzero), e the scale exponent of its largest
/// magnitude (detail/norm_scale.hpp); every thread gets both.
template <class T>
__device__ T scaled_row_sum(T* part, const T* x, int d, int& e) {
    T m = T(0);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const T a = x[j] < T(0) ? -x[j] : x[j];
        m = a > m ? a : m;
    }
    e = detail::scale_exponent(block_reduce<true>(part, m));
    T ss = T(0);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const T z = detail::scale_down(x[j], e);
        ss += z * z;
    }
    return block_reduce<false>(part, ss);
}

/// 1 / rms of row x (length d) as rr 2^-e, every thread getting both: e = 0 unless the row's
/// sum of squares overflows, then the row is taken scaled by 2^-e, as on the CPU.
template <class T>
__device__ T row_inv_rms(T* part, const T* x, int d, T eps, int& e) {
    T ss = T(0);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        ss += x[j] * x[j];
    }
    ss = block_reduce<false>(part, ss);
    e = 0;
    if (ss <= detail::largest_finite<T>()) {
        return T(1) / sqrt(ss / static_cast<T>(d) + eps);
    }
    const T scaled = scaled_row_sum(part, x, d, e);
    return detail::scaled_inv_rms(scaled, T(1) / static_cast<T>(d), eps, e);
}

/// RMSNorm of row r of a, by the whole block (256 threads; part: 256 shared entries): y = x /
/// sqrt(mean(x^2) + eps) ⊙ w, inv keeping 1 / rms (row_inv_rms: y = (x 2^-e) rr ⊙ w, 1 / rms =
/// rr 2^-e). With `add`, x is first add + x, into `sum` (a block's residual sum and its next
/// pre-norm in one pass: each thread reads back the entries it wrote).
template <class T>
__device__ void rms_row(const RmsRows<T>& a, long long r, T* part) {
    const int d = a.d;
    const T* x = a.x + r * a.xs;
    if (a.add != nullptr) {
        bool bad = false;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            const T v = a.add[r * a.as + j] + x[j];
            a.sum[r * a.ss + j] = v;
            bad = bad || not_finite(v);
        }
        if (bad && a.raise != nullptr) {
            atomicMax(a.raise, 1u);
        }
        x = a.sum + r * a.ss;
    }
    int e = 0;
    const T rr = row_inv_rms(part, x, d, a.eps, e);
    if (a.inv != nullptr && threadIdx.x == 0) {
        a.inv[r * a.is] = detail::scale_down(rr, e);
    }
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        a.y[r * a.ys + j] = detail::scale_down(x[j], e) * rr * a.w[j];
    }
}

/// RMSNorm of row blockIdx.x (rms_row): a block of 256 threads per row.
template <class T>
__global__ void rms_rows_kernel(RmsRows<T> a) {
    __shared__ T part[256];
    rms_row(a, blockIdx.x, part);
}
#endif

}  // namespace titans::backend::cuda
