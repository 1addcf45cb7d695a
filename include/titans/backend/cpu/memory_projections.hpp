#pragma once
// titans/backend/cpu/memory_projections.hpp: math §1's projections of the memory with every
// intermediate kept, and their reverse (math §9), for the training pass on the CPU. The input
// products and the gate logits come from the training forward (MemoryKernels::Recording).
//
//   u = x [W_Q | W_K | W_V],  c = causal conv of u (per sequence, from a zero history),
//   pre = phi(c),  qkv = pre with the q and k heads L2-normalised,
//   logits = x [W_theta | W_eta | W_alpha] + b (data-dependent and per-chunk gates).

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/eigen_math.hpp"
#include "../../detail/product.hpp"
#include "../../memory/config.hpp"
#include "../../memory/params.hpp"
#include "../../types.hpp"
#include "../../memory/kernels_decl.hpp"

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
    /// the forward kept (moved in): the conv (continuing each sequence's tail in `tails`, or
    /// from a zero history when it is empty), phi and the norm (elementwise, cheap).
    void compute(const MemoryConfig& cfg, const MemoryParams<T>& p, Mat u_kept, Mat logits_kept,
                 int B, const std::vector<Mat>& tails) {
        const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        u = std::move(u_kept);
        logits = std::move(logits_kept);
        const Eigen::Index N = u.rows() / B;
        c = u;
        if (cfg.use_conv) {
            const Mat taps = conv_taps(p);
            const Mat zero = Mat::Zero(cfg.conv_kernel - 1, 3 * D);
            for (int s = 0; s < B; ++s) {
                detail::causal_conv_in_place(taps, tails.empty() ? zero : tails[static_cast<std::size_t>(s)],
                                             c.middleRows(s * N, N));
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

    /// The query path alone (MAC's read through given weights: no conv, no gates): u = x W_Q,
    /// c = u, pre = phi(c), qkv = pre with each head L2-normalised; (B*N) x D each.
    void compute_queries(const MemoryConfig& cfg, const MemoryParams<T>& p, const Mat& x) {
        u.resize(x.rows(), cfg.inner_dim());
        detail::multiply(u, x, p.w_q);
        c = u;
        pre = c;
        if (cfg.qkv_activation == Activation::SiLU) {
            detail::activate_in_place(Activation::SiLU, pre);
        }
        qkv = pre;
        if (cfg.normalize_qk) {
            detail::l2_normalize_heads(qkv, cfg.n_heads, cfg.head_dim());
        }
    }

    /// The reverse of compute_queries: dq (the adjoint of qkv, consumed) gives dx (written) and
    /// g.w_q (added).
    void queries_backward(const MemoryConfig& cfg, const MemoryParams<T>& p, const Mat& x, Mat& dq,
                          Mat& dx, MemoryParams<T>& g) const {
        to_conv_adjoint(cfg, dq, 1, 0, dq.rows());
        dx.noalias() = dq * p.w_q.transpose();
        g.w_q.noalias() += x.transpose() * dq;
    }

    /// The reverse, in stages over rows [t0, t1) of every sequence (the memory's backward
    /// reaches the rows in pieces, last first): to_conv_adjoint, input_adjoint, input_rows, then
    /// parameter_gradients once every row is done. to_conv_adjoint: the norm and phi reversed
    /// in place, d the adjoint of qkv -> of c.
    void to_conv_adjoint(const MemoryConfig& cfg, Mat& d, int B, Eigen::Index t0,
                         Eigen::Index t1) const {
        const Eigen::Index N = d.rows() / B;
        for (int s = 0; s < B; ++s) {
            auto rows = d.middleRows(s * N + t0, t1 - t0);
            if (cfg.normalize_qk) {
                normalize_backward(cfg, rows, s * N + t0);
            }
            if (cfg.qkv_activation == Activation::SiLU) {
                Mat grad;
                detail::activate_grad_into(Activation::SiLU, c.middleRows(s * N + t0, t1 - t0), grad);
                rows.array() *= grad.array();
            }
        }
    }

    /// du (the adjoint of u) rows [t0, t1) from dc, the adjoint of c (its rows >= t0 final):
    /// c_t = taps[K-1] u_t + sum_{j<K-1} taps[j] u_{t-K+1+j}, so
    /// du_t = sum_j taps[j] dc_{t+K-1-j} over the rows before N.
    void input_adjoint(const MemoryConfig& cfg, const MemoryParams<T>& p, int B, const Mat& dc,
                       Mat& du, Eigen::Index t0, Eigen::Index t1) const {
        const Eigen::Index N = dc.rows() / B;
        if (!cfg.use_conv) {
            for (int s = 0; s < B; ++s) {
                du.middleRows(s * N + t0, t1 - t0) = dc.middleRows(s * N + t0, t1 - t0);
            }
            return;
        }
        const int K = cfg.conv_kernel;
        const Mat taps = conv_taps(p);
        for (int s = 0; s < B; ++s) {
            for (Eigen::Index t = t0; t < t1; ++t) {
                auto out = du.row(s * N + t).array();
                out = taps.row(K - 1).array() * dc.row(s * N + t).array();
                for (int j = 0; j < K - 1; ++j) {
                    const Eigen::Index at = t + K - 1 - j;
                    if (at < N) out += taps.row(j).array() * dc.row(s * N + at).array();
                }
            }
        }
    }

    /// dL/dx of rows [t0, t1) of every sequence, du [W_Q | W_K | W_V]^T + dlogits
    /// [W_gates]^T, into dx (B * (t1 - t0)) x d, sequence-major.
    static void input_rows(const MemoryConfig& cfg, const MemoryParams<T>& p, int B,
                           const Mat& du, const Mat& dlogits, Eigen::Index t0, Eigen::Index t1,
                           Mat& dx) {
        const int H = cfg.n_heads, D = cfg.inner_dim();
        const Eigen::Index N = du.rows() / B, n = t1 - t0;
        for (int s = 0; s < B; ++s) {
            const Eigen::Index r = s * N + t0;
            auto out = dx.middleRows(s * n, n);
            out.noalias() = du.block(r, 0, n, D) * p.w_q.transpose();
            out.noalias() += du.block(r, D, n, D) * p.w_k.transpose();
            out.noalias() += du.block(r, 2 * D, n, D) * p.w_v.transpose();
            if (cfg.gates != GateMode::Constant) {
                out.noalias() += dlogits.block(r, 0, n, H) * p.w_theta.transpose();
                out.noalias() += dlogits.block(r, H, n, H) * p.w_eta.transpose();
                out.noalias() += dlogits.block(r, 2 * H, n, H) * p.w_alpha.transpose();
            }
        }
    }

    /// The adjoint of each sequence's incoming conv tail (rows before row 0: tail row K-1+tau
    /// is u_tau for tau < 0) from dc, added to dtails[s] ((K-1) x 3D).
    void tail_adjoint(const MemoryConfig& cfg, const MemoryParams<T>& p, int B, const Mat& dc,
                      std::vector<Mat>& dtails) const {
        const int K = cfg.conv_kernel;
        const Eigen::Index N = dc.rows() / B;
        const Mat taps = conv_taps(p);
        for (int s = 0; s < B; ++s) {
            for (int r = 0; r < K - 1; ++r) {  // tail row r is u_tau, tau = r - (K-1)
                for (int j = 0; j < K - 1; ++j) {
                    const Eigen::Index at = r - j;  // c_t reads u_{t-K+1+j}: t = tau + K-1-j
                    if (at >= 0 && at < N) {
                        dtails[static_cast<std::size_t>(s)].row(r).array() +=
                            taps.row(j).array() * dc.row(s * N + at).array();
                    }
                }
            }
        }
    }

    /// The projections' gradients (added to g) once dc, du and dlogits are final; `tails` are
    /// the incoming conv tails compute() continued (empty: zero).
    void parameter_gradients(const MemoryConfig& cfg, const Mat& x, int B, const Mat& dc,
                             const Mat& du, const Mat& dlogits, const std::vector<Mat>& tails,
                             MemoryParams<T>& g) const {
        const int H = cfg.n_heads, D = cfg.inner_dim();
        if (cfg.use_conv) {
            const int K = cfg.conv_kernel;
            const Eigen::Index N = dc.rows() / B;
            Mat dtaps = Mat::Zero(K, 3 * D);
            for (int s = 0; s < B; ++s) {
                for (int j = 0; j < K; ++j) {
                    const Eigen::Index lag = K - 1 - j, n = N - lag;  // rows t >= lag
                    auto acc = dtaps.row(j).array();
                    for (Eigen::Index t = 0; t < n; ++t) {  // along rows: contiguous, SIMD
                        acc += dc.row(s * N + lag + t).array() * u.row(s * N + t).array();
                    }
                    // rows t < lag read the tail: u_{t-lag} is tail row t - lag + K-1 = t + j
                    for (Eigen::Index t = 0; t < std::min<Eigen::Index>(lag, N) && !tails.empty(); ++t) {
                        dtaps.row(j).array() += dc.row(s * N + t).array() *
                                                tails[static_cast<std::size_t>(s)].row(t + j).array();
                    }
                }
            }
            g.conv_q += dtaps.leftCols(D);
            g.conv_k += dtaps.middleCols(D, D);
            g.conv_v += dtaps.rightCols(D);
        }
        g.w_q.noalias() += x.transpose() * du.leftCols(D);
        g.w_k.noalias() += x.transpose() * du.middleCols(D, D);
        g.w_v.noalias() += x.transpose() * du.rightCols(D);
        if (cfg.gates == GateMode::Constant) {
            return;
        }
        g.w_theta.noalias() += x.transpose() * dlogits.leftCols(H);
        g.w_eta.noalias() += x.transpose() * dlogits.middleCols(H, H);
        g.w_alpha.noalias() += x.transpose() * dlogits.rightCols(H);
        g.b_theta += dlogits.leftCols(H).colwise().sum();
        g.b_eta += dlogits.middleCols(H, H).colwise().sum();
        g.b_alpha += dlogits.rightCols(H).colwise().sum();
    }

private:
    /// y = s / max(||s||, 1e-12) per q and k head (the q heads only when d holds D columns):
    /// ds = (dy - y (y . dy)) / ||s||, or dy / 1e-12 below the floor; with ||s|| = n 2^e
    /// (detail::norm_parts, e > 0 where s's sum of squares overflows) the division is scaled
    /// the same way. d's row r is row r0 + r.
    template <class Rows>
    void normalize_backward(const MemoryConfig& cfg, Rows&& d, Eigen::Index r0) const {
        const int dh = cfg.head_dim();
        const int heads = static_cast<int>(std::min<Eigen::Index>(2 * cfg.n_heads, d.cols() / dh));
        for (Eigen::Index r = 0; r < d.rows(); ++r) {
            for (int h = 0; h < heads; ++h) {
                const Eigen::Index c0 = static_cast<Eigen::Index>(h) * dh;
                auto dy = d.row(r).segment(c0, dh);
                const auto y = qkv.row(r0 + r).segment(c0, dh);
                const auto [norm, e] = detail::norm_parts(pre.row(r0 + r).segment(c0, dh));
                if (e > 0) {
                    const T dot = y.dot(dy);
                    dy = (dy - dot * y).unaryExpr([e = e](T v) { return detail::scale_down(v, e); }) /
                         norm;
                } else if (norm > T(1e-12)) {
                    const T dot = y.dot(dy);
                    dy = (dy - dot * y) / norm;
                } else {
                    dy /= T(1e-12);
                }
            }
        }
    }
};

}  // namespace titans::backend::cpu
