#pragma once
// titans/memory/key_tape.hpp: the key pass of math §2 with every intermediate kept, and its
// reverse (math §9): the second-order block of the memory's backward. A write's gradient
// A_{l-1}^T Δ_l depends on W through A and Δ, so the adjoints of A and Δ flow back into W, k
// and v through the key pass itself, including act'' where Δ_{l-1} = (Δ_l W_l^T) ⊙ act'(Z_{l-1}).
//
//   a_0 = k, z_l = a_{l-1} W_l, a_l = act(z_l) (l < L)           (here a[l-1], z[l-1])
//   Δ_L = z_L - v (+ k if residual), Δ_{l-1} = (Δ_l W_l^T) ⊙ act'(z_{l-1})  (here delta[l-1])

#include <vector>

#include "../detail/activation.hpp"
#include "../detail/eigen_math.hpp"
#include "../types.hpp"
#include "config.hpp"

namespace titans::detail {

/// Workspaces for n key rows through an MLP memory of depth L (index l = layer l+1): the
/// forward keeps a, z, act'(z), delta and back (= delta W^T); the caller then sets the adjoints
/// abar (of a) and dbar (of delta), and backward adds dW and writes dk, dv. Buffers are
/// reused between calls of the same row count. prepend() puts p rows computed earlier (a
/// chunk's pending rows from the state) above the forward's: a and delta, abar and dbar then
/// have p + n rows, and backward reverses the n computed ones only (the first p rows' adjoints
/// stay in abar, dbar for the caller).
template <class T>
struct KeyTape {
    std::vector<Matrix<T>> a, z, d1, delta, back;  // forward
    std::vector<Matrix<T>> abar, dbar, zbar;       // adjoints
    Matrix<T> bbar, f2;                            // scratch of backward

    template <class K, class V>
    void forward(const std::vector<Matrix<T>>& W, const K& k, const V& v, Activation act,
                 bool residual) {
        const std::size_t L = W.size();
        for (auto* m : {&a, &z, &d1, &delta, &back, &abar, &dbar, &zbar}) {
            m->resize(L);
        }
        a[0] = k;
        for (std::size_t l = 0; l < L; ++l) {
            z[l].noalias() = a[l] * W[l];
            if (l + 1 < L) {
                activate_into(act, z[l], a[l + 1]);
                activate_grad_into(act, z[l], d1[l]);
            }
        }
        delta[L - 1] = z[L - 1] - v;
        if (residual) {
            delta[L - 1] += k;
        }
        for (std::size_t l = L - 1; l > 0; --l) {
            back[l].noalias() = delta[l] * W[l].transpose();
            delta[l - 1] = back[l].cwiseProduct(d1[l - 1]);
        }
        zero_adjoints();
    }

    /// Puts rows pa[l] (p x in), pd[l] (p x out) above a[l], delta[l] (the adjoints zeroed).
    void prepend(const std::vector<Matrix<T>>& pa, const std::vector<Matrix<T>>& pd) {
        for (std::size_t l = 0; l < a.size(); ++l) {
            stack_above(pa[l], a[l]);
            stack_above(pd[l], delta[l]);
        }
        zero_adjoints();
    }

    /// The reverse of forward from the adjoints in abar, dbar (consumed): dW[l] += ∂/∂W_l,
    /// dk, dv written (n x d_h).
    /// (The rows of a prepend() are not reversed: their adjoints stay in abar, dbar.)
    void backward(const std::vector<Matrix<T>>& W, Activation act, bool residual,
                  std::vector<Matrix<T>>& dW, Matrix<T>& dk, Matrix<T>& dv) {
        const std::size_t L = W.size();
        const Eigen::Index n = z[0].rows();  // the computed rows: the last n of a, delta
        const auto rows = [n](Matrix<T>& m) { return m.bottomRows(n); };
        for (std::size_t l = 0; l < L; ++l) {
            zbar[l].setZero(z[l].rows(), z[l].cols());
        }
        for (std::size_t l = 1; l < L; ++l) {  // delta_{l-1} = back_l ⊙ act'(z_{l-1}), reversed
            bbar = rows(dbar[l - 1]).cwiseProduct(d1[l - 1]);
            activate_grad2_into(act, z[l - 1], f2);
            zbar[l - 1].array() += rows(dbar[l - 1]).array() * back[l].array() * f2.array();
            rows(dbar[l]).noalias() += bbar * W[l];
            dW[l].noalias() += bbar.transpose() * rows(delta[l]);
        }
        zbar[L - 1] += rows(dbar[L - 1]);
        dv = -rows(dbar[L - 1]);
        if (residual) {
            dk = rows(dbar[L - 1]);
        } else {
            dk.setZero(n, dbar[L - 1].cols());
        }
        for (std::size_t l = L; l-- > 0;) {  // z_l = a_l W_l, a_{l+1} = act(z_l), reversed
            if (l + 1 < L) {
                zbar[l].array() += rows(abar[l + 1]).array() * d1[l].array();
            }
            dW[l].noalias() += rows(a[l]).transpose() * zbar[l];
            rows(abar[l]).noalias() += zbar[l] * W[l].transpose();
        }
        dk += rows(abar[0]);
    }

private:
    void zero_adjoints() {
        for (std::size_t l = 0; l < a.size(); ++l) {
            abar[l].setZero(a[l].rows(), a[l].cols());
            dbar[l].setZero(delta[l].rows(), delta[l].cols());
        }
    }
    static void stack_above(const Matrix<T>& top, Matrix<T>& m) {
        if (top.rows() == 0) {
            return;
        }
        Matrix<T> both(top.rows() + m.rows(), m.cols());
        both << top, m;
        m = std::move(both);
    }
};

}  // namespace titans::detail
