// The serialization visitors: fields() of every config, tensors() of every parameter struct and
// state. Parameters: the visited names are unique, their sizes add up to the parameter count of
// the configuration computed here from the shape formulas, and writing through the visitor
// changes the object (a default-constructed one can be filled). States: the names do not depend
// on the position, and copying every visited tensor and integer of an advanced state into a
// fresh one continues the stream bit-identically (so the visited set is complete), while
// skipping any one of them does not. Configs: the field names, and from_string inverts
// to_string.
#include "test_common.hpp"

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

using namespace titans_test;
using titans::AttentionConfig;
using titans::AttentionParams;
using titans::Block;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;
using titans::BlockState;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::Model;
using titans::ModelConfig;
using titans::ModelParams;
using titans::ModelState;
using titans::MemoryState;

namespace {

// ---------------------------------------------------------------------------------------------
// Collecting what a visitor sees.

/// Names in visiting order, total number of scalars, and whether any tensor was empty.
struct Seen {
    std::vector<std::string> names;
    Eigen::Index total = 0;
    bool any_empty = false;

    [[nodiscard]] bool unique() const {
        return std::set<std::string>(names.begin(), names.end()).size() == names.size();
    }
    [[nodiscard]] bool contains(const std::string& n) const {
        return std::find(names.begin(), names.end(), n) != names.end();
    }
};

struct SeenVisitor {
    Seen* seen;
    template <class X>
    void operator()(const std::string& name, X& x) const {
        seen->names.push_back(name);
        if constexpr (std::is_same_v<std::remove_const_t<X>, std::int64_t>) {
            seen->total += 1;
        } else {
            seen->total += x.size();
            seen->any_empty = seen->any_empty || x.size() == 0;
        }
    }
};

template <class P, class Cfg>
Seen seen_params(const P& p, const Cfg& cfg) {
    Seen s;
    P::tensors(p, cfg, SeenVisitor{&s});
    return s;
}

template <class St>
Seen seen_state(const St& st) {
    Seen s;
    St::tensors(st, SeenVisitor{&s});
    return s;
}

/// Every visited tensor and integer of a state (or parameters), by name.
template <class T>
struct Dump {
    std::map<std::string, Matrix<T>> mats;
    std::map<std::string, std::int64_t> ints;
};

template <class T>
struct DumpVisitor {
    Dump<T>* dump;
    template <class X>
    void operator()(const std::string& name, const X& x) const {
        if constexpr (std::is_same_v<X, std::int64_t>) {
            dump->ints[name] = x;
        } else {
            dump->mats[name] = x;
        }
    }
};

/// Assigns every visited tensor and integer from `dump`, except names containing `skip`
/// (empty: none); counts the names found in `dump`.
template <class T>
struct LoadVisitor {
    const Dump<T>* dump;
    std::string skip;
    int* loaded;
    template <class X>
    void operator()(const std::string& name, X& x) const {
        if (!skip.empty() && name.find(skip) != std::string::npos) {
            return;
        }
        if constexpr (std::is_same_v<X, std::int64_t>) {
            x = dump->ints.at(name);
        } else {
            x = dump->mats.at(name);
        }
        ++*loaded;
    }
};

template <class T, class St>
Dump<T> dump_state(const St& st) {
    Dump<T> d;
    St::tensors(st, DumpVisitor<T>{&d});
    return d;
}

/// Loads `d` into `st`; returns how many entries were assigned.
template <class T, class St>
int load_state(St& st, const Dump<T>& d, const std::string& skip = "") {
    int loaded = 0;
    St::tensors(st, LoadVisitor<T>{&d, skip, &loaded});
    return loaded;
}

template <class T>
bool bitwise_equal(const Matrix<T>& a, const Matrix<T>& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() && (a.array() == b.array()).all();
}

template <class T>
bool dumps_equal(const Dump<T>& a, const Dump<T>& b) {
    if (a.ints != b.ints || a.mats.size() != b.mats.size()) return false;
    for (const auto& [name, m] : a.mats) {
        const auto it = b.mats.find(name);
        if (it == b.mats.end() || !bitwise_equal(m, it->second)) return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Parameter counts from the shape formulas of the doc comments (params.hpp, attention.hpp,
// feed_forward.hpp, block.hpp, model.hpp), written out independently of the library.

Eigen::Index memory_count(const MemoryConfig& c) {
    const Eigen::Index d = c.d_model, H = c.n_heads;
    const Eigen::Index dh = c.d_head > 0 ? c.d_head : d / H, D = H * dh, K = c.conv_kernel;
    const Eigen::Index L = c.depth, hid = L >= 2 ? c.expansion * dh : dh;
    // Layers: dh x hid, (L-2) of hid x hid, hid x dh; a single layer is dh x dh.
    const Eigen::Index mlp = L == 1 ? dh * dh : 2 * dh * hid + (L - 2) * hid * hid;
    Eigen::Index n = 3 * d * D + H * mlp + D * d;
    if (c.use_conv) n += 3 * K * D;
    if (c.gates != GateMode::Constant) n += 3 * d * H + 3 * H;
    return n;
}

Eigen::Index attention_count(const AttentionConfig& c) {
    const Eigen::Index d = c.d_model;
    const Eigen::Index D = c.n_heads * (c.d_head > 0 ? c.d_head : d / c.n_heads);
    return 3 * d * D + D * d;
}

/// Test configurations set `hidden` explicitly or use GELU's default 4d.
Eigen::Index ffn_count(const FeedForwardConfig& c) {
    const Eigen::Index d = c.d_model;
    if (c.kind == FeedForwardKind::GELU) {
        const Eigen::Index h = c.hidden > 0 ? c.hidden : 4 * d;
        return 2 * d * h;
    }
    REQUIRE(c.hidden > 0);
    return 3 * d * c.hidden;
}

Eigen::Index block_count(const BlockConfig& c) {
    const Eigen::Index d = c.d_model;
    Eigen::Index n = 2 * d + memory_count(c.memory);
    if (c.kind != BlockKind::LMM) n += attention_count(c.attention) + c.n_persistent * d;
    if (c.kind == BlockKind::MAG) n += 2 * d;
    if (c.use_ffn) n += ffn_count(c.ffn);
    return n;
}

Eigen::Index model_count(const ModelConfig& c) {
    Eigen::Index n = static_cast<Eigen::Index>(c.vocab_size) * c.d_model;
    for (const auto& b : c.blocks) n += block_count(b);
    const Eigen::Index out = c.vocab_size > 0 ? c.vocab_size : (c.d_out > 0 ? c.d_out : c.d_model);
    return n + c.d_model + static_cast<Eigen::Index>(c.d_model) * out;
}

/// Block configurations covering every kind, with and without FFN (SwiGLU, GELU), conv on and
/// off, the three gate modes, depth 1-3, an explicit d_head.
std::vector<BlockConfig> block_configs() {
    std::vector<BlockConfig> out;
    {
        auto c = BlockConfig::make(BlockKind::LMM, 16, 2, 2, 6, 4);
        c.ffn.hidden = 40;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::LMM, 12, 3, 1, 6, 4);
        c.use_ffn = false;
        c.memory.use_conv = false;
        c.memory.gates = GateMode::Constant;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::MAC, 16, 2, 2, 5, 4);
        c.use_ffn = false;
        c.memory.use_conv = false;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::MAC, 16, 2, 3, 5, 3);
        c.ffn.kind = FeedForwardKind::GELU;
        c.memory.gates = GateMode::Constant;
        c.n_persistent = 3;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::MAG, 16, 2, 2, 6, 4);
        c.ffn.hidden = 24;
        c.memory.gates = GateMode::PerChunk;
        c.memory.d_head = 6;
        c.attention.d_head = 4;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::MAG, 8, 1, 1, 3, 2);
        c.use_ffn = false;
        c.memory.gates = GateMode::Constant;
        c.memory.conv_kernel = 2;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::MAL, 16, 4, 2, 6, 4);
        c.ffn.kind = FeedForwardKind::GELU;
        c.ffn.hidden = 20;
        c.memory.expansion = 2;
        out.push_back(c);
    }
    {
        auto c = BlockConfig::make(BlockKind::MAL, 16, 2, 2, 6, 4);
        c.use_ffn = false;
        c.n_persistent = 0;
        c.memory.update = UpdateMode::PerToken;
        out.push_back(c);
    }
    return out;
}

ModelConfig mixed_model_config(int vocab) {
    ModelConfig c;
    c.vocab_size = vocab;
    c.d_model = 16;
    c.d_out = vocab > 0 ? 0 : 5;
    for (BlockKind k : {BlockKind::MAC, BlockKind::MAG, BlockKind::LMM, BlockKind::MAL}) {
        auto b = BlockConfig::make(k, 16, 2, 2, 5, 4);
        b.ffn.hidden = 24;
        c.blocks.push_back(b);
    }
    c.blocks[2].use_ffn = false;
    c.blocks[3].memory.gates = GateMode::Constant;
    return c;
}

/// Writes `value` into every visited tensor.
template <class T>
struct FillVisitor {
    T value;
    template <class X>
    void operator()(const std::string&, X& x) const {
        x.setConstant(value);
    }
};

/// Copies every visited parameter tensor of `p` into a default-constructed object.
template <class T, class P, class Cfg>
P copy_params_through_visitor(const P& p, const Cfg& cfg) {
    Dump<T> d;
    P::tensors(p, cfg, DumpVisitor<T>{&d});
    P q;
    int loaded = 0;
    P::tensors(q, cfg, LoadVisitor<T>{&d, "", &loaded});
    REQUIRE(loaded == static_cast<int>(d.mats.size()));
    return q;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parameters.

// parameter visitors: unique names, sizes that add up to the parameter count of the configuration,
// no empty tensor, for every block kind and mode
TEST_CASE("parameter visitors: names and sizes", "[visitors]") {
    const auto configs = block_configs();
    for (std::size_t i = 0; i < configs.size(); ++i) {
        const BlockConfig& cfg = configs[i];
        INFO("config " << i << " kind " << titans::to_string(cfg.kind));
        const auto p = BlockParams<double>::random(cfg, 100 + i);
        const Seen s = seen_params(p, cfg);
        CHECK(s.unique());
        // persistent is visited as 0 x d when n_persistent = 0 (validate() expects that shape).
        CHECK(s.any_empty == (cfg.kind != BlockKind::LMM && cfg.n_persistent == 0));
        CHECK(s.total == block_count(cfg));
        // The parts, visited on their own, agree with their own formulas.
        const Seen m = seen_params(p.memory, cfg.memory);
        CHECK(m.unique());
        CHECK(m.total == memory_count(cfg.memory));
        CHECK(s.contains("memory.w_q"));
        CHECK(s.contains("memory.memory_init.0.0"));
        CHECK(s.contains(titans::detail::visit_name("memory.memory_init", cfg.memory.n_heads - 1,
                                                    cfg.memory.depth - 1)));
        CHECK(s.contains("memory.conv_q") == cfg.memory.use_conv);
        CHECK(s.contains("memory.b_alpha") == (cfg.memory.gates != GateMode::Constant));
        CHECK(s.contains("attention.w_o") == (cfg.kind != BlockKind::LMM));
        CHECK(s.contains("persistent") == (cfg.kind != BlockKind::LMM));
        CHECK(s.contains("norm_y") == (cfg.kind == BlockKind::MAG));
        CHECK(s.contains("ffn.w1") == cfg.use_ffn);
        CHECK(s.contains("ffn.w3") == (cfg.use_ffn && cfg.ffn.kind == FeedForwardKind::SwiGLU));
        if (cfg.kind != BlockKind::LMM) {
            const Seen a = seen_params(p.attention, cfg.attention);
            CHECK(a.names == std::vector<std::string>{"w_q", "w_k", "w_v", "w_o"});
            CHECK(a.total == attention_count(cfg.attention));
        }
        if (cfg.use_ffn) {
            const Seen f = seen_params(p.ffn, cfg.ffn);
            CHECK(f.total == ffn_count(cfg.ffn));
        }
        // Non-const and const visits see the same names.
        auto q = p;
        Seen sq;
        BlockParams<double>::tensors(q, cfg, SeenVisitor{&sq});
        CHECK(sq.names == s.names);
    }
    for (int vocab : {0, 11}) {
        INFO("model, vocab " << vocab);
        const ModelConfig cfg = mixed_model_config(vocab);
        const auto p = ModelParams<float>::random(cfg, 7);
        const Seen s = seen_params(p, cfg);
        CHECK(s.unique());
        CHECK_FALSE(s.any_empty);
        CHECK(s.total == model_count(cfg));
        CHECK(s.contains("embedding") == (vocab > 0));
        CHECK(s.contains("blocks.0.memory.w_q"));
        CHECK(s.contains("blocks.3.attention.w_k"));
        CHECK_FALSE(s.contains("blocks.2.attention.w_k"));  // LMM
        CHECK(s.contains("blocks.1.norm_m"));
        CHECK(s.names.back() == "head");
    }
}

// parameter visitors: writing through the visitor changes exactly the visited tensors, and fills
// default-constructed parameters
TEST_CASE("parameter visitors: writing", "[visitors]") {
    const auto configs = block_configs();
    for (std::size_t i = 0; i < configs.size(); ++i) {
        const BlockConfig& cfg = configs[i];
        INFO("config " << i << " kind " << titans::to_string(cfg.kind));
        const auto p0 = BlockParams<double>::random(cfg, 200 + i);
        auto p = p0;
        BlockParams<double>::tensors(p, cfg, FillVisitor<double>{0.25});
        CHECK_NOTHROW(p.validate(cfg));
        CHECK((p.norm_mix.array() == 0.25).all());
        CHECK((p.memory.w_q.array() == 0.25).all());
        CHECK((p.memory.memory_init.back().back().array() == 0.25).all());
        CHECK((p.memory.w_o.array() == 0.25).all());
        if (cfg.memory.gates == GateMode::Constant) {
            // random() draws the gate weights, but this configuration does not use them.
            CHECK(bitwise_equal(p.memory.w_theta, p0.memory.w_theta));
        } else {
            CHECK((p.memory.b_theta.array() == 0.25).all());
        }
        if (!cfg.memory.use_conv) {
            CHECK(bitwise_equal(p.memory.conv_q, p0.memory.conv_q));
        }
        if (cfg.kind != BlockKind::LMM) {
            CHECK((p.persistent.array() == 0.25).all());
            CHECK((p.attention.w_v.array() == 0.25).all());
        }
        if (cfg.use_ffn) {
            CHECK((p.ffn.w2.array() == 0.25).all());
        }
        // A default-constructed BlockParams filled through the visitor builds an equal block.
        const auto q = copy_params_through_visitor<double>(p0, cfg);
        CHECK_NOTHROW(q.validate(cfg));
        Dump<double> d0, dq;
        BlockParams<double>::tensors(p0, cfg, DumpVisitor<double>{&d0});
        BlockParams<double>::tensors(q, cfg, DumpVisitor<double>{&dq});
        CHECK(dumps_equal(d0, dq));
        Rng rng(seed_for("visitor fill", static_cast<int>(i)));
        const Matrixd x = random_matrix(9, cfg.d_model, rng);
        Block<double> a(cfg, p0), b(cfg, q);
        auto sa = a.make_state(1);
        auto sb = b.make_state(1);
        CHECK(bitwise_equal(a.forward(sa, x), b.forward(sb, x)));
    }
    const ModelConfig cfg = mixed_model_config(11);
    const auto p0 = ModelParams<float>::random(cfg, 3);
    const auto q = copy_params_through_visitor<float>(p0, cfg);
    REQUIRE(q.blocks.size() == cfg.blocks.size());
    Model<float> a(cfg, p0), b(cfg, q);
    auto sa = a.make_state(1);
    auto sb = b.make_state(1);
    const std::vector<int> ids{3, 1, 4, 1, 5, 9, 2, 6};
    CHECK(bitwise_equal(a.forward_tokens(sa, ids), b.forward_tokens(sb, ids)));
    // Const visits check the counts they index.
    auto bad = p0;
    bad.blocks[0].memory.memory_init.pop_back();
    const auto& cbad = bad;
    Seen ignored;
    REQUIRE_THROWS_AS(ModelParams<float>::tensors(cbad, cfg, SeenVisitor{&ignored}),
                      titans::ShapeError);
}

// ---------------------------------------------------------------------------------------------
// States.

namespace {

/// Runs `first` through stream A, copies A's visited state into a fresh stream B, runs `next`
/// through both and checks that the outputs and final states are bit-identical; then checks
/// that skipping each name fragment in `skips` makes the outputs differ.
template <class T, class Layer, class Forward>
void check_resume(const Layer& layer, int batch, const Matrix<T>& first, const Matrix<T>& next,
                  Forward forward, const std::vector<std::string>& skips) {
    auto a = layer.make_state(batch);
    const Seen fresh = seen_state(a);
    REQUIRE(fresh.unique());
    (void)forward(a, first);
    const Seen advanced = seen_state(a);
    CHECK(advanced.names == fresh.names);
    const Dump<T> saved = dump_state<T>(a);

    auto b = layer.make_state(batch);
    CHECK(load_state(b, saved) == static_cast<int>(fresh.names.size()));
    CHECK(dumps_equal(dump_state<T>(b), saved));
    const Matrix<T> ya = forward(a, next);
    const Matrix<T> yb = forward(b, next);
    CHECK(bitwise_equal(ya, yb));
    CHECK(dumps_equal(dump_state<T>(a), dump_state<T>(b)));

    for (const std::string& skip : skips) {
        INFO("skipping the names containing " << skip);
        auto c = layer.make_state(batch);
        const int loaded = load_state(c, saved, skip);
        CHECK(loaded < static_cast<int>(fresh.names.size()));  // the fragment names something
        auto a2 = layer.make_state(batch);
        REQUIRE(load_state(a2, saved) == static_cast<int>(fresh.names.size()));
        CHECK_FALSE(bitwise_equal(forward(a2, next), forward(c, next)));
    }
}

std::vector<std::string> memory_skips(const MemoryConfig& m) {
    std::vector<std::string> s{".w.", ".s."};
    if (m.update == UpdateMode::Chunked) {
        s.insert(s.end(), {".a.", ".delta."});
        if (m.gates != GateMode::Constant) s.push_back(".gates");
    }
    if (m.use_conv) s.push_back("conv_tail");
    return s;
}

}  // namespace

// state visitors: NeuralMemory in every update, gate and conv mode resumes bit-identically from the
// visited tensors, and not without any one of them
TEST_CASE("state visitors: NeuralMemory", "[visitors]") {
    struct Mode {
        UpdateMode update;
        Retrieval retrieval;
        GateMode gates;
        bool conv;
    };
    const Mode modes[] = {
        {UpdateMode::Chunked, Retrieval::Lagged, GateMode::DataDependent, true},
        {UpdateMode::Chunked, Retrieval::InChunk, GateMode::Constant, false},
        {UpdateMode::Chunked, Retrieval::Lagged, GateMode::PerChunk, true},
        {UpdateMode::PerToken, Retrieval::InChunk, GateMode::DataDependent, true},
        {UpdateMode::PerToken, Retrieval::Lagged, GateMode::Constant, false},
    };
    int i = 0;
    for (const Mode& mode : modes) {
        INFO("mode " << i);
        MemoryConfig cfg{.d_model = 12, .n_heads = 2, .depth = 2, .expansion = 2,
                         .use_conv = mode.conv, .conv_kernel = 3, .gates = mode.gates,
                         .constant_theta = 0.5, .constant_eta = 0.8, .constant_alpha = 0.05,
                         .update = mode.update, .retrieval = mode.retrieval, .chunk = 4};
        cfg.theta_max = 0.5;  // learn visibly within a few tokens
        NeuralMemory<double> mem(cfg, MemoryParams<double>::random(cfg, 30 + i));
        Rng rng(seed_for("visitor memory", i));
        const int B = 2;
        const Matrixd first = random_matrix(B * 7, 12, rng);
        const Matrixd next = random_matrix(B * 6, 12, rng);
        auto fwd = [&mem](MemoryState<double>& st, const Matrixd& x) { return mem.forward(st, x); };
        const auto names = seen_state(mem.make_state(B)).names;
        CHECK(names.front() == "position");
        CHECK(std::count(names.begin(), names.end(), "heads.1.1.w.1") == 1);
        CHECK(std::count(names.begin(), names.end(), "heads.0.0.a.0") ==
              (mode.update == UpdateMode::Chunked ? 1 : 0));
        check_resume<double>(mem, B, first, next, fwd, memory_skips(cfg));
        ++i;
    }
}

// state visitors: every block kind resumes bit-identically from the visited tensors mid-chunk and
// mid-segment, and not without any one of them
TEST_CASE("state visitors: every block kind", "[visitors]") {
    for (BlockKind kind : titans::all_block_kinds) {
        INFO("kind " << titans::to_string(kind));
        auto cfg = BlockConfig::make(kind, 16, 2, 2, 5, 4);
        cfg.ffn.hidden = 24;
        cfg.attention.rope = kind == BlockKind::MAG;
        cfg.memory.theta_max = 0.5;
        Block<double> block(cfg, BlockParams<double>::random(cfg, 50));
        Rng rng(seed_for("visitor block", static_cast<int>(kind)));
        const int B = 2;
        // 7 tokens: inside the second chunk (4) and the second segment (5).
        const Matrixd first = random_matrix(B * 7, 16, rng);
        const Matrixd next = random_matrix(B * 6, 16, rng);
        auto fwd = [&block](BlockState<double>& st, const Matrixd& x) {
            return block.forward(st, x);
        };
        const Seen names = seen_state(block.make_state(B));
        CHECK(names.contains("position"));
        CHECK(names.contains("memory.position") == titans::has_memory(kind));
        CHECK(names.contains("memory.heads.1.1.s.1") == titans::has_memory(kind));
        const bool has_attention = titans::has_window(kind);
        CHECK(names.contains("attention.k.1") == has_attention);
        CHECK(names.contains("seg_v.1") == (kind == BlockKind::MAC));
        CHECK(names.contains("snapshot.1.1.1") == (kind == BlockKind::MAC));
        std::vector<std::string> skips;
        if (titans::has_memory(kind)) skips = memory_skips(cfg.memory);
        // The attention history as a whole (k alone would leave k and v of different lengths).
        if (has_attention) skips.push_back("attention.");
        if (kind == BlockKind::MAC) skips.insert(skips.end(), {"seg_k", "seg_v", "snapshot"});
        check_resume<double>(block, B, first, next, fwd, skips);
    }
}

// state visitors: a model of mixed kinds with a vocabulary resumes bit-identically, and the names
// are blocks.{i}.* of the block states
TEST_CASE("state visitors: mixed model", "[visitors]") {
    const ModelConfig cfg = mixed_model_config(11);
    Model<float> model(cfg, ModelParams<float>::random(cfg, 9));
    const int B = 2;
    auto tokens = [](int n, int salt) {
        std::vector<int> ids;
        for (int i = 0; i < n; ++i) ids.push_back((i * 7 + salt) % 11);
        return ids;
    };
    const std::vector<int> first = tokens(B * 8, 1), next = tokens(B * 9, 4);
    // check_resume feeds matrices: carry the ids in a 1-column matrix.
    auto as_matrix = [](const std::vector<int>& ids) {
        Matrix<float> m(static_cast<Eigen::Index>(ids.size()), 1);
        for (std::size_t i = 0; i < ids.size(); ++i) {
            m(static_cast<Eigen::Index>(i), 0) = static_cast<float>(ids[i]);
        }
        return m;
    };
    auto fwd = [&model](ModelState<float>& st, const Matrix<float>& m) {
        std::vector<int> ids;
        for (Eigen::Index i = 0; i < m.rows(); ++i) ids.push_back(static_cast<int>(m(i, 0)));
        return model.forward_tokens(st, ids);
    };
    const Seen names = seen_state(model.make_state(B));
    CHECK(names.names.front() == "position");
    CHECK(names.contains("blocks.0.snapshot.1.1.0"));
    CHECK(names.contains("blocks.1.attention.v.0"));
    CHECK(names.contains("blocks.3.memory.conv_tail.1"));
    CHECK_FALSE(names.contains("blocks.3.memory.heads.0.0.gates"));  // Constant gates
    CHECK_FALSE(names.contains("blocks.2.attention.k.0"));          // LMM
    check_resume<float>(model, B, as_matrix(first), as_matrix(next), fwd,
                        {"blocks.0.snapshot", "blocks.1.attention.", "blocks.3.memory.heads"});
}

// MAC make_state fills the segment snapshot with the memory's initial weights
TEST_CASE("MAC: make_state snapshot", "[visitors]") {
    auto cfg = BlockConfig::make(BlockKind::MAC, 16, 2, 2, 5, 4);
    const auto p = BlockParams<double>::random(cfg, 5);
    Block<double> block(cfg, p);
    const auto st = block.make_state(2);
    Dump<double> d = dump_state<double>(st);
    for (int b = 0; b < 2; ++b) {
        for (int h = 0; h < 2; ++h) {
            for (int l = 0; l < 2; ++l) {
                const auto name = titans::detail::visit_name("snapshot", b, h, l);
                INFO(name);
                REQUIRE(d.mats.count(name) == 1);
                CHECK(bitwise_equal(d.mats[name],
                                    p.memory.memory_init[static_cast<std::size_t>(h)]
                                                        [static_cast<std::size_t>(l)]));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Configs.

namespace {

/// Config fields as text (enums by name, doubles with 17 digits) and back.
struct ToText {
    std::map<std::string, std::string>* out;
    template <class X>
    void operator()(const std::string& name, const X& x) const {
        if constexpr (std::is_same_v<X, bool>) {
            (*out)[name] = x ? "true" : "false";
        } else if constexpr (std::is_same_v<X, int>) {
            (*out)[name] = std::to_string(x);
        } else if constexpr (std::is_same_v<X, double>) {
            char buf[64];
            std::snprintf(buf, sizeof buf, "%.17g", x);
            (*out)[name] = buf;
        } else {
            static_assert(std::is_enum_v<X>);
            (*out)[name] = titans::to_string(x);
        }
    }
};

struct FromText {
    const std::map<std::string, std::string>* in;
    template <class X>
    void operator()(const std::string& name, X& x) const {
        const std::string& s = in->at(name);
        if constexpr (std::is_same_v<X, bool>) {
            x = s == "true";
        } else if constexpr (std::is_same_v<X, int>) {
            x = std::stoi(s);
        } else if constexpr (std::is_same_v<X, double>) {
            x = std::stod(s);
        } else {
            REQUIRE(titans::from_string(s, x));
        }
    }
};

template <class Cfg>
std::vector<std::string> field_names(const Cfg& c) {
    std::vector<std::string> names;
    Cfg::fields(c, [&names](const std::string& n, const auto&) { names.push_back(n); });
    return names;
}

template <class E>
void check_enum_round_trip(std::initializer_list<E> values) {
    for (E e : values) {
        E out = *(values.end() - 1) == e ? *values.begin() : *(values.end() - 1);
        CHECK(titans::from_string(titans::to_string(e), out));
        CHECK(out == e);
        E kept = e;
        CHECK_FALSE(titans::from_string("bogus", kept));
        CHECK_FALSE(titans::from_string("", kept));
        CHECK(kept == e);
    }
}

}  // namespace

// config visitors: names in declaration order with dotted prefixes, flush_denormals not visited,
// and every config read back from text equals the original
TEST_CASE("config visitors: names and text", "[visitors]") {
    auto cfg = BlockConfig::make(BlockKind::MAC, 24, 3, 3, 7, 5);
    cfg.memory.gates = GateMode::PerChunk;
    cfg.memory.theta_max = 0.123456789012345678;
    cfg.memory.activation = Activation::GELU;
    cfg.attention.rope = true;
    cfg.ffn.kind = FeedForwardKind::GELU;
    cfg.ffn.hidden = 33;
    cfg.n_persistent = 2;
    cfg.norm_eps = 1e-5;
    const auto names = field_names(cfg);
    CHECK(std::set<std::string>(names.begin(), names.end()).size() == names.size());
    CHECK(names.size() == 2 + 22 + 6 + 3 + 3 + 1);
    CHECK(names.front() == "kind");
    CHECK(names[1] == "d_model");
    CHECK(names[2] == "memory.d_model");
    CHECK(names.back() == "norm_eps");
    for (const char* n : {"memory.chunk", "memory.gates", "memory.retrieval", "memory.max_grad_norm",
                          "memory.momentum", "memory.forget", "attention.window",
                          "attention.rope_base", "ffn.kind", "ffn.hidden", "segment", "use_ffn"}) {
        INFO(n);
        CHECK(std::count(names.begin(), names.end(), std::string(n)) == 1);
    }
    CHECK(std::count(names.begin(), names.end(), std::string("memory.flush_denormals")) == 0);
    CHECK(field_names(cfg.memory).size() == 22);

    // Block: text and back.
    std::map<std::string, std::string> text;
    BlockConfig::fields(cfg, ToText{&text});
    CHECK(text.at("memory.gates") == "PerChunk");
    CHECK(text.at("kind") == "MAC");
    BlockConfig back;
    BlockConfig::fields(back, FromText{&text});
    CHECK(back.kind == cfg.kind);
    CHECK(back.memory == cfg.memory);
    CHECK(back.memory.theta_max == cfg.memory.theta_max);
    CHECK(back.attention.window == cfg.attention.window);
    CHECK(back.attention.rope == cfg.attention.rope);
    CHECK(back.ffn.kind == cfg.ffn.kind);
    CHECK(back.ffn.hidden == cfg.ffn.hidden);
    CHECK(back.n_persistent == cfg.n_persistent);
    CHECK(back.segment == cfg.segment);
    CHECK(back.norm_eps == cfg.norm_eps);
    std::map<std::string, std::string> text2;
    BlockConfig::fields(back, ToText{&text2});
    CHECK(text2 == text);

    // Model: vocab_size, d_model, d_out, blocks.{i}.*, norm_eps; the block count is the caller's.
    const ModelConfig mc = mixed_model_config(11);
    const auto mnames = field_names(mc);
    CHECK(mnames.size() == 3 + 4 * names.size() + 1);
    CHECK(mnames[0] == "vocab_size");
    CHECK(mnames[3] == "blocks.0.kind");
    CHECK(mnames.back() == "norm_eps");
    CHECK(std::count(mnames.begin(), mnames.end(), std::string("blocks.3.memory.chunk")) == 1);
    std::map<std::string, std::string> mtext;
    ModelConfig::fields(mc, ToText{&mtext});
    ModelConfig mback;
    mback.blocks.resize(mc.blocks.size());
    ModelConfig::fields(mback, FromText{&mtext});
    std::map<std::string, std::string> mtext2;
    ModelConfig::fields(mback, ToText{&mtext2});
    CHECK(mtext2 == mtext);
    CHECK_NOTHROW(mback.validate());
    CHECK(mback.blocks[3].memory == mc.blocks[3].memory);
}

// from_string inverts to_string for every enumerator and rejects other names
TEST_CASE("from_string inverts to_string", "[visitors]") {
    check_enum_round_trip({Activation::SiLU, Activation::GELU, Activation::Identity});
    check_enum_round_trip({GateMode::DataDependent, GateMode::Constant, GateMode::PerChunk});
    check_enum_round_trip({UpdateMode::Chunked, UpdateMode::PerToken});
    check_enum_round_trip({Retrieval::Lagged, Retrieval::InChunk});
    check_enum_round_trip({FeedForwardKind::SwiGLU, FeedForwardKind::GELU});
    check_enum_round_trip({BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL, BlockKind::SWA});
    GateMode g = GateMode::Constant;
    CHECK_FALSE(titans::from_string("constant", g));  // case-sensitive
    CHECK(g == GateMode::Constant);
}

// Params::zeros has the shapes of Params::random for every parameter struct, without its draws
TEST_CASE("Params::zeros matches random", "[visitors]") {
    Rng rng(seed_for("params zeros"));
    ModelConfig cfg = ModelConfig::uniform(BlockKind::MAC, 1, 12, 2, 3, 5, 17, 4);
    cfg.blocks.push_back(BlockConfig::make(BlockKind::MAG, 12, 3, 1, 4, 3));
    cfg.blocks.push_back(BlockConfig::make(BlockKind::MAL, 12, 2, 2, 6, 2));
    cfg.blocks.back().ffn.kind = FeedForwardKind::GELU;
    cfg.blocks[1].memory.use_conv = false;
    const auto r = ModelParams<double>::random(cfg, rng());
    const auto z = ModelParams<double>::zeros(cfg);
    std::vector<std::pair<Eigen::Index, Eigen::Index>> rs, zs;
    std::size_t nonzero_random = 0;
    std::size_t zero_bias = 0;  // b_theta is 0 in random() too
    ModelParams<double>::tensors(r, cfg, [&](const std::string& name, const auto& m) {
        rs.emplace_back(m.rows(), m.cols());
        nonzero_random += (m.array() != 0.0).count() > 0 ? 1 : 0;
        zero_bias += name.find("b_theta") != std::string::npos ? 1 : 0;
    });
    ModelParams<double>::tensors(z, cfg, [&](const std::string& name, const auto& m) {
        zs.emplace_back(m.rows(), m.cols());
        // Drawn tensors are zero; only the constant parts (norm weights 1, gate biases, the
        // conv's current-token tap 1) are set.
        const bool constant_part = name.find("norm") != std::string::npos ||
                                   name.find("memory.b_") != std::string::npos ||
                                   name.find("conv_") != std::string::npos;
        if (!constant_part) {
            CAPTURE(name);
            CHECK(m.isZero(0.0));
        }
    });
    REQUIRE(rs == zs);
    REQUIRE(zero_bias == 3);
    REQUIRE(nonzero_random == rs.size() - zero_bias);  // random() really draws
    REQUIRE(rs.size() > 30);
}
