#pragma once
// titans/layers/rms_norm.hpp: RMSNorm<T>, the pre-normalisation of every Titans block (SPEC §7).

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

#include "../error.hpp"
#include "../fwd.hpp"
#include "../types.hpp"

namespace titans {

/// Root-mean-square normalisation of each row (token) with a learnable per-channel weight
/// (SPEC §7: pre-normalisation of every block, and RMSNorm_y / RMSNorm_m of MAG):
///
///     y = x / sqrt(mean_j(x_j^2) + eps) ⊙ weight,     x, y, weight: 1 x d
///
/// No mean subtraction and no bias (Zhang & Sennrich, 2019). Shapes: forward takes any
/// rows x d matrix (e.g. (B*N) x d) and returns rows x d.
///
///     titans::RMSNorm<float> norm(64);             // weight = 1, eps = 1e-6
///     titans::Matrixf y = norm.forward(x);         // x: N x 64
template <class T>
class RMSNorm {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::RMSNorm: T must be float or double");

public:
    using Scalar = T;

    /// Width d >= 1, weight initialised to ones, eps > 0 (ConfigError otherwise).
    explicit RMSNorm(int d_model, double eps = 1e-6)
        : weight_(RowVector<T>::Ones(std::max(d_model, 0))), eps_(eps) {
        detail::require<ConfigError>(d_model >= 1, "RMSNorm", "d_model", d_model, ">= 1");
        check_eps();
    }

    /// With a given weight (1 x d, d >= 1, finite).
    explicit RMSNorm(RowVector<T> weight, double eps = 1e-6) : weight_(std::move(weight)), eps_(eps) {
        detail::require<ShapeError>(weight_.cols() >= 1, "RMSNorm", "weight.cols()",
                                    weight_.cols(), ">= 1");
        check_weight(weight_);
        check_eps();
    }

    [[nodiscard]] int dim() const { return static_cast<int>(weight_.cols()); }
    [[nodiscard]] double eps() const { return eps_; }
    /// The learnable per-channel weight, 1 x d.
    [[nodiscard]] const RowVector<T>& weight() const { return weight_; }
    /// Replaces the weight (same width d, finite).
    void set_weight(RowVector<T> weight) {
        detail::require<ShapeError>(weight.cols() == weight_.cols(), "RMSNorm::set_weight",
                                    "weight.cols()", weight.cols(),
                                    detail::concat("d = ", weight_.cols()));
        check_weight(weight);
        weight_ = std::move(weight);
    }

    /// x: rows x d -> rows x d. Throws ShapeError (width), NonFiniteError (NaN / inf in x).
    [[nodiscard]] Matrix<T> forward(const Matrix<T>& x) const {
        Matrix<T> y;
        forward(x, y);
        return y;
    }

    /// As above, writing into `y` (resized; `y` may be `x` itself).
    void forward(const Matrix<T>& x, Matrix<T>& y) const {
        constexpr const char* where = "RMSNorm::forward";
        if (x.cols() != weight_.cols()) {
            throw ShapeError(detail::concat(where, ": x has ", x.cols(), " columns, expected d = ",
                                            weight_.cols()));
        }
        if (!x.allFinite()) {
            throw NonFiniteError(detail::concat(where, ": x has a NaN or infinite entry"));
        }
        y.resize(x.rows(), x.cols());  // no-op when &y == &x
        const T eps = static_cast<T>(eps_);
        const T inv_d = T(1) / static_cast<T>(x.cols());
        for (Eigen::Index r = 0; r < x.rows(); ++r) {
            const T inv_rms = T(1) / std::sqrt(x.row(r).squaredNorm() * inv_d + eps);
            y.row(r) = (x.row(r).array() * inv_rms * weight_.array()).matrix();
        }
    }

private:
    void check_eps() const {
        detail::require<ConfigError>(std::isfinite(eps_) && eps_ > 0, "RMSNorm", "eps", eps_,
                                     "a finite value > 0");
    }
    static void check_weight(const RowVector<T>& w) {
        if (!w.allFinite()) {
            throw NonFiniteError("RMSNorm: weight has a NaN or infinite entry");
        }
    }

    RowVector<T> weight_;
    double eps_;
};

}  // namespace titans
