#pragma once
// titans/models/block.hpp: the Titans blocks (math §7): memory alone (LMM), memory as a
// context (MAC), as a gate (MAG), as a layer (MAL), and the attention-only baseline (SWA),
// each a pre-norm residual block
//     h = x + Mixer(RMSNorm(x)),   out = h + FFN(RMSNorm(h))

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../attention/attention.hpp"
#include "../backend/backend.hpp"
#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/activation.hpp"
#include "../detail/eigen_math.hpp"
#include "../detail/enum_names.hpp"
#include "../detail/float_env.hpp"
#include "../detail/visit.hpp"
#include "../detail/random.hpp"
#include "../detail/shared.hpp"
#include "../error.hpp"
#include "../layers/feed_forward.hpp"
#include "../layers/glue.hpp"
#include "../layers/rms_norm.hpp"
#include "../limits.hpp"
#include "../memory/neural_memory.hpp"
#include "block_config.hpp"
#include "block_gradient.hpp"
#include "block_params.hpp"
#include "block_state.hpp"
#include "state_gradient.hpp"
#include "../threads.hpp"
#include "../types.hpp"

namespace titans {

/// One Titans block (math §7), pre-norm and residual:
///     u = RMSNorm(x),  h = x + Mixer(u),  out = h + FFN(RMSNorm(h))
/// with Mixer by kind (P = persistent tokens, M = the neural memory, streamed):
///   LMM  M(u)
///   MAG  o = RMSNorm_y(SWA*(P ‖ u)) ⊙ σ(RMSNorm_m(M(P ‖ u)))   (P always visible, window w)
///   MAL  o = SWA(M(P ‖ u))                                      (plain window over P ‖ u)
///   SWA  o = SWA*(P ‖ u)          (no memory: the attention-only baseline, MAG's branch alone)
///   MAC  per segment S of C tokens: h = M*_{t-1}(S) (read, memory as at the segment start),
///        y = Attn(P ‖ h ‖ S) (rows of S), write M with y, o = y ⊙ σ(M*_t(y))
/// P enters the memory (MAG, MAL) and the attention's window (MAL) once, at the start of each
/// stream (make_state). Shapes: x (B*N) x d -> (B*N) x d. Streaming in pieces of any sizes
/// equals one call. Choices where the paper is silent (math §7): MAC's h rows are visible
/// causally (h_j to tokens j' >= j of the segment) and M*_t(y_i) is the in-chunk read after
/// token i's own write, so no output depends on a later token; h is read from the memory's
/// query projection without its conv (the conv belongs to the memory's own input stream).
///
///     auto cfg = titans::BlockConfig::make(titans::BlockKind::MAG, 64, 4, 2, 128);
///     titans::Block<float> block(cfg, titans::BlockParams<float>::random(cfg, 1));
///     auto st = block.make_state(1);
///     titans::Matrixf y = block.forward(st, x);   // x: N x 64
template <class T, class Backend>
class Block {
public:
    using State = BlockState<T, Backend>;

private:
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;

public:

    /// Validates both (ConfigError, ShapeError, NonFiniteError) and keeps them.
    Block(BlockConfig config, BlockParams<T> params)
        : Block(std::move(config), std::make_shared<const BlockParams<T>>(std::move(params))) {}

    /// Shares `params` (not copied; ConfigError if null). The sub-layers refer to parts of
    /// them, so every weight is held once, however many copies of the block exist.
    Block(BlockConfig config, std::shared_ptr<const BlockParams<T>> params)
        : cfg_(std::move(config)),
          params_(detail::require_shared(std::move(params), "Block")),
          norm_mix_(((void)validated(cfg_, *params_), detail::share_part(params_, params_->norm_mix)),
                    cfg_.norm_eps),
          norm_ffn_(detail::share_part(params_, params_->norm_ffn), cfg_.norm_eps) {
        const BlockParams<T>& p = *params_;
        if (has_memory(cfg_.kind)) {
            memory_.emplace(cfg_.memory, detail::share_part(params_, p.memory));
        }
        if (cfg_.kind != BlockKind::LMM) {
            attention_.emplace(cfg_.attention, detail::share_part(params_, p.attention));
        }
        if (cfg_.kind == BlockKind::MAG) {
            norm_y_.emplace(detail::share_part(params_, p.norm_y), cfg_.norm_eps);
            norm_m_.emplace(detail::share_part(params_, p.norm_m), cfg_.norm_eps);
        }
        if (cfg_.use_ffn) {
            ffn_.emplace(cfg_.ffn, detail::share_part(params_, p.ffn));
        }
        install(derive());
    }

    [[nodiscard]] const BlockConfig& config() const { return cfg_; }
    [[nodiscard]] const BlockParams<T>& params() const { return *params_; }
    /// The parameters as held (shared with the model that owns them, if any).
    [[nodiscard]] const std::shared_ptr<const BlockParams<T>>& shared_params() const {
        return params_;
    }
    /// The block's memory; ConfigError for an SWA block (it has none: see has_memory()).
    [[nodiscard]] const NeuralMemory<T, Backend>& memory() const {
        if (!memory_) {
            throw ConfigError("Block::memory: an SWA block has no memory, expected a block of "
                              "kind LMM, MAC, MAG or MAL");
        }
        return *memory_;
    }

    /// A fresh state for `batch` streams; for MAG and MAL the memory (and for MAL the
    /// attention window) has already consumed the persistent tokens (SWA and MAG see them as
    /// the attention's prefix).
    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require_state_batch(
            "Block::make_state", batch, detail::scalar_name<T>(),
            [&](std::int64_t b) { return cfg_.state_bytes(b, std::int64_t{sizeof(T)}); });
        State st;
        st.kind_ = cfg_.kind;
        st.cfg_ = cfg_;
        st.batch_ = batch;
        if (memory_) st.memory_ = memory_->make_state(batch);
        if (cfg_.kind != BlockKind::LMM) {
            st.attention_ = attention_->make_state(batch);
        }
        const Eigen::Index np = cfg_.n_persistent;
        if ((cfg_.kind == BlockKind::MAG || cfg_.kind == BlockKind::MAL) && np > 0) {
            consume_persistent(st);
        }
        if (cfg_.kind == BlockKind::MAC) {
            const std::ptrdiff_t rows = std::ptrdiff_t{2} * batch * cfg_.segment,
                                 D = cfg_.attention.inner_dim();
            st.seg_k_ = Transfer::allocate(rows, D);
            st.seg_v_ = Transfer::allocate(rows, D);
            Glue::fill(Transfer::view(st.seg_k_), T(0));
            Glue::fill(Transfer::view(st.seg_v_), T(0));
            // Filled now (refreshed at every segment start) so every entry has a fixed shape.
            memory_->snapshot(st.memory_, st.snapshot_);
        }
        return st;
    }

    /// The next piece of every stream: x (B*N) x d -> (B*N) x d. Strong guarantee: if it
    /// throws (NonFiniteError when a sub-layer's output or state would not be finite), the
    /// state is as it was.
    [[nodiscard]] Matrix<T> forward(State& state, const MatrixRef<T>& x) const {
        // The memory's position is the largest of the block's (it also counts P for MAG, MAL).
        detail::check_position_advance("Block::forward", stream_position(state), x.rows(),
                                       state.batch_);
        check(state, x, "Block::forward");
        Matrix<T> y;
        Scope scope;  // CUDA: one stream, the checks read back once (model.hpp's run)
        const backend::Upload<Backend, T> in(x);  // in the scope: the call's buffers
        backend::Download<Backend, T> out(y, x.rows(), cfg_.d_model);
        if (!forward_checked(state, in.view(), out.view(), [&] { return !scope.flagged(); })) {
            const Scope strict(false);  // rolled back: again, each check throwing at its place
            forward_checked(state, in.view(), out.view());
        }
        out.finish();
        return y;
    }

    /// The backend-level forward: forward(state, x) on views in the backend's memory (device
    /// memory on a GPU), x (B*N) x d, y of x's shape and distinct: every sub-layer and the glue
    /// between them (residual sums, MAG's gate) run on the backend, nothing crosses to the host
    /// but the finiteness checks' row indices (MAC's segment attention still runs on the host:
    /// its mixer downloads u and uploads its output). Checks and guarantees as forward (x's
    /// finiteness by a glue kernel). What Model::forward chains.
    void forward(State& state, View<const T> x, View<T> y) const {
        forward_view(state, x, y, {});
    }

    /// The mixer alone (math §7) on already-normalised input u: (B*N) x d -> (B*N) x d.
    /// Advances the state (memory, attention, position) like forward(); strong guarantee.
    [[nodiscard]] Matrix<T> mix(State& state, const MatrixRef<T>& u) const {
        detail::check_position_advance("Block::mix", stream_position(state), u.rows(),
                                       state.batch_);
        check(state, u, "Block::mix");
        const ThreadScope team(threads_, work_estimate(u.rows()));
        Guard guard(*this, state);
        Matrix<T> o;
        const backend::Upload<Backend, T> in(u);
        backend::Download<Backend, T> out(o, u.rows(), cfg_.d_model);
        mix_unchecked(state, in.view(), out.view());
        require_finite(View<const T>(out.view()), state, "the mixer's output");
        out.finish();
        guard.commit();
        return o;
    }

    /// What the training forward keeps for backward (math §9; models/block_training.hpp).
    using Trace = BlockTrace<T, Backend>;
    /// Whether this backend has the training pass of every sub-layer (the CPU's and CUDA's
    /// do): the training calls exist. Which kinds train is trains(kind).
    static constexpr bool trainable = backend::MemoryTraining<Backend, T>::available &&
                                      backend::AttentionTraining<Backend, T>::available;
    /// Whether blocks of kind k train on this backend: every kind on the CPU and CUDA; on a
    /// backend without the memory's staged reverse every kind but MAC, whose training calls
    /// throw ConfigError there.
    [[nodiscard]] static constexpr bool trains(BlockKind k) {
        return trainable && (k != BlockKind::MAC || backend::MemoryTraining<Backend, T>::staged);
    }

    /// The training forward (math §9): forward(state, x), keeping in `trace` what backward
    /// needs; y = the output. From a fresh state (position 0) the persistent tokens go through
    /// the memory (and MAL's window) in this call, as rows before each sequence's, so that
    /// they are learnt. It also starts from a state that has seen earlier pieces (chained
    /// pieces: see backward's d_state_in / d_state_out): on the CPU and CUDA (backends whose
    /// memory has mid_chunk_training) anywhere; elsewhere when the memory is at a chunk boundary
    /// (its position, persistent tokens included for MAG and MAL, a multiple of chunk;
    /// ConfigError otherwise); MAC anywhere in a segment. Same outputs as forward (to
    /// rounding) and a state that continues the same; on an error nothing changes (state, y,
    /// trace). MAC's backward reverses its segments last first through the memory's updates
    /// and its segment-start reads (mac_training.hpp).
    ///
    ///     Block<double>::Trace trace;
    ///     block.forward(state, x, y, trace);
    ///     auto grads = BlockParams<double>::zeros(cfg);
    ///     block.backward(trace, dy, dx, grads);  // dy = dL/dy -> dx, grads += dL/dparams
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& y, Trace& trace) const
        requires(trainable)
    {
        detail::BlockTraining<T, Backend>::forward(*this, state, x, y, trace);
    }

    /// The backward pass (math §9) of a training forward: dy = dL/dy (the trace's rows x d)
    /// gives dx = dL/dx (resized; not sharing dy's storage), and the gradient of every
    /// parameter the block uses (norms, memory, attention, persistent tokens, feed-forward)
    /// is added to grads (shaped as params(), e.g. BlockParams<T>::zeros(config())).
    ///
    /// Chained pieces: d_state_out, if given and not empty(), is dL/d(the state the call
    /// left), its memory part (MemoryStateGradient: mid-chunk with the pending rows'
    /// adjoints), its attention part for MAG and MAL,
    /// its mac part (segment buffers and snapshot) for MAC (a part the kind lacks: ConfigError);
    /// d_state_in, if given, receives dL/d(the state the call started from) (empty for a call
    /// from a fresh state, whose memory restarts from W^0 and P). Reversing pieces last first,
    /// each with the next one's d_state_in as its d_state_out, gives the dx and grads of one
    /// call over their concatenation.
    ///
    /// Throws ShapeError (empty or moved-from trace, one whose sizes are not its forward's,
    /// shapes), ConfigError (another configuration's trace), NonFiniteError (dy, d_state_out,
    /// or gradients that overflow); nothing changes then.
    void backward(const Trace& trace, const MatrixRef<T>& dy, Matrix<T>& dx,
                  BlockParams<T>& grads, BlockStateGradient<T>* d_state_in = nullptr,
                  const BlockStateGradient<T>* d_state_out = nullptr) const
        requires(trainable)
    {
        detail::BlockTraining<T, Backend>::backward(*this, trace, dy, dx, grads, d_state_in,
                                                    d_state_out);
    }

    /// The backend-level training forward: forward(state, x, y, trace) on views in the
    /// backend's memory (x, y (B*N) x d, distinct), the activations and the trace kept there.
    /// Checks as the host call's but x's finiteness, which is the caller's (an output that is
    /// not finite throws NonFiniteError as forward's); on an error the state and trace are
    /// unchanged (y may have been written). How a model trains its blocks without a round trip.
    void forward(State& state, View<const T> x, View<T> y, Trace& trace) const
        requires(trainable)
    {
        detail::BlockTraining<T, Backend>::forward(*this, state, x, y, trace);
    }

    /// The backend-level backward: backward(trace, dy, dx, grads, d_state_in, d_state_out)
    /// with dy and dx views in the backend's memory (the trace's rows x d, distinct) and grads
    /// the block's gradients flat there (1 x parameter_count(): every tensor BlockParams::
    /// tensors visits, row-major, one after the other; a slice of a gradient buffer), added
    /// to. Checks as the host call's but dy's finiteness (gradients that are not finite still
    /// throw); on an error grads and d_state_in are unchanged (dx may have been written).
    void backward(const Trace& trace, View<const T> dy, View<T> dx, View<T> grads,
                  BlockStateGradient<T>* d_state_in = nullptr,
                  const BlockStateGradient<T>* d_state_out = nullptr) const
        requires(trainable)
    {
        detail::BlockTraining<T, Backend>::backward(*this, trace, dy, dx, grads, d_state_in,
                                                    d_state_out);
    }

    /// Entries of the parameters (every tensor BlockParams::tensors visits for config()): the
    /// length of the block's flat gradient.
    [[nodiscard]] Eigen::Index parameter_count() const {
        return detail::flat_size(*params_, cfg_);
    }

    /// Throws unless `trace` was filled by the training forward of a block of this
    /// configuration (every setting but the memory's flush_denormals) and holds the sizes that
    /// forward left: batch, rows and start, and every sub-layer's trace (each validated by the
    /// sub-layer, with the rows this block gives it). ShapeError (empty, moved-from, sizes
    /// changed), ConfigError (another configuration, the first differing setting named).
    /// `where` names the call.
    void validate_trace(const Trace& trace, const char* where = "Block::validate_trace") const
        requires(trainable)
    {
        detail::BlockTraining<T, Backend>::check_trace(*this, trace, where);
    }

    /// Transactions over several calls, as NeuralMemory::begin: after begin(state), forward
    /// and mix calls are undone together by rollback(state) (memory, attention, MAC segment
    /// buffers and position, bit-identical) or kept by commit(state). Without one, each call
    /// is its own. begin returns false (opening nothing) if one is already open.
    bool begin(State& state) const {
        check_state(state, "Block::begin");
        auto& u = state.undo_;
        if (u.open) {
            return false;
        }
        if (memory_) memory_->begin(state.memory_);
        if (uses_attention_state()) {
            attention_->begin(state.attention_);
        }
        u.open = true;
        u.wrapped = u.snap_saved = false;
        u.position = state.position_;
        u.row0 = u.hi = cfg_.kind == BlockKind::MAC
                            ? 2 * static_cast<int>(state.position_ % cfg_.segment)
                            : 0;
        return true;
    }
    void commit(State& state) const {
        if (memory_) memory_->commit(state.memory_);
        if (uses_attention_state()) {
            attention_->commit(state.attention_);
        }
        state.undo_.open = false;
    }
    void rollback(State& state) const {
        auto& u = state.undo_;
        if (!u.open) {
            return;
        }
        if (memory_) memory_->rollback(state.memory_);
        if (uses_attention_state()) {
            attention_->rollback(state.attention_);
        }
        if (cfg_.kind == BlockKind::MAC) {
            detail::MacMixer<T, Backend>::restore_segment(state);
        }
        state.position_ = u.position;
        u.open = false;
    }

    /// Thread settings of this block's calls, as NeuralMemory::set_threads (titans/threads.hpp);
    /// they decide for the whole call, sub-layers included.
    void set_threads(Threads t) {
        t.validate("Block::set_threads");
        threads_ = t;
    }
    [[nodiscard]] const Threads& threads() const { return threads_; }

    /// Approximate multiply-adds of a forward over `rows` tokens (memory, attention, FFN).
    [[nodiscard]] double work_estimate(Eigen::Index rows) const {
        double w = memory_ ? memory_->work_estimate(rows) : 0.0;
        if (attention_) {
            w += attention_->work_estimate(rows, cfg_.n_persistent);
        }
        if (ffn_) {
            w += static_cast<double>(rows) * 3.0 * cfg_.d_model * cfg_.ffn.hidden_dim();
        }
        return w;
    }

    /// Throws ConfigError unless `state` can be continued by this block: made by make_state()
    /// of a block with the same settings, its memory and attention states included.
    void validate_state(const State& state) const { check_state(state, "Block"); }

    /// Every entry 0, shaped as the adjoint of `state` (a BlockStateGradient as backward's
    /// d_state_out takes it for a trace that ended in `state`): the memory part
    /// (MemoryStateGradient::zeros; not SWA), the attention window's (MAG, MAL, SWA:
    /// AttentionStateGradient::zeros at the attention state's position, which for MAL counts
    /// the persistent tokens), and MAC's segment part (per stream keys and values of
    /// 2 (position % segment) x D_att rows, per (stream b, head h), index b * H + h, the
    /// memory's weight shapes). The parts to add one's own gradient into, or to give backward
    /// when only another part (or another block) has one. ConfigError: a state of another block.
    ///
    ///     auto d = block.zero_state_gradient(state);      // after block.forward(state, x, y, trace)
    ///     d.attention.values[0](0, 0) = 1.0;              // dL/d(a value the window keeps)
    ///     block.backward(trace, dy, dx, grads, nullptr, &d);
    [[nodiscard]] BlockStateGradient<T> zero_state_gradient(const State& state) const {
        check_state(state, "Block::zero_state_gradient");
        const int B = state.batch_;
        BlockStateGradient<T> d;
        if (memory_) {
            d.memory = MemoryStateGradient<T>::zeros(cfg_.memory, B, state.memory_.pending());
        }
        if (uses_attention_state()) {
            d.attention = AttentionStateGradient<T>::zeros(cfg_.attention, B,
                                                           state.attention_.position());
        }
        if (cfg_.kind == BlockKind::MAC) {
            const auto rows = static_cast<Eigen::Index>(2 * (state.position_ % cfg_.segment));
            d.mac.keys.assign(static_cast<std::size_t>(B),
                              Matrix<T>::Zero(rows, cfg_.attention.inner_dim()));
            d.mac.values = d.mac.keys;
            d.mac.snapshot = d.memory.weights;  // zeros of the memory's weight shapes
        }
        return d;
    }

private:
    friend struct detail::BlockTraining<T, Backend>;
    friend struct detail::MixerTraining<T, Backend>;
    friend struct detail::MacTraining<T, Backend>;
    friend struct detail::MacMixer<T, Backend>;
    friend class Model<T, Backend>;  // set_parameters: derive() again after new values
    friend struct detail::ModelParameters<T, Backend>;  // set_parameters(flat): stage, adopt

    /// MAC: P W_K and P W_V (N_p x D) on the backend, made by Glue::product_plain (on the
    /// CPU the bits its training pass and mixer have always read); shared by copies of the
    /// block.
    struct MacPrefix {
        Buffer k, v;
    };
    /// What the block computes once from its parameters: MAG's and SWA's persistent prefix
    /// projected by the attention (P W_K, P W_V), MAC's by the glue (N_p x D), and P itself
    /// on the backend (the rows a training forward puts before each sequence's, keeps as its
    /// attention's prefix, or, for MAC, multiplies for P's gradient; shared by copies of the
    /// block). Everything in the backend's memory, made there.
    struct Derived {
        std::optional<typename Attention<T, Backend>::Prefix> prefix;
        std::shared_ptr<const MacPrefix> mac_prefix;
        std::shared_ptr<const Buffer> persistent;
    };
    /// Derived from the parameters as held now (nothing changes if it throws): P (and, for
    /// MAC, W_K and W_V) go to the backend once.
    Derived derive() const {
        if (!attention_) return {};
        const backend::Upload<Backend, T> rows(params_->persistent);
        if (cfg_.kind != BlockKind::MAC) return derive(attention_->prepared(), rows.view(), {});
        const backend::Upload<Backend, T> w_k(params_->attention.w_k), w_v(params_->attention.w_v);
        return derive(attention_->prepared(), rows.view(), {w_k.view(), w_v.view()});
    }
    /// Derived from the attention's parameters `att` and P's rows `persistent` (p x d_model),
    /// both in the backend's memory; for MAC, `kv` holds W_K and W_V there (d x D each).
    Derived derive(const typename Attention<T, Backend>::Prepared& att, View<const T> persistent,
                   std::array<View<const T>, 2> kv) const {
        Derived d;
        if (cfg_.kind == BlockKind::MAG || cfg_.kind == BlockKind::SWA) {
            d.prefix.emplace(attention_->project_prefix(att, persistent));
        }
        if (cfg_.kind == BlockKind::MAC) {
            const Eigen::Index D = cfg_.attention.inner_dim();
            MacPrefix m{Transfer::allocate(persistent.rows, D), Transfer::allocate(persistent.rows, D)};
            if (persistent.rows > 0) {
                Glue::product_plain(persistent, kv[0], Transfer::view(m.k));
                Glue::product_plain(persistent, kv[1], Transfer::view(m.v));
            }
            d.mac_prefix = std::make_shared<const MacPrefix>(std::move(m));
        }
        if (cfg_.n_persistent > 0) {  // MAC: for P's gradient in its training pass
            Buffer p = Transfer::allocate(persistent.rows, persistent.cols);
            Glue::copy(persistent, Transfer::view(p));
            d.persistent = std::make_shared<const Buffer>(std::move(p));
        }
        return d;
    }
    /// New parameter values as the block's kernels would hold them (every sub-layer's
    /// prepare_flat and what derive() makes, from them), before any is taken.
    struct Staged {
        using Norm = typename RMSNorm<T, Backend>::Prepared;
        Norm norm_mix, norm_ffn;
        std::optional<typename NeuralMemory<T, Backend>::Prepared> memory;
        std::optional<typename Attention<T, Backend>::Prepared> attention;
        std::optional<Norm> norm_y, norm_m;
        std::optional<typename FeedForward<T, Backend>::Prepared> ffn;
        Derived derived;
    };
    /// Staged from the block's parameters flat in the backend's memory (1 x parameter_count(),
    /// BlockParams::tensors order): nothing crosses to the host.
    Staged stage(View<const T> flat) const {
        const auto v = detail::BlockGradientViews<T, const T>::cut(flat, *params_, cfg_);
        Staged s;
        s.norm_mix = norm_mix_.prepare_flat(v.norm_mix);
        s.norm_ffn = norm_ffn_.prepare_flat(v.norm_ffn);
        if (memory_) s.memory = memory_->prepare_flat(v.memory);
        if (norm_y_) s.norm_y = norm_y_->prepare_flat(v.norm_y);
        if (norm_m_) s.norm_m = norm_m_->prepare_flat(v.norm_m);
        if (ffn_) s.ffn = ffn_->prepare_flat(v.ffn);
        if (attention_) {
            s.attention = attention_->prepare_flat(v.attention);
            // W_K and W_V: the attention's second and third tensors (W_Q, W_K, W_V, W_O).
            const auto w = detail::flat_views(v.attention, params_->attention, cfg_.attention);
            s.derived = derive(*s.attention, v.persistent, {w[1], w[2]});
        }
        return s;
    }
    /// The kernels use what `s` holds from now on (params() keeps its host values: the model
    /// refreshes them).
    void adopt(Staged&& s) noexcept {
        norm_mix_.adopt(std::move(s.norm_mix));
        norm_ffn_.adopt(std::move(s.norm_ffn));
        if (memory_) memory_->adopt(std::move(*s.memory));
        if (norm_y_) norm_y_->adopt(std::move(*s.norm_y));
        if (norm_m_) norm_m_->adopt(std::move(*s.norm_m));
        if (ffn_) ffn_->adopt(std::move(*s.ffn));
        if (attention_) attention_->adopt(std::move(*s.attention));
        install(std::move(s.derived));
    }

    void install(Derived&& d) noexcept {
        prefix_ = std::move(d.prefix);
        mac_prefix_ = std::move(d.mac_prefix);
        persistent_ = std::move(d.persistent);
    }

    /// Opens a transaction for one call (unless one is open); rolls it back on unwinding.
    class Guard {
    public:
        Guard(const Block& block, State& state)
            : block_(block), state_(state), own_(block.begin(state)) {}
        Guard(const Guard&) = delete;
        Guard& operator=(const Guard&) = delete;
        ~Guard() {
            if (!done_) block_.rollback(state_);
        }
        void commit() {
            if (own_) block_.commit(state_);
            done_ = true;
        }

    private:
        const Block& block_;
        State& state_;
        bool own_, done_ = false;
    };

    /// A model's call chaining each block's last sum into the norm after it (inside a
    /// deferring call scope, where the norm has forward_sum: Model::blocks_and_head): `u_in`
    /// this block's RMSNorm_mix(x), made by the block before (empty: the block makes it);
    /// `next` the norm after this block (the next block's RMSNorm_mix, or the model's final
    /// norm) and `u_next` where the block's last sum writes next(y), the output's check
    /// deferred in that kernel. Null `next`: the plain forward.
    struct Link {
        View<const T> u_in{};
        const RMSNorm<T, Backend>* next = nullptr;
        View<T> u_next{};
    };

    /// forward(state, x, y) with its checks, linked to the norms around it (Link).
    void forward_view(State& state, View<const T> x, View<T> y, const Link& link) const {
        constexpr const char* where = "Block::forward";
        detail::check_position_advance(where, stream_position(state), x.rows, state.batch_);
        check_rows(state, x.rows, x.cols, where);
        detail::check_view_call(where, x, y, cfg_.d_model, false);
        // Deferred, the output's check covers x's: y = x + Mixer(u) (+ FFN) keeps a
        // non-finite entry of x non-finite.
        if (!backend::checks_deferred<Glue>() && Glue::nonfinite_row(x) >= 0) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
        forward_checked(state, x, y, backend::AllChecked{}, link);
    }

    /// What a host-matrix forward call runs in (CUDA: call_scope.cuh), or nothing.
    using Scope = typename backend::CallScopeOf<Glue>::type;
    /// Held around a sub-layer whose output a later check of the call covers (glue.hpp).
    using Covered = typename backend::CoveredOf<Glue>::type;

    /// forward on checked views: u = RMSNorm(x), y = x + Mixer(u), y += FFN(RMSNorm(y)), the
    /// activations in the backend's memory. False (the call rolled back) if settled() says a
    /// check deferred to a CallScope failed.
    template <class Settled = backend::AllChecked>
    bool forward_checked(State& state, View<const T> x, View<T> y, Settled settled = {},
                         const Link& link = {}) const {
        const ThreadScope team(threads_, work_estimate(x.rows));
        Guard guard(*this, state);
        Buffer u = backend::call_scratch<Backend, T>(x.rows, x.cols);
        if (link.u_in.data == nullptr) {
            norm_mix_.forward(x, Transfer::view(u));
        }
        mix_unchecked(state, link.u_in.data == nullptr ? cview(u) : link.u_in, y);
        std::ptrdiff_t bad = -1;  // the output's first non-finite row
        if (cfg_.use_ffn) {
            bad = ffn_and_sums(x, y, Transfer::view(u), state, link);
        } else {
            bad = last_sum(x, y, link);
        }
        if (bad >= 0) {
            throw_nonfinite(bad, y.rows, state, "the output");
        }
        if (!settled()) {
            return false;
        }
        guard.commit();
        return true;
    }

    static View<const T> cview(const Buffer& b) { return Transfer::view(b); }

    /// y = a + y and its first non-finite row (-1: none, or the check deferred), and with
    /// link.next, next(y) into link.u_next in the same kernel (its check deferred there).
    std::ptrdiff_t last_sum(View<const T> a, View<T> y, const Link& link) const {
        if constexpr (requires { link.next->forward_sum(a, y, link.u_next); }) {
            if (link.next != nullptr) {
                link.next->forward_sum(a, y, link.u_next);
                return -1;
            }
        }
        return backend::add_nonfinite_row<Glue>(a, View<const T>(y), y);
    }

    /// y = x + y (checked), u = RMSNorm_ffn(y), y = FFN(u) + y, and y's first non-finite row
    /// as last_sum gives it. With link.next (a deferring call: the sums' checks deferred),
    /// where the backend has it (FeedForward::forward_sums), all in the feed-forward's own
    /// kernel (the same bits).
    std::ptrdiff_t ffn_and_sums(View<const T> x, View<T> y, View<T> u, const State& state,
                                const Link& link) const {
        Buffer f = backend::call_scratch<Backend, T>(x.rows, x.cols);
        if constexpr (requires { ffn_->forward_sums(norm_ffn_, x, y, u, Transfer::view(f),
                                                    *link.next, link.u_next); }) {
            if (link.next != nullptr) {
                ffn_->forward_sums(norm_ffn_, x, y, u, Transfer::view(f), *link.next,
                                   link.u_next);
                return -1;
            }
        }
        residual_norm(x, y, u);
        require_residual_sum(y, state);
        ffn_->forward(View<const T>(u), Transfer::view(f));
        return last_sum(cview(f), y, link);
    }

    /// y = x + y, then u = RMSNorm_ffn(y): in one kernel where the backend has it
    /// (RMSNorm::forward_sum), the same bits either way.
    void residual_norm(View<const T> x, View<T> y, View<T> u) const {
        if constexpr (requires { norm_ffn_.forward_sum(x, y, u); }) {
            norm_ffn_.forward_sum(x, y, u);
        } else {
            Glue::add(x, y, y);
            norm_ffn_.forward(y, u);
        }
    }

    /// MAG's and MAL's fresh state takes P first, on the backend (nothing crosses to the
    /// host): each sequence's memory reads and writes P's rows, and MAL's window keeps M(P).
    void consume_persistent(State& st) const {
        const int batch = st.batch_;
        const Eigen::Index np = cfg_.n_persistent;
        Buffer p = Transfer::allocate(np * batch, cfg_.d_model);
        Glue::copy_rows(cview(*persistent_), Transfer::view(p), {batch, np, 0, 0, np, 0});
        Buffer yp = Transfer::allocate(np * batch, cfg_.d_model);
        memory_->forward(st.memory_, cview(p), Transfer::view(yp));
        if (cfg_.kind == BlockKind::MAL) {
            attention_->forward(st.attention_, cview(yp), Transfer::view(p), nullptr);
        }
    }

    void mix_unchecked(State& state, View<const T> u, View<T> o) const {
        try {
            mix_kind(state, u, o);
        } catch (const NonFiniteError& e) {
            rethrow_named(e);
        }
    }

    /// A sub-layer's NonFiniteError again, naming the block.
    [[noreturn]] void rethrow_named(const NonFiniteError& e) const {
        throw NonFiniteError(detail::concat(
            "Block (", to_string(cfg_.kind), "): ", e.what(),
            cfg_.kind == BlockKind::MAG || cfg_.kind == BlockKind::MAL
                ? " (memory positions count the persistent tokens first)"
                : ""));
    }

    /// o = Mixer(u) by kind, on the backend (MAC: see mix_mac_views); advances the position.
    void mix_kind(State& state, View<const T> u, View<T> o) const {
        switch (cfg_.kind) {
            case BlockKind::LMM: {
                // o goes straight into the residual sum, whose check covers it
                [[maybe_unused]] const Covered by_the_output;
                memory_->forward(state.memory_, u, o);
                break;
            }
            case BlockKind::MAG: mix_mag(state, u, o); break;
            case BlockKind::MAL: {
                // o goes straight into the residual sum, whose check covers it, and so does m:
                // a non-finite entry of m makes its row's q, k and v (m [W_Q | W_K | W_V]),
                // then that row's output, non-finite
                [[maybe_unused]] const Covered by_the_output;
                Buffer m = backend::call_scratch<Backend, T>(u.rows, u.cols);
                memory_->forward(state.memory_, u, Transfer::view(m));
                attention_->forward(state.attention_, cview(m), o, nullptr);
                break;
            }
            case BlockKind::MAC: detail::MacMixer<T, Backend>::mix(*this, state, u, o); break;
            case BlockKind::SWA: {
                [[maybe_unused]] const Covered by_the_output;
                attention_->forward(state.attention_, u, o, &*prefix_);
                break;
            }
        }
        state.position_ += u.rows / state.batch_;
    }

    /// The mixer's residual sum y checked (NonFiniteError naming it), unless the call's checks
    /// are deferred: then the output's check covers it (y + FFN(RMSNorm(y)) keeps a non-finite
    /// entry of y non-finite).
    void require_residual_sum(View<const T> y, const State& state) const {
        if (!backend::checks_deferred<Glue>()) {
            require_finite(y, state, "the mixer's residual sum");
        }
    }

    /// NonFiniteError naming the block, `what`, the sequence and the position of the first
    /// non-finite row of m (rows of the call that ended at state.position_).
    void require_finite(const Matrix<T>& m, const State& state, const char* what) const {
        if (detail::all_finite(m)) {
            return;
        }
        throw_nonfinite(detail::first_nonfinite_row(m), m.rows(), state, what);
    }
    /// The same of a view in the backend's memory (a glue kernel finds the row).
    void require_finite(View<const T> m, const State& state, const char* what) const {
        const std::ptrdiff_t r = Glue::nonfinite_row(m);
        if (r >= 0) {
            throw_nonfinite(r, m.rows, state, what);
        }
    }
    [[noreturn]] void throw_nonfinite(Eigen::Index r, Eigen::Index rows, const State& state,
                                      const char* what) const {
        const Eigen::Index N = rows / state.batch_;
        throw NonFiniteError(detail::concat(
            "Block (", to_string(cfg_.kind), "): ", what, " is not finite at sequence ", r / N,
            ", position ", state.undo_.position + r % N,
            " (a sub-layer overflows), expected finite values; the state is unchanged"));
    }

    bool uses_attention_state() const { return has_window(cfg_.kind); }

    /// The position forward's overflow check advances: the memory's (it also counts P for
    /// MAG and MAL), the block's for SWA.
    static std::int64_t stream_position(const State& state) {
        return has_memory(state.kind_) ? state.memory_.position() : state.position_;
    }

    /// True if a state made by a block with settings `a` can be continued by one with `b`:
    /// equal kind, width, memory (MemoryConfig::same_stream), persistent count, MAC segment and,
    /// for the kinds with attention, every attention setting (heads, width, window, RoPE).
    /// The feed-forward and the norms hold no state.
    static bool same_stream(const BlockConfig& a, const BlockConfig& b) {
        if (a.kind != b.kind || a.d_model != b.d_model ||
            (has_memory(a.kind) && !a.memory.same_stream(b.memory))) {
            return false;
        }
        if (a.kind == BlockKind::LMM) {
            return true;
        }
        const AttentionConfig &x = a.attention, &y = b.attention;
        return a.n_persistent == b.n_persistent &&
               (a.kind != BlockKind::MAC || a.segment == b.segment) &&
               x.d_model == y.d_model && x.n_heads == y.n_heads &&
               x.head_dim() == y.head_dim() && x.window == y.window && x.rope == y.rope &&
               (!x.rope || x.rope_base == y.rope_base);
    }

    void check_state(const State& state, const char* where) const {
        if (state.batch_ < 1 || !same_stream(state.cfg_, cfg_) ||
            (memory_ && state.memory_.batch() != state.batch_) ||
            (uses_attention_state() && state.attention_.batch() != state.batch_) ||
            (cfg_.kind == BlockKind::MAC &&
             (Transfer::view(state.seg_k_).rows != std::ptrdiff_t{2} * state.batch_ * cfg_.segment ||
              state.snapshot_.pairs() != static_cast<std::size_t>(state.batch_) *
                                             static_cast<std::size_t>(cfg_.memory.n_heads)))) {
            throw ConfigError(detail::concat(where, ": state was made for a different block (or "
                                                    "default-constructed), expected a state from "
                                                    "make_state() of this block"));
        }
    }
    void check_rows(const State& state, Eigen::Index rows, Eigen::Index cols,
                    const char* where) const {
        check_state(state, where);
        if (cols != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", cols,
                                            " columns, expected d_model = ", cfg_.d_model));
        }
        if (rows % state.batch_ != 0) {
            throw ShapeError(detail::concat(where, ": x has ", rows,
                                            " rows, expected a multiple of the state's batch = ",
                                            state.batch_));
        }
    }
    void check(const State& state, const MatrixRef<T>& x, const char* where) const {
        check_rows(state, x.rows(), x.cols(), where);
        if (!detail::all_finite(x)) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
    }

    static const BlockConfig& validated(const BlockConfig& cfg, const BlockParams<T>& p) {
        cfg.validate_for<T>();
        p.validate(cfg);
        return cfg;
    }

    /// MAG: o = RMSNorm_y(SWA*(P ‖ u)) ⊙ σ(RMSNorm_m(M(P ‖ u))), P W_K and P W_V projected
    /// once, at construction; the attention's output is normalised and gated in o.
    void mix_mag(State& st, View<const T> u, View<T> o) const {
        constexpr bool fused = requires { norm_y_->forward_gated(*norm_m_, o, View<const T>(o)); };
        Buffer m = backend::call_scratch<Backend, T>(u.rows, u.cols);
        {
            // fused: forward_gated checks o and m as it reads them (deferred)
            [[maybe_unused]] const std::conditional_t<fused, Covered, backend::NotCovered> gate;
            attention_->forward(st.attention_, u, o, &*prefix_);
            memory_->forward(st.memory_, u, Transfer::view(m));
        }
        if constexpr (fused) {
            norm_y_->forward_gated(*norm_m_, o, cview(m));  // one kernel, the same bits
        } else {
            norm_m_->forward(cview(m), Transfer::view(m));
            norm_y_->forward(o, o);
            Glue::gate(o, cview(m), o);
        }
    }

    BlockConfig cfg_;
    std::shared_ptr<const BlockParams<T>> params_;
    RMSNorm<T, Backend> norm_mix_, norm_ffn_;
    std::optional<NeuralMemory<T, Backend>> memory_;    // all kinds but SWA
    Threads threads_{};
    std::optional<Attention<T, Backend>> attention_;    // all kinds but LMM
    std::optional<RMSNorm<T, Backend>> norm_y_, norm_m_;  // MAG
    std::optional<FeedForward<T, Backend>> ffn_;        // if use_ffn
    std::optional<typename Attention<T, Backend>::Prefix> prefix_;  // MAG, SWA: P W_K, P W_V
    std::shared_ptr<const MacPrefix> mac_prefix_;  // MAC: its mixer's P W_K, P W_V
    std::shared_ptr<const Buffer> persistent_;  // N_p > 0: P on the backend
};

}  // namespace titans

#include "mac_mixer.hpp"  // MAC's mixer: detail::MacMixer
