#pragma once
// titans/models/model_training.hpp: the training pass of a Model (math §9, "Blocks and the
// model"): Model::forward(state, x, out, trace), forward_tokens(state, ids, out, trace) and
// Model::backward(trace, dout, grads, dx, d_state_in, d_state_out). The forward runs every
// block's training forward from the model's state; the backward reverses
//     h_0 = x (or embedding rows),  h_i = Block_i(h_{i-1}),  out = RMSNorm(h_n) head
// and scatters the input gradient into the embedding rows of the tokens.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../error.hpp"
#include "../detail/tensor_slots.hpp"
#include "block_training.hpp"
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
    Matrix<T> normed;      // RMSNorm_final(h_n), rows x d_model: the head's input
    std::vector<int> ids;  // forward_tokens: the ids whose embedding rows get the gradient

    [[nodiscard]] bool empty() const { return !filled; }
};

namespace detail {

/// The body of Model's training calls (a friend of Model).
template <class T, class Backend>
struct ModelTraining {
    using Mdl = Model<T, Backend>;
    using State = ModelState<T, Backend>;
    using Trace = ModelTrace<T, Backend>;

    static void forward(const Mdl& model, State& state, const MatrixRef<T>& x, Matrix<T>& out,
                        Trace& trace, std::vector<int> ids = {}) {
        constexpr const char* where = "Model::forward (training)";
        model.check_input(state, x.rows(), x.cols(), where);
        const ThreadScope team(model.threads_, 3.0 * model.work_estimate(x.rows()));
        State next = state;  // committed only if every block and the head succeed
        Trace t;
        t.cfg = model.cfg_;
        t.batch = state.batch;
        t.start = state.position;
        t.rows = x.rows();
        t.blocks.resize(model.blocks_.size());
        Matrix<T> h = x, hn;
        for (std::size_t i = 0; i < model.blocks_.size(); ++i) {
            try {
                model.blocks_[i].forward(next.blocks[i], h, hn, t.blocks[i]);
            } catch (const NonFiniteError& e) {
                throw NonFiniteError(concat("Model::forward: block ", i, ": ", e.what()));
            } catch (const ConfigError& e) {  // a continuing forward the block cannot take
                throw ConfigError(concat("Model::forward: block ", i, ": ", e.what()));
            }
            h.swap(hn);
        }
        model.norm_final_.forward(h, t.normed, t.norm_final);
        Matrix<T> o(h.rows(), model.params_->head.cols());
        multiply(o, t.normed, model.params_->head);
        model.require_finite_output(o);
        next.position += x.rows() / state.batch;
        t.ids = std::move(ids);
        t.filled = true;
        out = std::move(o);
        trace = std::move(t);
        state = std::move(next);
    }

    static void backward(const Mdl& model, const Trace& tr, const MatrixRef<T>& dout,
                         ModelParams<T>& grads, Matrix<T>* dx, ModelStateGradient<T>* d_in,
                         const ModelStateGradient<T>* d_out) {
        constexpr const char* where = "Model::backward";
        const ModelConfig& cfg = model.cfg_;
        check_trace(model, tr, where);
        check_gradient_rows(dout, tr.rows, cfg.output_dim(), where, "dout");
        check_same_tensors(*model.params_, grads, cfg, where, "grads");
        if (dx != nullptr && overlaps(dout, *dx)) {
            throw ShapeError(concat(where, ": dx shares storage with dout, expected a distinct "
                                           "matrix"));
        }
        const bool chained = d_out != nullptr && !d_out->empty();
        require<ShapeError>(!chained || d_out->blocks.size() == cfg.blocks.size(), where,
                            "d_state_out.blocks.size()", chained ? d_out->blocks.size() : 0,
                            concat(cfg.blocks.size(), " (the model's blocks)"));
        const ThreadScope team(model.threads_, 3.0 * model.work_estimate(tr.rows));
        ModelParams<T> g = ModelParams<T>::zeros(cfg);
        ModelStateGradient<T> d_start;
        if (d_in != nullptr) {
            d_start.blocks.resize(cfg.blocks.size());
        }
        g.head.noalias() = tr.normed.transpose() * dout;
        const Matrix<T> dz = dout * model.params_->head.transpose();
        Matrix<T> dh, dprev;
        model.norm_final_.backward(tr.norm_final, dz, dh, g.norm_final);
        for (std::size_t i = model.blocks_.size(); i-- > 0;) {
            // Into g's own zeros: no second accumulator per block (BlockTraining::accumulate).
            BlockTraining<T, Backend>::accumulate(model.blocks_[i], tr.blocks[i], dh, dprev,
                                                  g.blocks[i],
                                                  d_in != nullptr ? &d_start.blocks[i] : nullptr,
                                                  chained ? &d_out->blocks[i] : nullptr);
            dh.swap(dprev);
        }
        for (std::size_t r = 0; r < tr.ids.size(); ++r) {
            g.embedding.row(tr.ids[r]) += dh.row(static_cast<Eigen::Index>(r));
        }
        if (!all_finite(dh) || !tensors_finite(g, cfg)) {
            throw NonFiniteError(concat(where, ": the gradients overflow, expected finite "
                                               "values; grads are unchanged"));
        }
        add_tensors(g, grads, cfg);
        if (dx != nullptr) {
            *dx = std::move(dh);
        }
        if (d_in != nullptr) {  // empty after a fresh start: no earlier piece
            const bool none = tr.start == 0;
            *d_in = none ? ModelStateGradient<T>{} : std::move(d_start);
        }
    }

private:
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
        check_trace_shape(tr.normed, tr.rows, cfg.d_model, where, "normed");
        const bool ids = tr.ids.empty() || (cfg.vocab_size > 0 &&
                                            static_cast<Eigen::Index>(tr.ids.size()) == tr.rows);
        check_trace_part(ids, where, "ids.size()", tr.ids.size(),
                         cfg.vocab_size > 0 ? "0 or trace.rows" : "0 (a model without a vocabulary)");
        for (std::size_t r = 0; r < tr.ids.size(); ++r) {
            check_trace_part(tr.ids[r] >= 0 && tr.ids[r] < cfg.vocab_size, where,
                             concat("ids[", r, "]"), tr.ids[r],
                             concat("a token id in [0, vocab_size = ", cfg.vocab_size, ")"));
        }
    }
};

}  // namespace detail

}  // namespace titans
