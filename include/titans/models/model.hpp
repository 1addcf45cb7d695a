#pragma once
// titans/models/model.hpp: a stack of Titans blocks with an embedding (or raw vectors in),
// a final RMSNorm and an output head.

#include <array>
#include <optional>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../detail/flat_tensors.hpp"
#include "../detail/product.hpp"
#include "../detail/visit.hpp"
#include "../detail/random.hpp"
#include "../detail/shared.hpp"
#include "../error.hpp"
#include "../layers/glue.hpp"
#include "../layers/rms_norm.hpp"
#include "../limits.hpp"
#include "../threads.hpp"
#include "../types.hpp"
#include "backend_scalars.hpp"
#include "block.hpp"

namespace titans {

/// Settings of a Model. vocab_size > 0: token ids in, logits (vocab_size wide) out.
/// vocab_size = 0: raw d_model-wide vectors in, d_out-wide vectors out (d_out = 0: d_model).
struct ModelConfig {
    int vocab_size = 0;
    int d_model = 64;
    int d_out = 0;
    std::vector<BlockConfig> blocks;  ///< one per layer; kinds may be mixed
    double norm_eps = 1e-6;

    /// `n_layers` blocks of one kind (see BlockConfig::make).
    [[nodiscard]] static ModelConfig uniform(BlockKind kind, int n_layers, int d, int heads,
                                             int depth, int span, int vocab = 0, int chunk = 64) {
        detail::require_in_range(n_layers, 0, limits::max_blocks, "ModelConfig::uniform",
                                 "n_layers");
        ModelConfig c;
        c.vocab_size = vocab;
        c.d_model = d;
        for (int i = 0; i < n_layers; ++i) {
            c.blocks.push_back(BlockConfig::make(kind, d, heads, depth, span, chunk));
        }
        return c;
    }

    [[nodiscard]] int output_dim() const {
        return vocab_size > 0 ? vocab_size : (d_out > 0 ? d_out : d_model);
    }

    /// Serialization hook: calls v(name, field) for every setting, in declaration order:
    /// vocab_size, d_model, d_out, blocks.{i}.* (BlockConfig::fields) for every block,
    /// norm_eps. The number of blocks is not a field: a reader sizes `blocks` before visiting.
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, ModelConfig>);
        using S = std::string;
        v(S("vocab_size"), self.vocab_size);
        v(S("d_model"), self.d_model);
        v(S("d_out"), self.d_out);
        for (std::size_t i = 0; i < self.blocks.size(); ++i) {
            BlockConfig::fields(self.blocks[i],
                                detail::prefixed(detail::visit_name("blocks", i), v));
        }
        v(S("norm_eps"), self.norm_eps);
    }

    /// Elements of the ModelParams of this configuration (embedding, every block, norm_final,
    /// head), in 64 bits (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t parameter_count() const {
        using detail::sat_add;
        using detail::sat_mul;
        std::int64_t n = sat_add(sat_mul(vocab_size, d_model), d_model,
                                 sat_mul(d_model, output_dim()));
        for (const BlockConfig& b : blocks) n = sat_add(n, b.parameter_count());
        return n;
    }

    /// Bytes of the state make_state(batch) builds (every block's), `scalar_bytes` per
    /// element, in 64 bits (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t state_bytes(std::int64_t batch, std::int64_t scalar_bytes) const {
        std::int64_t n = limits::matrix_overhead_bytes;
        for (const BlockConfig& b : blocks) {
            n = detail::sat_add(n, b.state_bytes(batch, scalar_bytes));
        }
        return n;
    }

    /// Throws ConfigError naming the first invalid field: vocab_size in [0, max_vocab], d_model
    /// in [1, max_d_model], d_out in [0, max_d_out], blocks.size() in [1, max_blocks],
    /// norm_eps finite and > 0, every block valid with d_model equal to the model's, and the
    /// parameters and batch-1 state within limits::max_allocation_bytes at 4 bytes (float)
    /// per element. validate_for<T>() checks the T-specific rules too.
    void validate() const {
        constexpr const char* w = "ModelConfig";
        detail::require_in_range(vocab_size, 0, limits::max_vocab, w, "vocab_size",
                                 " (0 means vectors in and out)");
        detail::require_in_range(d_model, 1, limits::max_d_model, w, "d_model");
        detail::require_in_range(d_out, 0, limits::max_d_out, w, "d_out",
                                 " (0 means d_model)");
        detail::require_in_range(static_cast<std::int64_t>(blocks.size()), 1, limits::max_blocks,
                                 w, "blocks.size()");
        detail::require<ConfigError>(std::isfinite(norm_eps) && norm_eps > 0, w, "norm_eps",
                                     norm_eps, "a finite value > 0");
        for (std::size_t i = 0; i < blocks.size(); ++i) {
            blocks[i].validate();
            detail::require<ConfigError>(blocks[i].d_model == d_model, w,
                                         detail::concat("blocks[", i, "].d_model").c_str(),
                                         blocks[i].d_model, detail::concat("d_model = ", d_model));
        }
        check_budget(4, "float");
    }

    /// validate(), then every block's validate_for<T>(), norm_eps representable in T, and the
    /// parameters and batch-1 state within the budget at sizeof(T) bytes per element. Called
    /// by Model<T> and ModelParams<T>::random / zeros.
    template <class T>
    void validate_for() const {
        validate();
        for (const BlockConfig& b : blocks) b.validate_for<T>();
        detail::require_representable<T>(norm_eps, "ModelConfig", "norm_eps");
        check_budget(static_cast<std::int64_t>(sizeof(T)), detail::scalar_name<T>());
    }

private:
    void check_budget(std::int64_t scalar_bytes, const char* scalar) const {
        constexpr const char* w = "ModelConfig";
        detail::require_budget(detail::sat_mul(parameter_count(), scalar_bytes), w,
                               "parameter size", scalar,
                               "reduce vocab_size, d_out, d_model or the blocks");
        detail::require_budget(state_bytes(1, scalar_bytes), w, "state size for batch 1", scalar);
    }
};

/// Outer parameters of a Model: embedding (vocab_size x d; empty without a vocabulary),
/// blocks, norm_final (1 x d), head (d x output_dim()).
template <class T>
struct ModelParams {
    Matrix<T> embedding;
    std::vector<BlockParams<T>> blocks;
    RowVector<T> norm_final;
    Matrix<T> head;

    [[nodiscard]] static ModelParams random(const ModelConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, every entry 0 (norm weights too), without the generator's
    /// work: what a loader (titans::io::load_parameters) fills and what gradients are added to.
    /// Not a usable initialisation.
    [[nodiscard]] static ModelParams zeros(const ModelConfig& cfg) { return generate(cfg, 0, false); }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static ModelParams generate(const ModelConfig& cfg, std::uint64_t seed,
                                              bool draw) {
        cfg.validate_for<T>();  // field limits, T-representable settings, allocation budget
        ModelParams p;
        detail::TensorDraw<T> gauss(seed * 1000003 + 7, draw);
        if (cfg.vocab_size > 0) {
            p.embedding = gauss(cfg.vocab_size, cfg.d_model, 1.0);
        }
        for (std::size_t i = 0; i < cfg.blocks.size(); ++i) {
            p.blocks.push_back(BlockParams<T>::generate(cfg.blocks[i], seed * 131 + i + 1, draw));
        }
        p.norm_final = RowVector<T>::Constant(cfg.d_model, draw ? T(1) : T(0));
        p.head = gauss(cfg.d_model, cfg.output_dim(), 1.0 / std::sqrt(double(cfg.d_model)));
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for every tensor `cfg` uses, in this order:
    /// embedding (vocab_size > 0), blocks.{i}.* (BlockParams::tensors), norm_final, head;
    /// tensor is the member itself (const if Self is). Non-const: `blocks` is first resized to
    /// cfg.blocks.size(), so a default-constructed ModelParams can be filled; const: the counts
    /// must match (ShapeError).
    template <class Self, class V>
    static void tensors(Self& self, const ModelConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, ModelParams>);
        using S = std::string;
        if constexpr (std::is_const_v<Self>) {
            if (self.blocks.size() != cfg.blocks.size()) {
                throw ShapeError(detail::concat("ModelParams::tensors: blocks has ",
                                                self.blocks.size(), " entries, expected ",
                                                cfg.blocks.size()));
            }
        } else {
            self.blocks.resize(cfg.blocks.size());
        }
        if (cfg.vocab_size > 0) {
            v(S("embedding"), self.embedding);
        }
        for (std::size_t i = 0; i < cfg.blocks.size(); ++i) {
            BlockParams<T>::tensors(self.blocks[i], cfg.blocks[i],
                                    detail::prefixed(detail::visit_name("blocks", i), v));
        }
        v(S("norm_final"), self.norm_final);
        v(S("head"), self.head);
    }

    /// Throws ShapeError / NonFiniteError naming the first bad tensor: blocks.size() equal to
    /// cfg.blocks.size(), each block's as BlockParams::validate (the message prefixed with
    /// "blocks.<i>: "), embedding, norm_final and head at the shapes of `cfg`.
    void validate(const ModelConfig& cfg) const {
        if (blocks.size() != cfg.blocks.size()) {
            throw ShapeError(detail::concat("ModelParams: blocks has ", blocks.size(),
                                            " entries, expected ", cfg.blocks.size()));
        }
        const detail::TensorCheck check{"ModelParams"};
        const Eigen::Index vocab = cfg.vocab_size > 0 ? cfg.vocab_size : 0;
        check(embedding, "embedding", vocab, vocab > 0 ? cfg.d_model : 0);
        for (std::size_t i = 0; i < blocks.size(); ++i) {
            detail::with_context(detail::concat("blocks.", i, ": "),
                                 [&] { blocks[i].validate(cfg.blocks[i]); });
        }
        check(norm_final, "norm_final", 1, cfg.d_model);
        check(head, "head", cfg.d_model, cfg.output_dim());
    }
};

template <class T, class Backend>
struct ModelTrace;
template <class T, class Backend = backend::Cpu>
class ModelGradients;  // models/model_gradients.hpp
namespace detail {
template <class T, class Backend>
struct ModelTraining;
template <class T, class Backend>
struct ModelParameters;
template <class T, class Backend>
struct ParameterMirror;
}  // namespace detail

/// The state of B streams through a Model: one BlockState per layer and the position.
template <class T, class Backend = backend::Cpu>
struct ModelState {
    std::vector<BlockState<T, Backend>> blocks;
    int batch = 0;
    std::int64_t position = 0;

    /// Serialization hook (checkpoints): calls v(name, x) for position (std::int64_t&) and
    /// blocks.{i}.* (BlockState::tensors) of every block, x const if Self is. Load into a
    /// state from make_state() of the same model.
    template <class Self, class V>
    static void tensors(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, ModelState>);
        v(std::string("position"), self.position);
        for (std::size_t i = 0; i < self.blocks.size(); ++i) {
            BlockState<T, Backend>::tensors(self.blocks[i],
                                   detail::prefixed(detail::visit_name("blocks", i), v));
        }
    }
};

/// A Titans model (math §7): embedding -> blocks -> RMSNorm -> head, streaming.
///
///     auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAC, 2, 64, 4, 2, 32, 256);
///     titans::Model<float> model(cfg, titans::ModelParams<float>::random(cfg, 1));
///     auto st = model.make_state(1);
///     titans::Matrixf logits = model.forward_tokens(st, ids);  // ids.size() x 256
template <class T, class Backend = backend::Cpu>
class Model {
public:
    using State = ModelState<T, Backend>;

    Model(ModelConfig config, ModelParams<T> params)
        : Model(std::move(config), std::make_shared<ModelParams<T>>(std::move(params))) {
        own_refs_ = params_.use_count();  // made here: set_parameters may write it in place
    }

    /// Shares `params` (not copied; ConfigError if null). The blocks and their sub-layers
    /// refer to parts of them: every weight is held once.
    Model(ModelConfig config, std::shared_ptr<const ModelParams<T>> params)
        : cfg_(std::move(config)),
          params_(detail::require_shared(std::move(params), "Model")),
          norm_final_(detail::share_part(params_, validated(cfg_, *params_).norm_final),
                      cfg_.norm_eps) {
        for (std::size_t i = 0; i < cfg_.blocks.size(); ++i) {
            blocks_.emplace_back(cfg_.blocks[i], detail::share_part(params_, params_->blocks[i]));
        }
        if constexpr (!backend::BackendTraits<Backend>::host_accessible) {
            // The embedding and the head in the backend's memory, once (shared by copies).
            edge_ = std::make_shared<const Edge>(
                Edge{Transfer::upload(view_of(params_->embedding)),
                     Transfer::upload(view_of(params_->head))});
        }
    }

    [[nodiscard]] const ModelConfig& config() const { return cfg_; }
    /// The parameters on the host. After set_parameters took values where they live (a device
    /// buffer), the first call brings them back (one download; thread-safe).
    [[nodiscard]] const ModelParams<T>& params() const {
        detail::ModelParameters<T, Backend>::sync_host(*this);
        return *params_;
    }
    /// The blocks (their params() as this model's: brought back as params() does).
    [[nodiscard]] const std::vector<Block<T, Backend>>& blocks() const {
        detail::ModelParameters<T, Backend>::sync_host(*this);
        return blocks_;
    }
    /// Entries of every parameter: the length of the flat layout (ModelParams::tensors order,
    /// each tensor row-major) of ModelGradients and ModelAdamW.
    [[nodiscard]] Eigen::Index parameter_count() const { return detail::flat_size(*params_, cfg_); }

    /// Takes new values for every parameter the configuration uses (what a training loop does
    /// after each optimiser step: titans::Trainer) without rebuilding the model. `values` must
    /// pass the constructor's checks (ShapeError, NonFiniteError naming the tensor); nothing
    /// changes if it throws (strong guarantee).
    ///
    /// In place when this model alone holds its parameters (it made them from values, and no
    /// copy of it, no copy of one of its layers and no pointer from a shared_params() is alive)
    /// and its backend's kernels read the host parameters themselves (the CPU): the tensors of
    /// `values` are swapped into the ones the layers already point to (no entry copied, nothing
    /// allocated), then MAG's projected persistent prefix and MAC's P W_K, P W_V are made
    /// again. Otherwise the model takes `values` as a new parameter object and prepares its
    /// layers again, as the constructor does (a device uploads them). Either way, copies made
    /// before the call keep their parameters, and every call after it uses the new values,
    /// bit for bit as a model built from them. States made before stay states of this model;
    /// a training trace made before belongs to the old values (do not pass it to backward).
    ///
    ///     model.set_parameters(std::move(stepped));  // stepped: ModelParams<T>
    void set_parameters(ModelParams<T> values) {
        if (!writable_in_place()) {
            Model fresh(cfg_, std::move(values));
            fresh.threads_ = threads_;
            *this = std::move(fresh);
            return;
        }
        validated(cfg_, values);
        for (std::size_t i = 0; i < blocks_.size(); ++i) {
            values.blocks[i].validate(cfg_.blocks[i]);
        }
        // Made non-const by the by-value constructor (own_refs_ > 0), held by nothing else.
        auto& held = const_cast<ModelParams<T>&>(*params_);
        swap_tensors(held, values, cfg_);
        std::vector<typename Block<T, Backend>::Derived> derived;
        try {
            derived.reserve(blocks_.size());
            for (const auto& b : blocks_) derived.push_back(b.derive());
        } catch (...) {
            swap_tensors(held, values, cfg_);  // the previous values, bit for bit
            throw;
        }
        for (std::size_t i = 0; i < blocks_.size(); ++i) {
            blocks_[i].install(std::move(derived[i]));
        }
    }

    /// What set_parameters(flat, check) checks of the values: every entry finite (one scalar
    /// back from the backend), or nothing but the shape where the caller knows them finite (a
    /// step ModelAdamW::propose accepted).
    enum class ValueCheck { finite, known_finite };

    /// As set_parameters(values), with the values flat in the backend's memory: 1 x
    /// parameter_count(), ModelParams::tensors order, each tensor row-major (what
    /// ModelAdamW::proposed() and ModelGradients::view() hold). The view is read during the
    /// call only. ShapeError unless flat is 1 x parameter_count(); NonFiniteError naming the
    /// first tensor with a NaN or infinite entry (unless check is known_finite); nothing
    /// changes if it throws (strong guarantee).
    ///
    /// On a backend the host cannot read (a GPU), where this model alone holds its parameters
    /// (as set_parameters(values) writes in place), every layer takes its part where the values
    /// are (prepare_flat: a copy on the backend), and so do P, the embedding and the head.
    /// Without a MAC block nothing crosses to the host: the model keeps a copy of flat, and
    /// params() and blocks() bring the host tensors up to date when next called (one
    /// download; a reference kept from an earlier call sees the new values only after such a
    /// call). With one, the values come down at once (one download: MAC's mixer reads
    /// them on the host) into the host tensors, in place. Otherwise (shared parameters, the
    /// CPU) the values come to the host (one download; none on the CPU) and
    /// set_parameters(values) takes them.
    ///
    ///     opt.propose(grads.view(), lr);                // titans::ModelAdamW
    ///     model.set_parameters(opt.proposed(), Model<float, Cuda>::ValueCheck::known_finite);
    void set_parameters(View<const T> flat, ValueCheck check = ValueCheck::finite) {
        constexpr const char* where = "Model::set_parameters";
        detail::check_flat_params(where, flat, parameter_count());
        using Take = detail::ModelParameters<T, Backend>;
        if (check == ValueCheck::finite) Take::require_finite(*this, flat, where);
        if constexpr (Take::on_backend) {
            if (own_refs_ > 0 && params_.use_count() == own_refs_) {
                Take::take(*this, flat);
                return;
            }
        }
        ModelParams<T> values = ModelParams<T>::zeros(cfg_);
        backend::copy_to_host<Backend>(flat, values, cfg_);
        set_parameters(std::move(values));
    }

    [[nodiscard]] State make_state(int batch = 1) const {
        detail::require_state_batch(
            "Model::make_state", batch, detail::scalar_name<T>(),
            [&](std::int64_t b) { return cfg_.state_bytes(b, std::int64_t{sizeof(T)}); });
        State st;
        st.batch = batch;
        for (const auto& b : blocks_) {
            st.blocks.push_back(b.make_state(batch));
        }
        return st;
    }

    /// Thread settings of this model's calls, as NeuralMemory::set_threads
    /// (titans/threads.hpp); they decide for the whole call, every block included.
    void set_threads(Threads t) {
        t.validate("Model::set_threads");
        threads_ = t;
    }
    [[nodiscard]] const Threads& threads() const { return threads_; }

    /// Approximate multiply-adds of a forward over `rows` tokens (every block and the head).
    [[nodiscard]] double work_estimate(Eigen::Index rows) const {
        double w = static_cast<double>(rows) * static_cast<double>(params_->head.size());
        for (const auto& b : blocks_) {
            w += b.work_estimate(rows);
        }
        return w;
    }

    /// Throws ConfigError unless `state` can be continued by this model: made by make_state()
    /// of a model with the same settings (every block's state accepted by its block), with
    /// the model's batch and position equal to every block's.
    void validate_state(const State& state) const { check_state(state, "Model"); }

    /// Every entry 0, shaped as the adjoint of `state` (a ModelStateGradient as backward's
    /// d_state_out takes it for a trace that ended in `state`): one
    /// Block::zero_state_gradient per block. ConfigError: a state of another model.
    ///
    ///     auto d = model.zero_state_gradient(state);      // after model.forward(state, x, out, trace)
    ///     d.blocks[1].memory.weights[0][0](0, 0) = 1.0;   // dL/d(W_1[0, 0]) of block 1, (b, h) = (0, 0)
    ///     model.backward(trace, dout, grads, &dx, nullptr, &d);
    [[nodiscard]] ModelStateGradient<T> zero_state_gradient(const State& state) const {
        check_state(state, "Model::zero_state_gradient");
        ModelStateGradient<T> d;
        d.blocks.reserve(blocks_.size());
        for (std::size_t i = 0; i < blocks_.size(); ++i) {
            d.blocks.push_back(blocks_[i].zero_state_gradient(state.blocks[i]));
        }
        return d;
    }

    /// Vectors in: x (B*N) x d_model -> (B*N) x output_dim(). On a backend that is not the
    /// host's, x is uploaded once and the output downloaded once; every block, the final norm
    /// and the head run on the backend in between.
    [[nodiscard]] Matrix<T> forward(State& state, const MatrixRef<T>& x) const {
        check_input(state, x.rows(), x.cols(), "Model::forward");
        Scope scope;  // first: the input's buffer is the call's too
        const backend::Upload<Backend, T> in(x);
        return run(state, in.view(), scope);
    }

    /// Token ids in (B*N of them, sequence-major) -> logits (B*N) x vocab_size. The ids go to
    /// the backend once (the embedding rows are gathered there).
    [[nodiscard]] Matrix<T> forward_tokens(State& state, const std::vector<int>& ids) const {
        Scope scope;  // the gather joins the call's stream too
        const Buffer x = embedded(state, ids, "Model::forward_tokens");
        return run(state, Transfer::view(x), scope);
    }

    /// What the training forward keeps for backward (math §9; models/model_training.hpp).
    using Trace = ModelTrace<T, Backend>;
    /// Whether this backend has the training pass of every layer (the CPU's does).
    static constexpr bool trainable = Block<T, Backend>::trainable;

    /// The training forward (math §9): forward(state, x), every block's training forward
    /// keeping its trace in `trace`; out = the output. From a fresh state, or (chained pieces:
    /// see backward's d_state_in / d_state_out) from one that has seen earlier pieces: on the
    /// CPU and CUDA anywhere, elsewhere when every block's memory is at a chunk boundary (ConfigError
    /// naming the block otherwise). Same outputs as forward (to rounding) and a state that continues the
    /// same; on an error nothing changes (state, out, trace). Every block kind.
    ///
    ///     Model<double>::Trace trace;
    ///     model.forward_tokens(state, ids, logits, trace);
    ///     auto grads = ModelParams<double>::zeros(cfg);
    ///     model.backward(trace, dlogits, grads);  // grads += dL/dparams
    void forward(State& state, const MatrixRef<T>& x, Matrix<T>& out, Trace& trace) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::forward(*this, state, x, out, trace);
    }
    /// As above from token ids (B*N, sequence-major); backward adds to their embedding rows.
    void forward_tokens(State& state, const std::vector<int>& ids, Matrix<T>& out,
                        Trace& trace) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::forward_tokens(*this, state, ids, out, trace);
    }

    /// The training forward on token ids with its cross-entropy loss computed on the backend:
    /// forward_tokens(state, ids, logits, trace) followed by cross_entropy_loss(logits,
    /// labels, dlogits) (train/loss.hpp), the same bits on the CPU, but the logits stay in the
    /// backend's memory and the trace keeps dlogits for backward_loss: the ids and labels go up
    /// once, the loss (one scalar) comes back. labels: one per id, each < vocab_size or
    /// negative (not scored); returns 0 if none is scored. Throws as forward_tokens, ShapeError
    /// for labels (size, range); nothing changes then.
    ///
    ///     const double loss = model.forward_loss(state, ids, labels, trace);
    ///     model.backward_loss(trace, grads);   // as backward(trace, dlogits, grads)
    double forward_loss(State& state, const std::vector<int>& ids, std::span<const int> labels,
                        Trace& trace) const
        requires(trainable)
    {
        return detail::ModelTraining<T, Backend>::forward_loss(*this, state, ids, labels, trace);
    }
    /// As above, with nothing back now: the loss is left in slot `slot` of `into`, read later
    /// with a step's other scalars (BackendScalars::read; what Trainer::step does). ConfigError
    /// also for a slot out of range.
    void forward_loss(State& state, const std::vector<int>& ids, std::span<const int> labels,
                      Trace& trace, BackendScalars<T, Backend>& into, std::size_t slot) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::forward_loss(*this, state, ids, labels, trace, &into,
                                                        slot);
    }

    /// backward(trace, dlogits, grads, dx, d_state_in, d_state_out) from the loss's gradient
    /// that forward_loss kept in the trace (ConfigError for a trace without one).
    void backward_loss(const Trace& trace, ModelParams<T>& grads, Matrix<T>* dx = nullptr,
                       ModelStateGradient<T>* d_state_in = nullptr,
                       const ModelStateGradient<T>* d_state_out = nullptr) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::backward_loss(*this, trace, grads, dx, d_state_in,
                                                         d_state_out);
    }
    /// As above, the gradients added to a gradient buffer in the backend's memory
    /// (ModelGradients(*this)): nothing crosses to the host but dx, if asked for.
    void backward_loss(const Trace& trace, ModelGradients<T, Backend>& grads,
                       Matrix<T>* dx = nullptr, ModelStateGradient<T>* d_state_in = nullptr,
                       const ModelStateGradient<T>* d_state_out = nullptr) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::backward_loss(*this, trace, grads, dx, d_state_in,
                                                         d_state_out);
    }

    /// The backward pass (math §9) of a training forward: dout = dL/dout (the trace's rows x
    /// output_dim()) adds the gradient of every parameter (embedding rows of the tokens, every
    /// block, norm_final, head) to grads (shaped as params(), e.g. ModelParams<T>::zeros(
    /// config())) and, if dx is given, writes dL/dx (for tokens: dL/d of their embedding rows).
    ///
    /// Chained pieces: d_state_out, if given and not empty(), is dL/d(the state
    /// the call left), one BlockStateGradient per block; d_state_in, if given, receives
    /// dL/d(the state it started from) (empty for a call from a fresh state). Reversing pieces
    /// last first, each with the next one's d_state_in as its d_state_out, gives the grads and
    /// dx of one call over their concatenation (truncated backpropagation through time: stop
    /// passing them).
    ///
    /// Throws ShapeError (empty or moved-from trace, one whose sizes or token ids are not its
    /// forward's, shapes, d_state_out's block count), ConfigError (a trace of a model of another
    /// configuration, a state-gradient part a block's kind lacks), NonFiniteError (dout,
    /// d_state_out or grads, or gradients that overflow); nothing changes then.
    void backward(const Trace& trace, const MatrixRef<T>& dout, ModelParams<T>& grads,
                  Matrix<T>* dx = nullptr, ModelStateGradient<T>* d_state_in = nullptr,
                  const ModelStateGradient<T>* d_state_out = nullptr) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::backward(*this, trace, dout, grads, dx, d_state_in,
                                                    d_state_out);
    }
    /// As above, the gradients added to a gradient buffer in the backend's memory
    /// (ModelGradients(*this), models/model_gradients.hpp): dout goes up, nothing comes down
    /// but dx, if asked for. ShapeError for a buffer laid out for other parameters.
    void backward(const Trace& trace, const MatrixRef<T>& dout, ModelGradients<T, Backend>& grads,
                  Matrix<T>* dx = nullptr, ModelStateGradient<T>* d_state_in = nullptr,
                  const ModelStateGradient<T>* d_state_out = nullptr) const
        requires(trainable)
    {
        detail::ModelTraining<T, Backend>::backward(*this, trace, dout, grads, dx, d_state_in,
                                                    d_state_out);
    }

private:
    friend struct detail::ModelTraining<T, Backend>;
    friend class ModelGradients<T, Backend>;  // the parameters' shapes, without sync_host()
    friend struct detail::ModelParameters<T, Backend>;  // set_parameters(flat), params()

    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;

    /// The embedding and the head in the backend's memory (a backend that is not the host's).
    struct Edge {
        Buffer embedding, head;
    };
    /// A host tensor of the parameters as the backend's kernels read it: the tensor itself on
    /// a host-accessible backend, its copy in edge_ otherwise.
    View<const T> edge_view(const Matrix<T>& host, Buffer Edge::*part) const {
        if constexpr (backend::BackendTraits<Backend>::host_accessible) {
            (void)part;
            return view_of(host);
        } else {
            return Transfer::view((*edge_).*part);
        }
    }

    /// What a forward call runs in: the glue's CallScope (CUDA: call_scope.cuh), or nothing.
    using Scope = typename backend::CallScopeOf<Glue>::type;

    /// forward on checked input x in the backend's memory (pass), in `scope`. On CUDA every
    /// layer runs on one stream without waiting and the finiteness checks are deferred to the
    /// scope's device flag, read at the edge; if it is raised the pass was rolled back, and the
    /// call runs again with every check at its place, where the first failing one throws its
    /// NonFiniteError (the same error, the state unchanged).
    Matrix<T> run(State& state, View<const T> x, Scope& scope) const {
        std::optional<Matrix<T>> out = pass(state, x, [&] { return !scope.flagged(); });
        if (out) {
            return std::move(*out);
        }
        const Scope strict(false);
        return *pass(state, x, backend::AllChecked{});
    }

    /// The blocks in one transaction (if any block or the head throws, or settled() says a
    /// deferred check failed, all of them roll back and the state is as it was: strong
    /// guarantee; nullopt for the latter), their activations in two backend buffers taken in
    /// turn, the final norm and the head on the backend; the output downloaded once.
    template <class Settled>
    std::optional<Matrix<T>> pass(State& state, View<const T> x, Settled settled) const {
        const ThreadScope team(threads_, work_estimate(x.rows));
        std::size_t opened = 0;
        try {
            for (; opened < blocks_.size(); ++opened) {
                blocks_[opened].begin(state.blocks[opened]);
            }
            Matrix<T> out = blocks_and_head(state, x);
            if (!settled()) {
                rollback_blocks(state, opened);
                return std::nullopt;
            }
            require_finite_output(out);
            for (std::size_t i = 0; i < blocks_.size(); ++i) {
                blocks_[i].commit(state.blocks[i]);
            }
            state.position += x.rows / state.batch;
            return out;
        } catch (...) {
            rollback_blocks(state, opened);
            throw;
        }
    }

    /// Whether this call chains each block's last sum into the norm after it (Block::Link):
    /// inside a deferring call scope, where the norm fuses a sum (RMSNorm::forward_sum).
    static bool links_norms() {
        using Norm = RMSNorm<T, Backend>;
        if constexpr (requires(const Norm& n, View<const T> a, View<T> s) {
                          n.forward_sum(a, s, s);
                      }) {
            return backend::checks_deferred<Glue>();
        } else {
            return false;
        }
    }

    /// Every block on x, the final norm and the head (open transactions); the output
    /// downloaded. Linked (links_norms), each block's last sum also writes the next block's
    /// normalised input (the final norm's after the last), in two more buffers taken in turn.
    Matrix<T> blocks_and_head(State& state, View<const T> x) const {
        std::array<Buffer, 2> buf{backend::call_scratch<Backend, T>(x.rows, x.cols),
                                  backend::call_scratch<Backend, T>(x.rows, x.cols)};
        const bool linked = links_norms() && !blocks_.empty();
        std::array<Buffer, 2> normed{};
        if (linked) {
            normed = {backend::call_scratch<Backend, T>(x.rows, x.cols),
                      backend::call_scratch<Backend, T>(x.rows, x.cols)};
        }
        View<const T> h = x;
        for (std::size_t i = 0; i < blocks_.size(); ++i) {
            const View<T> next = Transfer::view(buf[i % 2]);
            typename Block<T, Backend>::Link link{};
            if (linked) {
                const bool last = i + 1 == blocks_.size();
                link = {i == 0 ? View<const T>{} : Transfer::view(std::as_const(normed[i % 2])),
                        last ? &norm_final_ : &blocks_[i + 1].norm_mix_,
                        Transfer::view(normed[(i + 1) % 2])};
            }
            try {
                blocks_[i].forward_view(state.blocks[i], h, next, link);
            } catch (const NonFiniteError& e) {
                throw NonFiniteError(detail::concat("Model::forward: block ", i, ": ", e.what()));
            }
            h = next;
        }
        View<T> z = Transfer::view(buf[blocks_.size() % 2]);  // not h
        if (linked) {
            z = Transfer::view(normed[blocks_.size() % 2]);  // the last block's sum wrote it
        } else {
            norm_final_.forward(h, z);
        }
        Matrix<T> out;
        {
            backend::Download<Backend, T> logits(out, x.rows, params_->head.cols());
            Glue::product(z, edge_view(params_->head, &Edge::head), logits.view());
            logits.finish();
        }
        return out;
    }

    void rollback_blocks(State& state, std::size_t opened) const {
        for (std::size_t i = 0; i < opened; ++i) {
            blocks_[i].rollback(state.blocks[i]);
        }
    }

    /// ConfigError without a vocabulary, ShapeError for an id outside [0, vocab_size).
    void check_ids(const std::vector<int>& ids, const char* where) const {
        detail::require<ConfigError>(cfg_.vocab_size > 0, where, "vocab_size", cfg_.vocab_size,
                                     "> 0 (this model takes vectors: forward)");
        for (const int id : ids) {
            detail::require<ShapeError>(id >= 0 && id < cfg_.vocab_size, where, "token id", id,
                                        detail::concat("in [0, ", cfg_.vocab_size, ")"));
        }
    }

    /// The embedding rows of ids gathered on the backend (ids and the call checked: check_ids,
    /// check_input; the ids go up once, and stay in *kept if given, as a training forward
    /// keeps them for its backward): every forward on token ids starts here.
    Buffer embedded(const State& state, const std::vector<int>& ids, const char* where,
                    typename Glue::Ids* kept = nullptr) const {
        check_ids(ids, where);
        const auto rows = static_cast<Eigen::Index>(ids.size());
        check_input(state, rows, cfg_.d_model, where);
        typename Glue::Ids on_backend = Glue::upload_ids(ids);
        Buffer x = Transfer::allocate(rows, cfg_.d_model);
        Glue::gather(edge_view(params_->embedding, &Edge::embedding), on_backend,
                     Transfer::view(x));
        if (kept != nullptr) *kept = std::move(on_backend);
        return x;
    }

    /// The checks of a forward call: the position may advance, the state is this model's, x
    /// is d_model wide.
    void check_input(const State& state, Eigen::Index rows, Eigen::Index cols,
                     const char* where) const {
        // Reserve: a block's memory also counts its persistent tokens (<= max_persistent).
        detail::check_position_advance(where, state.position, rows, state.batch,
                                       limits::max_persistent);
        check_state(state, where);
        if (cols != cfg_.d_model) {
            throw ShapeError(detail::concat(where, ": x has ", cols,
                                            " columns, expected d_model = ", cfg_.d_model));
        }
    }

    static void require_finite_output(const Matrix<T>& out) {
        if (!detail::all_finite(out)) {
            throw_nonfinite_output();
        }
    }
    [[noreturn]] static void throw_nonfinite_output() {
        throw NonFiniteError("Model::forward: the head's output is not finite (the final "
                             "projection overflows), expected finite values; the state is "
                             "unchanged");
    }

    void check_state(const State& state, const char* where) const {
        if (state.batch < 1 || state.blocks.size() != blocks_.size()) {
            throw ConfigError(detail::concat(where, ": state was made for a different model (or "
                                                    "default-constructed), expected a state from "
                                                    "make_state() of this model"));
        }
        for (std::size_t i = 0; i < blocks_.size(); ++i) {
            blocks_[i].validate_state(state.blocks[i]);
            if (state.blocks[i].batch() != state.batch ||
                state.blocks[i].position() != state.position) {
                throw ConfigError(detail::concat(
                    where, ": state.blocks[", i, "] has batch ", state.blocks[i].batch(),
                    " and position ", state.blocks[i].position(), ", expected the model's batch ",
                    state.batch, " and position ", state.position));
            }
        }
    }

    /// Whether set_parameters may write the parameters in place: this model made them (by
    /// value), nothing outside it holds them, and every kernel family's prepared form is the
    /// host parameters themselves (so nothing but Block::derive() depends on their values).
    [[nodiscard]] bool writable_in_place() const {
        using backend::AttentionKernels, backend::FeedForwardKernels, backend::MemoryKernels,
            backend::NormKernels, std::is_same_v, std::shared_ptr;
        constexpr bool host_prepared =
            is_same_v<typename MemoryKernels<Backend, T>::Prepared,
                      shared_ptr<const MemoryParams<T>>> &&
            is_same_v<typename AttentionKernels<Backend, T>::Prepared,
                      shared_ptr<const AttentionParams<T>>> &&
            is_same_v<typename NormKernels<Backend, T>::Prepared, shared_ptr<const RowVector<T>>> &&
            is_same_v<typename FeedForwardKernels<Backend, T>::Prepared,
                      shared_ptr<const FeedForwardParams<T>>>;
        return host_prepared && own_refs_ > 0 && params_.use_count() == own_refs_;
    }

    /// Exchanges the storage of every tensor `cfg` uses between a and b (same shapes): the
    /// matrices stay where they are, so the layers' pointers to them stay valid.
    static void swap_tensors(ModelParams<T>& a, ModelParams<T>& b, const ModelConfig& cfg) {
        std::vector<Matrix<T>*> mats;
        std::vector<RowVector<T>*> rows;
        ModelParams<T>::tensors(b, cfg, [&](const std::string&, auto& m) {
            if constexpr (std::is_same_v<std::decay_t<decltype(m)>, Matrix<T>>) {
                mats.push_back(&m);
            } else {
                rows.push_back(&m);
            }
        });
        std::size_t i = 0, j = 0;
        ModelParams<T>::tensors(a, cfg, [&](const std::string&, auto& m) {
            if constexpr (std::is_same_v<std::decay_t<decltype(m)>, Matrix<T>>) {
                m.swap(*mats[i++]);
            } else {
                m.swap(*rows[j++]);
            }
        });
    }

    /// Validates the configuration and the model-level tensors (the blocks validate theirs).
    static const ModelParams<T>& validated(const ModelConfig& cfg, const ModelParams<T>& p) {
        cfg.validate_for<T>();
        if (p.blocks.size() != cfg.blocks.size()) {
            throw ShapeError(detail::concat("ModelParams: blocks has ", p.blocks.size(),
                                            " entries, expected ", cfg.blocks.size()));
        }
        const detail::TensorCheck check{"ModelParams"};
        check(p.embedding, "embedding", cfg.vocab_size > 0 ? cfg.vocab_size : 0,
              cfg.vocab_size > 0 ? cfg.d_model : 0);
        check(p.norm_final, "norm_final", 1, cfg.d_model);
        check(p.head, "head", cfg.d_model, cfg.output_dim());
        return p;
    }

    ModelConfig cfg_;
    std::shared_ptr<const ModelParams<T>> params_;
    std::vector<Block<T, Backend>> blocks_;
    RMSNorm<T, Backend> norm_final_;
    std::shared_ptr<const Edge> edge_;  // null on a host-accessible backend
    // The values set_parameters(flat) took on the backend, which the host tensors (params_)
    // take again when next read (sync_host); null while the host tensors hold the values.
    // Shared by copies of the model, as params_ is.
    std::shared_ptr<detail::ParameterMirror<T, Backend>> mirror_;
    Threads threads_{};
    // params_.use_count() right after the by-value constructor (every pointer this model's
    // layers hold), 0 for shared parameters: set_parameters writes in place only at that count.
    long own_refs_ = 0;
};

}  // namespace titans

#include "model_parameters.hpp"  // Model::set_parameters(flat), params(): ModelParameters
#include "model_training.hpp"  // Model::forward / backward (training): ModelTraining
