#pragma once
// titans/models/block_gradient.hpp: a block's gradients as views into one flat buffer (math
// §9, "One gradient buffer"): the layout BlockParams::tensors visits, cut by sub-layer.

#include <Eigen/Core>

#include "../detail/flat_tensors.hpp"
#include "../view.hpp"
#include "block_config.hpp"
#include "block_params.hpp"

namespace titans::detail {

/// The parts of a block's flat gradient (1 x its parameter count, BlockParams::tensors' order:
/// norm_mix, norm_ffn, memory.*, attention.*, persistent, norm_y, norm_m, ffn.*), each in the
/// flat layout its layer's backward on views takes; a part the kind lacks is empty. X is T
/// (gradients) or const T (the parameters themselves, as Block::set_parameters reads them).
template <class T, class X = T>
struct BlockGradientViews {
    View<X> norm_mix, norm_ffn;  // 1 x d
    View<X> memory;              // 1 x the memory's parameter count
    View<X> attention;           // 1 x the attention's
    View<X> persistent;          // N_p x d
    View<X> norm_y, norm_m;      // 1 x d (MAG)
    View<X> ffn;                 // 1 x the feed-forward's

    /// The parts of `flat` for a block of configuration cfg whose parameters are shaped as
    /// `shapes`.
    static BlockGradientViews cut(View<X> flat, const BlockParams<T>& shapes,
                                  const BlockConfig& cfg) {
        BlockGradientViews g;
        Eigen::Index at = 0;
        const auto take = [&](Eigen::Index n) {
            const View<X> v = flat_range(flat, at, n);
            at += n;
            return v;
        };
        const Eigen::Index d = cfg.d_model;
        g.norm_mix = take(d);
        g.norm_ffn = take(d);
        if (has_memory(cfg.kind)) g.memory = take(flat_size(shapes.memory, cfg.memory));
        if (cfg.kind != BlockKind::LMM) {
            g.attention = take(flat_size(shapes.attention, cfg.attention));
            const View<X> p = take(shapes.persistent.size());
            g.persistent = View<X>{p.data, shapes.persistent.rows(), d, d};
        }
        if (cfg.kind == BlockKind::MAG) {
            g.norm_y = take(d);
            g.norm_m = take(d);
        }
        if (cfg.use_ffn) g.ffn = take(flat_size(shapes.ffn, cfg.ffn));
        return g;
    }
};

}  // namespace titans::detail
