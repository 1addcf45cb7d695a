#pragma once
// titans/layers/rms_norm.hpp: RMSNorm<T>, the pre-normalisation of every Titans block (math §7).

#include <algorithm>
#include <concepts>
#include <cmath>
#include <memory>
#include <type_traits>
#include <utility>

#include "../detail/float_env.hpp"
#include "../backend/backend.hpp"
#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/shared.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../types.hpp"
#include "kernels_decl.hpp"

namespace titans {

namespace backend {
/// What NormKernels<B, T> must provide for RMSNorm<T, B>, with x, y, dx rows x d views in
/// the backend's memory (outputs sized; y may be x itself):
///   Prepared, prepare(weight)     the weight as the kernel uses it, from the host weight
///   forward(prepared, eps, x, y)
///   forward_train(prepared, eps, x, y, inv_rms)
///                                 forward, also writing each row's 1 / rms (rows x 1)
///   backward(prepared, x, inv_rms, dy, dx, dweight)
///                                 dx from dy; dL/dweight (1 x d) added to dweight
template <class B, class T>
concept NormBackend = requires(const std::shared_ptr<const RowVector<T>>& w,
                               const typename NormKernels<B, T>::Prepared& p, T eps,
                               View<const T> x, View<T> y) {
    typename NormKernels<B, T>::Prepared;
    { NormKernels<B, T>::prepare(w) } -> std::same_as<typename NormKernels<B, T>::Prepared>;
    NormKernels<B, T>::forward(p, eps, x, y);
    NormKernels<B, T>::forward_train(p, eps, x, y, y);
    NormKernels<B, T>::backward(p, x, x, x, y, y);
};
}  // namespace backend

/// Root-mean-square normalisation of each row (token) with a learnable per-channel weight
/// (math §7: pre-normalisation of every block, and RMSNorm_y / RMSNorm_m of MAG):
///
///     y = x / sqrt(mean_j(x_j^2) + eps) ⊙ weight,     x, y, weight: 1 x d
///
/// No mean subtraction and no bias (Zhang & Sennrich, 2019). Shapes: forward takes any
/// rows x d matrix (e.g. (B*N) x d) and returns rows x d. Right for every finite row, even one
/// whose sum of squares overflows T (it is normalised scaled by a power of two); a row of
/// zeros gives zeros (and dL/dx = dL/dy ⊙ weight / sqrt(eps)).
///
///     titans::RMSNorm<float> norm(64);             // weight = 1, eps = 1e-6
///     titans::Matrixf y = norm.forward(x);         // x: N x 64
///
/// Training (math §9): forward(x, y, trace) keeps what backward needs; backward(trace, dy, dx,
/// grad) writes dL/dx and adds dL/dweight to grad (so gradients of several calls sum):
///
///     titans::RMSNorm<double>::Trace trace;
///     norm.forward(x, y, trace);
///     titans::RowVectord grad = titans::RowVectord::Zero(64);
///     norm.backward(trace, dy, dx, grad);          // dy = dL/dy, N x 64
template <class T, class Backend>
class RMSNorm {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::RMSNorm: T must be float or double");
    static_assert(backend::NormBackend<Backend, T>,
                  "titans::RMSNorm: Backend does not satisfy titans::backend::NormBackend");
    using Kernels = backend::NormKernels<Backend, T>;

    using Buffer = typename backend::Transfer<Backend, T>::Buffer;

public:
    using Scalar = T;

    /// What the training forward keeps for backward, in the backend's memory: the input rows
    /// and each row's 1 / rms, and what identifies the norm that made it (width, eps). Empty
    /// until forward(x, y, trace) fills it, and again once moved from.
    class Trace {
    public:
        [[nodiscard]] bool empty() const { return !filled_; }
        [[nodiscard]] Eigen::Index rows() const { return rows_; }

    private:
        friend class RMSNorm;
        Buffer x_{}, inv_rms_{};
        Eigen::Index rows_ = 0, cols_ = 0;
        double eps_ = 0;
        detail::TraceFilled filled_;
    };

    /// Width d in [1, limits::max_d_model], weight initialised to ones, eps > 0 and
    /// representable in T (ConfigError otherwise, before anything is allocated).
    explicit RMSNorm(int d_model, double eps = 1e-6)
        : RMSNorm(std::make_shared<const RowVector<T>>(
                      RowVector<T>::Ones(checked_width(d_model, eps))),
                  eps) {}

    /// With a given weight (1 x d, d >= 1, finite).
    explicit RMSNorm(RowVector<T> weight, double eps = 1e-6)
        : RMSNorm(std::make_shared<const RowVector<T>>(std::move(weight)), eps) {}

    /// Shares `weight` (not copied; ConfigError if null): how a block's norms refer to the
    /// block's parameters.
    explicit RMSNorm(std::shared_ptr<const RowVector<T>> weight, double eps = 1e-6)
        : weight_(detail::require_shared(std::move(weight), "RMSNorm")), eps_(eps) {
        detail::require<ShapeError>(weight_->cols() >= 1, "RMSNorm", "weight.cols()",
                                    weight_->cols(), ">= 1");
        check_weight(*weight_);
        check_eps(eps_);
        prepared_ = Kernels::prepare(weight_);
    }

    [[nodiscard]] int dim() const { return static_cast<int>(weight_->cols()); }
    [[nodiscard]] double eps() const { return eps_; }
    /// The learnable per-channel weight, 1 x d.
    [[nodiscard]] const RowVector<T>& weight() const { return *weight_; }
    /// The parameters as this layer's kernels hold them (on the CPU the host tensors).
    using Prepared = typename Kernels::Prepared;
    /// As NeuralMemory::prepare_flat: from the values flat in the backend's memory (the weight's
    /// order), copied there; ShapeError unless flat is 1 x their count.
    [[nodiscard]] Prepared prepare_flat(View<const T> flat) const
        requires requires(View<const T> f) { Kernels::prepare_flat(f); }
    {
        detail::check_flat_params("RMSNorm::prepare_flat", flat, weight_->cols());
        return Kernels::prepare_flat(flat);
    }
    /// As NeuralMemory::adopt.
    void adopt(Prepared p) noexcept { prepared_ = std::move(p); }
    /// The weight as this layer's kernels hold it: for a kernel that ends with this norm
    /// (FeedForward::forward_sum).
    [[nodiscard]] const Prepared& prepared() const noexcept { return prepared_; }
    /// Replaces the weight (same width d, finite). A shared weight is not modified: this norm
    /// then holds its own.
    void set_weight(RowVector<T> weight) {
        detail::require<ShapeError>(weight.cols() == weight_->cols(), "RMSNorm::set_weight",
                                    "weight.cols()", weight.cols(),
                                    detail::concat("d = ", weight_->cols()));
        check_weight(weight);
        weight_ = std::make_shared<const RowVector<T>>(std::move(weight));
        prepared_ = Kernels::prepare(weight_);
    }

    /// x: rows x d -> rows x d. Throws ShapeError (width), NonFiniteError (NaN / inf in x).
    [[nodiscard]] Matrix<T> forward(const MatrixRef<T>& x) const {
        Matrix<T> y;
        forward(x, y);
        return y;
    }

    /// As above, writing into `y` (resized; `y` may be `x` itself, but not share part of its
    /// storage otherwise).
    void forward(const MatrixRef<T>& x, Matrix<T>& y) const {
        check_input(x, y, "RMSNorm::forward");
        const backend::Upload<Backend, T> in(x);
        backend::Download<Backend, T> out(y, x.rows(), x.cols());  // no-op in place
        forward(in.view(), out.view());
        out.finish();
    }

    /// The backend-level forward: x and y are views in the backend's memory (device memory
    /// on a GPU), y of x's shape (y may be x itself, not part of it). Shapes are checked
    /// (ShapeError); finiteness is the caller's. How a block runs the norm between its layers
    /// without a round trip through the host.
    void forward(View<const T> x, View<T> y) const {
        detail::check_view_call("RMSNorm::forward", x, y, weight_->cols(), true);
        Kernels::forward(prepared_, static_cast<T>(eps_), x, y);
    }

    /// A residual sum and its norm in one pass, where the backend has it (CUDA): s = a + s,
    /// then y = RMSNorm(s), views in the backend's memory of one shape (a may be s; y distinct
    /// from both). How a block takes its mixer's residual sum and the feed-forward's pre-norm
    /// at once; the same bits as Glue::add(a, s, s) followed by forward(s, y). Inside a
    /// deferring call scope (CUDA's) a sum that is not finite raises the scope's flag: s's
    /// finiteness check, deferred, in the same kernel.
    void forward_sum(View<const T> a, View<T> s, View<T> y) const
        requires requires(const Prepared& p) { Kernels::forward_sum(p, T(0), a, s, y); }
    {
        detail::check_view_call("RMSNorm::forward_sum", a, s, weight_->cols(), true);
        detail::check_view_call("RMSNorm::forward_sum", View<const T>(s), y, weight_->cols(),
                                false);
        detail::check_view_call("RMSNorm::forward_sum", a, y, weight_->cols(), false);
        Kernels::forward_sum(prepared_, static_cast<T>(eps_), a, s, y);
    }

    /// MAG's output in one pass, where the backend has it (CUDA): o = RMSNorm(o) ⊙
    /// σ(gate_norm.RMSNorm(m)), views in the backend's memory of one shape (m distinct from o,
    /// left as it was); the same bits as gate_norm.forward(m, m), forward(o, o) and
    /// Glue::gate(o, m, o). Inside a deferring call scope (CUDA's) an entry of o or m that is
    /// not finite raises the scope's flag. ShapeError if gate_norm's width is not this norm's.
    void forward_gated(const RMSNorm& gate_norm, View<T> o, View<const T> m) const
        requires requires(const Prepared& p) {
            Kernels::forward_gated(p, T(0), p, T(0), o, m);
        }
    {
        detail::require<ShapeError>(gate_norm.dim() == dim(), "RMSNorm::forward_gated",
                                    "gate_norm.dim()", gate_norm.dim(),
                                    detail::concat("this norm's d = ", dim()));
        detail::check_view_call("RMSNorm::forward_gated", m, o, weight_->cols(), false);
        Kernels::forward_gated(prepared_, static_cast<T>(eps_), gate_norm.prepared_,
                               static_cast<T>(gate_norm.eps_), o, m);
    }

    /// The training forward: as forward(x, y), and keeps in `trace` (replacing what it held)
    /// what backward needs. On an error neither y nor trace changes.
    void forward(const MatrixRef<T>& x, Matrix<T>& y, Trace& trace) const {
        check_input(x, y, "RMSNorm::forward");
        const backend::Upload<Backend, T> in(x);
        Matrix<T> out_host;
        backend::Download<Backend, T> out(out_host, x.rows(), x.cols());
        Trace t;
        forward_train(in.view(), out.view(), t);
        out.finish();
        y = std::move(out_host);
        trace = std::move(t);
    }

    /// The backend-level training forward: forward(x, y, trace) on views in the backend's
    /// memory, y of x's shape and distinct (the trace keeps its own copy of x). Shapes are
    /// checked (ShapeError); finiteness is the caller's. On an error the trace is unchanged.
    void forward(View<const T> x, View<T> y, Trace& trace) const {
        detail::check_view_call("RMSNorm::forward", x, y, weight_->cols(), false);
        Trace t;
        forward_train(x, y, t);
        trace = std::move(t);
    }

    /// The backward pass (math §9): dy = dL/dy (the trace's rows x d) gives dx = dL/dx
    /// (resized; not sharing dy's storage), and dL/dweight is added to grad_weight (1 x d).
    /// Throws ShapeError (empty or moved-from trace, one of another width, shapes),
    /// ConfigError (a trace of a norm with another eps), NonFiniteError (in dy); nothing
    /// changes then.
    void backward(const Trace& trace, const MatrixRef<T>& dy, Matrix<T>& dx,
                  RowVector<T>& grad_weight) const {
        constexpr const char* where = "RMSNorm::backward";
        validate_trace(trace, where);
        detail::check_gradient_rows(dy, trace.rows_, weight_->cols(), where, "dy");
        detail::TensorCheck{where}(grad_weight, "grad_weight", 1, weight_->cols());
        if (detail::overlaps(dy, dx)) {
            throw ShapeError(detail::concat(where, ": dx shares storage with dy, expected a "
                                                   "distinct matrix"));
        }
        const backend::Upload<Backend, T> in(dy);
        backend::Download<Backend, T> out(dx, dy.rows(), dy.cols());
        backend::Update<Backend, T> grad(view_of(grad_weight));
        backward_checked(trace, in.view(), out.view(), grad.view());
        grad.finish();
        out.finish();
    }

    /// The backend-level backward: backward(trace, dy, dx, grad_weight) with dy and dx views
    /// in the backend's memory (the trace's rows x d, distinct) and grad_weight a 1 x d view
    /// there (a slice of a gradient buffer), added to. Shapes are checked (ShapeError,
    /// ConfigError as backward); dy's finiteness is the caller's.
    void backward(const Trace& trace, View<const T> dy, View<T> dx, View<T> grad_weight) const {
        constexpr const char* where = "RMSNorm::backward";
        validate_trace(trace, where);
        detail::check_view_gradient(where, dy, dx, weight_->cols(), trace.rows_);
        detail::check_flat_gradient(where, grad_weight, weight_->cols(), "the weight's");
        backward_checked(trace, dy, dx, grad_weight);
    }

    /// Throws unless `trace` was filled by the training forward of a norm of this width
    /// (ShapeError: empty, moved-from or another width) and eps (ConfigError). `where` names
    /// the call in the message.
    void validate_trace(const Trace& trace, const char* where = "RMSNorm::validate_trace") const {
        detail::check_trace(trace.filled_, trace.cols_, weight_->cols(), where);
        if (trace.eps_ != eps_) {
            throw ConfigError(detail::concat(
                where, ": trace was made by an RMSNorm of another configuration (eps = ",
                detail::setting_text(trace.eps_), ", expected ", detail::setting_text(eps_), ")"));
        }
    }

private:
    static View<const T> view(const Buffer& b) { return backend::Transfer<Backend, T>::view(b); }

    /// The training forward on checked views: x copied into the trace, 1 / rms kept.
    void forward_train(View<const T> x, View<T> y, Trace& t) const {
        using Transfer = backend::Transfer<Backend, T>;
        t.x_ = Transfer::allocate(x.rows, x.cols);
        backend::GlueKernels<Backend, T>::copy(x, Transfer::view(t.x_));
        t.inv_rms_ = Transfer::allocate(x.rows, 1);
        t.rows_ = x.rows;
        t.cols_ = x.cols;
        t.eps_ = eps_;
        t.filled_ = true;
        Kernels::forward_train(prepared_, static_cast<T>(eps_), view(t.x_), y,
                               Transfer::view(t.inv_rms_));
    }

    /// The backward on checked views; the weight's gradient added to grad (1 x d, in the
    /// backend's memory).
    void backward_checked(const Trace& trace, View<const T> dy, View<T> dx, View<T> grad) const {
        Kernels::backward(prepared_, view(trace.x_), view(trace.inv_rms_), dy, dx, grad);
    }

    void check_input(const MatrixRef<T>& x, const Matrix<T>& y, const char* where) const {
        const bool in_place = x.data() == y.data() && x.rows() == y.rows() &&
                              x.cols() == y.cols() && x.outerStride() == y.outerStride();
        if (!in_place && detail::overlaps(x, y)) {
            throw ShapeError(detail::concat(where, ": y shares part of x's storage, expected x "
                                                   "itself or a distinct matrix"));
        }
        if (x.cols() != weight_->cols()) {
            throw ShapeError(detail::concat(where, ": x has ", x.cols(), " columns, expected d = ",
                                            weight_->cols()));
        }
        if (!detail::all_finite(x)) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
    }

    static int checked_width(int d_model, double eps) {
        detail::require_in_range(d_model, 1, limits::max_d_model, "RMSNorm", "d_model");
        check_eps(eps);
        return d_model;
    }
    /// eps > 0, finite, and representable in T: an eps that rounds to 0 (1e-50 in float) or to
    /// infinity would divide by zero or zero the output.
    static void check_eps(double eps) {
        detail::require<ConfigError>(std::isfinite(eps) && eps > 0, "RMSNorm", "eps", eps,
                                     "a finite value > 0");
        detail::require_representable<T>(eps, "RMSNorm", "eps");
    }
    static void check_weight(const RowVector<T>& w) {
        if (!detail::all_finite(w)) {
            throw NonFiniteError("RMSNorm: weight has a NaN or infinite entry");
        }
    }

    std::shared_ptr<const RowVector<T>> weight_;  // the host copy
    typename Kernels::Prepared prepared_{};       // the backend's (the CPU's: weight_ itself)
    double eps_;
};

}  // namespace titans
