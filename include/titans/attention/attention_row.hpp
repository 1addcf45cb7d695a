#pragma once
// titans/attention/attention_row.hpp: the attention of one query row and one head (math §7),
// written once as a TITANS_HOST_DEVICE function: the CUDA backend runs it per (row, head) and
// the CPU tests compare it with the tiled kernel of attention/kernel.hpp.

#include <cmath>
#include <cstdint>

#include "../config.hpp"

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

}  // namespace titans::detail
