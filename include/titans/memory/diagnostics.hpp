#pragma once
// titans/memory/diagnostics.hpp: per-token surprise, returned on request by a forward call.

#include "../types.hpp"

namespace titans {

/// Per-token, per-head measures of surprise, taken at the weights the write's gradient is
/// taken at (the chunk-start weights W^s for the chunked update, M_{t-1} per token):
///   loss(i, h)      = 1/2 ||M(k_i) - v_i||^2               (math §2, before the write)
///   grad_norm(i, h) = sqrt(sum_l ||a_{l-1} delta_l^T||_F^2) = sqrt(sum_l |a_{l-1}|^2 |delta_l|^2)
/// Shapes: (B*N) x H, rows as in the input.
template <class T>
struct Diagnostics {
    Matrix<T> loss;
    Matrix<T> grad_norm;
};

}  // namespace titans
