#pragma once
// titans/detail/product.hpp: multiply(y, x, w), y = x w for the projections of every layer,
// fast for a streamed token as well as for a piece.
//
// A projection of a few rows (one token, or one token of each of a few streams) is bound by
// reading the weights, not by arithmetic. Eigen's GEMM first packs all of w (a 512 x 1536 float
// w: 3 MB copied per call, 7x the time of one pass over it), and its GEMV reads w once per row.
// Up to kStreamRows rows, multiply() instead reads w once: each group of four rows of w is
// added into every row of y, whose rows stay in cache, and the columns are split over the
// calling thread's team (titans/threads.hpp) when the product is large enough. More rows:
// Eigen's GEMM, whose packing is then paid back. Each entry of y is summed in the same order
// whatever the team, so results do not depend on the thread count.

#include <algorithm>
#include <array>
#include <cstddef>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../types.hpp"

namespace titans::detail {

/// Rows up to which multiply() streams w once instead of calling Eigen's GEMM.
inline constexpr Eigen::Index kStreamRows = 16;

/// y[:, c0:c1) = x w[:, c0:c1), streaming rows of w (four at a time) into every row of y, in
/// tiles of 256 columns so that the rows of w being added and the rows of y stay in L1.
template <class Y, class X, class W>
void stream_product_columns(Y& y, const X& x, const W& w, Eigen::Index c0, Eigen::Index c1) {
    using Index = Eigen::Index;
    const Index kTile = x.rows() == 1 ? c1 - c0 : 768;
    const Index m = x.rows(), K = w.rows();
    for (Index t0 = c0; t0 < c1; t0 += kTile) {
        const Index n = std::min(kTile, c1 - t0);
        auto yb = y.middleCols(t0, n);
        yb.setZero();
        Index k = 0;
        for (; k + 4 <= K; k += 4) {
            const auto w0 = w.row(k).segment(t0, n), w1 = w.row(k + 1).segment(t0, n),
                       w2 = w.row(k + 2).segment(t0, n), w3 = w.row(k + 3).segment(t0, n);
            for (Index r = 0; r < m; ++r) {
                yb.row(r) += x(r, k) * w0 + x(r, k + 1) * w1 + x(r, k + 2) * w2 + x(r, k + 3) * w3;
            }
        }
        for (; k < K; ++k) {
            const auto wk = w.row(k).segment(t0, n);
            for (Index r = 0; r < m; ++r) {
                yb.row(r) += x(r, k) * wk;
            }
        }
    }
}

/// y = [x w_0 | x w_1 | ...]: y (already sized x.rows() x the sum of the w_i's columns) takes
/// the products side by side; y must not alias x or any w_i. Row-major operands of one scalar
/// type. One pass over every w_i (streamed, columns split over the team) for a few rows, one
/// Eigen GEMM per w_i for more: several projections of the same x cost one parallel region.
template <class Y, class X, class W, std::size_t K>
void multiply_concat(Y&& y, const X& x, const std::array<const W*, K>& ws) {
    using Index = Eigen::Index;
    const Index m = x.rows();
    std::array<Index, K + 1> at{};  // first column of each product in y
    for (std::size_t i = 0; i < K; ++i) at[i + 1] = at[i] + ws[i]->cols();
    const Index n = at[K];
    if (m > kStreamRows || m == 0 || n == 0) {
        for (std::size_t i = 0; i < K; ++i) {
            y.middleCols(at[i], ws[i]->cols()).noalias() = x * *ws[i];
        }
        return;
    }
    // Columns [c0, c1) of the whole: the overlapping columns of each product.
    auto slice = [&](Index c0, Index c1) {
        for (std::size_t i = 0; i < K; ++i) {
            const Index a = std::max(c0, at[i]), b = std::min(c1, at[i + 1]);
            if (b > a) {
                auto yi = y.middleCols(at[i], ws[i]->cols());
                stream_product_columns(yi, x, *ws[i], a - at[i], b - at[i]);
            }
        }
    };
    int team = 1;
#if defined(_OPENMP)
    // Split only a product that takes tens of microseconds, into slices of >= 64 columns.
    const double work = static_cast<double>(m) * static_cast<double>(ws[0]->rows()) * static_cast<double>(n);
    if (!omp_in_parallel() && work >= 2.5e5) {
        team = static_cast<int>(std::min<Index>(omp_get_max_threads(), n / 64));
    }
#endif
    if (team <= 1) {
        slice(0, n);
        return;
    }
#if defined(_OPENMP)
#pragma omp parallel num_threads(team)
    {
        const Index t = omp_get_thread_num(), nt = omp_get_num_threads();
        // Slices on 16-column boundaries (whole SIMD registers), the last takes the rest.
        const Index per = ((n + nt - 1) / nt + 15) / 16 * 16;
        const Index c0 = std::min(n, t * per), c1 = std::min(n, c0 + per);
        slice(c0, c1);
    }
#endif
}

/// y = x w (y already sized x.rows() x w.cols(); y must not alias x or w). Row-major operands.
template <class Y, class X, class W>
void multiply(Y&& y, const X& x, const W& w) {
    multiply_concat(y, x, std::array<const W*, 1>{&w});
}

}  // namespace titans::detail
