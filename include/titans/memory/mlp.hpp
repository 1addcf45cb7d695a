#pragma once
// titans/memory/mlp.hpp: the memory model M and its associative loss (math §2), for one set
// of weights, written for clarity. The hot paths in backend/ use batched, preallocated
// versions of the same formulas.
//
//   a_0 = z,  z_l = a_{l-1} W_l,  a_l = act(z_l) (l < L),  M(z) = z_L  (+ z if residual)
//   loss(M; k, v) = 1/2 ||M(k) - v||^2
//   delta_L = M(k) - v,  dW_l = a_{l-1}^T delta_l,  delta_{l-1} = (delta_l W_l^T) . act'(z_{l-1})
//
// Shapes: W[l-1] is layer_in(l) x layer_out(l); z, k, v are n x d_h (n rows, each a token).
//
// Example (the gradient a write would use, for one key/value pair):
//   auto g = titans::associative_gradient<double>(W, k, v, titans::Activation::SiLU, false);

#include <vector>

#include "../detail/activation.hpp"
#include "../error.hpp"
#include "../types.hpp"
#include "config.hpp"
#include "key_tape.hpp"

namespace titans {

namespace detail {
template <class T>
void check_mlp_shapes(const std::vector<Matrix<T>>& W, Eigen::Index z_cols, const char* where) {
    if (W.empty()) {
        throw ShapeError(concat(where, ": W has 0 layers, expected depth >= 1"));
    }
    if (W.front().rows() != z_cols || W.back().cols() != z_cols) {
        throw ShapeError(concat(where, ": input has ", z_cols, " columns, W maps ",
                                W.front().rows(), " -> ", W.back().cols()));
    }
    for (std::size_t l = 1; l < W.size(); ++l) {
        if (W[l].rows() != W[l - 1].cols()) {
            throw ShapeError(concat(where, ": W[", l, "] has ", W[l].rows(), " rows, expected ",
                                    W[l - 1].cols(), " (columns of W[", l - 1, "])"));
        }
    }
}
}  // namespace detail

/// M(z) for every row of z (n x d_h) -> n x d_h.
template <class T>
[[nodiscard]] Matrix<T> memory_forward(const std::vector<Matrix<T>>& W, const Matrix<T>& z,
                                       Activation act, bool residual) {
    detail::check_mlp_shapes(W, z.cols(), "memory_forward");
    Matrix<T> a = z;
    for (std::size_t l = 0; l < W.size(); ++l) {
        Matrix<T> next = a * W[l];
        if (l + 1 < W.size()) {
            next = next.unaryExpr([act](T v) { return detail::activate(act, v); });
        }
        a = std::move(next);
    }
    if (residual) {
        a += z;
    }
    return a;
}

/// Sum over rows of 1/2 ||M(k_i) - v_i||^2 (k, v: n x d_h).
template <class T>
[[nodiscard]] T associative_loss(const std::vector<Matrix<T>>& W, const Matrix<T>& k,
                                 const Matrix<T>& v, Activation act, bool residual) {
    if (v.rows() != k.rows() || v.cols() != k.cols()) {
        throw ShapeError(detail::concat("associative_loss: v is ", v.rows(), " x ", v.cols(),
                                        ", expected the shape of k, ", k.rows(), " x ", k.cols()));
    }
    return T(0.5) * (memory_forward(W, k, act, residual) - v).squaredNorm();
}

/// Gradient of associative_loss with respect to every W_l (same shapes as W): the sum over
/// rows i of a_{l-1}[i]^T delta_l[i], i.e. A_{l-1}^T Delta_l (math §2, §4).
template <class T>
[[nodiscard]] std::vector<Matrix<T>> associative_gradient(const std::vector<Matrix<T>>& W,
                                                          const Matrix<T>& k, const Matrix<T>& v,
                                                          Activation act, bool residual) {
    detail::check_mlp_shapes(W, k.cols(), "associative_gradient");
    if (v.rows() != k.rows() || v.cols() != k.cols()) {
        throw ShapeError(detail::concat("associative_gradient: v is ", v.rows(), " x ", v.cols(),
                                        ", expected ", k.rows(), " x ", k.cols()));
    }
    const std::size_t L = W.size();
    std::vector<Matrix<T>> a(L), z(L);  // a[l] = input of W[l]; z[l] = its output
    a[0] = k;
    for (std::size_t l = 0; l < L; ++l) {
        z[l] = a[l] * W[l];
        if (l + 1 < L) {
            a[l + 1] = z[l].unaryExpr([act](T x) { return detail::activate(act, x); });
        }
    }
    Matrix<T> delta = z[L - 1] - v;
    if (residual) {
        delta += k;
    }
    std::vector<Matrix<T>> grad(L);
    for (std::size_t l = L; l-- > 0;) {
        grad[l] = a[l].transpose() * delta;
        if (l > 0) {
            Matrix<T> back = delta * W[l].transpose();
            delta = back.array() *
                    z[l - 1].unaryExpr([act](T x) { return detail::activate_grad(act, x); }).array();
        }
    }
    return grad;
}

/// What associative_gradient_backward returns: the gradients of φ with respect to W, k and v.
template <class T>
struct AssociativeGradientBackward {
    std::vector<Matrix<T>> dW;  ///< shaped as W
    Matrix<T> dk, dv;           ///< shaped as k
};

/// The backward of associative_gradient (math §9, the second-order terms of Δ): for the scalar
///
///     φ(W, k, v) = Σ_l <G_l, ∇_{W_l} loss(W; k, v)>      (G shaped as W)
///
/// returns ∂φ/∂W, ∂φ/∂k, ∂φ/∂v. Reverse mode through the gradient's own computation: with
/// a_l, z_l, δ_l as above, φ = Σ_l <a_l G_l, δ_l>, so ā_l = δ_l G_l^T and δ̄_l = a_l G_l; the
/// recursion δ_{l-1} = (δ_l W_l^T) ⊙ act'(z_{l-1}) sends δ̄ up (through W_l), into W̄_l and,
/// through act''(z_{l-1}), into z̄_{l-1}; then δ_L = z_L - v (+ k) and the forward pass are
/// reversed as usual.
template <class T>
[[nodiscard]] AssociativeGradientBackward<T> associative_gradient_backward(
    const std::vector<Matrix<T>>& W, const Matrix<T>& k, const Matrix<T>& v, Activation act,
    bool residual, const std::vector<Matrix<T>>& G) {
    constexpr const char* where = "associative_gradient_backward";
    detail::check_mlp_shapes(W, k.cols(), where);
    if (v.rows() != k.rows() || v.cols() != k.cols()) {
        throw ShapeError(detail::concat(where, ": v is ", v.rows(), " x ", v.cols(),
                                        ", expected ", k.rows(), " x ", k.cols()));
    }
    const std::size_t L = W.size();
    if (G.size() != L) {
        throw ShapeError(detail::concat(where, ": G has ", G.size(), " layers, expected ", L));
    }
    for (std::size_t l = 0; l < L; ++l) {
        if (G[l].rows() != W[l].rows() || G[l].cols() != W[l].cols()) {
            throw ShapeError(detail::concat(where, ": G[", l, "] is ", G[l].rows(), " x ",
                                            G[l].cols(), ", expected the shape of W[", l, "]"));
        }
    }
    detail::KeyTape<T> tape;
    tape.forward(W, k, v, act, residual);
    for (std::size_t l = 0; l < L; ++l) {
        tape.abar[l].noalias() = tape.delta[l] * G[l].transpose();
        tape.dbar[l].noalias() = tape.a[l] * G[l];
    }
    AssociativeGradientBackward<T> out;
    for (std::size_t l = 0; l < L; ++l) {
        out.dW.push_back(Matrix<T>::Zero(W[l].rows(), W[l].cols()));
    }
    tape.backward(W, act, residual, out.dW, out.dk, out.dv);
    return out;
}

}  // namespace titans
