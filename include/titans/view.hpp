#pragma once
// titans/view.hpp: non-owning views of row-major matrices, what the backend seam passes.
//
// The kernels of a backend (backend/backend.hpp) take their inputs and outputs as View<const T>
// and View<T>: a pointer, a shape and a row stride, in that backend's memory (host memory for
// backend::Cpu, device memory for a GPU backend). The layers make them at the public API edge
// from Eigen matrices (view_of), directly when the backend can read host memory and through
// the backend's Transfer otherwise (backend/edge.hpp). Eigen stays at that edge and inside the
// CPU backend, which maps a view back to an Eigen::Map without a copy.

#include <cstddef>
#include <type_traits>

#include "types.hpp"

namespace titans {

/// A non-owning view of a row-major matrix: `rows x cols` entries, row r starting at
/// `data + r * stride` (stride >= cols), in some backend's memory. T may be const (a read-only
/// view); a View<T> converts to a View<const T>. Cheap to copy; it never owns nor checks (the
/// layers check shapes before a view reaches a kernel).
///
///     Matrixd x = Matrixd::Random(4, 3);
///     titans::View<const double> v = titans::view_of(x);   // v.rows == 4, v.stride == 3
///     auto tail = v.middle_rows(1, 3);                    // rows 1..3, no copy
template <class T>
struct View {
    T* data = nullptr;
    std::ptrdiff_t rows = 0;
    std::ptrdiff_t cols = 0;
    std::ptrdiff_t stride = 0;  // elements from one row's start to the next's

    /// The read-only view of the same entries.
    constexpr operator View<const T>() const  // NOLINT(google-explicit-constructor)
        requires(!std::is_const_v<T>)
    {
        return View<const T>{data, rows, cols, stride};
    }
    /// Rows [r0, r0 + n) (checked by the caller).
    [[nodiscard]] constexpr View middle_rows(std::ptrdiff_t r0, std::ptrdiff_t n) const {
        return View{data + r0 * stride, n, cols, stride};
    }
    [[nodiscard]] constexpr bool empty() const { return rows == 0 || cols == 0; }
};

/// The view of a host row-major matrix (mutable or read-only), or of an Eigen::Ref to one or
/// to a block of one (inner stride 1).
template <class T>
[[nodiscard]] View<T> view_of(Matrix<T>& m) {
    return View<T>{m.data(), m.rows(), m.cols(), m.outerStride()};
}
template <class T>
[[nodiscard]] View<const T> view_of(const Matrix<T>& m) {
    return View<const T>{m.data(), m.rows(), m.cols(), m.outerStride()};
}
template <class T>
[[nodiscard]] View<const T> view_of(const MatrixRef<T>& m) {
    return View<const T>{m.data(), m.rows(), m.cols(), m.outerStride()};
}
/// A row vector as a 1 x n view.
template <class T>
[[nodiscard]] View<T> view_of(RowVector<T>& m) {
    return View<T>{m.data(), 1, m.cols(), m.cols()};
}
template <class T>
[[nodiscard]] View<const T> view_of(const RowVector<T>& m) {
    return View<const T>{m.data(), 1, m.cols(), m.cols()};
}

}  // namespace titans
