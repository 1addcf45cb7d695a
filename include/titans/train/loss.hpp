#pragma once
// titans/train/loss.hpp: the losses training starts its backward from (math §9): mean squared
// error and cross-entropy over logits, each returning the loss and writing its gradient.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>

#include "../detail/float_env.hpp"
#include "../detail/check.hpp"
#include "../detail/cross_entropy.hpp"
#include "../error.hpp"
#include "../limits.hpp"
#include "../types.hpp"

namespace titans {

namespace detail {

/// mse_loss where y - target, its sum of squares or 2 (y - target) / n overflows T: every
/// value from h = y / 2 - target / 2 in double (never overflows), the loss as
/// (2s)² mean((h / s)²) with s = max|h|, dy = h (4 / n) in double, then T. Returns the loss and
/// fills dy; NonFiniteError if the loss exceeds the largest double or an entry of dy the
/// largest T (the true values are not representable).
template <class T>
double mse_loss_scaled(const MatrixRef<T>& y, const MatrixRef<T>& target, Matrix<T>& dy) {
    const Eigen::ArrayXXd h =
        y.template cast<double>().array() * 0.5 - target.template cast<double>().array() * 0.5;
    const double n = static_cast<double>(y.size());
    const double s = h.abs().maxCoeff();
    const double loss = 2 * s * (2 * s * ((h / s).square().sum() / n));
    if (!std::isfinite(loss)) {
        throw NonFiniteError(concat("mse_loss: the loss mean((y - target)²) exceeds the "
                                    "largest double, expected y and target closer"));
    }
    Matrix<T> out = (h * (4 / n)).template cast<T>().matrix();
    if (!detail::all_finite(out)) {
        throw NonFiniteError(concat("mse_loss: dy = 2 (y - target) / n exceeds the largest ",
                                    scalar_name<T>(), ", expected y and target closer"));
    }
    dy = std::move(out);
    return loss;
}

}  // namespace detail

/// Mean squared error over every entry, L = mean((y - target)²), and dL/dy = 2 (y - target) / n
/// into dy (resized; n = y.size()). Values near the largest T, where y - target or its square
/// overflows, are computed by scaling (detail::mse_loss_scaled). Throws, dy unchanged then:
/// ShapeError (shapes differ, or empty), NonFiniteError (a NaN or infinite input; or a loss
/// beyond the largest double, or dy beyond the largest T).
///
///     titans::Matrixd dy;
///     const double loss = titans::mse_loss<double>(y, target, dy);
template <class T>
double mse_loss(const MatrixRef<T>& y, const MatrixRef<T>& target, Matrix<T>& dy) {
    constexpr const char* where = "mse_loss";
    if (y.rows() != target.rows() || y.cols() != target.cols() || y.size() == 0) {
        throw ShapeError(detail::concat(where, ": y is ", y.rows(), " x ", y.cols(), ", target ",
                                        target.rows(), " x ", target.cols(),
                                        ", expected equal non-empty shapes"));
    }
    if (!detail::all_finite(y) || !detail::all_finite(target)) {
        throw NonFiniteError(detail::concat(where, ": y or target has a NaN or infinite entry"));
    }
    const double inv_n = 1.0 / static_cast<double>(y.size());
    Matrix<T> diff = y - target;
    const double loss = diff.template cast<double>().squaredNorm() * inv_n;
    diff *= static_cast<T>(2 * inv_n);  // now dy
    if (!std::isfinite(loss) || !detail::all_finite(diff)) {
        return detail::mse_loss_scaled<T>(y, target, dy);
    }
    dy = std::move(diff);
    return loss;
}

/// Cross-entropy of the softmax of each row of `logits` (rows x V) against `labels` (one per
/// row, in [0, V), or negative: the row is ignored), averaged over the counted rows:
///
///     L = -(1 / n) Σ_{r counted} log softmax(logits_r)[label_r]
///     dL/dlogits_r = (softmax(logits_r) - onehot(label_r)) / n     (0 for ignored rows)
///
/// written to dlogits (resized). Log-sum-exp with the row maximum subtracted, so large logits
/// do not overflow. Returns 0 (and a zero gradient) when no row is counted. ShapeError
/// (labels.size() != rows, a label >= V, dlogits sharing logits' storage), NonFiniteError
/// (logits); dlogits is unchanged then.
template <class T>
double cross_entropy_loss(const MatrixRef<T>& logits, std::span<const int> labels,
                          Matrix<T>& dlogits) {
    constexpr const char* where = "cross_entropy_loss";
    const Eigen::Index rows = logits.rows(), vocab = logits.cols();
    detail::require<ShapeError>(static_cast<Eigen::Index>(labels.size()) == rows, where,
                                "labels.size()", labels.size(),
                                detail::concat("logits.rows() = ", rows));
    for (std::size_t r = 0; r < labels.size(); ++r) {
        detail::require<ShapeError>(labels[r] < vocab, where, "a label", labels[r],
                                    detail::concat("< logits.cols() = ", vocab,
                                                   " (or negative: ignored)"));
    }
    if (!detail::all_finite(logits)) {
        throw NonFiniteError(detail::concat(where, ": logits has a NaN or infinite entry"));
    }
    if (detail::overlaps(logits, dlogits)) {
        throw ShapeError(detail::concat(where, ": dlogits shares storage with logits, expected "
                                               "a distinct matrix"));
    }
    dlogits.resize(rows, vocab);
    return detail::cross_entropy_rows(logits, labels, dlogits);
}

}  // namespace titans
