#pragma once
// titans/detail/check.hpp: the shape-and-finiteness check of the parameter structs' validate().

#include <Eigen/Core>

#include "../error.hpp"

namespace titans::detail {

/// check(m, name, rows, cols): ShapeError "<owner>: <name> is r x c, expected rows x cols"
/// unless m is rows x cols, NonFiniteError "<owner>: <name> has a NaN or infinite entry".
struct TensorCheck {
    const char* owner;

    template <class M>
    void operator()(const M& m, const char* name, Eigen::Index rows, Eigen::Index cols) const {
        if (m.rows() != rows || m.cols() != cols) {
            throw ShapeError(concat(owner, ": ", name, " is ", m.rows(), " x ", m.cols(),
                                    ", expected ", rows, " x ", cols));
        }
        if (!m.allFinite()) {
            throw NonFiniteError(concat(owner, ": ", name, " has a NaN or infinite entry"));
        }
    }
};

}  // namespace titans::detail
