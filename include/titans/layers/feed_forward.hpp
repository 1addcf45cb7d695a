#pragma once
// titans/layers/feed_forward.hpp: FeedForward<T>, the position-wise feed-forward sub-block that
// follows the mixing sub-block of every Titans block (math §7): SwiGLU or a GELU MLP.

#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../detail/float_env.hpp"
#include "../backend/backend.hpp"
#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/product.hpp"
#include "../detail/activation.hpp"
#include "../detail/random.hpp"
#include "../detail/shared.hpp"
#include "../detail/tensor_slots.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../detail/enum_names.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../types.hpp"
#include "kernels_decl.hpp"
#include "rms_norm.hpp"

namespace titans {

/// The two feed-forward variants of math §7.
enum class FeedForwardKind {
    SwiGLU,  ///< y = (silu(x W1) ⊙ (x W3)) W2   (Shazeer, 2020)
    GELU,    ///< y = gelu(x W1) W2               (exact, erf-based GELU)
};

[[nodiscard]] inline const char* to_string(FeedForwardKind k) {
    return k == FeedForwardKind::SwiGLU ? "SwiGLU" : "GELU";
}

/// Inverse of to_string: sets `out` and returns true if `s` names an enumerator, else false.
[[nodiscard]] inline bool from_string(std::string_view s, FeedForwardKind& out) {
    return detail::enum_from_string(s, out, {FeedForwardKind::SwiGLU, FeedForwardKind::GELU});
}

/// Settings of a FeedForward. Aggregate:
///
///     titans::FeedForwardConfig cfg{.d_model = 64, .kind = titans::FeedForwardKind::SwiGLU};
///
/// `hidden = 0` picks the default width (see hidden_dim()).
struct FeedForwardConfig {
    int d_model = 64;                             ///< d, width in and out
    FeedForwardKind kind = FeedForwardKind::SwiGLU;
    int hidden = 0;                               ///< hidden width; 0 means the default

    /// The hidden width. Default: GELU 4d; SwiGLU 8d/3 rounded up to a multiple of 8, which
    /// gives its three matrices about the parameter count (8 d^2) of the two of a 4d GELU MLP,
    /// as in PaLM / LLaMA (d = 64 -> 176, d = 512 -> 1368).
    [[nodiscard]] int hidden_dim() const {
        if (hidden > 0) return hidden;
        if (kind == FeedForwardKind::GELU) return 4 * d_model;
        const int h = (8 * d_model + 2) / 3;  // ceil(8d / 3)
        return (h + 7) / 8 * 8;
    }

    /// Serialization hook: calls v(name, field) for d_model, kind, hidden (name a std::string,
    /// field a reference, const if Self is).
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, FeedForwardConfig>);
        v(std::string("d_model"), self.d_model);
        v(std::string("kind"), self.kind);
        v(std::string("hidden"), self.hidden);
    }

    /// Elements of the FeedForwardParams of this configuration (d x h, h x d, and d x h more
    /// for SwiGLU), in 64 bits (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t parameter_count() const {
        const std::int64_t h = d_model >= 1 ? hidden_dim() : 0;
        return detail::sat_mul(kind == FeedForwardKind::SwiGLU ? 3 : 2, d_model, h);
    }

    /// Throws ConfigError naming the first invalid field: d_model in [1, max_d_model], kind a
    /// valid enumerator, hidden in [0, max_ffn_hidden] (titans/limits.hpp), and the parameters
    /// within limits::max_allocation_bytes at 4 bytes (float) per element.
    void validate() const {
        constexpr const char* w = "FeedForwardConfig";
        detail::require_in_range(d_model, 1, limits::max_d_model, w, "d_model");
        detail::require<ConfigError>(
            kind == FeedForwardKind::SwiGLU || kind == FeedForwardKind::GELU, w, "kind",
            static_cast<int>(kind), "SwiGLU (0) or GELU (1)");
        detail::require_in_range(hidden, 0, limits::max_ffn_hidden, w, "hidden",
                                 " (0 means the default width)");
        check_budget(4, "float");
    }

    /// validate(), then the parameters within the budget at sizeof(T) bytes per element.
    /// Called by FeedForward<T> and FeedForwardParams<T>::random / zeros.
    template <class T>
    void validate_for() const {
        validate();
        check_budget(static_cast<std::int64_t>(sizeof(T)), detail::scalar_name<T>());
    }

private:
    void check_budget(std::int64_t scalar_bytes, const char* scalar) const {
        detail::require_budget(detail::sat_mul(parameter_count(), scalar_bytes),
                               "FeedForwardConfig", "parameter size", scalar,
                               "reduce d_model or hidden");
    }
};

/// The outer parameters of a FeedForward (no biases). Shapes (d = d_model, h = hidden_dim()):
///
///   w1   d x h    input projection (the SiLU / GELU branch)
///   w3   d x h    SwiGLU gate branch (empty, unused, for GELU)
///   w2   h x d    output projection
template <class T>
struct FeedForwardParams {
    Matrix<T> w1, w3, w2;

    /// Parameters drawn from a seeded generator (identical on every platform): w1, w3 N(0, 1/d),
    /// w2 N(0, 1/h).
    [[nodiscard]] static FeedForwardParams random(const FeedForwardConfig& cfg,
                                                  std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, every entry 0, without the generator's work: what a loader
    /// (titans::io::load_parameters) fills and what gradients are added to. Not a usable
    /// initialisation.
    [[nodiscard]] static FeedForwardParams zeros(const FeedForwardConfig& cfg) {
        return generate(cfg, 0, false);
    }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static FeedForwardParams generate(const FeedForwardConfig& cfg,
                                                    std::uint64_t seed, bool draw) {
        cfg.validate_for<T>();  // field limits, allocation budget
        detail::TensorDraw<T> gauss(seed, draw);
        const int d = cfg.d_model, h = cfg.hidden_dim();
        FeedForwardParams p;
        const double sd = 1.0 / std::sqrt(static_cast<double>(d));
        p.w1 = gauss(d, h, sd);
        if (cfg.kind == FeedForwardKind::SwiGLU) {
            p.w3 = gauss(d, h, sd);
        }
        p.w2 = gauss(h, d, 1.0 / std::sqrt(static_cast<double>(h)));
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for w1, w3 (SwiGLU only), w2, tensor the
    /// member itself (Matrix<T>&, const if Self is).
    template <class Self, class V>
    static void tensors(Self& self, const FeedForwardConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, FeedForwardParams>);
        v(std::string("w1"), self.w1);
        if (cfg.kind == FeedForwardKind::SwiGLU) {
            v(std::string("w3"), self.w3);
        }
        v(std::string("w2"), self.w2);
    }

    /// Throws ShapeError if a matrix's shape disagrees with `cfg`, NonFiniteError if a value is
    /// NaN or infinite.
    void validate(const FeedForwardConfig& cfg) const {
        const Eigen::Index d = cfg.d_model, h = cfg.hidden_dim();
        const detail::TensorCheck check{"FeedForwardParams"};
        check(w1, "w1", d, h);
        if (cfg.kind == FeedForwardKind::SwiGLU) {
            check(w3, "w3", d, h);
        }
        check(w2, "w2", h, d);
    }
};

namespace backend {
/// What FeedForwardKernels<B, T> must provide for FeedForward<T, B>, with x, y, dx rows x d
/// and a, g rows x h views in the backend's memory (outputs sized):
///   Prepared, prepare(cfg, params)    the parameters as the kernels use them, from the host's
///   forward(cfg, prepared, x, y)
///   forward_train(cfg, prepared, x, y, a, g)
///                                     forward, also writing the pre-activations a = x W1 and
///                                     (SwiGLU; empty for GELU) g = x W3
///   backward(cfg, prepared, x, a, g, dy, dx, dw1, dw3, dw2)
///                                     dx from dy; dL/dW1, dL/dW3 (SwiGLU), dL/dW2 added to
///                                     dw1, dw3, dw2
template <class B, class T>
concept FeedForwardBackend =
    requires(const FeedForwardConfig& cfg, const std::shared_ptr<const FeedForwardParams<T>>& hp,
             const typename FeedForwardKernels<B, T>::Prepared& p, View<const T> x,
             View<T> y) {
        typename FeedForwardKernels<B, T>::Prepared;
        { FeedForwardKernels<B, T>::prepare(cfg, hp) } ->
            std::same_as<typename FeedForwardKernels<B, T>::Prepared>;
        FeedForwardKernels<B, T>::forward(cfg, p, x, y);
        FeedForwardKernels<B, T>::forward_train(cfg, p, x, y, y, y);
        FeedForwardKernels<B, T>::backward(cfg, p, x, x, x, x, y, y, y, y);
    };
}  // namespace backend

namespace detail {
/// Whether FeedForward kernels K fuse the feed-forward with the sums and norms around it
/// (forward_sums, with a Norm of theirs: CUDA's).
template <class K, class T>
concept FeedForwardSums = requires(const FeedForwardConfig& c, const typename K::Prepared& p,
                                   typename K::Norm n, View<const T> a, View<T> v) {
    K::forward_sums(c, p, n, a, v, v, v, n, v);
};
}  // namespace detail

/// The position-wise feed-forward sub-block of a Titans block (math §7), row-wise on tokens:
///
///     SwiGLU:  y = (silu(x W1) ⊙ (x W3)) W2,     silu(z) = z σ(z)
///     GELU:    y = gelu(x W1) W2,                 gelu(z) = z Φ(z)   (exact, erf-based)
///
/// Shapes: forward takes any rows x d matrix (e.g. (B*N) x d) and returns rows x d; the hidden
/// activations are rows x hidden_dim().
///
///     titans::FeedForwardConfig cfg{.d_model = 64};                       // SwiGLU, h = 176
///     titans::FeedForward<float> ff(cfg, titans::FeedForwardParams<float>::random(cfg, 3));
///     titans::Matrixf y = ff.forward(x);                                  // x: N x 64
///
/// Training (math §9): forward(x, y, trace) keeps what backward needs; backward(trace, dy, dx,
/// grads) writes dL/dx and adds dL/dW to grads, a FeedForwardParams of the same shapes (start
/// from FeedForwardParams<T>::zeros(cfg); gradients of several calls sum).
///
/// Immutable after construction (safe to share between threads).
template <class T, class Backend>
class FeedForward {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::FeedForward: T must be float or double");
    static_assert(backend::FeedForwardBackend<Backend, T>,
                  "titans::FeedForward: Backend does not satisfy titans::backend::FeedForwardBackend");
    using Kernels = backend::FeedForwardKernels<Backend, T>;
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;

public:
    using Scalar = T;

    /// What the training forward keeps for backward, in the backend's memory: the input rows
    /// and the pre-activations x W1 and (SwiGLU) x W3, and the configuration of the layer that
    /// made it. Empty until forward(x, y, trace), and again once moved from.
    class Trace {
    public:
        [[nodiscard]] bool empty() const { return !filled_; }
        [[nodiscard]] Eigen::Index rows() const { return rows_; }

    private:
        friend class FeedForward;
        Buffer x_{}, a_{}, g_{};
        Eigen::Index rows_ = 0, cols_ = 0;
        FeedForwardConfig cfg_{};
        detail::TraceFilled filled_;
    };

    /// Validates both (ConfigError, ShapeError, NonFiniteError) and keeps them.
    FeedForward(FeedForwardConfig config, FeedForwardParams<T> params)
        : FeedForward(std::move(config),
                      std::make_shared<const FeedForwardParams<T>>(std::move(params))) {}

    /// Shares `params` (not copied; ConfigError if null), as NeuralMemory does.
    FeedForward(FeedForwardConfig config, std::shared_ptr<const FeedForwardParams<T>> params)
        : cfg_(std::move(config)),
          params_(detail::require_shared(std::move(params), "FeedForward")) {
        cfg_.validate_for<T>();
        params_->validate(cfg_);
        prepared_ = Kernels::prepare(cfg_, params_);
    }

    [[nodiscard]] const FeedForwardConfig& config() const { return cfg_; }
    [[nodiscard]] const FeedForwardParams<T>& params() const { return *params_; }
    /// The parameters as this layer's kernels hold them (on the CPU the host tensors).
    using Prepared = typename Kernels::Prepared;
    /// As NeuralMemory::prepare_flat: from w1 (w3 for SwiGLU), w2 flat in the backend's
    /// memory, copied there; ShapeError unless flat is 1 x their count.
    [[nodiscard]] Prepared prepare_flat(View<const T> flat) const
        requires requires(const FeedForwardConfig& c, const FeedForwardParams<T>& s,
                          View<const T> f) { Kernels::prepare_flat(c, s, f); }
    {
        detail::check_flat_params("FeedForward::prepare_flat", flat,
                                  detail::flat_size(*params_, cfg_));
        return Kernels::prepare_flat(cfg_, *params_, flat);
    }
    /// As NeuralMemory::adopt.
    void adopt(Prepared p) noexcept { prepared_ = std::move(p); }
    /// The parameters as held (shared with the block that owns them, if any).
    [[nodiscard]] const std::shared_ptr<const FeedForwardParams<T>>& shared_params() const {
        return params_;
    }

    /// x: rows x d -> rows x d. Throws ShapeError (width), NonFiniteError (NaN / inf in x).
    [[nodiscard]] Matrix<T> forward(const MatrixRef<T>& x) const {
        Matrix<T> y;
        forward(x, y);
        return y;
    }

    /// As above, writing into `y` (resized; must not be `x`).
    void forward(const MatrixRef<T>& x, Matrix<T>& y) const {
        check_input(x, y);
        const backend::Upload<Backend, T> in(x);
        backend::Download<Backend, T> out(y, x.rows(), cfg_.d_model);
        forward(in.view(), out.view());
        out.finish();
    }

    /// The backend-level forward: x and y are rows x d views in the backend's memory (device
    /// memory on a GPU), distinct. Shapes are checked (ShapeError); finiteness is the
    /// caller's. How a block runs the feed-forward without a round trip through the host.
    void forward(View<const T> x, View<T> y) const {
        detail::check_view_call("FeedForward::forward", x, y, cfg_.d_model, false);
        Kernels::forward(cfg_, prepared_, x, y);
    }

    /// A block's feed-forward with the residual sums and norms around it, where the backend
    /// has it (CUDA): s = a + s, u = pre.RMSNorm(s), y = FFN(u), s = y + s, u_next =
    /// next.RMSNorm(s); views in the backend's memory of one shape, all distinct. The same bits
    /// as pre.forward_sum(a, s, u), forward(u, y), next.forward_sum(y, s, u_next); for a decode
    /// token's few rows with the fused feed-forward (CUDA's set_fused_feed_forward) one launch
    /// instead of three. Inside a deferring call scope a sum that is not finite raises the
    /// scope's flag. ShapeError if a width is not d or two views share storage.
    void forward_sums(const RMSNorm<T, Backend>& pre, View<const T> a, View<T> s, View<T> u,
                      View<T> y, const RMSNorm<T, Backend>& next, View<T> u_next) const
        requires detail::FeedForwardSums<Kernels, T>
    {
        constexpr const char* where = "FeedForward::forward_sums";
        for (const auto* n : {&pre, &next}) {
            detail::require<ShapeError>(n->dim() == cfg_.d_model, where, "a norm's dim()",
                                        n->dim(), detail::concat("d_model = ", cfg_.d_model));
        }
        const View<const T> in[] = {a, s, u, y};
        const View<T> out[] = {s, u, y, u_next};
        for (std::size_t i = 0; i < 4; ++i) {
            for (std::size_t j = i; j < 4; ++j) {
                detail::check_view_call(where, in[i], out[j], cfg_.d_model, false);
            }
        }
        Kernels::forward_sums(cfg_, prepared_, {pre.prepared(), static_cast<T>(pre.eps())}, a, s,
                              u, y, {next.prepared(), static_cast<T>(next.eps())}, u_next);
    }

    /// The training forward: as forward(x, y), and keeps in `trace` (replacing what it held)
    /// what backward needs. On an error neither y nor trace changes.
    void forward(const MatrixRef<T>& x, Matrix<T>& y, Trace& trace) const {
        check_input(x, y);
        const backend::Upload<Backend, T> in(x);
        Matrix<T> y_new;
        backend::Download<Backend, T> out(y_new, x.rows(), cfg_.d_model);
        Trace t;
        forward_train(in.view(), out.view(), t);
        out.finish();
        y = std::move(y_new);
        trace = std::move(t);
    }

    /// The backend-level training forward: forward(x, y, trace) on views in the backend's
    /// memory, x and y rows x d, distinct (the trace keeps its own copy of x). Shapes are
    /// checked (ShapeError); finiteness is the caller's. On an error the trace is unchanged.
    void forward(View<const T> x, View<T> y, Trace& trace) const {
        detail::check_view_call("FeedForward::forward", x, y, cfg_.d_model, false);
        Trace t;
        forward_train(x, y, t);
        trace = std::move(t);
    }

    /// The backward pass (math §9): dy = dL/dy (the trace's rows x d) gives dx = dL/dx
    /// (resized; not sharing dy's storage), and dL/dW1, dL/dW3 (SwiGLU), dL/dW2 are added to
    /// grads (shaped as params()). Throws ShapeError (empty or moved-from trace, one of another
    /// width, shapes), ConfigError (a trace of another configuration: kind, hidden),
    /// NonFiniteError (in dy or grads); nothing changes then.
    void backward(const Trace& trace, const MatrixRef<T>& dy, Matrix<T>& dx,
                  FeedForwardParams<T>& grads) const {
        constexpr const char* where = "FeedForward::backward";
        validate_trace(trace, where);
        detail::check_gradient_rows(dy, trace.rows_, cfg_.d_model, where, "dy");
        const bool swiglu = cfg_.kind == FeedForwardKind::SwiGLU;
        const Eigen::Index d = cfg_.d_model, h = cfg_.hidden_dim();
        const detail::TensorCheck check{where};
        check(grads.w1, "grads.w1", d, h);
        if (swiglu) check(grads.w3, "grads.w3", d, h);
        check(grads.w2, "grads.w2", h, d);
        if (detail::overlaps(dy, dx)) {
            throw ShapeError(detail::concat(where, ": dx shares storage with dy, expected a "
                                                   "distinct matrix"));
        }
        const backend::Upload<Backend, T> in(dy);
        backend::Download<Backend, T> out(dx, dy.rows(), d);
        backend::Update<Backend, T> g1(view_of(grads.w1)), g2(view_of(grads.w2));
        std::optional<backend::Update<Backend, T>> g3;
        if (swiglu) g3.emplace(view_of(grads.w3));
        backward_checked(trace, in.view(), out.view(), g1.view(),
                         g3 ? g3->view() : View<T>{}, g2.view());
        g1.finish();
        g2.finish();
        if (g3) g3->finish();
        out.finish();
    }

    /// The backend-level backward: backward(trace, dy, dx, grads) with dy and dx views in the
    /// backend's memory (the trace's rows x d, distinct) and grads this layer's gradients flat
    /// there (1 x parameter_count(): W1, W3 (SwiGLU), W2 row-major one after the other, as
    /// tensors() visits them; a slice of a gradient buffer), added to. Shapes are checked
    /// (ShapeError, ConfigError as backward); the finiteness of dy is the caller's.
    void backward(const Trace& trace, View<const T> dy, View<T> dx, View<T> grads) const {
        constexpr const char* where = "FeedForward::backward";
        validate_trace(trace, where);
        detail::check_view_gradient(where, dy, dx, cfg_.d_model, trace.rows_);
        detail::check_flat_gradient(where, grads, parameter_count(), "W1, W3, W2");
        const auto g = detail::flat_views(grads, *params_, cfg_);
        const bool swiglu = cfg_.kind == FeedForwardKind::SwiGLU;
        backward_checked(trace, dy, dx, g[0], swiglu ? g[1] : View<T>{}, g.back());
    }

    /// Entries of the parameters (W1, W3 for SwiGLU, W2): the length of a flat gradient.
    [[nodiscard]] Eigen::Index parameter_count() const {
        return detail::flat_size(*params_, cfg_);
    }

    /// Throws unless `trace` was filled by the training forward of a feed-forward of this
    /// width (ShapeError: empty, moved-from or another width) and configuration (ConfigError
    /// naming the first differing setting). `where` names the call in the message.
    void validate_trace(const Trace& trace,
                        const char* where = "FeedForward::validate_trace") const {
        detail::check_trace(trace.filled_, trace.cols_, cfg_.d_model, where);
        detail::check_trace_config(trace.cfg_, cfg_, where, "a feed-forward");
    }

private:
    static View<const T> cview(const Buffer& b) { return Transfer::view(b); }

    /// The training forward on checked views: x copied into the trace, a = x W1 and (SwiGLU)
    /// g = x W3 kept.
    void forward_train(View<const T> x, View<T> y, Trace& t) const {
        const Eigen::Index h = cfg_.hidden_dim();
        const bool swiglu = cfg_.kind == FeedForwardKind::SwiGLU;
        t.x_ = Transfer::allocate(x.rows, x.cols);
        backend::GlueKernels<Backend, T>::copy(x, Transfer::view(t.x_));
        t.a_ = Transfer::allocate(x.rows, h);
        t.g_ = Transfer::allocate(swiglu ? x.rows : 0, swiglu ? h : 0);
        t.rows_ = x.rows;
        t.cols_ = x.cols;
        t.cfg_ = cfg_;
        t.filled_ = true;
        Kernels::forward_train(cfg_, prepared_, cview(t.x_), y, Transfer::view(t.a_),
                               Transfer::view(t.g_));
    }

    /// The backward on checked views; the weights' gradients added to dw1, dw3 (SwiGLU; empty
    /// otherwise), dw2, in the backend's memory.
    void backward_checked(const Trace& trace, View<const T> dy, View<T> dx, View<T> dw1,
                          View<T> dw3, View<T> dw2) const {
        Kernels::backward(cfg_, prepared_, cview(trace.x_), cview(trace.a_), cview(trace.g_),
                          dy, dx, dw1, dw3, dw2);
    }

    void check_input(const MatrixRef<T>& x, const Matrix<T>& y) const {
        constexpr const char* where = "FeedForward::forward";
        if (x.cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", x.cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (!detail::all_finite(x)) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
        if (detail::overlaps(x, y)) {
            throw ShapeError(detail::concat(where, ": y shares storage with x, expected a "
                                                   "distinct matrix"));
        }
    }

    FeedForwardConfig cfg_;
    std::shared_ptr<const FeedForwardParams<T>> params_;  // the host copy
    typename Kernels::Prepared prepared_{};              // the backend's (the CPU's: params_)
};

}  // namespace titans
