#pragma once
// titans/detail/rows.hpp: gathering and scattering a span of token rows of B sequences stored
// sequence-major ((B*N) x cols, sequence b's rows [b*N, (b+1)*N)).

#include <Eigen/Core>

#include "../types.hpp"

namespace titans::detail {

/// Rows [t0, t0 + m) of each of B sequences of a sequence-major matrix, stacked: (B*m) x cols.
template <class A>
Matrix<typename A::Scalar> segment_rows(const Eigen::MatrixBase<A>& a, int B, Eigen::Index t0,
                                        Eigen::Index m) {
    const Eigen::Index N = a.rows() / B;
    Matrix<typename A::Scalar> out(B * m, a.cols());
    for (int b = 0; b < B; ++b) {
        out.middleRows(b * m, m) = a.middleRows(b * N + t0, m);
    }
    return out;
}

/// The inverse of segment_rows: seg's rows added to rows [t0, t0 + m) of each sequence.
template <class T>
void add_segment_rows(const Matrix<T>& seg, int B, Eigen::Index t0, Matrix<T>& a) {
    const Eigen::Index N = a.rows() / B, m = seg.rows() / B;
    for (int b = 0; b < B; ++b) {
        a.middleRows(b * N + t0, m) += seg.middleRows(b * m, m);
    }
}

}  // namespace titans::detail
