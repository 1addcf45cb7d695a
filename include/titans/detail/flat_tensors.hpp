#pragma once
// titans/detail/flat_tensors.hpp: a parameter struct's tensors laid out flat, one after the
// other in its tensors() order, each row-major: how a layer, a block and a model see their
// gradients in one buffer of the backend's memory (math §9, "One gradient buffer").

#include <string>
#include <vector>

#include <Eigen/Core>

#include "../error.hpp"
#include "../view.hpp"
#include "check.hpp"
#include "tensor_slots.hpp"

namespace titans::detail {

/// Entries of every tensor Params::tensors(p, cfg, .) visits: the length of p's flat layout.
template <class Params, class Config>
[[nodiscard]] Eigen::Index flat_size(const Params& p, const Config& cfg) {
    Eigen::Index n = 0;
    for (const auto& s : tensor_slots(p, cfg)) n += s.size();
    return n;
}

/// The views of `flat` (1 x flat_size(shapes, cfg), contiguous) as the tensors of `shapes`, in
/// its tensors() order: tensor i is rows_i x cols_i row-major at the sum of the sizes before
/// it. X is T or const T.
template <class X, class Params, class Config>
[[nodiscard]] std::vector<View<X>> flat_views(View<X> flat, const Params& shapes,
                                              const Config& cfg) {
    std::vector<View<X>> out;
    X* at = flat.data;
    for (const auto& s : tensor_slots(shapes, cfg)) {
        out.push_back(View<X>{at, s.rows, s.cols, s.cols});
        at += s.size();
    }
    return out;
}

/// Entries [first, first + n) of a flat 1 x m view, as a 1 x n view.
template <class X>
[[nodiscard]] View<X> flat_range(View<X> flat, Eigen::Index first, Eigen::Index n) {
    return View<X>{flat.data + first, 1, n, n};
}

/// ShapeError unless `flat` holds a layer's parameters flat: 1 x n, contiguous (what a
/// layer's prepare_flat takes).
template <class X>
void check_flat_params(const char* where, View<X> flat, Eigen::Index n) {
    if (flat.rows != 1 || flat.cols != n || flat.stride < flat.cols ||
        (n > 0 && flat.data == nullptr)) {
        throw ShapeError(concat(where, ": flat is ", flat.rows, " x ", flat.cols,
                                ", expected 1 x ", n, " (the parameters, flat in tensors() "
                                "order, in the backend's memory)"));
    }
}

/// ShapeError unless `grads` is a layer's flat gradient view: 1 x n, contiguous (what a
/// backward on views adds its parameters' gradients to; `what` names the layer's tensors).
template <class X>
void check_flat_gradient(const char* where, View<X> grads, Eigen::Index n, const char* what) {
    if (grads.rows != 1 || grads.cols != n || grads.stride < grads.cols ||
        (n > 0 && grads.data == nullptr)) {
        throw ShapeError(concat(where, ": grads is ", grads.rows, " x ", grads.cols,
                                ", expected 1 x ", n, " (", what,
                                ", flat in tensors() order, in the backend's memory)"));
    }
}

}  // namespace titans::detail
