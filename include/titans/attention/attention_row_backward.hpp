#pragma once
// titans/attention/attention_row_backward.hpp: the attention layer's backward element kernels
// on raw row-major buffers (math §9), written once as TITANS_HOST_DEVICE code: the CUDA
// backend launches them (backend/cuda/attention_training.cuh, a thread per element) and the
// CPU tests run the same functors in a loop against the CPU backward.
//
//   RopeQKTranspose   the transposed RoPE of the q and k parts of fused [dq | dk | dv] rows
//   QueryRowsBackward per (query row, head): the softmax recomputed over the prefix and the
//                     window (as AttendRows), its statistics kept, dq written
//   KeyRowsBackward   per (sequence key row, head): dk, dv of a window row, summed over the
//                     queries that see it (no atomics, deterministic)
//   PrefixRowsBackward per (prefix row, head): dk, dv of a prefix row, summed over its queries
//
// With P_j = exp(scale (q . k_j - max)) / sum, dP_j = dout . v_j, delta = sum_j P_j dP_j and
// dS_j = scale P_j (dP_j - delta): dq = sum_j dS_j k_j, dk_j = sum_q dS_j q, dv_j = sum_q P_j
// dout (math §9), as attention/kernel_backward.hpp computes them per tile.

#include <cmath>
#include <cstdint>

#include "../config.hpp"
#include "rope.hpp"

namespace titans::detail {

/// The rotation of RopeQK transposed (the angle negated) on rows x [dq | dk | dv] (each D wide,
/// row stride 3D): element i rotates pair j of head h of part (0 dq, 1 dk) of row r, the row
/// at absolute position pos0 + r mod N. Elements: rows * 2 * H * (d_h / 2).
template <class T>
struct RopeQKTranspose {
    T* g;
    long long N, D;
    int H, d_head;
    std::int64_t pos0;
    double base;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const auto half = static_cast<unsigned>(d_head / 2), pairs = static_cast<unsigned>(H) * half;
        const unsigned r = i / (2 * pairs), rem = i % (2 * pairs);
        const unsigned part = rem / pairs, h = (rem % pairs) / half, j = (rem % pairs) % half;
        const double angle = static_cast<double>(pos0 + r % static_cast<unsigned>(N)) *
                             rope_frequency(static_cast<int>(j), d_head, base);
        const T c = static_cast<T>(std::cos(angle)), s = -static_cast<T>(std::sin(angle));
        T* e = g + static_cast<long long>(r) * 3 * D + part * D + h * d_head + 2 * j;
        const T a = e[0], b = e[1];
        e[0] = a * c - b * s;
        e[1] = a * s + b * c;
    }
};

/// What the three backward functors share: the forward's operands (as AttendRows: fused qkv
/// rows B*N x 3D, the prefix's projected keys/values, sequence b's window rows [kept ; new] at
/// k_win / v_win + b * cap * D) and dout (B*N x D), the softmax statistics per (row, head)
/// (mx, inv = 1 / sum, delta), row r = b N + t at r * H + head. Query t's own key is window row
/// kept + query_stride t: 1 for the attention layer, 2 for MAC's interleaved segment (kept then
/// 2 o + 1, the rows before it the segment's earlier ones).
template <class T>
struct AttentionBackwardOperands {
    const T* qkv;
    const T *k_prefix, *v_prefix;
    long long p, k_prefix_stride, v_prefix_stride;
    bool shared;
    const T *k_win, *v_win;
    long long cap, kept, N, D;
    int H, d_head, window;
    T scale;
    const T* dout;
    T *mx, *inv, *delta;
    long long query_stride = 1;

    TITANS_HOST_DEVICE static T dot(const T* a, const T* b, int n) {
        T s = T(0);
        for (int c = 0; c < n; ++c) {
            s += a[c] * b[c];
        }
        return s;
    }
    /// Query t's own window row, the last it sees.
    TITANS_HOST_DEVICE long long hi(long long t) const { return kept + query_stride * t; }
    /// The visible window rows of query t: [lo(t), hi(t)].
    TITANS_HOST_DEVICE long long lo(long long t) const {
        return hi(t) - window + 1 > 0 ? hi(t) - window + 1 : 0;
    }
    /// The queries that see window row j: [first_query(j), last_query(j)] (empty when first >
    /// last), from lo(t) <= j <= hi(t).
    TITANS_HOST_DEVICE long long first_query(long long j) const {
        return j > kept ? (j - kept + query_stride - 1) / query_stride : 0;
    }
    TITANS_HOST_DEVICE long long last_query(long long j) const {
        const long long reach = j - kept + window - 1;  // hi(t) <= reach
        const long long t = reach >= 0 ? reach / query_stride : -1;
        return t < N - 1 ? t : N - 1;
    }
};

/// Per (query row r = b N + t, head): the softmax over the prefix and the window recomputed
/// (its maximum, 1 / sum and delta kept for the key passes) and dq (row stride dq_stride,
/// head's columns) written. Elements: B * N * H.
template <class T>
struct QueryRowsBackward {
    AttentionBackwardOperands<T> a;
    T* dq;
    long long dq_stride;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned r = i / static_cast<unsigned>(a.H), head = i % static_cast<unsigned>(a.H);
        const long long b = r / static_cast<unsigned>(a.N), t = r % static_cast<unsigned>(a.N);
        const long long col = static_cast<long long>(head) * a.d_head, hi = a.hi(t);
        const long long lo = a.lo(t), p0 = a.shared ? 0 : b * a.p;
        const int dh = a.d_head;
        const T* q = a.qkv + static_cast<long long>(r) * 3 * a.D + col;
        const T* dout = a.dout + static_cast<long long>(r) * a.D + col;
        const T* kp = a.k_prefix + p0 * a.k_prefix_stride + col;
        const T* vp = a.v_prefix + p0 * a.v_prefix_stride + col;
        const T* ks = a.k_win + b * a.cap * a.D + col;
        const T* vs = a.v_win + b * a.cap * a.D + col;
        using O = AttentionBackwardOperands<T>;
        T mx = O::dot(q, ks + hi * a.D, dh);
        for (long long j = 0; j < a.p; ++j) {
            const T s = O::dot(q, kp + j * a.k_prefix_stride, dh);
            mx = s > mx ? s : mx;
        }
        for (long long j = lo; j < hi; ++j) {
            const T s = O::dot(q, ks + j * a.D, dh);
            mx = s > mx ? s : mx;
        }
        T sum = T(0);
        for (long long j = 0; j < a.p; ++j) {
            sum += std::exp((O::dot(q, kp + j * a.k_prefix_stride, dh) - mx) * a.scale);
        }
        for (long long j = lo; j <= hi; ++j) {
            sum += std::exp((O::dot(q, ks + j * a.D, dh) - mx) * a.scale);
        }
        const T inv = T(1) / sum;
        T delta = T(0);
        for (long long j = 0; j < a.p; ++j) {
            const T pj = std::exp((O::dot(q, kp + j * a.k_prefix_stride, dh) - mx) * a.scale) * inv;
            delta += pj * O::dot(dout, vp + j * a.v_prefix_stride, dh);
        }
        for (long long j = lo; j <= hi; ++j) {
            const T pj = std::exp((O::dot(q, ks + j * a.D, dh) - mx) * a.scale) * inv;
            delta += pj * O::dot(dout, vs + j * a.D, dh);
        }
        T* g = dq + static_cast<long long>(r) * dq_stride + col;
        for (int c = 0; c < dh; ++c) {
            g[c] = T(0);
        }
        auto add = [&](const T* k, const T* v) {
            const T pj = std::exp((O::dot(q, k, dh) - mx) * a.scale) * inv;
            const T ds = a.scale * pj * (O::dot(dout, v, dh) - delta);
            for (int c = 0; c < dh; ++c) {
                g[c] += ds * k[c];
            }
        };
        for (long long j = 0; j < a.p; ++j) {
            add(kp + j * a.k_prefix_stride, vp + j * a.v_prefix_stride);
        }
        for (long long j = lo; j <= hi; ++j) {
            add(ks + j * a.D, vs + j * a.D);
        }
        const long long s = static_cast<long long>(r) * a.H + head;
        a.mx[s] = mx;
        a.inv[s] = inv;
        a.delta[s] = delta;
    }
};

/// dk, dv (d_h entries each, written) of key k, value v against query row r (its statistics
/// from QueryRowsBackward) added into dk, dv.
template <class T>
TITANS_HOST_DEVICE void key_from_query(const AttentionBackwardOperands<T>& a, long long r,
                                       long long col, unsigned head, const T* k, const T* v,
                                       T* dk, T* dv) {
    using O = AttentionBackwardOperands<T>;
    const int dh = a.d_head;
    const T* q = a.qkv + r * 3 * a.D + col;
    const T* dout = a.dout + r * a.D + col;
    const long long s = r * a.H + head;
    const T pj = std::exp((O::dot(q, k, dh) - a.mx[s]) * a.scale) * a.inv[s];
    const T ds = a.scale * pj * (O::dot(dout, v, dh) - a.delta[s]);
    for (int c = 0; c < dh; ++c) {
        dv[c] += pj * dout[c];
        dk[c] += ds * q[c];
    }
}

/// Per (window row j of sequence b, head), rows of dk_win / dv_win (B * cap x D, as k_win):
/// written with the sum over the queries t that see row j (lo(t) <= j <= kept + t); rows no
/// query sees get 0. Elements: B * cap * H.
template <class T>
struct KeyRowsBackward {
    AttentionBackwardOperands<T> a;
    T *dk_win, *dv_win;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned row = i / static_cast<unsigned>(a.H), head = i % static_cast<unsigned>(a.H);
        const long long b = row / static_cast<unsigned>(a.cap), j = row % static_cast<unsigned>(a.cap);
        const long long col = static_cast<long long>(head) * a.d_head;
        const long long at = static_cast<long long>(row) * a.D + col;
        T* dk = dk_win + at;
        T* dv = dv_win + at;
        for (int c = 0; c < a.d_head; ++c) {
            dk[c] = T(0);
            dv[c] = T(0);
        }
        const long long t1 = a.last_query(j);  // query t sees j iff lo(t) <= j <= hi(t)
        for (long long t = a.first_query(j); t <= t1; ++t) {
            key_from_query(a, b * a.N + t, col, head, a.k_win + at, a.v_win + at, dk, dv);
        }
    }
};

/// Per (prefix row pr, head): dk, dv of the prefix row (row stride dkv_stride, dk at column
/// 0, dv at column D) written with the sum over every query that sees it: all B*N rows when
/// shared, else the N rows of sequence pr / p. Elements: (p or B p) * H.
template <class T>
struct PrefixRowsBackward {
    AttentionBackwardOperands<T> a;
    long long batch;
    T* dkv;
    long long dkv_stride;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned pr = i / static_cast<unsigned>(a.H), head = i % static_cast<unsigned>(a.H);
        const long long col = static_cast<long long>(head) * a.d_head;
        T* dk = dkv + static_cast<long long>(pr) * dkv_stride + col;
        T* dv = dk + a.D;
        for (int c = 0; c < a.d_head; ++c) {
            dk[c] = T(0);
            dv[c] = T(0);
        }
        const long long r0 = a.shared ? 0 : (pr / static_cast<unsigned>(a.p)) * a.N;
        const long long r1 = a.shared ? batch * a.N : r0 + a.N;
        const T* k = a.k_prefix + static_cast<long long>(pr) * a.k_prefix_stride + col;
        const T* v = a.v_prefix + static_cast<long long>(pr) * a.v_prefix_stride + col;
        for (long long r = r0; r < r1; ++r) {
            key_from_query(a, r, col, head, k, v, dk, dv);
        }
    }
};

}  // namespace titans::detail

namespace titans::detail {

/// The new rows' part of window adjoints dk_win / dv_win (sequence b's row at + t of its cap
/// rows) into the dk and dv parts of fused rows B*N x [dq | dk | dv]. Elements: B * N * D.
template <class T>
struct GatherWindowGrad {
    const T *dk_win, *dv_win;
    T* g;
    long long N, D, cap, at;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned r = i / static_cast<unsigned>(D), c = i % static_cast<unsigned>(D);
        const unsigned b = r / static_cast<unsigned>(N), t = r % static_cast<unsigned>(N);
        const long long from = (b * cap + at + t) * D + c, to = static_cast<long long>(r) * 3 * D;
        g[to + D + c] = dk_win[from];
        g[to + 2 * D + c] = dv_win[from];
    }
};

}  // namespace titans::detail

namespace titans::detail {

/// The reverse of SegmentAppend (attention_row.hpp): a MAC part's segment-row adjoints taken
/// apart. Sequence b's row 2(o+i)+1 (the token's key, value) of dk_seg / dv_seg (rows_per_sequence
/// rows per sequence, row stride D) goes to the dk and dv parts of fused row r = b m + i of g
/// (B*m x [dq | dk | dv]), its row 2(o+i) (the read's) to row r of dkvh (B*m x [dk_h | dv_h]).
/// Elements: B * m * D.
template <class T>
struct SegmentGather {
    const T *dk_seg, *dv_seg;
    T *g, *dkvh;
    long long rows_per_sequence, m, offset, D;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const long long r = i / static_cast<unsigned>(D), c = i % static_cast<unsigned>(D);
        const long long b = r / m, t = r % m;
        const long long at = (b * rows_per_sequence + 2 * (offset + t)) * D + c;
        dkvh[r * 2 * D + c] = dk_seg[at];
        dkvh[r * 2 * D + D + c] = dv_seg[at];
        g[r * 3 * D + D + c] = dk_seg[at + D];
        g[r * 3 * D + 2 * D + c] = dv_seg[at + D];
    }
};

}  // namespace titans::detail
