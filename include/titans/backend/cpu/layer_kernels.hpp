#pragma once
// titans/backend/cpu/layer_kernels.hpp: the CPU kernels of the stateless layers, RMSNorm and
// FeedForward (math §7).

#include <cmath>
#include <memory>

#include "../../detail/activation.hpp"
#include "../../detail/product.hpp"
#include "../../layers/feed_forward.hpp"
#include "../../layers/rms_norm.hpp"
#include "../../types.hpp"
#include "../backend.hpp"
#include "transfer.hpp"

namespace titans::backend {

struct Cpu;

/// RMSNorm on the CPU: y_r = x_r / sqrt(mean_j(x_rj^2) + eps) ⊙ weight, row by row (y may be
/// x itself).
template <class T>
struct NormKernels<Cpu, T> {
    /// The weight as the kernel uses it: the caller's own (shared, not copied).
    using Prepared = std::shared_ptr<const RowVector<T>>;

    static Prepared prepare(const std::shared_ptr<const RowVector<T>>& weight) { return weight; }

    static void forward(const Prepared& weight, T eps, View<const T> xv, View<T> yv) {
        const auto x = cpu::as_eigen(xv);
        auto y = cpu::as_eigen(yv);
        const T inv_d = T(1) / static_cast<T>(x.cols());
        for (Eigen::Index r = 0; r < x.rows(); ++r) {
            const T inv_rms = T(1) / std::sqrt(x.row(r).squaredNorm() * inv_d + eps);
            y.row(r) = (x.row(r).array() * inv_rms * weight->array()).matrix();
        }
    }
};

/// FeedForward on the CPU: SwiGLU (silu(x W1) ⊙ (x W3)) W2 or GELU gelu(x W1) W2, the products
/// through detail::multiply (one pass over the weights for a few rows).
template <class T>
struct FeedForwardKernels<Cpu, T> {
    /// The parameters as the kernel uses them: the caller's own (shared, not copied).
    using Prepared = std::shared_ptr<const FeedForwardParams<T>>;

    static Prepared prepare(const FeedForwardConfig&,
                            const std::shared_ptr<const FeedForwardParams<T>>& params) {
        return params;
    }

    static void forward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> xv,
                        View<T> y) {
        const auto x = cpu::as_eigen(xv);
        Matrix<T> a(x.rows(), p->w1.cols());
        detail::multiply(a, x, p->w1);
        if (cfg.kind == FeedForwardKind::SwiGLU) {
            Matrix<T> g(x.rows(), p->w3.cols());
            detail::multiply(g, x, p->w3);
            a = a.unaryExpr([](T z) { return detail::silu(z); }).cwiseProduct(g);
        } else {
            a = a.unaryExpr([](T z) { return detail::gelu(z); });
        }
        detail::multiply(cpu::as_eigen(y), a, p->w2);
    }
};

}  // namespace titans::backend
