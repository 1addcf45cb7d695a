#pragma once
// titans/backend/cpu/attention_training.hpp: the attention layer's training pass on the CPU
// (math §9).
//
// forward: the inference forward from any state, keeping the input, the prefix rows, the
// incoming position and the window's kept keys and values. backward: the projections, RoPE and
// the per-sequence attention outputs recomputed; then W_O, the tiled kernel's backward
// (attention/kernel_backward.hpp) over [kept ; new] keys, the adjoint of the window the call
// left added to its rows, the transposed rotation, the input products and the prefix's
// projections reversed; the kept rows' adjoint is the incoming state's.

#include <cstdint>
#include <utility>
#include <vector>

#include "../../attention/kernel_backward.hpp"
#include "../../attention/state_gradient.hpp"
#include "../../detail/tensor_slots.hpp"
#include "../../detail/trace.hpp"
#include "attention_kernels.hpp"
#include "../../attention/kernels_decl.hpp"

namespace titans::backend {

template <class T>
struct AttentionTraining<Cpu, T> {
    static constexpr bool available = true;
    using Kernels = AttentionKernels<Cpu, T>;
    using Mat = Matrix<T>;
    using Index = Eigen::Index;

    /// What backward needs: the input, the prefix rows (0 rows if none) and their sharing, the
    /// incoming position and each sequence's kept keys (rotated) and values.
    struct Trace {
        AttentionConfig cfg;
        Mat x, prefix;
        PrefixSharing sharing = PrefixSharing::Shared;
        int batch = 0;
        std::int64_t start = 0;
        std::vector<Mat> kept_k, kept_v;
        detail::TraceFilled filled;  // a moved-from trace is empty
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Index rows() const { return x.rows(); }
    };

    /// The sizes forward leaves in a trace for cfg, past the checks of batch, rows and start
    /// (Attention::validate_trace): the prefix d_model wide (PerSequence: a multiple of batch
    /// rows), and per sequence min(window - 1, start) x D kept keys and values. ShapeError
    /// naming the part otherwise.
    static void check_trace(const AttentionConfig& cfg, const Trace& tr, const char* where) {
        detail::check_trace_prefix(cfg.d_model, tr.prefix.rows(), tr.prefix.cols(), tr.sharing,
                                   tr.batch, where);
        const Index h = std::min<std::int64_t>(cfg.window - 1, tr.start), D = cfg.inner_dim();
        for (const std::vector<Mat>* kept : {&tr.kept_k, &tr.kept_v}) {
            const char* part = kept == &tr.kept_k ? "kept_k" : "kept_v";
            detail::check_trace_part(kept->size() == static_cast<std::size_t>(tr.batch), where,
                                     detail::concat(part, ".size()"), kept->size(),
                                     "trace.batch");
            for (const Mat& m : *kept) {
                detail::check_trace_shape(m, h, D, where, part);
            }
        }
    }

    /// Kernels::forward from any state, recording the trace. prefix: checked rows (0 rows:
    /// none).
    static void forward(const AttentionConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y,
                        View<const T> prefix, PrefixSharing sharing, Trace& trace) {
        Trace t;
        t.cfg = cfg;
        t.batch = st.batch();
        t.x = cpu::as_eigen(x);
        t.prefix = prefix.rows > 0 ? Mat(cpu::as_eigen(prefix)) : Mat(0, cfg.d_model);
        t.sharing = sharing;
        t.start = st.position();
        for (int b = 0; b < t.batch; ++b) {
            t.kept_k.emplace_back(st.keys(b));
            t.kept_v.emplace_back(st.values(b));
        }
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

    /// dL/dx (written), the parameters' gradients added to `grads` (1 x the parameters'
    /// count, W_Q, W_K, W_V, W_O row-major one after the other) and, if dprefix is not empty,
    /// dL/dprefix added to it (the prefix's shape) from dy = dL/dy. d_out (checked, or null):
    /// the adjoint of the window the call left; d_in (or null) receives the incoming window's.
    /// The gradients gather in zeros first, then join grads and dprefix.
    static void backward(const AttentionConfig& cfg, const typename Kernels::Prepared& prepared,
                         const Trace& tr, View<const T> dyv, View<T> dxv, View<T> grads,
                         View<T> dprefix, const AttentionStateGradient<T>* d_out = nullptr,
                         AttentionStateGradient<T>* d_in = nullptr) {
        auto local = AttentionParams<T>::zeros(cfg);
        Mat dp;
        backward_into(cfg, prepared, tr, dyv, dxv, local, dprefix.empty() ? nullptr : &dp,
                      d_out, d_in);
        detail::add_flat_host(std::as_const(local), cfg, grads.data);
        if (!dprefix.empty() && dp.size() > 0) {
            cpu::as_eigen(dprefix) += dp;
        }
    }

    /// backward with the gradients added to g (host tensors) and dL/dprefix written to
    /// *dprefix (the prefix's shape) if dprefix is given.
    static void backward_into(const AttentionConfig& cfg,
                              const typename Kernels::Prepared& prepared, const Trace& tr,
                              View<const T> dyv, View<T> dxv, AttentionParams<T>& g,
                              Mat* dprefix, const AttentionStateGradient<T>* d_out,
                              AttentionStateGradient<T>* d_in) {
        const AttentionParams<T>& p = *prepared;
        const int B = tr.batch, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const Index N = tr.x.rows() / B;
        const auto dy = cpu::as_eigen(dyv);
        Mat q = tr.x * p.w_q, k = tr.x * p.w_k, v = tr.x * p.w_v;
        const detail::RopeTable<T> table(cfg.rope ? N : 0, dh, tr.start, cfg.rope_base);
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
        std::vector<Mat> ks(static_cast<std::size_t>(B)), vs(static_cast<std::size_t>(B));
        for (int b = 0; b < B; ++b) {  // each sequence's keys and values [kept ; new]
            const Index p0 = shared ? 0 : b * np;
            const auto i = static_cast<std::size_t>(b);
            ks[i] = stacked(tr.kept_k[i], k.middleRows(b * N, N));
            vs[i] = stacked(tr.kept_v[i], v.middleRows(b * N, N));
            detail::prefix_window_attention_impl<T>(
                q.middleRows(b * N, N), kp.middleRows(p0, np), vp.middleRows(p0, np), ks[i],
                vs[i], H, dh, cfg.window, tr.kept_k[i].rows(), o.middleRows(b * N, N));
        }
        g.w_o.noalias() += o.transpose() * dy;
        const Mat dout = dy * p.w_o.transpose();
        Mat dq(q.rows(), D), dk(k.rows(), D), dv(v.rows(), D);
        Mat dkp = Mat::Zero(kp.rows(), D), dvp = Mat::Zero(vp.rows(), D);
        if (d_in != nullptr) {
            d_in->keys.assign(static_cast<std::size_t>(B), Mat());
            d_in->values.assign(static_cast<std::size_t>(B), Mat());
        }
        for (int b = 0; b < B; ++b) {
            const auto i = static_cast<std::size_t>(b);
            sequence_backward(cfg, tr, b, q, ks[i], vs[i], kp, vp, dout, d_out, d_in, dq, dk, dv,
                              dkp, dvp);
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
    /// [top ; bottom], rows stacked.
    template <class A>
    static Mat stacked(const Mat& top, const A& bottom) {
        Mat out(top.rows() + bottom.rows(), top.cols());
        out.topRows(top.rows()) = top;
        out.bottomRows(bottom.rows()) = bottom;
        return out;
    }

    /// Sequence b's kernel backward over its keys and values ks, vs = [kept ; new] (queries
    /// after the kept rows): its rows of dq, dk, dv written, its prefix rows of dkp, dvp added
    /// to; the window the call left (the last min(w - 1, h + N) of those keys) takes d_out's
    /// adjoint, and the kept rows' adjoint goes to d_in.
    static void sequence_backward(const AttentionConfig& cfg, const Trace& tr, int b,
                                  const Mat& q, const Mat& ks, const Mat& vs, const Mat& kp,
                                  const Mat& vp, const Mat& dout,
                                  const AttentionStateGradient<T>* d_out,
                                  AttentionStateGradient<T>* d_in, Mat& dq, Mat& dk, Mat& dv,
                                  Mat& dkp, Mat& dvp) {
        const int B = tr.batch, D = cfg.inner_dim();
        const auto i = static_cast<std::size_t>(b);
        const Index N = tr.x.rows() / B, h = tr.kept_k[i].rows();
        const bool shared = tr.sharing == PrefixSharing::Shared;
        const Index np = shared ? kp.rows() : kp.rows() / B, p0 = shared ? 0 : b * np;
        Mat dq_b, dkp_b = Mat::Zero(np, D), dvp_b = Mat::Zero(np, D);
        Mat dks = Mat::Zero(h + N, D), dvs = Mat::Zero(h + N, D);
        if (N > 0) {
            prefix_window_attention_backward<T>(
                q.middleRows(b * N, N), kp.middleRows(p0, np), vp.middleRows(p0, np), ks, vs,
                cfg.n_heads, cfg.head_dim(), cfg.window, h, dout.middleRows(b * N, N), dq_b,
                dkp_b, dvp_b, dks, dvs);
            dq.middleRows(b * N, N) = dq_b;
        }
        if (d_out != nullptr) {
            const Index keep = d_out->keys[i].rows();
            dks.bottomRows(keep) += d_out->keys[i];
            dvs.bottomRows(keep) += d_out->values[i];
        }
        dk.middleRows(b * N, N) = dks.bottomRows(N);
        dv.middleRows(b * N, N) = dvs.bottomRows(N);
        dkp.middleRows(p0, np) += dkp_b;
        dvp.middleRows(p0, np) += dvp_b;
        if (d_in != nullptr) {
            d_in->keys[i] = dks.topRows(h);
            d_in->values[i] = dvs.topRows(h);
        }
    }

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
