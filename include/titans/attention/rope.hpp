#pragma once
// titans/attention/rope.hpp: rotary position embedding (RoPE) for the attention layers (math §7,
// "optional rotary position embedding").
//
// Within every head, the pairs of columns (2i, 2i+1), i = 0 .. d_h/2 - 1, of the token at
// absolute position t are rotated by the angle t * omega_i, omega_i = base^(-2i / d_h):
//
//     [x'_{2i}  ]   [cos(t omega_i)  -sin(t omega_i)] [x_{2i}  ]
//     [x'_{2i+1}] = [sin(t omega_i)   cos(t omega_i)] [x_{2i+1}]
//
// Rotations compose, so for a query rotated at position a and a key rotated at position b the
// score q'_a . k'_b = q R(a)^T R(b) k = q R(b - a) k depends on the positions only through a - b.
// Angles, cosines and sines are evaluated in double precision whatever T is, so that float
// keeps full accuracy at large positions.

#include <cmath>
#include <cstdint>
#include <vector>

#include "../config.hpp"
#include "../error.hpp"
#include "../limits.hpp"
#include "../types.hpp"

namespace titans {

namespace detail {

/// The frequency omega_i = base^(-2i / d_h) of pair i, in double; the angle at absolute
/// position t is t * omega_i (the CPU's table and the CUDA backend's RoPE kernel both use it).
TITANS_HOST_DEVICE double rope_frequency(int i, int d_head, double base) {
    return std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d_head));
}

/// cos / sin of t * base^(-2i/d_h) for rows t = first_position .. first_position + rows - 1 and
/// i = 0 .. d_h/2 - 1, both rows x (d_h/2), row-major. Shared by every head and by q and k.
template <class T>
struct RopeTable {
    Matrix<T> cos, sin;

    RopeTable(Eigen::Index rows, int d_head, std::int64_t first_position, double base) {
        const int half = d_head / 2;
        cos.resize(rows, half);
        sin.resize(rows, half);
        std::vector<double> omega(static_cast<std::size_t>(half));
        for (int i = 0; i < half; ++i) {
            omega[static_cast<std::size_t>(i)] = rope_frequency(i, d_head, base);
        }
        for (Eigen::Index r = 0; r < rows; ++r) {
            const double t = static_cast<double>(first_position + r);
            for (int i = 0; i < half; ++i) {
                const double angle = t * omega[static_cast<std::size_t>(i)];
                cos(r, i) = static_cast<T>(std::cos(angle));
                sin(r, i) = static_cast<T>(std::sin(angle));
            }
        }
    }

    /// Rotates every head of x (rows x (n_heads * d_head)) in place; row r uses table row r.
    void apply(Eigen::Ref<Matrix<T>> x, int n_heads, int d_head) const {
        rotate<false>(x, n_heads, d_head);
    }
    /// The transposed (inverse) rotation: the backward of apply (math §9).
    void apply_transpose(Eigen::Ref<Matrix<T>> x, int n_heads, int d_head) const {
        rotate<true>(x, n_heads, d_head);
    }

private:
    template <bool Transpose>
    void rotate(Eigen::Ref<Matrix<T>> x, int n_heads, int d_head) const {
        const int half = d_head / 2;
        for (Eigen::Index r = 0; r < x.rows(); ++r) {
            T* row = &x(r, 0);
            for (int h = 0; h < n_heads; ++h) {
                T* head = row + static_cast<Eigen::Index>(h) * d_head;
                for (int i = 0; i < half; ++i) {
                    const T c = cos(r, i), s = Transpose ? -sin(r, i) : sin(r, i);
                    const T a = head[2 * i], b = head[2 * i + 1];
                    head[2 * i] = a * c - b * s;
                    head[2 * i + 1] = a * s + b * c;
                }
            }
        }
    }
};

/// ConfigError / ShapeError naming the first bad argument of apply_rope on a rows x cols x.
inline void check_rope_args(Eigen::Index rows, Eigen::Index cols, int n_heads, int d_head,
                            std::int64_t first_position, double base) {
    constexpr const char* w = "apply_rope";
    require<ConfigError>(n_heads >= 1, w, "n_heads", n_heads, ">= 1");
    require<ConfigError>(d_head >= 2 && d_head % 2 == 0, w, "d_head", d_head,
                         "an even number >= 2 (RoPE rotates pairs of columns)");
    require<ConfigError>(std::isfinite(base) && base > 0, w, "base", base,
                         "a finite value > 0");
    require<ConfigError>(first_position >= 0, w, "first_position", first_position, ">= 0");
    // Row r sits at first_position + r: the positions stay within the library's limit (and
    // so never overflow), as every state's do.
    require<ConfigError>(rows <= limits::max_position &&
                             first_position <= limits::max_position - rows,
                         w, "first_position", first_position,
                         concat("<= limits::max_position - x.rows() = 2^62 - ", rows,
                                " (the last row's position must stay within 2^62)"));
    const Eigen::Index D = static_cast<Eigen::Index>(n_heads) * d_head;
    if (cols != D) {
        throw ShapeError(concat(w, ": x has ", cols, " columns, expected n_heads * d_head = ", D));
    }
}

}  // namespace detail

/// Rotary position embedding in place (see the top of this file): row r of x is the token at
/// absolute position first_position + r; head h is columns [h*d_h, (h+1)*d_h).
/// x: rows x (n_heads * d_head). Throws ConfigError for an odd d_head (or n_heads < 1, base
/// <= 0, first_position < 0, first_position + rows > limits::max_position = 2^62), ShapeError
/// if x has the wrong width.
///
///     titans::Matrixf q = ...;                               // N x (H * d_h)
///     titans::apply_rope(q, H, d_h, /*first_position=*/0, 10000.0);
///
/// This overload takes any row-major view (blocks, rows of a larger matrix) but needs the scalar
/// type spelled out: `titans::apply_rope<float>(q.middleRows(r0, n), H, d_h, pos, 10000.0)`.
template <class T>
void apply_rope(Eigen::Ref<Matrix<T>> x, int n_heads, int d_head, std::int64_t first_position,
                double base = 10000.0) {
    detail::check_rope_args(x.rows(), x.cols(), n_heads, d_head, first_position, base);
    if (x.rows() == 0) return;
    detail::RopeTable<T> table(x.rows(), d_head, first_position, base);
    table.apply(x, n_heads, d_head);
}

/// As above, for a whole Matrix (the scalar type is deduced).
template <class T>
void apply_rope(Matrix<T>& x, int n_heads, int d_head, std::int64_t first_position,
                double base = 10000.0) {
    apply_rope<T>(Eigen::Ref<Matrix<T>>(x), n_heads, d_head, first_position, base);
}

}  // namespace titans
