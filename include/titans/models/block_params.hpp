#pragma once
// titans/models/block_params.hpp: a block's outer parameters (math §6-7).

#include <cstdint>
#include <string>
#include <type_traits>

#include "../attention/params.hpp"
#include "../detail/check.hpp"
#include "../detail/random.hpp"
#include "../detail/visit.hpp"
#include "../layers/feed_forward.hpp"
#include "../memory/params.hpp"
#include "../types.hpp"
#include "block_config.hpp"

namespace titans {

/// Outer parameters of a block. Shapes (d = d_model, N_p = n_persistent):
///   norm_mix, norm_ffn   1 x d    pre-norm weights of the two sub-blocks
///   memory               see MemoryParams (empty for SWA)
///   attention            see AttentionParams (empty for LMM)
///   persistent           N_p x d  persistent tokens P (math §6; empty for LMM)
///   norm_y, norm_m       1 x d    MAG's output norms (empty otherwise)
///   ffn                  see FeedForwardParams (empty if !use_ffn)
template <class T>
struct BlockParams {
    RowVector<T> norm_mix, norm_ffn;
    MemoryParams<T> memory;
    AttentionParams<T> attention;
    Matrix<T> persistent;
    RowVector<T> norm_y, norm_m;
    FeedForwardParams<T> ffn;

    /// Seeded parameters: norms 1, persistent tokens N(0, 1), the rest from each part's random().
    [[nodiscard]] static BlockParams random(const BlockConfig& cfg, std::uint64_t seed) {
        return generate(cfg, seed, true);
    }
    /// Every tensor at its shape, every entry 0 (norm weights too), without the generator's
    /// work: what a loader (titans::io::load_parameters) fills and what gradients are added to.
    /// Not a usable initialisation.
    [[nodiscard]] static BlockParams zeros(const BlockConfig& cfg) { return generate(cfg, 0, false); }
    /// random() (draw) or zeros() (!draw).
    [[nodiscard]] static BlockParams generate(const BlockConfig& cfg, std::uint64_t seed,
                                              bool draw) {
        cfg.validate_for<T>();  // field limits, T-representable settings, allocation budget
        BlockParams p;
        const int d = cfg.d_model;
        const T one = draw ? T(1) : T(0);  // zeros() is all zeros, norm weights too
        p.norm_mix = RowVector<T>::Constant(d, one);
        p.norm_ffn = RowVector<T>::Constant(d, one);
        if (has_memory(cfg.kind)) {
            p.memory = MemoryParams<T>::generate(cfg.memory, seed * 4 + 1, draw);
        }
        if (cfg.kind != BlockKind::LMM) {
            p.attention = AttentionParams<T>::generate(cfg.attention, seed * 4 + 2, draw);
            p.persistent = detail::TensorDraw<T>(seed * 4 + 3, draw)(cfg.n_persistent, d, 1.0);
        }
        if (cfg.kind == BlockKind::MAG) {
            p.norm_y = RowVector<T>::Constant(d, one);
            p.norm_m = RowVector<T>::Constant(d, one);
        }
        if (cfg.use_ffn) {
            p.ffn = FeedForwardParams<T>::generate(cfg.ffn, seed * 4 + 4, draw);
        }
        return p;
    }

    /// Serialization hook: calls v(name, tensor) for every tensor `cfg` uses, in this order:
    /// norm_mix, norm_ffn, memory.* (not SWA), attention.* and persistent (not LMM), norm_y and norm_m
    /// (MAG), ffn.* (use_ffn); tensor is the member itself (const if Self is).
    template <class Self, class V>
    static void tensors(Self& self, const BlockConfig& cfg, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, BlockParams>);
        using S = std::string;
        v(S("norm_mix"), self.norm_mix);
        v(S("norm_ffn"), self.norm_ffn);
        if (has_memory(cfg.kind)) {
            MemoryParams<T>::tensors(self.memory, cfg.memory, detail::prefixed("memory", v));
        }
        if (cfg.kind != BlockKind::LMM) {
            AttentionParams<T>::tensors(self.attention, cfg.attention,
                                        detail::prefixed("attention", v));
            v(S("persistent"), self.persistent);
        }
        if (cfg.kind == BlockKind::MAG) {
            v(S("norm_y"), self.norm_y);
            v(S("norm_m"), self.norm_m);
        }
        if (cfg.use_ffn) {
            FeedForwardParams<T>::tensors(self.ffn, cfg.ffn, detail::prefixed("ffn", v));
        }
    }

    /// Throws ShapeError / NonFiniteError naming the first bad tensor.
    void validate(const BlockConfig& cfg) const {
        const Eigen::Index d = cfg.d_model;
        const detail::TensorCheck check{"BlockParams"};
        check(norm_mix, "norm_mix", 1, d);
        check(norm_ffn, "norm_ffn", 1, d);
        if (has_memory(cfg.kind)) memory.validate(cfg.memory);
        if (cfg.kind != BlockKind::LMM) {
            attention.validate(cfg.attention);
            check(persistent, "persistent", cfg.n_persistent, d);
        }
        if (cfg.kind == BlockKind::MAG) {
            check(norm_y, "norm_y", 1, d);
            check(norm_m, "norm_m", 1, d);
        }
        if (cfg.use_ffn) {
            ffn.validate(cfg.ffn);
        }
    }
};

}  // namespace titans
