#pragma once
// titans/backend/cpu/memory_training.hpp: the neural memory's training pass on the CPU
// (math §9).
//
// forward: the inference forward, keeping the memory (W, S) at every chunk start (N/b copies
// per sequence and head, not N), the input products and the gate logits. backward: the conv,
// phi and norm recomputed from the kept products (elementwise); then per (sequence,
// head), in parallel, a reverse sweep over the chunks. Each chunk's key pass, gates and
// coefficients are recomputed from its start memory, and reversed in turn: the read (lagged or
// dual form), the chunk end W' = beta W + c S - A^T diag(g) Delta, S' = P S - A^T diag(s) Delta,
// the coefficient recurrences, the gradient clipping and the key pass with its second-order
// terms; the adjoint of the start memory is carried to the previous chunk. Last, the
// projections are reversed. The per-token update (math §3) is the chunk size 1 of the same.

#include <algorithm>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/float_env.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/chunk_coefficients_backward.hpp"
#include "../../memory/key_tape.hpp"
#include "memory_kernels.hpp"
#include "memory_projections.hpp"

namespace titans::backend {

template <class T>
struct MemoryTraining<Cpu, T> {
    static constexpr bool available = true;
    using Kernels = MemoryKernels<Cpu, T>;
    using Mat = Matrix<T>;
    using Layers = std::vector<Mat>;

    /// What backward needs: the input, the memory at every chunk start, the input products
    /// and gate logits (Kernels::Recording).
    struct Trace {
        MemoryConfig cfg;
        Mat x;
        int batch = 0;
        typename Kernels::Recording kept;
        bool filled = false;
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Eigen::Index rows() const { return x.rows(); }
    };

    /// The forward of Kernels::forward from a fresh state (position 0), recording the trace.
    static void forward(const MemoryConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y, Trace& trace) {
        Trace t;
        t.cfg = cfg;
        t.batch = st.batch();
        t.x = cpu::as_eigen(x);
        t.kept.memory.resize(static_cast<std::size_t>(t.batch) *
                             static_cast<std::size_t>(cfg.n_heads));
        Kernels::run(cfg, p, st, x, y, nullptr, &t.kept);
        t.filled = true;
        trace = std::move(t);
    }

    /// dL/dx (written, rows x d) and every parameter's gradient (added to grads) from
    /// dy = dL/dy.
    static void backward(const MemoryConfig& cfg, const typename Kernels::Prepared& prepared,
                         const Trace& tr, View<const T> dyv, View<T> dxv, MemoryParams<T>& g) {
        if (tr.x.rows() == 0) {
            return;  // an empty piece: dx is 0 x d, no parameter gradient
        }
        const MemoryParams<T>& p = *prepared;
        const int B = tr.batch, H = cfg.n_heads, D = cfg.inner_dim();
        const Eigen::Index N = tr.x.rows() / B;
        const auto dy = cpu::as_eigen(dyv);
        cpu::MemoryProjections<T> pr;
        pr.compute(cfg, p, tr.kept.u, tr.kept.logits, B);
        const Mat dyh = dy * p.w_o.transpose();
        Mat yh(tr.x.rows(), D), dqkv(tr.x.rows(), 3 * D), dlogits = Mat::Zero(pr.logits.rows(), pr.logits.cols());
        const int pairs = B * H;
        std::vector<Pair> work(static_cast<std::size_t>(pairs));
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
#endif
        for (int bh = 0; bh < pairs; ++bh) {
            const detail::DenormalFlushScope flush(cfg.flush_denormals);
            const Slice sl{pr, dyh, bh / H * N, bh % H, cfg.head_dim(), D, H};
            sweep(cfg, tr.kept.memory[static_cast<std::size_t>(bh)], sl, N,
                  work[static_cast<std::size_t>(bh)], yh, dqkv, dlogits);
        }
        g.w_o.noalias() += yh.transpose() * dy;
        for (int bh = 0; bh < pairs; ++bh) {
            auto& dw0 = g.memory_init[static_cast<std::size_t>(bh % H)];
            for (std::size_t l = 0; l < dw0.size(); ++l) {
                dw0[l] += work[static_cast<std::size_t>(bh)].dWn[l];
            }
        }
        Mat dx;
        pr.backward(cfg, p, tr.x, B, dqkv, dlogits, dx, g);
        cpu::as_eigen(dxv) = dx;
    }

private:
    /// One (sequence, head)'s rows and columns in the piece's matrices.
    struct Slice {
        const cpu::MemoryProjections<T>& pr;
        const Mat& dyh;
        Eigen::Index r0;
        int h, dh, D, H;
        template <class M>
        auto q(M& m, Eigen::Index t, Eigen::Index n) const {
            return m.block(r0 + t, h * dh, n, dh);
        }
        template <class M>
        auto k(M& m, Eigen::Index t, Eigen::Index n) const {
            return m.block(r0 + t, D + h * dh, n, dh);
        }
        template <class M>
        auto v(M& m, Eigen::Index t, Eigen::Index n) const {
            return m.block(r0 + t, 2 * D + h * dh, n, dh);
        }
    };

    /// Workspaces of one pair's reverse sweep.
    struct Pair {
        detail::KeyTape<T> tape;
        Layers W, S, dW, dS, dWn, dSn;  // chunk-start memory; adjoints at its start and end
        Layers hin, z, p1, p2, sc;      // the read, per layer
        Mat dq, dk, dv, dH, tmp, G, dG, dM;
        std::vector<T> theta0, theta, eta, alpha, g2, beta, c, g, s;
        std::vector<T> dtheta, deta, dalpha, dbeta, dc, dg, ds, scratch;
    };

    /// The reverse sweep over one pair's chunks (see the file comment). Leaves the adjoint of
    /// the first chunk's start memory (W^0) in w.dWn.
    static void sweep(const MemoryConfig& cfg, const std::vector<Mat>& snap, const Slice& sl,
                      Eigen::Index N, Pair& w, Mat& yh, Mat& dqkv, Mat& dlogits) {
        const int b = cfg.effective_chunk(), L = cfg.depth;
        const auto Ls = static_cast<std::size_t>(L);
        const Eigen::Index chunks = (N + b - 1) / b;
        w.W.resize(Ls);
        w.S.resize(Ls);
        w.dW.resize(Ls);
        w.dS.resize(Ls);
        w.dWn.resize(Ls);
        w.dSn.resize(Ls);
        for (std::size_t l = 0; l < Ls; ++l) {
            w.dWn[l].setZero(snap[l].rows(), snap[l].cols());
            w.dSn[l].setZero(snap[l].rows(), snap[l].cols());
        }
        for (Eigen::Index ch = chunks - 1; ch >= 0; --ch) {
            const auto at = static_cast<std::size_t>(ch) * 2 * Ls;
            for (std::size_t l = 0; l < Ls; ++l) {
                w.W[l] = snap[at + l];
                w.S[l] = snap[at + Ls + l];
                w.dW[l].setZero(w.W[l].rows(), w.W[l].cols());
                w.dS[l].setZero(w.W[l].rows(), w.W[l].cols());
            }
            const Eigen::Index t0 = ch * b;
            const int n = static_cast<int>(std::min<Eigen::Index>(b, N - t0));
            chunk_backward(cfg, sl, t0, n, ch + 1 < chunks, w, yh, dqkv, dlogits);
            std::swap(w.dW, w.dWn);
            std::swap(w.dS, w.dSn);
        }
    }

    /// One chunk of n rows at t0, reversed: recompute, then read, chunk end (if `end`),
    /// coefficients, clipping, key pass, gates.
    static void chunk_backward(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int n,
                               bool end, Pair& w, Mat& yh, Mat& dqkv, Mat& dlogits) {
        const Mat& qkv = sl.pr.qkv;
        w.tape.forward(w.W, sl.k(qkv, t0, n), sl.v(qkv, t0, n), cfg.activation, cfg.residual);
        gates(cfg, sl, t0, n, w);
        for (auto* v : {&w.dtheta, &w.deta, &w.dalpha, &w.dbeta, &w.dc, &w.dg, &w.ds}) {
            v->assign(static_cast<std::size_t>(n), T(0));
        }
        w.scratch.resize(6 * static_cast<std::size_t>(n));
        auto y = yh.block(sl.r0 + t0, sl.h * sl.dh, n, sl.dh);
        const auto dy = sl.dyh.block(sl.r0 + t0, sl.h * sl.dh, n, sl.dh);
        T dp_end = T(0);
        if (cfg.retrieval == Retrieval::Lagged) {
            lagged_backward(cfg, sl.q(qkv, t0, n), dy, w, y);
        } else {
            dual_backward(cfg, sl.q(qkv, t0, n), dy, n, w, y);
        }
        if (end) {
            dp_end = end_backward(n, w);
        }
        chunk_coefficients_backward<T>(
            n, w.theta.data(), w.eta.data(), w.alpha.data(), w.dbeta.data(), w.dc.data(),
            cfg.retrieval == Retrieval::InChunk ? w.dG.data() : nullptr,
            end ? w.dg.data() : nullptr, end ? w.ds.data() : nullptr, dp_end, w.dtheta.data(),
            w.deta.data(), w.dalpha.data(), w.scratch.data());
        clip_backward(cfg, n, w);
        w.tape.backward(w.W, cfg.activation, cfg.residual, w.dW, w.dk, w.dv);
        sl.q(dqkv, t0, n) = w.dq;
        sl.k(dqkv, t0, n) = w.dk;
        sl.v(dqkv, t0, n) = w.dv;
        gates_backward(cfg, sl, t0, n, w, dlogits);
    }

    /// The gates of rows [t0, t0+n) (theta0 before clipping, theta after, eta, alpha), as
    /// Kernels::gates_clipped computes them for a whole chunk.
    static void gates(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int n, Pair& w) {
        for (auto* v : {&w.theta0, &w.theta, &w.eta, &w.alpha, &w.g2}) {
            v->resize(static_cast<std::size_t>(n));
        }
        const T tmax = static_cast<T>(cfg.theta_max);
        const Mat& lg = sl.pr.logits;
        const auto logit = [&](int i, int which) { return lg(sl.r0 + t0 + i, which * sl.H + sl.h); };
        const auto mean = [&](int which) {
            T m = T(0);
            for (int i = 0; i < n; ++i) m += logit(i, which);
            return m / static_cast<T>(n);
        };
        for (int i = 0; i < n; ++i) {
            const auto u = static_cast<std::size_t>(i);
            if (cfg.gates == GateMode::Constant) {
                w.theta0[u] = static_cast<T>(cfg.constant_theta);
                w.eta[u] = static_cast<T>(cfg.constant_eta);
                w.alpha[u] = static_cast<T>(cfg.constant_alpha);
            } else {
                const bool chunk = cfg.gates == GateMode::PerChunk;
                w.theta0[u] = tmax * detail::sigmoid(chunk ? mean(0) : logit(i, 0));
                w.eta[u] = detail::sigmoid(chunk ? mean(1) : logit(i, 1));
                w.alpha[u] = detail::sigmoid(chunk ? mean(2) : logit(i, 2));
            }
            T g2 = T(0);
            for (std::size_t l = 0; l < w.tape.a.size(); ++l) {
                g2 += w.tape.a[l].row(i).squaredNorm() * w.tape.delta[l].row(i).squaredNorm();
            }
            w.g2[u] = g2;
            const T c = static_cast<T>(cfg.max_grad_norm);
            w.theta[u] = cfg.max_grad_norm > 0 && g2 > c * c ? w.theta0[u] * (c / std::sqrt(g2))
                                                             : w.theta0[u];
        }
    }

    /// The adjoints of the gate values (dtheta of theta0 after clip_backward) into the logits.
    static void gates_backward(const MemoryConfig& cfg, const Slice& sl, Eigen::Index t0, int n,
                               const Pair& w, Mat& dlogits) {
        if (cfg.gates == GateMode::Constant) {
            return;
        }
        const T tmax = static_cast<T>(cfg.theta_max);
        const Mat& lg = sl.pr.logits;
        const std::vector<T>* adj[3] = {&w.dtheta, &w.deta, &w.dalpha};
        for (int which = 0; which < 3; ++which) {
            const Eigen::Index col = which * sl.H + sl.h;
            const T scale = which == 0 ? tmax : T(1);
            const auto dsig = [](T z) { const T s = detail::sigmoid(z); return s * (T(1) - s); };
            if (cfg.gates == GateMode::PerChunk) {
                T m = T(0), d = T(0);
                for (int i = 0; i < n; ++i) {
                    m += lg(sl.r0 + t0 + i, col);
                    d += (*adj[which])[static_cast<std::size_t>(i)];
                }
                m /= static_cast<T>(n);
                const T dl = d * scale * dsig(m) / static_cast<T>(n);
                for (int i = 0; i < n; ++i) dlogits(sl.r0 + t0 + i, col) = dl;
            } else {
                for (int i = 0; i < n; ++i) {
                    dlogits(sl.r0 + t0 + i, col) = (*adj[which])[static_cast<std::size_t>(i)] *
                                                   scale * dsig(lg(sl.r0 + t0 + i, col));
                }
            }
        }
    }

    /// theta_i = theta0_i min(1, c / sqrt(g2_i)), g2_i = sum_l ||a_l,i||^2 ||delta_l,i||^2:
    /// dtheta becomes the adjoint of theta0; g2's adjoint goes into the tape's abar and dbar.
    static void clip_backward(const MemoryConfig& cfg, int n, Pair& w) {
        const T c = static_cast<T>(cfg.max_grad_norm);
        for (int i = 0; i < n; ++i) {
            const auto u = static_cast<std::size_t>(i);
            if (!(cfg.max_grad_norm > 0 && w.g2[u] > c * c)) {
                continue;
            }
            const T f = c / std::sqrt(w.g2[u]);
            const T dg2 = T(-0.5) * w.dtheta[u] * w.theta0[u] * f / w.g2[u];
            w.dtheta[u] *= f;
            for (std::size_t l = 0; l < w.tape.a.size(); ++l) {
                const T na = w.tape.a[l].row(i).squaredNorm();
                const T nd = w.tape.delta[l].row(i).squaredNorm();
                w.tape.abar[l].row(i) += (T(2) * dg2 * nd) * w.tape.a[l].row(i);
                w.tape.dbar[l].row(i) += (T(2) * dg2 * na) * w.tape.delta[l].row(i);
            }
        }
    }

    /// Lagged read y = M_W(q) (W the chunk-start memory) recomputed into y, and reversed:
    /// dq written, dW added.
    template <class Q, class DY, class Y>
    static void lagged_backward(const MemoryConfig& cfg, const Q& q, const DY& dy, Pair& w, Y& y) {
        const std::size_t L = w.W.size();
        w.hin.resize(L);
        w.z.resize(L);
        w.hin[0] = q;
        for (std::size_t l = 0; l < L; ++l) {
            w.z[l].noalias() = w.hin[l] * w.W[l];
            if (l + 1 < L) {
                w.hin[l + 1] = w.z[l].unaryExpr([&](T v) { return detail::activate(cfg.activation, v); });
            }
        }
        y = w.z[L - 1];
        if (cfg.residual) y += q;
        w.tmp = dy;  // the adjoint of z_l, l = L-1 first
        for (std::size_t l = L; l-- > 0;) {
            w.dW[l].noalias() += w.hin[l].transpose() * w.tmp;
            w.dH.noalias() = w.tmp * w.W[l].transpose();
            if (l > 0) {
                w.tmp = w.dH.cwiseProduct(w.z[l - 1].unaryExpr(
                    [&](T v) { return detail::activate_grad(cfg.activation, v); }));
            }
        }
        w.dq = w.dH;
        if (cfg.residual) w.dq += dy;
    }

    /// Dual-form read (math §5) recomputed into y, and reversed: per layer
    /// Z = diag(beta) H W + diag(c) H S - (G . (H A^T)) Delta. dq written; dW, dS, the tape's
    /// abar / dbar, dbeta, dc added; dG written.
    template <class Q, class DY, class Y>
    static void dual_backward(const MemoryConfig& cfg, const Q& q, const DY& dy, int n, Pair& w,
                              Y& y) {
        const std::size_t L = w.W.size();
        for (auto* v : {&w.beta, &w.c}) v->resize(static_cast<std::size_t>(n));
        w.G.resize(n, n);
        chunk_row_coefficients<T>(n, 0, w.theta.data(), w.eta.data(), w.alpha.data(),
                                  w.beta.data(), w.c.data(), w.G.data());
        const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> beta(w.beta.data(), n), c(w.c.data(), n);
        for (auto* v : {&w.hin, &w.z, &w.p1, &w.p2, &w.sc}) v->resize(L);
        w.hin[0] = q;
        for (std::size_t l = 0; l < L; ++l) {
            w.p1[l].noalias() = w.hin[l] * w.W[l];
            w.p2[l].noalias() = w.hin[l] * w.S[l];
            w.sc[l].noalias() = w.hin[l] * w.tape.a[l].transpose();
            w.dM = w.G.cwiseProduct(w.sc[l]);
            w.z[l] = beta.asDiagonal() * w.p1[l] + c.asDiagonal() * w.p2[l];
            w.z[l].noalias() -= w.dM * w.tape.delta[l];
            if (l + 1 < L) {
                w.hin[l + 1] = w.z[l].unaryExpr([&](T v) { return detail::activate(cfg.activation, v); });
            }
        }
        y = w.z[L - 1];
        if (cfg.residual) y += q;
        w.dG.setZero(n, n);
        w.tmp = dy;
        for (std::size_t l = L; l-- > 0;) {
            dual_layer_backward(l, beta, c, w);
            if (l > 0) {
                w.tmp = w.dH.cwiseProduct(w.z[l - 1].unaryExpr(
                    [&](T v) { return detail::activate_grad(cfg.activation, v); }));
            }
        }
        w.dq = w.dH;
        if (cfg.residual) w.dq += dy;
    }

    /// One layer of dual_backward: w.tmp = dZ_l in, w.dH = the adjoint of H_l's input out.
    template <class Vec>
    static void dual_layer_backward(std::size_t l, const Vec& beta, const Vec& c, Pair& w) {
        const Mat& dZ = w.tmp;
        const Mat& hin = w.hin[l];
        for (Eigen::Index i = 0; i < dZ.rows(); ++i) {
            w.dbeta[static_cast<std::size_t>(i)] += dZ.row(i).dot(w.p1[l].row(i));
            w.dc[static_cast<std::size_t>(i)] += dZ.row(i).dot(w.p2[l].row(i));
        }
        Mat scaled = beta.asDiagonal() * dZ;
        w.dW[l].noalias() += hin.transpose() * scaled;
        w.dH.noalias() = scaled * w.W[l].transpose();
        scaled = c.asDiagonal() * dZ;
        w.dS[l].noalias() += hin.transpose() * scaled;
        w.dH.noalias() += scaled * w.S[l].transpose();
        // - (G . sc) Delta: Delta's adjoint -(G . sc)^T dZ; dM = -dZ Delta^T into G and sc.
        const Mat M = w.G.cwiseProduct(w.sc[l]);
        w.tape.dbar[l].noalias() -= M.transpose() * dZ;
        w.dM.noalias() = -dZ * w.tape.delta[l].transpose();
        w.dG += w.dM.cwiseProduct(w.sc[l]);
        const Mat dsc = w.dM.cwiseProduct(w.G);
        w.dH.noalias() += dsc * w.tape.a[l];
        w.tape.abar[l].noalias() += dsc.transpose() * hin;
    }

    /// The chunk end W' = beta W + c S - A^T diag(g) Delta, S' = P S - A^T diag(s) Delta,
    /// reversed from dWn, dSn: dW, dS, abar, dbar, dg, ds, dbeta[n-1], dc[n-1] added; returns
    /// dP_end.
    static T end_backward(int n, Pair& w) {
        std::vector<T>& gk = w.g;
        std::vector<T>& sk = w.s;
        gk.resize(static_cast<std::size_t>(n));
        sk.resize(static_cast<std::size_t>(n));
        T be, ce, pe;
        chunk_end_coefficients<T>(n, w.theta.data(), w.eta.data(), w.alpha.data(), gk.data(),
                                  sk.data(), &be, &ce, &pe);
        const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> g(gk.data(), n), s(sk.data(), n);
        T dbe = T(0), dce = T(0), dpe = T(0);
        for (std::size_t l = 0; l < w.W.size(); ++l) {
            const Mat& A = w.tape.a[l];
            const Mat& Dl = w.tape.delta[l];
            w.dW[l] += be * w.dWn[l];
            w.dS[l] += ce * w.dWn[l] + pe * w.dSn[l];
            dbe += w.dWn[l].cwiseProduct(w.W[l]).sum();
            dce += w.dWn[l].cwiseProduct(w.S[l]).sum();
            dpe += w.dSn[l].cwiseProduct(w.S[l]).sum();
            const Mat AW = A * w.dWn[l], AS = A * w.dSn[l];
            for (int i = 0; i < n; ++i) {
                w.dg[static_cast<std::size_t>(i)] -= AW.row(i).dot(Dl.row(i));
                w.ds[static_cast<std::size_t>(i)] -= AS.row(i).dot(Dl.row(i));
            }
            w.tape.dbar[l].noalias() -= g.asDiagonal() * AW;
            w.tape.dbar[l].noalias() -= s.asDiagonal() * AS;
            const Mat DW = Dl * w.dWn[l].transpose(), DS = Dl * w.dSn[l].transpose();
            w.tape.abar[l].noalias() -= g.asDiagonal() * DW;
            w.tape.abar[l].noalias() -= s.asDiagonal() * DS;
        }
        w.dbeta[static_cast<std::size_t>(n - 1)] += dbe;
        w.dc[static_cast<std::size_t>(n - 1)] += dce;
        return dpe;
    }
};

}  // namespace titans::backend
