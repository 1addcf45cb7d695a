#pragma once
// tests/reference/reference_blocks.hpp: a plain, slow reference of the Titans blocks (math §6-7)
// and of a Model stack, used by tests/test_blocks.cpp to check titans::Block and titans::Model.
//
// Written from docs/math.md §6-7 and the documented semantics of Block (models/block.hpp), never from
// its code. Whole sequences only (no streaming), one sequence at a time, with per-segment and
// per-token loops. Double precision only. Building blocks:
//   - the memory: reference::chunk_start_loop (reference::per_token for UpdateMode::PerToken)
//     run on the WHOLE memory input stream of a sequence (reference_memory.hpp);
//   - attention: reference::attention, the full masked score matrix (reference_attention.hpp),
//     with reference::rope for the rotary embedding at absolute positions;
//   - RMSNorm and the feed-forward: reference::rms_norm / reference::feed_forward, explicit loops
//     (reference_attention.hpp): x / sqrt(mean(x^2) + eps) * w, (silu(x W1) ⊙ (x W3)) W2 or
//     gelu(x W1) W2.
//
//   block_mix(cfg, p, u, B)       the mixer on normalised input u ((B*N) x d), with details
//   block_forward(cfg, p, x, B)   u = RMSNorm(x), h = x + Mix(u), out = h + FFN(RMSNorm(h))
//   model_forward(cfg, p, x, B)   blocks in turn, final RMSNorm, head
//   embed(cfg, p, ids)            embedding rows of token ids
//
// The mixers, per sequence (P = persistent tokens, N_p rows; M = the memory):
//   LMM  o = M(u)
//   MAG  m = M(P ‖ u) without its first N_p rows; y = Attn(u) where query t sees every P row
//        (projected by W_K / W_V, never rotated) and u rows t-w < j <= t;
//        o = RMSNorm_y(y) ⊙ σ(RMSNorm_m(m))
//   SWA  o = y of MAG (no memory, no norms, no gate): the attention-only baseline
//   MAL  ỹ = M(P ‖ u) ((N_p + N) rows); o = the rows t >= N_p of SWA(ỹ), plain causal window w
//        over all N_p + N positions (P rows are ordinary first positions)
//   MAC  per segment S of C rows (absolute positions s0 .. s1-1):
//          W_snap = the memory weights after the y rows of all earlier segments (memory_init
//                   for the first: obtained by running the reference memory on those y rows);
//          h_i    = [ M_{W_snap,h}( n(φ(u_i W_Q^mem))_h ) ]_heads W_O^mem   (no conv);
//          query i (rotated at its absolute position) sees all P rows, h_{s0..i} (P and h
//          projected by the attention's W_K / W_V, never rotated) and u_{s0..i} (rotated);
//          y_i = Attn × W_O;
//        the memory is written with the y rows of all segments in order; r = its outputs (in its
//        configured retrieval mode); o = y ⊙ σ(r).

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <vector>

#include <titans/models/block.hpp>
#include <titans/models/model.hpp>

#include "reference_attention.hpp"
#include "reference_memory.hpp"

namespace titans::reference {

/// Everything the reference computes for one block over B sequences of N tokens.
struct BlockResult {
    Matrixd u;    // (B*N) x d   normalised input of the mixer
    Matrixd mix;  // (B*N) x d   mixer output o
    Matrixd out;  // (B*N) x d   block output (block_forward only; else empty)
    Matrixd y;    // (B*N) x d   MAC: the attention outputs y (what the memory is written with)
    // The memory's input stream of each sequence: LMM u_b, MAG/MAL P ‖ u_b, MAC y_b (none for SWA).
    std::vector<Matrixd> memory_input;
    // The memory weights after the whole stream: weights[b][h][l-1].
    std::vector<std::vector<std::vector<Matrixd>>> weights;
};

namespace detail_blocks {

inline Matrixd rows_of(const Matrixd& x, Eigen::Index r0, Eigen::Index n) {
    Matrixd r(n, x.cols());
    for (Eigen::Index i = 0; i < n; ++i)
        for (Eigen::Index j = 0; j < x.cols(); ++j) r(i, j) = x(r0 + i, j);
    return r;
}

inline Matrixd stack(const Matrixd& a, const Matrixd& b) {
    Matrixd r(a.rows() + b.rows(), std::max(a.cols(), b.cols()));
    for (Eigen::Index i = 0; i < a.rows(); ++i)
        for (Eigen::Index j = 0; j < a.cols(); ++j) r(i, j) = a(i, j);
    for (Eigen::Index i = 0; i < b.rows(); ++i)
        for (Eigen::Index j = 0; j < b.cols(); ++j) r(a.rows() + i, j) = b(i, j);
    return r;
}

inline Matrixd row_vector(const RowVectord& v) {
    Matrixd r(1, v.cols());
    for (Eigen::Index j = 0; j < v.cols(); ++j) r(0, j) = v(j);
    return r;
}

/// The memory run as a sequence model over one whole stream xs (n x d) of one sequence.
inline Result run_memory(const MemoryConfig& cfg, const MemoryParams<double>& p, const Matrixd& xs) {
    return cfg.update == UpdateMode::PerToken ? per_token(cfg, p, xs, 1)
                                              : chunk_start_loop(cfg, p, xs, 1);
}

/// The memory weights after the stream xs (memory_init when xs is empty): weights[h][l-1].
inline std::vector<std::vector<Matrixd>> weights_after(const MemoryConfig& cfg,
                                                       const MemoryParams<double>& p,
                                                       const Matrixd& xs) {
    if (xs.rows() == 0) return p.memory_init;
    return run_memory(cfg, p, xs).weights[0];
}

/// MAC's h row of one token u (1 x d): the memory's query path without conv (u W_Q, φ, per-head
/// L2 norm if normalize_qk), each head read through its snapshot weights, concatenated, W_O.
inline Matrixd mac_memory_row(const MemoryConfig& cfg, const MemoryParams<double>& p,
                              const std::vector<std::vector<Matrixd>>& snapshot,
                              const Matrixd& u_row) {
    const int H = cfg.n_heads, dh = cfg.head_dim();
    Matrixd q = row_times(u_row, p.w_q);
    for (Eigen::Index c = 0; c < q.cols(); ++c) q(0, c) = act_value(cfg.qkv_activation, q(0, c));
    Matrixd heads(1, cfg.inner_dim());
    for (int h = 0; h < H; ++h) {
        Matrixd qh = head_row(q, 0, h, dh);
        if (cfg.normalize_qk) {
            double ss = 0.0;
            for (int j = 0; j < dh; ++j) ss += qh(0, j) * qh(0, j);
            const double nrm = std::max(std::sqrt(ss), 1e-12);
            for (int j = 0; j < dh; ++j) qh(0, j) /= nrm;
        }
        const Matrixd m = mlp_forward(snapshot[static_cast<std::size_t>(h)], qh, cfg.activation,
                                      cfg.residual);
        for (int j = 0; j < dh; ++j) heads(0, h * dh + j) = m(0, j);
    }
    return row_times(heads, p.w_o);
}

inline double sigmoid_of(double z) { return 1.0 / (1.0 + std::exp(-z)); }

/// y = SWA*(P ‖ u) W_O of one sequence ub (N x d): every P row visible (projected by W_K / W_V,
/// never rotated), u rows causal in the window w, RoPE from position 0.
inline Matrixd prefix_window(const BlockConfig& cfg, const BlockParams<double>& p,
                             const Matrixd& ub) {
    const AttentionConfig& ac = cfg.attention;
    const int Ha = ac.n_heads, dha = ac.head_dim();
    Matrixd q = matmul(ub, p.attention.w_q), k = matmul(ub, p.attention.w_k);
    const Matrixd v = matmul(ub, p.attention.w_v);
    if (ac.rope) {
        q = rope(q, Ha, dha, 0, ac.rope_base);
        k = rope(k, Ha, dha, 0, ac.rope_base);
    }
    const Matrixd kp = matmul(p.persistent, p.attention.w_k);
    const Matrixd vp = matmul(p.persistent, p.attention.w_v);
    return matmul(attention(q, kp, vp, k, v, Ha, dha, ac.window, 0), p.attention.w_o);
}

}  // namespace detail_blocks

/// The mixer of math §7 on already-normalised input u ((B*N) x d), whole sequences.
inline BlockResult block_mix(const BlockConfig& cfg, const BlockParams<double>& p, const Matrixd& u,
                             int B) {
    using namespace detail_blocks;
    cfg.validate();
    p.validate(cfg);
    if (B < 1 || u.rows() % B != 0 || u.cols() != cfg.d_model) {
        throw ShapeError("reference::block_mix: bad input shape");
    }
    const Eigen::Index N = u.rows() / B, d = cfg.d_model, Np = cfg.n_persistent;
    const MemoryConfig& mc = cfg.memory;
    const AttentionConfig& ac = cfg.attention;
    const int Ha = ac.n_heads, dha = ac.head_dim();
    BlockResult r;
    r.u = u;
    r.mix = Matrixd::Zero(u.rows(), d);
    r.y = Matrixd::Zero(u.rows(), d);
    for (int b = 0; b < B; ++b) {
        const Matrixd ub = rows_of(u, b * N, N);
        Matrixd ob(N, d);
        switch (cfg.kind) {
            case BlockKind::LMM: {
                const Result m = run_memory(mc, p.memory, ub);
                ob = m.y;
                r.memory_input.push_back(ub);
                r.weights.push_back(m.weights[0]);
                break;
            }
            case BlockKind::MAG: {
                // m = M(P ‖ u), rows of u.
                const Matrixd mem_in = stack(p.persistent, ub);
                const Result mr = run_memory(mc, p.memory, mem_in);
                const Matrixd m = rows_of(mr.y, Np, N);
                const Matrixd y = prefix_window(cfg, p, ub);  // SWA*(P ‖ u)
                const Matrixd ny = rms_norm(y, row_vector(p.norm_y), cfg.norm_eps);
                const Matrixd nm = rms_norm(m, row_vector(p.norm_m), cfg.norm_eps);
                for (Eigen::Index t = 0; t < N; ++t)
                    for (Eigen::Index j = 0; j < d; ++j) ob(t, j) = ny(t, j) * sigmoid_of(nm(t, j));
                r.memory_input.push_back(mem_in);
                r.weights.push_back(mr.weights[0]);
                break;
            }
            case BlockKind::SWA: ob = prefix_window(cfg, p, ub); break;
            case BlockKind::MAL: {
                // ỹ = M(P ‖ u); plain causal window over all N_p + N positions.
                const Matrixd mem_in = stack(p.persistent, ub);
                const Result mr = run_memory(mc, p.memory, mem_in);
                const Matrixd& yt = mr.y;
                Matrixd q = matmul(yt, p.attention.w_q), k = matmul(yt, p.attention.w_k);
                const Matrixd v = matmul(yt, p.attention.w_v);
                if (ac.rope) {
                    q = rope(q, Ha, dha, 0, ac.rope_base);
                    k = rope(k, Ha, dha, 0, ac.rope_base);
                }
                const Matrixd none(0, ac.inner_dim());
                const Matrixd all =
                    matmul(attention(q, none, none, k, v, Ha, dha, ac.window, 0), p.attention.w_o);
                ob = rows_of(all, Np, N);
                r.memory_input.push_back(mem_in);
                r.weights.push_back(mr.weights[0]);
                break;
            }
            case BlockKind::MAC: {
                const Eigen::Index C = cfg.segment;
                const Matrixd kP = matmul(p.persistent, p.attention.w_k);
                const Matrixd vP = matmul(p.persistent, p.attention.w_v);
                Matrixd yb(N, d);
                for (Eigen::Index s0 = 0; s0 < N; s0 += C) {
                    const Eigen::Index s1 = std::min(N, s0 + C);
                    // The memory as it was before the segment: after the y rows written so far.
                    const auto snapshot = weights_after(mc, p.memory, rows_of(yb, 0, s0));
                    Matrixd hrows(s1 - s0, d);
                    for (Eigen::Index i = s0; i < s1; ++i) {
                        const Matrixd hi = mac_memory_row(mc, p.memory, snapshot, rows_of(ub, i, 1));
                        for (Eigen::Index j = 0; j < d; ++j) hrows(i - s0, j) = hi(0, j);
                    }
                    const Matrixd kh = matmul(hrows, p.attention.w_k);
                    const Matrixd vh = matmul(hrows, p.attention.w_v);
                    Matrixd qs = matmul(rows_of(ub, s0, s1 - s0), p.attention.w_q);
                    Matrixd ks = matmul(rows_of(ub, s0, s1 - s0), p.attention.w_k);
                    const Matrixd vs = matmul(rows_of(ub, s0, s1 - s0), p.attention.w_v);
                    if (ac.rope) {  // absolute positions of the segment's tokens
                        qs = rope(qs, Ha, dha, s0, ac.rope_base);
                        ks = rope(ks, Ha, dha, s0, ac.rope_base);
                    }
                    // Query i of the segment: prefix = P ‖ h_{s0..i}, keys u_{s0..i}, each query
                    // on its own (the full score matrix of a 1-row query).
                    for (Eigen::Index i = 0; i < s1 - s0; ++i) {
                        const Matrixd kp = stack(kP, rows_of(kh, 0, i + 1));
                        const Matrixd vp = stack(vP, rows_of(vh, 0, i + 1));
                        const Matrixd a =
                            attention(rows_of(qs, i, 1), kp, vp, rows_of(ks, 0, i + 1),
                                      rows_of(vs, 0, i + 1), Ha, dha, INT_MAX, i);
                        const Matrixd yi = matmul(a, p.attention.w_o);
                        for (Eigen::Index j = 0; j < d; ++j) yb(s0 + i, j) = yi(0, j);
                    }
                }
                // Write the memory with y (all segments in order) and read it: o = y ⊙ σ(r).
                const Result mr = run_memory(mc, p.memory, yb);
                for (Eigen::Index t = 0; t < N; ++t)
                    for (Eigen::Index j = 0; j < d; ++j) {
                        ob(t, j) = yb(t, j) * sigmoid_of(mr.y(t, j));
                        r.y(b * N + t, j) = yb(t, j);
                    }
                r.memory_input.push_back(yb);
                r.weights.push_back(mr.weights[0]);
                break;
            }
        }
        for (Eigen::Index t = 0; t < N; ++t)
            for (Eigen::Index j = 0; j < d; ++j) r.mix(b * N + t, j) = ob(t, j);
    }
    return r;
}

/// One block over whole sequences: u = RMSNorm_mix(x), h = x + Mix(u),
/// out = h + FFN(RMSNorm_ffn(h)) (no FFN term when !use_ffn).
inline BlockResult block_forward(const BlockConfig& cfg, const BlockParams<double>& p,
                                 const Matrixd& x, int B) {
    using namespace detail_blocks;
    const Matrixd u = rms_norm(x, row_vector(p.norm_mix), cfg.norm_eps);
    BlockResult r = block_mix(cfg, p, u, B);
    Matrixd h(x.rows(), x.cols());
    for (Eigen::Index i = 0; i < x.rows(); ++i)
        for (Eigen::Index j = 0; j < x.cols(); ++j) h(i, j) = x(i, j) + r.mix(i, j);
    r.out = h;
    if (cfg.use_ffn) {
        const Matrixd f = feed_forward(cfg.ffn, p.ffn, rms_norm(h, row_vector(p.norm_ffn), cfg.norm_eps));
        for (Eigen::Index i = 0; i < x.rows(); ++i)
            for (Eigen::Index j = 0; j < x.cols(); ++j) r.out(i, j) += f(i, j);
    }
    return r;
}

/// Embedding rows of token ids ((B*N) ids, sequence-major) -> (B*N) x d.
inline Matrixd embed(const ModelParams<double>& p, const std::vector<int>& ids) {
    Matrixd x(static_cast<Eigen::Index>(ids.size()), p.embedding.cols());
    for (std::size_t i = 0; i < ids.size(); ++i)
        for (Eigen::Index j = 0; j < p.embedding.cols(); ++j)
            x(static_cast<Eigen::Index>(i), j) = p.embedding(ids[i], j);
    return x;
}

/// A Model over whole sequences: each block in turn, then RMSNorm_final, then the head.
inline Matrixd model_forward(const ModelConfig& cfg, const ModelParams<double>& p, const Matrixd& x,
                             int B) {
    Matrixd h = x;
    for (std::size_t i = 0; i < cfg.blocks.size(); ++i) {
        h = block_forward(cfg.blocks[i], p.blocks[i], h, B).out;
    }
    return matmul(rms_norm(h, detail_blocks::row_vector(p.norm_final), cfg.norm_eps), p.head);
}

}  // namespace titans::reference
