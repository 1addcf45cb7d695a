// A training trace is used only by the layer that made it (issue: "the training surface keeps
// the promises the inference surface keeps"). Every backward (RMSNorm, FeedForward, Attention,
// NeuralMemory, every block kind, the model) refuses, naming `trace`, a trace of another layer
// of the same width that differs in any setting (hidden size, feed-forward kind, vocabulary,
// heads, depth, chunk, window, segment, ...), a default-constructed or moved-from trace, and a
// trace whose internal sizes (or token ids) are not those its training forward left; and it
// refuses gradients of another configuration naming `grads`. Each refusal leaves the
// gradients and dx bit for bit as they were. Without the checks these calls read and write out
// of bounds (an Eigen assertion in a debug build, a heap overflow in a release build).

#include "robust_common.hpp"

#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace traces_test {

using namespace titans_test;
using titans::AttentionConfig;
using titans::AttentionParams;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;
using titans::ConfigError;
using titans::FeedForwardConfig;
using titans::FeedForwardKind;
using titans::FeedForwardParams;
using titans::ModelConfig;
using titans::ModelParams;
using titans::PrefixSharing;
using titans::RowVector;
using titans::ShapeError;

using Bits = std::vector<std::uint64_t>;

/// Appends m's shape and the bit pattern of every entry (as double: exact for float too).
template <class M>
void add_trace_bits(Bits& out, const M& m) {
    out.push_back(static_cast<std::uint64_t>(m.rows()));
    out.push_back(static_cast<std::uint64_t>(m.cols()));
    for (Eigen::Index i = 0; i < m.size(); ++i) {
        const double v = static_cast<double>(m.data()[i]);
        std::uint64_t b = 0;
        std::memcpy(&b, &v, sizeof b);
        out.push_back(b);
    }
}

/// Every tensor of a parameter struct of configuration cfg, and dx, bit for bit.
template <class Params, class Config, class T>
Bits trace_test_bits(const Params& p, const Config& cfg, const Matrix<T>& dx) {
    Bits out;
    Params::tensors(p, cfg, [&out](const std::string&, const auto& m) { add_trace_bits(out, m); });
    add_trace_bits(out, dx);
    return out;
}

/// call() throws E whose message contains every text, and snap() (the caller's gradients and
/// dx) reads the same before and after.
template <class E, class Call, class Snap>
void require_refused(const Call& call, const Snap& snap, std::initializer_list<std::string> texts) {
    const Bits before = snap();
    std::string message;
    try {
        call();
    } catch (const E& e) {
        message = e.what();
    }
    INFO("message: " << message);
    REQUIRE(!message.empty());  // E thrown (another exception type fails the test case)
    for (const std::string& t : texts) {
        CHECK_THAT(message, TITANS_CONTAINS(t));
    }
    CHECK(snap() == before);
}

/// A matrix of rows x cols drawn from rng, in T.
template <class T>
Matrix<T> trace_test_matrix(Eigen::Index rows, Eigen::Index cols, Rng& rng) {
    return random_matrix(rows, cols, rng).cast<T>();
}

/// A setting changed, and the name the refusal must give.
template <class Config>
struct Variation {
    const char* name;
    std::function<void(Config&)> change;
};

/// A change of a trace's insides, and the text the refusal must give.
template <class Trace>
using Tampering = std::pair<std::string, std::function<void(Trace&)>>;

/// For each variation of cfg, a trace made by a layer so configured (make_trace(other)) is
/// refused by backward(trace)() with a ConfigError naming `where`, the trace and the setting.
template <class Config, class MakeTrace, class Backward, class Snap>
void require_foreign_refused(const Config& cfg, const std::vector<Variation<Config>>& variations,
                             const MakeTrace& make_trace, const Backward& backward,
                             const Snap& snap, const char* where) {
    for (const auto& v : variations) {
        Config other = cfg;
        v.change(other);
        INFO("setting " << v.name);
        require_refused<ConfigError>(backward(make_trace(other)), snap, {where, "trace", v.name});
    }
}

/// Each tampering of a copy of `trace` is refused by backward(trace)() with an E naming
/// `where` and its text; so are a default-constructed and a moved-from trace. Returns the
/// trace the move filled.
template <class E, class Trace, class Backward, class Snap>
Trace require_tampered_refused(const Trace& trace, const std::vector<Tampering<Trace>>& tampered,
                               const Backward& backward, const Snap& snap,
                               const std::string& where) {
    for (const auto& [text, change] : tampered) {
        Trace t = trace;
        change(t);
        INFO("tampered: " << text);
        require_refused<E>(backward(t), snap, {where, text});
    }
    require_refused<ShapeError>(backward(Trace{}), snap, {where + ": trace is empty"});
    Trace moved = trace, to = std::move(moved);
    CHECK(moved.empty());
    require_refused<ShapeError>(backward(moved), snap, {where + ": trace is empty"});
    return to;
}

// RMSNorm: a trace of a norm with another eps or width, a default and a moved-from trace.
TEMPLATE_TEST_CASE("traces: RMSNorm foreign", "[train][traces]",
                   float, double) {
    using T = TestType;
    Rng rng(seed_for("traces: RMSNorm"));
    const int d = 6;
    const titans::RMSNorm<T> norm(d), other_eps(d, 1e-3), wide(d + 1);
    const Matrix<T> x = trace_test_matrix<T>(5, d, rng), dy = trace_test_matrix<T>(5, d, rng);
    Matrix<T> y, dx = trace_test_matrix<T>(2, 3, rng);
    RowVector<T> grad = trace_test_matrix<T>(1, d, rng);
    const auto snap = [&] {
        Bits b;
        add_trace_bits(b, grad);
        add_trace_bits(b, dx);
        return b;
    };
    typename titans::RMSNorm<T>::Trace trace, foreign, wider, none;
    norm.forward(x, y, trace);
    other_eps.forward(x, y, foreign);
    wide.forward(trace_test_matrix<T>(5, d + 1, rng), y, wider);
    const auto backward = [&](const auto& tr) { return [&] { norm.backward(tr, dy, dx, grad); }; };
    require_refused<ConfigError>(backward(foreign), snap, {"RMSNorm::backward", "trace", "eps"});
    require_refused<ShapeError>(backward(wider), snap, {"trace", "expected d = 6"});
    require_refused<ShapeError>(backward(none), snap, {"trace is empty"});
    auto moved = std::move(trace);
    CHECK(trace.empty());
    require_refused<ShapeError>(backward(trace), snap, {"trace is empty"});
    typename titans::RMSNorm<T>::Trace assigned;
    assigned = std::move(moved);
    CHECK(moved.empty());
    require_refused<ShapeError>(backward(moved), snap, {"trace is empty"});
    const auto copy = assigned;  // a copy is the same trace
    Matrix<T> dx2;
    RowVector<T> grad2 = grad;
    norm.backward(assigned, dy, dx, grad);
    norm.backward(copy, dy, dx2, grad2);
    CHECK(identical(dx, dx2));
    CHECK(identical(grad, grad2));
}

// FeedForward: a trace of a feed-forward of the same width with another kind or hidden size (its
// pre-activations of another width: a heap overflow before), default and moved-from traces,
// and gradients of another hidden size.
TEMPLATE_TEST_CASE("traces: FFN foreign",
                   "[train][traces]", float, double) {
    using T = TestType;
    Rng rng(seed_for("traces: FeedForward"));
    const FeedForwardConfig cfg{.d_model = 6, .kind = FeedForwardKind::SwiGLU, .hidden = 10};
    const titans::FeedForward<T> ff(cfg, FeedForwardParams<T>::random(cfg, 3));
    const Matrix<T> x = trace_test_matrix<T>(5, 6, rng), dy = trace_test_matrix<T>(5, 6, rng);
    Matrix<T> y, dx = trace_test_matrix<T>(3, 2, rng);
    FeedForwardParams<T> grads = FeedForwardParams<T>::random(cfg, 9);
    const auto snap = [&] { return trace_test_bits(grads, cfg, dx); };
    const auto backward = [&](const auto& tr) { return [&] { ff.backward(tr, dy, dx, grads); }; };
    typename titans::FeedForward<T>::Trace trace;
    ff.forward(x, y, trace);
    const std::vector<Variation<FeedForwardConfig>> variations{
        {"kind", [](FeedForwardConfig& c) { c.kind = FeedForwardKind::GELU; }},
        {"kind", [](FeedForwardConfig& c) { c.kind = FeedForwardKind::GELU, c.hidden = 0; }},
        {"hidden", [](FeedForwardConfig& c) { c.hidden = 12; }},
        {"hidden", [](FeedForwardConfig& c) { c.hidden = 0; }},  // 16: another width
    };
    const auto make_trace = [&](const FeedForwardConfig& other) {
        const titans::FeedForward<T> made(other, FeedForwardParams<T>::random(other, 4));
        typename titans::FeedForward<T>::Trace foreign;
        made.forward(x, y, foreign);
        return foreign;
    };
    require_foreign_refused(cfg, variations, make_trace, backward, snap, "FeedForward::backward");
    const auto moved =
        require_tampered_refused<ShapeError>(trace, {}, backward, snap, "FeedForward::backward");
    const FeedForwardConfig wider{.d_model = 6, .kind = FeedForwardKind::SwiGLU, .hidden = 12};
    auto other_grads = FeedForwardParams<T>::zeros(wider);
    const auto other_snap = [&] { return trace_test_bits(other_grads, wider, dx); };
    require_refused<ShapeError>([&] { ff.backward(moved, dy, dx, other_grads); }, other_snap,
                                {"grads"});
    ff.backward(moved, dy, dx, grads);
    CHECK(dx.rows() == 5);
}

/// An attention trace from a state two tokens in (kept rows), with a prefix of 3 rows.
template <class T>
typename titans::Attention<T>::Trace attention_trace(const titans::Attention<T>& attn,
                                                     const Matrix<T>& x, const Matrix<T>& prefix,
                                                     PrefixSharing sharing, Rng& rng) {
    auto st = attn.make_state(2);
    Matrix<T> y;
    attn.forward(st, trace_test_matrix<T>(4, attn.config().d_model, rng), y, &prefix, sharing);
    typename titans::Attention<T>::Trace trace;
    attn.forward(st, x, y, trace, &prefix, sharing);
    return trace;
}

// Attention: a trace of an attention of the same width with other heads, head width, window or
// RoPE; traces whose batch, rows, start, prefix or kept window were changed; default and
// moved-from traces; gradients of another head width.
TEMPLATE_TEST_CASE("traces: attention foreign",
                   "[train][traces]", float, double) {
    using T = TestType;
    Rng rng(seed_for("traces: Attention"));
    const AttentionConfig cfg{.d_model = 8, .n_heads = 2, .window = 3, .rope = true};
    const titans::Attention<T> attn(cfg, AttentionParams<T>::random(cfg, 5));
    const Matrix<T> x = trace_test_matrix<T>(2 * 3, 8, rng), dy = trace_test_matrix<T>(6, 8, rng);
    const Matrix<T> prefix = trace_test_matrix<T>(4, 8, rng);
    Matrix<T> dx = trace_test_matrix<T>(2, 2, rng);
    AttentionParams<T> grads = AttentionParams<T>::random(cfg, 6);
    const auto snap = [&] { return trace_test_bits(grads, cfg, dx); };
    const auto backward = [&](const auto& tr) {
        return [&] { attn.backward(tr, dy, dx, grads); };
    };
    using Trace = typename titans::Attention<T>::Trace;
    const Trace trace = attention_trace(attn, x, prefix, PrefixSharing::PerSequence, rng);
    const std::vector<Variation<AttentionConfig>> variations{
        {"n_heads", [](AttentionConfig& c) { c.n_heads = 4; }},
        {"d_head", [](AttentionConfig& c) { c.d_head = 2; }},
        {"window", [](AttentionConfig& c) { c.window = 5; }},
        {"rope", [](AttentionConfig& c) { c.rope = false; }},
        {"rope_base", [](AttentionConfig& c) { c.rope_base = 100.0; }},
    };
    const auto make_trace = [&](const AttentionConfig& other) {
        const titans::Attention<T> made(other, AttentionParams<T>::random(other, 7));
        return attention_trace(made, x, prefix, PrefixSharing::PerSequence, rng);
    };
    require_foreign_refused(cfg, variations, make_trace, backward, snap, "Attention::backward");
    const std::vector<Tampering<Trace>> tampered{
        {"trace.rows", [](Trace& t) { t.x.conservativeResize(5, 8); }},
        {"trace.kept_k.size()", [](Trace& t) { t.batch = 1; }},
        {"trace.batch", [](Trace& t) { t.batch = 0; }},
        {"trace.start", [](Trace& t) { t.start = -1; }},
        {"trace.kept_k shape", [](Trace& t) { t.start = 1; }},
        {"trace.kept_k.size()", [](Trace& t) { t.kept_k.pop_back(); }},
        {"trace.kept_v shape", [](Trace& t) { t.kept_v[1].conservativeResize(1, 8); }},
        {"trace.prefix.cols()", [](Trace& t) { t.prefix.conservativeResize(4, 7); }},
        {"trace.prefix.rows()", [](Trace& t) { t.prefix.conservativeResize(3, 8); }},
        {"trace.sharing", [](Trace& t) { t.sharing = static_cast<PrefixSharing>(5); }},
        {"trace holds 7-column rows", [](Trace& t) { t.x.conservativeResize(6, 7); }},
    };
    const Trace to =
        require_tampered_refused<ShapeError>(trace, tampered, backward, snap, "Attention::backward");
    const AttentionConfig other{.d_model = 8, .n_heads = 2, .d_head = 2, .window = 3, .rope = true};
    auto other_grads = AttentionParams<T>::zeros(other);
    const auto other_snap = [&] { return trace_test_bits(other_grads, other, dx); };
    require_refused<ShapeError>([&] { attn.backward(to, dy, dx, other_grads); }, other_snap,
                                {"grads"});
    attn.backward(to, dy, dx, grads);
    CHECK(dx.rows() == 6);
}

/// The base memory of the memory test: chunks of 2, a conv, gates per token, depth 2.
inline MemoryConfig trace_test_memory_config() {
    MemoryConfig c{.d_model = 8, .n_heads = 2, .depth = 2, .expansion = 2};
    c.use_conv = true;
    c.conv_kernel = 2;
    c.gates = GateMode::DataDependent;
    c.chunk = 2;
    return c;
}

/// A memory trace of 2 sequences of 5 tokens from a fresh state (start 0) or, if `later`, one
/// a chunk in (start 2).
template <class T>
typename NeuralMemory<T>::Trace memory_trace(const NeuralMemory<T>& mem, const Matrix<T>& x,
                                             bool later, Rng& rng) {
    auto st = mem.make_state(2);
    Matrix<T> y;
    if (later) {
        mem.forward(st, trace_test_matrix<T>(2 * 2, mem.config().d_model, rng), y);
    }
    typename NeuralMemory<T>::Trace trace;
    mem.forward(st, x, y, trace);
    return trace;
}

// NeuralMemory: a trace of a memory of the same width with any other setting (depth, heads,
// head width, expansion, chunk, conv, gates, update, retrieval, activation, ...); traces whose
// batch, rows, start, conv tails, products, logits or chunk-start memory were changed; default
// and moved-from traces; gradients of another depth or head count named `grads` (before, a
// message about MemoryParams::tensors).
TEMPLATE_TEST_CASE("traces: memory foreign",
                   "[train][traces]", float, double) {
    using T = TestType;
    Rng rng(seed_for("traces: NeuralMemory"));
    const MemoryConfig cfg = trace_test_memory_config();
    const NeuralMemory<T> mem(cfg, MemoryParams<T>::random(cfg, 5));
    const Matrix<T> x = trace_test_matrix<T>(2 * 5, 8, rng), dy = trace_test_matrix<T>(10, 8, rng);
    Matrix<T> dx = trace_test_matrix<T>(2, 2, rng);
    MemoryParams<T> grads = MemoryParams<T>::random(cfg, 6);
    const auto snap = [&] { return trace_test_bits(grads, cfg, dx); };
    const auto backward = [&](const auto& tr) { return [&] { mem.backward(tr, dy, dx, grads); }; };
    using Trace = typename NeuralMemory<T>::Trace;
    const Trace trace = memory_trace(mem, x, true, rng);
    const std::vector<Variation<MemoryConfig>> variations{
        {"depth", [](MemoryConfig& c) { c.depth = 1; }},
        {"n_heads", [](MemoryConfig& c) { c.n_heads = 4; }},
        {"d_head", [](MemoryConfig& c) { c.d_head = 3; }},
        {"expansion", [](MemoryConfig& c) { c.expansion = 1; }},
        {"chunk", [](MemoryConfig& c) { c.chunk = 4; }},
        {"use_conv", [](MemoryConfig& c) { c.use_conv = false; }},
        {"conv_kernel", [](MemoryConfig& c) { c.conv_kernel = 3; }},
        {"gates", [](MemoryConfig& c) { c.gates = GateMode::Constant; }},
        {"gates", [](MemoryConfig& c) { c.gates = GateMode::PerChunk; }},
        {"update", [](MemoryConfig& c) { c.update = UpdateMode::PerToken; }},
        {"retrieval", [](MemoryConfig& c) { c.retrieval = Retrieval::InChunk; }},
        {"activation", [](MemoryConfig& c) { c.activation = Activation::GELU; }},
        {"residual", [](MemoryConfig& c) { c.residual = true; }},
        {"theta_max", [](MemoryConfig& c) { c.theta_max = 0.02; }},
        {"max_grad_norm", [](MemoryConfig& c) { c.max_grad_norm = 3.0; }},
    };
    const auto make_trace = [&](const MemoryConfig& other) {
        return memory_trace(NeuralMemory<T>(other, MemoryParams<T>::random(other, 7)), x, false,
                            rng);
    };
    require_foreign_refused(cfg, variations, make_trace, backward, snap, "NeuralMemory::backward");
    {  // flush_denormals changes no stored value: a trace of such a memory is this memory's
        MemoryConfig flushing = cfg;
        flushing.flush_denormals = !cfg.flush_denormals;
        const NeuralMemory<T> made(flushing, mem.params());
        Matrix<T> dx_own, dx_other;
        auto g_own = MemoryParams<T>::zeros(cfg), g_other = g_own;
        mem.backward(memory_trace(mem, x, false, rng), dy, dx_own, g_own);
        mem.backward(memory_trace(made, x, false, rng), dy, dx_other, g_other);
        CHECK(identical(dx_own, dx_other));
    }
    const std::vector<Tampering<Trace>> tampered{
        {"trace.rows", [](Trace& t) { t.x.conservativeResize(9, 8); }},
        {"trace.tail_in.size()", [](Trace& t) { t.batch = 5; }},
        {"trace.batch", [](Trace& t) { t.batch = -1; }},
        {"trace.start", [](Trace& t) { t.start = 1; }},  // not at a chunk boundary
        {"trace.start", [](Trace& t) { t.start = -2; }},
        {"trace.tail_in.size()", [](Trace& t) { t.tail_in.pop_back(); }},
        {"trace.tail_in shape", [](Trace& t) { t.tail_in[1].resize(2, 24); }},
        {"trace.kept.u shape", [](Trace& t) { t.kept.u.conservativeResize(9, 24); }},
        {"trace.kept.logits shape", [](Trace& t) { t.kept.logits.resize(10, 5); }},
        {"trace.kept.memory.size()", [](Trace& t) { t.kept.memory.pop_back(); }},
        {"trace.kept.memory[i].size()", [](Trace& t) { t.kept.memory[1].pop_back(); }},
        {"trace.kept.memory[i][j] shape", [](Trace& t) { t.kept.memory[3][1].resize(1, 1); }},
    };
    const Trace to = require_tampered_refused<ShapeError>(trace, tampered, backward, snap,
                                                          "NeuralMemory::backward");
    for (const MemoryConfig& other : {MemoryConfig{.d_model = 8, .n_heads = 2, .depth = 1},
                                      MemoryConfig{.d_model = 8, .n_heads = 1, .depth = 2}}) {
        auto other_grads = MemoryParams<T>::zeros(other);
        const auto other_snap = [&] { return trace_test_bits(other_grads, other, dx); };
        INFO("grads of depth " << other.depth << ", heads " << other.n_heads);
        require_refused<ShapeError>([&] { mem.backward(to, dy, dx, other_grads); }, other_snap,
                                    {"NeuralMemory::backward: grads", "n_heads x depth = 2 x 2"});
        CHECK_THROWS_WITH(mem.backward(to, dy, dx, other_grads),
                          !TITANS_CONTAINS("MemoryParams::tensors"));
    }
    mem.backward(to, dy, dx, grads);
    CHECK(dx.rows() == 10);
}

/// The base block of a kind for the block tests: d = 8, 2 heads, memory depth 1 with chunks of
/// 2, window / segment 4, 2 persistent tokens, a SwiGLU feed-forward of hidden width 12.
inline BlockConfig trace_test_block_config(BlockKind kind) {
    BlockConfig c = BlockConfig::make(kind, 8, 2, 1, 4, 2);
    c.n_persistent = 2;
    c.ffn.hidden = 12;
    return c;
}

/// A block trace of 2 sequences of 3 tokens from a fresh state or, if `later`, from one two
/// tokens in (a memory chunk boundary for every kind; MAC then starts mid-segment).
template <class T>
typename titans::Block<T>::Trace block_trace(const titans::Block<T>& block, bool later,
                                             Rng& rng) {
    auto st = block.make_state(2);
    Matrix<T> y;
    if (later) {
        y = block.forward(st, trace_test_matrix<T>(2 * 2, 8, rng));
    }
    typename titans::Block<T>::Trace trace;
    block.forward(st, trace_test_matrix<T>(2 * 3, 8, rng), y, trace);
    return trace;
}

/// The changes a block trace's internal sizes can suffer, each with the text its refusal
/// names, for a block of `kind` whose trace started two tokens in.
template <class T>
std::vector<Tampering<typename titans::Block<T>::Trace>> block_tamperings(
    BlockKind kind, const titans::Block<T>& block, Rng& rng) {
    using Trace = typename titans::Block<T>::Trace;
    const BlockConfig& cfg = block.config();
    std::vector<Tampering<Trace>> out{
        {"trace.norm_mix.rows()", [](Trace& t) { t.rows += 2; }},
        {"trace.rows", [](Trace& t) { t.batch = 4; }},
        {"trace.start", [](Trace& t) { t.start = -1; }},
        {"(trace.norm_ffn): trace is empty", [](Trace& t) { t.norm_ffn = {}; }},
    };
    const titans::FeedForward<T> ffn(cfg.ffn, block.params().ffn);
    typename titans::FeedForward<T>::Trace shorter;  // the block's ffn over other rows
    Matrix<T> y;
    ffn.forward(trace_test_matrix<T>(4, 8, rng), y, shorter);
    out.emplace_back("trace.ffn.rows()", [shorter](Trace& t) { t.ffn = shorter; });
    if (titans::has_memory(kind)) {
        out.emplace_back("(trace.memory): trace is empty",
                         [](Trace& t) { auto gone = std::move(t.memory); });
        MemoryConfig deeper = cfg.memory;
        deeper.depth = 2;
        const NeuralMemory<T> other(deeper, MemoryParams<T>::random(deeper, 3));
        auto st = other.make_state(2);
        typename NeuralMemory<T>::Trace foreign;
        other.forward(st, trace_test_matrix<T>(6, 8, rng), y, foreign);
        out.emplace_back("(trace.memory): trace was made by a memory of another configuration",
                         [foreign](Trace& t) { t.memory = foreign; });
    }
    if (kind == BlockKind::MAG || kind == BlockKind::SWA) {
        out.emplace_back("trace.attention.prefix.rows()",
                         [](Trace& t) { t.attention.prefix.conservativeResize(1, 8); });
    }
    if (kind == BlockKind::MAG) {
        out.emplace_back("trace.a shape", [](Trace& t) { t.a.conservativeResize(5, 8); });
        out.emplace_back("trace.gate shape", [](Trace& t) { t.gate.conservativeResize(6, 7); });
        out.emplace_back("(trace.norm_y): trace is empty", [](Trace& t) { t.norm_y = {}; });
    }
    if (titans::has_window(kind)) {
        out.emplace_back("(trace.attention): trace.kept_k.size()",
                         [](Trace& t) { t.attention.kept_k.pop_back(); });
    }
    if (kind == BlockKind::MAC) {
        out.emplace_back("trace.u shape", [](Trace& t) { t.u.conservativeResize(5, 8); });
        out.emplace_back("trace.segments", [](Trace& t) { t.segments.pop_back(); });
        out.emplace_back("trace.segments[0].t0, offset",
                         [](Trace& t) { t.segments[0].offset = 0; });
        out.emplace_back("trace.segments[1].h, y, r",
                         [](Trace& t) { t.segments[1].r.conservativeResize(1, 8); });
        out.emplace_back("trace.segments[0].kept_k, kept_v shape",
                         [](Trace& t) { t.segments[0].kept_v.conservativeResize(3, 8); });
        out.emplace_back("trace.segments[0].kept_k, kept_v shape",
                         [](Trace& t) { t.segments[0].kept_k.resize(1, 8); });
        out.emplace_back("trace.segments[1].weights.pairs()",
                         [](Trace& t) { t.segments[1].weights.weights.pop_back(); });
    }
    return out;
}

// Blocks of every kind: a trace of a block of the same width with any other setting (kind,
// feed-forward hidden size and kind, use_ffn, memory depth, heads, chunk, window, persistent
// tokens, segment, norm eps); traces whose sizes or sub-layer traces were changed; default and
// moved-from traces; gradients of another memory depth named `grads`.
TEMPLATE_TEST_CASE("traces: block foreign", "[train][traces]",
                   float, double) {
    using T = TestType;
    for (const BlockKind kind : titans::all_block_kinds) {
        Rng rng(seed_for("traces: Block", static_cast<std::uint64_t>(kind)));
        const BlockConfig cfg = trace_test_block_config(kind);
        const titans::Block<T> block(cfg, BlockParams<T>::random(cfg, 5));
        using Trace = typename titans::Block<T>::Trace;
        const Trace later = block_trace(block, true, rng), fresh = block_trace(block, false, rng);
        const Matrix<T> dy = trace_test_matrix<T>(6, 8, rng);
        Matrix<T> dx = trace_test_matrix<T>(2, 2, rng);
        BlockParams<T> grads = BlockParams<T>::random(cfg, 6);
        const auto snap = [&] { return trace_test_bits(grads, cfg, dx); };
        const auto backward = [&](const auto& tr) {
            return [&] { block.backward(tr, dy, dx, grads); };
        };
        std::vector<Variation<BlockConfig>> variations{
            {"kind", [kind](BlockConfig& c) {
                 c = trace_test_block_config(kind == BlockKind::MAG ? BlockKind::MAL
                                                                    : BlockKind::MAG);
             }},
            {"ffn.hidden", [](BlockConfig& c) { c.ffn.hidden = 16; }},
            {"ffn.kind", [](BlockConfig& c) { c.ffn.kind = FeedForwardKind::GELU; }},
            {"use_ffn", [](BlockConfig& c) { c.use_ffn = false; }},
            {"attention.window", [](BlockConfig& c) { c.attention.window = 3; }},
            {"attention.n_heads", [](BlockConfig& c) { c.attention.n_heads = 1; }},
            {"n_persistent", [](BlockConfig& c) { c.n_persistent = 3; }},
            {"norm_eps", [](BlockConfig& c) { c.norm_eps = 1e-5; }},
        };
        if (titans::has_memory(kind)) {  // SWA uses neither its memory nor its segment
            variations.push_back({"memory.depth", [](BlockConfig& c) { c.memory.depth = 2; }});
            variations.push_back({"memory.n_heads", [](BlockConfig& c) { c.memory.n_heads = 1; }});
            variations.push_back({"memory.chunk", [](BlockConfig& c) { c.memory.chunk = 1; }});
            variations.push_back({"segment", [](BlockConfig& c) { c.segment = 3; }});
        }
        INFO("kind " << titans::to_string(kind));
        const auto make_trace = [&](const BlockConfig& other) {
            return block_trace(titans::Block<T>(other, BlockParams<T>::random(other, 7)), false,
                               rng);
        };
        require_foreign_refused(cfg, variations, make_trace, backward, snap, "Block::backward");
        require_tampered_refused<titans::Error>(later, block_tamperings<T>(kind, block, rng),
                                                backward, snap, "Block::backward");
        if (kind == BlockKind::MAG || kind == BlockKind::MAL) {  // P's rows: not in the memory's
            Trace t = fresh;
            t.start = 2;
            require_refused<ShapeError>(backward(t), snap, {"trace.memory.rows()"});
        }
        const Trace to = fresh;
        BlockConfig deeper = cfg;
        deeper.memory.depth = 2;
        deeper.ffn.hidden = 16;  // what SWA's gradients can differ in
        auto other_grads = BlockParams<T>::zeros(deeper);
        const auto other_snap = [&] { return trace_test_bits(other_grads, deeper, dx); };
        require_refused<ShapeError>([&] { block.backward(to, dy, dx, other_grads); }, other_snap,
                                    {"Block::backward: grads"});
        block.backward(to, dy, dx, grads);
        block.backward(later, dy, dx, grads);
        CHECK(dx.rows() == 6);
    }
}

/// The base model of the model tests: vocabulary 11, d = 8, a MAG block then a MAC block.
inline ModelConfig trace_test_model_config() {
    ModelConfig c;
    c.vocab_size = 11;
    c.d_model = 8;
    c.blocks = {trace_test_block_config(BlockKind::MAG), trace_test_block_config(BlockKind::MAC)};
    return c;
}

/// A model trace of 2 sequences of 3 tokens (forward_tokens with a vocabulary, else forward),
/// the first id the vocabulary's last.
template <class T>
typename titans::Model<T>::Trace model_trace(const titans::Model<T>& model, Rng& rng) {
    const ModelConfig& cfg = model.config();
    auto st = model.make_state(2);
    Matrix<T> out;
    typename titans::Model<T>::Trace trace;
    if (cfg.vocab_size == 0) {
        model.forward(st, trace_test_matrix<T>(6, cfg.d_model, rng), out, trace);
        return trace;
    }
    std::vector<int> ids(6);
    for (int& id : ids) id = uniform_int(rng, 0, cfg.vocab_size - 1);
    ids[0] = cfg.vocab_size - 1;
    model.forward_tokens(st, ids, out, trace);
    return trace;
}

// The model: a trace of a model of the same width with another vocabulary (its token ids past
// this embedding: an out-of-bounds write of the embedding's gradient before), other block
// kinds, feed-forward width or kind, heads, depth, eps or block count, or without a vocabulary;
// traces whose token ids, blocks or sizes were changed; default and moved-from traces;
// gradients of another block count or memory depth named `grads`.
TEMPLATE_TEST_CASE("traces: model foreign", "[train][traces]",
                   float, double) {
    using T = TestType;
    Rng rng(seed_for("traces: Model"));
    const ModelConfig cfg = trace_test_model_config();
    const titans::Model<T> model(cfg, ModelParams<T>::random(cfg, 5));
    using Trace = typename titans::Model<T>::Trace;
    const Trace trace = model_trace(model, rng);
    const Matrix<T> dout = trace_test_matrix<T>(6, 11, rng);
    Matrix<T> dx = trace_test_matrix<T>(2, 2, rng);
    ModelParams<T> grads = ModelParams<T>::random(cfg, 6);
    const auto snap = [&] { return trace_test_bits(grads, cfg, dx); };
    const auto backward = [&](const auto& tr) {
        return [&] { model.backward(tr, dout, grads, &dx); };
    };
    const std::vector<Variation<ModelConfig>> variations{
        {"vocab_size", [](ModelConfig& c) { c.vocab_size = 13; }},
        {"vocab_size", [](ModelConfig& c) { c.vocab_size = 0, c.d_out = 11; }},
        {"blocks.0.kind",
         [](ModelConfig& c) { c.blocks[0] = trace_test_block_config(BlockKind::LMM); }},
        {"blocks.1.ffn.hidden", [](ModelConfig& c) { c.blocks[1].ffn.hidden = 16; }},
        {"blocks.0.ffn.kind", [](ModelConfig& c) { c.blocks[0].ffn.kind = FeedForwardKind::GELU; }},
        {"blocks.1.attention.n_heads", [](ModelConfig& c) { c.blocks[1].attention.n_heads = 1; }},
        {"blocks.0.memory.depth", [](ModelConfig& c) { c.blocks[0].memory.depth = 2; }},
        {"norm_eps", [](ModelConfig& c) { c.norm_eps = 1e-5; }},
        {"3 blocks", [](ModelConfig& c) { c.blocks.push_back(c.blocks[0]); }},
    };
    const auto make_trace = [&](const ModelConfig& other) {
        return model_trace(titans::Model<T>(other, ModelParams<T>::random(other, 7)), rng);
    };
    require_foreign_refused(cfg, variations, make_trace, backward, snap, "Model::backward");
    const std::vector<Tampering<Trace>> tampered{
        {"trace.ids[0] = 11", [](Trace& t) { t.ids[0] = 11; }},
        {"trace.ids[5] = -1", [](Trace& t) { t.ids[5] = -1; }},
        {"trace.ids.size()", [](Trace& t) { t.ids.pop_back(); }},
        {"trace.blocks.size()", [](Trace& t) { t.blocks.pop_back(); }},
        {"trace.blocks[0] rows, batch, start", [](Trace& t) { t.rows = 4; }},
        {"(trace.blocks[1]): trace is empty", [](Trace& t) { t.blocks[1] = {}; }},
        {"trace.normed shape", [](Trace& t) { t.normed.conservativeResize(6, 7); }},
        {"(trace.norm_final): trace is empty", [](Trace& t) { t.norm_final = {}; }},
        {"trace.batch", [](Trace& t) { t.batch = 0; }},
    };
    const Trace to =
        require_tampered_refused<ShapeError>(trace, tampered, backward, snap, "Model::backward");
    {  // token ids in the trace of a model without a vocabulary
        ModelConfig vectors = cfg;
        vectors.vocab_size = 0;
        vectors.d_out = 11;
        const titans::Model<T> plain(vectors, ModelParams<T>::random(vectors, 8));
        Trace t = model_trace(plain, rng);
        t.ids.assign(6, 0);
        auto g = ModelParams<T>::zeros(vectors);
        const auto plain_snap = [&] { return trace_test_bits(g, vectors, dx); };
        require_refused<ShapeError>([&] { plain.backward(t, dout, g, &dx); }, plain_snap,
                                    {"trace.ids.size()", "a model without a vocabulary"});
    }
    ModelConfig more = cfg;
    more.blocks.push_back(cfg.blocks[1]);
    ModelConfig deeper = cfg;
    deeper.blocks[1].memory.depth = 2;
    for (const ModelConfig& other : {more, deeper}) {
        auto other_grads = ModelParams<T>::zeros(other);
        const auto other_snap = [&] { return trace_test_bits(other_grads, other, dx); };
        require_refused<ShapeError>([&] { model.backward(to, dout, other_grads, &dx); },
                                    other_snap, {"Model::backward: grads"});
        CHECK_THROWS_WITH(model.backward(to, dout, other_grads, &dx),
                          !TITANS_CONTAINS("Params::tensors"));
    }
    model.backward(to, dout, grads, &dx);
    CHECK(dx.rows() == 6);
}

}  // namespace traces_test
