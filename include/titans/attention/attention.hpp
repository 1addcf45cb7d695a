#pragma once
// titans/attention/attention.hpp: exact multi-head softmax attention with an always-visible
// prefix and a causal sliding window (math §6-7), tiled so that work and memory are linear in
// the sequence length for a fixed window and prefix.
//
//   AttentionConfig            d_model, heads, window, RoPE settings
//   AttentionParams<T>         w_q, w_k, w_v (d x D), w_o (D x d)
//   prefix_window_attention    the core primitive on projected q/k/v, used by every composition
//   AttentionState<T>          per-sequence history (last w-1 keys/values) of a stream batch
//   Attention<T>               the layer: projections, RoPE, streaming, output projection
//
// The masks of math §7 are all instances of one rule. Query i of a piece sits at position
// t = first_query + i of the sequence keys and sees
//     every prefix row (persistent tokens P, MAC's retrieved memory h_t, ...)    and
//     sequence keys j with t - w < j <= t (itself and the w - 1 before it).
// MAG/MAL: prefix = P, window w. MAC: prefix = P ‖ h_t, window >= C (causal inside a segment).

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
#include "../detail/random.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../types.hpp"
#include "rope.hpp"

namespace titans {

// ---------------------------------------------------------------------------------------------
// Configuration and parameters.

/// Every setting of an Attention layer (math §7). Aggregate: use designated initialisers,
///
///     titans::AttentionConfig cfg{.d_model = 256, .n_heads = 4, .window = 128, .rope = true};
///
/// then `cfg.validate()` (the Attention constructor calls it) throws ConfigError naming the
/// first bad field.
struct AttentionConfig {
    int d_model = 64;           ///< d, width of the tokens in and out
    int n_heads = 1;            ///< H
    int d_head = 0;             ///< d_h; 0 means d_model / n_heads
    int window = 64;            ///< w >= 1: a query sees its own position and the w-1 before it
                                ///< (use a window >= the sequence length for full causal attention)
    bool rope = false;          ///< rotary position embedding of q and k (sequence tokens only)
    double rope_base = 10000.0; ///< RoPE base: pair i of a head turns by t * base^(-2i/d_h)

    /// d_h after defaulting.
    [[nodiscard]] int head_dim() const { return d_head > 0 ? d_head : d_model / n_heads; }
    /// D = H * d_h, the width of the concatenated heads.
    [[nodiscard]] int inner_dim() const { return n_heads * head_dim(); }

    /// Serialization hook: calls v(name, field) for every setting, in declaration order, with
    /// name a std::string and field an int, double or bool reference (const if Self is).
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AttentionConfig>);
        using S = std::string;
        v(S("d_model"), self.d_model);
        v(S("n_heads"), self.n_heads);
        v(S("d_head"), self.d_head);
        v(S("window"), self.window);
        v(S("rope"), self.rope);
        v(S("rope_base"), self.rope_base);
    }

    /// Elements of the AttentionParams of this configuration (4 d x D), in 64 bits
    /// (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t parameter_count() const {
        return detail::sat_mul(4, d_model, inner_dim64());
    }

    /// Bytes of the state make_state(batch) builds once it is full (the last w - 1 keys and
    /// values of every sequence, plus limits::matrix_overhead_bytes per matrix),
    /// `scalar_bytes` per element, in 64 bits (saturating).
    [[nodiscard]] std::int64_t state_bytes(std::int64_t batch, std::int64_t scalar_bytes) const {
        using detail::sat_add;
        using detail::sat_mul;
        const std::int64_t per_sequence =
            sat_add(sat_mul(2, window - 1, inner_dim64(), scalar_bytes),
                    sat_mul(2, limits::matrix_overhead_bytes));
        return sat_mul(batch, per_sequence);
    }

    /// Throws ConfigError naming the first invalid field and what it must be: every field in
    /// its range (upper limits in titans/limits.hpp), rope_base finite and > 0, and the
    /// parameters and the full batch-1 state within limits::max_allocation_bytes at 4 bytes
    /// (float) per element. validate_for<T>() also counts sizeof(T) and checks rope_base is
    /// representable in T.
    void validate() const {
        constexpr const char* w = "AttentionConfig";
        using detail::require;
        using detail::require_in_range;
        require_in_range(d_model, 1, limits::max_d_model, w, "d_model");
        require_in_range(n_heads, 1, limits::max_heads, w, "n_heads");
        require_in_range(d_head, 0, limits::max_head_dim, w, "d_head",
                         " (0 means d_model / n_heads)");
        if (d_head == 0) {
            require<ConfigError>(d_model % n_heads == 0, w, "d_model", d_model,
                                 detail::concat("a multiple of n_heads = ", n_heads,
                                                " when d_head = 0"));
        }
        require_in_range(window, 1, limits::max_window, w, "window");
        if (rope) {
            require<ConfigError>(head_dim() % 2 == 0, w, "d_head", head_dim(),
                                 "an even number when rope = true (RoPE rotates pairs)");
        }
        require<ConfigError>(std::isfinite(rope_base) && rope_base > 0, w, "rope_base",
                             rope_base, "a finite value > 0");
        check_budget(4, "float");
    }

    /// validate(), then rope_base representable in T and the parameters and batch-1 state
    /// within the budget at sizeof(T) bytes per element. Called by Attention<T> and
    /// AttentionParams<T>::random / zeros.
    template <class T>
    void validate_for() const {
        validate();
        detail::require_representable<T>(rope_base, "AttentionConfig", "rope_base");
        check_budget(static_cast<std::int64_t>(sizeof(T)), detail::scalar_name<T>());
    }

    /// H * d_h in 64 bits (saturating; 0 rather than a division by zero when n_heads < 1).
    [[nodiscard]] std::int64_t inner_dim64() const {
        const std::int64_t dh = d_head > 0 ? d_head : (n_heads > 0 ? d_model / n_heads : 0);
        return detail::sat_mul(n_heads, dh);
    }

private:
    void check_budget(std::int64_t scalar_bytes, const char* scalar) const {
        constexpr const char* w = "AttentionConfig";
        detail::require_budget(detail::sat_mul(parameter_count(), scalar_bytes), w,
                               "parameter size", scalar, "reduce d_model, n_heads or d_head");
        detail::require_budget(state_bytes(1, scalar_bytes), w, "state size for batch 1", scalar,
                               "reduce window, n_heads or d_head (the state keeps the last "
                               "window - 1 keys and values)");
    }
};

/// The outer parameters of an Attention layer (fixed at test time). Shapes (d = d_model,
/// D = H * d_h; head h is columns [h*d_h, (h+1)*d_h) of w_q, w_k, w_v and rows of w_o):
///
///   w_q, w_k, w_v   d x D    query / key / value projections (no biases)
///   w_o             D x d    output projection
template <class T>
struct AttentionParams {
    Matrix<T> w_q, w_k, w_v;
    Matrix<T> w_o;

    /// Parameters drawn from a seeded generator (identical on every platform): w_q, w_k, w_v
    /// N(0, 1/d), w_o N(0, 1/D).
    [[nodiscard]] static AttentionParams random(const AttentionConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, zero-filled, without the generator's work: what a loader
    /// (titans::io::load_parameters) fills. Not a usable initialisation.
    [[nodiscard]] static AttentionParams zeros(const AttentionConfig& cfg) {
        return generate(cfg, 0, false);
    }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static AttentionParams generate(const AttentionConfig& cfg, std::uint64_t seed,
                                                  bool draw) {
        cfg.validate_for<T>();  // field limits, T-representable settings, allocation budget
        detail::TensorDraw<T> gauss(seed, draw);
        const int d = cfg.d_model, D = cfg.inner_dim();
        AttentionParams p;
        const double sd = 1.0 / std::sqrt(static_cast<double>(d));
        p.w_q = gauss(d, D, sd);
        p.w_k = gauss(d, D, sd);
        p.w_v = gauss(d, D, sd);
        p.w_o = gauss(D, d, 1.0 / std::sqrt(static_cast<double>(D)));
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for w_q, w_k, w_v, w_o, tensor the member
    /// itself (Matrix<T>&, const if Self is). `cfg` is unused (every tensor is always used).
    template <class Self, class V>
    static void tensors(Self& self, [[maybe_unused]] const AttentionConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AttentionParams>);
        using S = std::string;
        v(S("w_q"), self.w_q);
        v(S("w_k"), self.w_k);
        v(S("w_v"), self.w_v);
        v(S("w_o"), self.w_o);
    }

    /// Throws ShapeError if a matrix's shape disagrees with `cfg`, NonFiniteError if a value is
    /// NaN or infinite.
    void validate(const AttentionConfig& cfg) const {
        const Eigen::Index d = cfg.d_model, D = cfg.inner_dim();
        const detail::TensorCheck check{"AttentionParams"};
        check(w_q, "w_q", d, D);
        check(w_k, "w_k", d, D);
        check(w_v, "w_v", d, D);
        check(w_o, "w_o", D, d);
    }
};

// ---------------------------------------------------------------------------------------------
// The core primitive.

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
    // Threads only pay off for more than a few microseconds of work (not for one streamed token).
    const double work = static_cast<double>(n) * static_cast<double>(p + span_cap) *
                        static_cast<double>(D);
#pragma omp parallel if (units > 1 && work >= 262144.0)
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

// ---------------------------------------------------------------------------------------------
// The layer.

/// How Attention::forward reads its prefix argument.
enum class PrefixSharing {
    Shared,       ///< prefix is p x d, the same rows for every sequence (persistent tokens P)
    PerSequence,  ///< prefix is (B*p) x d stacked sequence-major, rows [b*p, (b+1)*p) for
                  ///< sequence b (e.g. MAC's P ‖ h_t, where h_t differs per sequence)
};

/// The state of B independent streams of one Attention layer: per sequence, the rotated keys
/// and the values of its last min(w - 1, position) tokens (all a later query can still see),
/// and the absolute position of the next token. Made by Attention::make_state(B); copyable (a
/// copy is a snapshot of the streams).
template <class T>
class AttentionState {
public:
    AttentionState() = default;

    [[nodiscard]] int batch() const { return batch_; }
    /// Tokens seen per sequence (absolute position of the next token).
    [[nodiscard]] std::int64_t position() const { return position_; }
    /// Keys (rotated if rope) kept for sequence b: min(w - 1, position) x D, oldest first.
    [[nodiscard]] const Matrix<T>& keys(int b) const { return k_hist_[static_cast<std::size_t>(b)]; }
    /// Values kept for sequence b: min(w - 1, position) x D, oldest first.
    [[nodiscard]] const Matrix<T>& values(int b) const { return v_hist_[static_cast<std::size_t>(b)]; }
    /// The configuration the state was made for.
    [[nodiscard]] const AttentionConfig& config() const { return cfg_; }

    /// Serialization hook (checkpoints): calls v(name, x) for everything a resumed stream needs
    /// to continue bit-identically, x a Matrix<T>& or std::int64_t& (const if Self is):
    ///     position   std::int64_t
    ///     k.{b}      keys (rotated if rope) of sequence b: min(w - 1, position) x D
    ///     v.{b}      values of sequence b:                 min(w - 1, position) x D
    /// The ROW COUNT of k.{b} and v.{b} varies with position (0 rows at position 0): a loader
    /// must accept any h x D with h = min(w - 1, position) and assign (resize) the member.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AttentionState>);
        v(std::string("position"), self.position_);
        for (std::size_t b = 0; b < self.k_hist_.size(); ++b) {
            v(detail::visit_name("k", b), self.k_hist_[b]);
        }
        for (std::size_t b = 0; b < self.v_hist_.size(); ++b) {
            v(detail::visit_name("v", b), self.v_hist_[b]);
        }
    }

private:
    friend class Attention<T>;

    AttentionConfig cfg_{};
    int batch_ = 0;
    std::int64_t position_ = 0;
    std::vector<Matrix<T>> k_hist_, v_hist_;  // B of h x D, h = min(w - 1, position)
    // The open transaction (Attention::begin): position and histories at its start, the
    // histories swapped out (not copied) by the first call that replaces them.
    struct Undo {
        bool open = false, saved = false;
        std::int64_t position = 0;
        std::vector<Matrix<T>> k, v;
    } undo_;
};

/// A causal sliding-window multi-head attention layer over a batch of streams, with an optional
/// always-visible prefix (math §6-7: SWA* of MAG, SWA of MAL, and the segment attention of MAC):
///
///     q_t = rope_t(x_t W_Q),  k_t = rope_t(x_t W_K),  v_t = x_t W_V        (sequence tokens)
///     k_P = P W_K,  v_P = P W_V                                             (prefix, not rotated)
///     y_t = [ softmax( q_t [k_P ; k_{t-w+1..t}]^T / sqrt(d_h) ) [v_P ; v_{t-w+1..t}] ]_heads W_O
///
/// rope_t rotates at the token's absolute position t in the stream (only when cfg.rope). Prefix
/// tokens carry no position: they are not rotated and every query sees all of them, so they act
/// as a content-addressed memory (the persistent tokens of math §6).
///
/// Shapes: forward takes x of (B*N) x d_model (B sequences of N tokens, stacked
/// sequence-major) and returns (B*N) x d_model. B is fixed by the state; N may differ between
/// calls: the state keeps the last w - 1 keys/values of every sequence, so feeding a stream in
/// pieces of any length (one token at a time included) gives the outputs of one call.
///
///     titans::AttentionConfig cfg{.d_model = 64, .n_heads = 4, .window = 32, .rope = true};
///     titans::Attention<float> attn(cfg, titans::AttentionParams<float>::random(cfg, 7));
///     auto state = attn.make_state(1);
///     titans::Matrixf y = attn.forward(state, x, &persistent.tokens());  // x: N x 64
///
/// Thread safety: an Attention is immutable after construction; distinct states may be used
/// from distinct threads concurrently.
template <class T>
class Attention {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::Attention: T must be float or double");

public:
    using Scalar = T;
    using State = AttentionState<T>;

    /// Validates both (ConfigError, ShapeError, NonFiniteError) and keeps copies.
    Attention(AttentionConfig config, AttentionParams<T> params)
        : cfg_(std::move(config)), params_(std::move(params)) {
        cfg_.validate_for<T>();
        params_.validate(cfg_);
    }

    [[nodiscard]] const AttentionConfig& config() const { return cfg_; }
    [[nodiscard]] const AttentionParams<T>& params() const { return params_; }

    /// A fresh state for `batch` independent sequences: no history, position 0.
    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require_state_batch(
            "Attention::make_state", batch, detail::scalar_name<T>(),
            [&](std::int64_t b) { return cfg_.state_bytes(b, std::int64_t{sizeof(T)}); });
        State s;
        s.cfg_ = cfg_;
        s.batch_ = batch;
        s.position_ = 0;
        s.k_hist_.assign(static_cast<std::size_t>(batch), Matrix<T>(0, cfg_.inner_dim()));
        s.v_hist_.assign(static_cast<std::size_t>(batch), Matrix<T>(0, cfg_.inner_dim()));
        return s;
    }

    /// Processes the next piece of every stream. x: (B*N) x d_model with B = state.batch();
    /// prefix (optional): p x d_model (PrefixSharing::Shared) or (B*p) x d_model
    /// (PrefixSharing::PerSequence), visible to every query. Returns (B*N) x d_model.
    [[nodiscard]] Matrix<T> forward(State& state, const Matrix<T>& x,
                                    const Matrix<T>* prefix = nullptr,
                                    PrefixSharing sharing = PrefixSharing::Shared) const {
        Matrix<T> y;
        forward(state, x, y, prefix, sharing);
        return y;
    }

    /// As above, writing into `y` (resized to (B*N) x d_model).
    void forward(State& state, const Matrix<T>& x, Matrix<T>& y, const Matrix<T>* prefix = nullptr,
                 PrefixSharing sharing = PrefixSharing::Shared) const {
        constexpr const char* where = "Attention::forward";
        detail::check_position_advance(where, state.position_, x.rows(), state.batch_);
        check_state(state, where);
        check_input(state, x, prefix, sharing, where);
        if (&x == &y || (prefix != nullptr && prefix == &y)) {
            throw ShapeError("Attention::forward: y is also an input, expected a distinct matrix");
        }
        using Index = Eigen::Index;
        const int B = state.batch_, H = cfg_.n_heads, dh = cfg_.head_dim(), D = cfg_.inner_dim();
        const Index N = x.rows() / B;
        y.resize(x.rows(), cfg_.d_model);
        if (N == 0) return;

        // Projections of every token of every sequence at once.
        Matrix<T> q(x.rows(), D), k(x.rows(), D), v(x.rows(), D);
        q.noalias() = x * params_.w_q;
        k.noalias() = x * params_.w_k;
        v.noalias() = x * params_.w_v;
        if (cfg_.rope) {
            // All sequences are at the same absolute position: one table for all of them.
            detail::RopeTable<T> table(N, dh, state.position_, cfg_.rope_base);
            for (int b = 0; b < B; ++b) {
                table.apply(q.middleRows(b * N, N), H, dh);
                table.apply(k.middleRows(b * N, N), H, dh);
            }
        }
        Matrix<T> kp(0, D), vp(0, D);
        Index p = 0;
        if (prefix != nullptr && prefix->rows() > 0) {
            kp.noalias() = *prefix * params_.w_k;
            vp.noalias() = *prefix * params_.w_v;
            p = sharing == PrefixSharing::Shared ? prefix->rows() : prefix->rows() / B;
        }

        const bool own = begin(state);
        try {
            attend(state, q, k, v, kp, vp, p, sharing, y);
        } catch (...) {
            rollback(state);
            throw;
        }
        if (own) {
            commit(state);
        }
    }

    /// Throws ConfigError unless `state` can be continued by this layer: made by make_state()
    /// of an attention with the same heads, widths, window and RoPE settings.
    void validate_state(const State& state) const { check_state(state, "Attention"); }

    /// Transactions, as NeuralMemory::begin/commit/rollback: forward calls after begin(state)
    /// are undone together by rollback(state) or kept by commit(state); without one each call
    /// is its own (a call that throws leaves the state as it was). begin returns false if one
    /// is already open.
    bool begin(State& state) const {
        check_state(state, "Attention::begin");
        auto& u = state.undo_;
        if (u.open) {
            return false;
        }
        u.open = true;
        u.saved = false;
        u.position = state.position_;
        return true;
    }
    void commit(State& state) const { state.undo_.open = false; }
    void rollback(State& state) const {
        auto& u = state.undo_;
        if (!u.open) {
            return;
        }
        if (u.saved) {
            for (std::size_t b = 0; b < state.k_hist_.size(); ++b) {
                state.k_hist_[b].swap(u.k[b]);
                state.v_hist_[b].swap(u.v[b]);
            }
        }
        state.position_ = u.position;
        u.open = false;
    }

private:
    /// The attention proper on projected q, k, v (and prefix kp, vp of p rows per sequence),
    /// then the new histories and W_O; NonFiniteError if the output is not finite.
    void attend(State& state, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                const Matrix<T>& kp, const Matrix<T>& vp, Eigen::Index p, PrefixSharing sharing,
                Matrix<T>& y) const {
        using Index = Eigen::Index;
        const int B = state.batch_, H = cfg_.n_heads, dh = cfg_.head_dim(), D = cfg_.inner_dim();
        const Index N = q.rows() / B;
        // Per sequence: keys/values = [history (h rows) ; this piece (N rows)], queries at
        // positions h .. h + N - 1 of them.
        const Index w1 = static_cast<Index>(cfg_.window) - 1;
        const Index h = state.k_hist_[0].rows();
        Matrix<T> ks(h + N, D), vs(h + N, D), o(q.rows(), D);
        const Index keep = std::min<Index>(w1, h + N);
        for (int b = 0; b < B; ++b) {
            auto& kh = state.k_hist_[static_cast<std::size_t>(b)];
            auto& vh = state.v_hist_[static_cast<std::size_t>(b)];
            ks.topRows(h) = kh;
            vs.topRows(h) = vh;
            ks.bottomRows(N) = k.middleRows(b * N, N);
            vs.bottomRows(N) = v.middleRows(b * N, N);
            const Index pr0 = sharing == PrefixSharing::Shared ? 0 : b * p;
            detail::prefix_window_attention_impl<T>(
                q.middleRows(b * N, N), kp.middleRows(pr0, p), vp.middleRows(pr0, p), ks, vs, H,
                dh, cfg_.window, h, o.middleRows(b * N, N));
            if (state.undo_.open && !state.undo_.saved) {  // keep the old history: O(1) swaps
                state.undo_.k.resize(state.k_hist_.size());
                state.undo_.v.resize(state.v_hist_.size());
                kh.swap(state.undo_.k[static_cast<std::size_t>(b)]);
                vh.swap(state.undo_.v[static_cast<std::size_t>(b)]);
            }
            kh = ks.bottomRows(keep);
            vh = vs.bottomRows(keep);
        }
        state.undo_.saved = state.undo_.open;
        y.noalias() = o * params_.w_o;
        if (!detail::all_finite(y)) {
            Index r = 0;
            while (r + 1 < y.rows() && detail::all_finite(y.row(r))) ++r;
            throw NonFiniteError(detail::concat(
                "Attention::forward: the output is not finite at sequence ", r / N, ", position ",
                state.position_ + r % N, " (the projections overflow), expected finite values; "
                "the state is unchanged"));
        }
        state.position_ += N;
    }

    void check_state(const State& state, const char* where) const {
        const AttentionConfig& s = state.cfg_;
        const bool same = state.batch_ >= 1 && s.d_model == cfg_.d_model &&
                          s.n_heads == cfg_.n_heads && s.head_dim() == cfg_.head_dim() &&
                          s.window == cfg_.window && s.rope == cfg_.rope &&
                          (!cfg_.rope || s.rope_base == cfg_.rope_base) &&
                          state.k_hist_.size() == static_cast<std::size_t>(state.batch_);
        if (!same) {
            throw ConfigError(detail::concat(
                where, ": state was made for a different configuration (or default-constructed),"
                       " expected a state from make_state() of an attention with this "
                       "configuration"));
        }
    }
    void check_input(const State& state, const Matrix<T>& x, const Matrix<T>* prefix,
                     PrefixSharing sharing, const char* where) const {
        if (x.cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", x.cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (x.rows() % state.batch_ != 0) {
            throw ShapeError(detail::concat(where, ": x has ", x.rows(),
                                            " rows, expected a multiple of the state's batch = ",
                                            state.batch_, " (B*N rows, sequence-major)"));
        }
        if (!x.allFinite()) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
        if (prefix == nullptr) return;
        if (prefix->cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": prefix has ", prefix->cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (sharing == PrefixSharing::PerSequence && prefix->rows() % state.batch_ != 0) {
            throw ShapeError(detail::concat(
                where, ": prefix has ", prefix->rows(),
                " rows, expected a multiple of the state's batch = ", state.batch_,
                " (B*p rows, sequence-major, with PrefixSharing::PerSequence)"));
        }
        if (!prefix->allFinite()) {
            throw NonFiniteError(detail::concat(where, ": prefix has a NaN or infinite entry"));
        }
    }

    AttentionConfig cfg_;
    AttentionParams<T> params_;
};

}  // namespace titans
