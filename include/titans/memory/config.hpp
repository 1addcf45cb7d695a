#pragma once
// titans/memory/config.hpp: MemoryConfig, every setting of the neural long-term memory.

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "../activation.hpp"
#include "../error.hpp"
#include "../detail/enum_names.hpp"
#include "../limits.hpp"

namespace titans {

/// How the gates theta (learning rate), eta (momentum decay) and alpha (forget) are made
/// (math §1).
enum class GateMode {
    DataDependent,  ///< per token and head: sigmoid(x_t w + b) (theta scaled by theta_max)
    Constant,       ///< fixed scalars constant_theta, constant_eta, constant_alpha
    PerChunk,       ///< one value per chunk and head, from the chunk's mean input
};

/// Which gradients the write uses (math §3 vs §4).
enum class UpdateMode {
    Chunked,   ///< math §4: gradients at the chunk-start weights, closed-form chunk end
    PerToken,  ///< math §3: true per-token recurrence (the reference; equals Chunked with b = 1)
};

/// How queries read the memory (math §5).
enum class Retrieval {
    Lagged,   ///< y_i = M_{W^s}(q_i): chunk-start weights (b = 1: read, then write)
    InChunk,  ///< y_i = M_{W_i}(q_i): weights after token i's own write (b = 1: write, then read)
};

[[nodiscard]] inline const char* to_string(GateMode g) {
    switch (g) {
        case GateMode::DataDependent: return "DataDependent";
        case GateMode::Constant: return "Constant";
        case GateMode::PerChunk: return "PerChunk";
    }
    return "?";
}
[[nodiscard]] inline const char* to_string(UpdateMode u) {
    return u == UpdateMode::Chunked ? "Chunked" : "PerToken";
}
[[nodiscard]] inline const char* to_string(Retrieval r) {
    return r == Retrieval::Lagged ? "Lagged" : "InChunk";
}

/// Inverses of to_string: set `out` and return true if `s` is an enumerator's name (exact,
/// case-sensitive); leave `out` unchanged and return false otherwise.
[[nodiscard]] inline bool from_string(std::string_view s, GateMode& out) {
    return detail::enum_from_string(s, out,
                                    {GateMode::DataDependent, GateMode::Constant, GateMode::PerChunk});
}
[[nodiscard]] inline bool from_string(std::string_view s, UpdateMode& out) {
    return detail::enum_from_string(s, out, {UpdateMode::Chunked, UpdateMode::PerToken});
}
[[nodiscard]] inline bool from_string(std::string_view s, Retrieval& out) {
    return detail::enum_from_string(s, out, {Retrieval::Lagged, Retrieval::InChunk});
}

/// Every setting of a NeuralMemory (math §1-5). Aggregate: use designated initialisers,
///
///     titans::MemoryConfig cfg{.d_model = 512, .n_heads = 8, .depth = 2, .chunk = 64};
///
/// then `cfg.validate()` (the NeuralMemory constructor calls it) throws ConfigError naming the
/// first bad field.
struct MemoryConfig {
    // Shapes.
    int d_model = 64;    ///< d, width of the tokens in and out
    int n_heads = 1;     ///< H
    int d_head = 0;      ///< d_h; 0 means d_model / n_heads
    // Memory model (math §2).
    int depth = 2;       ///< L >= 1 weight matrices; 1 is the linear (matrix) memory
    int expansion = 4;   ///< e: hidden width e * d_h (used when depth >= 2)
    Activation activation = Activation::SiLU;  ///< act between layers: SiLU or GELU
    bool residual = false;                     ///< M(z) = z + MLP(z)
    // Projections (math §1).
    bool use_conv = true;      ///< causal depthwise conv on q, k, v
    int conv_kernel = 4;       ///< its kernel size
    Activation qkv_activation = Activation::SiLU;  ///< phi: SiLU or Identity
    bool normalize_qk = true;  ///< L2-normalise q and k over the head dimension
    // Gates (math §1).
    GateMode gates = GateMode::DataDependent;
    double theta_max = 0.01;       ///< theta_t = theta_max * sigmoid(.); stable at b = 64 (math §10)
    double constant_theta = 0.1;   ///< GateMode::Constant: learning rate >= 0
    double constant_eta = 0.9;     ///< GateMode::Constant: momentum decay in [0, 1]
    double constant_alpha = 0.01;  ///< GateMode::Constant: forget rate in [0, 1]
    /// math §10: per-token gradient-norm clipping, theta_t <- theta_t * min(1, c / ||grad_t||)
    /// with ||grad_t|| the Frobenius norm of token t's gradient over all layers; 0 turns it
    /// off. Keeps the memory finite on constant, periodic and large inputs (math §10).
    double max_grad_norm = 1.0;
    /// The paper's ablations (its Table 5), for every gate mode: false fixes eta_t = 0 (no
    /// momentum: S_t = -theta_t grad_t) or alpha_t = 0 (no forgetting: W_t = W_{t-1} + S_t).
    /// The other gates stay as `gates` makes them; the fixed gate's parameters stay in
    /// MemoryParams (same layout) and get zero gradients.
    bool momentum = true;
    bool forget = true;
    // Algorithm (math §3-5).
    UpdateMode update = UpdateMode::Chunked;
    Retrieval retrieval = Retrieval::Lagged;
    int chunk = 64;  ///< b, tokens per chunk (chunk boundaries are absolute positions)
    // Execution.
    /// Flush subnormal floats to zero during a call (x86 MXCSR FTZ/DAZ, restored after): a
    /// memory decaying towards zero otherwise slows every product 5-15x. Off gives IEEE
    /// gradual underflow.
    bool flush_denormals = true;

    /// d_h after defaulting.
    [[nodiscard]] int head_dim() const { return d_head > 0 ? d_head : d_model / n_heads; }
    /// Hidden width of the memory MLP.
    [[nodiscard]] int hidden_dim() const { return depth >= 2 ? expansion * head_dim() : head_dim(); }
    /// Input width of memory layer l (1-based, math §2): d_h for l = 1, e*d_h otherwise.
    [[nodiscard]] int layer_in(int l) const { return l == 1 ? head_dim() : hidden_dim(); }
    /// Output width of memory layer l: d_h for l = L, e*d_h otherwise.
    [[nodiscard]] int layer_out(int l) const { return l == depth ? head_dim() : hidden_dim(); }
    /// The factor of gate `which` (0 theta, 1 eta, 2 alpha) on its sigmoid for the
    /// data-dependent and per-chunk gates: theta_max, then 1, or 0 where momentum / forget is
    /// off (so the fixed gate is exactly 0 and its logits' adjoints too).
    [[nodiscard]] double gate_scale(int which) const {
        return which == 0 ? theta_max : which == 1 ? (momentum ? 1.0 : 0.0) : (forget ? 1.0 : 0.0);
    }
    /// The value of gate `which` under GateMode::Constant: constant_theta, constant_eta (0
    /// without momentum), constant_alpha (0 without forgetting).
    [[nodiscard]] double gate_constant(int which) const {
        return which == 0 ? constant_theta
               : which == 1 ? (momentum ? constant_eta : 0.0)
                            : (forget ? constant_alpha : 0.0);
    }
    /// H * d_h, the width of the concatenated heads.
    [[nodiscard]] int inner_dim() const { return n_heads * head_dim(); }
    /// The chunk size the algorithm runs with (PerToken is the b = 1 case).
    [[nodiscard]] int effective_chunk() const { return update == UpdateMode::PerToken ? 1 : chunk; }

    /// Field-by-field equality.
    bool operator==(const MemoryConfig&) const = default;

    /// True if a state made for `other` can be continued by a memory with this configuration:
    /// every setting equal except flush_denormals (which changes no stored value's meaning).
    [[nodiscard]] bool same_stream(const MemoryConfig& other) const {
        MemoryConfig a = *this;
        a.flush_denormals = other.flush_denormals;
        return a == other;
    }

    /// Serialization hook: calls v(name, field) for every setting, in declaration order, with
    /// name a std::string and field an int, double, bool or enum reference (const if Self is).
    /// flush_denormals is not visited: it is not part of a stream's identity (same_stream).
    template <class Self, class V>
    static void fields(Self& self, V&& v) {
        static_assert(std::is_same_v<std::remove_const_t<Self>, MemoryConfig>);
        using S = std::string;
        v(S("d_model"), self.d_model);
        v(S("n_heads"), self.n_heads);
        v(S("d_head"), self.d_head);
        v(S("depth"), self.depth);
        v(S("expansion"), self.expansion);
        v(S("activation"), self.activation);
        v(S("residual"), self.residual);
        v(S("use_conv"), self.use_conv);
        v(S("conv_kernel"), self.conv_kernel);
        v(S("qkv_activation"), self.qkv_activation);
        v(S("normalize_qk"), self.normalize_qk);
        v(S("gates"), self.gates);
        v(S("theta_max"), self.theta_max);
        v(S("constant_theta"), self.constant_theta);
        v(S("constant_eta"), self.constant_eta);
        v(S("constant_alpha"), self.constant_alpha);
        v(S("max_grad_norm"), self.max_grad_norm);
        v(S("momentum"), self.momentum);
        v(S("forget"), self.forget);
        v(S("update"), self.update);
        v(S("retrieval"), self.retrieval);
        v(S("chunk"), self.chunk);
    }

    /// Elements of the MemoryParams of this configuration (every tensor random() / zeros()
    /// allocates), in 64 bits (saturating at INT64_MAX). Meaningful for a validated
    /// configuration (negative fields count as 0).
    [[nodiscard]] std::int64_t parameter_count() const {
        using detail::sat_add;
        using detail::sat_mul;
        const std::int64_t d = d_model, H = n_heads, D = sat_mul(H, head_dim64());
        return sat_add(sat_mul(4, d, D),              // w_q, w_k, w_v, w_o
                       sat_mul(3, conv_kernel, D),    // conv_q, conv_k, conv_v
                       sat_mul(3, sat_add(d, 1), H),  // gate weights and biases
                       sat_mul(H, memory_weight_count()));
    }

    /// Bytes of the state make_state(batch) builds (every matrix at its largest, plus
    /// limits::matrix_overhead_bytes per matrix), `scalar_bytes` per element, in 64 bits
    /// (saturating). Meaningful for a validated configuration.
    [[nodiscard]] std::int64_t state_bytes(std::int64_t batch, std::int64_t scalar_bytes) const {
        using detail::sat_add;
        using detail::sat_mul;
        const std::int64_t dh = head_dim64(), L = depth;
        const std::int64_t hid = L >= 2 ? sat_mul(expansion, dh) : dh;
        const std::int64_t b = update == UpdateMode::PerToken ? 1 : chunk;
        const std::int64_t sum_in = sat_add(dh, sat_mul(L - 1, hid));   // sum_l layer_in(l)
        const std::int64_t sum_out = sat_add(sat_mul(L - 1, hid), dh);  // sum_l layer_out(l)
        const std::int64_t widest = hid > dh ? hid : dh;
        // Per (sequence, head): W^s, S^s; pending a, delta; workspaces z, hid, gates, t1, t2,
        // scores, G (b x b), coef.
        const std::int64_t head_elems =
            sat_add(sat_mul(2, memory_weight_count()), sat_mul(b, sum_in), sat_mul(3, b, sum_out),
                    sat_mul(3, b), sat_mul(2, b, widest), sat_mul(2, b, b), sat_mul(8, b));
        const std::int64_t head_bytes =
            sat_add(sat_mul(head_elems, scalar_bytes),
                    sat_mul(sat_add(sat_mul(6, L), 6), limits::matrix_overhead_bytes));
        const std::int64_t conv =
            use_conv ? sat_mul(conv_kernel - 1, 3, sat_mul(n_heads, dh)) : 0;  // conv tail
        const std::int64_t per_sequence =
            sat_add(sat_mul(n_heads, head_bytes), sat_mul(conv, scalar_bytes),
                    limits::matrix_overhead_bytes);
        return sat_mul(batch, per_sequence);
    }

    /// Throws ConfigError naming the first invalid field and what it must be: every field in
    /// its range (upper limits in titans/limits.hpp), every enum a valid enumerator, every
    /// double finite, and the parameters and the state of one sequence within
    /// limits::max_allocation_bytes at 4 bytes (float) per element. validate_for<T>() also
    /// counts sizeof(T) and checks that the doubles are representable in T.
    void validate() const {
        constexpr const char* w = "MemoryConfig";
        using detail::require;
        using detail::require_in_range;
        detail::require_head_shape(d_model, n_heads, d_head, w);
        require_in_range(depth, 1, limits::max_depth, w, "depth");
        require_in_range(expansion, 1, limits::max_expansion, w, "expansion");
        require<ConfigError>(activation == Activation::SiLU || activation == Activation::GELU, w,
                             "activation", static_cast<int>(activation),
                             "SiLU (0) or GELU (1)");
        require_in_range(conv_kernel, 1, limits::max_conv_kernel, w, "conv_kernel");
        require<ConfigError>(
            qkv_activation == Activation::SiLU || qkv_activation == Activation::Identity, w,
            "qkv_activation", static_cast<int>(qkv_activation), "SiLU (0) or Identity (2)");
        require<ConfigError>(gates == GateMode::DataDependent || gates == GateMode::Constant ||
                                 gates == GateMode::PerChunk,
                             w, "gates", static_cast<int>(gates),
                             "DataDependent (0), Constant (1) or PerChunk (2)");
        require<ConfigError>(update == UpdateMode::Chunked || update == UpdateMode::PerToken, w,
                             "update", static_cast<int>(update), "Chunked (0) or PerToken (1)");
        require<ConfigError>(retrieval == Retrieval::Lagged || retrieval == Retrieval::InChunk,
                             w, "retrieval", static_cast<int>(retrieval),
                             "Lagged (0) or InChunk (1)");
        require<ConfigError>(std::isfinite(theta_max) && theta_max >= 0, w, "theta_max",
                             theta_max, "a finite value >= 0");
        require<ConfigError>(std::isfinite(constant_theta) && constant_theta >= 0, w,
                             "constant_theta", constant_theta, "a finite value >= 0");
        require<ConfigError>(constant_eta >= 0 && constant_eta <= 1, w, "constant_eta",
                             constant_eta, "a value in [0, 1]");
        require<ConfigError>(constant_alpha >= 0 && constant_alpha <= 1, w, "constant_alpha",
                             constant_alpha, "a value in [0, 1]");
        require<ConfigError>(std::isfinite(max_grad_norm) && max_grad_norm >= 0, w,
                             "max_grad_norm", max_grad_norm, "a finite value >= 0 (0: off)");
        require_in_range(chunk, 1, limits::max_chunk, w, "chunk");
        // Per-chunk gates are a function of the whole chunk's mean input. Only the lagged,
        // chunked mode never lets a token's output depend on later tokens of its chunk
        // (its outputs read W^s; the gates enter only the chunk-end write).
        if (gates == GateMode::PerChunk) {
            require<ConfigError>(update == UpdateMode::Chunked, w, "update", to_string(update),
                                 "Chunked when gates = PerChunk (per-chunk gates would read "
                                 "future tokens of the chunk)");
            require<ConfigError>(retrieval == Retrieval::Lagged, w, "retrieval",
                                 to_string(retrieval),
                                 "Lagged when gates = PerChunk (per-chunk gates would read "
                                 "future tokens of the chunk)");
        }
        check_budget(4, "float");
    }

    /// validate(), then the checks that depend on the scalar type T of the object: every
    /// double setting representable in T (finite, not rounding to 0 or infinity), and the
    /// parameters and batch-1 state within limits::max_allocation_bytes at sizeof(T) bytes
    /// per element. Called by NeuralMemory<T> and MemoryParams<T>::random / zeros.
    template <class T>
    void validate_for() const {
        validate();
        constexpr const char* w = "MemoryConfig";
        detail::require_representable<T>(theta_max, w, "theta_max");
        detail::require_representable<T>(constant_theta, w, "constant_theta");
        detail::require_representable<T>(constant_eta, w, "constant_eta");
        detail::require_representable<T>(constant_alpha, w, "constant_alpha");
        detail::require_representable<T>(max_grad_norm, w, "max_grad_norm");
        check_budget(static_cast<std::int64_t>(sizeof(T)), detail::scalar_name<T>());
    }

    /// d_h in 64 bits (0 rather than a division by zero when n_heads < 1).
    [[nodiscard]] std::int64_t head_dim64() const {
        return d_head > 0 ? d_head : (n_heads > 0 ? d_model / n_heads : 0);
    }
    /// sum_l layer_in(l) * layer_out(l): the memory weights of one head, in 64 bits
    /// (saturating).
    [[nodiscard]] std::int64_t memory_weight_count() const {
        using detail::sat_add;
        using detail::sat_mul;
        const std::int64_t dh = head_dim64();
        if (depth < 2) return sat_mul(dh, dh);
        const std::int64_t hid = sat_mul(expansion, dh);
        return sat_add(sat_mul(2, dh, hid), sat_mul(depth - 2, hid, hid));
    }

private:
    void check_budget(std::int64_t scalar_bytes, const char* scalar) const {
        constexpr const char* w = "MemoryConfig";
        detail::require_budget(detail::sat_mul(parameter_count(), scalar_bytes), w,
                               "parameter size", scalar,
                               "reduce d_model, n_heads, d_head, depth, expansion or conv_kernel");
        detail::require_budget(state_bytes(1, scalar_bytes), w, "state size for batch 1", scalar,
                               "reduce n_heads, d_head, depth, expansion or chunk (b x b "
                               "workspaces per head)");
    }
};

}  // namespace titans
