#pragma once
// titans/backend/cpu/memory_projections.hpp: math §1's projections of the memory with every
// intermediate kept, and their reverse (math §9), for the training pass on the CPU. The input
// products and the gate logits come from the training forward (MemoryKernels::Recording).
//
//   u = x [W_Q | W_K | W_V],  c = causal conv of u (per sequence, from a zero history),
//   pre = phi(c),  qkv = pre with the q and k heads L2-normalised,
//   logits = x [W_theta | W_eta | W_alpha] + b (data-dependent and per-chunk gates).

#include <array>
#include <cmath>
#include <utility>

#include "../../detail/activation.hpp"
#include "../../detail/eigen_math.hpp"
#include "../../detail/product.hpp"
#include "../../memory/config.hpp"
#include "../../memory/params.hpp"
#include "../../types.hpp"

namespace titans::backend::cpu {

/// math §1's gate logits x [W_theta | W_eta | W_alpha] + [b_theta | b_eta | b_alpha], (B*N) x 3H
/// (left empty for constant gates).
template <class T, class X>
void gate_logits(const MemoryConfig& cfg, const MemoryParams<T>& p, const X& x, Matrix<T>& logits) {
    if (cfg.gates == GateMode::Constant) {
        return;
    }
    const int H = cfg.n_heads;
    logits.resize(x.rows(), 3 * H);
    detail::multiply_concat(logits, x,
                            std::array<const Matrix<T>*, 3>{&p.w_theta, &p.w_eta, &p.w_alpha});
    logits.leftCols(H).rowwise() += p.b_theta;
    logits.middleCols(H, H).rowwise() += p.b_eta;
    logits.rightCols(H).rowwise() += p.b_alpha;
}

/// The projections of a (B*N) x d input, each stage kept (see the file comment).
template <class T>
struct MemoryProjections {
    using Mat = Matrix<T>;
    Mat u, c, pre, qkv, logits;

    static Mat conv_taps(const MemoryParams<T>& p) {
        Mat taps(p.conv_q.rows(), 3 * p.conv_q.cols());
        taps << p.conv_q, p.conv_k, p.conv_v;
        return taps;
    }

    /// The stages after the input products, from u = x [W_Q | W_K | W_V] and the gate logits
    /// the forward kept (moved in): the conv, phi and the norm (elementwise, cheap).
    void compute(const MemoryConfig& cfg, const MemoryParams<T>& p, Mat u_kept, Mat logits_kept,
                 int B) {
        const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        u = std::move(u_kept);
        logits = std::move(logits_kept);
        const Eigen::Index N = u.rows() / B;
        c = u;
        if (cfg.use_conv) {
            const Mat taps = conv_taps(p);
            const Mat tail = Mat::Zero(cfg.conv_kernel - 1, 3 * D);
            for (int s = 0; s < B; ++s) {
                detail::causal_conv_in_place(taps, tail, c.middleRows(s * N, N));
            }
        }
        pre = c;
        if (cfg.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, pre);
        }
        qkv = pre;
        if (cfg.normalize_qk) {
            detail::l2_normalize_heads(qkv.leftCols(2 * D), 2 * H, dh);
        }
    }

    /// The reverse: dqkv (adjoint of qkv, consumed) and dlogits give dx (written) and the
    /// projection gradients (added to g: w_q, w_k, w_v, conv_*, w_theta.., b_theta..).
    void backward(const MemoryConfig& cfg, const MemoryParams<T>& p, const Mat& x, int B,
                  Mat& dqkv, const Mat& dlogits, Mat& dx, MemoryParams<T>& g) const {
        const int H = cfg.n_heads, D = cfg.inner_dim();
        if (cfg.normalize_qk) {
            normalize_backward(cfg, dqkv);
        }
        if (cfg.qkv_activation == Activation::SiLU) {
            dqkv.array() *= c.unaryExpr([](T z) { return detail::silu_grad(z); }).array();
        }
        if (cfg.use_conv) {
            conv_backward(cfg, p, B, dqkv, g);  // dqkv becomes the adjoint of u
        }
        dx.noalias() = dqkv.leftCols(D) * p.w_q.transpose();
        dx.noalias() += dqkv.middleCols(D, D) * p.w_k.transpose();
        dx.noalias() += dqkv.rightCols(D) * p.w_v.transpose();
        g.w_q.noalias() += x.transpose() * dqkv.leftCols(D);
        g.w_k.noalias() += x.transpose() * dqkv.middleCols(D, D);
        g.w_v.noalias() += x.transpose() * dqkv.rightCols(D);
        if (cfg.gates == GateMode::Constant) {
            return;
        }
        dx.noalias() += dlogits.leftCols(H) * p.w_theta.transpose();
        dx.noalias() += dlogits.middleCols(H, H) * p.w_eta.transpose();
        dx.noalias() += dlogits.rightCols(H) * p.w_alpha.transpose();
        g.w_theta.noalias() += x.transpose() * dlogits.leftCols(H);
        g.w_eta.noalias() += x.transpose() * dlogits.middleCols(H, H);
        g.w_alpha.noalias() += x.transpose() * dlogits.rightCols(H);
        g.b_theta += dlogits.leftCols(H).colwise().sum();
        g.b_eta += dlogits.middleCols(H, H).colwise().sum();
        g.b_alpha += dlogits.rightCols(H).colwise().sum();
    }

private:
    /// y = s / max(||s||, 1e-12) per q and k head: ds = (dy - y (y . dy)) / ||s||, or
    /// dy / 1e-12 below the floor.
    void normalize_backward(const MemoryConfig& cfg, Mat& d) const {
        const int dh = cfg.head_dim(), heads = 2 * cfg.n_heads;
        for (Eigen::Index r = 0; r < d.rows(); ++r) {
            for (int h = 0; h < heads; ++h) {
                const Eigen::Index c0 = static_cast<Eigen::Index>(h) * dh;
                auto dy = d.row(r).segment(c0, dh);
                const auto y = qkv.row(r).segment(c0, dh);
                const T norm = pre.row(r).segment(c0, dh).norm();
                if (norm > T(1e-12)) {
                    const T dot = y.dot(dy);
                    dy = (dy - dot * y) / norm;
                } else {
                    dy /= T(1e-12);
                }
            }
        }
    }

    /// c_t = taps[K-1] . u_t + sum_{j<K-1} taps[j] . u_{t-K+1+j} (zero before row 0):
    /// d (the adjoint of c) becomes the adjoint of u; the taps' gradients go to g.conv_*.
    void conv_backward(const MemoryConfig& cfg, const MemoryParams<T>& p, int B, Mat& d,
                       MemoryParams<T>& g) const {
        const int K = cfg.conv_kernel, D = cfg.inner_dim();
        const Eigen::Index N = d.rows() / B;
        const Mat taps = conv_taps(p);
        Mat dtaps = Mat::Zero(K, 3 * D);
        Mat du(d.rows(), d.cols());
        for (int s = 0; s < B; ++s) {
            const Eigen::Index r0 = s * N;
            for (Eigen::Index t = 0; t < N; ++t) {
                const auto dc = d.row(r0 + t).array();
                du.row(r0 + t).array() = taps.row(K - 1).array() * dc;
                dtaps.row(K - 1).array() += dc * u.row(r0 + t).array();
            }
            for (Eigen::Index t = 0; t < N; ++t) {
                const auto dc = d.row(r0 + t).array();
                for (int j = 0; j < K - 1; ++j) {
                    const Eigen::Index tau = t - K + 1 + j;
                    if (tau >= 0) {
                        du.row(r0 + tau).array() += taps.row(j).array() * dc;
                        dtaps.row(j).array() += dc * u.row(r0 + tau).array();
                    }
                }
            }
        }
        d = du;
        g.conv_q += dtaps.leftCols(D);
        g.conv_k += dtaps.middleCols(D, D);
        g.conv_v += dtaps.rightCols(D);
    }
};

}  // namespace titans::backend::cpu
