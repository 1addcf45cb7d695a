#pragma once
// titans/attention/kernel_backward.hpp: prefix_window_attention_backward, the gradients of the
// tiled prefix + sliding-window attention of kernel.hpp with respect to its queries, keys and
// values, recomputing the softmax per query tile (never an n x m matrix).

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../error.hpp"
#include "../types.hpp"
#include "kernel.hpp"

namespace titans {

namespace detail {

/// The gradient arguments of prefix_window_attention_backward.
template <class T>
struct AttentionGradients {
    const Eigen::Ref<const Matrix<T>>& dout;
    Matrix<T>& dq;
    Matrix<T>& dk_prefix;
    Matrix<T>& dv_prefix;
    Matrix<T>& dk_seq;
    Matrix<T>& dv_seq;
};

/// ShapeError naming the first bad gradient argument: dout n x D, dk_prefix / dv_prefix p x D
/// (0 x 0 accepted when p = 0), dk_seq / dv_seq m x D, and no output sharing its storage with an
/// input or another output. Called after check_attention_operands (D is valid).
template <class T>
void check_attention_gradients(const AttentionOperands<T>& a, const AttentionGradients<T>& g) {
    using Index = Eigen::Index;
    constexpr const char* w = "prefix_window_attention_backward";
    const Index D = static_cast<Index>(a.n_heads) * a.d_head;
    const Index n = a.q.rows(), p = a.k_prefix.rows(), m = a.k_seq.rows();
    auto shape = [&](const auto& x, const char* name, Index rows, const char* what) {
        const bool empty_ok = rows == 0 && x.rows() == 0 && x.cols() == 0;
        if ((x.rows() != rows || x.cols() != D) && !empty_ok) {
            throw ShapeError(concat(w, ": ", name, " is ", x.rows(), " x ", x.cols(),
                                    ", expected ", rows, " x ", D, " (", what, ")"));
        }
    };
    shape(g.dout, "dout", n, "q.rows() x n_heads * d_head");
    shape(g.dk_prefix, "dk_prefix", p, "the shape of k_prefix");
    shape(g.dv_prefix, "dv_prefix", p, "the shape of v_prefix");
    shape(g.dk_seq, "dk_seq", m, "the shape of k_seq");
    shape(g.dv_seq, "dv_seq", m, "the shape of v_seq");
    const Matrix<T>* const outs[] = {&g.dq, &g.dk_prefix, &g.dv_prefix, &g.dk_seq, &g.dv_seq};
    const char* const names[] = {"dq", "dk_prefix", "dv_prefix", "dk_seq", "dv_seq"};
    const Eigen::Ref<const Matrix<T>>* const ins[] = {&a.q,     &a.k_prefix, &a.v_prefix,
                                                      &a.k_seq, &a.v_seq,    &g.dout};
    for (int o = 0; o < 5; ++o) {
        bool shared = false;
        for (const auto* in : ins) shared = shared || overlaps(*in, *outs[o]);
        for (int o2 = 0; o2 < o; ++o2) shared = shared || outs[o] == outs[o2];
        if (shared) {
            throw ShapeError(concat(w, ": ", names[o], " shares its storage with an input or "
                                    "another gradient, expected a distinct matrix"));
        }
    }
}

/// Per-head workspaces of the backward: the softmax probabilities against the prefix (pp) and
/// the key span (ps), then the score gradients in dpp / dps (dP, overwritten by scale * dS).
template <class T>
struct AttentionBackwardTile {
    Matrix<T> pp, ps, dpp, dps;
    Eigen::Matrix<T, Eigen::Dynamic, 1> inv;  // 1 / row sums
};

/// The softmax probabilities of queries [i0, i0 + t) of head columns [c0, c0 + d_h), exactly as
/// attention_unit computes them (softmax_numerators, then each row times its 1 / sum), into
/// ws.pp (t x p) and ws.ps (t x L); returns the span.
template <class T>
AttentionSpan attention_probabilities(const AttentionOperands<T>& a, Eigen::Index i0,
                                      Eigen::Index t, Eigen::Index c0, T scale,
                                      AttentionBackwardTile<T>& ws) {
    const AttentionSpan span = softmax_numerators(a, i0, t, c0, scale, ws.ps, ws.pp, ws.inv);
    ws.ps.topLeftCorner(t, span.L) = ws.inv.head(t).asDiagonal() * ws.ps.topLeftCorner(t, span.L);
    if (a.k_prefix.rows() > 0) {
        ws.pp.topRows(t) = ws.inv.head(t).asDiagonal() * ws.pp.topRows(t);
    }
    return span;
}

/// The backward of one (query tile, head) unit: dV += P^T dO, dP = dO V^T,
/// dS = scale * P ⊙ (dP - rowsum(dP ⊙ P)), dq = dS K, dK += dS^T q, over the prefix and the
/// key span together.
template <class T>
void attention_unit_backward(const AttentionOperands<T>& a, const AttentionGradients<T>& g,
                             Eigen::Index i0, Eigen::Index t, Eigen::Index c0, T scale,
                             AttentionBackwardTile<T>& ws) {
    using Index = Eigen::Index;
    const Index p = a.k_prefix.rows(), dh = a.d_head;
    const auto [js, L] = attention_probabilities(a, i0, t, c0, scale, ws);
    const auto qh = a.q.block(i0, c0, t, dh);
    const auto doh = g.dout.block(i0, c0, t, dh);
    const auto Ps = ws.ps.topLeftCorner(t, L);
    const auto Pp = ws.pp.topRows(t);
    auto dSs = ws.dps.topLeftCorner(t, L);
    auto dSp = ws.dpp.topRows(t);
    g.dv_seq.block(js, c0, L, dh).noalias() += Ps.transpose() * doh;
    dSs.noalias() = doh * a.v_seq.block(js, c0, L, dh).transpose();
    if (p > 0) {
        g.dv_prefix.block(0, c0, p, dh).noalias() += Pp.transpose() * doh;
        dSp.noalias() = doh * a.v_prefix.block(0, c0, p, dh).transpose();
    }
    for (Index r = 0; r < t; ++r) {
        // rowsum(dP ⊙ P) = dO_r . O_r: the softmax Jacobian's projection (masked P entries are 0).
        T delta = (dSs.row(r).array() * Ps.row(r).array()).sum();
        if (p > 0) delta += (dSp.row(r).array() * Pp.row(r).array()).sum();
        dSs.row(r).array() = scale * Ps.row(r).array() * (dSs.row(r).array() - delta);
        if (p > 0) {
            dSp.row(r).array() = scale * Pp.row(r).array() * (dSp.row(r).array() - delta);
        }
    }
    auto dqh = g.dq.block(i0, c0, t, dh);
    dqh.noalias() = dSs * a.k_seq.block(js, c0, L, dh);
    g.dk_seq.block(js, c0, L, dh).noalias() += dSs.transpose() * qh;
    if (p > 0) {
        dqh.noalias() += dSp * a.k_prefix.block(0, c0, p, dh);
        g.dk_prefix.block(0, c0, p, dh).noalias() += dSp.transpose() * qh;
    }
}

}  // namespace detail

/// The gradients of prefix_window_attention (same inputs, same visibility rule: query row i at
/// key position t = first_query + query_stride * i sees every prefix row and the sequence rows
/// t - window < j <= t) for an upstream gradient dout = dL/dout. Per head h (columns
/// [h*d_h, (h+1)*d_h)) and query row i, with K, V the visible keys and values
/// [K_prefix ; K_seq[win(i)]], [V_prefix ; V_seq[win(i)]] and scale = 1 / sqrt(d_h):
///
///     P_i   = softmax(scale * q_i K^T)                 (recomputed per query tile)
///     dV   += P_i^T dout_i              dP_i = dout_i V^T
///     dS_i  = P_i ⊙ (dP_i - rowsum(dP_i ⊙ P_i))        (rowsum(dP ⊙ P) = dout_i . out_i)
///     dq_i  = scale * dS_i K            dK  += scale * dS_i^T q_i
///
/// Shapes (D = n_heads * d_head): the inputs as for the forward; dout n x D; dq is WRITTEN
/// (resized to n x D); dk_prefix, dv_prefix (p x D, or 0 x 0 when p = 0) and dk_seq, dv_seq
/// (m x D) are ADDED to: the caller zeroes them, and calls for several pieces accumulate. Rows of
/// dk_seq / dv_seq that no query sees are left as they were. No output may share its storage
/// with an input or another output.
///
/// Computed in the forward's query tiles against only the key span their windows cover, with
/// Eigen GEMMs: O(n (p + window + tile) d_h) work per head and O(tile (p + window + tile))
/// workspace per head, never an n x m matrix. Parallel over heads under OpenMP (heads own
/// disjoint columns; the tiles of one head run in order, as their key spans overlap). Throws
/// ConfigError / ShapeError as the forward does, and ShapeError naming a gradient argument of
/// the wrong shape; a refused call changes no output. Checks no finiteness.
///
///     titans::prefix_window_attention_backward(q, kp, vp, ks, vs, H, d_h, window, first, dout,
///                                              dq, dkp, dvp, dks, dvs);
///
/// The Ref arguments take any row-major views; T is deduced from the gradient matrices.
template <class T>
void prefix_window_attention_backward(
    const Eigen::Ref<const Matrix<std::type_identity_t<T>>>& q,
    const Eigen::Ref<const Matrix<std::type_identity_t<T>>>& k_prefix,
    const Eigen::Ref<const Matrix<std::type_identity_t<T>>>& v_prefix,
    const Eigen::Ref<const Matrix<std::type_identity_t<T>>>& k_seq,
    const Eigen::Ref<const Matrix<std::type_identity_t<T>>>& v_seq, int n_heads, int d_head,
    int window, Eigen::Index first_query,
    const Eigen::Ref<const Matrix<std::type_identity_t<T>>>& dout, Matrix<T>& dq,
    Matrix<T>& dk_prefix, Matrix<T>& dv_prefix, Matrix<T>& dk_seq, Matrix<T>& dv_seq,
    Eigen::Index query_stride = 1) {
    using Index = Eigen::Index;
    const Index n = q.rows(), p = k_prefix.rows(), m = k_seq.rows();
    // The forward's checker measures `out`: a stand-in for dq, so a refused call leaves dq as
    // it was.
    detail::AttentionOutputProbe<T> probe(n, n_heads, d_head);
    const Index D = probe.map.cols();
    const detail::AttentionOperands<T> a{q,         k_prefix, v_prefix, k_seq,  v_seq,
                                         probe.ref, n_heads,  d_head,   window, first_query,
                                         query_stride};
    detail::check_attention_operands(a);
    const detail::AttentionGradients<T> g{dout, dq, dk_prefix, dv_prefix, dk_seq, dv_seq};
    detail::check_attention_gradients(a, g);
    dq.resize(n, D);
    if (n == 0) return;
    const Index tile = detail::attention_query_tile(window);
    const Index span_cap = detail::attention_span_cap(query_stride, tile, window, m);
    const T scale = T(1) / std::sqrt(static_cast<T>(d_head));
#if defined(_OPENMP)
    const double work = static_cast<double>(n) * static_cast<double>(p + span_cap) *
                        static_cast<double>(n_heads) * d_head;
#pragma omp parallel for schedule(static) if (n_heads > 1 && work >= 1.0e6)
#endif
    for (int h = 0; h < n_heads; ++h) {
        detail::AttentionBackwardTile<T> ws{Matrix<T>(tile, p), Matrix<T>(tile, span_cap),
                                            Matrix<T>(tile, p), Matrix<T>(tile, span_cap),
                                            Eigen::Matrix<T, Eigen::Dynamic, 1>(tile)};
        for (Index i0 = 0; i0 < n; i0 += tile) {
            detail::attention_unit_backward(a, g, i0, std::min(tile, n - i0),
                                            static_cast<Index>(h) * d_head, scale, ws);
        }
    }
}

}  // namespace titans
