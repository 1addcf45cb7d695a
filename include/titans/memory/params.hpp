#pragma once
// titans/memory/params.hpp: MemoryParams<T>, the outer parameters of a neural memory.
//
// Outer parameters are fixed at test time (math §1): they are what a training run learns and
// what a checkpoint stores. Shapes (d = d_model, H = n_heads, d_h = head_dim, K = conv_kernel,
// D = H * d_h, L = depth):
//
//   w_q, w_k, w_v            d x D      q/k/v projections, head h is columns [h*d_h, (h+1)*d_h)
//   conv_q, conv_k, conv_v   K x D      depthwise causal conv: out_t = sum_j conv[j] * in_{t-K+1+j}
//                                       (row K-1 is the current token's tap; unused if !use_conv)
//   w_theta, w_eta, w_alpha  d x H      gate projections (unused for GateMode::Constant)
//   b_theta, b_eta, b_alpha  1 x H      gate biases
//   memory_init[h][l-1]      layer_in(l) x layer_out(l)   initial memory weights W_l^0 of head h
//   w_o                      D x d      output projection

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/random.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../types.hpp"
#include "config.hpp"

namespace titans {

template <class T>
struct MemoryParams {
    Matrix<T> w_q, w_k, w_v;
    Matrix<T> conv_q, conv_k, conv_v;
    Matrix<T> w_theta, w_eta, w_alpha;
    RowVector<T> b_theta, b_eta, b_alpha;
    std::vector<std::vector<Matrix<T>>> memory_init;
    Matrix<T> w_o;

    /// Parameters drawn from a seeded generator (identical on every platform): projections
    /// N(0, 1/fan_in), conv taps N(0, 0.1^2) with 1 added to the current-token tap, gate
    /// weights N(0, 1/d) with biases 0 (theta), 2 (eta) and -8 (alpha).
    [[nodiscard]] static MemoryParams random(const MemoryConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, every entry 0 (the conv taps and gate biases too), without the
    /// generator's work: what a loader (titans::io::load_parameters) fills and what gradients
    /// are added to. Not a usable initialisation.
    [[nodiscard]] static MemoryParams zeros(const MemoryConfig& cfg) { return generate(cfg, 0, false); }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static MemoryParams generate(const MemoryConfig& cfg, std::uint64_t seed,
                                               bool draw) {
        cfg.validate_for<T>();  // field limits, T-representable settings, allocation budget
        detail::TensorDraw<T> gauss(seed, draw);
        const int d = cfg.d_model, H = cfg.n_heads, D = cfg.inner_dim(), K = cfg.conv_kernel;
        MemoryParams p;
        const double sd = 1.0 / std::sqrt(static_cast<double>(d));
        p.w_q = gauss(d, D, sd);
        p.w_k = gauss(d, D, sd);
        p.w_v = gauss(d, D, sd);
        const T on = draw ? T(1) : T(0);  // zeros() is all zeros: no constants either
        for (Matrix<T>* c : {&p.conv_q, &p.conv_k, &p.conv_v}) {
            *c = gauss(K, D, 0.1);
            c->row(K - 1).array() += on;
        }
        p.w_theta = gauss(d, H, sd);
        p.w_eta = gauss(d, H, sd);
        p.w_alpha = gauss(d, H, sd);
        p.b_theta = RowVector<T>::Constant(H, T(0));
        p.b_eta = RowVector<T>::Constant(H, T(2) * on);
        p.b_alpha = RowVector<T>::Constant(H, T(-8) * on);
        p.memory_init.resize(static_cast<std::size_t>(H));
        for (auto& head : p.memory_init) {
            for (int l = 1; l <= cfg.depth; ++l) {
                head.push_back(gauss(cfg.layer_in(l), cfg.layer_out(l),
                                     1.0 / std::sqrt(static_cast<double>(cfg.layer_in(l)))));
            }
        }
        p.w_o = gauss(D, d, 1.0 / std::sqrt(static_cast<double>(D)));
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for every tensor `cfg` uses, in this order:
    /// w_q, w_k, w_v, conv_q, conv_k, conv_v (if use_conv), w_theta, w_eta, w_alpha, b_theta,
    /// b_eta, b_alpha (unless GateMode::Constant), memory_init.{h}.{l} (head h, layer index
    /// l = 0..L-1), w_o. tensor is the member itself (Matrix<T>& or RowVector<T>&, const if
    /// Self is). Non-const: memory_init is first resized to n_heads x depth, so a
    /// default-constructed MemoryParams can be filled; const: its counts must match (ShapeError).
    template <class Self, class V>
    static void tensors(Self& self, const MemoryConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, MemoryParams>);
        using S = std::string;
        const auto H = static_cast<std::size_t>(cfg.n_heads);
        const auto L = static_cast<std::size_t>(cfg.depth);
        if constexpr (std::is_const_v<Self>) {
            bool ok = self.memory_init.size() == H;
            for (std::size_t h = 0; ok && h < H; ++h) {
                ok = self.memory_init[h].size() == L;
            }
            if (!ok) {
                throw ShapeError(detail::concat("MemoryParams::tensors: memory_init is not ",
                                                "n_heads x depth = ", H, " x ", L));
            }
        } else {
            self.memory_init.resize(H);
            for (auto& head : self.memory_init) {
                head.resize(L);
            }
        }
        v(S("w_q"), self.w_q);
        v(S("w_k"), self.w_k);
        v(S("w_v"), self.w_v);
        if (cfg.use_conv) {
            v(S("conv_q"), self.conv_q);
            v(S("conv_k"), self.conv_k);
            v(S("conv_v"), self.conv_v);
        }
        if (cfg.gates != GateMode::Constant) {
            v(S("w_theta"), self.w_theta);
            v(S("w_eta"), self.w_eta);
            v(S("w_alpha"), self.w_alpha);
            v(S("b_theta"), self.b_theta);
            v(S("b_eta"), self.b_eta);
            v(S("b_alpha"), self.b_alpha);
        }
        for (std::size_t h = 0; h < H; ++h) {
            for (std::size_t l = 0; l < L; ++l) {
                v(detail::visit_name("memory_init", h, l), self.memory_init[h][l]);
            }
        }
        v(S("w_o"), self.w_o);
    }

    /// Throws ShapeError if a tensor's shape disagrees with `cfg`, NonFiniteError if a value
    /// is NaN or infinite.
    void validate(const MemoryConfig& cfg) const {
        const Eigen::Index d = cfg.d_model, H = cfg.n_heads, D = cfg.inner_dim(),
                           K = cfg.conv_kernel;
        const detail::TensorCheck check{"MemoryParams"};
        check(w_q, "w_q", d, D);
        check(w_k, "w_k", d, D);
        check(w_v, "w_v", d, D);
        if (cfg.use_conv) {
            check(conv_q, "conv_q", K, D);
            check(conv_k, "conv_k", K, D);
            check(conv_v, "conv_v", K, D);
        }
        if (cfg.gates != GateMode::Constant) {
            check(w_theta, "w_theta", d, H);
            check(w_eta, "w_eta", d, H);
            check(w_alpha, "w_alpha", d, H);
            check(b_theta, "b_theta", 1, H);
            check(b_eta, "b_eta", 1, H);
            check(b_alpha, "b_alpha", 1, H);
        }
        if (memory_init.size() != static_cast<std::size_t>(H)) {
            throw ShapeError(detail::concat("MemoryParams: memory_init has ", memory_init.size(),
                                            " heads, expected n_heads = ", H));
        }
        for (std::size_t h = 0; h < memory_init.size(); ++h) {
            if (memory_init[h].size() != static_cast<std::size_t>(cfg.depth)) {
                throw ShapeError(detail::concat("MemoryParams: memory_init[", h, "] has ",
                                                memory_init[h].size(),
                                                " layers, expected depth = ", cfg.depth));
            }
            for (int l = 1; l <= cfg.depth; ++l) {
                const std::string name = detail::concat("memory_init[", h, "][", l - 1, "]");
                check(memory_init[h][static_cast<std::size_t>(l - 1)], name.c_str(),
                      cfg.layer_in(l), cfg.layer_out(l));
            }
        }
        check(w_o, "w_o", D, d);
    }
};

}  // namespace titans
