#pragma once
// titans/train/trainer.hpp: Trainer, a training step over a Model on token ids (math §9):
// forward from a fresh state, cross-entropy, backward, global clipping, AdamW at the
// schedule's rate, on the model's backend (ModelGradients, ModelAdamW). The model takes each
// step's parameters in place (Model::set_parameters); the trainer's whole state saves and resumes
// bit for bit (titans/io/trainer.hpp).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/cpu/cpu.hpp"  // the default backend
#include "../detail/check.hpp"
#include "../error.hpp"
#include "../fwd.hpp"
#include "../limits.hpp"
#include "../models/backend_scalars.hpp"
#include "../models/model.hpp"
#include "../models/model_gradients.hpp"
#include "adamw.hpp"
#include "communicator.hpp"
#include "data_parallel.hpp"
#include "model_adamw.hpp"
#include "gradients.hpp"
#include "loss.hpp"
#include "schedule.hpp"

namespace titans {

/// Settings of a Trainer. Aggregate.
struct TrainerConfig {
    AdamWConfig adamw{};       ///< the optimiser
    WarmupCosine schedule{};   ///< the learning rate of step t = 1, 2, ...
    double clip_norm = 1.0;    ///< global gradient-norm clipping, finite, >= 0; 0: no clipping

    /// ConfigError naming the first invalid field ("TrainerConfig: adamw.beta1 = 1, ...").
    void validate() const {
        constexpr const char* w = "TrainerConfig";
        renamed("AdamWConfig: ", "TrainerConfig: adamw.", [&] { adamw.validate(); });
        renamed("WarmupCosine: ", "TrainerConfig: schedule.", [&] { schedule.validate(); });
        detail::require<ConfigError>(std::isfinite(clip_norm) && clip_norm >= 0, w, "clip_norm",
                                     clip_norm, "a finite value >= 0 (0: no clipping)");
    }

    /// Serialization hook: v(name, field) for adamw.* (AdamWConfig::fields), schedule.*
    /// (WarmupCosine::fields), clip_norm.
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, TrainerConfig>);
        AdamWConfig::fields(self.adamw, detail::prefixed("adamw", v));
        WarmupCosine::fields(self.schedule, detail::prefixed("schedule", v));
        v(std::string("clip_norm"), self.clip_norm);
    }

private:
    /// Runs f; a ConfigError whose message starts with `from` is thrown again starting with `to`.
    template <class F>
    static void renamed(const char* from, const char* to, F&& f) {
        try {
            f();
        } catch (const ConfigError& e) {
            const std::string m = e.what();
            if (m.rfind(from, 0) != 0) throw;
            throw ConfigError(to + m.substr(std::strlen(from)));
        }
    }
};

/// What a Trainer has done besides its optimiser's steps; saved with it.
struct TrainerProgress {
    /// Sequences consumed: every step adds its batch; the user may set it (set_data_position),
    /// e.g. to where a data loader resumes. In [0, limits::max_position].
    std::int64_t data_position = 0;
    double loss = 0.0;            ///< of the last step (0 before the first)
    double gradient_norm = 0.0;   ///< of the last step, before clipping
    double learning_rate = 0.0;   ///< of the last step

    /// ConfigError naming the first invalid field (data_position in range, the rest finite
    /// and >= 0).
    void validate() const {
        constexpr const char* w = "TrainerProgress";
        detail::require_in_range(data_position, std::int64_t{0}, limits::max_position, w,
                                 "data_position");
        for (const auto& [name, x] : {std::pair{"loss", loss}, {"gradient_norm", gradient_norm},
                                      {"learning_rate", learning_rate}}) {
            detail::require<ConfigError>(std::isfinite(x) && x >= 0, w, name, x,
                                         "a finite value >= 0");
        }
    }

    /// Serialization hook: v(name, field) for data_position, loss, gradient_norm,
    /// learning_rate.
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, TrainerProgress>);
        v(std::string("data_position"), self.data_position);
        v(std::string("loss"), self.loss);
        v(std::string("gradient_norm"), self.gradient_norm);
        v(std::string("learning_rate"), self.learning_rate);
    }
};

/// Trains a Model on token ids (math §9). Each step():
///
///     state = model.make_state(batch)                         a fresh state: sequences are
///     logits = model.forward_tokens(state, ids, ., trace)     independent, nothing carries over
///     loss = cross_entropy_loss(logits, labels, dlogits)      labels < 0 ignored
///     grads = model.backward(trace, dlogits)                  (the four on the backend:
///     norm = clip_gradient_norm(grads, clip_norm)             forward_loss, backward_loss
///                                                             into ModelGradients, its clip;
///                                                             no clipping for clip_norm = 0)
///     params = AdamW step at schedule(optimizer().steps() + 1)    (ModelAdamW: on the backend,
///                                                             in the parameter buffer; the
///                                                             gradients stay where they are)
///
/// bit for bit as that sequence written by hand with a model rebuilt from the parameters every
/// step and the host AdamW<T>, but the model takes the new values in place
/// (Model::set_parameters). Strong guarantee: a step that throws (bad arguments, non-finite
/// logits, gradients or updated parameters) leaves the model, the optimiser and the progress
/// as they were.
///
///     titans::Trainer<float> trainer(cfg, titans::ModelParams<float>::random(cfg, 1),
///                                    {.schedule = {.peak = 3e-3, .warmup = 100, .total = 2000}});
///     const double loss = trainer.step(ids, labels, batch);  // ids, labels: batch * N each
///
/// Backends: those whose blocks train (Model<T, Backend>::trainable: the CPU and CUDA);
/// elsewhere the class does not compile (static_assert). On a backend without the memory's
/// staged reverse a model with a MAC block is refused (ConfigError; Block::trains). The
/// optimiser's parameters and moments live in the backend's memory (ModelAdamW), and the model
/// takes each step's values from there (Model::set_parameters(flat)): on a device each layer
/// copies its part there, nothing crossing to the host (MAC's P W_K, P W_V are made there
/// too). The loss, the norm and AdamW's verdict wait there too (BackendScalars) and come back
/// together: besides the ids and labels going up, a step on a device makes one download.
template <class T, class Backend>
class Trainer {
    static_assert(Model<T, Backend>::trainable,
                  "titans::Trainer: Model<T, Backend> cannot train on this backend (the memory's "
                  "or the attention's training pass is missing)");

public:
    using Scalar = T;
    using ModelType = Model<T, Backend>;

    /// A trainer from its first step: the model (vocab_size > 0: token ids in) with these
    /// parameters, a fresh AdamW. Throws what Model's constructor throws, ConfigError for a
    /// model without a vocabulary or an invalid config.
    Trainer(ModelConfig model_config, ModelParams<T> params, TrainerConfig config = {})
        : Trainer(std::move(model_config), std::move(params), config, fresh_optimizer(config),
                  TrainerProgress{}) {}

    /// A trainer resumed (what titans::io::load_trainer does): `optimizer` has taken the
    /// steps so far, with config.adamw's settings and the moments of exactly these parameters'
    /// tensors (ConfigError, ShapeError otherwise; progress validated too).
    Trainer(ModelConfig model_config, ModelParams<T> params, TrainerConfig config,
            AdamW<T> optimizer, TrainerProgress progress)
        : cfg_(checked(config, model_config)),
          model_(std::move(model_config), std::move(params)),
          opt_(model_.config(), model_.params(), checked_optimizer(cfg_, optimizer)),
          progress_(progress) {
        progress_.validate();
    }

    /// One training step on `batch` sequences of N tokens: ids (batch * N, sequence-major as
    /// Model::forward_tokens takes them) and labels (one per id, the id to predict there, or
    /// negative: not scored). Returns the loss (0 if no label is scored; AdamW still steps).
    /// Throws, changing nothing: ConfigError (batch not in [1, max_batch], the data position
    /// would pass max_position), ShapeError (ids.size() not a positive multiple of batch,
    /// labels.size() != ids.size(), an id or label outside [0, vocab_size)), NonFiniteError
    /// (logits, gradients or updated parameters NaN or infinite).
    ///
    /// With a communicator of n > 1 ranks (set_communicator) every rank passes the same batch
    /// (batch >= n) and computes the gradients of its shard of sequences (rank r: sequences
    /// [r * batch / n, (r + 1) * batch / n)); the gradient buffer is summed over the ranks,
    /// each rank's weighted by its share of the scored labels, so every rank takes the step of
    /// the whole batch (to rounding: the sums run in another order) with the same bits. A rank
    /// that refuses its part makes every rank throw (CommunicationError naming it, its own
    /// error on it), as does a rank given another batch; every check_every steps the ranks'
    /// new parameters are compared before the step is taken (CommunicationError naming a rank
    /// that drifted; nothing changes).
    double step(const std::vector<int>& ids, std::span<const int> labels, int batch) {
        const ModelConfig& mc = model_.config();
        std::optional<ModelGradients<T, Backend>> g;  // zeros, in the backend's memory
        // The loss, the norm and AdamW's verdict wait on the backend until all are known: one
        // download brings them back (a data-parallel rank has its loss already).
        enum : std::size_t { loss_slot, norm_slot, verdict_slot };
        BackendScalars<T, Backend> scalars;
        double loss = 0.0;
        if (comm_) {
            loss = distributed_gradients(ids, labels, batch, g);  // the ranks check together
        } else {
            check_step(ids, labels, batch);
            g.emplace(model_);
            gradients(ids, labels, batch, *g, &scalars, loss_slot);
        }
        ModelGradients<T, Backend>& grads = *g;
        grads.clip(cfg_.clip_norm, scalars, norm_slot);  // clip_norm 0: the norm alone
        const double lr = cfg_.schedule(opt_.steps() + 1);
        opt_.propose(grads.view(), lr, scalars, verdict_slot);
        const backend::ScalarValues got = scalars.read();
        if (!comm_) loss = got[loss_slot];
        const double norm = got[norm_slot];
        grads.require_finite_norm(norm, "Trainer::step");
        opt_.settle(got[verdict_slot]);  // taken below (commit) only if all went well
        if (comm_ && check_every_ > 0 && (opt_.steps() + 1) % check_every_ == 0) {
            detail::require_same_on_ranks(*comm_, params_print(opt_.proposed_params(mc)),
                                          "Trainer::step",
                                          "parameters (the ranks have drifted apart)");
        }
        // propose found every new entry finite; on a device the model takes them there
        model_.set_parameters(opt_.proposed(), ModelType::ValueCheck::known_finite);
        opt_.commit();
        progress_ = {progress_.data_position + batch, loss, norm, lr};
        return loss;
    }

    /// Joins a data-parallel run (null: trains alone again): every rank's trainer calls it
    /// with its communicator (collective), and every rank's model configuration, trainer
    /// settings, parameters, optimiser state and data position must equal rank 0's
    /// (CommunicationError naming the first rank that differs; nothing changes then), and so
    /// must check_every: every check_every steps (0: never; >= 0, ConfigError otherwise)
    /// step() compares the ranks' parameters. A rank refusing its own arguments makes every
    /// rank throw (CommunicationError naming it on the others). The gradient buffer is summed where it lives: a backend the host reads (the
    /// CPU) takes a host communicator (MPI's), a device backend (CUDA) a device one (NCCL's,
    /// <titans/nccl/nccl.cuh>); ConfigError otherwise, unless the run has one rank.
    ///
    ///     titans::mpi::Session mpi(argc, argv);                        // <titans/mpi/mpi.hpp>
    ///     trainer.set_communicator(std::make_shared<titans::mpi::Communicator>());
    void set_communicator(std::shared_ptr<Communicator> comm, std::int64_t check_every = 100) {
        constexpr const char* where = "Trainer::set_communicator";
        if (!comm) {
            detail::require<ConfigError>(check_every >= 0, where, "check_every", check_every,
                                         ">= 0 (0: never)");
        } else {
            std::exception_ptr failed;  // refused here: every rank learns it at the first gather
            detail::SettingsPrint settings;
            try {
                detail::require<ConfigError>(check_every >= 0, where, "check_every",
                                             check_every, ">= 0 (0: never)");
                detail::require<ConfigError>(
                    detail::can_sum<Backend>(*comm), where, "communicator",
                    comm->device_memory() ? "a device communicator" : "a host communicator",
                    backend::BackendTraits<Backend>::host_accessible
                        ? "a host communicator (MPI's) for this backend, or one rank"
                        : "a device communicator (NCCL's) for this backend, or one rank");
                ModelConfig::fields(model_.config(), std::ref(settings));
                TrainerConfig::fields(cfg_, std::ref(settings));
                settings(std::string("check_every"), check_every);
            } catch (...) {
                failed = std::current_exception();
            }
            detail::agree(*comm, failed, settings.hash().value(), where,
                          "model configuration, trainer settings or check_every");
            detail::require_same_on_ranks(*comm, params_print(model_.params()), where,
                                          "parameters");
            detail::require_same_on_ranks(
                *comm, detail::optimizer_print(opt_.to_host(), progress_.data_position), where,
                "optimiser state or data position");
        }
        comm_ = std::move(comm);
        check_every_ = check_every;
    }
    /// The communicator of a data-parallel run (null when training alone).
    [[nodiscard]] const std::shared_ptr<Communicator>& communicator() const { return comm_; }

    [[nodiscard]] const ModelType& model() const { return model_; }
    [[nodiscard]] const ModelParams<T>& params() const { return model_.params(); }
    /// The optimiser's state as a host AdamW<T> (from the backend: moments by tensor name).
    [[nodiscard]] AdamW<T> optimizer() const { return opt_.to_host(); }
    [[nodiscard]] const TrainerConfig& config() const { return cfg_; }
    [[nodiscard]] const TrainerProgress& progress() const { return progress_; }
    /// Steps taken (the optimiser's).
    [[nodiscard]] std::int64_t steps() const { return opt_.steps(); }
    [[nodiscard]] std::int64_t data_position() const { return progress_.data_position; }
    [[nodiscard]] double last_loss() const { return progress_.loss; }
    /// The global gradient norm of the last step, before clipping.
    [[nodiscard]] double last_gradient_norm() const { return progress_.gradient_norm; }
    [[nodiscard]] double last_learning_rate() const { return progress_.learning_rate; }

    /// Sets the data position (ConfigError unless in [0, limits::max_position]).
    void set_data_position(std::int64_t position) {
        detail::require_in_range(position, std::int64_t{0}, limits::max_position,
                                 "Trainer::set_data_position", "position");
        progress_.data_position = position;
    }
    /// The model's thread settings (Model::set_threads).
    void set_threads(Threads t) { model_.set_threads(t); }

private:
    static AdamW<T> fresh_optimizer(const TrainerConfig& c) {
        c.validate();  // first, so that its errors name TrainerConfig's fields
        return AdamW<T>(c.adamw);
    }

    static const TrainerConfig& checked(const TrainerConfig& c, const ModelConfig& mc) {
        c.validate();
        detail::require<ConfigError>(mc.vocab_size > 0, "Trainer", "model vocab_size",
                                     mc.vocab_size, "> 0 (the trainer takes token ids)");
        for (std::size_t i = 0; i < mc.blocks.size(); ++i) {
            const BlockKind k = mc.blocks[i].kind;
            if (!Block<T, Backend>::trains(k)) {
                throw ConfigError(detail::concat(
                    "Trainer: model block ", i, " is ", to_string(k), ", which does not train on "
                    "this backend (MAC needs the memory's staged reverse), expected LMM, MAG, MAL "
                    "or SWA here, or the CPU backend"));
            }
        }
        return c;
    }

    /// The optimiser's settings are config().adamw (ModelAdamW's constructor then checks that
    /// its moments are none or those of every tensor, shaped as it).
    static const AdamW<T>& checked_optimizer(const TrainerConfig& config, const AdamW<T>& opt) {
        constexpr const char* where = "Trainer";
        std::vector<std::pair<std::string, double>> mine, theirs;
        const auto list = [](auto& out) {
            return [&out](const std::string& n, const auto& x) { out.emplace_back(n, double(x)); };
        };
        AdamWConfig::fields(opt.config(), list(theirs));
        AdamWConfig::fields(config.adamw, list(mine));
        for (std::size_t i = 0; i < mine.size(); ++i) {
            detail::require<ConfigError>(
                theirs[i].second == mine[i].second, where,
                detail::concat("optimizer.config().", theirs[i].first).c_str(), theirs[i].second,
                detail::concat("config.adamw.", mine[i].first, " = ", mine[i].second));
        }
        return opt;
    }

    void check_step(const std::vector<int>& ids, std::span<const int> labels, int batch) const {
        constexpr const char* where = "Trainer::step";
        detail::require_in_range(batch, 1, limits::max_batch, where, "batch");
        detail::require<ShapeError>(!ids.empty() && ids.size() % static_cast<std::size_t>(batch) == 0,
                                    where, "ids.size()", ids.size(),
                                    detail::concat("a positive multiple of batch = ", batch));
        detail::require<ShapeError>(labels.size() == ids.size(), where, "labels.size()",
                                    labels.size(), detail::concat("ids.size() = ", ids.size()));
        const int vocab = model_.config().vocab_size;
        for (std::size_t i = 0; i < ids.size(); ++i) {
            detail::require<ShapeError>(ids[i] >= 0 && ids[i] < vocab, where, "a token id",
                                        ids[i], detail::concat("in [0, ", vocab, ")"));
            detail::require<ShapeError>(labels[i] < vocab, where, "a label", labels[i],
                                        detail::concat("< vocab_size = ", vocab,
                                                       " (or negative: not scored)"));
        }
        detail::require<ConfigError>(progress_.data_position <= limits::max_position - batch,
                                     where, "data_position + batch",
                                     progress_.data_position + batch,
                                     "at most max_position = 2^62");
    }

    /// gradients() of this rank's shard, its refusal shared with every rank, then the ranks'
    /// gradients and losses combined (detail::combine).
    double distributed_gradients(const std::vector<int>& ids, std::span<const int> labels,
                                 int batch, std::optional<ModelGradients<T, Backend>>& g) const {
        const int ranks = comm_->size();
        std::exception_ptr failed;
        double loss = 0.0;
        std::int64_t mine = 0, all = 0;
        try {
            check_step(ids, labels, batch);
            g.emplace(model_);
            detail::require<ConfigError>(batch >= ranks, "Trainer::step", "batch", batch,
                                         detail::concat(">= the ranks of the run, ", ranks));
            const detail::Shard sh = detail::shard_of(batch, comm_->rank(), ranks);
            const std::size_t n = ids.size() / static_cast<std::size_t>(batch),
                              at = static_cast<std::size_t>(sh.first) * n,
                              len = static_cast<std::size_t>(sh.count) * n;
            const std::vector<int> my_ids(ids.begin() + static_cast<std::ptrdiff_t>(at),
                                          ids.begin() + static_cast<std::ptrdiff_t>(at + len));
            const std::span<const int> my_labels = labels.subspan(at, len);
            loss = gradients(my_ids, my_labels, sh.count, *g);
            for (const int l : labels) all += l >= 0;
            for (const int l : my_labels) mine += l >= 0;
        } catch (...) {
            failed = std::current_exception();
        }
        detail::agree(*comm_, failed, detail::batch_print(ids, labels, batch), "Trainer::step",
                      "batch (ids, labels or batch)");
        return detail::combine(*comm_, *g, loss, mine, all);
    }

    std::uint64_t params_print(const ModelParams<T>& p) const {
        detail::Fnv1a h;
        detail::print_tensors(h, p, model_.config());
        return h.value();
    }

    /// The training forward from a fresh state, the loss (returned, or, given `into`, left in
    /// its slot `slot`) and the backward into grads.
    double gradients(const std::vector<int>& ids, std::span<const int> labels, int batch,
                     ModelGradients<T, Backend>& grads,
                     BackendScalars<T, Backend>* into = nullptr, std::size_t slot = 0) const {
        // In the glue's CallScope (CUDA: one stream, the finiteness checks deferred to one
        // flag read here). If it is raised, or the pass fails on what a deferred check let
        // through, the pass runs again strictly, where the first failing check throws at its
        // place; nothing of the trainer has changed before the step is taken.
        using Scope = typename backend::CallScopeOf<backend::GlueKernels<Backend, T>>::type;
        if constexpr (std::is_same_v<Scope, backend::NoCallScope>) {
            return gradients_pass(ids, labels, batch, grads, into, slot);
        }
        {
            Scope scope;
            try {
                const double loss = gradients_pass(ids, labels, batch, grads, into, slot);
                if (!scope.flagged()) {
                    return loss;
                }
            } catch (const NonFiniteError&) {  // named at its place below
            }
        }
        const Scope strict(false);
        grads.zero();
        return gradients_pass(ids, labels, batch, grads, into, slot);
    }

    /// The training forward, the loss and the backward, as gradients() describes.
    double gradients_pass(const std::vector<int>& ids, std::span<const int> labels, int batch,
                          ModelGradients<T, Backend>& grads, BackendScalars<T, Backend>* into,
                          std::size_t slot) const {
        auto state = model_.make_state(batch);
        typename ModelType::Trace trace;
        double loss = 0.0;
        if (into != nullptr) {
            model_.forward_loss(state, ids, labels, trace, *into, slot);
        } else {
            loss = model_.forward_loss(state, ids, labels, trace);
        }
        model_.backward_loss(trace, grads);
        return loss;
    }

    TrainerConfig cfg_;
    ModelType model_;
    ModelAdamW<T, Backend> opt_;  // the parameters and moments in the backend's memory
    TrainerProgress progress_;
    std::shared_ptr<Communicator> comm_;  // a data-parallel run's (null: alone)
    std::int64_t check_every_ = 0;
};

}  // namespace titans
