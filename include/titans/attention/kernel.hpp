#pragma once
// titans/attention/kernel.hpp: prefix_window_attention, the tiled prefix + sliding-window
// attention on projected queries, keys and values (the core primitive of every composition).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/float_env.hpp"
#include "../error.hpp"
#include "../limits.hpp"
#include "../types.hpp"

namespace titans {

namespace detail {

/// Queries per tile of prefix_window_attention: the window, clamped to [16, 64]. A tile of t
/// queries reads a key span of t + w - 1 rows of which each query sees w, so small windows want
/// small tiles (less masked work) and large windows large ones (larger GEMMs).
inline Eigen::Index attention_query_tile(int window) {
    return std::clamp<Eigen::Index>(window, 16, 64);
}

/// The operands of prefix_window_attention, checked by check_attention_operands.
template <class T>
struct AttentionOperands {
    const Eigen::Ref<const Matrix<T>>& q;
    const Eigen::Ref<const Matrix<T>>& k_prefix;
    const Eigen::Ref<const Matrix<T>>& v_prefix;
    const Eigen::Ref<const Matrix<T>>& k_seq;
    const Eigen::Ref<const Matrix<T>>& v_seq;
    Eigen::Ref<Matrix<T>>& out;
    int n_heads, d_head, window;
    Eigen::Index first_query, query_stride;
};

/// ConfigError / ShapeError naming the first bad argument of prefix_window_attention.
template <class T>
void check_attention_operands(const AttentionOperands<T>& a) {
    using Index = Eigen::Index;
    constexpr const char* w = "prefix_window_attention";
    require<ConfigError>(a.n_heads >= 1, w, "n_heads", a.n_heads, ">= 1");
    require<ConfigError>(a.d_head >= 1, w, "d_head", a.d_head, ">= 1");
    require<ConfigError>(a.window >= 1, w, "window", a.window, ">= 1");
    require<ShapeError>(a.first_query >= 0, w, "first_query", a.first_query, ">= 0");
    require<ConfigError>(a.query_stride >= 1, w, "query_stride", a.query_stride, ">= 1");
    const Index D = static_cast<Index>(a.n_heads) * a.d_head;
    const Index n = a.q.rows(), p = a.k_prefix.rows(), m = a.k_seq.rows();
    auto width = [&](const auto& x, const char* name) {
        if (x.cols() != D && !(x.rows() == 0 && x.cols() == 0)) {
            throw ShapeError(concat(w, ": ", name, " has ", x.cols(),
                                    " columns, expected n_heads * d_head = ", D));
        }
    };
    width(a.q, "q");
    width(a.k_prefix, "k_prefix");
    width(a.v_prefix, "v_prefix");
    width(a.k_seq, "k_seq");
    width(a.v_seq, "v_seq");
    require<ShapeError>(a.v_prefix.rows() == p, w, "v_prefix.rows()", a.v_prefix.rows(),
                        concat("k_prefix.rows() = ", p));
    require<ShapeError>(a.v_seq.rows() == m, w, "v_seq.rows()", a.v_seq.rows(),
                        concat("k_seq.rows() = ", m));
    // The last query's position (first_query + query_stride * (n - 1)) must be a key row; one
    // beyond 64 bits is refused before it is computed.
    const Index steps = std::max<Index>(n, 1) - 1;
    if (steps > 0 && a.query_stride > (std::numeric_limits<Index>::max() - a.first_query) / steps) {
        throw ShapeError(concat(w, ": the last query's position first_query + query_stride * "
                                "(q.rows() - 1) = ", a.first_query, " + ", a.query_stride, " * ",
                                steps, " is beyond 2^63 - 1, expected < k_seq.rows() = ", m));
    }
    const Index last_pos = a.first_query + a.query_stride * steps;
    require<ShapeError>(m > last_pos || n == 0, w, "k_seq.rows()", m,
                        concat("> first_query + query_stride * (q.rows() - 1) = ", last_pos));
    if (a.out.rows() != n || a.out.cols() != D) {
        throw ShapeError(concat(w, ": out is ", a.out.rows(), " x ", a.out.cols(), ", expected ",
                                n, " x ", D, " (q.rows() x n_heads * d_head)"));
    }
    const T* const o0 = a.out.data();
    const T* const inputs[] = {a.q.data(), p > 0 ? a.k_prefix.data() : nullptr,
                               p > 0 ? a.v_prefix.data() : nullptr, a.k_seq.data(),
                               a.v_seq.data()};
    for (const T* in : inputs) {
        if (n > 0 && in == o0) {
            throw ShapeError(concat(w, ": out shares its storage with an input, expected a "
                                       "distinct matrix"));
        }
    }
}

/// An n x D stand-in for an output that is not sized yet, for check_attention_operands (which
/// measures out, never reads or writes it): a view of one local scalar, allocating nothing
/// whatever n x D is.
template <class T>
struct AttentionOutputProbe {
    T stand_in{};
    Eigen::Map<Matrix<T>> map;
    Eigen::Ref<Matrix<T>> ref;
    AttentionOutputProbe(Eigen::Index n, int n_heads, int d_head)
        : map(&stand_in, n, static_cast<Eigen::Index>(std::max(n_heads, 0)) * std::max(d_head, 0)),
          ref(map) {}
    AttentionOutputProbe(const AttentionOutputProbe&) = delete;
    AttentionOutputProbe& operator=(const AttentionOutputProbe&) = delete;
};

/// The widest key span a query tile of `tile` queries reads, at most m: query_stride * (tile -
/// 1) + window, saturating (a stride near 2^63 with one query is valid).
inline Eigen::Index attention_span_cap(Eigen::Index query_stride, Eigen::Index tile, int window,
                                       Eigen::Index m) {
    return std::min<Eigen::Index>(sat_add(sat_mul(query_stride, tile - 1), window), m);
}

/// Per-thread workspaces of one (query tile, head) unit: exp-scores against the prefix (sp)
/// and the key span (ss), and the reciprocal row sums.
template <class T>
struct AttentionTile {
    Matrix<T> sp, ss;
    RowVector<T> row_sum;
};

/// The key span [js, js + L) of the sequence rows a query tile reads.
struct AttentionSpan {
    Eigen::Index js, L;
};

/// The softmax of one (query tile, head) unit before its normalisation: queries [i0, i0 + t)
/// of head columns [c0, c0 + d_h), at positions P0 + s r (s = query_stride), against the
/// prefix and sequence keys [js, js + L), js = max(0, P0 - w + 1). Writes
/// exp(scale (score - row max)) over prefix and window scores together into ss (t x L, masked
/// entries 0) and sp (t x p), and 1 / (row sum) into inv(r); returns the span. The forward and
/// the backward share it, so they see the same probabilities.
template <class T, class Inv>
AttentionSpan softmax_numerators(const AttentionOperands<T>& a, Eigen::Index i0, Eigen::Index t,
                                 Eigen::Index c0, T scale, Matrix<T>& ss, Matrix<T>& sp,
                                 Inv&& inv) {
    using Index = Eigen::Index;
    const Index p = a.k_prefix.rows(), wl = a.window, s = a.query_stride, dh = a.d_head;
    const Index P0 = a.first_query + s * i0;  // the tile's first query
    const Index js = std::max<Index>(0, P0 - wl + 1);
    const Index L = P0 + s * (t - 1) + 1 - js;  // key span [js, js + L)
    const auto qh = a.q.block(i0, c0, t, dh);
    auto S = ss.topLeftCorner(t, L);
    S.noalias() = qh * a.k_seq.block(js, c0, L, dh).transpose();
    auto Sp = sp.topRows(t);
    if (p > 0) {
        Sp.noalias() = qh * a.k_prefix.block(0, c0, p, dh).transpose();
    }
    for (Index r = 0; r < t; ++r) {
        // Visible span columns of query r (position P0 + s r): [lo, hi].
        const Index pos = P0 + s * r;
        const Index lo = std::max<Index>(pos - wl + 1, js) - js;
        const Index hi = pos - js;
        auto vis = S.row(r).segment(lo, hi - lo + 1);
        T mx = vis.maxCoeff();
        if (p > 0) mx = std::max(mx, Sp.row(r).maxCoeff());
        // exp(scale * (s - max)): the numerically stable softmax over prefix and window
        // scores together (scale > 0, so the max of the scaled scores is scale * mx).
        vis = ((vis.array() - mx) * scale).exp().matrix();
        S.row(r).head(lo).setZero();
        S.row(r).tail(L - 1 - hi).setZero();
        T sum = vis.sum();
        if (p > 0) {
            Sp.row(r) = ((Sp.row(r).array() - mx) * scale).exp().matrix();
            sum += Sp.row(r).sum();
        }
        inv(r) = T(1) / sum;  // sum >= 1: the max entry contributes exp(0)
    }
    return {js, L};
}

/// One unit (see softmax_numerators): the normalised softmax times the values, into out.
template <class T>
void attention_unit(const AttentionOperands<T>& a, Eigen::Index i0, Eigen::Index t,
                    Eigen::Index c0, T scale, AttentionTile<T>& ws) {
    using Index = Eigen::Index;
    const Index p = a.k_prefix.rows(), dh = a.d_head;
    const auto [js, L] = softmax_numerators(a, i0, t, c0, scale, ws.ss, ws.sp, ws.row_sum);
    const auto S = ws.ss.topLeftCorner(t, L);
    const auto Sp = ws.sp.topRows(t);
    auto oh = a.out.block(i0, c0, t, dh);
    oh.noalias() = S * a.v_seq.block(js, c0, L, dh);
    if (p > 0) {
        oh.noalias() += Sp * a.v_prefix.block(0, c0, p, dh);
    }
    for (Index r = 0; r < t; ++r) {
        oh.row(r) *= ws.row_sum(r);
    }
}

template <class T>
void prefix_window_attention_impl(const Eigen::Ref<const Matrix<T>>& q,
                                  const Eigen::Ref<const Matrix<T>>& k_prefix,
                                  const Eigen::Ref<const Matrix<T>>& v_prefix,
                                  const Eigen::Ref<const Matrix<T>>& k_seq,
                                  const Eigen::Ref<const Matrix<T>>& v_seq, int n_heads,
                                  int d_head, int window, Eigen::Index first_query,
                                  Eigen::Ref<Matrix<T>> out, Eigen::Index query_stride = 1) {
    using Index = Eigen::Index;
    const AttentionOperands<T> a{q,      k_prefix, v_prefix, k_seq,       v_seq,       out,
                                 n_heads, d_head,  window,   first_query, query_stride};
    check_attention_operands(a);
    const Index n = q.rows(), p = k_prefix.rows(), m = k_seq.rows();
    if (n == 0) return;
    // Softmax(Q K^T / sqrt(d_h)) V, one (query tile, head) unit at a time: O(t (p + s t + w)
    // d_h) work per unit, linear in n overall.
    const Index tile = attention_query_tile(window);
    const Index units = (n + tile - 1) / tile * n_heads;
    const Index span_cap = attention_span_cap(query_stride, tile, window, m);
    const T scale = T(1) / std::sqrt(static_cast<T>(d_head));
#if defined(_OPENMP)
    // Threads only pay off for tens of microseconds of work (not for one streamed token).
    const double work = static_cast<double>(n) * static_cast<double>(p + span_cap) *
                        static_cast<double>(n_heads) * d_head;
#pragma omp parallel if (units > 1 && work >= 1.0e6)
#endif
    {
        AttentionTile<T> ws{Matrix<T>(tile, p), Matrix<T>(tile, span_cap), RowVector<T>(tile)};
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (Index u = 0; u < units; ++u) {
            const Index i0 = (u / n_heads) * tile;
            attention_unit(a, i0, std::min(tile, n - i0), (u % n_heads) * d_head, scale, ws);
        }
    }
}

}  // namespace detail

/// Exact multi-head softmax attention with an always-visible prefix and a causal sliding
/// window (math §7), on already projected (and, if wanted, rotated) queries, keys and values:
///
///     out_i = softmax( q_i [K_prefix ; K_seq[win(i)]]^T / sqrt(d_h) ) [V_prefix ; V_seq[win(i)]]
///     win(i) = { j : t - window < j <= t },   t = first_query + i,
///
/// per head h (columns [h*d_h, (h+1)*d_h) of every matrix). Query row i sits at position
/// first_query + i of the k_seq / v_seq rows (first_query + query_stride * i in general: with a
/// stride of 2, queries sit at every other key position, as MAC's interleaved keys need); it
/// sees ALL prefix rows and the sequence keys of its window (itself and the window - 1 before
/// it, fewer at the start).
///
/// Shapes (D = n_heads * d_head): q n x D; k_prefix, v_prefix p x D (p may be 0; a 0 x 0 matrix
/// is accepted too); k_seq, v_seq m x D with m > first_query + query_stride * (n - 1); out
/// n x D (must not share storage with an input). Rows of k_seq beyond the last query's position
/// are never read.
///
/// Computed in tiles of 16-64 queries against only the key span their windows cover, with
/// Eigen GEMMs and a softmax that subtracts the row maximum over prefix and window scores:
/// O(n (p + window + tile) d_h) work per head and O(tile (p + window + tile)) workspace per
/// thread, never an n x m score matrix. Parallel over (tile, head) under OpenMP. Checks shapes
/// (ShapeError) and n_heads, d_head, window, query_stride >= 1 (ConfigError), not finiteness.
///
///     // MAC segment: prefix = P ‖ h_t projected, full causal attention inside the segment.
///     titans::prefix_window_attention<float>(q, kp, vp, ks, vs, H, d_h, /*window=*/C,
///                                            /*first_query=*/0, out.middleRows(r0, C));
///
/// This overload takes any row-major views (blocks, rows of larger matrices) and needs the
/// scalar type spelled out; the overloads below take Matrix<T> and deduce it.
template <class T>
void prefix_window_attention(const Eigen::Ref<const Matrix<T>>& q,
                             const Eigen::Ref<const Matrix<T>>& k_prefix,
                             const Eigen::Ref<const Matrix<T>>& v_prefix,
                             const Eigen::Ref<const Matrix<T>>& k_seq,
                             const Eigen::Ref<const Matrix<T>>& v_seq, int n_heads, int d_head,
                             int window, Eigen::Index first_query, Eigen::Ref<Matrix<T>> out,
                             Eigen::Index query_stride = 1) {
    detail::prefix_window_attention_impl<T>(q, k_prefix, v_prefix, k_seq, v_seq, n_heads, d_head,
                                            window, first_query, out, query_stride);
}

/// As above with Matrix arguments; `out` is resized to q.rows() x (n_heads * d_head).
template <class T>
void prefix_window_attention(const Matrix<T>& q, const Matrix<T>& k_prefix,
                             const Matrix<T>& v_prefix, const Matrix<T>& k_seq,
                             const Matrix<T>& v_seq, int n_heads, int d_head, int window,
                             Eigen::Index first_query, Matrix<T>& out) {
    if (&out == &q || &out == &k_prefix || &out == &v_prefix || &out == &k_seq ||
        &out == &v_seq) {
        throw ShapeError("prefix_window_attention: out is also an input, expected a distinct "
                         "matrix");
    }
    // Every argument checked before out is resized (a huge n_heads * d_head allocates nothing).
    detail::AttentionOutputProbe<T> probe(q.rows(), n_heads, d_head);
    detail::check_attention_operands(detail::AttentionOperands<T>{
        q, k_prefix, v_prefix, k_seq, v_seq, probe.ref, n_heads, d_head, window, first_query, 1});
    out.resize(q.rows(), probe.map.cols());
    detail::prefix_window_attention_impl<T>(q, k_prefix, v_prefix, k_seq, v_seq, n_heads, d_head,
                                            window, first_query, out);
}

/// As above, returning the q.rows() x (n_heads * d_head) result.
template <class T>
[[nodiscard]] Matrix<T> prefix_window_attention(const Matrix<T>& q, const Matrix<T>& k_prefix,
                                                const Matrix<T>& v_prefix,
                                                const Matrix<T>& k_seq, const Matrix<T>& v_seq,
                                                int n_heads, int d_head, int window,
                                                Eigen::Index first_query = 0) {
    Matrix<T> out;
    prefix_window_attention(q, k_prefix, v_prefix, k_seq, v_seq, n_heads, d_head, window,
                            first_query, out);
    return out;
}

}  // namespace titans
