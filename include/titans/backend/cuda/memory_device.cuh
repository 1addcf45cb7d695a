#pragma once
// titans/backend/cuda/memory_device.cuh: the CUDA backend's own kernels where the element-wise
// launcher (launch.cuh) would waste the GPU: row-wise work (a block per token row, a warp per
// head row) whose index arithmetic and reductions are per row, not per entry.

#include <cmath>

#include "../../config.hpp"
#include "../../detail/activation.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../limits.hpp"
#include "../../memory/config.hpp"
#include "launch.cuh"

namespace titans::backend::cuda {

/// Per-layer pointers of the pending rows a kernel reads (captured by value).
template <class T>
struct PendingLayers {
    const T* a[limits::max_depth];
    const T* d[limits::max_depth];
    int in[limits::max_depth];
    int out[limits::max_depth];
    int depth;
};

#if TITANS_CUDA_DEVICE_CODE

/// math §1 for one token row r of u (M x C, C = D for queries only, else 3D): the causal conv
/// over the sequence (rows before the piece from `tail`, (K-1) x 3D per sequence), phi, and
/// the pair-major layout [s*H + h][t][d_h] of q (and k, v). One block per row.
template <class T>
__global__ void conv_rows_kernel(const T* u, const T* taps, const T* tail, T* q, T* k, T* v,
                                 long long N, int C, int C3, int K, int D, int dh, int H,
                                 bool conv, bool silu) {
    const long long r = blockIdx.x, s = r / N, t = r % N;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        T val = u[r * C + c];
        if (conv) {
            val *= taps[static_cast<long long>(K - 1) * C3 + c];
            for (int j = 0; j < K - 1; ++j) {
                const long long tt = t - K + 1 + j;
                const T in = tt >= 0 ? u[(s * N + tt) * C + c]
                                     : tail[(s * (K - 1) + tt + K - 1) * C3 + c];
                val += taps[static_cast<long long>(j) * C3 + c] * in;
            }
        }
        if (silu) {
            val = detail::silu(val);
        }
        const int which = c / D, h = (c - which * D) / dh, j = c - which * D - h * dh;
        T* out = which == 0 ? q : (which == 1 ? k : v);
        out[((s * H + h) * N + t) * dh + j] = val;
    }
}

/// Warp sum (every lane gets it).
template <class T>
__device__ T warp_sum(T x) {
    for (int o = 16; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, o);
    }
    return x;
}

/// Warp maximum (every lane gets it).
template <class T>
__device__ T warp_max(T x) {
    for (int o = 16; o > 0; o >>= 1) {
        const T y = __shfl_xor_sync(0xffffffffu, x, o);
        x = y > x ? y : x;
    }
    return x;
}

/// Rows of d_h entries (`rows` of a, then `rows` of b when b is given) divided by their L2
/// norm, at least 1e-12. One warp per row. A row whose sum of squares overflows is divided
/// scaled by 2^-e (detail/norm_scale.hpp), as on the CPU.
template <class T>
__global__ void l2_rows_kernel(T* a, T* b, long long rows, int dh) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= (b != nullptr ? 2 * rows : rows)) {
        return;  // the whole warp
    }
    T* row = (w < rows ? a : b) + (w % rows) * dh;
    T ss = T(0);
    for (int j = lane; j < dh; j += 32) {
        ss += row[j] * row[j];
    }
    ss = warp_sum(ss);
    if (ss <= detail::largest_finite<T>()) {
        const T nrm = sqrt(ss) > T(1e-12) ? sqrt(ss) : T(1e-12);
        for (int j = lane; j < dh; j += 32) {
            row[j] /= nrm;
        }
        return;
    }
    T amax = T(0);
    for (int j = lane; j < dh; j += 32) {
        amax = fabs(row[j]) > amax ? fabs(row[j]) : amax;
    }
    const int e = detail::scale_exponent(warp_max(amax));
    T scaled = T(0);
    for (int j = lane; j < dh; j += 32) {
        const T z = detail::scale_down(row[j], e);
        scaled += z * z;
    }
    const T nrm = sqrt(warp_sum(scaled));
    for (int j = lane; j < dh; j += 32) {
        row[j] = detail::scale_down(row[j], e) / nrm;
    }
}

/// theta, eta, alpha of pending rows [0, n) of every pair into coef (rows 0..2, CS apart per
/// pair), theta clipped by math §10. One warp per (pair, row).
template <class T>
__global__ void gate_values_kernel(GateMode mode, T tmax, T ct, T ce, T ca, T clip,
                                   PendingLayers<T> ly, const T* gates, T* coef, long long P,
                                   int b, int n, long long CS) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= P * n) {
        return;
    }
    const long long p = w / n, r = w % n;
    T th = ct, et = ce, al = ca;
    if (mode == GateMode::DataDependent) {
        const T* g = gates + (p * b + r) * 3;
        th = tmax * detail::sigmoid(g[0]);
        et = detail::sigmoid(g[1]);
        al = detail::sigmoid(g[2]);
    } else if (mode == GateMode::PerChunk) {
        T s0 = T(0), s1 = T(0), s2 = T(0);
        for (int j = lane; j < n; j += 32) {
            const T* g = gates + (p * b + j) * 3;
            s0 += g[0];
            s1 += g[1];
            s2 += g[2];
        }
        th = tmax * detail::sigmoid(warp_sum(s0) / T(n));
        et = detail::sigmoid(warp_sum(s1) / T(n));
        al = detail::sigmoid(warp_sum(s2) / T(n));
    }
    if (clip > T(0)) {
        T g2 = T(0);
        for (int l = 0; l < ly.depth; ++l) {
            const T* a = ly.a[l] + (p * b + r) * ly.in[l];
            const T* d = ly.d[l] + (p * b + r) * ly.out[l];
            T sa = T(0), sd = T(0);
            for (int c = lane; c < ly.in[l]; c += 32) {
                sa += a[c] * a[c];
            }
            for (int c = lane; c < ly.out[l]; c += 32) {
                sd += d[c] * d[c];
            }
            g2 += warp_sum(sa) * warp_sum(sd);
        }
        if (g2 > clip * clip) {  // the plain sum where finite, else the scaled norm
            th *= g2 <= detail::largest_finite<T>()
                      ? clip / sqrt(g2)
                      : detail::scaled_grad_norm<T>(ly.depth, [&](int l) {
                            return detail::GradRows<T>{ly.a[l] + (p * b + r) * ly.in[l], ly.in[l],
                                                       ly.d[l] + (p * b + r) * ly.out[l],
                                                       ly.out[l]};
                        }).clip_factor(clip);
        }
    }
    if (lane == 0) {
        T* cf = coef + p * CS;
        cf[r] = th;
        cf[b + r] = et;
        cf[2 * b + r] = al;
    }
}

/// Blocks of 256 threads for `warps` warps of work.
inline unsigned warp_blocks(long long warps) {
    return static_cast<unsigned>((warps * 32 + 255) / 256);
}

#endif

}  // namespace titans::backend::cuda
