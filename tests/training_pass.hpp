#pragma once
// tests/training_pass.hpp: a layer's loss and its gradients from a fresh state, for the
// backward tests (Layer: titans::NeuralMemory<double> or titans::Block<double>).
//
//   fresh_loss<Layer>(cfg, p, batch, x, dy)           L = sum(dy . y), y = a fresh forward
//   fresh_gradients<Layer>(cfg, p, batch, x, dy, dx)  dL/dparams from the training pass (dx
//                                                     written)
//   chained_pieces<StateGradient>(layer, B, x, dy, cuts, g, first_empty, y)
//                                                     the same over pieces, chained in reverse
//   check_gradients_match(g, g_all, cfg, floor, cat)  every tensor of g against g_all's
//   gradient_scale(g, cfg, dx)                        the largest entry of dx or of g
//   chained_floor(g, cfg, dx)                         1e-2 of it: the floor of a chained
//                                                     test's relative errors
//   block_pieces(block, B, x, dy, cuts)               chained_pieces for a block of any scalar
//                                                     and backend: y, dx and grads in double
//   model_pieces(model, B, ids, dout, cuts)           the same for a model on token ids

#include "catch.hpp"
#include "block_cases.hpp"
#include "test_common.hpp"

#include <titans/titans.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace titans_test {

template <class Layer, class Config, class Params>
double fresh_loss(const Config& cfg, const Params& p, int batch, const titans::Matrixd& x,
                  const titans::Matrixd& dy) {
    const Layer layer(cfg, p);
    auto st = layer.make_state(batch);
    return dy.cwiseProduct(layer.forward(st, x)).sum();
}

template <class Layer, class Config, class Params>
Params fresh_gradients(const Config& cfg, const Params& p, int batch, const titans::Matrixd& x,
                       const titans::Matrixd& dy, titans::Matrixd& dx) {
    const Layer layer(cfg, p);
    auto st = layer.make_state(batch);
    typename Layer::Trace trace;
    titans::Matrixd y;
    layer.forward(st, x, y, trace);
    auto g = Params::zeros(cfg);
    layer.backward(trace, dy, dx, g);
    return g;
}

/// Chained pieces (math §9): layer's training forward over rows [cuts[k], cuts[k + 1]) of each
/// of the B streams of x (sequence-major, N rows each) in order from a fresh state, then its
/// backward last piece first, each given the next one's d_state_in as its d_state_out. Returns
/// dx (B*N x d); gradients added to g; y (if given) gets the pieces' outputs in x's layout.
/// Checks that every piece after position 0 returns a d_state_in, and those at position 0 (the
/// first, and after empty ones) an empty one when first_empty (blocks: their state restarts
/// from W^0 and P).
template <class StateGradient, class Layer, class Params>
titans::Matrixd chained_pieces(const Layer& layer, int B, const titans::Matrixd& x,
                               const titans::Matrixd& dy, const std::vector<Eigen::Index>& cuts,
                               Params& g, bool first_empty, titans::Matrixd* y = nullptr) {
    const Eigen::Index N = x.rows() / B;
    auto st = layer.make_state(B);
    std::vector<typename Layer::Trace> traces(cuts.size() - 1);
    titans::Matrixd yk;
    if (y != nullptr) y->resize(x.rows(), x.cols());
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        layer.forward(st, take_tokens(x, B, N, cuts[k], cuts[k + 1]), yk, traces[k]);
        if (y != nullptr) put_tokens(*y, yk, B, N, cuts[k], cuts[k + 1]);
    }
    titans::Matrixd dx(x.rows(), x.cols());
    StateGradient d_next;
    for (std::size_t k = traces.size(); k-- > 0;) {
        titans::Matrixd dxk;
        StateGradient d_in;
        layer.backward(traces[k], take_tokens(dy, B, N, cuts[k], cuts[k + 1]), dxk, g, &d_in,
                       &d_next);
        put_tokens(dx, dxk, B, N, cuts[k], cuts[k + 1]);
        if (cuts[k] > 0 || first_empty) CHECK(d_in.empty() == (cuts[k] == 0));
        d_next = std::move(d_in);
    }
    return dx;
}

/// The scale of a gradient: the largest entry of dx or of any tensor of g.
template <class Params, class Config>
double gradient_scale(const Params& g, const Config& cfg, const titans::Matrixd& dx) {
    double scale = dx.size() > 0 ? dx.cwiseAbs().maxCoeff() : 0.0;
    Params::tensors(g, cfg, [&](const std::string&, const auto& t) {
        if (t.size() > 0) scale = std::max(scale, titans::Matrixd(t).cwiseAbs().maxCoeff());
    });
    return scale;
}

/// The floor of the relative errors (rel_error) of chained pieces against one call: 1e-2 of
/// the gradient's scale, so a tensor far below that scale is held to 1e-14 of it (about 45
/// ulps) in absolute terms. Pieces sum a tensor's per-token terms in another order, and those
/// terms can be of the gradient's scale even where their sum is small (a final norm over
/// large rows, a constant stream whose equal keys make dL/dq cancel): their rounding is then
/// some ulps of the scale, not of the sum. 1e-3 of it (1e-15, 4.5 ulps) failed 4 of 60 seeds
/// of the model test by 1.0-1.7e-12; a missed or doubled term is off by far more.
template <class Params, class Config>
double chained_floor(const Params& g, const Config& cfg, const titans::Matrixd& dx) {
    return 1e-2 * gradient_scale(g, cfg, dx);
}

/// Every tensor of g against the same-named one of g_all (Params::tensors), relative to its
/// own largest entry or `floor`, to 1e-12; errors noted under `category`.
template <class Params, class Config>
void check_gradients_match(const Params& g, const Params& g_all, const Config& cfg, double floor,
                        const std::string& category) {
    Params::tensors(g, cfg, [&](const std::string& name, const auto& t) {
        Params::tensors(g_all, cfg, [&](const std::string& n2, const auto& t2) {
            if (n2 != name) return;
            INFO(name << " norm " << titans::Matrixd(t2).norm());
            CHECK(note_error<double>(category, rel_error(titans::Matrixd(t), titans::Matrixd(t2),
                                                         floor)) <= 1e-12);
        });
    });
}

/// What a block's training over pieces gives, in double: the outputs, dx, the gradients.
struct BlockPieces {
    titans::Matrixd y, dx;
    titans::BlockParams<double> g;
};

/// block's training forward over the pieces [cuts[k], cuts[k + 1]) of each of the B streams of
/// x (rounded to T), then its backward last piece first, each given the next one's
/// d_state_in: chained_pieces for a block of any scalar and backend, compared in double.
template <class T, class Backend>
BlockPieces block_pieces(const titans::Block<T, Backend>& block, int B, const titans::Matrixd& x,
                          const titans::Matrixd& dy, const std::vector<Eigen::Index>& cuts) {
    const Eigen::Index N = x.rows() / B;
    auto st = block.make_state(B);
    std::vector<typename titans::Block<T, Backend>::Trace> traces(cuts.size() - 1);
    BlockPieces r;
    r.y.resize(x.rows(), x.cols());
    r.dx.resize(x.rows(), x.cols());
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        titans::Matrix<T> yk;
        const titans::Matrix<T> xk = take_tokens(x, B, N, cuts[k], cuts[k + 1]).template cast<T>();
        block.forward(st, xk, yk, traces[k]);
        put_tokens(r.y, titans::Matrixd(yk.template cast<double>()), B, N, cuts[k], cuts[k + 1]);
    }
    auto g = titans::BlockParams<T>::zeros(block.config());
    titans::BlockStateGradient<T> d_next;
    for (std::size_t k = traces.size(); k-- > 0;) {
        titans::Matrix<T> dxk;
        titans::BlockStateGradient<T> d_in;
        const titans::Matrix<T> dyk = take_tokens(dy, B, N, cuts[k], cuts[k + 1]).template cast<T>();
        block.backward(traces[k], dyk, dxk, g, &d_in, &d_next);
        put_tokens(r.dx, titans::Matrixd(dxk.template cast<double>()), B, N, cuts[k], cuts[k + 1]);
        d_next = std::move(d_in);
    }
    r.g = cast_block<double>(g);
    return r;
}

struct ModelPieces {
    titans::Matrixd out, dx;
    titans::ModelParams<double> g;
};

/// model's training forward on token ids over the pieces [cuts[k], cuts[k + 1]) of each of the
/// B streams of ids (B*N, sequence-major), then its backward last piece first from dout (B*N x
/// output_dim, rounded to T), each given the next one's d_state_in: the logits, dx and grads
/// in double, for a model of any scalar and backend.
template <class T, class Backend>
ModelPieces model_pieces(const titans::Model<T, Backend>& model, int B, const std::vector<int>& ids,
                         const titans::Matrixd& dout, const std::vector<Eigen::Index>& cuts) {
    const auto N = static_cast<Eigen::Index>(ids.size()) / B;
    auto st = model.make_state(B);
    std::vector<typename titans::Model<T, Backend>::Trace> traces(cuts.size() - 1);
    ModelPieces r;
    r.out.resize(dout.rows(), dout.cols());
    r.dx.resize(dout.rows(), model.config().d_model);
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        std::vector<int> piece;
        for (int b = 0; b < B; ++b) {
            for (Eigen::Index t = cuts[k]; t < cuts[k + 1]; ++t) {
                piece.push_back(ids[static_cast<std::size_t>(b * N + t)]);
            }
        }
        titans::Matrix<T> ok;
        model.forward_tokens(st, piece, ok, traces[k]);
        put_tokens(r.out, titans::Matrixd(ok.template cast<double>()), B, N, cuts[k], cuts[k + 1]);
    }
    auto g = titans::ModelParams<T>::zeros(model.config());
    titans::ModelStateGradient<T> d_next;
    for (std::size_t k = traces.size(); k-- > 0;) {
        titans::Matrix<T> dxk;
        titans::ModelStateGradient<T> d_in;
        const titans::Matrix<T> dk = take_tokens(dout, B, N, cuts[k], cuts[k + 1]).template cast<T>();
        model.backward(traces[k], dk, g, &dxk, &d_in, &d_next);
        put_tokens(r.dx, titans::Matrixd(dxk.template cast<double>()), B, N, cuts[k], cuts[k + 1]);
        d_next = std::move(d_in);
    }
    r.g = cast_model<double>(g);
    return r;
}

}  // namespace titans_test
