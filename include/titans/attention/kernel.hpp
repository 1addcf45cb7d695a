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
#include "../types.hpp"

namespace titans {

namespace detail {

/// Queries per tile of prefix_window_attention: the window, clamped to [16, 64]. A tile of t
/// queries reads a key span of t + w - 1 rows of which each query sees w, so small windows want
/// small tiles (less masked work) and large windows large ones (larger GEMMs).
inline Eigen::Index attention_query_tile(int window) {
    return std::clamp<Eigen::Index>(window, 16, 64);
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
    constexpr const char* w = "prefix_window_attention";
    require<ConfigError>(n_heads >= 1, w, "n_heads", n_heads, ">= 1");
    require<ConfigError>(d_head >= 1, w, "d_head", d_head, ">= 1");
    require<ConfigError>(window >= 1, w, "window", window, ">= 1");
    require<ShapeError>(first_query >= 0, w, "first_query", first_query, ">= 0");
    require<ConfigError>(query_stride >= 1, w, "query_stride", query_stride, ">= 1");
    const Index D = static_cast<Index>(n_heads) * d_head;
    const Index n = q.rows(), p = k_prefix.rows(), m = k_seq.rows();
    auto width = [&](const auto& x, const char* name) {
        if (x.cols() != D && !(x.rows() == 0 && x.cols() == 0)) {
            throw ShapeError(concat(w, ": ", name, " has ", x.cols(),
                                    " columns, expected n_heads * d_head = ", D));
        }
    };
    width(q, "q");
    width(k_prefix, "k_prefix");
    width(v_prefix, "v_prefix");
    width(k_seq, "k_seq");
    width(v_seq, "v_seq");
    require<ShapeError>(v_prefix.rows() == p, w, "v_prefix.rows()", v_prefix.rows(),
                        concat("k_prefix.rows() = ", p));
    require<ShapeError>(v_seq.rows() == m, w, "v_seq.rows()", v_seq.rows(),
                        concat("k_seq.rows() = ", m));
    // The last query's position (first_query + query_stride * (n - 1)) must be a key row.
    const Index last_pos = first_query + query_stride * (std::max<Index>(n, 1) - 1);
    require<ShapeError>(m > last_pos || n == 0, w, "k_seq.rows()", m,
                        concat("> first_query + query_stride * (q.rows() - 1) = ", last_pos));
    if (out.rows() != n || out.cols() != D) {
        throw ShapeError(concat(w, ": out is ", out.rows(), " x ", out.cols(), ", expected ", n,
                                " x ", D, " (q.rows() x n_heads * d_head)"));
    }
    if (n == 0) return;
    const T* const o0 = out.data();
    const T* const inputs[] = {q.data(), p > 0 ? k_prefix.data() : nullptr,
                               p > 0 ? v_prefix.data() : nullptr, k_seq.data(), v_seq.data()};
    for (const T* in : inputs) {
        if (in == o0) {
            throw ShapeError(concat(w, ": out shares its storage with an input, expected a "
                                       "distinct matrix"));
        }
    }

    // Softmax(Q K^T / sqrt(d_h)) V, one (query tile, head) unit at a time. A tile of queries
    // [i0, i0 + t) at positions P0, P0 + s, ..., P0 + s (t - 1) (s = query_stride) reads
    // sequence keys [js, P0 + s (t - 1) + 1) with js = max(0, P0 - w + 1):
    // O(t (p + s t + w) d_h) work per unit, linear in n overall.
    const Index tile = attention_query_tile(window);
    const Index n_tiles = (n + tile - 1) / tile;
    const Index units = n_tiles * n_heads;
    const Index wl = window;
    const Index span_cap = std::min<Index>(query_stride * (tile - 1) + wl, m);
    const T scale = T(1) / std::sqrt(static_cast<T>(d_head));

#if defined(_OPENMP)
    // Threads only pay off for tens of microseconds of work (not for one streamed token).
    const double work = static_cast<double>(n) * static_cast<double>(p + span_cap) *
                        static_cast<double>(D);
#pragma omp parallel if (units > 1 && work >= 1.0e6)
#endif
    {
        // Per-thread tile workspaces: exp-scores against the prefix and the key span.
        Matrix<T> sp(tile, p), ss(tile, span_cap);
        RowVector<T> row_sum(tile);
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (Index u = 0; u < units; ++u) {
            const Index tile_idx = u / n_heads;
            const Index c0 = (u % n_heads) * d_head;
            const Index i0 = tile_idx * tile;
            const Index t = std::min(tile, n - i0);
            const Index P0 = first_query + query_stride * i0;  // the tile's first query
            const Index js = std::max<Index>(0, P0 - wl + 1);
            const Index L = P0 + query_stride * (t - 1) + 1 - js;  // key span [js, js + L)
            const auto qh = q.block(i0, c0, t, d_head);
            auto S = ss.topLeftCorner(t, L);
            S.noalias() = qh * k_seq.block(js, c0, L, d_head).transpose();
            auto Sp = sp.topRows(t);
            if (p > 0) {
                Sp.noalias() = qh * k_prefix.block(0, c0, p, d_head).transpose();
            }
            for (Index r = 0; r < t; ++r) {
                // Visible span columns of query r (position P0 + s r): [lo, hi].
                const Index pos = P0 + query_stride * r;
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
                row_sum(r) = T(1) / sum;  // sum >= 1: the max entry contributes exp(0)
            }
            auto oh = out.block(i0, c0, t, d_head);
            oh.noalias() = S * v_seq.block(js, c0, L, d_head);
            if (p > 0) {
                oh.noalias() += Sp * v_prefix.block(0, c0, p, d_head);
            }
            for (Index r = 0; r < t; ++r) {
                oh.row(r) *= row_sum(r);
            }
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
    out.resize(q.rows(), static_cast<Eigen::Index>(std::max(n_heads, 0)) * std::max(d_head, 0));
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
