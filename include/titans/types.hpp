#pragma once
// titans/types.hpp: the dense matrix types of the CPU API.
//
// Tokens are row vectors (math conventions, docs/math.md), so every matrix is row-major: a sequence of N
// tokens of width d is an `N x d` Matrix and a linear layer is `x * W`. A batch of B
// sequences of N tokens is stacked sequence-major into a `(B*N) x d` Matrix: rows
// [b*N, (b+1)*N) belong to sequence b.

#include <Eigen/Core>

namespace titans {

template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic, Eigen::RowMajor>;

/// What the public forward/read calls take: a read-only view of a row-major matrix or of a
/// block of rows / columns of one, passed without a copy. Anything else (a column-major
/// matrix, a product, a cast) is evaluated into a temporary row-major copy first: one pass
/// over the input, the cost of the conversion and nothing more.
template <class T>
using MatrixRef = Eigen::Ref<const Matrix<T>>;

using Matrixf = Matrix<float>;
using Matrixd = Matrix<double>;
using RowVectorf = RowVector<float>;
using RowVectord = RowVector<double>;

}  // namespace titans
