#pragma once
// titans/attention/segment.hpp: MAC's segment attention (math §7, "MAC"), the call a backend's
// AttentionKernels::segment runs (SegmentCall, on views in its memory) and its host form
// (segment_attention, on Eigen matrices: the CPU kernel, and MAC's training pass on any
// backend).
//
// For a part of m rows at offset o of a segment of C tokens (absolute position pos), per
// stream b with its rows U_b (m x d) and their memory read h_b:
//     q, k, v = U_b W_Q, U_b W_K, U_b W_V      (RoPE on q and k at positions pos .. pos+m-1)
//     k_h, v_h = h_b W_K, h_b W_V
//     the stream's segment buffers (2C x D): row 2(o+i) = (k_h, v_h)_i, row 2(o+i)+1 = (k, v)_i
//     y_b = Attn(q; P ‖ buffer rows [0, 2(o+i)+2)) W_O
// query i sits at interleaved row 2(o+i)+1 and sees the prefix P W_K, P W_V and every
// segment row up to its own (h_i included): causal over the segment.

#include <cstdint>

#include "../detail/product.hpp"
#include "../types.hpp"
#include "../view.hpp"
#include "config.hpp"
#include "kernel.hpp"
#include "params.hpp"
#include "prefix.hpp"
#include "rope.hpp"

namespace titans {

/// One part of a MAC segment on a backend (views in its memory, checked by the caller):
/// u and h (B*m) x d (stream-major: stream b's rows at b*m), seg_k and seg_v (B*2C) x D
/// (stream b's buffer at rows b*2C), the prefix P W_K, P W_V (N_p x D, shared), y (B*m) x d.
template <class T>
struct SegmentCall {
    View<const T> u, h;
    View<T> seg_k, seg_v;
    PrefixView<T> prefix;
    View<T> y;
    int batch = 1, segment = 1, offset = 0, rows = 0;
    std::int64_t position = 0;
};

namespace detail {

/// The segment attention on the host (see the file's comment): writes the part's keys and
/// values into seg_k, seg_v ((B*2C) x D) and returns y ((B*m) x d). u, h: (B*m) x d.
template <class T, class SegK, class SegV>
Matrix<T> segment_attention(const AttentionConfig& cfg, const AttentionParams<T>& ap,
                            const MatrixRef<T>& u, const MatrixRef<T>& h, const MatrixRef<T>& kp,
                            const MatrixRef<T>& vp, SegK&& seg_k, SegV&& seg_v, int B, int C,
                            int o, std::int64_t pos) {
    const int Ha = cfg.n_heads, dha = cfg.head_dim();
    const Eigen::Index D = cfg.inner_dim(), m = u.rows() / B;
    Matrix<T> qs(u.rows(), D), ks(u.rows(), D), vs(u.rows(), D), kh(u.rows(), D),
        vh(u.rows(), D);
    multiply(qs, u, ap.w_q);
    multiply(ks, u, ap.w_k);
    multiply(vs, u, ap.w_v);
    multiply(kh, h, ap.w_k);
    multiply(vh, h, ap.w_v);
    Matrix<T> att(u.rows(), D);
    for (int b = 0; b < B; ++b) {
        const Eigen::Index r0 = static_cast<Eigen::Index>(b) * m;
        if (cfg.rope) {
            apply_rope<T>(qs.middleRows(r0, m), Ha, dha, pos, cfg.rope_base);
            apply_rope<T>(ks.middleRows(r0, m), Ha, dha, pos, cfg.rope_base);
        }
        auto sk = seg_k.middleRows(static_cast<Eigen::Index>(b) * 2 * C, 2 * C);
        auto sv = seg_v.middleRows(static_cast<Eigen::Index>(b) * 2 * C, 2 * C);
        for (Eigen::Index i = 0; i < m; ++i) {
            sk.row(2 * (o + i)) = kh.row(r0 + i);
            sv.row(2 * (o + i)) = vh.row(r0 + i);
            sk.row(2 * (o + i) + 1) = ks.row(r0 + i);
            sv.row(2 * (o + i) + 1) = vs.row(r0 + i);
        }
        // Query of token o+i sits at interleaved position 2(o+i)+1 (query stride 2) and
        // sees P, then h_0..h_{o+i} and s_0..s_{o+i}: causal over the segment, h included.
        prefix_window_attention<T>(qs.middleRows(r0, m), kp, vp, sk.topRows(2 * (o + m)),
                                   sv.topRows(2 * (o + m)), Ha, dha, 2 * C, 2 * o + 1,
                                   att.middleRows(r0, m), /*query_stride=*/2);
    }
    Matrix<T> y(u.rows(), cfg.d_model);
    multiply(y, att, ap.w_o);
    return y;
}

}  // namespace detail

}  // namespace titans
