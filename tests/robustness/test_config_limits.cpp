// Sizes cannot overflow: every configuration field has a documented upper limit
// (titans/limits.hpp, docs/errors.md "Limits"), every derived size is computed in 64 bits, a
// configuration or make_state(batch) over the allocation budget is refused before anything is
// allocated, enums out of range and non-finite doubles are rejected, a float object rejects
// settings that do not survive conversion to float, and a forward call never pushes a position
// past limits::max_position. Every error is a titans::ConfigError (REQUIRE_THROWS_AS fails on
// std::bad_alloc or std::length_error), naming the field.
//
// Also built alone with -O2 -DNDEBUG (ctest robustness_o2) so that a size computation that
// wraps silently in an optimised build is caught.
#include "test_common.hpp"

#include <climits>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

using namespace titans_test;
using titans::AttentionConfig;
using titans::BlockConfig;
using titans::BlockKind;
using titans::ConfigError;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::ModelConfig;
namespace limits = titans::limits;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

/// A tiny memory: every size small, so a test can change one field towards its limit.
MemoryConfig tiny_memory() {
    MemoryConfig c;
    c.d_model = 4;
    c.n_heads = 1;
    c.d_head = 0;
    c.depth = 1;
    c.expansion = 1;
    c.conv_kernel = 2;
    c.chunk = 2;
    return c;
}

AttentionConfig tiny_attention() { return AttentionConfig{.d_model = 4, .n_heads = 1, .window = 4}; }

BlockConfig tiny_block(BlockKind kind) {
    BlockConfig c = BlockConfig::make(kind, 4, 1, 1, 4, 2);
    c.n_persistent = 1;
    c.ffn.hidden = 4;
    return c;
}

ModelConfig tiny_model(BlockKind kind = BlockKind::LMM) {
    ModelConfig c;
    c.d_model = 4;
    c.blocks = {tiny_block(kind)};
    return c;
}

/// Sets every std::int64_t a state visits (its positions) to p.
struct SetPositions {
    std::int64_t p;
    template <class X>
    void operator()(const std::string&, X& x) const {
        if constexpr (std::is_same_v<X, std::int64_t>) x = p;
    }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// MemoryConfig.

// limits: MemoryConfig fields at their limit pass
TEST_CASE("limits: MemoryConfig at limit", "[limits][config]") {
    std::vector<MemoryConfig> ok;
    {
        MemoryConfig c = tiny_memory();
        c.d_model = limits::max_d_model;
        c.d_head = 1;
        ok.push_back(c);
    }
    {
        MemoryConfig c = tiny_memory();
        c.d_model = limits::max_heads;
        c.n_heads = limits::max_heads;  // d_h = 1
        ok.push_back(c);
    }
    {
        MemoryConfig c = tiny_memory();
        c.d_head = 1;
        c.depth = limits::max_depth;
        c.expansion = limits::max_expansion;
        ok.push_back(c);
    }
    {
        MemoryConfig c = tiny_memory();
        c.conv_kernel = limits::max_conv_kernel;
        ok.push_back(c);
    }
    {
        MemoryConfig c = tiny_memory();
        c.chunk = limits::max_chunk;  // 2 b x b workspaces: 2 GiB in float, 4 GiB in double
        ok.push_back(c);
    }
    for (const MemoryConfig& c : ok) {
        REQUIRE_NOTHROW(c.validate());
        REQUIRE_NOTHROW(c.validate_for<float>());
        REQUIRE_NOTHROW(c.validate_for<double>());
        CHECK(c.parameter_count() > 0);
        CHECK(c.state_bytes(1, 8) <= limits::max_allocation_bytes);
    }
}

// limits: MemoryConfig fields beyond their limit
TEST_CASE("limits: MemoryConfig over limit", "[limits][config]") {
    struct Field {
        const char* name;
        int MemoryConfig::*member;
        int limit;
        int lowest;
    };
    const Field fields[] = {
        {"d_model", &MemoryConfig::d_model, limits::max_d_model, 1},
        {"n_heads", &MemoryConfig::n_heads, limits::max_heads, 1},
        {"d_head", &MemoryConfig::d_head, limits::max_head_dim, 0},
        {"depth", &MemoryConfig::depth, limits::max_depth, 1},
        {"expansion", &MemoryConfig::expansion, limits::max_expansion, 1},
        {"conv_kernel", &MemoryConfig::conv_kernel, limits::max_conv_kernel, 1},
        {"chunk", &MemoryConfig::chunk, limits::max_chunk, 1},
    };
    for (const Field& f : fields) {
        for (int v : {f.limit + 1, INT_MAX, f.lowest - 1, -7, INT_MIN}) {
            MemoryConfig c = tiny_memory();
            c.d_head = 1;  // so that d_model and n_heads need not divide
            c.*f.member = v;
            INFO(f.name << " = " << v);
            REQUIRE_THROWS_NAMING(c.validate(), ConfigError, f.name);
            REQUIRE_THROWS_NAMING(c.validate_for<float>(), ConfigError, f.name);
            REQUIRE_THROWS_NAMING(titans::MemoryParamsf::random(c, 1), ConfigError, f.name);
            REQUIRE_THROWS_NAMING(titans::MemoryParamsd::zeros(c), ConfigError, f.name);
            REQUIRE_THROWS_NAMING(NeuralMemory<float>(c, titans::MemoryParamsf{}), ConfigError,
                                  f.name);
        }
    }
}

// limits: products that overflow int are ConfigError
TEST_CASE("limits: int-overflowing products", "[limits][config]") {
    // Every field within its limit, but d_h * e = 2^22, H * d_h = 2^28: the memory weights
    // alone are 2^12 * 2^38 * 63 elements. Refused by the budget, computed in 64 bits.
    MemoryConfig c = tiny_memory();
    c.d_model = limits::max_d_model;
    c.n_heads = limits::max_heads;
    c.d_head = limits::max_head_dim;
    c.depth = limits::max_depth;
    c.expansion = limits::max_expansion;
    c.conv_kernel = limits::max_conv_kernel;
    c.chunk = limits::max_chunk;
    REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "parameter size");
    REQUIRE_THROWS_NAMING(titans::MemoryParamsf::random(c, 1), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(titans::MemoryParamsd::zeros(c), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(NeuralMemory<double>(c, titans::MemoryParamsd{}), ConfigError,
                          "max_allocation_bytes");
    CHECK(c.parameter_count() > (std::int64_t{1} << 50));  // no wrap to a small or negative count

    // d_h = 2^16 alone: d_h^2 = 2^32 memory weights per head, over the budget even in float.
    MemoryConfig d = tiny_memory();
    d.d_head = limits::max_head_dim;
    REQUIRE_THROWS_NAMING(d.validate(), ConfigError, "max_allocation_bytes");

    // The b x b workspaces of a large chunk with many heads: a state over the budget.
    MemoryConfig s = tiny_memory();
    s.d_model = 64;
    s.n_heads = 64;
    s.chunk = limits::max_chunk;
    REQUIRE_THROWS_NAMING(s.validate(), ConfigError, "state size for batch 1");

    // Attention: 4 d D with d = 2^16, D = 2^12 * 2^16.
    AttentionConfig a{.d_model = limits::max_d_model, .n_heads = limits::max_heads,
                      .d_head = limits::max_head_dim, .window = limits::max_window};
    REQUIRE_THROWS_NAMING(a.validate(), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(titans::AttentionParamsf::random(a, 1), ConfigError,
                          "max_allocation_bytes");
    // A full window of keys and values: 2 (w - 1) D.
    AttentionConfig w{.d_model = 1024, .n_heads = 1, .window = limits::max_window};
    REQUIRE_THROWS_NAMING(w.validate(), ConfigError, "state size for batch 1");
    REQUIRE_THROWS_NAMING(titans::Attention<float>(w, titans::AttentionParamsf{}), ConfigError,
                          "window");

    // Feed-forward: 3 d h with d = 2^16, h = 2^22.
    FeedForwardConfig f{.d_model = limits::max_d_model, .hidden = limits::max_ffn_hidden};
    REQUIRE_THROWS_NAMING(f.validate(), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(titans::FeedForwardParamsf::zeros(f), ConfigError,
                          "max_allocation_bytes");
    FeedForwardConfig fd{.d_model = limits::max_d_model};  // default SwiGLU width ~ 8d/3
    REQUIRE_THROWS_NAMING(fd.validate(), ConfigError, "max_allocation_bytes");

    // Model: vocab x d embedding and d x vocab head.
    ModelConfig m = tiny_model();
    m.vocab_size = limits::max_vocab;
    m.d_model = 1024;
    m.blocks = {BlockConfig::make(BlockKind::LMM, 1024, 1024, 1, 4, 2)};
    REQUIRE_THROWS_NAMING(m.validate(), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(titans::ModelParams<float>::zeros(m), ConfigError,
                          "max_allocation_bytes");
}

TEST_CASE("limits: the budget counts sizeof(T)", "[limits][config]") {
    // About 2.4e9 parameter elements: 9.7 GB in float (accepted), 19 GB in double (refused).
    MemoryConfig c = tiny_memory();
    c.d_model = 1 << 15;
    c.d_head = 1 << 14;
    c.chunk = 1;
    REQUIRE(c.parameter_count() > (std::int64_t{1} << 31));
    REQUIRE_NOTHROW(c.validate());
    REQUIRE_NOTHROW(c.validate_for<float>());
    REQUIRE_THROWS_NAMING(c.validate_for<double>(), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(c.validate_for<double>(), ConfigError, "double");
    REQUIRE_THROWS_NAMING(titans::MemoryParamsd::zeros(c), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(NeuralMemory<double>(c, titans::MemoryParamsd{}), ConfigError,
                          "max_allocation_bytes");
}

// limits: enums out of range are ConfigError
TEST_CASE("limits: enums out of range", "[limits][config]") {
    {
        MemoryConfig c = tiny_memory();
        c.activation = static_cast<Activation>(7);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "activation");
        c = tiny_memory();
        c.qkv_activation = static_cast<Activation>(-1);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "qkv_activation");
        c = tiny_memory();
        c.gates = static_cast<GateMode>(3);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "gates");
        REQUIRE_THROWS_NAMING(titans::MemoryParamsf::random(c, 1), ConfigError, "gates");
        c = tiny_memory();
        c.update = static_cast<UpdateMode>(2);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "update");
        c = tiny_memory();
        c.update = static_cast<UpdateMode>(INT_MIN);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "update");
        c = tiny_memory();
        c.retrieval = static_cast<Retrieval>(5);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, "retrieval");
    }
    {
        FeedForwardConfig f{.d_model = 4, .kind = static_cast<FeedForwardKind>(9)};
        REQUIRE_THROWS_NAMING(f.validate(), ConfigError, "kind");
        REQUIRE_THROWS_NAMING(titans::FeedForwardParamsf::random(f, 1), ConfigError, "kind");
    }
    for (int k : {5, 9, -1, INT_MAX}) {  // 4 is SWA
        BlockConfig b = tiny_block(BlockKind::MAG);
        b.kind = static_cast<BlockKind>(k);
        REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "kind");
        REQUIRE_THROWS_NAMING(titans::BlockParams<float>::random(b, 1), ConfigError, "kind");
        ModelConfig m = tiny_model();
        m.blocks[0] = b;
        REQUIRE_THROWS_NAMING(m.validate(), ConfigError, "kind");
    }
    {
        BlockConfig b = tiny_block(BlockKind::LMM);
        b.memory.gates = static_cast<GateMode>(99);
        REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "gates");
    }
}

// limits: NaN and infinite doubles are ConfigError
TEST_CASE("limits: NaN and infinite doubles", "[limits][config]") {
    using Setter = void (*)(MemoryConfig&, double);
    const std::vector<std::pair<const char*, Setter>> memory = {
        {"theta_max", [](MemoryConfig& c, double v) { c.theta_max = v; }},
        {"constant_theta", [](MemoryConfig& c, double v) { c.constant_theta = v; }},
        {"constant_eta", [](MemoryConfig& c, double v) { c.constant_eta = v; }},
        {"constant_alpha", [](MemoryConfig& c, double v) { c.constant_alpha = v; }},
        {"max_grad_norm", [](MemoryConfig& c, double v) { c.max_grad_norm = v; }},
    };
    for (double v : {kNaN, kInf, -kInf}) {
        for (const auto& [name, set] : memory) {
            MemoryConfig c = tiny_memory();
            set(c, v);
            INFO(name << " = " << v);
            REQUIRE_THROWS_NAMING(c.validate(), ConfigError, name);
            REQUIRE_THROWS_NAMING(titans::MemoryParamsd::random(c, 1), ConfigError, name);
        }
        for (bool rope : {true, false}) {  // checked whether or not RoPE is on
            AttentionConfig a = tiny_attention();
            a.rope = rope;
            a.rope_base = v;
            REQUIRE_THROWS_NAMING(a.validate(), ConfigError, "rope_base");
        }
        BlockConfig b = tiny_block(BlockKind::MAG);
        b.norm_eps = v;
        REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "norm_eps");
        ModelConfig m = tiny_model();
        m.norm_eps = v;
        REQUIRE_THROWS_NAMING(m.validate(), ConfigError, "norm_eps");
        REQUIRE_THROWS_NAMING(titans::RMSNorm<double>(4, v), ConfigError, "eps");
        REQUIRE_THROWS_NAMING(titans::PersistentMemory<double>::random(2, 4, 1, v), ConfigError,
                              "stddev");
    }
}

// limits: float objects reject float-only overflow
TEST_CASE("limits: float-only overflow", "[limits][config][float]") {
    // Finite in double, infinite (or zero) in float: the double objects accept them, the float
    // objects and float parameter generators refuse them.
    using Setter = void (*)(MemoryConfig&, double);
    const std::vector<std::tuple<const char*, Setter, double>> memory = {
        {"theta_max", [](MemoryConfig& c, double v) { c.theta_max = v; }, 1e39},
        {"constant_theta", [](MemoryConfig& c, double v) { c.constant_theta = v; }, 1e39},
        {"max_grad_norm", [](MemoryConfig& c, double v) { c.max_grad_norm = v; }, 1e300},
        {"constant_alpha", [](MemoryConfig& c, double v) { c.constant_alpha = v; }, 1e-50},
        {"constant_eta", [](MemoryConfig& c, double v) { c.constant_eta = v; }, 1e-40},
    };
    for (const auto& [name, set, v] : memory) {
        MemoryConfig c = tiny_memory();
        set(c, v);
        INFO(name << " = " << v);
        REQUIRE_NOTHROW(c.validate());
        REQUIRE_NOTHROW(c.validate_for<double>());
        REQUIRE_NOTHROW(NeuralMemory<double>(c, titans::MemoryParamsd::random(c, 1)));
        REQUIRE_THROWS_NAMING(c.validate_for<float>(), ConfigError, name);
        REQUIRE_THROWS_NAMING(c.validate_for<float>(), ConfigError, "float");
        REQUIRE_THROWS_NAMING(titans::MemoryParamsf::random(c, 1), ConfigError, name);
        REQUIRE_THROWS_NAMING(titans::MemoryParamsf::zeros(c), ConfigError, name);
        const auto pf = titans::MemoryParamsf::random(tiny_memory(), 1);
        REQUIRE_THROWS_NAMING(NeuralMemory<float>(c, pf), ConfigError, name);
        BlockConfig b = tiny_block(BlockKind::MAG);
        b.memory = c;
        b.memory.d_model = b.d_model;
        REQUIRE_NOTHROW(titans::Block<double>(b, titans::BlockParams<double>::random(b, 1)));
        REQUIRE_THROWS_NAMING(titans::BlockParams<float>::random(b, 1), ConfigError, name);
    }
    {
        AttentionConfig a = tiny_attention();
        a.rope = true;
        a.d_head = 2;
        a.rope_base = 1e39;
        REQUIRE_NOTHROW(titans::Attention<double>(a, titans::AttentionParamsd::random(a, 1)));
        REQUIRE_THROWS_NAMING(titans::AttentionParamsf::random(a, 1), ConfigError, "rope_base");
        REQUIRE_THROWS_NAMING(
            titans::Attention<float>(a, titans::AttentionParamsf::random(tiny_attention(), 1)),
            ConfigError, "rope_base");
    }
    for (double eps : {1e-50, 1e-40, 1e39}) {  // rounds to 0, subnormal, overflows in float
        INFO("eps = " << eps);
        REQUIRE_NOTHROW(titans::RMSNorm<double>(4, eps));
        REQUIRE_THROWS_NAMING(titans::RMSNorm<float>(4, eps), ConfigError, "eps");
        REQUIRE_THROWS_NAMING(titans::RMSNorm<float>(titans::RowVectorf::Ones(4), eps),
                              ConfigError, "eps");
        BlockConfig b = tiny_block(BlockKind::MAG);
        b.norm_eps = eps;
        REQUIRE_NOTHROW(titans::Block<double>(b, titans::BlockParams<double>::random(b, 1)));
        REQUIRE_THROWS_NAMING(titans::BlockParams<float>::random(b, 1), ConfigError, "norm_eps");
        const auto bp = titans::BlockParams<float>::random(tiny_block(BlockKind::MAG), 1);
        REQUIRE_THROWS_NAMING(titans::Block<float>(b, bp), ConfigError, "norm_eps");
        ModelConfig m = tiny_model();
        m.norm_eps = eps;
        REQUIRE_NOTHROW(titans::Model<double>(m, titans::ModelParams<double>::random(m, 1)));
        REQUIRE_THROWS_NAMING(titans::ModelParams<float>::random(m, 1), ConfigError, "norm_eps");
        const auto mp = titans::ModelParams<float>::random(tiny_model(), 1);
        REQUIRE_THROWS_NAMING(titans::Model<float>(m, mp), ConfigError, "norm_eps");
    }
    REQUIRE_THROWS_NAMING(titans::PersistentMemory<float>::random(2, 4, 1, 1e39), ConfigError,
                          "stddev");
}

// ---------------------------------------------------------------------------------------------
// The other configs.

// limits: AttentionConfig fields and limits
TEST_CASE("limits: AttentionConfig", "[limits][config]") {
    {
        AttentionConfig a = tiny_attention();
        a.d_model = limits::max_d_model;
        a.d_head = 1;
        REQUIRE_NOTHROW(a.validate_for<double>());
        a = tiny_attention();
        a.d_model = limits::max_heads;
        a.n_heads = limits::max_heads;
        REQUIRE_NOTHROW(a.validate_for<double>());
        a = tiny_attention();
        a.d_model = 1;
        a.d_head = limits::max_head_dim;
        a.window = 1;
        REQUIRE_NOTHROW(a.validate_for<double>());
        a = tiny_attention();
        a.d_model = 2;
        a.window = limits::max_window;  // 2 (w - 1) x 2 keys and values: 512 MiB in double
        REQUIRE_NOTHROW(a.validate_for<double>());
    }
    struct Field {
        const char* name;
        int AttentionConfig::*member;
        int limit;
        int lowest;
    };
    const Field fields[] = {
        {"d_model", &AttentionConfig::d_model, limits::max_d_model, 1},
        {"n_heads", &AttentionConfig::n_heads, limits::max_heads, 1},
        {"d_head", &AttentionConfig::d_head, limits::max_head_dim, 0},
        {"window", &AttentionConfig::window, limits::max_window, 1},
    };
    for (const Field& f : fields) {
        for (int v : {f.limit + 1, INT_MAX, f.lowest - 1, INT_MIN}) {
            AttentionConfig a = tiny_attention();
            a.d_head = 1;
            a.*f.member = v;
            INFO(f.name << " = " << v);
            REQUIRE_THROWS_NAMING(a.validate(), ConfigError, f.name);
            REQUIRE_THROWS_NAMING(titans::AttentionParamsd::zeros(a), ConfigError, f.name);
        }
    }
    for (double base : {0.0, -1.0}) {
        AttentionConfig a = tiny_attention();
        a.rope_base = base;
        REQUIRE_THROWS_NAMING(a.validate(), ConfigError, "rope_base");
    }
}

// limits: FeedForward and RMSNorm limits
TEST_CASE("limits: FeedForward and RMSNorm", "[limits][config]") {
    REQUIRE_NOTHROW(FeedForwardConfig{.d_model = limits::max_d_model, .hidden = 1}.validate());
    REQUIRE_NOTHROW(FeedForwardConfig{.d_model = 1, .hidden = limits::max_ffn_hidden}.validate());
    for (int v : {limits::max_d_model + 1, INT_MAX, 0, INT_MIN}) {
        FeedForwardConfig f{.d_model = v, .hidden = 1};
        REQUIRE_THROWS_NAMING(f.validate(), ConfigError, "d_model");
        REQUIRE_THROWS_NAMING(titans::FeedForwardParamsf::random(f, 1), ConfigError, "d_model");
        REQUIRE_THROWS_NAMING(titans::FeedForward<float>(f, titans::FeedForwardParamsf{}),
                              ConfigError, "d_model");
        REQUIRE_THROWS_NAMING(titans::RMSNorm<float>(v), ConfigError, "d_model");
    }
    for (int v : {limits::max_ffn_hidden + 1, INT_MAX, -1, INT_MIN}) {
        FeedForwardConfig f{.d_model = 4, .hidden = v};
        REQUIRE_THROWS_NAMING(f.validate(), ConfigError, "hidden");
    }
    REQUIRE_NOTHROW(titans::RMSNorm<float>(4, 1e-30));
    // PersistentMemory::random: counts and the budget, before allocating.
    REQUIRE_THROWS_NAMING(titans::PersistentMemory<float>::random(INT_MAX, 4, 1), ConfigError,
                          "n_tokens");
    REQUIRE_THROWS_NAMING(titans::PersistentMemory<float>::random(-1, 4, 1), ConfigError,
                          "n_tokens");
    REQUIRE_THROWS_NAMING(titans::PersistentMemory<float>::random(4, INT_MAX, 1), ConfigError,
                          "d_model");
    REQUIRE_THROWS_NAMING(
        titans::PersistentMemory<double>::random(limits::max_persistent, limits::max_d_model, 1),
        ConfigError, "max_allocation_bytes");
}

// limits: BlockConfig fields and limits
TEST_CASE("limits: BlockConfig", "[limits][config]") {
    {
        BlockConfig b = tiny_block(BlockKind::MAG);
        b.n_persistent = limits::max_persistent;
        REQUIRE_NOTHROW(b.validate_for<double>());
        b = tiny_block(BlockKind::MAC);
        b.segment = limits::max_segment;
        REQUIRE_NOTHROW(b.validate_for<double>());
        b = tiny_block(BlockKind::LMM);
        b.d_model = b.memory.d_model = b.ffn.d_model = limits::max_d_model;
        b.memory.d_head = 1;
        b.ffn.hidden = 1;
        b.attention = AttentionConfig{.d_model = 1, .n_heads = 1, .window = 1};  // unused by LMM
        REQUIRE_NOTHROW(b.validate_for<double>());
    }
    for (int v : {limits::max_persistent + 1, INT_MAX, -1, INT_MIN}) {
        for (BlockKind k : {BlockKind::MAC, BlockKind::MAG, BlockKind::MAL}) {
            BlockConfig b = tiny_block(k);
            b.n_persistent = v;
            REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "n_persistent");
            REQUIRE_THROWS_NAMING(titans::BlockParams<float>::zeros(b), ConfigError,
                                  "n_persistent");
        }
    }
    for (int v : {limits::max_segment + 1, INT_MAX, 0, INT_MIN}) {
        BlockConfig b = tiny_block(BlockKind::MAC);
        b.segment = v;
        REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "segment");
    }
    for (int v : {limits::max_d_model + 1, INT_MAX, 0, INT_MIN}) {
        BlockConfig b = tiny_block(BlockKind::MAL);
        b.d_model = v;
        REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "d_model");
    }
    // Nested fields are reported by their own validate(); LMM checks its (unused) attention
    // too, since the state records the attention width.
    BlockConfig b = tiny_block(BlockKind::LMM);
    b.attention.n_heads = INT_MAX;
    REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "n_heads");
    b = tiny_block(BlockKind::MAG);
    b.attention.window = INT_MAX;
    REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "window");
    b = tiny_block(BlockKind::MAG);
    b.memory.chunk = INT_MAX;
    REQUIRE_THROWS_NAMING(titans::Block<float>(b, titans::BlockParams<float>{}), ConfigError,
                          "chunk");
    // Persistent tokens over the budget (N_p x d with N_p, d at their limits).
    b = tiny_block(BlockKind::MAG);
    b.n_persistent = limits::max_persistent;
    b.d_model = b.memory.d_model = b.attention.d_model = b.ffn.d_model = limits::max_d_model;
    b.memory.d_head = b.attention.d_head = 1;
    REQUIRE_THROWS_NAMING(b.validate(), ConfigError, "max_allocation_bytes");
}

// limits: ModelConfig fields and limits
TEST_CASE("limits: ModelConfig", "[limits][config]") {
    {
        ModelConfig m = tiny_model();
        m.d_model = 16;
        m.blocks = {tiny_block(BlockKind::LMM)};
        m.blocks[0].d_model = m.blocks[0].memory.d_model = m.blocks[0].ffn.d_model = 16;
        m.vocab_size = limits::max_vocab;  // 2 x 2^26 x 16 elements: 8 GiB in float
        REQUIRE_NOTHROW(m.validate());
        REQUIRE_NOTHROW(m.validate_for<float>());
        REQUIRE_THROWS_NAMING(m.validate_for<double>(), ConfigError, "max_allocation_bytes");
        m.vocab_size = 0;
        m.d_out = limits::max_d_out;
        REQUIRE_NOTHROW(m.validate());
        ModelConfig many = tiny_model();
        many.blocks.assign(limits::max_blocks, tiny_block(BlockKind::LMM));
        REQUIRE_NOTHROW(many.validate());
        many.blocks.push_back(tiny_block(BlockKind::LMM));
        REQUIRE_THROWS_NAMING(many.validate(), ConfigError, "blocks.size()");
    }
    for (int v : {limits::max_vocab + 1, INT_MAX, -1, INT_MIN}) {
        ModelConfig m = tiny_model();
        m.vocab_size = v;
        REQUIRE_THROWS_NAMING(m.validate(), ConfigError, "vocab_size");
        REQUIRE_THROWS_NAMING(titans::ModelParams<float>::zeros(m), ConfigError, "vocab_size");
    }
    for (int v : {limits::max_d_out + 1, INT_MAX, -1, INT_MIN}) {
        ModelConfig m = tiny_model();
        m.d_out = v;
        REQUIRE_THROWS_NAMING(m.validate(), ConfigError, "d_out");
    }
    for (int v : {limits::max_d_model + 1, INT_MAX, 0, INT_MIN}) {
        ModelConfig m = tiny_model();
        m.d_model = v;
        REQUIRE_THROWS_NAMING(m.validate(), ConfigError, "d_model");
        REQUIRE_THROWS_NAMING(titans::Model<float>(m, titans::ModelParams<float>{}), ConfigError,
                              "d_model");
    }
    REQUIRE_THROWS_NAMING(ModelConfig::uniform(BlockKind::LMM, INT_MAX, 4, 1, 1, 4), ConfigError,
                          "n_layers");
    REQUIRE_THROWS_NAMING(ModelConfig::uniform(BlockKind::LMM, -1, 4, 1, 1, 4), ConfigError,
                          "n_layers");
}

// ---------------------------------------------------------------------------------------------
// make_state and positions.

// limits: make_state of a huge batch is ConfigError
TEST_CASE("limits: make_state huge batch", "[limits][state]") {
    const MemoryConfig mc = tiny_memory();
    const NeuralMemory<float> mem(mc, titans::MemoryParamsf::random(mc, 1));
    CHECK(mc.state_bytes(limits::max_batch, 8) <= limits::max_allocation_bytes);
    for (int b : {0, -1, INT_MIN, limits::max_batch + 1, INT_MAX}) {
        INFO("batch = " << b);
        REQUIRE_THROWS_NAMING(mem.make_state(b), ConfigError, "batch");
    }
    // Within max_batch but over the budget: 2 b x b workspaces per (sequence, head).
    MemoryConfig big = tiny_memory();
    big.chunk = 1024;
    const NeuralMemory<float> bigmem(big, titans::MemoryParamsf::random(big, 1));
    REQUIRE_THROWS_NAMING(bigmem.make_state(limits::max_batch), ConfigError, "batch");
    REQUIRE_THROWS_NAMING(bigmem.make_state(limits::max_batch), ConfigError,
                          "max_allocation_bytes");
    REQUIRE_NOTHROW(bigmem.make_state(2));

    // Attention: the full window of keys and values of every sequence.
    AttentionConfig ac{.d_model = 64, .n_heads = 1, .window = 1 << 20};
    const titans::Attention<double> attn(ac, titans::AttentionParamsd::random(ac, 1));
    REQUIRE_NOTHROW(attn.make_state(1));
    REQUIRE_THROWS_NAMING(attn.make_state(1024), ConfigError, "max_allocation_bytes");
    REQUIRE_THROWS_NAMING(attn.make_state(INT_MAX), ConfigError, "batch");

    // Blocks and models: MAC segment buffers, MAG persistent-token pass.
    for (BlockKind k : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL}) {
        INFO("kind " << titans::to_string(k));
        BlockConfig bc = tiny_block(k);
        bc.memory.chunk = 512;
        bc.segment = 1 << 16;
        bc.n_persistent = 1 << 10;
        const titans::Block<float> blk(bc, titans::BlockParams<float>::random(bc, 1));
        REQUIRE_THROWS_NAMING(blk.make_state(limits::max_batch), ConfigError,
                              "max_allocation_bytes");
        REQUIRE_THROWS_NAMING(blk.make_state(0), ConfigError, "batch");
        REQUIRE_THROWS_NAMING(blk.make_state(INT_MAX), ConfigError, "batch");
        ModelConfig m;
        m.d_model = 4;
        m.blocks = {bc, bc};
        const titans::Model<float> model(m, titans::ModelParams<float>::random(m, 1));
        REQUIRE_THROWS_NAMING(model.make_state(limits::max_batch), ConfigError,
                              "max_allocation_bytes");
        REQUIRE_THROWS_NAMING(model.make_state(limits::max_batch + 1), ConfigError, "batch");
    }
}

// limits: a forward past max_position throws
TEST_CASE("limits: forward past max_position", "[limits][state]") {
    const std::int64_t top = limits::max_position;
    const Matrixd x2 = Matrixd::Ones(2, 4);
    {
        const MemoryConfig c = tiny_memory();
        const NeuralMemory<double> mem(c, titans::MemoryParamsd::random(c, 1));
        auto st = mem.make_state(1);
        titans::MemoryState<double>::tensors(st, SetPositions{top - 2});
        REQUIRE_NOTHROW(mem.forward(st, x2));  // reaches exactly max_position
        CHECK(st.position() == top);
        REQUIRE_THROWS_NAMING(mem.forward(st, Matrixd::Ones(1, 4)), ConfigError, "position");
        CHECK(st.position() == top);  // unchanged
        REQUIRE_NOTHROW(mem.forward(st, Matrixd(0, 4)));  // an empty piece does not advance
        titans::MemoryState<double>::tensors(st, SetPositions{top - 1});
        REQUIRE_THROWS_NAMING(mem.forward(st, x2), ConfigError, "max_position");
    }
    {
        const AttentionConfig c = tiny_attention();
        const titans::Attention<double> attn(c, titans::AttentionParamsd::random(c, 1));
        auto st = attn.make_state(2);
        titans::AttentionState<double>::tensors(st, SetPositions{top - 1});
        REQUIRE_THROWS_NAMING(attn.forward(st, Matrixd::Ones(4, 4)), ConfigError, "position");
        REQUIRE_NOTHROW(attn.forward(st, x2));  // one token per sequence
        CHECK(st.position() == top);
    }
    for (BlockKind k : {BlockKind::LMM, BlockKind::MAG}) {
        const BlockConfig c = tiny_block(k);
        const titans::Block<double> blk(c, titans::BlockParams<double>::random(c, 1));
        auto st = blk.make_state(1);
        titans::BlockState<double>::tensors(st, SetPositions{top - 1});
        REQUIRE_THROWS_NAMING(blk.forward(st, x2), ConfigError, "position");
        REQUIRE_THROWS_NAMING(blk.mix(st, x2), ConfigError, "position");
        CHECK(st.position() == top - 1);
    }
    {
        const ModelConfig c = tiny_model();
        const titans::Model<double> model(c, titans::ModelParams<double>::random(c, 1));
        auto st = model.make_state(1);
        titans::ModelState<double>::tensors(st, SetPositions{top - 1});
        REQUIRE_THROWS_NAMING(model.forward(st, x2), ConfigError, "position");
        CHECK(st.position == top - 1);
    }
}

// ---------------------------------------------------------------------------------------------
// The helpers.

// limits: checked size arithmetic and helpers
TEST_CASE("limits: checked size arithmetic", "[limits]") {
    using namespace titans::detail;
    constexpr std::int64_t top = std::numeric_limits<std::int64_t>::max();
    STATIC_REQUIRE(sat_mul(3, 4) == 12);
    STATIC_REQUIRE(sat_mul(top, 2) == top);
    STATIC_REQUIRE(sat_mul(std::int64_t{1} << 40, std::int64_t{1} << 40) == top);
    STATIC_REQUIRE(sat_mul(-5, 7) == 0);
    STATIC_REQUIRE(sat_add(top, 1) == top);
    STATIC_REQUIRE(sat_add(1, 2, 3, 4) == 10);
    STATIC_REQUIRE(sat_mul(2, 3, 4, 5) == 120);
    CHECK(checked_mul(1 << 20, 1 << 20, "t", "n") == (std::int64_t{1} << 40));
    CHECK(checked_mul(-3, 5, "t", "n") == -15);
    REQUIRE_THROWS_NAMING(checked_mul(top / 2 + 1, 2, "t", "elements"), ConfigError, "elements");
    REQUIRE_THROWS_NAMING(checked_mul(std::numeric_limits<std::int64_t>::min(), -1, "t", "n"),
                          ConfigError, "overflows");
    REQUIRE_THROWS_NAMING(checked_mul(-(std::int64_t{1} << 62), 4, "t", "n"), ConfigError,
                          "overflows");
    REQUIRE_THROWS_NAMING(checked_add(top, 1, "t", "bytes"), ConfigError, "bytes");
    CHECK(checked_add(top, -1, "t", "n") == top - 1);
    CHECK(checked_int(INT_MAX, "t", "n") == INT_MAX);
    REQUIRE_THROWS_NAMING(checked_int(std::int64_t{INT_MAX} + 1, "t", "width"), ConfigError,
                          "width");

    CHECK(representable<float>(0.0));
    CHECK(representable<float>(1e38));
    CHECK(representable<float>(-1e-37));
    CHECK_FALSE(representable<float>(1e39));
    CHECK_FALSE(representable<float>(-1e39));
    CHECK_FALSE(representable<float>(1e-50));
    CHECK_FALSE(representable<float>(kNaN));
    CHECK_FALSE(representable<float>(kInf));
    CHECK(representable<double>(1e39));
    CHECK(representable<double>(1e-300));
    CHECK_FALSE(representable<double>(1e-320));  // subnormal in double
    CHECK_FALSE(representable<double>(kInf));

    const std::int64_t P = limits::max_position;
    REQUIRE_NOTHROW(check_position_advance("t", P - 4, 8, 2));
    REQUIRE_THROWS_NAMING(check_position_advance("t", P - 4, 10, 2), ConfigError, "position");
    REQUIRE_THROWS_NAMING(check_position_advance("t", P - 4, 2, 1, 3), ConfigError, "position");
    REQUIRE_THROWS_NAMING(check_position_advance("t", -1, 0, 1), ConfigError, "position");
    REQUIRE_THROWS_NAMING(check_position_advance("t", top, 0, 1), ConfigError, "position");
    REQUIRE_NOTHROW(check_position_advance("t", top, 5, 0));  // batch 0: the state check's job
    REQUIRE_NOTHROW(check_position_advance("t", 0, 5, 1, limits::max_persistent));
}
