#pragma once
// titans/detail/eigen_math.hpp: element-wise and row-wise pieces of math §1-2 on Eigen
// matrices, shared by the CPU memory kernels and the blocks.

#include <algorithm>

#include "../activation.hpp"
#include "../types.hpp"
#include "activation.hpp"
#include "norm_scale.hpp"

namespace titans::detail {

/// dst = act(src) (dst resized if it can be). SiLU goes through Eigen's SIMD exp (a scalar
/// libm call per element costs as much as the products around it); GELU stays on std::erf.
/// exp(-z) overflowing to inf gives SiLU -0, the right limit.
template <class Src, class Dst>
void activate_into(Activation act, const Src& src, Dst&& dst) {
    using T = typename Src::Scalar;
    dst.resize(src.rows(), src.cols());
    if (act == Activation::SiLU) {
        dst.array() = src.array() / (T(1) + (-src.array()).exp());
    } else if (act == Activation::GELU) {
        dst = src.unaryExpr([](T v) { return gelu(v); });
    } else {
        dst = src;
    }
}

/// dst = act'(src) (resized if it can be; not sharing src's storage). SiLU: s (1 + z (1 - s)),
/// s = sigmoid(z) through the SIMD exp (exp(-z) = inf gives s = 0 and 0, the right limits).
template <class Src, class Dst>
void activate_grad_into(Activation act, const Src& src, Dst&& dst) {
    using T = typename Src::Scalar;
    dst.resize(src.rows(), src.cols());
    if (act == Activation::SiLU) {
        dst.array() = T(1) / (T(1) + (-src.array()).exp());
        dst.array() *= T(1) + src.array() * (T(1) - dst.array());
    } else {
        dst = src.unaryExpr([act](T v) { return activate_grad(act, v); });
    }
}

/// dst = act''(src) (resized if it can be; not sharing src's storage). SiLU:
/// s (1 - s) (2 + z (1 - 2 s)) through the SIMD exp.
template <class Src, class Dst>
void activate_grad2_into(Activation act, const Src& src, Dst&& dst) {
    using T = typename Src::Scalar;
    dst.resize(src.rows(), src.cols());
    if (act == Activation::SiLU) {
        dst.array() = T(1) / (T(1) + (-src.array()).exp());
        dst.array() = dst.array() * (T(1) - dst.array()) *
                      (T(2) + src.array() * (T(1) - T(2) * dst.array()));
    } else {
        dst = src.unaryExpr([act](T v) { return activate_grad2(act, v); });
    }
}

template <class Z>
void activate_in_place(Activation act, Z&& z) {
    activate_into(act, z, z);
}

/// act(z) into `out`, then z <- act'(z) (SiLU: s (1 + z (1 - s)), s = sigmoid(z) kept in
/// `tmp`, a workspace of z's shape).
template <class Z, class Out, class Tmp>
void activate_and_grad(Activation act, Z&& z, Out&& out, Tmp&& tmp) {
    using T = typename std::decay_t<Z>::Scalar;
    if (act == Activation::SiLU) {
        tmp.array() = T(1) / (T(1) + (-z.array()).exp());
        out.array() = z.array() * tmp.array();
        z.array() = tmp.array() * (T(1) + z.array() * (T(1) - tmp.array()));
    } else {
        out = z.unaryExpr([act](T v) { return activate(act, v); });
        z = z.unaryExpr([act](T v) { return activate_grad(act, v); });
    }
}

/// n(z) = z / max(||z||, 1e-12) for every head slice [h*d_h, (h+1)*d_h) of every row of m
/// (rows x heads*d_h). Right for every finite z: one whose sum of squares overflows is divided
/// scaled by 2^-e (norm_parts).
template <class M>
void l2_normalize_heads(M&& m, int heads, int d_head) {
    using T = typename std::decay_t<M>::Scalar;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (m.rows() >= 256)
#endif
    for (Eigen::Index r = 0; r < m.rows(); ++r) {
        for (int h = 0; h < heads; ++h) {
            auto seg = m.row(r).segment(static_cast<Eigen::Index>(h) * d_head, d_head);
            const auto [n, e] = norm_parts(seg);
            if (e == 0) {
                seg /= std::max(n, T(1e-12));
            } else {
                seg = seg.unaryExpr([e = e](T v) { return scale_down(v, e); }) / n;
            }
        }
    }
}

/// Depthwise causal conv over time, in place: u_t <- sum_j taps[j] . u_{t-K+1+j}, where inputs
/// before row 0 come from `tail` (the K-1 rows that preceded u, oldest first). taps: K x C,
/// tail: (K-1) x C, u: N x C. Rows are rewritten from the last to the first, so every row
/// still reads unmodified inputs.
template <class Taps, class Tail, class U>
void causal_conv_in_place(const Taps& taps, const Tail& tail, U&& u) {
    using T = typename std::decay_t<U>::Scalar;
    const Eigen::Index K = taps.rows(), C = taps.cols();
    using RowArray = Eigen::Map<const Eigen::Array<T, 1, Eigen::Dynamic>, 0, Eigen::InnerStride<>>;
    // Raw row views through data() and the strides: works for const and mutable blocks of
    // either storage order (a const block's operator() returns by value, not by reference).
    auto input = [&](Eigen::Index t) {
        return t >= 0 ? RowArray(u.data() + t * u.rowStride(), C, Eigen::InnerStride<>(u.colStride()))
                      : RowArray(tail.data() + (t + K - 1) * tail.rowStride(), C,
                                 Eigen::InnerStride<>(tail.colStride()));
    };
    for (Eigen::Index t = u.rows() - 1; t >= 0; --t) {
        auto out = u.row(t);
        out.array() *= taps.row(K - 1).array();
        for (Eigen::Index j = 0; j < K - 1; ++j) {
            out.array() += taps.row(j).array() * input(t - K + 1 + j);
        }
    }
}

}  // namespace titans::detail
