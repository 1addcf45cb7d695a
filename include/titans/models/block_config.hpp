#pragma once
// titans/models/block_config.hpp: the block kinds (math §7) and a block's settings.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <type_traits>

#include "../attention/config.hpp"
#include "../detail/check.hpp"
#include "../detail/enum_names.hpp"
#include "../detail/visit.hpp"
#include "../error.hpp"
#include "../layers/feed_forward.hpp"
#include "../limits.hpp"
#include "../memory/config.hpp"

namespace titans {

/// Which sequence mixer a block uses (math §7).
enum class BlockKind {
    LMM,  ///< the neural memory alone: Mixer(u) = M(u)
    MAC,  ///< memory as a context: segments attend over P ‖ M*_{t-1}(S) ‖ S, then write/gate
    MAG,  ///< memory as a gate: RMSNorm(SWA*(P ‖ u)) ⊙ σ(RMSNorm(M(P ‖ u)))
    MAL,  ///< memory as a layer: SWA(M(P ‖ u))
    SWA,  ///< attention alone, no memory (the baseline): SWA*(P ‖ u)
};

/// Every block kind, in enumerator order.
inline constexpr BlockKind all_block_kinds[] = {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG,
                                                BlockKind::MAL, BlockKind::SWA};

/// Whether blocks of kind k hold a neural memory (all but SWA).
[[nodiscard]] constexpr bool has_memory(BlockKind k) { return k != BlockKind::SWA; }
/// Whether blocks of kind k keep a sliding attention window in their state (MAG, MAL, SWA;
/// MAC attends within its segment buffers, LMM has no attention).
[[nodiscard]] constexpr bool has_window(BlockKind k) {
    return k == BlockKind::MAG || k == BlockKind::MAL || k == BlockKind::SWA;
}

[[nodiscard]] inline const char* to_string(BlockKind k) {
    switch (k) {
        case BlockKind::LMM: return "LMM";
        case BlockKind::MAC: return "MAC";
        case BlockKind::MAG: return "MAG";
        case BlockKind::MAL: return "MAL";
        case BlockKind::SWA: return "SWA";
    }
    return "?";
}

/// Inverse of to_string: sets `out` and returns true if `s` names an enumerator, else false.
[[nodiscard]] inline bool from_string(std::string_view s, BlockKind& out) {
    return detail::enum_from_string(s, out, {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG,
                                             BlockKind::MAL, BlockKind::SWA});
}

/// Settings of one block. `memory.d_model`, `attention.d_model` and `ffn.d_model` must all
/// equal `d_model` (make() sets them). For MAC, `segment` is C and the attention window is
/// not used (every token sees its whole segment prefix); for MAG, MAL and SWA the window is w.
/// SWA blocks have no memory: `memory` is neither used nor validated.
struct BlockConfig {
    BlockKind kind = BlockKind::MAG;
    int d_model = 64;
    MemoryConfig memory{};
    AttentionConfig attention{};
    int n_persistent = 4;  ///< N_p persistent tokens (math §6); unused by LMM
    int segment = 64;      ///< C, MAC segment length (absolute positions)
    bool use_ffn = true;
    FeedForwardConfig ffn{};
    double norm_eps = 1e-6;

    /// A block of kind `kind`, width d, H heads for memory and attention, memory depth L,
    /// window / segment `span`, with the memory chunk `chunk`. MAC's memory reads with
    /// Retrieval::InChunk so "the updated memory" of math §7 includes the token's own write.
    /// SWA gets no persistent tokens (n_persistent = 0: the paper's sliding-window baseline;
    /// set it to give the attention a learnt prefix, as MAG's branch has).
    [[nodiscard]] static BlockConfig make(BlockKind kind, int d, int heads, int depth, int span,
                                          int chunk = 64) {
        BlockConfig c;
        c.kind = kind;
        c.d_model = d;
        c.memory.d_model = d;
        c.memory.n_heads = heads;
        c.memory.depth = depth;
        c.memory.chunk = chunk;
        c.memory.retrieval = kind == BlockKind::MAC ? Retrieval::InChunk : Retrieval::Lagged;
        c.attention.d_model = d;
        c.attention.n_heads = heads;
        c.attention.window = span;
        c.segment = span;
        if (kind == BlockKind::SWA) c.n_persistent = 0;
        c.ffn.d_model = d;
        return c;
    }

    /// Serialization hook: calls v(name, field) for every setting, in declaration order: kind,
    /// d_model, memory.* (MemoryConfig::fields), attention.*, n_persistent, segment, use_ffn,
    /// ffn.*, norm_eps. Every field is visited whatever the kind (attention.* for LMM too).
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, BlockConfig>);
        using S = std::string;
        v(S("kind"), self.kind);
        v(S("d_model"), self.d_model);
        MemoryConfig::fields(self.memory, detail::prefixed("memory", v));
        AttentionConfig::fields(self.attention, detail::prefixed("attention", v));
        v(S("n_persistent"), self.n_persistent);
        v(S("segment"), self.segment);
        v(S("use_ffn"), self.use_ffn);
        FeedForwardConfig::fields(self.ffn, detail::prefixed("ffn", v));
        v(S("norm_eps"), self.norm_eps);
    }

    /// Elements of the BlockParams of this configuration (what random() / zeros() allocate),
    /// in 64 bits (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t parameter_count() const {
        using detail::sat_add;
        using detail::sat_mul;
        const std::int64_t d = d_model;
        std::int64_t n = sat_mul(2, d);  // norms
        if (has_memory(kind)) n = sat_add(n, memory.parameter_count());
        if (kind != BlockKind::LMM) {
            n = sat_add(n, attention.parameter_count(), sat_mul(n_persistent, d));
        }
        if (kind == BlockKind::MAG) n = sat_add(n, sat_mul(2, d));  // norm_y, norm_m
        if (use_ffn) n = sat_add(n, ffn.parameter_count());
        return n;
    }

    /// Bytes of the state make_state(batch) builds, `scalar_bytes` per element, in 64 bits
    /// (saturating): the memory's state, the attention's full KV window (MAG, MAL, SWA), MAC's
    /// segment buffers (2 x batch x 2C x D_att), snapshots (batch x H x memory weights) and
    /// P W_K, P W_V, and for MAG / MAL the persistent-token pass make_state runs (batch x N_p
    /// rows through the memory, and the attention for MAL). Meaningful for a validated
    /// configuration.
    [[nodiscard]] std::int64_t state_bytes(std::int64_t batch, std::int64_t scalar_bytes) const {
        using detail::sat_add;
        using detail::sat_mul;
        constexpr std::int64_t overhead = limits::matrix_overhead_bytes;
        if (kind == BlockKind::SWA) return attention.state_bytes(batch, scalar_bytes);
        std::int64_t bytes = memory.state_bytes(batch, scalar_bytes);
        const std::int64_t np = n_persistent, d = d_model, Da = attention.inner_dim64();
        const std::int64_t Hm = memory.n_heads, Dm = sat_mul(Hm, memory.head_dim64());
        if (kind == BlockKind::MAG || kind == BlockKind::MAL) {
            bytes = sat_add(bytes, attention.state_bytes(batch, scalar_bytes));
            const std::int64_t pass = sat_add(sat_mul(3, d), sat_mul(4, Dm), sat_mul(3, Hm),
                                              sat_mul(6, Da));
            bytes = sat_add(bytes, sat_mul(batch, np, pass, scalar_bytes));
        } else if (kind == BlockKind::MAC) {
            const std::int64_t seg = sat_mul(2, sat_mul(2, segment), Da);  // seg_k, seg_v
            const std::int64_t snap = sat_mul(Hm, memory.memory_weight_count());
            bytes = sat_add(bytes, sat_mul(batch, sat_add(seg, snap), scalar_bytes),
                            sat_mul(batch, sat_add(4, sat_mul(Hm, memory.depth)), overhead),
                            sat_mul(2, np, Da, scalar_bytes));
        }
        return bytes;
    }

    /// Throws ConfigError naming the first invalid field: kind a valid enumerator, d_model in
    /// [1, max_d_model], memory (all kinds but SWA) and attention (every kind: its width is
    /// part of the state) valid, their d_model (and ffn's) equal to d_model, n_persistent in
    /// [0, max_persistent]
    /// (not LMM), segment in [1, max_segment] (MAC), ffn valid (use_ffn), norm_eps finite and
    /// > 0, and the parameters and batch-1 state within limits::max_allocation_bytes at 4
    /// bytes (float) per element. validate_for<T>() checks the T-specific rules too.
    void validate() const {
        constexpr const char* w = "BlockConfig";
        detail::require<ConfigError>(std::ranges::find(all_block_kinds, kind) !=
                                         std::end(all_block_kinds),
                                     w, "kind", static_cast<int>(kind),
                                     "LMM (0), MAC (1), MAG (2), MAL (3) or SWA (4)");
        detail::require_in_range(d_model, 1, limits::max_d_model, w, "d_model");
        if (has_memory(kind)) {
            memory.validate();
            detail::require<ConfigError>(memory.d_model == d_model, w, "memory.d_model",
                                         memory.d_model, detail::concat("d_model = ", d_model));
        }
        attention.validate();
        if (kind != BlockKind::LMM) {
            detail::require<ConfigError>(attention.d_model == d_model, w, "attention.d_model",
                                         attention.d_model, detail::concat("d_model = ", d_model));
            detail::require_in_range(n_persistent, 0, limits::max_persistent, w, "n_persistent");
        }
        if (kind == BlockKind::MAC) {
            detail::require_in_range(segment, 1, limits::max_segment, w, "segment");
        }
        if (use_ffn) {
            ffn.validate();
            detail::require<ConfigError>(ffn.d_model == d_model, w, "ffn.d_model", ffn.d_model,
                                         detail::concat("d_model = ", d_model));
        }
        detail::require<ConfigError>(std::isfinite(norm_eps) && norm_eps > 0, w, "norm_eps",
                                     norm_eps, "a finite value > 0");
        check_budget(4, "float");
    }

    /// validate(), then the T-specific checks of every part (doubles representable in T,
    /// norm_eps not rounding to 0 in T) and the parameters and batch-1 state within the
    /// budget at sizeof(T) bytes per element. Called by Block<T> and BlockParams<T>::random /
    /// zeros.
    template <class T>
    void validate_for() const {
        validate();
        if (has_memory(kind)) memory.validate_for<T>();
        attention.validate_for<T>();
        if (use_ffn) ffn.validate_for<T>();
        detail::require_representable<T>(norm_eps, "BlockConfig", "norm_eps");
        check_budget(static_cast<std::int64_t>(sizeof(T)), detail::scalar_name<T>());
    }

private:
    void check_budget(std::int64_t scalar_bytes, const char* scalar) const {
        constexpr const char* w = "BlockConfig";
        detail::require_budget(detail::sat_mul(parameter_count(), scalar_bytes), w,
                               "parameter size", scalar);
        detail::require_budget(state_bytes(1, scalar_bytes), w, "state size for batch 1", scalar);
    }
};

}  // namespace titans
