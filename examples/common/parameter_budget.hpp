#pragma once
// examples/common/parameter_budget.hpp: models of equal size for fair comparisons. The
// attention-only baseline (BlockKind::SWA) has no memory, so at the same width it is smaller
// than a Titans model; widening its feed-forward gives it the same parameter count.

#include <titans/titans.hpp>

#include <cstdint>
#include <cstdlib>

namespace examples {

/// Sets every block's feed-forward hidden width (the same for all, 1..16 d) to the one that
/// brings cfg.parameter_count() nearest `target`; returns the count reached.
inline std::int64_t fit_feed_forward(titans::ModelConfig& cfg, std::int64_t target) {
    std::int64_t best_gap = -1;
    int best = 1;
    for (int h = 1; h <= 16 * cfg.d_model; ++h) {
        for (auto& b : cfg.blocks) b.ffn.hidden = h;
        const std::int64_t gap = std::llabs(cfg.parameter_count() - target);
        if (best_gap < 0 || gap < best_gap) {
            best_gap = gap;
            best = h;
        }
    }
    for (auto& b : cfg.blocks) b.ffn.hidden = best;
    return cfg.parameter_count();
}

}  // namespace examples
