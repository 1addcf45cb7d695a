#pragma once
// titans/detail/activation.hpp: scalar nonlinearities and their derivatives (math §1-2).
//
// Written once as TITANS_HOST_DEVICE functions so the CPU backend and a CUDA backend evaluate
// the same formulas. SiLU's take their sigmoid from a policy S (S::of(z)): ExactSigmoid here;
// the CUDA kernels' float pass one built on the special function unit (backend/cuda/
// fast_math.cuh).

#include <cmath>

#include "../config.hpp"
#include "../activation.hpp"

namespace titans::detail {

template <class T>
TITANS_HOST_DEVICE T sigmoid(T z) {
    // Two branches so that exp never overflows.
    if (z >= T(0)) {
        return T(1) / (T(1) + std::exp(-z));
    }
    const T e = std::exp(z);
    return e / (T(1) + e);
}

/// The sigmoid above, as a policy for the functions below.
struct ExactSigmoid {
    template <class T>
    TITANS_HOST_DEVICE static T of(T z) {
        return sigmoid(z);
    }
};

/// SiLU(z) = z * sigmoid(z).
template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE T silu(T z) {
    return z * S::of(z);
}

/// d/dz SiLU(z) = s + z s (1 - s), s = sigmoid(z).
template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE T silu_grad(T z) {
    const T s = S::of(z);
    return s * (T(1) + z * (T(1) - s));
}

/// Exact GELU(z) = z * Phi(z) = z/2 * (1 + erf(z / sqrt 2)).
/// Phi(z), the standard normal's distribution function, as erfc(-z / sqrt 2) / 2: to a few ulp
/// in both tails (the textbook (1 + erf(z / sqrt 2)) / 2 loses every digit below z = -6, where
/// 1 + erf cancels: GELU and its derivative there, and a gradient check on them, were noise).
template <class T>
TITANS_HOST_DEVICE T gauss_cdf(T z) {
    return T(0.5) * std::erfc(-z * T(0.70710678118654752440));
}

template <class T>
TITANS_HOST_DEVICE T gelu(T z) {
    return z * gauss_cdf(z);
}

/// d/dz GELU(z) = Phi(z) + z * phi(z).
template <class T>
TITANS_HOST_DEVICE T gelu_grad(T z) {
    const T cdf = gauss_cdf(z);
    const T pdf = T(0.39894228040143267794) * std::exp(T(-0.5) * z * z);
    return cdf + z * pdf;
}

/// d²/dz² SiLU(z) = s (1 - s) (2 + z (1 - 2 s)), s = sigmoid(z).
template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE T silu_grad2(T z) {
    const T s = S::of(z);
    return s * (T(1) - s) * (T(2) + z * (T(1) - T(2) * s));
}

/// d²/dz² GELU(z) = phi(z) (2 - z^2).
template <class T>
TITANS_HOST_DEVICE T gelu_grad2(T z) {
    const T pdf = T(0.39894228040143267794) * std::exp(T(-0.5) * z * z);
    return pdf * (T(2) - z * z);
}

template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE T activate(Activation a, T z) {
    switch (a) {
        case Activation::SiLU: return silu<T, S>(z);
        case Activation::GELU: return gelu(z);
        case Activation::Identity: break;
    }
    return z;
}

template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE T activate_grad(Activation a, T z) {
    switch (a) {
        case Activation::SiLU: return silu_grad<T, S>(z);
        case Activation::GELU: return gelu_grad(z);
        case Activation::Identity: break;
    }
    return T(1);
}

/// act''(z): what the backward of a gradient (math §9, the second-order terms) needs.
/// An activation's value and derivative at one z.
template <class T>
struct ValueGrad {
    T value;
    T grad;
};

/// activate(a, z) and activate_grad(a, z) from one evaluation of the shared sigmoid or erf
/// (the same expressions as the two calls: the same values where the compiler contracts alike).
template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE ValueGrad<T> activate_with_grad(Activation a, T z) {
    switch (a) {
        case Activation::SiLU: {
            const T s = S::of(z);
            return {z * s, s * (T(1) + z * (T(1) - s))};
        }
        case Activation::GELU: {
            const T cdf = gauss_cdf(z);
            const T pdf = T(0.39894228040143267794) * std::exp(T(-0.5) * z * z);
            return {z * cdf, cdf + z * pdf};
        }
        case Activation::Identity: break;
    }
    return {z, T(1)};
}

template <class T, class S = ExactSigmoid>
TITANS_HOST_DEVICE T activate_grad2(Activation a, T z) {
    switch (a) {
        case Activation::SiLU: return silu_grad2<T, S>(z);
        case Activation::GELU: return gelu_grad2(z);
        case Activation::Identity: break;
    }
    return T(0);
}

}  // namespace titans::detail
