#pragma once
// titans/attention/attention.hpp: exact multi-head softmax attention with an always-visible
// prefix and a causal sliding window (math §6-7), tiled so that work and memory are linear in
// the sequence length for a fixed window and prefix.
//
//   AttentionConfig            d_model, heads, window, RoPE settings
//   AttentionParams<T>         w_q, w_k, w_v (d x D), w_o (D x d)
//   prefix_window_attention    the core primitive on projected q/k/v, used by every composition
//   AttentionState<T>          per-sequence history (last w-1 keys/values) of a stream batch
//   Attention<T, Backend>      the layer: projections, RoPE, streaming, output projection, on
//                              AttentionKernels<Backend, T> (CPU: backend/cpu/attention_kernels.hpp)
//
// The masks of math §7 are all instances of one rule. Query i of a piece sits at position
// t = first_query + i of the sequence keys and sees
//     every prefix row (persistent tokens P, MAC's retrieved memory h_t, ...)    and
//     sequence keys j with t - w < j <= t (itself and the w - 1 before it).
// MAG/MAL: prefix = P, window w. MAC: prefix = P ‖ h_t, window >= C (causal inside a segment).
//
// The parts: config.hpp, params.hpp, kernel.hpp (prefix_window_attention), state.hpp; this file
// holds the layer.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "../backend/backend.hpp"
#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/float_env.hpp"
#include "../detail/shared.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../threads.hpp"
#include "../detail/tensor_slots.hpp"
#include "../types.hpp"
#include "config.hpp"
#include "segment.hpp"
#include "segment_backward.hpp"
#include "segment_check.hpp"
#include "kernel.hpp"
#include "params.hpp"
#include "rope.hpp"
#include "prefix.hpp"
#include "state_gradient.hpp"
#include "kernels_decl.hpp"

namespace titans {

namespace backend {

/// What AttentionKernels<B, T> must provide for Attention<T, B> to run on it:
///   Prepared                        the parameters as the kernels use them, made once per object
///   prepare(cfg, params)            Prepared from the host parameters (a shared_ptr)
///   State                           a stream batch's window (last w - 1 keys and values) and
///                                   position, with batch(), position(), config(), well_formed()
///                                   readable on the host and State::tensors(state, visitor)
///                                   (the checkpoint hook; a device state transfers through it)
///   make_state(cfg, B)              a fresh state for B sequences
///   Prefix                          projected prefix keys/values owned by the backend, with
///                                   rows(), sharing and view() (a PrefixView<T>)
///   project_prefix(cfg, p, P, sharing)   P W_K and P W_V of rows P (checked; a view)
///   forward(cfg, p, state, x, y, prefix)  math §6-7 over a piece: x (B*N) x d in, y out
///                                   (sized), views in the backend's memory; prefix optional
///                                   (a const PrefixView<T>*, nullptr for none: a projected
///                                   Prefix's view() or the caller's own projections); throws
///                                   NonFiniteError with the state unchanged
///   begin(state) -> bool, commit(state), rollback(state)   transactions, as MemoryBackend's
/// The backward pass of the family (training) will add its members here.
template <class B, class T>
concept AttentionBackend = requires(
    const AttentionConfig& cfg, const std::shared_ptr<const AttentionParams<T>>& hp,
    const typename AttentionKernels<B, T>::Prepared& p, typename AttentionKernels<B, T>::State& s,
    const typename AttentionKernels<B, T>::State& cs,
    const typename AttentionKernels<B, T>::Prefix& pre, View<const T> x, View<T> y,
    const PrefixView<T>& pv, PrefixSharing sharing, int i) {
    typename AttentionKernels<B, T>::Prepared;
    typename AttentionKernels<B, T>::State;
    typename AttentionKernels<B, T>::Prefix;
    { AttentionKernels<B, T>::prepare(cfg, hp) } ->
        std::same_as<typename AttentionKernels<B, T>::Prepared>;
    { AttentionKernels<B, T>::make_state(cfg, i) } ->
        std::same_as<typename AttentionKernels<B, T>::State>;
    { AttentionKernels<B, T>::project_prefix(cfg, p, x, sharing) } ->
        std::same_as<typename AttentionKernels<B, T>::Prefix>;
    AttentionKernels<B, T>::forward(cfg, p, s, x, y, &pv);
    { AttentionKernels<B, T>::begin(s) } -> std::convertible_to<bool>;
    AttentionKernels<B, T>::commit(s);
    AttentionKernels<B, T>::rollback(s);
    { pre.rows() } -> std::convertible_to<Eigen::Index>;
    { pre.sharing } -> std::convertible_to<PrefixSharing>;
    { pre.view() } -> std::same_as<PrefixView<T>>;
    { cs.batch() } -> std::convertible_to<int>;
    { cs.position() } -> std::convertible_to<std::int64_t>;
    { cs.config() } -> std::convertible_to<const AttentionConfig&>;
    { cs.well_formed() } -> std::convertible_to<bool>;
};

}  // namespace backend

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
/// The math runs on AttentionKernels<Backend, T> (concept backend::AttentionBackend); this class
/// checks arguments, owns the parameters (shared) and their prepared form, and sets threads.
///
///     titans::AttentionConfig cfg{.d_model = 64, .n_heads = 4, .window = 32, .rope = true};
///     titans::Attention<float> attn(cfg, titans::AttentionParams<float>::random(cfg, 7));
///     auto state = attn.make_state(1);
///     titans::Matrixf y = attn.forward(state, x, &persistent.tokens());  // x: N x 64
///
/// Thread safety: an Attention is immutable after construction; distinct states may be used
/// from distinct threads concurrently.
template <class T, class Backend>
class Attention {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::Attention: T must be float or double");
    using Kernels = backend::AttentionKernels<Backend, T>;

public:
    using Scalar = T;
    using State = typename Kernels::State;
    /// A prefix projected once (project_prefix), on the backend.
    using Prefix = typename Kernels::Prefix;

    /// Validates both (ConfigError, ShapeError, NonFiniteError) and keeps them.
    Attention(AttentionConfig config, AttentionParams<T> params)
        : Attention(std::move(config),
                    std::make_shared<const AttentionParams<T>>(std::move(params))) {}

    /// Shares `params` (not copied; ConfigError if null), as NeuralMemory does.
    Attention(AttentionConfig config, std::shared_ptr<const AttentionParams<T>> params)
        : cfg_(std::move(config)), params_(detail::require_shared(std::move(params), "Attention")) {
        static_assert(backend::AttentionBackend<Backend, T>,
                      "titans::Attention: AttentionKernels<Backend, T> does not satisfy "
                      "backend::AttentionBackend");
        cfg_.validate_for<T>();
        params_->validate(cfg_);
        prepared_ = Kernels::prepare(cfg_, params_);
    }

    [[nodiscard]] const AttentionConfig& config() const { return cfg_; }
    [[nodiscard]] const AttentionParams<T>& params() const { return *params_; }
    /// The parameters as this layer's kernels hold them (on the CPU the host tensors).
    using Prepared = typename Kernels::Prepared;
    /// As NeuralMemory::prepare_flat: from W_Q, W_K, W_V, W_O flat in the backend's memory,
    /// copied there; ShapeError unless flat is 1 x their count.
    [[nodiscard]] Prepared prepare_flat(View<const T> flat) const
        requires requires(const AttentionConfig& c, const AttentionParams<T>& s,
                          View<const T> f) { Kernels::prepare_flat(c, s, f); }
    {
        const Eigen::Index n = detail::flat_size(*params_, cfg_);
        detail::check_flat_params("Attention::prepare_flat", flat, n);
        return Kernels::prepare_flat(cfg_, *params_, flat);
    }
    /// As NeuralMemory::adopt.
    void adopt(Prepared p) noexcept { prepared_ = std::move(p); }
    /// The parameters as the kernels hold them now (project_prefix(prepared(), rows)).
    [[nodiscard]] const Prepared& prepared() const { return prepared_; }
    /// The parameters as held (shared with the block that owns them, if any).
    [[nodiscard]] const std::shared_ptr<const AttentionParams<T>>& shared_params() const {
        return params_;
    }

    /// A fresh state for `batch` independent sequences: no history, position 0.
    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require_state_batch(
            "Attention::make_state", batch, detail::scalar_name<T>(),
            [&](std::int64_t b) { return cfg_.state_bytes(b, std::int64_t{sizeof(T)}); });
        return Kernels::make_state(cfg_, batch);
    }

    /// Projects a prefix once (P W_K, P W_V) for forward(state, x, y, prefix): p x d_model
    /// rows (Shared) or (B*p) x d_model (PerSequence). A fixed prefix (persistent tokens) then
    /// costs nothing per call.
    [[nodiscard]] Prefix project_prefix(const MatrixRef<T>& prefix,
                                        PrefixSharing sharing = PrefixSharing::Shared) const {
        check_prefix(prefix, "Attention::project_prefix");
        const backend::Upload<Backend, T> rows(prefix);
        return Kernels::project_prefix(cfg_, prepared_, rows.view(), sharing);
    }

    /// As project_prefix, from rows in the backend's memory (p x d_model, finite: the
    /// caller's check) with the parameters `with` (prepare_flat's of this layer): how a model
    /// projects its persistent tokens for new values before it adopts them.
    [[nodiscard]] Prefix project_prefix(const Prepared& with, View<const T> rows) const {
        detail::require<ShapeError>(rows.cols == cfg_.d_model, "Attention::project_prefix",
                                    "rows.cols", rows.cols,
                                    detail::concat(cfg_.d_model, " (d_model)"));
        return Kernels::project_prefix(cfg_, with, rows, PrefixSharing::Shared);
    }

    /// Processes the next piece of every stream. x: (B*N) x d_model with B = state.batch();
    /// prefix (optional): p x d_model (PrefixSharing::Shared) or (B*p) x d_model
    /// (PrefixSharing::PerSequence), visible to every query. Returns (B*N) x d_model.
    [[nodiscard]] Matrix<T> forward(State& state, const MatrixRef<T>& x,
                                    const Matrix<T>* prefix = nullptr,
                                    PrefixSharing sharing = PrefixSharing::Shared) const {
        Matrix<T> y;
        forward(state, x, y, prefix, sharing);
        return y;
    }

    /// As above, writing into `y` (resized to (B*N) x d_model; not sharing storage with an
    /// input).
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y, const Matrix<T>* prefix = nullptr,
                 PrefixSharing sharing = PrefixSharing::Shared) const {
        check_forward(state, x, y, prefix, sharing);
        const ThreadScope team(threads_, work_estimate(x.rows(), prefix ? prefix->rows() : 0));
        if (prefix == nullptr || prefix->rows() == 0) {
            run(state, x, y, nullptr);
            return;
        }
        const backend::Upload<Backend, T> rows(*prefix);
        const Prefix projected = Kernels::project_prefix(cfg_, prepared_, rows.view(), sharing);
        const PrefixView<T> view = projected.view();
        run(state, x, y, &view);
    }

    /// As forward with a prefix projected once by project_prefix (same outputs).
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y, const Prefix& prefix) const {
        constexpr const char* where = "Attention::forward";
        check_call(state, x, where);
        check_sharing(state, prefix.rows(), prefix.sharing, where);
        if (detail::overlaps(x, y)) {
            throw ShapeError("Attention::forward: y is also an input, expected a distinct matrix");
        }
        const ThreadScope team(threads_, work_estimate(x.rows(), prefix.rows()));
        const PrefixView<T> view = prefix.view();
        run(state, x, y, &view);
    }

    /// As forward with a prefix shared by every sequence whose projections the caller made:
    /// k_prefix = prefix W_K and v_prefix = prefix W_V (p x D each). Same outputs as with the
    /// prefix. On the CPU they are read in place (no copy); a device backend uploads them on
    /// every call, where project_prefix keeps a fixed prefix on the device once.
    void forward_projected(State& state, const MatrixRef<T>& x, Matrix<T>& y,
                           const Matrix<T>& k_prefix, const Matrix<T>& v_prefix) const {
        constexpr const char* where = "Attention::forward_projected";
        check_call(state, x, where);
        const Eigen::Index D = cfg_.inner_dim();
        detail::require<ShapeError>(k_prefix.cols() == D || k_prefix.rows() == 0, where,
                                    "k_prefix.cols()", k_prefix.cols(),
                                    detail::concat("n_heads * d_head = ", D));
        detail::require<ShapeError>(
            v_prefix.rows() == k_prefix.rows() && v_prefix.cols() == k_prefix.cols(), where,
            "v_prefix shape", detail::concat(v_prefix.rows(), " x ", v_prefix.cols()),
            detail::concat("k_prefix's ", k_prefix.rows(), " x ", k_prefix.cols()));
        if (!detail::all_finite(k_prefix) || !detail::all_finite(v_prefix)) {
            throw NonFiniteError(detail::concat(where, ": the prefix has a NaN or infinite entry"));
        }
        if (detail::overlaps(x, y) || detail::overlaps(k_prefix, y) ||
            detail::overlaps(v_prefix, y)) {
            throw ShapeError(detail::concat(where, ": y is also an input, expected a distinct matrix"));
        }
        const ThreadScope team(threads_, work_estimate(x.rows(), k_prefix.rows()));
        const backend::Upload<Backend, T> k(k_prefix), v(v_prefix);
        const PrefixView<T> view{k.view(), v.view(), PrefixSharing::Shared};
        run(state, x, y, k_prefix.rows() > 0 ? &view : nullptr);
    }

    /// What the training forward keeps for backward (math §9): the input, the prefix rows, the
    /// incoming position and the window's kept keys and values.
    using Trace = typename backend::AttentionTraining<Backend, T>::Trace;

    /// The training forward (math §9): forward(state, x, y, prefix, sharing) from any state (a
    /// fresh one, or one that has seen earlier pieces: see backward's d_state_in/d_state_out),
    /// keeping in `trace` what backward needs. Same outputs and state as forward; on an error
    /// nothing changes. Backends with a training pass only (the CPU, CUDA).
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y, Trace& trace,
                 const Matrix<T>* prefix = nullptr,
                 PrefixSharing sharing = PrefixSharing::Shared) const
        requires(backend::AttentionTraining<Backend, T>::available)
    {
        check_forward(state, x, y, prefix, sharing);
        Matrix<T> y_new;
        {
            const backend::Upload<Backend, T> in(x);
            std::optional<backend::Upload<Backend, T>> rows;
            if (prefix != nullptr) rows.emplace(*prefix);
            backend::Download<Backend, T> out(y_new, x.rows(), cfg_.d_model);
            train_checked(state, in.view(), out.view(), trace,
                          rows ? rows->view() : View<const T>{}, sharing);
            out.finish();
        }
        y = std::move(y_new);
    }

    /// The backend-level training forward: forward(state, x, y, trace, prefix, sharing) with x,
    /// y and the prefix rows views in the backend's memory (x, y (B*N) x d_model, distinct;
    /// prefix p x d_model or (B*p) x d_model as sharing says, 0 rows: none, copied into the
    /// trace there). Shapes, the state and the position are checked (ShapeError, ConfigError,
    /// OverflowError); finiteness of x and of the prefix is the caller's. On an error the state
    /// and trace are unchanged (y may have been written).
    void forward(State& state, View<const T> x, View<T> y, Trace& trace,
                 View<const T> prefix = {}, PrefixSharing sharing = PrefixSharing::Shared) const
        requires(backend::AttentionTraining<Backend, T>::available)
    {
        constexpr const char* where = "Attention::forward";
        check_rows(state, x.rows, x.cols, where);
        detail::check_view_call(where, x, y, cfg_.d_model, false);
        if (prefix.rows > 0) {
            detail::require<ShapeError>(prefix.cols == cfg_.d_model && prefix.stride >= prefix.cols,
                                        where, "prefix.cols()", prefix.cols,
                                        detail::concat(cfg_.d_model, " (d_model)"));
            check_sharing(state, prefix.rows, sharing, where);
        }
        train_checked(state, x, y, trace, prefix, sharing);
    }

    /// The backward pass (math §9) of a training forward: dy = dL/dy (the trace's rows x
    /// d_model) gives dx = dL/dx (resized), the gradients of W_Q, W_K, W_V, W_O added to grads
    /// (shaped as params(), e.g. AttentionParams<T>::zeros(config())) and, if `dprefix` is
    /// given and the forward had a prefix, dL/dprefix (resized to the prefix's shape).
    /// Through the output projection, the tiled kernel (softmax recomputed per tile), RoPE and
    /// the projections of x and of the prefix.
    ///
    /// Chained pieces (math §9): d_state_out, if given and not empty(), is dL/d(the window the
    /// call left: per sequence min(w - 1, position) x D keys and values); d_state_in, if given,
    /// receives dL/d(the window it started from), the incoming state's kept rows. Reversing
    /// pieces last first, each with the next one's d_state_in as its d_state_out, gives the dx
    /// and grads of one call over their concatenation.
    ///
    /// Throws ShapeError (empty or moved-from trace, one whose sizes are not its forward's,
    /// shapes, shared storage; d_state_out's shapes), ConfigError (another configuration's
    /// trace), NonFiniteError (dy, d_state_out); nothing changes then.
    void backward(const Trace& trace, const MatrixRef<T>& dy, Matrix<T>& dx,
                  AttentionParams<T>& grads, Matrix<T>* dprefix = nullptr,
                  AttentionStateGradient<T>* d_state_in = nullptr,
                  const AttentionStateGradient<T>* d_state_out = nullptr) const
        requires(backend::AttentionTraining<Backend, T>::available)
    {
        constexpr const char* where = "Attention::backward";
        check_backward(trace, dy, dx, grads, dprefix, where);
        using Transfer = backend::Transfer<Backend, T>;
        Matrix<T> dx_new, flat(1, parameter_count());
        detail::flatten_tensors(grads, cfg_, flat.data());  // grads go up, gain, come down
        const bool want_dp = dprefix != nullptr && trace.prefix.rows() > 0;
        Matrix<T> dp_new = Matrix<T>::Zero(want_dp ? trace.prefix.rows() : 0, cfg_.d_model);
        {
            const backend::Upload<Backend, T> in(dy);
            backend::Download<Backend, T> out(dx_new, dy.rows(), cfg_.d_model);
            auto g = Transfer::upload(view_of(std::as_const(flat)));
            auto dp = Transfer::upload(view_of(std::as_const(dp_new)));
            backward_checked(trace, in.view(), out.view(), Transfer::view(g), Transfer::view(dp),
                             d_state_in, d_state_out);
            out.finish();
            backend::copy_to_host<Backend>(Transfer::view(std::as_const(g)), grads, cfg_);
            if (want_dp) Transfer::download(Transfer::view(std::as_const(dp)), view_of(dp_new));
        }
        if (dprefix != nullptr) *dprefix = std::move(dp_new);
        dx = std::move(dx_new);
    }

    /// The backend-level backward: backward(trace, dy, dx, grads, dprefix, d_state_in,
    /// d_state_out) with dy and dx views in the backend's memory (the trace's rows x d_model,
    /// distinct), grads this attention's gradients flat there (1 x parameter_count(): W_Q,
    /// W_K, W_V, W_O row-major one after the other; a slice of a gradient buffer) and dprefix
    /// empty (not wanted) or the prefix's rows x d_model there; dL/dparams is added to grads,
    /// dL/dprefix to dprefix. Checks as backward's but dy's finiteness, the caller's; on an
    /// error grads, dprefix and d_state_in are unchanged.
    void backward(const Trace& trace, View<const T> dy, View<T> dx, View<T> grads,
                  View<T> dprefix = {}, AttentionStateGradient<T>* d_state_in = nullptr,
                  const AttentionStateGradient<T>* d_state_out = nullptr) const
        requires(backend::AttentionTraining<Backend, T>::available)
    {
        constexpr const char* where = "Attention::backward";
        validate_trace(trace, where);
        detail::check_view_gradient(where, dy, dx, cfg_.d_model, trace.rows());
        detail::check_flat_gradient(where, grads, parameter_count(), "W_Q, W_K, W_V, W_O");
        if (!dprefix.empty() && (dprefix.rows != trace.prefix.rows() ||
                                 dprefix.cols != cfg_.d_model)) {
            throw ShapeError(detail::concat(where, ": dprefix is ", dprefix.rows, " x ",
                                            dprefix.cols, ", expected empty or ",
                                            trace.prefix.rows(), " x ", cfg_.d_model,
                                            " (the trace's prefix)"));
        }
        backward_checked(trace, dy, dx, grads, dprefix, d_state_in, d_state_out);
    }

    /// Entries of the parameters (W_Q, W_K, W_V, W_O): the length of a flat gradient.
    [[nodiscard]] Eigen::Index parameter_count() const {
        return detail::flat_size(*params_, cfg_);
    }

    /// Throws unless `trace` was filled by the training forward of an attention of this
    /// configuration and holds the sizes that forward left (batch, input, prefix, kept window):
    /// ShapeError (empty, moved-from, another width, sizes changed), ConfigError (another
    /// configuration, the first differing setting named). `where` names the call.
    void validate_trace(const Trace& trace, const char* where = "Attention::validate_trace") const
        requires(backend::AttentionTraining<Backend, T>::available)
    {
        detail::check_trace(!trace.empty(), trace.empty() ? cfg_.d_model : trace.x.cols(),
                            cfg_.d_model, where);
        detail::check_trace_config(trace.cfg, cfg_, where, "an attention");
        detail::check_trace_stream(trace.batch, trace.rows(), trace.start, where);
        backend::AttentionTraining<Backend, T>::check_trace(cfg_, trace, where);
    }

    /// Thread settings of this object's calls, as NeuralMemory::set_threads (titans/threads.hpp).
    void set_threads(Threads t) {
        t.validate("Attention::set_threads");
        threads_ = t;
    }
    [[nodiscard]] const Threads& threads() const { return threads_; }

    /// Approximate multiply-adds of a forward over `rows` tokens with a prefix of `prefix_rows`
    /// (projections and W_O, scores and values over the window and the prefix).
    [[nodiscard]] double work_estimate(Eigen::Index rows, Eigen::Index prefix_rows = 0) const {
        const double d = cfg_.d_model, D = cfg_.inner_dim();
        const double seen = static_cast<double>(cfg_.window) + static_cast<double>(prefix_rows);
        return static_cast<double>(rows) * (4.0 * d * D + 2.0 * D * seen) +
               static_cast<double>(prefix_rows) * 2.0 * d * D;
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
        return Kernels::begin(state);
    }
    void commit(State& state) const { Kernels::commit(state); }
    void rollback(State& state) const { Kernels::rollback(state); }

private:
    /// forward's checks with a prefix of rows (or none).
    void check_forward(const State& state, const MatrixRef<T>& x, const Matrix<T>& y,
                       const Matrix<T>* prefix, PrefixSharing sharing) const {
        constexpr const char* where = "Attention::forward";
        check_call(state, x, where);
        if (prefix != nullptr) {
            check_prefix(*prefix, where);
            check_sharing(state, prefix->rows(), sharing, where);
        }
        if (detail::overlaps(x, y) || (prefix != nullptr && detail::overlaps(*prefix, y))) {
            throw ShapeError("Attention::forward: y is also an input, expected a distinct matrix");
        }
    }

    /// Checked x and prefix through the kernels (y resized to (B*N) x d_model).
    void run(State& state, const MatrixRef<T>& x, Matrix<T>& y, const PrefixView<T>* prefix) const {
        const backend::Upload<Backend, T> in(x);
        backend::Download<Backend, T> out(y, x.rows(), cfg_.d_model);
        Kernels::forward(cfg_, prepared_, state, in.view(), out.view(), prefix);
        out.finish();
    }

public:
    /// The backend-level forward: forward(state, x, y, prefix) on views in the backend's
    /// memory (device memory on a GPU): x (B*N) x d_model, y of x's shape and distinct, the
    /// prefix (if any) projected once by project_prefix. Shapes, the state and the position
    /// are checked (ShapeError, ConfigError, OverflowError as forward); finiteness of x is the
    /// caller's (an output or window that would not be finite throws NonFiniteError as
    /// forward, the state unchanged). How a block runs its attention without a round trip
    /// through the host.
    void forward(State& state, View<const T> x, View<T> y, const Prefix* prefix) const {
        constexpr const char* where = "Attention::forward";
        check_rows(state, x.rows, x.cols, where);
        detail::check_view_call(where, x, y, cfg_.d_model, false);
        if (prefix != nullptr) {
            check_sharing(state, prefix->rows(), prefix->sharing, where);
        }
        const ThreadScope team(threads_, work_estimate(x.rows, prefix ? prefix->rows() : 0));
        const PrefixView<T> pv = prefix != nullptr ? prefix->view() : PrefixView<T>{};
        Kernels::forward(cfg_, prepared_, state, x, y, prefix != nullptr ? &pv : nullptr);
    }

    /// MAC's segment attention (attention/segment.hpp) on views in the backend's memory: the
    /// part's keys and values written into the call's segment buffers, y = its output. How
    /// MAC's mixer runs on every backend. Checked first (detail::check_segment_call):
    /// ConfigError unless batch, segment, rows >= 1, 0 <= offset <= segment - rows and
    /// position >= 0; ShapeError unless every view has the shape SegmentCall gives, y and the
    /// buffers share no storage with the inputs or each other, and the prefix is shared.
    /// Finiteness of the inputs is the caller's.
    void segment(const SegmentCall<T>& call) const {
        detail::check_segment_call(cfg_, call, "Attention::segment");
        Kernels::segment(cfg_, prepared_, call);
    }

    /// The reverse of segment (attention/segment_backward.hpp) on views in the backend's
    /// memory: dL/du, dL/dh and the kept rows' adjoint written, the attention's gradient added
    /// to `call.grads` (its flat layout: W_Q, W_K, W_V, W_O) and P's to `call.dpersistent`.
    /// Checked as segment (detail::check_segment_backward_call: the counts, every view's
    /// shape as SegmentBackwardCall gives it, grads 1 x parameter_count(), the outputs distinct
    /// from the inputs and each other); finiteness of the inputs is the caller's.
    void segment_backward(const SegmentBackwardCall<T>& call) const {
        detail::check_segment_backward_call(cfg_, call, parameter_count(),
                                            "Attention::segment_backward");
        Kernels::segment_backward(cfg_, prepared_, call);
    }

private:

    /// The training forward on checked views: the trace replaced only if the kernels succeed.
    void train_checked(State& state, View<const T> x, View<T> y, Trace& trace,
                       View<const T> prefix, PrefixSharing sharing) const {
        const ThreadScope team(threads_, work_estimate(x.rows, prefix.rows));
        Trace t;
        backend::AttentionTraining<Backend, T>::forward(cfg_, prepared_, state, x, y, prefix,
                                                        sharing, t);
        trace = std::move(t);
    }

    /// The backward on checked views (but d_state_out): the kernels add the gradients to grads
    /// and dprefix (the backend's memory), d_state_in filled once they return.
    void backward_checked(const Trace& trace, View<const T> dy, View<T> dx, View<T> grads,
                          View<T> dprefix, AttentionStateGradient<T>* d_state_in,
                          const AttentionStateGradient<T>* d_state_out) const {
        const bool chained = d_state_out != nullptr && !d_state_out->empty();
        if (chained) {
            check_state_gradient(*d_state_out, trace, "Attention::backward");
        }
        const ThreadScope team(threads_, 3.0 * work_estimate(dy.rows, trace.prefix.rows()));
        AttentionStateGradient<T> d_in;
        backend::AttentionTraining<Backend, T>::backward(
            cfg_, prepared_, trace, dy, dx, grads, dprefix, chained ? d_state_out : nullptr,
            d_state_in != nullptr ? &d_in : nullptr);
        if (d_state_in != nullptr) {
            *d_state_in = std::move(d_in);
        }
    }

    template <class Tr>
    void check_backward(const Tr& trace, const MatrixRef<T>& dy, const Matrix<T>& dx,
                        const AttentionParams<T>& grads, const Matrix<T>* dprefix,
                        const char* where) const {
        validate_trace(trace, where);
        detail::check_gradient_rows(dy, trace.rows(), cfg_.d_model, where, "dy");
        detail::check_same_tensors(*params_, grads, cfg_, where, "grads");
        if (detail::overlaps(dy, dx) || (dprefix != nullptr && (detail::overlaps(dy, *dprefix) ||
                                                                dprefix == &dx))) {
            throw ShapeError(detail::concat(where, ": dx, dprefix and dy share storage, "
                                                   "expected distinct matrices"));
        }
    }

    /// d: per sequence of the trace's batch, keys and values of min(w - 1, end position) x D
    /// rows, finite.
    template <class Tr>
    void check_state_gradient(const AttentionStateGradient<T>& d, const Tr& trace,
                              const char* where) const {
        const std::int64_t end = trace.start + trace.rows() / trace.batch;
        const std::int64_t keep = std::min<std::int64_t>(cfg_.window - 1, end);
        detail::check_sequence_adjoints(d.keys, d.values, static_cast<std::size_t>(trace.batch),
                                        keep, cfg_.inner_dim(), where, "d_state_out",
                                        "min(window - 1, position) x n_heads * d_head");
    }

    void check_state(const State& state, const char* where) const {
        const AttentionConfig& s = state.config();
        const bool same = state.batch() >= 1 && s.d_model == cfg_.d_model &&
                          s.n_heads == cfg_.n_heads && s.head_dim() == cfg_.head_dim() &&
                          s.window == cfg_.window && s.rope == cfg_.rope &&
                          (!cfg_.rope || s.rope_base == cfg_.rope_base) && state.well_formed();
        if (!same) {
            throw ConfigError(detail::concat(
                where, ": state was made for a different configuration (or default-constructed),"
                       " expected a state from make_state() of an attention with this "
                       "configuration"));
        }
    }
    /// The state and x of a forward call (position, configuration, shape, finiteness).
    void check_call(const State& state, const MatrixRef<T>& x, const char* where) const {
        check_rows(state, x.rows(), x.cols(), where);
        if (!detail::all_finite(x)) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
    }
    /// The position may advance by rows / B, the state is this layer's, x is d_model wide and
    /// B*N rows.
    void check_rows(const State& state, Eigen::Index rows, Eigen::Index cols,
                    const char* where) const {
        detail::check_position_advance(where, state.position(), rows, state.batch());
        check_state(state, where);
        if (cols != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", cols,
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (rows % state.batch() != 0) {
            throw ShapeError(detail::concat(where, ": x has ", rows,
                                            " rows, expected a multiple of the state's batch = ",
                                            state.batch(), " (B*N rows, sequence-major)"));
        }
    }
    void check_prefix(const MatrixRef<T>& prefix, const char* where) const {
        if (prefix.cols() != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": prefix has ", prefix.cols(),
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (!detail::all_finite(prefix)) {
            throw NonFiniteError(detail::concat(where, ": prefix has a NaN or infinite entry"));
        }
    }
    static void check_sharing(const State& state, Eigen::Index rows, PrefixSharing sharing,
                              const char* where) {
        if (sharing == PrefixSharing::PerSequence && rows % state.batch() != 0) {
            throw ShapeError(detail::concat(
                where, ": prefix has ", rows, " rows, expected a multiple of the state's batch = ",
                state.batch(), " (B*p rows, sequence-major, with PrefixSharing::PerSequence)"));
        }
    }

    AttentionConfig cfg_;
    std::shared_ptr<const AttentionParams<T>> params_;
    typename Kernels::Prepared prepared_;
    Threads threads_{};
};

}  // namespace titans
