#pragma once
// tests/reference/reference_memory_backward.hpp: a plain reverse-mode reference of the gradient of
// L = sum(dy .* y), y = reference::per_token(cfg, p, x, batch).y, with respect to every
// parameter tensor the config uses and to x. Written from reference_memory.hpp and
// docs/math.md §1-3 only; nothing is taken from the library's backward code.
//
// Method: per (sequence, head) the forward recurrence is re-run keeping W_{t-1}, S_{t-1}, u_t,
// W_t and the effective (clipped) theta of every token, then tokens are swept in reverse with
// adjoints Wbar (of W_t) and Sbar (of S_t). u_t = grad_W l(W_{t-1}; k_t, v_t) is itself
// differentiated by reverse mode through its own computation graph (forward of the MLP, then
// its back-propagation), which brings in act''.
//
// Every product is an explicit loop; Eigen matrices are containers only. Double precision.

#include "reference/reference_memory.hpp"

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace titans::reference {

/// act''(z): SiLU s(1-s)(2 + z(1-2s)); GELU phi(z)(2 - z^2); Identity 0.
inline double act_second(Activation act, double z) {
    switch (act) {
        case Activation::SiLU: {
            const double s = sigmoid(z);
            return s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s));
        }
        case Activation::GELU: {
            const double phi = std::exp(-0.5 * z * z) / std::sqrt(2.0 * 3.14159265358979323846);
            return phi * (2.0 - z * z);
        }
        case Activation::Identity: return 0.0;
    }
    return 0.0;
}

/// dL/dparams (same shapes as MemoryParams<double>::zeros(cfg); tensors the config does not
/// use stay zero) and dL/dx.
struct Gradients {
    MemoryParams<double> params;
    Matrixd x;
};

namespace detail_bwd {

using Layers = std::vector<Matrixd>;

inline Layers zero_layers(const Layers& W) {
    Layers r;
    for (const Matrixd& m : W) r.push_back(zeros_like(m));
    return r;
}

inline Matrixd zero_matrix(Eigen::Index rows, Eigen::Index cols) {
    Matrixd m(rows, cols);
    for (Eigen::Index i = 0; i < rows; ++i)
        for (Eigen::Index j = 0; j < cols; ++j) m(i, j) = 0.0;
    return m;
}

/// sum over every layer and entry of a .* b.
inline double dot_layers(const Layers& a, const Layers& b) {
    double s = 0.0;
    for (std::size_t l = 0; l < a.size(); ++l)
        for (Eigen::Index i = 0; i < a[l].rows(); ++i)
            for (Eigen::Index j = 0; j < a[l].cols(); ++j) s += a[l](i, j) * b[l](i, j);
    return s;
}

// ---------------------------------------------------------------------------------------------
// The memory MLP.

/// Backward of out = M(W; z) (first order). Adds dout-weighted dW into dW, returns dL/dz.
inline Matrixd mlp_read_backward(const Layers& W, const Matrixd& z, Activation act, bool res,
                                 const Matrixd& dout, Layers& dW) {
    const std::size_t L = W.size();
    const Forward f = mlp_forward_full(W, z, act, res);
    Matrixd dz = zero_matrix(1, z.cols());
    if (res)
        for (Eigen::Index j = 0; j < z.cols(); ++j) dz(0, j) += dout(0, j);
    Matrixd d = dout;  // dL/dz_l, starting at l = L
    for (std::size_t l = L; l >= 1; --l) {
        const Matrixd& a_prev = f.a[l - 1];
        for (Eigen::Index i = 0; i < W[l - 1].rows(); ++i)
            for (Eigen::Index j = 0; j < W[l - 1].cols(); ++j) dW[l - 1](i, j) += a_prev(0, i) * d(0, j);
        Matrixd da = row_times_transpose(d, W[l - 1]);  // dL/da_{l-1}
        if (l == 1) {
            for (Eigen::Index j = 0; j < z.cols(); ++j) dz(0, j) += da(0, j);
        } else {
            const Matrixd& z_prev = f.zs[l - 2];
            for (Eigen::Index j = 0; j < da.cols(); ++j) da(0, j) *= act_deriv(act, z_prev(0, j));
            d = da;
        }
    }
    return dz;
}

/// The intermediates of u = assoc_grad(W, k, v): the MLP forward f, delta[l-1] = delta_l and
/// back[l-1] = delta_l W_l^T (l >= 2; back[0] unused).
struct AssocTape {
    Forward f;
    std::vector<Matrixd> delta, back;
};

inline AssocTape assoc_tape(const Layers& W, const Matrixd& k, const Matrixd& v, Activation act,
                            bool res) {
    const std::size_t L = W.size();
    AssocTape tp;
    tp.f = mlp_forward_full(W, k, act, res);
    tp.delta.assign(L, Matrixd());
    tp.back.assign(L, Matrixd());
    Matrixd d(1, tp.f.out.cols());
    for (Eigen::Index j = 0; j < d.cols(); ++j) d(0, j) = tp.f.out(0, j) - v(0, j);
    for (std::size_t l = L; l >= 1; --l) {
        tp.delta[l - 1] = d;
        if (l > 1) {
            tp.back[l - 1] = row_times_transpose(d, W[l - 1]);
            d = tp.back[l - 1];
            for (Eigen::Index j = 0; j < d.cols(); ++j) d(0, j) *= act_deriv(act, tp.f.zs[l - 2](0, j));
        }
    }
    return tp;
}

/// Reverse of the back-propagation sweep of assoc_grad (g_l = a_{l-1}^T delta_l and
/// delta_{l-1} = back_l .* act'(z_{l-1}), back_l = delta_l W_l^T), given gbar = dL/dg.
/// Accumulates dW, da[l-1] = dL/da_{l-1}, dzs[l-1] = dL/dz_l; returns dL/d delta_L.
inline Matrixd assoc_sweep_backward(const Layers& W, const AssocTape& tp, Activation act,
                                    const Layers& gbar, Layers& dW, std::vector<Matrixd>& da,
                                    std::vector<Matrixd>& dzs) {
    const std::size_t L = W.size();
    std::vector<Matrixd> ddelta;
    for (std::size_t l = 1; l <= L; ++l) ddelta.push_back(zero_matrix(1, W[l - 1].cols()));
    for (std::size_t l = 1; l <= L; ++l) {
        const Matrixd& dl = tp.delta[l - 1];
        if (l > 1) {  // delta_{l-1} = back_l .* act'(z_{l-1}); ddelta[l-2] is complete here
            const Matrixd& zp = tp.f.zs[l - 2];
            for (Eigen::Index i = 0; i < W[l - 1].rows(); ++i) {
                const double dd = ddelta[l - 2](0, i);
                const double bbar = dd * act_deriv(act, zp(0, i));
                dzs[l - 2](0, i) += dd * tp.back[l - 1](0, i) * act_second(act, zp(0, i));
                for (Eigen::Index j = 0; j < W[l - 1].cols(); ++j) {
                    ddelta[l - 1](0, j) += bbar * W[l - 1](i, j);
                    dW[l - 1](i, j) += bbar * dl(0, j);
                }
            }
        }
        const Matrixd& a_prev = tp.f.a[l - 1];  // g_l = a_{l-1}^T delta_l
        for (Eigen::Index i = 0; i < W[l - 1].rows(); ++i)
            for (Eigen::Index j = 0; j < W[l - 1].cols(); ++j) {
                da[l - 1](0, i) += gbar[l - 1](i, j) * dl(0, j);
                ddelta[l - 1](0, j) += a_prev(0, i) * gbar[l - 1](i, j);
            }
    }
    return ddelta[L - 1];
}

/// Backward of u = assoc_grad(W; k, v) given ubar = dL/du: accumulates dW (the second-order
/// terms), dk and dv (1 x d_h rows).
inline void assoc_grad_backward(const Layers& W, const Matrixd& k, const Matrixd& v,
                                Activation act, bool res, const Layers& ubar, Layers& dW,
                                Matrixd& dk, Matrixd& dv) {
    const std::size_t L = W.size();
    const AssocTape tp = assoc_tape(W, k, v, act, res);
    std::vector<Matrixd> da, dzs;  // da[l-1]: dL/da_{l-1}; dzs[l-1]: dL/dz_l
    for (std::size_t l = 1; l <= L; ++l) {
        da.push_back(zero_matrix(1, W[l - 1].rows()));
        dzs.push_back(zero_matrix(1, W[l - 1].cols()));
    }
    const Matrixd dout = assoc_sweep_backward(W, tp, act, ubar, dW, da, dzs);
    // delta_L = out - v, out = z_L (+ k).
    for (Eigen::Index j = 0; j < dout.cols(); ++j) {
        dv(0, j) -= dout(0, j);
        dzs[L - 1](0, j) += dout(0, j);
        if (res) dk(0, j) += dout(0, j);
    }
    // Reverse of the MLP forward z_l = a_{l-1} W_l, a_{l-1} = act(z_{l-1}).
    for (std::size_t l = L; l >= 1; --l) {
        const Matrixd& a_prev = tp.f.a[l - 1];
        for (Eigen::Index i = 0; i < W[l - 1].rows(); ++i)
            for (Eigen::Index j = 0; j < W[l - 1].cols(); ++j) {
                dW[l - 1](i, j) += a_prev(0, i) * dzs[l - 1](0, j);
                da[l - 1](0, i) += dzs[l - 1](0, j) * W[l - 1](i, j);
            }
        if (l > 1) {
            const Matrixd& zp = tp.f.zs[l - 2];
            for (Eigen::Index i = 0; i < zp.cols(); ++i)
                dzs[l - 2](0, i) += da[l - 1](0, i) * act_deriv(act, zp(0, i));
        }
    }
    for (Eigen::Index j = 0; j < k.cols(); ++j) dk(0, j) += da[0](0, j);
}

// ---------------------------------------------------------------------------------------------
// One (sequence, head): the recurrence of math §3 and its reverse sweep.

struct HeadTape {
    std::vector<Layers> W_prev, S_prev, u, W_post;  // per token
    std::vector<double> theta_eff;                  // clipped theta per token
};

inline Matrixd head_of(const Matrixd& m, Eigen::Index t, int h, int dh) { return head_row(m, t, h, dh); }

inline HeadTape head_forward(const MemoryConfig& cfg, const Layers& W0, const QKV& pr,
                             const Gates& g, int h) {
    const Eigen::Index N = pr.q.rows();
    const int dh = cfg.head_dim();
    HeadTape tp;
    Layers W = W0;
    Layers S = detail_ref::zero_state(W0);
    for (Eigen::Index t = 0; t < N; ++t) {
        const Matrixd k = head_of(pr.k, t, h, dh), v = head_of(pr.v, t, h, dh);
        const Layers u = assoc_grad(W, k, v, cfg.activation, cfg.residual);
        const double th = detail_ref::clipped_theta(cfg, g.theta(t, h), u);
        tp.W_prev.push_back(W);
        tp.S_prev.push_back(S);
        tp.u.push_back(u);
        tp.theta_eff.push_back(th);
        detail_ref::step(W, S, u, th, g.eta(t, h), g.alpha(t, h));
        tp.W_post.push_back(W);
    }
    return tp;
}

/// Adjoints of one sequence's projections and gates (N x D and N x H).
struct SeqAdjoints {
    Matrixd dq, dk, dv, dtheta, deta, dalpha;
};

/// Adds into col block h of a (N x D) matrix at row t.
inline void add_head(Matrixd& m, Eigen::Index t, int h, int dh, const Matrixd& r) {
    for (int j = 0; j < dh; ++j) m(t, h * dh + j) += r(0, j);
}

/// Reverse of one step S = eta S - theta_eff u, W = (1-alpha) W + S, theta_eff = theta *
/// min(1, c/||u||). On entry Wbar, Sbar are the adjoints of W_t, S_t; on exit those of
/// W_{t-1} (without the contributions through u_t and the lagged read) and S_{t-1}.
/// Returns ubar; adds the gate adjoints.
inline Layers step_backward(const MemoryConfig& cfg, const HeadTape& tp, const Gates& g,
                            Eigen::Index t, int h, Layers& Wbar, Layers& Sbar, SeqAdjoints& adj) {
    const std::size_t ti = static_cast<std::size_t>(t);
    const Layers& u = tp.u[ti];
    Layers Stot = Sbar;  // total adjoint of S_t: through S_{t+1} and through W_t
    for (std::size_t l = 0; l < Stot.size(); ++l) Stot[l] += Wbar[l];
    adj.dalpha(t, h) += -dot_layers(Wbar, tp.W_prev[ti]);
    adj.deta(t, h) += dot_layers(Stot, tp.S_prev[ti]);
    const double dtheta_eff = -dot_layers(Stot, u);
    Layers ubar = Stot;
    for (Matrixd& m : ubar) m *= -tp.theta_eff[ti];
    const double theta = g.theta(t, h), c = cfg.max_grad_norm, n = grad_norm_of(u);
    if (c > 0 && n > c) {  // theta_eff = theta c / n: d/du = -theta c u / n^3
        adj.dtheta(t, h) += dtheta_eff * (c / n);
        const double s = dtheta_eff * (-theta * c / (n * n * n));
        for (std::size_t l = 0; l < u.size(); ++l) ubar[l] += s * u[l];
    } else {
        adj.dtheta(t, h) += dtheta_eff;
    }
    for (std::size_t l = 0; l < Wbar.size(); ++l) {
        Wbar[l] *= (1.0 - g.alpha(t, h));
        Sbar[l] = g.eta(t, h) * Stot[l];
    }
    return ubar;
}

/// Reverse sweep of one (sequence, head). dyh: N x D adjoint of the head outputs. Adds into
/// adj (q, k, v, gates) and returns dL/dW^0.
inline Layers head_backward(const MemoryConfig& cfg, const HeadTape& tp, const QKV& pr,
                            const Gates& g, int h, const Matrixd& dyh, SeqAdjoints& adj) {
    const Eigen::Index N = pr.q.rows();
    const int dh = cfg.head_dim();
    const Activation act = cfg.activation;
    const bool res = cfg.residual, lagged = cfg.retrieval == Retrieval::Lagged;
    Layers Wbar = zero_layers(tp.W_prev.empty() ? Layers() : tp.W_prev[0]);
    Layers Sbar = Wbar;
    for (Eigen::Index t = N - 1; t >= 0; --t) {
        const std::size_t ti = static_cast<std::size_t>(t);
        const Matrixd q = head_of(pr.q, t, h, dh), k = head_of(pr.k, t, h, dh),
                      v = head_of(pr.v, t, h, dh), dout = head_of(dyh, t, h, dh);
        if (!lagged)  // y_t = M(W_t; q_t)
            add_head(adj.dq, t, h, dh, mlp_read_backward(tp.W_post[ti], q, act, res, dout, Wbar));
        const Layers ubar = step_backward(cfg, tp, g, t, h, Wbar, Sbar, adj);
        Matrixd dk = zero_matrix(1, dh), dv = zero_matrix(1, dh);
        assoc_grad_backward(tp.W_prev[ti], k, v, act, res, ubar, Wbar, dk, dv);
        add_head(adj.dk, t, h, dh, dk);
        add_head(adj.dv, t, h, dh, dv);
        if (lagged)  // y_t = M(W_{t-1}; q_t)
            add_head(adj.dq, t, h, dh, mlp_read_backward(tp.W_prev[ti], q, act, res, dout, Wbar));
    }
    return Wbar;
}

// ---------------------------------------------------------------------------------------------
// Projections and gates (math §1).

/// Backward of project_one: out = n(phi(conv(xs Wp))). dout: N x D. Adds into dWp (d x D),
/// dconv (K x D, if use_conv) and dxs (N x d).
inline void project_backward(const MemoryConfig& cfg, const Matrixd& xs, const Matrixd& Wp,
                             const Matrixd& conv, bool normalize, const Matrixd& dout,
                             Matrixd& dWp, Matrixd& dconv, Matrixd& dxs) {
    const Eigen::Index N = xs.rows(), d = xs.cols(), D = Wp.cols();
    const int K = cfg.conv_kernel, H = cfg.n_heads, dh = cfg.head_dim();
    Matrixd pre = zero_matrix(N, D), cv = zero_matrix(N, D), ph(N, D), dph = dout;
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c)
            for (Eigen::Index i = 0; i < d; ++i) pre(t, c) += xs(t, i) * Wp(i, c);
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c) {
            if (!cfg.use_conv) { cv(t, c) = pre(t, c); continue; }
            for (int j = 0; j < K; ++j)
                if (t - K + 1 + j >= 0) cv(t, c) += conv(j, c) * pre(t - K + 1 + j, c);
        }
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c) ph(t, c) = act_value(cfg.qkv_activation, cv(t, c));
    if (normalize)  // o = p / max(||p||, 1e-12): dp = (do - o (o . do)) / ||p|| (or do / 1e-12)
        for (Eigen::Index t = 0; t < N; ++t)
            for (int h = 0; h < H; ++h) {
                double ss = 0.0, od = 0.0;
                for (int j = 0; j < dh; ++j) ss += ph(t, h * dh + j) * ph(t, h * dh + j);
                const double nrm = std::sqrt(ss);
                const bool floor = !(nrm > 1e-12);
                const double den = floor ? 1e-12 : nrm;
                for (int j = 0; j < dh; ++j) od += ph(t, h * dh + j) / den * dout(t, h * dh + j);
                for (int j = 0; j < dh; ++j) {
                    const Eigen::Index c = h * dh + j;
                    dph(t, c) = floor ? dout(t, c) / den : (dout(t, c) - ph(t, c) / den * od) / den;
                }
            }
    Matrixd dcv(N, D), dpre = zero_matrix(N, D);
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c) dcv(t, c) = dph(t, c) * act_deriv(cfg.qkv_activation, cv(t, c));
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c) {
            if (!cfg.use_conv) { dpre(t, c) += dcv(t, c); continue; }
            for (int j = 0; j < K; ++j) {
                const Eigen::Index tau = t - K + 1 + j;
                if (tau < 0) continue;
                dconv(j, c) += dcv(t, c) * pre(tau, c);
                dpre(tau, c) += dcv(t, c) * conv(j, c);
            }
        }
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c)
            for (Eigen::Index i = 0; i < d; ++i) {
                dWp(i, c) += xs(t, i) * dpre(t, c);
                dxs(t, i) += dpre(t, c) * Wp(i, c);
            }
}

/// Backward of one data-dependent gate value = scale * sigmoid(xs_t w[:, h] + b[h]), given
/// dval (N x H). Adds into dw, db, dxs.
inline void gate_backward(const Matrixd& xs, const Matrixd& w, const RowVectord& b, double scale,
                          const Matrixd& dval, Matrixd& dw, RowVectord& db, Matrixd& dxs) {
    for (Eigen::Index t = 0; t < xs.rows(); ++t)
        for (Eigen::Index h = 0; h < w.cols(); ++h) {
            double z = b(h);
            for (Eigen::Index i = 0; i < xs.cols(); ++i) z += xs(t, i) * w(i, h);
            const double s = sigmoid(z);
            const double dz = dval(t, h) * scale * s * (1.0 - s);
            db(h) += dz;
            for (Eigen::Index i = 0; i < xs.cols(); ++i) {
                dw(i, h) += xs(t, i) * dz;
                dxs(t, i) += w(i, h) * dz;
            }
        }
}

/// One sequence b: recompute, sweep heads, then projections, gates and w_o. Adds into gr.
inline void sequence_backward(const MemoryConfig& cfg, const MemoryParams<double>& p,
                              const Matrixd& xs, const Matrixd& dys, Gradients& gr,
                              Matrixd& dxs) {
    const Eigen::Index N = xs.rows();
    const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim(), d = cfg.d_model;
    const QKV pr = project_qkv(cfg, p, xs);
    const Gates g = compute_gates(cfg, p, xs, 1);
    Matrixd yh = zero_matrix(N, D), dyh = zero_matrix(N, D);  // head outputs and adjoint
    for (Eigen::Index t = 0; t < N; ++t)
        for (int c = 0; c < D; ++c)
            for (int j = 0; j < d; ++j) dyh(t, c) += dys(t, j) * p.w_o(c, j);
    SeqAdjoints adj{zero_matrix(N, D), zero_matrix(N, D), zero_matrix(N, D),
                    zero_matrix(N, H), zero_matrix(N, H), zero_matrix(N, H)};
    const bool lagged = cfg.retrieval == Retrieval::Lagged;
    for (int h = 0; h < H; ++h) {
        const Layers& W0 = p.memory_init[static_cast<std::size_t>(h)];
        const HeadTape tp = head_forward(cfg, W0, pr, g, h);
        for (Eigen::Index t = 0; t < N; ++t) {
            const Layers& Wr = lagged ? tp.W_prev[static_cast<std::size_t>(t)] : tp.W_post[static_cast<std::size_t>(t)];
            add_head(yh, t, h, dh, mlp_forward(Wr, head_of(pr.q, t, h, dh), cfg.activation, cfg.residual));
        }
        const Layers dW0 = head_backward(cfg, tp, pr, g, h, dyh, adj);
        for (std::size_t l = 0; l < dW0.size(); ++l) gr.params.memory_init[static_cast<std::size_t>(h)][l] += dW0[l];
    }
    for (int c = 0; c < D; ++c)  // y = yh w_o
        for (int j = 0; j < d; ++j)
            for (Eigen::Index t = 0; t < N; ++t) gr.params.w_o(c, j) += yh(t, c) * dys(t, j);
    MemoryParams<double>& gp = gr.params;
    project_backward(cfg, xs, p.w_q, p.conv_q, cfg.normalize_qk, adj.dq, gp.w_q, gp.conv_q, dxs);
    project_backward(cfg, xs, p.w_k, p.conv_k, cfg.normalize_qk, adj.dk, gp.w_k, gp.conv_k, dxs);
    project_backward(cfg, xs, p.w_v, p.conv_v, false, adj.dv, gp.w_v, gp.conv_v, dxs);
    if (cfg.gates == GateMode::DataDependent) {
        gate_backward(xs, p.w_theta, p.b_theta, cfg.theta_max, adj.dtheta, gp.w_theta, gp.b_theta, dxs);
        // momentum / forget off: the gate is the constant 0, nothing flows into its parameters
        if (cfg.momentum) gate_backward(xs, p.w_eta, p.b_eta, 1.0, adj.deta, gp.w_eta, gp.b_eta, dxs);
        if (cfg.forget) gate_backward(xs, p.w_alpha, p.b_alpha, 1.0, adj.dalpha, gp.w_alpha, gp.b_alpha, dxs);
    }
}

}  // namespace detail_bwd

/// Gradient of L = sum(dy .* per_token(cfg, p, x, batch).y) with respect to every tensor of p
/// the config uses and to x. dy: (B*N) x d_model. Throws ConfigError for PerChunk gates.
inline Gradients per_token_backward(const MemoryConfig& cfg, const MemoryParams<double>& p,
                                    const Matrixd& x, int batch, const Matrixd& dy) {
    if (cfg.gates == GateMode::PerChunk) {
        throw ConfigError("reference::per_token_backward: gates = PerChunk is not defined per token");
    }
    const Eigen::Index N = detail_ref::check_inputs(cfg, p, x, batch);
    if (dy.rows() != x.rows() || dy.cols() != cfg.d_model) {
        throw ShapeError("reference::per_token_backward: dy must be (B*N) x d_model");
    }
    Gradients gr{MemoryParams<double>::zeros(cfg), detail_bwd::zero_matrix(x.rows(), x.cols())};
    // zeros() keeps random()'s constant offsets (conv current tap 1, biases 0 / 2 / -8):
    // clear every tensor explicitly.
    MemoryParams<double>::tensors(gr.params, cfg, [](const std::string&, auto& t) { t.setZero(); });
    gr.params.conv_q.setZero();
    gr.params.conv_k.setZero();
    gr.params.conv_v.setZero();
    gr.params.b_theta.setZero();
    gr.params.b_eta.setZero();
    gr.params.b_alpha.setZero();
    for (int b = 0; b < batch; ++b) {
        const Matrixd xs = detail_ref::sequence_rows(x, b, N);
        const Matrixd dys = detail_ref::sequence_rows(dy, b, N);
        Matrixd dxs = detail_bwd::zero_matrix(N, x.cols());
        detail_bwd::sequence_backward(cfg, p, xs, dys, gr, dxs);
        for (Eigen::Index t = 0; t < N; ++t)
            for (Eigen::Index i = 0; i < x.cols(); ++i) gr.x(b * N + t, i) += dxs(t, i);
    }
    return gr;
}

}  // namespace titans::reference
