#pragma once
// tests/training_pass.hpp: a layer's loss and its gradients from a fresh state, for the
// backward tests (Layer: titans::NeuralMemory<double> or titans::Block<double>).
//
//   fresh_loss<Layer>(cfg, p, batch, x, dy)           L = sum(dy . y), y = a fresh forward
//   fresh_gradients<Layer>(cfg, p, batch, x, dy, dx)  dL/dparams from the training pass (dx
//                                                     written)

#include <titans/titans.hpp>

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

}  // namespace titans_test
