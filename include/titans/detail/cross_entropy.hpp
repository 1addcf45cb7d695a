#pragma once
// titans/detail/cross_entropy.hpp: the rows of the cross-entropy loss (train/loss.hpp), shared
// by cross_entropy_loss on host matrices and the CPU's glue kernel on views.

#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>

#include <Eigen/Core>

namespace titans::detail {

/// L = -(1 / n) Σ_{r counted} log softmax(logits_r)[label_r] over the rows whose label is >= 0
/// (n of them), dlogits_r = (softmax(logits_r) - onehot(label_r)) / n (0 for ignored rows).
/// Inputs checked by the caller: labels one per row, each < logits.cols(), logits finite,
/// dlogits of logits' shape and distinct. Log-sum-exp in double with the row maximum
/// subtracted. Returns 0 (dlogits zero) when no row is counted.
template <class L, class D>
double cross_entropy_rows(const L& logits, std::span<const int> labels, D&& dlogits) {
    using T = typename std::decay_t<D>::Scalar;
    std::int64_t counted = 0;
    for (const int label : labels) counted += label >= 0;
    dlogits.setZero();
    if (counted == 0) return 0.0;
    const double inv_n = 1.0 / static_cast<double>(counted);
    double loss = 0.0;
    for (Eigen::Index r = 0; r < logits.rows(); ++r) {
        const int label = labels[static_cast<std::size_t>(r)];
        if (label < 0) continue;
        const auto z = logits.row(r).template cast<double>().array();
        const double m = z.maxCoeff();
        const auto e = (z - m).exp();
        const double sum = e.sum();
        loss += std::log(sum) + m - z(label);
        dlogits.row(r) = (e / sum * inv_n).template cast<T>().matrix();
        dlogits(r, label) -= static_cast<T>(inv_n);
    }
    return loss * inv_n;
}

}  // namespace titans::detail
