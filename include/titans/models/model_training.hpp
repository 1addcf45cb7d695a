#pragma once
// titans/models/model_training.hpp: the training pass of a Model (math §9, "Blocks and the
// model"): Model::forward(state, x, out, trace), forward_tokens(state, ids, out, trace) and
// Model::backward(trace, dout, grads, dx, d_state_in, d_state_out). The forward runs every
// block's training forward from the model's state; the backward reverses
//     h_0 = x (or embedding rows),  h_i = Block_i(h_{i-1}),  out = RMSNorm(h_n) head
// and scatters the input gradient into the embedding rows of the tokens. Both keep their
// activations and traces in the backend's memory: the input goes up once (the ids, gathered
// there, or the vectors), the logits come down once, and the backward takes dL/dlogits up once
// and adds the parameter gradients to one flat buffer there (model_gradients.hpp; the host
// calls download it once and add it to host structs).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "../backend/edge.hpp"
#include "../detail/check.hpp"
#include "../error.hpp"
#include "../detail/tensor_slots.hpp"
#include "backend_scalars.hpp"
#include "block_training.hpp"
#include "model_gradients.hpp"
#include "model.hpp"
#include "state_gradient.hpp"

namespace titans {

/// What Model's training forward keeps for backward (math §9): the configuration of the model
/// that made it, every block's trace, the final norm's, the head's input and, after
/// forward_tokens, the token ids. rows = B*N of the call. Empty until a training forward fills
/// it, and again once moved from.
template <class T, class Backend>
struct ModelTrace {
    ModelConfig cfg;
    int batch = 0;
    std::int64_t start = 0;  // the model's position at the call
    Eigen::Index rows = 0;
    detail::TraceFilled filled;
    std::vector<BlockTrace<T, Backend>> blocks;
    typename RMSNorm<T, Backend>::Trace norm_final;
    /// RMSNorm_final(h_n), rows x d_model, in the backend's memory: the head's input.
    typename backend::Transfer<Backend, T>::Buffer normed;
    std::vector<int> ids;  // forward_tokens: the ids whose embedding rows get the gradient
    /// The same ids in the backend's memory (uploaded once by the forward): what the
    /// backward's scatter_add reads.
    typename backend::GlueKernels<Backend, T>::Ids device_ids;
    /// forward_loss: dL/dlogits of its loss (rows x output_dim, in the backend's memory), what
    /// backward_loss starts from; empty (0 x 0) after forward and forward_tokens.
    typename backend::Transfer<Backend, T>::Buffer dlogits;
    bool has_loss = false;

    [[nodiscard]] bool empty() const { return !filled; }
};

namespace detail {

/// The body of Model's training calls (a friend of Model).
template <class T, class Backend>
struct ModelTraining {
    using Mdl = Model<T, Backend>;
    using State = ModelState<T, Backend>;
    using Trace = ModelTrace<T, Backend>;

    /// Model::forward (training) from host vectors: checked (finite too) and uploaded once.
    static void forward(const Mdl& model, State& state, const MatrixRef<T>& x, Matrix<T>& out,
                        Trace& trace) {
        constexpr const char* where = "Model::forward (training)";
        model.check_input(state, x.rows(), x.cols(), where);
        if (!all_finite(x)) {
            throw NonFiniteError(concat(where, ": x has a NaN or infinite entry"));
        }
        const backend::Upload<Backend, T> in(x);
        run(model, state, in.view(), out, trace, {}, {});
    }

    /// Model::forward_tokens (training): the ids checked, their embedding rows gathered on the
    /// backend.
    static void forward_tokens(const Mdl& model, State& state, const std::vector<int>& ids,
                               Matrix<T>& out, Trace& trace) {
        typename Glue::Ids kept;
        const Buffer x = model.embedded(state, ids, "Model::forward_tokens (training)", &kept);
        run(model, state, cview(x), out, trace, ids, std::move(kept));
    }

    /// Model::forward_loss: forward_tokens with the logits kept on the backend, the
    /// cross-entropy against labels there (its gradient kept in the trace), the loss back.
    /// into (or null: the loss back now) takes the loss in slot `slot`.
    static double forward_loss(const Mdl& model, State& state, const std::vector<int>& ids,
                               std::span<const int> labels, Trace& trace,
                               BackendScalars<T, Backend>* into = nullptr, std::size_t slot = 0) {
        constexpr const char* where = "Model::forward_loss";
        std::optional<BackendScalars<T, Backend>> own;  // where the loss waits to come back
        if (into == nullptr) own.emplace();
        typename BackendScalars<T, Backend>::Slots& s =
            (into != nullptr ? *into : *own).at(slot, where);
        require<ShapeError>(labels.size() == ids.size(), where, "labels.size()", labels.size(),
                            concat("ids.size() = ", ids.size()));
        for (const int label : labels) {
            require<ShapeError>(label < model.cfg_.vocab_size, where, "a label", label,
                                concat("< vocab_size = ", model.cfg_.vocab_size,
                                       " (or negative: not scored)"));
        }
        typename Glue::Ids kept;
        const Buffer x = model.embedded(state, ids, where, &kept);
        State next = state;
        Trace t;
        const Buffer logits = forward_pass(model, next, cview(x), t);
        if (Glue::nonfinite_row(cview(logits)) >= 0) {
            model.throw_nonfinite_output();
        }
        t.dlogits = Transfer::allocate(t.rows, model.params_->head.cols());
        Glue::cross_entropy(cview(logits), labels, view(t.dlogits), s, slot);
        const double loss = own ? own->read()[slot] : 0.0;
        t.has_loss = true;
        t.ids = ids;
        t.device_ids = std::move(kept);
        commit(state, std::move(next), trace, std::move(t));
        return loss;
    }

    /// Model::backward from host dout: checked, uploaded once; Grads: ModelParams<T> (host,
    /// added to once at the end) or ModelGradients<T, Backend> (added to on the backend).
    template <class Grads>
    static void backward(const Mdl& model, const Trace& tr, const MatrixRef<T>& dout,
                         Grads& grads, Matrix<T>* dx, ModelStateGradient<T>* d_in,
                         const ModelStateGradient<T>* d_out) {
        constexpr const char* where = "Model::backward";
        check_trace(model, tr, where);
        check_gradient_rows(dout, tr.rows, model.cfg_.output_dim(), where, "dout");
        if (dx != nullptr && overlaps(dout, *dx)) {
            throw ShapeError(concat(where, ": dx shares storage with dout, expected a distinct "
                                           "matrix"));
        }
        check_grads(model, grads, where);
        const backend::Upload<Backend, T> dO(dout);
        backward_checked(model, tr, dO.view(), sink(model, grads), dx, d_in, d_out);
    }

    /// Model::backward_loss: from the gradient of forward_loss's loss, kept in the trace.
    template <class Grads>
    static void backward_loss(const Mdl& model, const Trace& tr, Grads& grads, Matrix<T>* dx,
                              ModelStateGradient<T>* d_in, const ModelStateGradient<T>* d_out) {
        constexpr const char* where = "Model::backward_loss";
        check_trace(model, tr, where);
        if (!tr.has_loss) {
            throw ConfigError(concat(where, ": the trace holds no loss, expected one filled by "
                                            "forward_loss (else call backward with dL/dout)"));
        }
        check_trace_view(cview(tr.dlogits), tr.rows, model.cfg_.output_dim(), where, "dlogits");
        check_grads(model, grads, "Model::backward");
        backward_checked(model, tr, cview(tr.dlogits), sink(model, grads), dx, d_in, d_out);
    }

    /// The backward from dout in the backend's memory (the trace, dout and grads checked): the
    /// gradients into a zeroed flat buffer there, handed to add(flat) once they and dL/dx are
    /// known finite.
    template <class Add>
    static void backward_checked(const Mdl& model, const Trace& tr, View<const T> dout, Add add,
                                 Matrix<T>* dx, ModelStateGradient<T>* d_in,
                                 const ModelStateGradient<T>* d_out) {
        constexpr const char* where = "Model::backward";
        const ModelConfig& cfg = model.cfg_;
        const bool chained = d_out != nullptr && !d_out->empty();
        require<ShapeError>(!chained || d_out->blocks.size() == cfg.blocks.size(), where,
                            "d_state_out.blocks.size()", chained ? d_out->blocks.size() : 0,
                            concat(cfg.blocks.size(), " (the model's blocks)"));
        const ThreadScope team(model.threads_, 3.0 * model.work_estimate(tr.rows));
        Buffer g = Transfer::allocate(1, flat_size(*model.params_, cfg));
        Glue::fill(view(g), T(0));
        ModelStateGradient<T> d_start;
        if (d_in != nullptr) {
            d_start.blocks.resize(cfg.blocks.size());
        }
        Buffer dh = input_gradient(model, tr, dout, view(g), chained ? d_out : nullptr,
                                   d_in != nullptr ? &d_start : nullptr);
        if (Glue::nonfinite_row(cview(dh)) >= 0 || Glue::nonfinite_row(cview(g)) >= 0) {
            throw NonFiniteError(concat(where, ": the gradients overflow, expected finite "
                                               "values; grads are unchanged"));
        }
        add(cview(g));
        if (dx != nullptr) {
            dx->resize(tr.rows, cfg.d_model);
            Transfer::download(cview(dh), view_of(*dx));
        }
        if (d_in != nullptr) {  // empty after a fresh start: no earlier piece
            const bool none = tr.start == 0;
            *d_in = none ? ModelStateGradient<T>{} : std::move(d_start);
        }
    }

private:
    using Transfer = backend::Transfer<Backend, T>;
    using Buffer = typename Transfer::Buffer;
    using Glue = backend::GlueKernels<Backend, T>;
    static View<T> view(Buffer& b) { return Transfer::view(b); }
    static View<const T> cview(const Buffer& b) { return Transfer::view(b); }

    static void check_grads(const Mdl& model, const ModelParams<T>& grads, const char* where) {
        check_same_tensors(*model.params_, grads, model.cfg_, where, "grads");
    }
    static void check_grads(const Mdl& model, const ModelGradients<T, Backend>& grads,
                            const char* where) {
        grads.check_layout(model, where);
    }
    /// How the finished flat gradient joins grads: added to the host tensors (one download
    /// off the host), or to the gradient buffer on the backend.
    static auto sink(const Mdl& model, ModelParams<T>& grads) {
        return [&model, &grads](View<const T> g) {
            backend::add_to_host<Backend>(g, grads, model.cfg_);
        };
    }
    static auto sink(const Mdl&, ModelGradients<T, Backend>& grads) {
        return [&grads](View<const T> g) {
            const View<T> to = grads.view();
            Glue::add(View<const T>(to), g, to);
        };
    }

    /// The training forward on a checked input x in the backend's memory: the logits
    /// downloaded once into out; state, out and trace change only if every step succeeds.
    static void run(const Mdl& model, State& state, View<const T> x, Matrix<T>& out,
                    Trace& trace, std::vector<int> ids, typename Glue::Ids device_ids) {
        State next = state;  // committed only if every block and the head succeed
        Trace t;
        const Buffer logits = forward_pass(model, next, x, t);
        Matrix<T> o(x.rows, model.params_->head.cols());
        Transfer::download(cview(logits), view_of(o));
        model.require_finite_output(o);
        t.ids = std::move(ids);
        t.device_ids = std::move(device_ids);
        out = std::move(o);
        commit(state, std::move(next), trace, std::move(t));
    }

    /// The training forward into next and t: every block's training forward, their
    /// activations in two buffers taken in turn, the final norm (its output kept in t) and the
    /// head; returns the logits, in the backend's memory.
    static Buffer forward_pass(const Mdl& model, State& next, View<const T> x, Trace& t) {
        const ThreadScope team(model.threads_, 3.0 * model.work_estimate(x.rows));
        t.cfg = model.cfg_;
        t.batch = next.batch;
        t.start = next.position;
        t.rows = x.rows;
        t.blocks.resize(model.blocks_.size());
        std::array<Buffer, 2> buf{Transfer::allocate(x.rows, x.cols),
                                  Transfer::allocate(x.rows, x.cols)};
        View<const T> h = x;
        for (std::size_t i = 0; i < model.blocks_.size(); ++i) {
            const View<T> y = view(buf[i % 2]);
            try {
                model.blocks_[i].forward(next.blocks[i], h, y, t.blocks[i]);
            } catch (const NonFiniteError& e) {
                throw NonFiniteError(concat("Model::forward: block ", i, ": ", e.what()));
            } catch (const ConfigError& e) {  // a continuing forward the block cannot take
                throw ConfigError(concat("Model::forward: block ", i, ": ", e.what()));
            }
            h = y;
        }
        t.normed = Transfer::allocate(x.rows, x.cols);
        model.norm_final_.forward(h, view(t.normed), t.norm_final);
        Buffer logits = Transfer::allocate(x.rows, model.params_->head.cols());
        Glue::product(cview(t.normed), model.edge_view(model.params_->head, &Mdl::Edge::head),
                      view(logits));
        return logits;
    }

    /// A successful training forward: next's position advanced, t filled; both moved in.
    static void commit(State& state, State next, Trace& trace, Trace t) {
        next.position += t.rows / state.batch;
        t.filled = true;
        trace = std::move(t);
        state = std::move(next);
    }

    /// dL/d(the model's input) from dout (in the backend's memory): the head (its gradient
    /// normedᵀ dout), the final norm, every block last first (each adding into its slice of
    /// the flat gradient g, BlockTraining::accumulate), then the embedding rows of the tokens
    /// (scatter-added).
    static Buffer input_gradient(const Mdl& model, const Trace& tr, View<const T> dout,
                                 View<T> g, const ModelStateGradient<T>* d_out,
                                 ModelStateGradient<T>* d_start) {
        const ModelConfig& cfg = model.cfg_;
        const Eigen::Index rows = tr.rows, d = cfg.d_model;
        // The flat layout (ModelParams::tensors): embedding, blocks, norm_final, head.
        const Eigen::Index vocab = cfg.vocab_size, out = cfg.output_dim();
        const View<T> embedding{g.data, vocab, d, d};
        Eigen::Index at = vocab * d;
        std::vector<View<T>> block_g;
        for (const auto& b : model.blocks_) {
            block_g.push_back(flat_range(g, at, b.parameter_count()));
            at += b.parameter_count();
        }
        const View<T> norm_final = flat_range(g, at, d);
        const View<T> head{g.data + at + d, d, out, out};
        Glue::product_at(cview(tr.normed), dout, head);
        Buffer dh = Transfer::allocate(rows, d), dprev = Transfer::allocate(rows, d);
        Glue::product_bt(dout, model.edge_view(model.params_->head, &Mdl::Edge::head), view(dprev));
        model.norm_final_.backward(tr.norm_final, cview(dprev), view(dh), norm_final);
        for (std::size_t i = model.blocks_.size(); i-- > 0;) {
            BlockTraining<T, Backend>::accumulate(
                model.blocks_[i], tr.blocks[i], cview(dh), view(dprev), block_g[i],
                d_start != nullptr ? &d_start->blocks[i] : nullptr,
                d_out != nullptr ? &d_out->blocks[i] : nullptr);
            std::swap(dh, dprev);
        }
        if (!tr.ids.empty()) {
            Glue::scatter_add(cview(dh), tr.device_ids, embedding);
        }
        return dh;
    }

    /// tr was filled by a training forward of a model of this configuration (block count
    /// first), with the sizes it left: batch, rows, start, every block's trace valid for its
    /// block with those, the final norm's and the head's input of rows x d_model, and token
    /// ids none (Model::forward) or one per row, each in [0, vocab_size).
    static void check_trace(const Mdl& model, const Trace& tr, const char* where) {
        const ModelConfig& cfg = model.cfg_;
        check_trace_filled(tr.filled, where);
        if (tr.cfg.blocks.size() != cfg.blocks.size()) {
            throw ConfigError(concat(where, ": trace was made by a model of ", tr.cfg.blocks.size(),
                                     " blocks, expected this model's ", cfg.blocks.size()));
        }
        check_trace_config(tr.cfg, cfg, where, "a model");
        check_trace_stream(tr.batch, tr.rows, tr.start, where);
        check_trace_part(tr.blocks.size() == cfg.blocks.size(), where, "blocks.size()",
                         tr.blocks.size(), concat(cfg.blocks.size(), " (the model's blocks)"));
        for (std::size_t i = 0; i < tr.blocks.size(); ++i) {
            const BlockTrace<T, Backend>& b = tr.blocks[i];
            model.blocks_[i].validate_trace(b, concat(where, " (trace.blocks[", i, "])").c_str());
            check_trace_part(b.rows == tr.rows && b.batch == tr.batch && b.start == tr.start,
                             where, concat("blocks[", i, "] rows, batch, start"),
                             concat(b.rows, ", ", b.batch, ", ", b.start),
                             concat(tr.rows, ", ", tr.batch, ", ", tr.start, " (the model's)"));
        }
        model.norm_final_.validate_trace(tr.norm_final,
                                         concat(where, " (trace.norm_final)").c_str());
        check_trace_part(tr.norm_final.rows() == tr.rows, where, "norm_final.rows()",
                         tr.norm_final.rows(), "trace.rows");
        check_trace_view(cview(tr.normed), tr.rows, cfg.d_model, where, "normed");
        const bool ids = tr.ids.empty() || (cfg.vocab_size > 0 &&
                                            static_cast<Eigen::Index>(tr.ids.size()) == tr.rows);
        check_trace_part(ids, where, "ids.size()", tr.ids.size(),
                         cfg.vocab_size > 0 ? "0 or trace.rows" : "0 (a model without a vocabulary)");
        check_trace_part(tr.device_ids.size() == tr.ids.size(), where, "device_ids.size()",
                         tr.device_ids.size(), "ids.size()");
        for (std::size_t r = 0; r < tr.ids.size(); ++r) {
            check_trace_part(tr.ids[r] >= 0 && tr.ids[r] < cfg.vocab_size, where,
                             concat("ids[", r, "]"), tr.ids[r],
                             concat("a token id in [0, vocab_size = ", cfg.vocab_size, ")"));
        }
    }
};

}  // namespace detail

}  // namespace titans
