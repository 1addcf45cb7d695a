#pragma once
// titans/detail/check.hpp: the shape-and-finiteness checks of the parameter structs'
// validate() and of the layers' backward calls, and with_context, which prefixes their messages.

#include <cstddef>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "float_env.hpp"
#include "../error.hpp"
#include "../view.hpp"
#include "trace.hpp"

namespace titans::detail {

/// Runs `f`; a titans error it throws (ConfigError, ShapeError, NonFiniteError, FormatError) is
/// thrown again, same type, with `prefix` in front of its message.
template <class F>
void with_context(const std::string& prefix, F&& f) {
    try {
        f();
    } catch (const ConfigError& e) {
        throw ConfigError(prefix + e.what());
    } catch (const ShapeError& e) {
        throw ShapeError(prefix + e.what());
    } catch (const NonFiniteError& e) {
        throw NonFiniteError(prefix + e.what());
    } catch (const FormatError& e) {
        throw FormatError(prefix + e.what());
    }
}

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
        if (!all_finite(m)) {
            throw NonFiniteError(concat(owner, ": ", name, " has a NaN or infinite entry"));
        }
    }
};

/// A state gradient's per-sequence adjoints of kept key and value rows (the attention's
/// window, MAC's segment buffers): `name`.keys and `name`.values hold B matrices of rows x D
/// each (ShapeError naming the part, the shapes and `meaning`, what rows x D is), finite
/// (NonFiniteError).
template <class M>
void check_sequence_adjoints(const std::vector<M>& keys, const std::vector<M>& values,
                             std::size_t B, Eigen::Index rows, Eigen::Index D, const char* where,
                             const char* name, const char* meaning) {
    for (const auto* group : {&keys, &values}) {
        const std::string part = concat(name, group == &keys ? ".keys" : ".values");
        if (group->size() != B) {
            throw ShapeError(concat(where, ": ", part, ".size() = ", group->size(),
                                    ", expected ", B, " (the batch)"));
        }
        for (const M& m : *group) {
            if (m.rows() != rows || m.cols() != D) {
                throw ShapeError(concat(where, ": ", part, " has a ", m.rows(), " x ", m.cols(),
                                        " matrix, expected ", rows, " x ", D, " (", meaning, ")"));
            }
            if (!all_finite(m)) {
                throw NonFiniteError(concat(where, ": ", name, " has a NaN or infinite entry"));
            }
        }
    }
}

/// True if the storage of `x` (a view) and of `y` (an output about to be resized) overlap:
/// writing y would then change or free x.
template <class X, class Y>
[[nodiscard]] bool overlaps(const X& x, const Y& y) {
    if (x.size() == 0 || y.size() == 0) {
        return false;
    }
    const auto* x0 = x.data();
    const auto* x1 = x.data() + (x.rows() - 1) * x.outerStride() + x.cols();
    const auto* y0 = y.data();
    const auto* y1 = y.data() + y.size();
    return x0 < y1 && y0 < x1;
}

/// Whether the storage spans of two views (first entry to last, strides included) meet; an
/// empty view meets nothing.
template <class T>
[[nodiscard]] bool views_overlap(View<const T> a, View<const T> b) {
    if (a.rows * a.cols == 0 || b.rows * b.cols == 0) return false;
    const T* a1 = a.data + (a.rows - 1) * a.stride + a.cols;
    const T* b1 = b.data + (b.rows - 1) * b.stride + b.cols;
    return a.data < b1 && b.data < a1;
}

/// View `name` is rows x cols, row-major (stride >= cols) with storage when not empty
/// (ShapeError). With `optional`, an empty view (no entries) also passes: an input the call
/// does without, or an output not asked for.
template <class X>
void check_view_shape(const char* where, const char* name, View<X> v, std::ptrdiff_t rows,
                      std::ptrdiff_t cols, bool optional = false) {
    if (optional && v.rows * v.cols == 0) return;
    if (v.rows != rows || v.cols != cols) {
        throw ShapeError(concat(where, ": ", name, " is ", v.rows, " x ", v.cols, ", expected ",
                                rows, " x ", cols, optional ? " or empty" : ""));
    }
    if (rows * cols > 0 && (v.data == nullptr || (rows > 1 && v.stride < cols))) {
        throw ShapeError(concat(where, ": ", name, " has a null pointer or a row stride of ",
                                v.stride, ", expected an allocated row-major matrix (stride >= ",
                                cols, ")"));
    }
}

/// The checks of a layer's call on views in the backend's memory (its backend-level forward),
/// ShapeError naming `where` otherwise: x is `d` wide with a stride >= d, and y has x's shape
/// and a stride >= its width; y is x itself (allowed only when `in_place`) or shares none of
/// its entries. Finiteness is the caller's (a block checks its input once, by a glue kernel).
template <class T>
void check_view_call(const char* where, View<const T> x, View<T> y, std::ptrdiff_t d,
                     bool in_place) {
    if (x.cols != d) {
        throw ShapeError(concat(where, ": x has ", x.cols, " columns, expected d_model = ", d));
    }
    if (y.rows != x.rows || y.cols != x.cols) {
        throw ShapeError(concat(where, ": y is ", y.rows, " x ", y.cols, ", expected x's shape ",
                                x.rows, " x ", x.cols));
    }
    if ((x.rows > 1 && x.stride < x.cols) || (y.rows > 1 && y.stride < y.cols) ||
        ((x.data == nullptr || y.data == nullptr) && x.rows * x.cols > 0)) {
        throw ShapeError(concat(where, ": a view with a null pointer or a row stride below its "
                                       "width, expected views of allocated row-major matrices"));
    }
    const bool same = x.data == y.data && x.stride == y.stride;
    if (!(same && in_place) && views_overlap(x, View<const T>(y))) {
        throw ShapeError(concat(where, in_place ? ": y shares part of x's storage, expected x "
                                                  "itself or a distinct matrix"
                                                : ": y shares storage with x, expected a "
                                                  "distinct matrix"));
    }
}

/// check_trace_shape of a trace part held in the backend's memory (its view).
template <class T>
void check_trace_view(View<const T> v, Eigen::Index rows, Eigen::Index cols, const char* where,
                      const std::string& part) {
    check_trace_part(v.rows == rows && v.cols == cols, where, part + " shape",
                     concat(v.rows, " x ", v.cols), concat(rows, " x ", cols));
}

/// The views of a layer's backend-level backward (ShapeError otherwise): dy d columns and the
/// trace's `rows` rows, dx of its shape and distinct (check_view_call).
template <class T>
void check_view_gradient(const char* where, View<const T> dy, View<T> dx, std::ptrdiff_t d,
                         std::ptrdiff_t rows) {
    check_view_call(where, dy, dx, d, false);
    require<ShapeError>(dy.rows == rows, where, "dy.rows", dy.rows,
                        concat("the trace's ", rows, " rows"));
}

/// The checks of a layer's backward call, ShapeError otherwise: the trace was filled by a
/// training forward (check_trace_filled) of a layer of width d, and dy (named `name`) is
/// rows x d and finite (NonFiniteError otherwise).
inline void check_trace(bool filled, Eigen::Index trace_cols, Eigen::Index d, const char* where) {
    check_trace_filled(filled, where);
    if (trace_cols != d) {
        throw ShapeError(concat(where, ": trace holds ", trace_cols,
                                "-column rows, expected d = ", d));
    }
}
template <class M>
void check_gradient_rows(const M& dy, Eigen::Index rows, Eigen::Index d, const char* where,
                         const char* name) {
    if (dy.rows() != rows || dy.cols() != d) {
        throw ShapeError(concat(where, ": ", name, " is ", dy.rows(), " x ", dy.cols(),
                                ", expected ", rows, " x ", d, " (the rows of the trace)"));
    }
    if (!all_finite(dy)) {
        throw NonFiniteError(concat(where, ": ", name, " has a NaN or infinite entry"));
    }
}

}  // namespace titans::detail
