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

/// What Model's training forward keeps for backward (math §9): every block's trace, the final
/// norm's, the head's input and, after forward_tokens, the token ids. rows = B*N of the call.
template <class T, class Backend>
struct ModelTrace {
    int batch = 0;
    std::int64_t start = 0;  // the model's position at the call
    Eigen::Index rows = 0;
    bool filled = false;
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
        model.check_input(state, x, where);
        const ThreadScope team(model.threads_, 3.0 * model.work_estimate(x.rows()));
        State next = state;  // committed only if every block and the head succeed
        Trace t;
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
        check_trace(tr.filled, tr.filled ? tr.normed.cols() : cfg.d_model, cfg.d_model, where);
        if (tr.blocks.size() != cfg.blocks.size()) {
            throw ConfigError(concat(where, ": trace holds ", tr.blocks.size(),
                                     " blocks, expected this model's ", cfg.blocks.size()));
        }
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
            model.blocks_[i].backward(tr.blocks[i], dh, dprev, g.blocks[i],
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
};

}  // namespace detail

}  // namespace titans
