#pragma once
// tests/reference/reference_memory.hpp: an independent, deliberately plain reference of the
// neural long-term memory (math §1-5), used by the tests to check the library.
//
// Written from docs/math.md and the MemoryConfig / MemoryParams headers only. Every product is an
// explicit loop over indices; Eigen matrices serve only as containers. Double precision only.
// Clarity beats speed: nothing here is meant to be fast.
//
//   per_token(cfg, p, x, B)        math §3, the true recurrence (gradient of token t at M_{t-1}).
//   chunk_start_loop(cfg, p, x, B) math §4/§5 by a per-token loop with chunk-start gradients,
//                                  materialising every W_i.

#include <titans/memory/config.hpp>
#include <titans/memory/params.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include <titans/error.hpp>
#include <titans/types.hpp>

namespace titans::reference {

// ---------------------------------------------------------------------------------------------
// Scalar functions.

inline double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

/// act(z): SiLU z*sigmoid(z), exact GELU 0.5*z*(1+erf(z/sqrt 2)), or Identity.
inline double act_value(Activation act, double z) {
    switch (act) {
        case Activation::SiLU: return z * sigmoid(z);
        case Activation::GELU: return 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0)));
        case Activation::Identity: return z;
    }
    return z;
}

/// act'(z): SiLU s + z s (1-s); GELU Phi(z) + z phi(z); Identity 1.
inline double act_deriv(Activation act, double z) {
    switch (act) {
        case Activation::SiLU: {
            const double s = sigmoid(z);
            return s + z * s * (1.0 - s);
        }
        case Activation::GELU: {
            const double Phi = 0.5 * (1.0 + std::erf(z / std::sqrt(2.0)));
            const double phi = std::exp(-0.5 * z * z) / std::sqrt(2.0 * 3.14159265358979323846);
            return Phi + z * phi;
        }
        case Activation::Identity: return 1.0;
    }
    return 1.0;
}

// ---------------------------------------------------------------------------------------------
// Plain-loop linear algebra on row vectors.

/// r (1 x m) = a (1 x n) * W (n x m), by loops.
inline Matrixd row_times(const Matrixd& a, const Matrixd& W) {
    if (a.rows() != 1 || a.cols() != W.rows()) {
        throw ShapeError(detail::concat("reference::row_times: a is ", a.rows(), " x ", a.cols(),
                                        ", W is ", W.rows(), " x ", W.cols()));
    }
    Matrixd r(1, W.cols());
    for (Eigen::Index j = 0; j < W.cols(); ++j) {
        double s = 0.0;
        for (Eigen::Index i = 0; i < W.rows(); ++i) s += a(0, i) * W(i, j);
        r(0, j) = s;
    }
    return r;
}

/// r (1 x n) = d (1 x m) * W^T (W is n x m), by loops.
inline Matrixd row_times_transpose(const Matrixd& d, const Matrixd& W) {
    if (d.rows() != 1 || d.cols() != W.cols()) {
        throw ShapeError("reference::row_times_transpose: shape mismatch");
    }
    Matrixd r(1, W.rows());
    for (Eigen::Index i = 0; i < W.rows(); ++i) {
        double s = 0.0;
        for (Eigen::Index j = 0; j < W.cols(); ++j) s += d(0, j) * W(i, j);
        r(0, i) = s;
    }
    return r;
}

inline Matrixd zeros_like(const Matrixd& m) {
    Matrixd z(m.rows(), m.cols());
    for (Eigen::Index i = 0; i < m.rows(); ++i)
        for (Eigen::Index j = 0; j < m.cols(); ++j) z(i, j) = 0.0;
    return z;
}

// ---------------------------------------------------------------------------------------------
// The memory MLP (math §2).

/// Forward pass of the memory, keeping every intermediate. a[0] = z, zs[l-1] = z_l
/// (l = 1..L), a[l] = act(z_l) for l < L. out = M(z) (z_L, plus z if residual).
struct Forward {
    std::vector<Matrixd> a;   // a[0..L-1]: inputs of layers 1..L
    std::vector<Matrixd> zs;  // zs[l-1] = z_l, l = 1..L
    Matrixd out;              // M(z), 1 x d_h
};

inline Forward mlp_forward_full(const std::vector<Matrixd>& W, const Matrixd& z_row,
                                Activation act, bool residual) {
    if (W.empty()) throw ConfigError("reference::mlp_forward: no layers");
    const std::size_t L = W.size();
    Forward f;
    f.a.push_back(z_row);
    for (std::size_t l = 1; l <= L; ++l) {
        Matrixd zl = row_times(f.a[l - 1], W[l - 1]);
        f.zs.push_back(zl);
        if (l < L) {
            Matrixd al(1, zl.cols());
            for (Eigen::Index j = 0; j < zl.cols(); ++j) al(0, j) = act_value(act, zl(0, j));
            f.a.push_back(al);
        }
    }
    f.out = f.zs[L - 1];
    if (residual) {
        if (f.out.cols() != z_row.cols()) {
            throw ShapeError("reference::mlp_forward: residual needs d_out == d_in");
        }
        for (Eigen::Index j = 0; j < f.out.cols(); ++j) f.out(0, j) += z_row(0, j);
    }
    return f;
}

/// M(z) for one row z (1 x d_h): z_L, or z + z_L if residual.
inline Matrixd mlp_forward(const std::vector<Matrixd>& W, const Matrixd& z_row, Activation act,
                           bool residual) {
    return mlp_forward_full(W, z_row, act, residual).out;
}

/// 1/2 ||M(k) - v||^2.
inline double assoc_loss(const std::vector<Matrixd>& W, const Matrixd& k_row,
                         const Matrixd& v_row, Activation act, bool residual) {
    const Matrixd m = mlp_forward(W, k_row, act, residual);
    double s = 0.0;
    for (Eigen::Index j = 0; j < m.cols(); ++j) {
        const double e = m(0, j) - v_row(0, j);
        s += e * e;
    }
    return 0.5 * s;
}

/// Gradient of 1/2 ||M(k) - v||^2 with respect to every W_l, by back-propagation:
/// delta_L = M(k) - v, grad W_l = a_{l-1}^T delta_l, delta_{l-1} = (delta_l W_l^T) . act'(z_{l-1}).
inline std::vector<Matrixd> assoc_grad(const std::vector<Matrixd>& W, const Matrixd& k_row,
                                       const Matrixd& v_row, Activation act, bool residual) {
    const std::size_t L = W.size();
    const Forward f = mlp_forward_full(W, k_row, act, residual);
    std::vector<Matrixd> g(L);
    Matrixd delta(1, f.out.cols());
    for (Eigen::Index j = 0; j < f.out.cols(); ++j) delta(0, j) = f.out(0, j) - v_row(0, j);
    for (std::size_t l = L; l >= 1; --l) {
        const Matrixd& a_prev = f.a[l - 1];
        Matrixd gl(W[l - 1].rows(), W[l - 1].cols());
        for (Eigen::Index i = 0; i < gl.rows(); ++i)
            for (Eigen::Index j = 0; j < gl.cols(); ++j) gl(i, j) = a_prev(0, i) * delta(0, j);
        g[l - 1] = gl;
        if (l > 1) {
            Matrixd back = row_times_transpose(delta, W[l - 1]);
            const Matrixd& z_prev = f.zs[l - 2];  // z_{l-1}
            for (Eigen::Index j = 0; j < back.cols(); ++j)
                back(0, j) *= act_deriv(act, z_prev(0, j));
            delta = back;
        }
    }
    return g;
}

/// sqrt(sum over layers of ||g_l||_F^2).
inline double grad_norm_of(const std::vector<Matrixd>& g) {
    double s = 0.0;
    for (const Matrixd& m : g)
        for (Eigen::Index i = 0; i < m.rows(); ++i)
            for (Eigen::Index j = 0; j < m.cols(); ++j) s += m(i, j) * m(i, j);
    return std::sqrt(s);
}

// ---------------------------------------------------------------------------------------------
// Projections (math §1), one sequence at a time.

/// q, k, v of one sequence: each N x D (D = H * d_h), head h in columns [h*d_h, (h+1)*d_h).
struct QKV {
    Matrixd q, k, v;
};

/// One projection for a sequence xs (N x d): pre = xs W (N x D); optional causal depthwise conv
/// out_t[c] = sum_j conv(j, c) * pre_{t-K+1+j}[c] (pre at t < 0 is 0); phi; optional per-head
/// L2 normalisation n(v) = v / max(||v||, 1e-12).
inline Matrixd project_one(const MemoryConfig& cfg, const Matrixd& xs, const Matrixd& Wp,
                           const Matrixd& conv, bool normalize) {
    const Eigen::Index N = xs.rows(), d = xs.cols(), D = Wp.cols();
    Matrixd pre(N, D);
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c) {
            double s = 0.0;
            for (Eigen::Index i = 0; i < d; ++i) s += xs(t, i) * Wp(i, c);
            pre(t, c) = s;
        }
    Matrixd conv_out(N, D);
    if (cfg.use_conv) {
        const int K = cfg.conv_kernel;
        for (Eigen::Index t = 0; t < N; ++t)
            for (Eigen::Index c = 0; c < D; ++c) {
                double s = 0.0;
                for (int j = 0; j < K; ++j) {
                    const Eigen::Index tau = t - K + 1 + j;
                    if (tau < 0) continue;  // before the sequence start: zero
                    s += conv(j, c) * pre(tau, c);
                }
                conv_out(t, c) = s;
            }
    } else {
        conv_out = pre;
    }
    Matrixd out(N, D);
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index c = 0; c < D; ++c) out(t, c) = act_value(cfg.qkv_activation, conv_out(t, c));
    if (normalize) {
        const int H = cfg.n_heads, dh = cfg.head_dim();
        for (Eigen::Index t = 0; t < N; ++t)
            for (int h = 0; h < H; ++h) {
                double ss = 0.0;
                for (int j = 0; j < dh; ++j) ss += out(t, h * dh + j) * out(t, h * dh + j);
                const double nrm = std::max(std::sqrt(ss), 1e-12);
                for (int j = 0; j < dh; ++j) out(t, h * dh + j) /= nrm;
            }
    }
    return out;
}

inline QKV project_qkv(const MemoryConfig& cfg, const MemoryParams<double>& p, const Matrixd& xs) {
    QKV r;
    r.q = project_one(cfg, xs, p.w_q, p.conv_q, cfg.normalize_qk);
    r.k = project_one(cfg, xs, p.w_k, p.conv_k, cfg.normalize_qk);
    r.v = project_one(cfg, xs, p.w_v, p.conv_v, false);
    return r;
}

/// The row of head h of a projection at token t (1 x d_h).
inline Matrixd head_row(const Matrixd& m, Eigen::Index t, int h, int dh) {
    Matrixd r(1, dh);
    for (int j = 0; j < dh; ++j) r(0, j) = m(t, h * dh + j);
    return r;
}

// ---------------------------------------------------------------------------------------------
// Gates (math §1), one sequence at a time: N x H each.

struct Gates {
    Matrixd theta, eta, alpha;
};

/// sigmoid(xrow . w[:, h] + b[h]) for a 1 x d row xrow.
inline double gate_value(const Matrixd& xrow, const Matrixd& w, const RowVectord& b, int h) {
    double s = 0.0;
    for (Eigen::Index i = 0; i < xrow.cols(); ++i) s += xrow(0, i) * w(i, h);
    return sigmoid(s + b(h));
}

/// Gates of one sequence xs (N x d). PerChunk uses chunks of `chunk` tokens at absolute
/// positions; each chunk's gates come from the mean of the chunk's tokens present.
inline Gates compute_gates(const MemoryConfig& cfg, const MemoryParams<double>& p,
                           const Matrixd& xs, int chunk) {
    const Eigen::Index N = xs.rows(), d = xs.cols();
    const int H = cfg.n_heads;
    Gates g{Matrixd(N, H), Matrixd(N, H), Matrixd(N, H)};
    if (cfg.gates == GateMode::Constant) {
        for (Eigen::Index t = 0; t < N; ++t)
            for (int h = 0; h < H; ++h) {
                g.theta(t, h) = cfg.constant_theta;
                g.eta(t, h) = cfg.momentum ? cfg.constant_eta : 0.0;
                g.alpha(t, h) = cfg.forget ? cfg.constant_alpha : 0.0;
            }
        return g;
    }
    if (cfg.gates == GateMode::DataDependent) {
        for (Eigen::Index t = 0; t < N; ++t) {
            Matrixd xrow(1, d);
            for (Eigen::Index i = 0; i < d; ++i) xrow(0, i) = xs(t, i);
            for (int h = 0; h < H; ++h) {
                g.theta(t, h) = cfg.theta_max * gate_value(xrow, p.w_theta, p.b_theta, h);
                g.eta(t, h) = cfg.momentum ? gate_value(xrow, p.w_eta, p.b_eta, h) : 0.0;
                g.alpha(t, h) = cfg.forget ? gate_value(xrow, p.w_alpha, p.b_alpha, h) : 0.0;
            }
        }
        return g;
    }
    // PerChunk.
    for (Eigen::Index c0 = 0; c0 < N; c0 += chunk) {
        const Eigen::Index c1 = std::min<Eigen::Index>(N, c0 + chunk);
        Matrixd xbar(1, d);
        for (Eigen::Index i = 0; i < d; ++i) {
            double s = 0.0;
            for (Eigen::Index t = c0; t < c1; ++t) s += xs(t, i);
            xbar(0, i) = s / static_cast<double>(c1 - c0);
        }
        for (int h = 0; h < H; ++h) {
            const double th = cfg.theta_max * gate_value(xbar, p.w_theta, p.b_theta, h);
            const double et = cfg.momentum ? gate_value(xbar, p.w_eta, p.b_eta, h) : 0.0;
            const double al = cfg.forget ? gate_value(xbar, p.w_alpha, p.b_alpha, h) : 0.0;
            for (Eigen::Index t = c0; t < c1; ++t) {
                g.theta(t, h) = th;
                g.eta(t, h) = et;
                g.alpha(t, h) = al;
            }
        }
    }
    return g;
}

// ---------------------------------------------------------------------------------------------
// Results and common plumbing.

struct Result {
    Matrixd y;  // (B*N) x d outputs
    // state after the last token: weights[b][h][l-1] = M_N, momentum[b][h][l-1] = S_N
    std::vector<std::vector<std::vector<Matrixd>>> weights, momentum;
    Matrixd loss;       // (B*N) x H: 1/2||M(k_t)-v_t||^2 at the weights the gradient is taken at
    Matrixd grad_norm;  // (B*N) x H: sqrt(sum_l ||grad W_l||_F^2) of that gradient
};

namespace detail_ref {

/// Validates cfg (PerChunk's restrictions on update/retrieval are not enforced here: the
/// reference ignores cfg.update), p and x. Returns N.
inline Eigen::Index check_inputs(const MemoryConfig& cfg, const MemoryParams<double>& p,
                                 const Matrixd& x, int batch) {
    MemoryConfig c = cfg;
    if (c.gates == GateMode::PerChunk) c.gates = GateMode::DataDependent;
    c.validate();
    p.validate(cfg);
    if (batch < 1) throw ShapeError(titans::detail::concat("reference: batch = ", batch, ", expected >= 1"));
    if (x.cols() != cfg.d_model) {
        throw ShapeError(titans::detail::concat("reference: x has ", x.cols(),
                                                " columns, expected d_model = ", cfg.d_model));
    }
    if (x.rows() % batch != 0) {
        throw ShapeError(titans::detail::concat("reference: x has ", x.rows(),
                                                " rows, not a multiple of batch = ", batch));
    }
    return x.rows() / batch;
}

inline Matrixd sequence_rows(const Matrixd& x, Eigen::Index b, Eigen::Index N) {
    Matrixd xs(N, x.cols());
    for (Eigen::Index t = 0; t < N; ++t)
        for (Eigen::Index i = 0; i < x.cols(); ++i) xs(t, i) = x(b * N + t, i);
    return xs;
}

inline Result make_result(const MemoryConfig& cfg, Eigen::Index rows, int batch) {
    Result r;
    r.y = Matrixd(rows, cfg.d_model);
    r.loss = Matrixd(rows, cfg.n_heads);
    r.grad_norm = Matrixd(rows, cfg.n_heads);
    for (Eigen::Index i = 0; i < rows; ++i) {
        for (int j = 0; j < cfg.d_model; ++j) r.y(i, j) = 0.0;
        for (int h = 0; h < cfg.n_heads; ++h) {
            r.loss(i, h) = 0.0;
            r.grad_norm(i, h) = 0.0;
        }
    }
    r.weights.assign(static_cast<std::size_t>(batch), {});
    r.momentum.assign(static_cast<std::size_t>(batch), {});
    return r;
}

/// y.row(row) = yh (1 x D) * W_O (D x d).
inline void write_output(Result& r, Eigen::Index row, const Matrixd& yh, const Matrixd& w_o) {
    for (Eigen::Index j = 0; j < w_o.cols(); ++j) {
        double s = 0.0;
        for (Eigen::Index c = 0; c < w_o.rows(); ++c) s += yh(0, c) * w_o(c, j);
        r.y(row, j) = s;
    }
}

/// yh(0, h*d_h + j) = m(0, j).
inline void put_head(Matrixd& yh, const Matrixd& m, int h, int dh) {
    for (int j = 0; j < dh; ++j) yh(0, h * dh + j) = m(0, j);
}

/// One step of math §3 on every layer: S = eta S - theta u; W = (1 - alpha) W + S.
inline void step(std::vector<Matrixd>& W, std::vector<Matrixd>& S, const std::vector<Matrixd>& u,
                 double theta, double eta, double alpha) {
    for (std::size_t l = 0; l < W.size(); ++l)
        for (Eigen::Index i = 0; i < W[l].rows(); ++i)
            for (Eigen::Index j = 0; j < W[l].cols(); ++j) {
                S[l](i, j) = eta * S[l](i, j) - theta * u[l](i, j);
                W[l](i, j) = (1.0 - alpha) * W[l](i, j) + S[l](i, j);
            }
}

/// math §10: theta * min(1, c / ||u||_F) with c = cfg.max_grad_norm (0: no clipping) and
/// ||u||_F the Frobenius norm of the token's whole gradient (every layer).
inline double clipped_theta(const MemoryConfig& cfg, double theta, const std::vector<Matrixd>& u) {
    const double n = grad_norm_of(u);
    if (cfg.max_grad_norm > 0 && n > cfg.max_grad_norm) {
        return theta * (cfg.max_grad_norm / n);
    }
    return theta;
}

inline std::vector<Matrixd> zero_state(const std::vector<Matrixd>& W0) {
    std::vector<Matrixd> S;
    for (const Matrixd& m : W0) S.push_back(zeros_like(m));
    return S;
}

}  // namespace detail_ref

// ---------------------------------------------------------------------------------------------
// math §3: the true per-token recurrence.

/// Gradient of token t at M_{t-1}. Lagged: y_t = M_{t-1}(q_t) (read, then write); InChunk:
/// write, then y_t = M_t(q_t). loss/grad_norm at M_{t-1}. Throws ConfigError for PerChunk
/// gates. Ignores cfg.chunk and cfg.update.
inline Result per_token(const MemoryConfig& cfg, const MemoryParams<double>& p, const Matrixd& x,
                        int batch) {
    if (cfg.gates == GateMode::PerChunk) {
        throw ConfigError("reference::per_token: gates = PerChunk is not defined per token");
    }
    const Eigen::Index N = detail_ref::check_inputs(cfg, p, x, batch);
    const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
    const Activation act = cfg.activation;
    const bool res = cfg.residual;
    Result r = detail_ref::make_result(cfg, x.rows(), batch);
    for (int b = 0; b < batch; ++b) {
        const Matrixd xs = detail_ref::sequence_rows(x, b, N);
        const QKV pr = project_qkv(cfg, p, xs);
        const Gates g = compute_gates(cfg, p, xs, 1);
        std::vector<Matrixd> yheads(static_cast<std::size_t>(N), Matrixd(1, D));
        for (int h = 0; h < H; ++h) {
            std::vector<Matrixd> W = p.memory_init[static_cast<std::size_t>(h)];
            std::vector<Matrixd> S = detail_ref::zero_state(W);
            for (Eigen::Index t = 0; t < N; ++t) {
                const Matrixd q = head_row(pr.q, t, h, dh);
                const Matrixd k = head_row(pr.k, t, h, dh);
                const Matrixd v = head_row(pr.v, t, h, dh);
                if (cfg.retrieval == Retrieval::Lagged) {
                    detail_ref::put_head(yheads[static_cast<std::size_t>(t)],
                                         mlp_forward(W, q, act, res), h, dh);
                }
                const std::vector<Matrixd> u = assoc_grad(W, k, v, act, res);
                r.loss(b * N + t, h) = assoc_loss(W, k, v, act, res);
                r.grad_norm(b * N + t, h) = grad_norm_of(u);
                detail_ref::step(W, S, u, detail_ref::clipped_theta(cfg, g.theta(t, h), u),
                                 g.eta(t, h), g.alpha(t, h));
                if (cfg.retrieval == Retrieval::InChunk) {
                    detail_ref::put_head(yheads[static_cast<std::size_t>(t)],
                                         mlp_forward(W, q, act, res), h, dh);
                }
            }
            r.weights[static_cast<std::size_t>(b)].push_back(W);
            r.momentum[static_cast<std::size_t>(b)].push_back(S);
        }
        for (Eigen::Index t = 0; t < N; ++t) {
            detail_ref::write_output(r, b * N + t, yheads[static_cast<std::size_t>(t)], p.w_o);
        }
    }
    return r;
}

// ---------------------------------------------------------------------------------------------
// math §4/§5 by a per-token loop with chunk-start gradients.

/// Chunks of b = cfg.chunk tokens at absolute positions (the last one possibly shorter). In a
/// chunk starting from (W^s, S^s): u_i = grad l(W^s; k_i, v_i) for every token i of the chunk,
/// then S_i = eta_i S_{i-1} - theta_i u_i, W_i = (1 - alpha_i) W_{i-1} + S_i token by token,
/// materialising every W_i. Lagged: y_i = M_{W^s}(q_i); InChunk: y_i = M_{W_i}(q_i).
/// loss/grad_norm at W^s. Supports every GateMode. Ignores cfg.update.
inline Result chunk_start_loop(const MemoryConfig& cfg, const MemoryParams<double>& p,
                               const Matrixd& x, int batch) {
    const Eigen::Index N = detail_ref::check_inputs(cfg, p, x, batch);
    const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
    const int bsz = cfg.chunk;
    const Activation act = cfg.activation;
    const bool res = cfg.residual;
    Result r = detail_ref::make_result(cfg, x.rows(), batch);
    for (int b = 0; b < batch; ++b) {
        const Matrixd xs = detail_ref::sequence_rows(x, b, N);
        const QKV pr = project_qkv(cfg, p, xs);
        const Gates g = compute_gates(cfg, p, xs, bsz);
        std::vector<Matrixd> yheads(static_cast<std::size_t>(N), Matrixd(1, D));
        for (int h = 0; h < H; ++h) {
            std::vector<Matrixd> W = p.memory_init[static_cast<std::size_t>(h)];
            std::vector<Matrixd> S = detail_ref::zero_state(W);
            for (Eigen::Index c0 = 0; c0 < N; c0 += bsz) {
                const Eigen::Index c1 = std::min<Eigen::Index>(N, c0 + bsz);
                const std::vector<Matrixd> Ws = W;  // chunk-start weights
                // Every gradient of the chunk at W^s.
                std::vector<std::vector<Matrixd>> u;
                for (Eigen::Index t = c0; t < c1; ++t) {
                    const Matrixd k = head_row(pr.k, t, h, dh);
                    const Matrixd v = head_row(pr.v, t, h, dh);
                    u.push_back(assoc_grad(Ws, k, v, act, res));
                    r.loss(b * N + t, h) = assoc_loss(Ws, k, v, act, res);
                    r.grad_norm(b * N + t, h) = grad_norm_of(u.back());
                }
                // The recurrence, token by token.
                for (Eigen::Index t = c0; t < c1; ++t) {
                    const Matrixd q = head_row(pr.q, t, h, dh);
                    const std::vector<Matrixd>& ut = u[static_cast<std::size_t>(t - c0)];
                    detail_ref::step(W, S, ut, detail_ref::clipped_theta(cfg, g.theta(t, h), ut),
                                     g.eta(t, h), g.alpha(t, h));
                    const std::vector<Matrixd>& Wread =
                        cfg.retrieval == Retrieval::Lagged ? Ws : W;
                    detail_ref::put_head(yheads[static_cast<std::size_t>(t)],
                                         mlp_forward(Wread, q, act, res), h, dh);
                }
            }
            r.weights[static_cast<std::size_t>(b)].push_back(W);
            r.momentum[static_cast<std::size_t>(b)].push_back(S);
        }
        for (Eigen::Index t = 0; t < N; ++t) {
            detail_ref::write_output(r, b * N + t, yheads[static_cast<std::size_t>(t)], p.w_o);
        }
    }
    return r;
}

}  // namespace titans::reference
