// A state is accepted only by an object that can continue it: every setting the state depends
// on is checked, and a refused state is left untouched.

#include "robust_common.hpp"

#include <functional>
#include <vector>

using namespace titans_test;
using titans::BlockConfig;
using titans::BlockKind;
using titans::ConfigError;

namespace {

using SettingEdit = std::function<void(BlockConfig&)>;

/// Every setting a block's state depends on, changed one at a time.
std::vector<std::pair<const char*, SettingEdit>> state_settings() {
    return {
        {"kind", [](BlockConfig& c) { c.kind = c.kind == BlockKind::MAG ? BlockKind::MAL : BlockKind::MAG; }},
        {"memory.chunk", [](BlockConfig& c) { c.memory.chunk += 1; }},
        {"memory.depth", [](BlockConfig& c) { c.memory.depth += 1; }},
        {"memory.theta_max", [](BlockConfig& c) { c.memory.theta_max *= 2; }},
        {"memory.max_grad_norm", [](BlockConfig& c) { c.memory.max_grad_norm = 0.5; }},
        {"memory.n_heads", [](BlockConfig& c) { c.memory.n_heads = 4; }},
        {"attention.n_heads", [](BlockConfig& c) { c.attention.n_heads = 4; }},
        {"attention.window", [](BlockConfig& c) { c.attention.window += 1; }},
        {"attention.rope", [](BlockConfig& c) { c.attention.rope = !c.attention.rope; }},
        {"attention.rope_base", [](BlockConfig& c) {
             c.attention.rope = true;
             c.attention.rope_base = 500.0;
         }},
        {"segment", [](BlockConfig& c) { c.segment += 1; }},
        {"n_persistent", [](BlockConfig& c) { c.n_persistent += 1; }},
    };
}

/// True if the setting `name` holds state for blocks of kind k (what a continuing block needs).
bool matters(const std::string& name, BlockKind k) {
    if (name == "kind") return true;
    if (name.rfind("memory.", 0) == 0) return titans::has_memory(k);  // SWA has none
    if (k == BlockKind::LMM) return false;
    if (name == "segment") return k == BlockKind::MAC;
    return true;
}

}  // namespace

TEST_CASE("foreign states: blocks", "[robustness][states]") {
    Rng rng(seed_for("foreign block states", 0));
    for (BlockKind kind : titans::all_block_kinds) {
        BlockConfig base = BlockConfig::make(kind, 16, 2, 2, 8, 4);
        base.attention.rope = true;
        titans::Block<double> block(base, titans::BlockParams<double>::random(base, 1));
        const Matrixd x = random_matrix(6, 16, rng);
        for (const auto& [name, edit] : state_settings()) {
            BlockConfig other = base;
            edit(other);
            if (other.kind == BlockKind::MAL && kind == BlockKind::LMM) continue;
            INFO("kind " << titans::to_string(kind) << " changed " << name);
            titans::Block<double> foreign(other, titans::BlockParams<double>::random(other, 2));
            auto st = foreign.make_state(2);
            const robust::Snapshot before = robust::snapshot(st);
            if (matters(name, kind)) {
                REQUIRE_THROWS_NAMING(block.forward(st, x), ConfigError, "state");
                REQUIRE_THROWS_AS(block.validate_state(st), ConfigError);
                CHECK(robust::snapshot(st) == before);
            } else {
                CHECK_NOTHROW(block.forward(st, x));
            }
        }
        // The feed-forward and the norms hold no state: a block differing only there continues.
        BlockConfig ffn = base;
        ffn.use_ffn = !ffn.use_ffn;
        ffn.norm_eps = 1e-3;
        titans::Block<double> other(ffn, titans::BlockParams<double>::random(ffn, 3));
        auto st = other.make_state(2);
        CHECK_NOTHROW(block.forward(st, x));
    }
}

TEST_CASE("foreign states: model", "[robustness][states]") {
    Rng rng(seed_for("foreign model states", 0));
    auto cfg = titans::ModelConfig::uniform(BlockKind::MAG, 2, 16, 2, 2, 8, 0, 4);
    titans::Model<double> model(cfg, titans::ModelParams<double>::random(cfg, 1));
    const Matrixd x = random_matrix(4, 16, rng);
    auto good = model.make_state(2);
    (void)model.forward(good, x);

    auto fewer = titans::ModelConfig::uniform(BlockKind::MAG, 1, 16, 2, 2, 8, 0, 4);
    titans::Model<double> small(fewer, titans::ModelParams<double>::random(fewer, 1));
    auto st = small.make_state(2);
    REQUIRE_THROWS_NAMING(model.forward(st, x), ConfigError, "state");

    auto bad_pos = good;
    bad_pos.position += 1;
    REQUIRE_THROWS_NAMING(model.forward(bad_pos, x), ConfigError, "position");
    auto bad_batch = good;
    bad_batch.batch = 1;
    REQUIRE_THROWS_NAMING(model.forward(bad_batch, random_matrix(2, 16, rng)), ConfigError,
                          "batch");
    auto swapped = good;  // a block state of another model's block: window differs
    auto wide = titans::ModelConfig::uniform(BlockKind::MAG, 2, 16, 2, 2, 9, 0, 4);
    titans::Model<double> other(wide, titans::ModelParams<double>::random(wide, 1));
    auto os = other.make_state(2);
    (void)other.forward(os, x);
    swapped.blocks[1] = os.blocks[1];
    REQUIRE_THROWS_NAMING(model.forward(swapped, x), ConfigError, "state");
    REQUIRE_THROWS_AS(model.validate_state(swapped), ConfigError);
    CHECK_NOTHROW(model.validate_state(good));
}
