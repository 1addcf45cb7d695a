#pragma once
// titans/attention/attention_row.hpp: the attention layer's element kernels on raw row-major
// buffers (math §6-7), written once as TITANS_HOST_DEVICE code: the CUDA backend launches them
// (backend/cuda/attention_kernels.cuh, a thread per element) and the CPU tests run the same
// functors in a loop against the CPU layer, so their arithmetic and index math are checked on
// every CI run, GPU or not.
//
//   attention_row   one query row and one head against the prefix and the window
//   RopeQK          RoPE of the q and k parts of fused [q | k | v] rows, one pair per element
//   AppendWindow    a piece's keys and values after each sequence's kept window rows
//   AttendRows      attention_row for every (row, head) of a piece
//   SegmentAppend   a MAC part's keys and values into its segment buffers, interleaved
//   SegmentRows     attention_row for every (row, head) of a MAC part (query stride 2)

#include <cmath>
#include <cstdint>

#include "../config.hpp"
#include "rope.hpp"

namespace titans::detail {

/// The operands of attention_row, raw pointers into row-major matrices (host or device).
/// Every pointer is at the head's first column; row r of a matrix starts at + r * its stride.
template <class T>
struct AttentionRowOperands {
    const T* q;                          ///< the query (d_h entries)
    const T *k_prefix, *v_prefix;        ///< p prefix rows (any p >= 0)
    long long p, k_prefix_stride, v_prefix_stride;
    const T *k_seq, *v_seq;              ///< sequence rows, row stride seq_stride
    long long lo, hi, seq_stride;        ///< the visible sequence rows [lo, hi] (lo <= hi)
    int d_head;
    T scale;                             ///< 1 / sqrt(d_h)
};

/// out (d_h entries) = softmax(scale [q . k_prefix_j ; q . k_seq_j (lo <= j <= hi)])
/// [v_prefix ; v_seq], the softmax over the prefix and window scores together, stabilised by
/// their maximum (as the tiled kernel: exp(scale (s - max)), normalised at the end). Two passes
/// over the keys (the maximum, then the numerators and the weighted values), no workspace.
template <class T>
TITANS_HOST_DEVICE void attention_row(const AttentionRowOperands<T>& a, T* out) {
    const int dh = a.d_head;
    auto dot = [&](const T* k) {
        T s = T(0);
        for (int c = 0; c < dh; ++c) {
            s += a.q[c] * k[c];
        }
        return s;
    };
    T mx = dot(a.k_seq + a.hi * a.seq_stride);  // the query's own key is always visible
    for (long long j = 0; j < a.p; ++j) {
        const T s = dot(a.k_prefix + j * a.k_prefix_stride);
        mx = s > mx ? s : mx;
    }
    for (long long j = a.lo; j < a.hi; ++j) {
        const T s = dot(a.k_seq + j * a.seq_stride);
        mx = s > mx ? s : mx;
    }
    for (int c = 0; c < dh; ++c) {
        out[c] = T(0);
    }
    T sum = T(0);
    auto accumulate = [&](const T* k, const T* v) {
        const T e = std::exp((dot(k) - mx) * a.scale);
        sum += e;
        for (int c = 0; c < dh; ++c) {
            out[c] += e * v[c];
        }
    };
    for (long long j = 0; j < a.p; ++j) {
        accumulate(a.k_prefix + j * a.k_prefix_stride, a.v_prefix + j * a.v_prefix_stride);
    }
    for (long long j = a.lo; j <= a.hi; ++j) {
        accumulate(a.k_seq + j * a.seq_stride, a.v_seq + j * a.seq_stride);
    }
    const T inv = T(1) / sum;  // sum >= 1: the maximum contributes exp(0)
    for (int c = 0; c < dh; ++c) {
        out[c] *= inv;
    }
}

/// The RoPE rotation of pair j (of a head d_head wide) at absolute position pos: the angle
/// pos omega_j in double (rope_frequency, the CPU table's function), its cosine and sine in T.
template <class T>
struct RopePair {
    T c, s;
    TITANS_HOST_DEVICE RopePair(std::int64_t pos, int j, int d_head, double base) {
        const double angle = static_cast<double>(pos) * rope_frequency(j, d_head, base);
        c = static_cast<T>(std::cos(angle));
        s = static_cast<T>(std::sin(angle));
    }
    /// to[0], to[1] = the pair from[0], from[1] rotated (to may be from).
    TITANS_HOST_DEVICE void rotate(const T* from, T* to) const {
        const T a = from[0], b = from[1];
        to[0] = a * c - b * s;
        to[1] = a * s + b * c;
    }
};

/// RoPE of rows x [q | k | v] (each D = H d_h wide, row stride 3D): element i rotates pair j
/// of head h of row r in q and in k (one angle for both), the row at absolute position
/// pos0 + r mod N. Elements: rows * H * (d_h / 2).
template <class T>
struct RopeQK {
    T* qkv;
    long long N, D;
    int H, d_head;
    std::int64_t pos0;
    double base;
    /// Element i's rotation; returns r D + h d_h + 2j, the pair's first entry as an element of
    /// a rows x D functor (AppendWindow, SegmentAppend).
    TITANS_HOST_DEVICE unsigned rotate(unsigned i) const {
        const auto half = static_cast<unsigned>(d_head / 2), pairs = static_cast<unsigned>(H) * half;
        const unsigned r = i / pairs, h = (i % pairs) / half, j = (i % pairs) % half;
        const RopePair<T> turn(pos0 + r % static_cast<unsigned>(N), static_cast<int>(j), d_head,
                               base);
        const unsigned col = h * static_cast<unsigned>(d_head) + 2 * j;
        T* e = qkv + static_cast<long long>(r) * 3 * D + col;
        turn.rotate(e, e);          // q
        turn.rotate(e + D, e + D);  // k
        return r * static_cast<unsigned>(D) + col;
    }
};

/// RoPE and a functor A over the rows x D entries of k and v (AppendWindow, SegmentAppend) in
/// one pass: element i rotates its pair of q and k (RopeQK), then A moves the pair's two
/// columns, reading the rotated k. The values of RopeQK's pass then A's. Elements:
/// rows * H * (d_h / 2); rows * D below 2^32.
template <class T, class A>
struct RopeThen {
    RopeQK<T> rope;
    A then;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned e = rope.rotate(i);
        then(e);
        then(e + 1);
    }
};

/// The k and v parts of B*N fused rows (sequence-major) into window buffers k_buf, v_buf of
/// cap x D per sequence, sequence b's row t at buffer row at + t. Elements: B * N * D.
template <class T>
struct AppendWindow {
    const T* qkv;
    T *k_buf, *v_buf;
    long long N, D, cap, at;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned r = i / static_cast<unsigned>(D), c = i % static_cast<unsigned>(D);
        const unsigned b = r / static_cast<unsigned>(N), t = r % static_cast<unsigned>(N);
        const long long to = (b * cap + at + t) * D + c, from = static_cast<long long>(r) * 3 * D;
        k_buf[to] = qkv[from + D + c];
        v_buf[to] = qkv[from + 2 * D + c];
    }
};

/// o (B*N rows x D) = the attention of every (row, head) of a piece: row r = b N + t is the
/// query of fused row r, at position kept + t of sequence b's window rows (k_win, v_win:
/// kept + N rows per sequence, sequence b's at + b * cap * D), seeing rows max(0, kept + t -
/// window + 1) .. kept + t and every prefix row (p per sequence: rows b p .. b p + p - 1 of
/// k_prefix / v_prefix, or rows 0 .. p - 1 for all when shared). Elements: B * N * H.
template <class T>
struct AttendRows {
    const T* qkv;
    const T *k_prefix, *v_prefix;
    long long p, k_prefix_stride, v_prefix_stride;
    bool shared;
    const T *k_win, *v_win;
    long long cap, kept, N, D;
    int H, d_head, window;
    T scale;
    T* o;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned r = i / static_cast<unsigned>(H), head = i % static_cast<unsigned>(H);
        const long long b = r / static_cast<unsigned>(N), t = r % static_cast<unsigned>(N);
        const long long pos = kept + t, col = static_cast<long long>(head) * d_head;
        const long long p0 = shared ? 0 : b * p;
        const AttentionRowOperands<T> a{
            qkv + static_cast<long long>(r) * 3 * D + col,
            k_prefix + p0 * k_prefix_stride + col, v_prefix + p0 * v_prefix_stride + col, p,
            k_prefix_stride, v_prefix_stride,
            k_win + b * cap * D + col, v_win + b * cap * D + col,
            pos - window + 1 > 0 ? pos - window + 1 : 0, pos, D, d_head, scale};
        attention_row(a, o + static_cast<long long>(r) * D + col);
    }
};

/// The keys and values of a MAC part (attention/segment.hpp) into its segment buffers: row
/// r = b m + i of qkv (B*m x 3D fused [q | k | v] of the part's tokens, RoPE applied) and of
/// kvh (B*m x 2D: [k | v] of the memory's reads h) goes to sequence b's interleaved rows
/// 2(o+i) (the read) and 2(o+i)+1 (the token) of seg_k, seg_v (2C rows per sequence, row stride
/// seg_stride). Elements: B * m * D.
template <class T>
struct SegmentAppend {
    const T *qkv, *kvh;
    T *seg_k, *seg_v;
    long long seg_stride, rows_per_sequence, m, offset, D;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const long long r = i / static_cast<unsigned>(D), c = i % static_cast<unsigned>(D);
        const long long b = r / m, t = r % m;
        const long long at = (b * rows_per_sequence + 2 * (offset + t)) * seg_stride + c;
        seg_k[at] = kvh[r * 2 * D + c];
        seg_v[at] = kvh[r * 2 * D + D + c];
        seg_k[at + seg_stride] = qkv[r * 3 * D + D + c];
        seg_v[at + seg_stride] = qkv[r * 3 * D + 2 * D + c];
    }
};

/// o (B*m rows x D) = MAC's segment attention of every (row, head) of a part: row r = b m + i
/// is the query of fused row r of qkv, at interleaved row 2(o+i)+1 of sequence b's segment
/// buffers, seeing every (shared) prefix row and the buffer rows 0 .. 2(o+i)+1 (causal over
/// the segment, the token's read included). Elements: B * m * H.
template <class T>
struct SegmentRows {
    const T* qkv;
    const T *k_prefix, *v_prefix;
    long long p, k_prefix_stride, v_prefix_stride;
    const T *seg_k, *seg_v;
    long long seg_stride, rows_per_sequence, m, offset, D;
    int H, d_head;
    T scale;
    T* o;
    TITANS_HOST_DEVICE void operator()(unsigned i) const {
        const unsigned r = i / static_cast<unsigned>(H), head = i % static_cast<unsigned>(H);
        const long long b = r / m, t = r % m, col = static_cast<long long>(head) * d_head;
        const long long seq = b * rows_per_sequence * seg_stride + col;
        const AttentionRowOperands<T> a{qkv + static_cast<long long>(r) * 3 * D + col,
                                        k_prefix + col, v_prefix + col, p, k_prefix_stride,
                                        v_prefix_stride, seg_k + seq, seg_v + seq, 0,
                                        2 * (offset + t) + 1, seg_stride, d_head, scale};
        attention_row(a, o + static_cast<long long>(r) * D + col);
    }
};

}  // namespace titans::detail
