#pragma once
// titans/backend/cpu/layer_kernels.hpp: the CPU kernels of the stateless layers, RMSNorm and
// FeedForward (math §7).

#include <cmath>
#include <memory>

#include "../../detail/tensor_slots.hpp"
#include "../../detail/activation.hpp"
#include "../../detail/eigen_math.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../detail/product.hpp"
#include "../../layers/feed_forward.hpp"
#include "../../layers/rms_norm.hpp"
#include "../../types.hpp"
#include "../backend.hpp"
#include "transfer.hpp"
#include "../../layers/kernels_decl.hpp"

namespace titans::backend {

struct Cpu;

/// RMSNorm on the CPU: y_r = x_r / sqrt(mean_j(x_rj^2) + eps) ⊙ weight, row by row (y may be
/// x itself). Right for every finite row: a row whose sum of squares overflows T is normalised
/// from its entries scaled by a power of two first (detail/norm_scale.hpp); every other row
/// takes the plain sum, as before. A row of zeros gives y = 0 and 1 / rms = 1 / sqrt(eps).
template <class T>
struct NormKernels<Cpu, T> {
    /// The weight as the kernel uses it: the caller's own (shared, not copied).
    using Prepared = std::shared_ptr<const RowVector<T>>;

    static Prepared prepare(const std::shared_ptr<const RowVector<T>>& weight) { return weight; }
    /// The weight from a 1 x d view: a copy.
    static Prepared prepare_flat(View<const T> flat) {
        return std::make_shared<const RowVector<T>>(cpu::as_eigen(flat));
    }

    static void forward(const Prepared& weight, T eps, View<const T> x, View<T> y) {
        normalize(*weight, eps, x, y, nullptr);
    }

    /// forward, also keeping each row's 1 / rms in inv_rms (rows x 1) for backward.
    static void forward_train(const Prepared& weight, T eps, View<const T> x, View<T> y,
                              View<T> inv_rms) {
        normalize(*weight, eps, x, y, &inv_rms);
    }

    /// Math §9 (RMSNorm): with u = dy ⊙ weight and r = 1 / rms of the row,
    ///     dx = r u - x r^3 <u, x> / d,     dweight += Σ_rows dy ⊙ x r  (the sum added once).
    /// x and inv_rms as forward_train kept them; dx rows x d (sized), dweight 1 x d. A row where
    /// r^3 or a product of that formula leaves T's normal range (rms beyond ~2^±(max exponent
    /// / 3), huge dy) takes the same gradient through the normalised row instead (robust_row).
    static void backward(const Prepared& weight, View<const T> xv, View<const T> inv_rms,
                         View<const T> dyv, View<T> dxv, View<T> dweight) {
        const auto x = cpu::as_eigen(xv);
        const auto dy = cpu::as_eigen(dyv);
        auto dx = cpu::as_eigen(dxv);
        auto dw = cpu::as_eigen(dweight);
        const T inv_d = T(1) / static_cast<T>(x.cols());
        // The call's Σ_rows is summed apart and added to dweight once (as on CUDA): two calls
        // then add exactly twice one call's gradient into a zero dweight.
        RowVector<T> u(x.cols()), g(x.cols()), sum = RowVector<T>::Zero(x.cols());
        for (Eigen::Index r = 0; r < x.rows(); ++r) {
            const T rr = inv_rms.data[r * inv_rms.stride];
            u = (dy.row(r).array() * weight->array()).matrix();
            const T r3 = rr * rr * rr;
            bool done = false;
            if (r3 >= detail::smallest_normal<T>() && r3 <= detail::largest_finite<T>()) {
                const T k = r3 * u.dot(x.row(r)) * inv_d;
                g = (dy.row(r).array() * x.row(r).array() * rr).matrix();
                dx.row(r) = (u.array() * rr - x.row(r).array() * k).matrix();
                done = std::isfinite(k) && g.allFinite() && dx.row(r).allFinite();
                // g's expression again, in place (as before: a compiler that fuses the add
                // into the product does so as it did).
                if (done) sum.array() += dy.row(r).array() * x.row(r).array() * rr;
            }
            if (!done) robust_row(x.row(r), rr, u, dy.row(r), dx.row(r), sum, inv_d);
        }
        dw.row(0) += sum;
    }

private:
    static void normalize(const RowVector<T>& weight, T eps, View<const T> xv, View<T> yv,
                          const View<T>* inv_rms) {
        const auto x = cpu::as_eigen(xv);
        auto y = cpu::as_eigen(yv);
        const T inv_d = T(1) / static_cast<T>(x.cols());
        for (Eigen::Index r = 0; r < x.rows(); ++r) {
            const T ss = x.row(r).squaredNorm();
            if (ss <= detail::largest_finite<T>()) {  // the plain sum: every ordinary row
                const T inv = T(1) / std::sqrt(ss * inv_d + eps);
                if (inv_rms != nullptr) inv_rms->data[r * inv_rms->stride] = inv;
                y.row(r) = (x.row(r).array() * inv * weight.array()).matrix();
            } else {  // x_j / rms = (x_j 2^-e) inv, 1 / rms = inv 2^-e
                const auto [scaled_ss, e] = detail::scaled_squared_norm(x.row(r));
                const T inv = detail::scaled_inv_rms(scaled_ss, inv_d, eps, e);
                if (inv_rms != nullptr) {
                    inv_rms->data[r * inv_rms->stride] = detail::scale_down(inv, e);
                }
                y.row(r) = (scaled_row(x.row(r), e).array() * inv * weight.array()).matrix();
            }
        }
    }

    /// x 2^-e, entry by entry.
    template <class Row>
    static auto scaled_row(const Row& x, int e) {
        return x.unaryExpr([e](T v) { return detail::scale_down(v, e); });
    }

    /// The backward of one row through xh = x / rms (|xh_j| <= sqrt(d)), which neither
    /// overflows nor underflows: with 1 / rms = inv 2^-e and c = <u, xh> / d,
    ///     dx = ((u - xh c) inv) 2^-e,     dweight += dy ⊙ xh.
    /// 1 / rms is rr unless rr is subnormal (rms beyond 2^(max exponent - 2), where eps is below
    /// the rounding of mean(x^2)): then it is taken again from the row, scaled as forward did.
    template <class XRow, class DyRow, class DxRow, class DwRow>
    static void robust_row(const XRow& x, T rr, const RowVector<T>& u, const DyRow& dy,
                           DxRow&& dx, DwRow&& dw, T inv_d) {
        T inv = rr;
        int e = 0;
        if (!(rr >= detail::smallest_normal<T>())) {
            const auto [scaled_ss, ex] = detail::scaled_squared_norm(x);
            e = ex;
            inv = detail::scaled_inv_rms(scaled_ss, inv_d, T(0), e);
        }
        const RowVector<T> xh = (scaled_row(x, e).array() * inv).matrix();
        const T c = u.dot(xh) * inv_d;
        dx = scaled_row(((u - xh * c) * inv).eval(), e);
        dw += (dy.array() * xh.array()).matrix();
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
    /// The parameters from their flat form (FeedForwardParams::tensors order): a copy.
    static Prepared prepare_flat(const FeedForwardConfig& cfg, const FeedForwardParams<T>& shapes,
                                 View<const T> flat) {
        return detail::from_flat(shapes, cfg, flat.data);
    }

    static void forward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> xv,
                        View<T> y) {
        Matrix<T> a(xv.rows, p->w1.cols());
        Matrix<T> g(cfg.kind == FeedForwardKind::SwiGLU ? xv.rows : 0, p->w3.cols());
        project(cfg, *p, xv, view_of(a), view_of(g));
        activate(cfg, a, g);
        detail::multiply(cpu::as_eigen(y), a, p->w2);
    }

    /// forward, keeping the pre-activations a = x W1 and (SwiGLU; empty for GELU) g = x W3,
    /// rows x h each, for backward.
    static void forward_train(const FeedForwardConfig& cfg, const Prepared& p,
                              View<const T> xv, View<T> y, View<T> a, View<T> g) {
        project(cfg, *p, xv, a, g);
        Matrix<T> h = cpu::as_eigen(View<const T>(a));
        activate(cfg, h, cpu::as_eigen(View<const T>(g)));
        detail::multiply(cpu::as_eigen(y), h, p->w2);
    }

    /// Math §9 (feed-forward), with h = act(a) (⊙ g for SwiGLU) and dh = dy W2^T:
    ///     dW2 += h^T dy,  da = dh ⊙ act'(a) (⊙ g),  dg = dh ⊙ silu(a),
    ///     dW1 += x^T da,  dW3 += x^T dg,  dx = da W1^T + dg W3^T.
    /// x, a, g as forward_train kept them; dx rows x d (sized); the gradients are added to.
    static void backward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> xv,
                         View<const T> av, View<const T> gv, View<const T> dyv, View<T> dxv,
                         View<T> dw1, View<T> dw3, View<T> dw2) {
        const auto x = cpu::as_eigen(xv);
        const auto a = cpu::as_eigen(av);
        const auto dy = cpu::as_eigen(dyv);
        const bool swiglu = cfg.kind == FeedForwardKind::SwiGLU;
        Matrix<T> h = a;
        activate(cfg, h, cpu::as_eigen(gv));
        cpu::as_eigen(dw2).noalias() += h.transpose() * dy;
        Matrix<T> dh = dy * p->w2.transpose();
        if (swiglu) {
            const auto g = cpu::as_eigen(gv);
            // h is reused for dg = dh ⊙ silu(a); dh becomes da = dh ⊙ g ⊙ silu'(a).
            detail::activate_into(Activation::SiLU, a, h);
            h.array() *= dh.array();
            Matrix<T> grad;
            detail::activate_grad_into(Activation::SiLU, a, grad);
            dh.array() *= g.array() * grad.array();
            cpu::as_eigen(dw3).noalias() += x.transpose() * h;
        } else {
            dh = dh.cwiseProduct(a.unaryExpr([](T z) { return detail::gelu_grad(z); }));
        }
        cpu::as_eigen(dw1).noalias() += x.transpose() * dh;
        auto dx = cpu::as_eigen(dxv);
        dx.noalias() = dh * p->w1.transpose();
        if (swiglu) dx.noalias() += h * p->w3.transpose();
    }

private:
    /// a = x W1 and, for SwiGLU, g = x W3 (a, g sized).
    static void project(const FeedForwardConfig& cfg, const FeedForwardParams<T>& p,
                        View<const T> xv, View<T> a, View<T> g) {
        const auto x = cpu::as_eigen(xv);
        detail::multiply(cpu::as_eigen(a), x, p.w1);
        if (cfg.kind == FeedForwardKind::SwiGLU) detail::multiply(cpu::as_eigen(g), x, p.w3);
    }
    /// a <- silu(a) ⊙ g (SwiGLU) or gelu(a) (GELU), in place.
    template <class G>
    static void activate(const FeedForwardConfig& cfg, Matrix<T>& a, const G& g) {
        if (cfg.kind == FeedForwardKind::SwiGLU) {
            detail::activate_in_place(Activation::SiLU, a);
            a.array() *= g.array();
        } else {
            a = a.unaryExpr([](T z) { return detail::gelu(z); });
        }
    }
};

}  // namespace titans::backend
