#pragma once
// titans/attention/segment_backward.hpp: the reverse of MAC's segment attention (math §9,
// "MAC"; the forward in segment.hpp): the call a backend's AttentionKernels::segment_backward
// runs (SegmentBackwardCall, on views in its memory) and its host form
// (segment_attention_backward: the CPU kernel, and MAC's training pass).
//
// For a part of m rows at offset o of a segment of C tokens (absolute position pos), per
// stream b: the forward is recomputed (q, k, v = U_b W_{Q,K,V} with RoPE; k_h, v_h = h_b W_{K,V};
// the buffer [kept rows (2o); (k_h, v_h)_i, (k, v)_i interleaved], n = 2(o+m) rows; att_b =
// Attn(q; P W_K ‖ buffer) with query i at row 2(o+i)+1), then with dy = dL/dy:
//     g_O += att^T dy,  datt = dy W_O^T
//     dq, d(buffer rows), d(prefix rows)  from the softmax's reverse (attention_row_backward.hpp)
//     d(buffer rows) += the adjoint the rows get after the part (the state the call leaves)
//     dkept = d(buffer rows [0, 2o)); dk, dv, dk_h, dv_h = the part's rows taken apart; RoPE^T
//     g_Q += U^T dq, g_K += U^T dk + h^T dk_h + P^T dk_P, g_V likewise, g_P += dk_P W_K^T + dv_P W_V^T
//     dU = dq W_Q^T + dk W_K^T + dv W_V^T,  dh = dk_h W_K^T + dv_h W_V^T

#include <cstdint>

#include "../types.hpp"
#include "../view.hpp"
#include "config.hpp"
#include "kernel.hpp"
#include "kernel_backward.hpp"
#include "params.hpp"
#include "prefix.hpp"
#include "rope.hpp"

namespace titans {

/// The reverse of one SegmentCall on a backend (views in its memory, checked by the caller;
/// stream b's rows at b * its rows per stream):
///   u, h, dy        (B*m) x d: the part's input, its memory reads, dL/dy
///   kept_k, kept_v  (B*2o) x D: the keys (RoPE applied) and values of the segment's first o
///                   tokens, as the forward's buffers held them (empty when o = 0)
///   after_k, after_v (B*2(o+m)) x D: the adjoint of the part's buffer rows from after the
///                   part (the state the call leaves; empty: none)
///   prefix          P W_K, P W_V (N_p x D, shared) and persistent P (N_p x d) for its gradient
///   du, dh          (B*m) x d, written
///   dkept_k, dkept_v (B*2o) x D, written (empty: not asked)
///   grads           1 x 4 d D, the attention's flat gradient (W_Q, W_K, W_V, W_O), added to
///   dpersistent     N_p x d, added to (empty when N_p = 0)
template <class T>
struct SegmentBackwardCall {
    View<const T> u, h, dy;
    View<const T> kept_k, kept_v, after_k, after_v;
    PrefixView<T> prefix;
    View<const T> persistent;
    View<T> du, dh, dkept_k, dkept_v;
    View<T> grads, dpersistent;
    int batch = 1, segment = 1, offset = 0, rows = 0;
    std::int64_t position = 0;
};

/// Where segment_attention_backward adds the parameter gradients on the host: W_Q, W_K, W_V
/// (d x D), W_O (D x d) and P (N_p x d), each a writable Eigen matrix, map or reference to one.
template <class M>
struct SegmentGradientSink {
    M w_q, w_k, w_v, w_o, persistent;
};

namespace detail {

/// The host operands of segment_attention_backward, as SegmentBackwardCall's (kp, vp = P W_K,
/// P W_V; P the persistent rows; after_k, after_v 0 rows for none).
template <class T>
struct SegmentBackwardOperands {
    MatrixRef<T> u, h, dy, kept_k, kept_v, after_k, after_v, kp, vp, persistent;
    int batch, segment, offset;
    std::int64_t position;
};

/// One stream's buffer rows [kept; (k_h, v_h)_i, (k, v)_i] (n = 2(o+m) rows) from its part of
/// the projections (rows r0 .. r0+m).
template <class T>
void segment_rows(const MatrixRef<T>& kept, const Matrix<T>& h_rows, const Matrix<T>& s_rows,
                  Eigen::Index b, Eigen::Index o, Eigen::Index m, Matrix<T>& to) {
    to.resize(2 * (o + m), h_rows.cols());
    if (o > 0) {
        to.topRows(2 * o) = kept.middleRows(b * 2 * o, 2 * o);
    }
    for (Eigen::Index i = 0; i < m; ++i) {
        to.row(2 * (o + i)) = h_rows.row(b * m + i);
        to.row(2 * (o + i) + 1) = s_rows.row(b * m + i);
    }
}

/// The reverse of segment_attention on the host (see the file's comment): du, dh ((B*m) x d)
/// and dkept_k, dkept_v ((B*2o) x D) written, the parameter gradients added to g.
template <class T, class M>
void segment_attention_backward(const AttentionConfig& cfg, const AttentionParams<T>& ap,
                                const SegmentBackwardOperands<T>& a, Matrix<T>& du,
                                Matrix<T>& dh, Matrix<T>& dkept_k, Matrix<T>& dkept_v,
                                SegmentGradientSink<M>& g) {
    const int Ha = cfg.n_heads, dha = cfg.head_dim(), B = a.batch;
    const Eigen::Index D = cfg.inner_dim(), rows = a.u.rows(), m = rows / B, o = a.offset;
    const Eigen::Index np = a.kp.rows(), n = 2 * (o + m);
    Matrix<T> qs = a.u * ap.w_q, ks = a.u * ap.w_k;
    const Matrix<T> vs = a.u * ap.w_v, kh = a.h * ap.w_k, vh = a.h * ap.w_v;
    const RopeTable<T> table(cfg.rope ? m : 0, dha, a.position, cfg.rope_base);
    Matrix<T> att(rows, D), dq(rows, D), dks(rows, D), dvs(rows, D), dkh(rows, D), dvh(rows, D);
    Matrix<T> dkp = Matrix<T>::Zero(np, D), dvp = Matrix<T>::Zero(np, D);
    dkept_k.resize(B * 2 * o, D);
    dkept_v.resize(B * 2 * o, D);
    const Matrix<T> datt = a.dy * ap.w_o.transpose();
    for (int b = 0; b < B; ++b) {
        const Eigen::Index r0 = b * m;
        if (cfg.rope) {
            table.apply(qs.middleRows(r0, m), Ha, dha);
            table.apply(ks.middleRows(r0, m), Ha, dha);
        }
        Matrix<T> sk, sv;  // [kept; h_o, s_o, h_{o+1}, s_{o+1}, ...]
        segment_rows<T>(a.kept_k, kh, ks, b, o, m, sk);
        segment_rows<T>(a.kept_v, vh, vs, b, o, m, sv);
        const Eigen::Index q0 = 2 * o + 1;
        prefix_window_attention<T>(qs.middleRows(r0, m), a.kp, a.vp, sk, sv, Ha, dha,
                                   2 * a.segment, q0, att.middleRows(r0, m), 2);
        Matrix<T> dq_b, dkp_b = Matrix<T>::Zero(np, D), dvp_b = Matrix<T>::Zero(np, D);
        Matrix<T> dsk = Matrix<T>::Zero(n, D), dsv = Matrix<T>::Zero(n, D);
        prefix_window_attention_backward<T>(qs.middleRows(r0, m), a.kp, a.vp, sk, sv, Ha, dha,
                                            2 * a.segment, q0, datt.middleRows(r0, m), dq_b,
                                            dkp_b, dvp_b, dsk, dsv, 2);
        if (a.after_k.rows() > 0) {  // the rows' adjoint from the state the call leaves
            dsk += a.after_k.middleRows(b * n, n);
            dsv += a.after_v.middleRows(b * n, n);
        }
        dkept_k.middleRows(b * 2 * o, 2 * o) = dsk.topRows(2 * o);
        dkept_v.middleRows(b * 2 * o, 2 * o) = dsv.topRows(2 * o);
        dq.middleRows(r0, m) = dq_b;
        dkp += dkp_b;
        dvp += dvp_b;
        for (Eigen::Index i = 0; i < m; ++i) {
            dkh.row(r0 + i) = dsk.row(2 * (o + i));
            dks.row(r0 + i) = dsk.row(2 * (o + i) + 1);
            dvh.row(r0 + i) = dsv.row(2 * (o + i));
            dvs.row(r0 + i) = dsv.row(2 * (o + i) + 1);
        }
        if (cfg.rope) {
            table.apply_transpose(dq.middleRows(r0, m), Ha, dha);
            table.apply_transpose(dks.middleRows(r0, m), Ha, dha);
        }
    }
    g.w_o.noalias() += att.transpose() * a.dy;
    g.w_q.noalias() += a.u.transpose() * dq;
    g.w_k.noalias() += a.u.transpose() * dks + a.h.transpose() * dkh;
    g.w_v.noalias() += a.u.transpose() * dvs + a.h.transpose() * dvh;
    du.noalias() = dq * ap.w_q.transpose() + dks * ap.w_k.transpose() + dvs * ap.w_v.transpose();
    dh.noalias() = dkh * ap.w_k.transpose() + dvh * ap.w_v.transpose();
    if (np > 0) {  // k_P = P W_K, v_P = P W_V
        g.w_k.noalias() += a.persistent.transpose() * dkp;
        g.w_v.noalias() += a.persistent.transpose() * dvp;
        g.persistent.noalias() += dkp * ap.w_k.transpose() + dvp * ap.w_v.transpose();
    }
}

}  // namespace detail

}  // namespace titans
