#pragma once
// titans/memory/neural_memory.hpp: NeuralMemory<T, Backend>, the neural long-term memory.

#include <memory>
#include <utility>
#include <vector>

#include "../fwd.hpp"
#include "../backend/backend.hpp"
#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/float_env.hpp"
#include "../detail/shared.hpp"
#include "../detail/tensor_slots.hpp"
#include "../error.hpp"
#include "../threads.hpp"
#include "../types.hpp"
#include "config.hpp"
#include "diagnostics.hpp"
#include "params.hpp"
#include "state_gradient.hpp"
#include "kernels_decl.hpp"

namespace titans {

/// The neural long-term memory of Titans (math §1-5) as a sequence layer that learns at test
/// time. Per head, an MLP memory M (depth L) is written with the momentum/forget update
///     S_t = eta_t S_{t-1} - theta_t grad l(M_{t-1}; k_t, v_t),   M_t = (1 - alpha_t) M_{t-1} + S_t
/// (chunked, math §4, or per token, math §3) and read as y_t = M*(q_t) (lagged or in-chunk,
/// math §5); heads are concatenated and projected by W_O.
///
/// Shapes: a call takes x of (B*N) x d_model (B sequences of N tokens, stacked
/// sequence-major) and returns (B*N) x d_model. B is fixed by the state; N may differ between
/// calls: feeding a stream in pieces of any length gives the same outputs and state as one call.
///
///     titans::MemoryConfig cfg{.d_model = 64, .n_heads = 4, .depth = 2, .chunk = 16};
///     titans::NeuralMemory<float> mem(cfg, titans::MemoryParams<float>::random(cfg, 42));
///     auto state = mem.make_state(1);
///     titans::Matrixf y = mem.forward(state, x);  // x: N x 64
///
/// Thread safety: a NeuralMemory is immutable after construction; distinct states may be used
/// from distinct threads concurrently.
template <class T, class Backend>
class NeuralMemory {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::NeuralMemory: T must be float or double");
    static_assert(backend::MemoryBackend<Backend, T>,
                  "titans::NeuralMemory: Backend does not satisfy titans::backend::MemoryBackend");
    using Kernels = backend::MemoryKernels<Backend, T>;

public:
    using Scalar = T;
    using State = typename Kernels::State;
    using BackendType = Backend;

    /// Validates both (ConfigError, ShapeError, NonFiniteError) and keeps them (the
    /// parameters are moved in; pass std::move(params) to avoid a copy).
    NeuralMemory(MemoryConfig config, MemoryParams<T> params)
        : NeuralMemory(std::move(config),
                       std::make_shared<const MemoryParams<T>>(std::move(params))) {}

    /// Shares `params` (not copied; ConfigError if null): a block hands its memory a pointer
    /// into its own parameters, so every weight is held once. Copies of the object share too.
    NeuralMemory(MemoryConfig config, std::shared_ptr<const MemoryParams<T>> params)
        : cfg_(std::move(config)),
          params_(detail::require_shared(std::move(params), "NeuralMemory")) {
        cfg_.validate_for<T>();
        params_->validate(cfg_);
        prepared_ = Kernels::prepare(cfg_, params_);
    }

    [[nodiscard]] const MemoryConfig& config() const { return cfg_; }
    [[nodiscard]] const MemoryParams<T>& params() const { return *params_; }
    /// The parameters as held (shared with the block or model that owns them, if any).
    [[nodiscard]] const std::shared_ptr<const MemoryParams<T>>& shared_params() const {
        return params_;
    }
    /// The parameters as this layer's kernels hold them (on the CPU the host tensors).
    using Prepared = typename Kernels::Prepared;
    /// What the kernels would hold for new values of the parameters, read from their flat form
    /// in the backend's memory (1 x parameter_count(), MemoryParams::tensors order, each
    /// row-major: a slice of a parameter buffer) and copied there: nothing crosses to the
    /// host. ShapeError unless flat is 1 x that count. With adopt, how a model takes an
    /// optimiser's step where the parameters live (Model::set_parameters(flat)): every layer's
    /// made first, then all adopted, so that a throw changes nothing.
    [[nodiscard]] Prepared prepare_flat(View<const T> flat) const
        requires requires(const MemoryConfig& c, const MemoryParams<T>& s, View<const T> f) {
            Kernels::prepare_flat(c, s, f);
        }
    {
        detail::check_flat_params("NeuralMemory::prepare_flat", flat, parameter_count());
        return Kernels::prepare_flat(cfg_, *params_, flat);
    }
    /// The kernels use `p` (from prepare_flat of this layer or a copy of it) from now on;
    /// params() keeps the host values it had (the owner of the parameters refreshes them).
    void adopt(Prepared p) noexcept { prepared_ = std::move(p); }

    /// A fresh state for `batch` independent sequences: M_0 = memory_init, S_0 = 0,
    /// conv history zero, position 0.
    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require_state_batch(
            "NeuralMemory::make_state", batch, detail::scalar_name<T>(),
            [&](std::int64_t b) { return cfg_.state_bytes(b, std::int64_t{sizeof(T)}); });
        return Kernels::make_state(cfg_, prepared_, batch);
    }

    /// Processes the next piece of every stream. x: (B*N) x d_model with B = state.batch();
    /// returns (B*N) x d_model. If `diag` is given it receives per-token surprise.
    [[nodiscard]] Matrix<T> forward(State& state, const MatrixRef<T>& x,
                                    Diagnostics<T>* diag = nullptr) const {
        Matrix<T> y;
        forward(state, x, y, diag);
        return y;
    }

    /// As above, writing into `y` (resized to (B*N) x d_model; reuse it to avoid allocation;
    /// it must not share storage with x).
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y,
                 Diagnostics<T>* diag = nullptr) const {
        check_forward(state, x, y);
        const ThreadScope team(threads_, work_estimate(x.rows()));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        const backend::Upload<Backend, T> in(x);
        backend::Download<Backend, T> out(y, x.rows(), cfg_.d_model);
        Kernels::forward(cfg_, prepared_, state, in.view(), out.view(), diag);
        out.finish();
    }

    /// The backend-level forward: forward(state, x, y, diag) on views in the backend's memory
    /// (device memory on a GPU): x (B*N) x d_model, y of x's shape and distinct. Shapes, the
    /// state and the position are checked (ShapeError, ConfigError, OverflowError as forward);
    /// finiteness of x is the caller's (an output or a state that would not be finite throws
    /// NonFiniteError as forward, the state unchanged). How a block runs its memory without a
    /// round trip through the host.
    void forward(State& state, View<const T> x, View<T> y, Diagnostics<T>* diag = nullptr) const {
        check_view_forward(state, x, y, "NeuralMemory::forward");
        const ThreadScope team(threads_, work_estimate(x.rows));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        Kernels::forward(cfg_, prepared_, state, x, y, diag);
    }

    /// What the training forward keeps for backward (math §9): the input and the memory at
    /// every chunk start (N/b copies per sequence and head), in the backend's memory.
    using Trace = typename backend::MemoryTraining<Backend, T>::Trace;

    /// The training forward (math §9): forward(state, x, y) from any state (mid_chunk_training:
    /// the CPU and CUDA; a state p tokens into a chunk is continued with its pending rows,
    /// whose adjoints backward's d_state_in then carries; on a backend without it, from a
    /// state at a chunk boundary only: ConfigError otherwise), keeping in `trace` what
    /// backward needs. Same outputs and state as forward,
    /// and if `diag` is given the same per-token surprise (Diagnostics: (B*N) x H each) as
    /// forward gives; on an error nothing changes (state, y, trace, diag). Backends with a
    /// training pass only (the CPU, CUDA). Pieces chain: see backward's d_state_in and
    /// d_state_out.
    ///
    ///     NeuralMemory<double>::Trace trace;
    ///     Diagnostics<double> surprise;                // optional
    ///     mem.forward(state, x, y, trace, &surprise);
    ///     auto grads = MemoryParams<double>::zeros(cfg);
    ///     mem.backward(trace, dy, dx, grads);  // dy = dL/dy -> dx = dL/dx, grads += dL/dparams
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y, Trace& trace,
                 Diagnostics<T>* diag = nullptr) const
        requires(backend::MemoryTraining<Backend, T>::available)
    {
        check_forward(state, x, y);
        require_chunk_start(state, "NeuralMemory::forward (training)");
        Matrix<T> y_new;
        {
            const backend::Upload<Backend, T> in(x);
            backend::Download<Backend, T> out(y_new, x.rows(), cfg_.d_model);
            train_checked(state, in.view(), out.view(), trace, diag);
            out.finish();
        }
        y = std::move(y_new);
    }

    /// The backend-level training forward: forward(state, x, y, trace, diag) on views in the
    /// backend's memory, x (B*N) x d_model, y of x's shape and distinct. Shapes, the state, the
    /// position and (without mid_chunk_training) the chunk boundary are checked (ShapeError, ConfigError, OverflowError);
    /// finiteness of x is the caller's. On an error the state, trace and diag are unchanged (y
    /// may have been written). How a block trains its memory without a round trip.
    void forward(State& state, View<const T> x, View<T> y, Trace& trace,
                 Diagnostics<T>* diag = nullptr) const
        requires(backend::MemoryTraining<Backend, T>::available)
    {
        constexpr const char* where = "NeuralMemory::forward (training)";
        check_view_forward(state, x, y, where);
        require_chunk_start(state, where);
        train_checked(state, x, y, trace, diag);
    }

    /// The backward pass (math §9) of a training forward: dy = dL/dy (the trace's rows x
    /// d_model) gives dx = dL/dx (resized; not sharing dy's storage), and the gradient of every
    /// parameter (projections, conv, gates, W^0 = memory_init, W_O) is added to grads (shaped as
    /// params(), e.g. MemoryParams<T>::zeros(config())), through every memory update of the
    /// call: chunk ends, their second-order terms, the gate coefficients, clipping and both
    /// reads. Throws ShapeError (empty or moved-from trace, one whose sizes are not its
    /// forward's, shapes), ConfigError (a trace of another configuration), NonFiniteError (dy,
    /// or gradients that overflow); nothing changes then.
    ///
    /// Chained pieces (math §9): d_state_out, if given and not empty(), is dL/d(the state the
    /// trace's call left: its chunk-start memory and, mid-chunk, its pending rows; see
    /// MemoryStateGradient), and without mid_chunk_training the trace must end at a chunk
    /// boundary (ConfigError otherwise); d_state_in, if given, receives dL/d(the state it
    /// started from), the pending rows' adjoints included when it was mid-chunk. grads.memory_init gets
    /// the start memory's adjoint only for a trace from position 0 (where the state is W^0)
    /// with tokens: an empty trace there comes before the piece that adds it, and passes it on.
    /// Reversing pieces last first, each with the next one's d_state_in as its d_state_out,
    /// gives the dx and grads of one call over their concatenation.
    void backward(const Trace& trace, const MatrixRef<T>& dy, Matrix<T>& dx,
                  MemoryParams<T>& grads, MemoryStateGradient<T>* d_state_in = nullptr,
                  const MemoryStateGradient<T>* d_state_out = nullptr) const
        requires(backend::MemoryTraining<Backend, T>::available)
    {
        constexpr const char* where = "NeuralMemory::backward";
        validate_trace(trace, where);
        detail::check_gradient_rows(dy, trace.rows(), cfg_.d_model, where, "dy");
        if (detail::overlaps(dy, dx)) {
            throw ShapeError(detail::concat(where, ": dx shares storage with dy, expected a "
                                                   "distinct matrix"));
        }
        using Transfer = backend::Transfer<Backend, T>;
        Matrix<T> dx_new, flat(1, parameter_count());
        {
            const backend::Upload<Backend, T> in(dy);
            backend::Download<Backend, T> out(dx_new, dy.rows(), cfg_.d_model);
            detail::check_same_tensors(*params_, grads, cfg_, where, "grads");
            detail::flatten_tensors(grads, cfg_, flat.data());  // up, gain, down if all is well
            auto g = Transfer::upload(view_of(std::as_const(flat)));
            backward_checked(trace, in.view(), out.view(), Transfer::view(g), d_state_in,
                             d_state_out, [&] {
                                 out.finish();
                                 return detail::all_finite(dx_new);
                             });
            backend::copy_to_host<Backend>(Transfer::view(std::as_const(g)), grads, cfg_);
        }
        dx = std::move(dx_new);
    }

    /// The backend-level backward: backward(trace, dy, dx, grads, d_state_in, d_state_out)
    /// with dy and dx views in the backend's memory (the trace's rows x d_model, distinct) and
    /// grads this memory's gradients flat there (1 x parameter_count(), its tensors row-major
    /// one after the other as MemoryParams::tensors visits them; a slice of a gradient buffer),
    /// added to. Checks as backward's but dy's and dx's finiteness, which are the caller's; on
    /// an error grads and d_state_in are unchanged (dx may have been written).
    void backward(const Trace& trace, View<const T> dy, View<T> dx, View<T> grads,
                  MemoryStateGradient<T>* d_state_in = nullptr,
                  const MemoryStateGradient<T>* d_state_out = nullptr) const
        requires(backend::MemoryTraining<Backend, T>::available)
    {
        constexpr const char* where = "NeuralMemory::backward";
        validate_trace(trace, where);
        detail::check_view_gradient(where, dy, dx, cfg_.d_model, trace.rows());
        detail::check_flat_gradient(where, grads, parameter_count(), "the memory's tensors");
        backward_checked(trace, dy, dx, grads, d_state_in, d_state_out, [] { return true; });
    }

    /// Entries of the parameters (every tensor MemoryParams::tensors visits for config()): the
    /// length of a flat gradient.
    [[nodiscard]] Eigen::Index parameter_count() const {
        return detail::flat_size(*params_, cfg_);
    }

    /// Reads the memory without writing it: x is projected like forward's queries (q path of
    /// math §1; the conv continues the stream but its tail is not updated), every query reads
    /// the memory as it is after the last token seen, y = M_{W_t}(q) per head, then W_O.
    /// x: (B*N) x d_model -> (B*N) x d_model. The state is unchanged.
    [[nodiscard]] Matrix<T> read(const State& state, const MatrixRef<T>& x) const {
        check_state(state, "NeuralMemory::read");
        check_input(state.batch(), x, "NeuralMemory::read");
        Matrix<T> y;
        const ThreadScope team(threads_, work_estimate(x.rows()));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        const backend::Upload<Backend, T> in(x);
        backend::Download<Backend, T> out(y, x.rows(), cfg_.d_model);
        Kernels::read(cfg_, prepared_, state, in.view(), out.view());
        out.finish();
        if (!detail::all_finite(y)) {
            throw NonFiniteError("NeuralMemory::read: the read-out is not finite (the memory "
                                 "diverged or x overflows the projections), expected finite "
                                 "values; the state is unchanged");
        }
        return y;
    }

    /// Reads x through given memory weights, without a state: the q path of math §1 without
    /// the conv (W_Q, phi, L2 norm), y = M_W(q) per (sequence b, head h) with
    /// W = weights[b * H + h] (layer l at index l-1, the shapes current_weights returns), then
    /// W_O. x: (batch*N) x d_model -> (batch*N) x d_model. MAC reads the memory as it was at
    /// its segment's start this way (math §7).
    [[nodiscard]] Matrix<T> read_weights(const std::vector<std::vector<Matrix<T>>>& weights,
                                         const MatrixRef<T>& x, int batch) const {
        constexpr const char* where = "NeuralMemory::read_weights";
        detail::require<ConfigError>(batch >= 1, where, "batch", batch, ">= 1");
        check_weights(weights, batch, where);
        check_input(batch, x, where);
        Matrix<T> y;
        const ThreadScope team(threads_, work_estimate(x.rows()));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        const backend::Upload<Backend, T> in(x);
        backend::Download<Backend, T> out(y, x.rows(), cfg_.d_model);
        Kernels::read_weights(cfg_, prepared_, weights, in.view(), batch, out.view());
        out.finish();
        return y;
    }

    /// The memory weights of sequence b, head h after the last token seen (W_t of math §3;
    /// layer l at index l-1), materialised from the chunk-start weights and the pending rows.
    [[nodiscard]] std::vector<Matrix<T>> current_weights(const State& state, int b, int h) const {
        check_index(state, b, h, "NeuralMemory::current_weights");
        return Kernels::current_weights(cfg_, state, b, h);
    }

    /// current_weights of every (sequence b, head h), at index b * H + h: the layout
    /// read_weights takes, brought to the host at once (on CUDA one download per layer).
    [[nodiscard]] std::vector<std::vector<Matrix<T>>> current_weights(const State& state) const {
        check_state(state, "NeuralMemory::current_weights");
        return Kernels::all_weights(cfg_, state);
    }

    /// The weights of every (sequence, head) now, kept in the backend's memory (math §7: MAC
    /// reads the memory as it was at its segment's start): into `into`, whose storage is
    /// reused. On the CPU a MemorySnapshot (host matrices, current_weights()' layout).
    ///
    ///     NeuralMemory<double>::Snapshot s;
    ///     mem.snapshot(state, s);                    // W after the tokens seen so far
    ///     mem.read_snapshot(s, xv, state.batch(), yv);  // views in the backend's memory
    using Snapshot = typename Kernels::Snapshot;
    void snapshot(const State& state, Snapshot& into) const {
        check_state(state, "NeuralMemory::snapshot");
        Kernels::snapshot(cfg_, state, into);
    }

    /// read_weights through a snapshot, on views in the backend's memory: x (batch*N) x
    /// d_model, y of its shape and distinct; the snapshot holds batch * n_heads pairs
    /// (ShapeError otherwise). Finiteness of x is the caller's.
    void read_snapshot(const Snapshot& s, View<const T> x, int batch, View<T> y) const {
        constexpr const char* where = "NeuralMemory::read_snapshot";
        check_snapshot_read(s, batch, x, where);
        detail::check_view_call(where, x, y, cfg_.d_model, false);
        const ThreadScope team(threads_, work_estimate(x.rows));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        Kernels::read_snapshot(cfg_, prepared_, s, x, batch, y);
    }

    /// A snapshot's weights on the host (current_weights()' layout), and a snapshot of host
    /// weights for `batch` sequences (ShapeError unless they have validate_weights' shapes).
    [[nodiscard]] std::vector<std::vector<Matrix<T>>> snapshot_weights(const Snapshot& s) const {
        return Kernels::snapshot_weights(cfg_, s);
    }
    [[nodiscard]] Snapshot make_snapshot(std::vector<std::vector<Matrix<T>>> weights,
                                         int batch) const {
        validate_weights(weights, batch, "NeuralMemory::make_snapshot");
        return Kernels::make_snapshot(cfg_, std::move(weights));
    }

    /// The momentum S_t of sequence b, head h after the last token seen.
    [[nodiscard]] std::vector<Matrix<T>> current_momentum(const State& state, int b, int h) const {
        check_index(state, b, h, "NeuralMemory::current_momentum");
        return Kernels::current_momentum(cfg_, state, b, h);
    }

    /// Transactions: after begin(state), the forward calls on `state` are undone together by
    /// rollback(state) (bit-identical to the state at begin) or kept by commit(state). Without
    /// one, each forward call is its own transaction: it commits when it returns and leaves
    /// the state untouched when it throws. Inside one, a forward that throws rolls the whole
    /// transaction back. begin returns false (and opens nothing) if one is already open. The
    /// saved values live in the state (buffers sized on first use). Blocks use this to keep
    /// the strong guarantee across their sub-layers.
    bool begin(State& state) const {
        check_state(state, "NeuralMemory::begin");
        return Kernels::begin(state);
    }
    void commit(State& state) const { Kernels::commit(state); }
    void rollback(State& state) const { Kernels::rollback(state); }

    /// Thread settings of this object's calls (default: automatic, see titans/threads.hpp):
    /// at most `t.max` threads, fewer for small calls and on a loaded machine. Not to be
    /// changed while another thread runs a call on this object. Throws ConfigError if max < 0.
    void set_threads(Threads t) {
        t.validate("NeuralMemory::set_threads");
        threads_ = t;
    }
    [[nodiscard]] const Threads& threads() const { return threads_; }

    /// Approximate multiply-adds of a forward over `rows` tokens (projections, key forward and
    /// backward, read and chunk-end update per head): what the thread decision weighs.
    [[nodiscard]] double work_estimate(Eigen::Index rows) const {
        double per_head = 0;
        for (int l = 1; l <= cfg_.depth; ++l) {
            per_head += static_cast<double>(cfg_.layer_in(l)) * cfg_.layer_out(l);
        }
        const double d = cfg_.d_model, D = cfg_.inner_dim();
        return static_cast<double>(rows) * (4.0 * d * D + 5.0 * cfg_.n_heads * per_head);
    }

    /// Throws ConfigError unless `state` can be continued by this memory: made by make_state()
    /// of a memory with the same configuration (every setting but flush_denormals).
    void validate_state(const State& state) const { check_state(state, "NeuralMemory"); }

    /// Whether a training trace may start (and a state gradient be taken) mid-chunk on this
    /// backend: the CPU's and CUDA's, yes.
    static constexpr bool mid_chunk_training = backend::MemoryTraining<Backend, T>::mid_chunk;

    /// Throws unless `trace` was filled by the training forward of a memory of this
    /// configuration (every setting but flush_denormals) and holds the sizes that forward left
    /// (batch, input, its start (at a chunk boundary unless mid_chunk_training; else with the
    /// incoming pending rows), conv tails, products, chunk-start memory):
    /// ShapeError (empty, moved-from, another width, sizes changed), ConfigError (another
    /// configuration, the first differing setting named). `where` names the call.
    void validate_trace(const Trace& trace,
                        const char* where = "NeuralMemory::validate_trace") const
        requires(backend::MemoryTraining<Backend, T>::available)
    {
        detail::check_trace(!trace.empty(), trace.empty() ? cfg_.d_model : trace.x.cols(),
                            cfg_.d_model, where);
        detail::check_trace_config(trace.cfg, cfg_, where, "a memory");
        detail::check_trace_stream(trace.batch, trace.rows(), trace.start, where);
        if constexpr (!mid_chunk_training) {
            const int b = cfg_.effective_chunk();
            detail::check_trace_part(
                trace.start % b == 0, where, "start", trace.start,
                detail::concat("a multiple of the chunk ", b,
                               " (a training forward starts at a chunk boundary here)"));
        }
        backend::MemoryTraining<Backend, T>::check_trace(cfg_, trace, where);
    }

    /// Throws unless `weights` hold, per (sequence b, head h) at b * H + h for `batch`
    /// sequences, depth matrices of the layer shapes (layer_in(l) x layer_out(l), l = 1..L),
    /// as current_weights() returns them: ShapeError naming the entry. `where` names the call.
    void validate_weights(const std::vector<std::vector<Matrix<T>>>& weights, int batch,
                          const char* where = "NeuralMemory::validate_weights") const {
        detail::require<ConfigError>(batch >= 1, where, "batch", batch, ">= 1");
        check_weights(weights, batch, where);
    }

    /// Throws unless d can be the adjoint of the state a trace's call left (d_state_out of
    /// backward and Reverse): the trace ends at a chunk boundary unless mid_chunk_training
    /// (ConfigError), the weights, momentum, conv tails and pending rows (p = the trace's end
    /// mod the chunk; empty: zero) are shaped for its batch (ShapeError), every entry is
    /// finite (NonFiniteError).
    void validate_state_gradient(const MemoryStateGradient<T>& d, const Trace& trace) const
        requires(backend::MemoryTraining<Backend, T>::available)
    {
        check_state_gradient(d, trace);
    }

    // --- Staged training (math §9, "staged reverse"): for callers whose later inputs depend on
    // the memory mid-stream, such as a read of it (MAC reads it at every segment start).

    /// Whether this backend has the staged training API (begin_trace, forward_part, Reverse,
    /// read_weights_backward): the CPU's and CUDA's.
    static constexpr bool staged = backend::MemoryTraining<Backend, T>::staged;

    /// Starts a training trace of `rows` tokens per stream from `state` (anywhere with
    /// mid_chunk_training, else at a chunk boundary: ConfigError otherwise, as the training
    /// forward), for forward_part to fill in pieces of
    /// any length. Replaces `trace` (on success only); the state is not changed.
    ///
    ///     NeuralMemory<double>::Trace trace;
    ///     mem.begin_trace(state, 10, trace);
    ///     mem.forward_part(state, x1, y1, trace);     // rows 0..3 of every stream
    ///     auto W = mem.current_weights(state, 0, 0);  // the memory after 4 tokens
    ///     mem.forward_part(state, x2, y2, trace);     // rows 4..9: the trace is filled
    void begin_trace(const State& state, Eigen::Index rows, Trace& trace) const
        requires(staged)
    {
        constexpr const char* where = "NeuralMemory::begin_trace";
        check_state(state, where);
        detail::require<ShapeError>(rows >= 0, where, "rows", rows, ">= 0");
        detail::check_position_advance(where, state.position(), rows, 1);
        const std::int64_t per_row = detail::checked_mul(
            state.batch(), cfg_.d_model + 3 * cfg_.inner_dim() + 3 * cfg_.n_heads, where, "row");
        detail::require_budget(detail::checked_mul(detail::checked_mul(per_row, rows, where, "rows"),
                                                   static_cast<std::int64_t>(sizeof(T)),
                                                   where, "rows"),
                               where, "the trace's rows", sizeof(T) == 4 ? "float" : "double");
        require_chunk_start(state, where);
        Trace t;
        backend::MemoryTraining<Backend, T>::start(cfg_, state, rows, cfg_.d_model, t);
        trace = std::move(t);
    }

    /// The next piece of a trace from begin_trace: forward(state, x, y) (x: (B*m) x d_model,
    /// any m up to the trace's rows left), recorded at the trace's rows after its earlier
    /// pieces; the trace is filled (backward and Reverse take it) once its rows are in.
    /// `state` is the one begin_trace saw, fed the trace's earlier pieces only (ConfigError if
    /// its position is not the trace's start plus a part of its rows; ShapeError past the
    /// rows). diag as forward's. On an error nothing changes (state, y, trace, diag).
    void forward_part(State& state, const MatrixRef<T>& x, Matrix<T>& y, Trace& trace,
                      Diagnostics<T>* diag = nullptr) const
        requires(staged)
    {
        constexpr const char* where = "NeuralMemory::forward_part";
        check_forward(state, x, y);
        check_part(state, x.rows() / state.batch(), trace, where);
        const ThreadScope team(threads_, 3.0 * work_estimate(x.rows()));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        Matrix<T> y_new;
        Diagnostics<T> surprise;
        {
            const backend::Upload<Backend, T> in(x);
            backend::Download<Backend, T> out(y_new, x.rows(), cfg_.d_model);
            backend::MemoryTraining<Backend, T>::forward_part(
                cfg_, prepared_, state, in.view(), out.view(), trace,
                diag != nullptr ? &surprise : nullptr);
            out.finish();
        }
        y = std::move(y_new);
        if (diag != nullptr) {
            *diag = std::move(surprise);
        }
    }

    /// The backward of read_weights (math §7's read through given weights): dy = dL/dy
    /// ((batch*N) x d_model) gives dx = dL/dx (resized), dweights[b * H + h] = dL/d(weights)
    /// (resized, the weights' shapes; where the weights are the memory mid-stream, tap them
    /// into that trace's Reverse) and adds W_Q's and W_O's gradients to grads. Throws as
    /// read_weights, ShapeError (dy's shape, grads), NonFiniteError (dy, or gradients that
    /// overflow); nothing changes then.
    ///
    ///     Matrixd h = mem.read_weights(W, x, B);
    ///     mem.read_weights_backward(W, x, B, dh, dx, dW, grads);
    void read_weights_backward(const std::vector<std::vector<Matrix<T>>>& weights,
                               const MatrixRef<T>& x, int batch, const MatrixRef<T>& dy,
                               Matrix<T>& dx, std::vector<std::vector<Matrix<T>>>& dweights,
                               MemoryParams<T>& grads) const
        requires(staged)
    {
        constexpr const char* where = "NeuralMemory::read_weights_backward";
        detail::require<ConfigError>(batch >= 1, where, "batch", batch, ">= 1");
        check_weights(weights, batch, where);
        check_input(batch, x, where);
        detail::check_gradient_rows(dy, x.rows(), cfg_.d_model, where, "dy");
        detail::check_same_tensors(*params_, grads, cfg_, where, "grads");
        const ThreadScope team(threads_, 2.0 * work_estimate(x.rows()));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        MemoryParams<T> local = MemoryParams<T>::zeros(cfg_);
        Matrix<T> dx_new;
        std::vector<std::vector<Matrix<T>>> dw_new;
        backend::MemoryTraining<Backend, T>::read_weights_backward(
            cfg_, prepared_, weights, Matrix<T>(x), batch, Matrix<T>(dy), dx_new, dw_new, local);
        if (!detail::all_finite(dx_new) || !detail::tensors_finite(local, cfg_) ||
            !detail::all_finite_each(dw_new)) {
            throw NonFiniteError(detail::concat(where, ": the gradients overflow, expected "
                                                       "finite values; grads are unchanged"));
        }
        detail::add_tensors(local, grads, cfg_);
        dx = std::move(dx_new);
        dweights = std::move(dw_new);
    }

    /// forward_part on views in the backend's memory (x, y (B*m) x d_model, distinct): checks
    /// as the host call's but x's finiteness (the caller's). How MAC's training pass runs its
    /// memory without a round trip.
    void forward_part(State& state, View<const T> x, View<T> y, Trace& trace) const
        requires(staged)
    {
        constexpr const char* where = "NeuralMemory::forward_part";
        check_view_forward(state, x, y, where);
        check_part(state, x.rows / state.batch(), trace, where);
        const ThreadScope team(threads_, 3.0 * work_estimate(x.rows));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        backend::MemoryTraining<Backend, T>::forward_part(cfg_, prepared_, state, x, y, trace);
    }

    /// read_weights_backward through a snapshot, on views in the backend's memory: x, dy
    /// (batch*N) x d_model, dx of their shape (written, distinct); dW = dL/d(the snapshot's
    /// weights), a snapshot of batch * n_heads pairs (replaced; tap it into the Reverse of the
    /// trace whose memory the snapshot was); W_Q's and W_O's gradients added to grads, the
    /// memory's flat gradient (1 x its parameter count, MemoryParams::tensors order).
    /// ConfigError, ShapeError as read_snapshot; NonFiniteError if the gradients overflow,
    /// grads unchanged then. Finiteness of x and dy is the caller's.
    ///
    ///     mem.read_snapshot(s, xv, B, hv);
    ///     mem.read_snapshot_backward(s, xv, B, dhv, dxv, dS, gv);  // then rev.tap(dS)
    void read_snapshot_backward(const Snapshot& s, View<const T> x, int batch, View<const T> dy,
                                View<T> dx, Snapshot& dW, View<T> grads) const
        requires(staged)
    {
        constexpr const char* where = "NeuralMemory::read_snapshot_backward";
        check_snapshot_read(s, batch, x, where);
        detail::check_view_call(where, x, dx, cfg_.d_model, false);
        detail::check_view_gradient(where, dy, dx, cfg_.d_model, x.rows);
        detail::check_flat_gradient(where, grads, parameter_count(), "the memory's tensors");
        const ThreadScope team(threads_, 2.0 * work_estimate(x.rows));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        if (!backend::MemoryTraining<Backend, T>::read_snapshot_backward(cfg_, prepared_, s, x,
                                                                         batch, dy, dx, dW, grads)) {
            throw NonFiniteError(detail::concat(where, ": the gradients overflow, expected "
                                                       "finite values; grads are unchanged"));
        }
    }

    class Reverse;

private:
    /// read_snapshot's checks of the batch, the snapshot's pairs and x's shape.
    void check_snapshot_read(const Snapshot& s, int batch, View<const T> x, const char* where) const {
        detail::require<ConfigError>(batch >= 1, where, "batch", batch, ">= 1");
        const std::size_t pairs = static_cast<std::size_t>(batch) * static_cast<std::size_t>(cfg_.n_heads);
        detail::require<ShapeError>(s.pairs() == pairs, where, "snapshot.pairs()", s.pairs(),
                                    detail::concat("batch * n_heads = ", pairs));
        check_shape(batch, x.rows, x.cols, where);
    }

    void require_chunk_start(const State& state, const char* where) const {
        if (!mid_chunk_training && state.pending() != 0) {
            throw ConfigError(detail::concat(
                where, ": state.pending() = ", state.pending(),
                ", expected 0 (a training trace starts at a chunk boundary: a fresh state, "
                "or one fed a multiple of chunk = ", cfg_.chunk, " tokens)"));
        }
    }
    /// The training forward on checked views (require_chunk_start passed): the trace and
    /// diag replaced only if the kernels succeed.
    void train_checked(State& state, View<const T> x, View<T> y, Trace& trace,
                       Diagnostics<T>* diag) const {
        const ThreadScope team(threads_, 3.0 * work_estimate(x.rows));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        Trace t;
        Diagnostics<T> surprise;
        backend::MemoryTraining<Backend, T>::forward(cfg_, prepared_, state, x, y, t,
                                                     diag != nullptr ? &surprise : nullptr);
        trace = std::move(t);
        if (diag != nullptr) {
            *diag = std::move(surprise);
        }
    }

    /// The backward on views checked but for d_state_out: the kernels add the gradients to
    /// grads only if they and the incoming state's adjoint are finite; d_state_in is filled
    /// only if dx is finite too (`dx_finite()` tells: the host call downloads and scans it into
    /// a copy of its grads, the view call leaves dx to its caller).
    template <class DxFinite>
    void backward_checked(const Trace& trace, View<const T> dy, View<T> dx, View<T> grads,
                          MemoryStateGradient<T>* d_state_in,
                          const MemoryStateGradient<T>* d_state_out, DxFinite dx_finite) const {
        constexpr const char* where = "NeuralMemory::backward";
        const bool chained = d_state_out != nullptr && !d_state_out->empty();
        if (chained) {
            check_state_gradient(*d_state_out, trace);
        }
        const ThreadScope team(threads_, 3.0 * work_estimate(dy.rows));
        const detail::DenormalFlushScope flush(cfg_.flush_denormals);
        MemoryStateGradient<T> d_in;
        const bool finite = backend::MemoryTraining<Backend, T>::backward(
            cfg_, prepared_, trace, dy, dx, grads, chained ? d_state_out : nullptr,
            d_state_in != nullptr ? &d_in : nullptr);
        if (!finite || !dx_finite()) {
            throw NonFiniteError(detail::concat(where, ": the gradients overflow, expected "
                                                       "finite values; grads are unchanged"));
        }
        if (d_state_in != nullptr) {
            *d_state_in = std::move(d_in);
        }
    }
    /// The view forward's checks: position, state, shapes.
    void check_view_forward(const State& state, View<const T> x, View<T> y,
                            const char* where) const {
        detail::check_position_advance(where, state.position(), x.rows, state.batch());
        check_state(state, where);
        check_shape(state.batch(), x.rows, x.cols, where);
        detail::check_view_call(where, x, y, cfg_.d_model, false);
    }
    /// forward_part's checks of the trace against the state and the piece's m rows.
    void check_part(const State& state, Eigen::Index m, const Trace& trace,
                    const char* where) const {
        detail::require<ShapeError>(trace.batch >= 1, where, "trace.batch", trace.batch,
                                    ">= 1 (a trace from begin_trace)");
        detail::check_trace_config(trace.cfg, cfg_, where, "a memory");
        detail::require<ShapeError>(trace.batch == state.batch(), where, "trace.batch",
                                    trace.batch, detail::concat("state.batch() = ", state.batch()));
        const Eigen::Index N = trace.rows() / trace.batch;
        const Eigen::Index done = trace.recorded;
        if (state.position() != trace.start + done) {
            throw ConfigError(detail::concat(
                where, ": state.position() = ", state.position(), ", expected the trace's start ",
                trace.start, " plus its ", done, " rows recorded (the state begin_trace saw, fed "
                "this trace's earlier pieces only)"));
        }
        detail::require<ShapeError>(m <= N - done, where, "rows per stream of x", m,
                                    detail::concat("at most the trace's ", N - done, " rows left"));
    }
    void check_forward(const State& state, const MatrixRef<T>& x, const Matrix<T>& y) const {
        detail::check_position_advance("NeuralMemory::forward", state.position(), x.rows(),
                                       state.batch());
        check_state(state, "NeuralMemory::forward");
        check_input(state.batch(), x, "NeuralMemory::forward");
        if (detail::overlaps(x, y)) {
            throw ShapeError("NeuralMemory::forward: x and y share storage, expected "
                             "distinct matrices");
        }
    }
    void check_state(const State& state, const char* where) const {
        const bool same = state.batch() >= 1 && cfg_.same_stream(state.config());
        if (!same) {
            throw ConfigError(detail::concat(
                where, ": state was made for a different configuration (or default-constructed),"
                       " expected a state from make_state() of a memory with this configuration"));
        }
    }
    void check_shape(int batch, Eigen::Index rows, Eigen::Index cols, const char* where) const {
        if (cols != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", cols,
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (rows % batch != 0) {
            throw ShapeError(detail::concat(where, ": x has ", rows,
                                            " rows, expected a multiple of the batch = ", batch,
                                            " (B*N rows, sequence-major)"));
        }
    }
    void check_input(int batch, const MatrixRef<T>& x, const char* where) const {
        check_shape(batch, x.rows(), x.cols(), where);
        if (!detail::all_finite(x)) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
    }
    void check_weights(const std::vector<std::vector<Matrix<T>>>& weights, int batch,
                       const char* where) const {
        const std::size_t pairs = static_cast<std::size_t>(batch) * static_cast<std::size_t>(cfg_.n_heads);
        detail::require<ShapeError>(weights.size() == pairs, where, "weights.size()",
                                    weights.size(), detail::concat("batch * n_heads = ", pairs));
        for (std::size_t i = 0; i < pairs; ++i) {
            detail::require<ShapeError>(weights[i].size() == static_cast<std::size_t>(cfg_.depth),
                                        where, detail::concat("weights[", i, "].size()").c_str(),
                                        weights[i].size(), detail::concat("depth = ", cfg_.depth));
            for (int l = 1; l <= cfg_.depth; ++l) {
                const Matrix<T>& w = weights[i][static_cast<std::size_t>(l - 1)];
                if (w.rows() != cfg_.layer_in(l) || w.cols() != cfg_.layer_out(l)) {
                    throw ShapeError(detail::concat(where, ": weights[", i, "][", l - 1, "] is ",
                                                    w.rows(), " x ", w.cols(), ", expected ",
                                                    cfg_.layer_in(l), " x ", cfg_.layer_out(l)));
                }
            }
        }
    }
    /// d: a state gradient of the trace's batch (weights and momentum as check_weights, conv
    /// tails (K-1) x 3D per sequence, or none without a conv, pending rows as
    /// check_pending_gradient), finite, for a trace that ends at a chunk boundary unless
    /// mid_chunk_training.
    template <class Tr>
    void check_state_gradient(const MemoryStateGradient<T>& d, const Tr& trace) const {
        constexpr const char* where = "NeuralMemory::backward";
        const std::int64_t end = trace.start + trace.rows() / trace.batch;
        if (!mid_chunk_training && cfg_.update == UpdateMode::Chunked && end % cfg_.chunk != 0) {
            throw ConfigError(detail::concat(where, ": d_state_out is given but the trace ends at "
                                             "position ", end, ", expected a multiple of chunk = ",
                                             cfg_.chunk, " (a state gradient is taken at a chunk "
                                             "boundary)"));
        }
        check_weights(d.weights, trace.batch, "NeuralMemory::backward (d_state_out.weights)");
        check_weights(d.momentum, trace.batch, "NeuralMemory::backward (d_state_out.momentum)");
        const int K1 = cfg_.use_conv ? cfg_.conv_kernel - 1 : 0;
        const auto tails = static_cast<std::size_t>(trace.batch);
        detail::require<ShapeError>(d.conv_tail.size() == tails || (K1 == 0 && d.conv_tail.empty()),
                                    where, "d_state_out.conv_tail.size()", d.conv_tail.size(),
                                    detail::concat(tails, " (the batch)"));
        for (const Matrix<T>& t : d.conv_tail) {
            if (t.rows() != K1 || t.cols() != 3 * cfg_.inner_dim()) {
                throw ShapeError(detail::concat(where, ": d_state_out.conv_tail has a ", t.rows(),
                                                " x ", t.cols(), " matrix, expected ", K1, " x ",
                                                3 * cfg_.inner_dim(), " (K-1 x 3D)"));
            }
        }
        check_pending_gradient(d, trace.batch, static_cast<int>(end % cfg_.effective_chunk()));
        if (!d.finite()) {
            throw NonFiniteError(detail::concat(where, ": d_state_out has a NaN or infinite entry"));
        }
    }
    /// d_state_out's pending rows: each part empty (zero) or one per pair of p rows.
    void check_pending_gradient(const MemoryStateGradient<T>& d, int batch, int p) const {
        constexpr const char* where = "NeuralMemory::backward";
        const auto pairs = static_cast<std::size_t>(batch) * static_cast<std::size_t>(cfg_.n_heads);
        const auto parts = [&](const auto& v, const char* name) {
            detail::require<ShapeError>(
                v.empty() || (p > 0 && v.size() == pairs), where, name, v.size(),
                p > 0 ? detail::concat("0 (zero) or ", pairs, " (batch * n_heads)")
                      : std::string("0 (the trace ends at a chunk boundary: no pending rows)"));
        };
        parts(d.pending_a, "d_state_out.pending_a.size()");
        parts(d.pending_delta, "d_state_out.pending_delta.size()");
        parts(d.pending_gates, "d_state_out.pending_gates.size()");
        const auto shape = [&](const Matrix<T>& m, Eigen::Index cols, const char* name) {
            if (m.rows() != p || m.cols() != cols) {
                throw ShapeError(detail::concat(where, ": d_state_out.", name, " has a ", m.rows(),
                                                " x ", m.cols(), " matrix, expected ", p, " x ",
                                                cols, " (the pending rows after the trace)"));
            }
        };
        for (std::size_t i = 0; i < d.pending_a.size(); ++i) {
            detail::require<ShapeError>(d.pending_a[i].size() == static_cast<std::size_t>(cfg_.depth),
                                        where, "d_state_out.pending_a[i].size()",
                                        d.pending_a[i].size(), detail::concat(cfg_.depth, " (depth)"));
            for (int l = 1; l <= cfg_.depth; ++l) {
                shape(d.pending_a[i][static_cast<std::size_t>(l - 1)], cfg_.layer_in(l), "pending_a");
            }
        }
        for (std::size_t i = 0; i < d.pending_delta.size(); ++i) {
            detail::require<ShapeError>(d.pending_delta[i].size() == static_cast<std::size_t>(cfg_.depth),
                                        where, "d_state_out.pending_delta[i].size()",
                                        d.pending_delta[i].size(), detail::concat(cfg_.depth, " (depth)"));
            for (int l = 1; l <= cfg_.depth; ++l) {
                shape(d.pending_delta[i][static_cast<std::size_t>(l - 1)], cfg_.layer_out(l),
                      "pending_delta");
            }
        }
        for (const Matrix<T>& g : d.pending_gates) {
            shape(g, cfg_.gates != GateMode::Constant ? 3 : 0, "pending_gates");
        }
    }
    void check_index(const State& state, int b, int h, const char* where) const {
        check_state(state, where);
        detail::require<ShapeError>(b >= 0 && b < state.batch(), where, "b", b,
                                    detail::concat("in [0, ", state.batch(), ")"));
        detail::require<ShapeError>(h >= 0 && h < cfg_.n_heads, where, "h", h,
                                    detail::concat("in [0, ", cfg_.n_heads, ")"));
    }

    MemoryConfig cfg_;
    std::shared_ptr<const MemoryParams<T>> params_;  // the host copy (io, params())
    typename Kernels::Prepared prepared_{};          // the backend's (the CPU's: params_ itself)
    Threads threads_{};
};

}  // namespace titans

#include "reverse.hpp"
