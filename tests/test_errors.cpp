// Every error path of the public API throws the documented type (titans::ConfigError,
// ShapeError or NonFiniteError, all derived from titans::Error) with a message naming the
// offending argument; a rejected call leaves the state untouched.
#include "test_common.hpp"

#include <functional>

using namespace titans_test;
using titans::ConfigError;
using titans::NonFiniteError;
using titans::ShapeError;

namespace {

/// A small valid configuration exercising every tensor (conv on, data-dependent gates).
MemoryConfig valid_config() {
    MemoryConfig c;
    c.d_model = 8;
    c.n_heads = 2;
    c.depth = 2;
    c.expansion = 2;
    c.chunk = 3;
    c.use_conv = true;
    c.conv_kernel = 3;
    c.gates = GateMode::DataDependent;
    return c;
}

/// cfg.validate(), MemoryParams::random(cfg) and the NeuralMemory constructor all reject cfg.
void require_config_error(const MemoryConfig& cfg, const char* field) {
    INFO("field " << field);
    REQUIRE_THROWS_NAMING(cfg.validate(), ConfigError, field);
    REQUIRE_THROWS_NAMING(titans::MemoryParamsd::random(cfg, 1), ConfigError, field);
    const titans::MemoryParamsd p = titans::MemoryParamsd::random(valid_config(), 1);
    REQUIRE_THROWS_NAMING(NeuralMemory<double>(cfg, p), ConfigError, field);
    REQUIRE_THROWS_NAMING(NeuralMemory<float>(cfg, cast_params<float>(p)), ConfigError, field);
}

}  // namespace

// the valid base configuration used by the error tests is accepted
TEST_CASE("errors: base config is valid", "[errors]") {
    const MemoryConfig c = valid_config();
    REQUIRE_NOTHROW(c.validate());
    REQUIRE_NOTHROW(NeuralMemory<double>(c, titans::MemoryParamsd::random(c, 3)));
}

// invalid MemoryConfig fields throw ConfigError naming the field
TEST_CASE("errors: bad MemoryConfig fields", "[errors][config]") {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    const std::vector<std::pair<std::function<void(MemoryConfig&)>, const char*>> cases = {
        {[](MemoryConfig& c) { c.chunk = 0; }, "chunk"},
        {[](MemoryConfig& c) { c.chunk = -3; }, "chunk"},
        {[](MemoryConfig& c) { c.depth = 0; }, "depth"},
        {[](MemoryConfig& c) { c.d_model = 0; }, "d_model"},
        {[](MemoryConfig& c) { c.n_heads = 0; }, "n_heads"},
        {[](MemoryConfig& c) { c.d_model = 10; c.n_heads = 3; c.d_head = 0; }, "d_model"},
        {[](MemoryConfig& c) { c.d_head = -1; }, "d_head"},
        {[](MemoryConfig& c) { c.expansion = 0; }, "expansion"},
        {[](MemoryConfig& c) { c.conv_kernel = 0; }, "conv_kernel"},
        {[](MemoryConfig& c) { c.constant_theta = -0.1; }, "constant_theta"},
        {[nan](MemoryConfig& c) { c.constant_theta = nan; }, "constant_theta"},
        {[inf](MemoryConfig& c) { c.constant_theta = inf; }, "constant_theta"},
        {[](MemoryConfig& c) { c.constant_eta = 1.5; }, "constant_eta"},
        {[](MemoryConfig& c) { c.constant_eta = -0.1; }, "constant_eta"},
        {[nan](MemoryConfig& c) { c.constant_eta = nan; }, "constant_eta"},
        {[](MemoryConfig& c) { c.constant_alpha = 1.01; }, "constant_alpha"},
        {[](MemoryConfig& c) { c.constant_alpha = -0.01; }, "constant_alpha"},
        {[nan](MemoryConfig& c) { c.constant_alpha = nan; }, "constant_alpha"},
        {[](MemoryConfig& c) { c.theta_max = -0.1; }, "theta_max"},
        {[nan](MemoryConfig& c) { c.theta_max = nan; }, "theta_max"},
        {[inf](MemoryConfig& c) { c.theta_max = inf; }, "theta_max"},
        {[](MemoryConfig& c) { c.activation = Activation::Identity; }, "activation"},
        {[](MemoryConfig& c) { c.qkv_activation = Activation::GELU; }, "qkv_activation"},
        {[](MemoryConfig& c) {
             c.gates = GateMode::PerChunk;
             c.retrieval = Retrieval::InChunk;
         },
         "retrieval"},
        {[](MemoryConfig& c) {
             c.gates = GateMode::PerChunk;
             c.update = UpdateMode::PerToken;
         },
         "update"},
        {[](MemoryConfig& c) {
             c.gates = GateMode::PerChunk;
             c.update = UpdateMode::PerToken;
             c.retrieval = Retrieval::InChunk;
         },
         "PerChunk"},
    };
    for (const auto& [mutate, field] : cases) {
        MemoryConfig c = valid_config();
        mutate(c);
        require_config_error(c, field);
    }
}

// boundary values of the gate constants are accepted (eta, alpha in {0, 1}, theta = 0, theta_max =
// 0) and PerChunk gates work with Chunked + Lagged
TEST_CASE("errors: boundary gate values ok", "[errors][config]") {
    for (double v : {0.0, 1.0}) {
        MemoryConfig c = valid_config();
        c.gates = GateMode::Constant;
        c.constant_eta = v;
        c.constant_alpha = v;
        c.constant_theta = 0.0;
        c.theta_max = 0.0;
        REQUIRE_NOTHROW(c.validate());
    }
    MemoryConfig c = valid_config();
    c.gates = GateMode::PerChunk;
    c.update = UpdateMode::Chunked;
    c.retrieval = Retrieval::Lagged;
    REQUIRE_NOTHROW(c.validate());
}

// MemoryParams with a wrongly shaped tensor throw ShapeError naming it; a NaN or infinite entry
// throws NonFiniteError naming it
TEST_CASE("errors: bad MemoryParams tensors", "[errors][params]") {
    const MemoryConfig cfg = valid_config();
    const titans::MemoryParamsd good = titans::MemoryParamsd::random(cfg, 5);
    REQUIRE_NOTHROW(good.validate(cfg));
    using P = titans::MemoryParamsd;
    const std::vector<std::pair<std::function<Eigen::Ref<Matrixd>(P&)>, const char*>> dense = {
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_q; }, "w_q"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_k; }, "w_k"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_v; }, "w_v"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.conv_q; }, "conv_q"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.conv_k; }, "conv_k"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.conv_v; }, "conv_v"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_theta; }, "w_theta"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_eta; }, "w_eta"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_alpha; }, "w_alpha"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.memory_init[1][0]; }, "memory_init[1][0]"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.memory_init[0][1]; }, "memory_init[0][1]"},
        {[](P& p) -> Eigen::Ref<Matrixd> { return p.w_o; }, "w_o"},
    };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    for (const auto& [get, name] : dense) {
        INFO("tensor " << name);
        {  // NaN, then infinity, in the last entry.
            P p = good;
            Eigen::Ref<Matrixd> m = get(p);
            m(m.rows() - 1, m.cols() - 1) = nan;
            REQUIRE_THROWS_NAMING(p.validate(cfg), NonFiniteError, name);
            REQUIRE_THROWS_NAMING(NeuralMemory<double>(cfg, p), NonFiniteError, name);
            m(m.rows() - 1, m.cols() - 1) = -inf;
            REQUIRE_THROWS_NAMING(p.validate(cfg), NonFiniteError, name);
        }
    }
    // Wrong shapes: one row more, one column fewer.
    auto reshape = [](Matrixd& m, int dr, int dc) {
        m = Matrixd::Ones(m.rows() + dr, m.cols() + dc);
    };
    const std::vector<std::pair<std::function<void(P&)>, const char*>> shapes = {
        {[&](P& p) { reshape(p.w_q, 1, 0); }, "w_q"},
        {[&](P& p) { reshape(p.w_k, 0, -1); }, "w_k"},
        {[&](P& p) { reshape(p.w_v, -1, 0); }, "w_v"},
        {[&](P& p) { reshape(p.conv_q, 1, 0); }, "conv_q"},
        {[&](P& p) { reshape(p.conv_k, 0, 1); }, "conv_k"},
        {[&](P& p) { reshape(p.conv_v, -1, 0); }, "conv_v"},
        {[&](P& p) { reshape(p.w_theta, 0, 1); }, "w_theta"},
        {[&](P& p) { reshape(p.w_eta, 1, 0); }, "w_eta"},
        {[&](P& p) { reshape(p.w_alpha, 0, -1); }, "w_alpha"},
        {[](P& p) { p.b_theta = titans::RowVectord::Ones(3); }, "b_theta"},
        {[](P& p) { p.b_eta = titans::RowVectord::Ones(1); }, "b_eta"},
        {[](P& p) { p.b_alpha = titans::RowVectord::Ones(4); }, "b_alpha"},
        {[&](P& p) { reshape(p.memory_init[0][0], 1, 0); }, "memory_init[0][0]"},
        {[&](P& p) { reshape(p.memory_init[1][1], 0, 1); }, "memory_init[1][1]"},
        {[](P& p) { p.memory_init.pop_back(); }, "memory_init"},
        {[](P& p) { p.memory_init[0].pop_back(); }, "memory_init[0]"},
        {[&](P& p) { reshape(p.w_o, 0, 1); }, "w_o"},
    };
    for (const auto& [mutate, name] : shapes) {
        INFO("tensor " << name);
        P p = good;
        mutate(p);
        REQUIRE_THROWS_NAMING(p.validate(cfg), ShapeError, name);
        REQUIRE_THROWS_NAMING(NeuralMemory<double>(cfg, p), ShapeError, name);
        REQUIRE_THROWS_NAMING(NeuralMemory<float>(cfg, cast_params<float>(p)), ShapeError, name);
    }
    // A NaN in a gate bias.
    for (const char* name : {"b_theta", "b_eta", "b_alpha"}) {
        P p = good;
        titans::RowVectord& b = std::string(name) == "b_theta" ? p.b_theta
                                : std::string(name) == "b_eta" ? p.b_eta
                                                               : p.b_alpha;
        b(0) = nan;
        REQUIRE_THROWS_NAMING(p.validate(cfg), NonFiniteError, name);
    }
}

// unused tensors are not validated: conv taps without conv, gate weights with constant gates
TEST_CASE("errors: unused tensors unchecked", "[errors][params]") {
    MemoryConfig cfg = valid_config();
    cfg.use_conv = false;
    cfg.gates = GateMode::Constant;
    titans::MemoryParamsd p = titans::MemoryParamsd::random(cfg, 9);
    p.conv_q = Matrixd::Ones(1, 1);
    p.w_theta = Matrixd::Ones(2, 2);
    p.b_eta = titans::RowVectord::Ones(5);
    REQUIRE_NOTHROW(p.validate(cfg));
    REQUIRE_NOTHROW(NeuralMemory<double>(cfg, p));
}

// forward, read, make_state, current_weights and current_momentum reject bad arguments with the
// right error type and leave the state untouched
TEST_CASE("errors: bad forward arguments", "[errors][forward]") {
    const MemoryConfig cfg = valid_config();
    const titans::MemoryParamsd p = titans::MemoryParamsd::random(cfg, 11);
    NeuralMemory<double> mem(cfg, p);
    Rng rng(seed_for("errors-forward"));
    const int B = 2;
    auto st = mem.make_state(B);
    const Matrixd x0 = random_matrix(4 * B, cfg.d_model, rng);
    (void)mem.forward(st, x0);  // mid-chunk (chunk 3)
    const auto before = st;

    Matrixd bad_cols = random_matrix(2 * B, cfg.d_model + 1, rng);
    REQUIRE_THROWS_NAMING(mem.forward(st, bad_cols), ShapeError, "columns");
    REQUIRE_THROWS_NAMING(mem.forward(st, bad_cols), ShapeError, "d_model");
    REQUIRE_THROWS_NAMING(mem.read(st, bad_cols), ShapeError, "columns");
    Matrixd bad_rows = random_matrix(2 * B + 1, cfg.d_model, rng);
    REQUIRE_THROWS_NAMING(mem.forward(st, bad_rows), ShapeError, "rows");
    REQUIRE_THROWS_NAMING(mem.forward(st, bad_rows), ShapeError, "batch");
    REQUIRE_THROWS_NAMING(mem.read(st, bad_rows), ShapeError, "rows");
    Matrixd with_nan = random_matrix(2 * B, cfg.d_model, rng);
    with_nan(3, 2) = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_NAMING(mem.forward(st, with_nan), NonFiniteError, "x");
    REQUIRE_THROWS_NAMING(mem.read(st, with_nan), NonFiniteError, "x");
    Matrixd with_inf = random_matrix(2 * B, cfg.d_model, rng);
    with_inf(0, 0) = std::numeric_limits<double>::infinity();
    REQUIRE_THROWS_NAMING(mem.forward(st, with_inf), NonFiniteError, "x");
    Matrixd alias = random_matrix(2 * B, cfg.d_model, rng);
    REQUIRE_THROWS_NAMING(mem.forward(st, alias, alias), ShapeError, "share storage");
    REQUIRE_THROWS_NAMING(mem.forward(st, alias.bottomRows(B), alias), ShapeError, "share storage");

    // A state of another configuration, and a default-constructed state.
    MemoryConfig other = cfg;
    other.depth = 1;
    NeuralMemory<double> mem_other(other, titans::MemoryParamsd::random(other, 12));
    auto st_other = mem_other.make_state(B);
    const Matrixd x = random_matrix(2 * B, cfg.d_model, rng);
    REQUIRE_THROWS_NAMING(mem.forward(st_other, x), ConfigError, "state");
    REQUIRE_THROWS_NAMING(mem.read(st_other, x), ConfigError, "state");
    REQUIRE_THROWS_NAMING(mem.current_weights(st_other, 0, 0), ConfigError, "state");
    MemoryConfig other_chunk = cfg;
    other_chunk.chunk = 4;
    NeuralMemory<double> mem_chunk(other_chunk, p);
    auto st_chunk = mem_chunk.make_state(B);
    REQUIRE_THROWS_NAMING(mem.forward(st_chunk, x), ConfigError, "state");
    NeuralMemory<double>::State blank;
    REQUIRE_THROWS_NAMING(mem.forward(blank, x), ConfigError, "state");
    REQUIRE_THROWS_NAMING(mem.read(blank, x), ConfigError, "state");
    REQUIRE_THROWS_NAMING(mem.current_weights(blank, 0, 0), ConfigError, "state");
    REQUIRE_THROWS_NAMING(mem.current_momentum(blank, 0, 0), ConfigError, "state");

    REQUIRE_THROWS_NAMING(mem.make_state(0), ConfigError, "batch");
    REQUIRE_THROWS_NAMING(mem.make_state(-1), ConfigError, "batch");

    REQUIRE_THROWS_NAMING(mem.current_weights(st, B, 0), ShapeError, "b = ");
    REQUIRE_THROWS_NAMING(mem.current_weights(st, -1, 0), ShapeError, "b = ");
    REQUIRE_THROWS_NAMING(mem.current_weights(st, 0, cfg.n_heads), ShapeError, "h = ");
    REQUIRE_THROWS_NAMING(mem.current_weights(st, 0, -1), ShapeError, "h = ");
    REQUIRE_THROWS_NAMING(mem.current_momentum(st, B, 0), ShapeError, "b = ");
    REQUIRE_THROWS_NAMING(mem.current_momentum(st, 0, cfg.n_heads), ShapeError, "h = ");

    // Nothing above changed the state: it continues exactly like an untouched copy.
    CHECK(st.position() == before.position());
    auto untouched = before;
    const Matrixd x1 = random_matrix(5 * B, cfg.d_model, rng);
    CHECK(identical(mem.forward(st, x1), mem.forward(untouched, x1)));
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < cfg.n_heads; ++h)
            CHECK(rel_error(mem.current_weights(st, b, h), mem.current_weights(untouched, b, h)) == 0.0);
}

// memory_forward, associative_loss and associative_gradient reject mismatched shapes with
// ShapeError
TEST_CASE("errors: MLP function shapes", "[errors][mlp]") {
    Rng rng(seed_for("errors-mlp"));
    const std::vector<Matrixd> W{random_matrix(4, 8, rng), random_matrix(8, 4, rng)};
    const Matrixd k = random_matrix(3, 4, rng), v = random_matrix(3, 4, rng);
    const Activation act = Activation::SiLU;
    REQUIRE_NOTHROW(titans::associative_gradient<double>(W, k, v, act, false));
    // v of another shape.
    const Matrixd v_rows = random_matrix(2, 4, rng), v_cols = random_matrix(3, 5, rng);
    REQUIRE_THROWS_NAMING(titans::associative_gradient<double>(W, k, v_rows, act, false), ShapeError, "v");
    REQUIRE_THROWS_NAMING(titans::associative_gradient<double>(W, k, v_cols, act, false), ShapeError, "v");
    REQUIRE_THROWS_NAMING(titans::associative_loss<double>(W, k, v_rows, act, false), ShapeError, "v");
    REQUIRE_THROWS_NAMING(titans::associative_loss<double>(W, k, v_cols, act, false), ShapeError, "v");
    // k of the wrong width.
    const Matrixd k5 = random_matrix(3, 5, rng);
    REQUIRE_THROWS_NAMING(titans::associative_gradient<double>(W, k5, v_cols, act, false), ShapeError, "columns");
    REQUIRE_THROWS_NAMING(titans::memory_forward<double>(W, k5, act, false), ShapeError, "columns");
    REQUIRE_THROWS_AS(titans::associative_loss<double>(W, k5, v_cols, act, false), ShapeError);
    // Layers that do not chain, and no layers.
    const std::vector<Matrixd> W_bad{random_matrix(4, 8, rng), random_matrix(7, 4, rng)};
    REQUIRE_THROWS_NAMING(titans::associative_gradient<double>(W_bad, k, v, act, false), ShapeError, "W[1]");
    REQUIRE_THROWS_NAMING(titans::memory_forward<double>(W_bad, k, act, false), ShapeError, "W[1]");
    const std::vector<Matrixd> W_none;
    REQUIRE_THROWS_NAMING(titans::associative_gradient<double>(W_none, k, v, act, false), ShapeError, "W");
    REQUIRE_THROWS_NAMING(titans::memory_forward<double>(W_none, k, act, false), ShapeError, "W");
}

// a state is rejected by a memory whose configuration differs in a setting that shaped the state's
// pending rows or its write (activation, residual, q/k/v path, gate scale) - docs/errors.md: 'the
// state came from make_state of a memory with the same configuration'
TEST_CASE("errors: state of another config", "[errors][forward][state-config]") {
    // The state holds, for the chunk in progress, the activations A and back-propagated errors
    // Delta computed with the writing memory's activation, residual and q/k/v path, and gate
    // logits turned into gates at the chunk end with theta_max / constant gates: continuing it
    // with a memory that differs in any of these silently mixes two memories.
    const MemoryConfig base = valid_config();
    const std::vector<std::pair<std::function<void(MemoryConfig&)>, const char*>> changes = {
        {[](MemoryConfig& c) { c.activation = Activation::GELU; }, "activation"},
        {[](MemoryConfig& c) { c.residual = true; }, "residual"},
        {[](MemoryConfig& c) { c.qkv_activation = Activation::Identity; }, "qkv_activation"},
        {[](MemoryConfig& c) { c.normalize_qk = false; }, "normalize_qk"},
        {[](MemoryConfig& c) { c.theta_max = 0.05; }, "theta_max"},
    };
    Rng rng(seed_for("state-config-mismatch"));
    const titans::MemoryParamsd p = titans::MemoryParamsd::random(base, 21);
    const NeuralMemory<double> writer(base, p);
    auto st = writer.make_state(1);
    (void)writer.forward(st, random_matrix(4, base.d_model, rng));  // mid-chunk (chunk 3)
    const Matrixd x = random_matrix(2, base.d_model, rng);
    for (const auto& [change, field] : changes) {
        MemoryConfig other = base;
        change(other);
        const NeuralMemory<double> reader(other, p);
        auto copy = st;
        INFO("configurations differ in " << field);
        CHECK_THROWS_AS(static_cast<void>(reader.forward(copy, x)), ConfigError);
    }
    {
        MemoryConfig c1 = base, c2 = base;
        c1.gates = c2.gates = GateMode::Constant;
        c2.constant_theta = 0.5;
        const NeuralMemory<double> w1(c1, p), w2(c2, p);
        auto s1 = w1.make_state(1);
        (void)w1.forward(s1, random_matrix(4, base.d_model, rng));
        INFO("configurations differ in constant_theta");
        CHECK_THROWS_AS(static_cast<void>(w2.forward(s1, x)), ConfigError);
    }
}
