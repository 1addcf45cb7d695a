#pragma once
// titans/backend/cpu/attention_training.hpp: the attention layer's training pass on the CPU
// (math §9).
//
// forward: the inference forward from a fresh state, keeping the input and the prefix rows.
// backward: the projections, RoPE and the per-sequence attention outputs recomputed; then
// W_O, the tiled kernel's backward (attention/kernel_backward.hpp), the transposed rotation,
// the input products and the prefix's projections reversed.

#include <utility>

#include "../../attention/kernel_backward.hpp"
#include "attention_kernels.hpp"

namespace titans::backend {

template <class T>
struct AttentionTraining<Cpu, T> {
    static constexpr bool available = true;
    using Kernels = AttentionKernels<Cpu, T>;
    using Mat = Matrix<T>;
    using Index = Eigen::Index;

    /// What backward needs: the input, the prefix rows (0 rows if none) and their sharing.
    struct Trace {
        AttentionConfig cfg;
        Mat x, prefix;
        PrefixSharing sharing = PrefixSharing::Shared;
        int batch = 0;
        bool filled = false;
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Index rows() const { return x.rows(); }
    };

    /// Kernels::forward from a fresh state, recording the trace. prefix: checked rows or null.
    static void forward(const AttentionConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y,
                        const Mat* prefix, PrefixSharing sharing, Trace& trace) {
        Trace t;
        t.cfg = cfg;
        t.batch = st.batch();
        t.x = cpu::as_eigen(x);
        t.prefix = prefix != nullptr ? *prefix : Mat(0, cfg.d_model);
        t.sharing = sharing;
        if (t.prefix.rows() > 0) {
            const auto projected = Kernels::project_prefix(cfg, p, view_of(t.prefix), sharing);
            const PrefixView<T> view = projected.view();
            Kernels::forward(cfg, p, st, x, y, &view);
        } else {
            Kernels::forward(cfg, p, st, x, y, nullptr);
        }
        t.filled = true;
        trace = std::move(t);
    }

    /// dL/dx (written), the parameters' gradients (added to g) and, if dprefix is given,
    /// dL/dprefix (written, the prefix's shape) from dy = dL/dy.
    static void backward(const AttentionConfig& cfg, const typename Kernels::Prepared& prepared,
                         const Trace& tr, View<const T> dyv, View<T> dxv, AttentionParams<T>& g,
                         Mat* dprefix) {
        const AttentionParams<T>& p = *prepared;
        const int B = tr.batch, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const Index N = tr.x.rows() / B;
        const auto dy = cpu::as_eigen(dyv);
        Mat q = tr.x * p.w_q, k = tr.x * p.w_k, v = tr.x * p.w_v;
        const detail::RopeTable<T> table(cfg.rope ? N : 0, dh, 0, cfg.rope_base);
        if (cfg.rope) {
            for (int b = 0; b < B; ++b) {
                table.apply(q.middleRows(b * N, N), H, dh);
                table.apply(k.middleRows(b * N, N), H, dh);
            }
        }
        const Mat kp = tr.prefix * p.w_k, vp = tr.prefix * p.w_v;
        const bool shared = tr.sharing == PrefixSharing::Shared;
        const Index np = shared ? kp.rows() : kp.rows() / B;
        Mat o(tr.x.rows(), D);
        for (int b = 0; b < B; ++b) {
            const Index p0 = shared ? 0 : b * np;
            detail::prefix_window_attention_impl<T>(
                q.middleRows(b * N, N), kp.middleRows(p0, np), vp.middleRows(p0, np),
                k.middleRows(b * N, N), v.middleRows(b * N, N), H, dh, cfg.window, 0,
                o.middleRows(b * N, N));
        }
        g.w_o.noalias() += o.transpose() * dy;
        const Mat dout = dy * p.w_o.transpose();
        Mat dq(q.rows(), D), dk(k.rows(), D), dv(v.rows(), D);
        Mat dkp = Mat::Zero(kp.rows(), D), dvp = Mat::Zero(vp.rows(), D);
        for (int b = 0; b < B; ++b) {
            const Index p0 = shared ? 0 : b * np;
            Mat dq_b, dkp_b = Mat::Zero(np, D), dvp_b = Mat::Zero(np, D);
            Mat dk_b = Mat::Zero(N, D), dv_b = Mat::Zero(N, D);
            prefix_window_attention_backward<T>(
                q.middleRows(b * N, N), kp.middleRows(p0, np), vp.middleRows(p0, np),
                k.middleRows(b * N, N), v.middleRows(b * N, N), H, dh, cfg.window, 0,
                dout.middleRows(b * N, N), dq_b, dkp_b, dvp_b, dk_b, dv_b);
            dq.middleRows(b * N, N) = dq_b;
            dk.middleRows(b * N, N) = dk_b;
            dv.middleRows(b * N, N) = dv_b;
            dkp.middleRows(p0, np) += dkp_b;
            dvp.middleRows(p0, np) += dvp_b;
        }
        if (cfg.rope) {
            for (int b = 0; b < B; ++b) {
                table.apply_transpose(dq.middleRows(b * N, N), H, dh);
                table.apply_transpose(dk.middleRows(b * N, N), H, dh);
            }
        }
        inputs_backward(p, tr, dq, dk, dv, dkp, dvp, g, cpu::as_eigen(dxv), dprefix);
    }

private:
    /// q = x W_Q, k = x W_K, v = x W_V, k_P = P W_K, v_P = P W_V, reversed.
    template <class DX>
    static void inputs_backward(const AttentionParams<T>& p, const Trace& tr, const Mat& dq,
                                const Mat& dk, const Mat& dv, const Mat& dkp, const Mat& dvp,
                                AttentionParams<T>& g, DX&& dx, Mat* dprefix) {
        g.w_q.noalias() += tr.x.transpose() * dq;
        g.w_k.noalias() += tr.x.transpose() * dk;
        g.w_v.noalias() += tr.x.transpose() * dv;
        dx.noalias() = dq * p.w_q.transpose();
        dx.noalias() += dk * p.w_k.transpose();
        dx.noalias() += dv * p.w_v.transpose();
        if (tr.prefix.rows() == 0) {
            return;
        }
        g.w_k.noalias() += tr.prefix.transpose() * dkp;
        g.w_v.noalias() += tr.prefix.transpose() * dvp;
        if (dprefix != nullptr) {
            dprefix->noalias() = dkp * p.w_k.transpose();
            dprefix->noalias() += dvp * p.w_v.transpose();
        }
    }
};

}  // namespace titans::backend
