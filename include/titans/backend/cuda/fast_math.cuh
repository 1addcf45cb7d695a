#pragma once
// titans/backend/cuda/fast_math.cuh: the special function unit's approximations the kernels
// take in float, and the memory's activations built on them (math §1).
//
// On the GPU, ex2_ftz is ex2.approx.ftz (2^x, 2 ulp) and rcp_ftz is rcp.approx.ftz (1 / x,
// 1 ulp): one instruction each, subnormal results flushed to 0. expf and IEEE division take
// nine and about eight (a branch to a slow path besides). Elsewhere (the CPU emulation of
// CUDA) they are std::exp2 and a division in float, flushed the same way and then moved by
// the instructions' documented worst error, all in one direction (2^x up by 2 ulp, 1 / x
// down by 1), so that the tests bound what the GPU's approximations can do to the formulas
// built on them: those add the rounding of x log2(e) before ex2 (relative |x| 2^-24 in
// exp(x)). Double keeps the exact functions (detail/activation.hpp): the kernels' double
// results keep their parity.
//
//   const float s = fast_sigmoid(z);                        // 1 / (1 + 2^(-z log2 e))
//   const float a = kernel_activate(Activation::SiLU, z);   // z s

#include <bit>
#include <cmath>
#include <limits>

#include "../../activation.hpp"
#include "../../config.hpp"
#include "../../detail/activation.hpp"

namespace titans::backend::cuda {

/// The special function unit's approximations fast_math takes.
enum class Sfu { Ex2, Rcp };

/// F's approximation of x in float, subnormal results flushed to 0 of their sign: on the GPU
/// ex2.approx.ftz.f32 (2^x) or rcp.approx.ftz.f32 (1 / x); in the emulation the exact value
/// moved by the instruction's worst error (2^x 2 ulp up, 1 / x 1 ulp down), and NaN as the
/// GPU's canonical NaN (bits 0x7fffffff).
template <Sfu F>
TITANS_HOST_DEVICE float sfu_ftz(float x) {
#if defined(__CUDA_ARCH__)
    float r;
    if constexpr (F == Sfu::Ex2) {
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    } else {
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    }
    return r;
#else
    if (std::isnan(x)) {
        return std::bit_cast<float>(0x7fffffffu);
    }
    const float r =
        F == Sfu::Ex2 ? std::exp2(x) * (1.0f + 0x1p-22f) : (1.0f / x) * (1.0f - 0x1p-23f);
    return std::fabs(r) < std::numeric_limits<float>::min() ? std::copysign(0.0f, r) : r;
#endif
}

/// 2^x in float, subnormal results flushed to 0 (ex2.approx.ftz.f32 on the GPU).
TITANS_HOST_DEVICE float ex2_ftz(float x) {
    return sfu_ftz<Sfu::Ex2>(x);
}

/// 1 / x in float, subnormal results flushed to signed 0 (rcp.approx.ftz.f32 on the GPU).
TITANS_HOST_DEVICE float rcp_ftz(float x) {
    return sfu_ftz<Sfu::Rcp>(x);
}

/// sigmoid(z) = 1 / (1 + e^-z): in float 1 / (1 + 2^(-z log2 e)) with ex2_ftz and rcp_ftz, no
/// branch (below z = -88 the power overflows to inf and 1 / inf = 0; NaN stays NaN); in double
/// detail::sigmoid.
template <class T>
TITANS_HOST_DEVICE T fast_sigmoid(T z) {
    if constexpr (sizeof(T) == 4) {
        return rcp_ftz(1.0f + ex2_ftz(z * -1.44269504088896341f));
    } else {
        return detail::sigmoid(z);
    }
}

/// fast_sigmoid as detail/activation.hpp's sigmoid policy.
struct FastSigmoid {
    template <class T>
    TITANS_HOST_DEVICE static T of(T z) {
        return fast_sigmoid(z);
    }
};

/// The memory's activation and its derivatives in the kernels: detail/activation.hpp's formulas
/// with FastSigmoid (SiLU in float on the special function unit; GELU and double exact).
template <class T>
TITANS_HOST_DEVICE T kernel_activate(Activation a, T z) {
    return detail::activate<T, FastSigmoid>(a, z);
}
template <class T>
TITANS_HOST_DEVICE T kernel_activate_grad(Activation a, T z) {
    return detail::activate_grad<T, FastSigmoid>(a, z);
}
template <class T>
TITANS_HOST_DEVICE detail::ValueGrad<T> kernel_activate_with_grad(Activation a, T z) {
    return detail::activate_with_grad<T, FastSigmoid>(a, z);
}
template <class T>
TITANS_HOST_DEVICE T kernel_activate_grad2(Activation a, T z) {
    return detail::activate_grad2<T, FastSigmoid>(a, z);
}

}  // namespace titans::backend::cuda
