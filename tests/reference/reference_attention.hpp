#pragma once
// tests/reference/reference_attention.hpp: an independent, deliberately plain reference of the
// attention layer and the basic layers (math §6-7), used by tests/test_attention.cpp.
//
// Written from docs/math.md and the public headers' documented formulas only. Every product is an
// explicit loop; Eigen matrices serve only as containers. Double precision only. Attention builds
// the FULL masked score matrix of every head (n x (p + m)), so it is quadratic: clarity beats
// speed.
//
//   attention(q, kp, vp, ks, vs, H, dh, w, f)   masked multi-head softmax attention
//   rope(x, H, dh, first_position, base)        explicit 2x2 rotations
//   attention_layer(cfg, p, x, B, prefix, per_sequence_prefix)   the whole Attention layer
//   rms_norm(x, weight, eps), feed_forward(cfg, p, x)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <titans/attention/attention.hpp>
#include <titans/layers/feed_forward.hpp>
#include <titans/types.hpp>

namespace titans::reference {

/// out (n x H*dh), query i at position t = f + stride * i sees all p prefix rows and sequence
/// rows j with t - w < j <= t. Scores s = q.k / sqrt(dh); masked entries are -inf in the full
/// score matrix.
inline Matrixd attention(const Matrixd& q, const Matrixd& kp, const Matrixd& vp,
                         const Matrixd& ks, const Matrixd& vs, int H, int dh, int w,
                         long long f, long long stride = 1) {
    const long long n = q.rows(), p = kp.rows(), m = ks.rows();
    Matrixd out = Matrixd::Zero(n, static_cast<long long>(H) * dh);
    const double ninf = -std::numeric_limits<double>::infinity();
    for (int h = 0; h < H; ++h) {
        const long long c0 = static_cast<long long>(h) * dh;
        // Full score matrix over [prefix ; sequence] columns.
        Matrixd S(n, p + m);
        for (long long i = 0; i < n; ++i) {
            const long long t = f + stride * i;
            for (long long c = 0; c < p + m; ++c) {
                bool visible = true;
                if (c >= p) {
                    const long long j = c - p;
                    visible = (j <= t) && (j > t - w);
                }
                if (!visible) {
                    S(i, c) = ninf;
                    continue;
                }
                double dot = 0.0;
                for (int e = 0; e < dh; ++e) {
                    const double kv = c < p ? kp(c, c0 + e) : ks(c - p, c0 + e);
                    dot += q(i, c0 + e) * kv;
                }
                S(i, c) = dot / std::sqrt(static_cast<double>(dh));
            }
        }
        // Row softmax and weighted sum of values.
        for (long long i = 0; i < n; ++i) {
            double mx = ninf;
            for (long long c = 0; c < p + m; ++c) mx = std::max(mx, S(i, c));
            double sum = 0.0;
            for (long long c = 0; c < p + m; ++c) {
                S(i, c) = S(i, c) == ninf ? 0.0 : std::exp(S(i, c) - mx);
                sum += S(i, c);
            }
            for (long long c = 0; c < p + m; ++c) {
                if (S(i, c) == 0.0) continue;
                for (int e = 0; e < dh; ++e) {
                    const double vv = c < p ? vp(c, c0 + e) : vs(c - p, c0 + e);
                    out(i, c0 + e) += S(i, c) / sum * vv;
                }
            }
        }
    }
    return out;
}

/// Rotates pair (2i, 2i+1) of every head of row r by (first_position + r) * base^(-2i/dh),
/// as an explicit 2x2 matrix-vector product.
inline Matrixd rope(const Matrixd& x, int H, int dh, long long first_position, double base) {
    Matrixd y = x;
    for (long long r = 0; r < x.rows(); ++r) {
        const double t = static_cast<double>(first_position + r);
        for (int h = 0; h < H; ++h) {
            for (int i = 0; i < dh / 2; ++i) {
                const double angle = t * std::pow(base, -2.0 * i / dh);
                const double R[2][2] = {{std::cos(angle), -std::sin(angle)},
                                        {std::sin(angle), std::cos(angle)}};
                const long long a = static_cast<long long>(h) * dh + 2 * i;
                y(r, a) = R[0][0] * x(r, a) + R[0][1] * x(r, a + 1);
                y(r, a + 1) = R[1][0] * x(r, a) + R[1][1] * x(r, a + 1);
            }
        }
    }
    return y;
}

/// x * W by explicit loops.
inline Matrixd matmul(const Matrixd& x, const Matrixd& W) {
    Matrixd y = Matrixd::Zero(x.rows(), W.cols());
    for (long long i = 0; i < x.rows(); ++i)
        for (long long k = 0; k < x.cols(); ++k)
            for (long long j = 0; j < W.cols(); ++j) y(i, j) += x(i, k) * W(k, j);
    return y;
}

/// The Attention layer over whole sequences (B of N tokens, sequence-major, positions 0..N-1):
/// projections, RoPE of sequence q/k, prefix projected and not rotated (shared, or per sequence
/// (B*p rows) when per_sequence_prefix), attention, W_O.
inline Matrixd attention_layer(const AttentionConfig& cfg, const AttentionParams<double>& P,
                               const Matrixd& x, int B, const Matrixd* prefix,
                               bool per_sequence_prefix = false) {
    const int H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
    const long long N = x.rows() / B;
    Matrixd o(x.rows(), D);
    for (int b = 0; b < B; ++b) {
        const Matrixd xb = x.middleRows(b * N, N);
        Matrixd q = matmul(xb, P.w_q), k = matmul(xb, P.w_k), v = matmul(xb, P.w_v);
        if (cfg.rope) {
            q = rope(q, H, dh, 0, cfg.rope_base);
            k = rope(k, H, dh, 0, cfg.rope_base);
        }
        Matrixd kp(0, D), vp(0, D);
        if (prefix != nullptr) {
            const long long p = per_sequence_prefix ? prefix->rows() / B : prefix->rows();
            const Matrixd pb = prefix->middleRows(per_sequence_prefix ? b * p : 0, p);
            kp = matmul(pb, P.w_k);
            vp = matmul(pb, P.w_v);
        }
        o.middleRows(b * N, N) = attention(q, kp, vp, k, v, H, dh, cfg.window, 0);
    }
    return matmul(o, P.w_o);
}

/// y = x / sqrt(mean(x^2) + eps) * weight, row by row.
inline Matrixd rms_norm(const Matrixd& x, const Matrixd& weight, double eps) {
    Matrixd y(x.rows(), x.cols());
    for (long long r = 0; r < x.rows(); ++r) {
        double ss = 0.0;
        for (long long c = 0; c < x.cols(); ++c) ss += x(r, c) * x(r, c);
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.cols()) + eps);
        for (long long c = 0; c < x.cols(); ++c) y(r, c) = x(r, c) * inv * weight(0, c);
    }
    return y;
}

/// SwiGLU (silu(x W1) * (x W3)) W2 or GELU gelu(x W1) W2, by loops.
inline Matrixd feed_forward(const FeedForwardConfig& cfg, const FeedForwardParams<double>& P,
                            const Matrixd& x) {
    Matrixd a = matmul(x, P.w1);
    Matrixd g;
    if (cfg.kind == FeedForwardKind::SwiGLU) g = matmul(x, P.w3);
    for (long long i = 0; i < a.rows(); ++i)
        for (long long j = 0; j < a.cols(); ++j) {
            const double z = a(i, j);
            if (cfg.kind == FeedForwardKind::SwiGLU) {
                a(i, j) = z / (1.0 + std::exp(-z)) * g(i, j);
            } else {
                a(i, j) = 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0)));
            }
        }
    return matmul(a, P.w2);
}

}  // namespace titans::reference
