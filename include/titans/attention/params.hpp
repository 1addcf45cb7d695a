#pragma once
// titans/attention/params.hpp: AttentionParams<T>, the outer parameters of an Attention layer.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/random.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../types.hpp"
#include "config.hpp"

namespace titans {

/// The outer parameters of an Attention layer (fixed at test time). Shapes (d = d_model,
/// D = H * d_h; head h is columns [h*d_h, (h+1)*d_h) of w_q, w_k, w_v and rows of w_o):
///
///   w_q, w_k, w_v   d x D    query / key / value projections (no biases)
///   w_o             D x d    output projection
template <class T>
struct AttentionParams {
    Matrix<T> w_q, w_k, w_v;
    Matrix<T> w_o;

    /// Parameters drawn from a seeded generator (identical on every platform): w_q, w_k, w_v
    /// N(0, 1/d), w_o N(0, 1/D).
    [[nodiscard]] static AttentionParams random(const AttentionConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, every entry 0, without the generator's work: what a loader
    /// (titans::io::load_parameters) fills and what gradients are added to. Not a usable
    /// initialisation.
    [[nodiscard]] static AttentionParams zeros(const AttentionConfig& cfg) {
        return generate(cfg, 0, false);
    }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static AttentionParams generate(const AttentionConfig& cfg, std::uint64_t seed,
                                                  bool draw) {
        cfg.validate_for<T>();  // field limits, T-representable settings, allocation budget
        detail::TensorDraw<T> gauss(seed, draw);
        const int d = cfg.d_model, D = cfg.inner_dim();
        AttentionParams p;
        const double sd = 1.0 / std::sqrt(static_cast<double>(d));
        p.w_q = gauss(d, D, sd);
        p.w_k = gauss(d, D, sd);
        p.w_v = gauss(d, D, sd);
        p.w_o = gauss(D, d, 1.0 / std::sqrt(static_cast<double>(D)));
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for w_q, w_k, w_v, w_o, tensor the member
    /// itself (Matrix<T>&, const if Self is). `cfg` is unused (every tensor is always used).
    template <class Self, class V>
    static void tensors(Self& self, [[maybe_unused]] const AttentionConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, AttentionParams>);
        using S = std::string;
        v(S("w_q"), self.w_q);
        v(S("w_k"), self.w_k);
        v(S("w_v"), self.w_v);
        v(S("w_o"), self.w_o);
    }

    /// Throws ShapeError if a matrix's shape disagrees with `cfg`, NonFiniteError if a value is
    /// NaN or infinite.
    void validate(const AttentionConfig& cfg) const {
        const Eigen::Index d = cfg.d_model, D = cfg.inner_dim();
        const detail::TensorCheck check{"AttentionParams"};
        check(w_q, "w_q", d, D);
        check(w_k, "w_k", d, D);
        check(w_v, "w_v", d, D);
        check(w_o, "w_o", D, d);
    }
};

}  // namespace titans
