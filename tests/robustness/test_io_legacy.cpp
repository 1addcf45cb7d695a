// Checkpoints written before max_grad_norm existed (math §10) still load, with the meaning
// they were written with: clipping off. tests/io/data/legacy_*_before_clipping.safetensors are
// copies of the fuzz seed corpus as it was written by titans 0.1.0 (fuzz/checkpoint_objects.hpp:
// a d 8 model of LMM, MAC, MAG, MAL blocks, 3 tokens of 2 streams).

#include "test_common.hpp"

#include <titans/io/checkpoint.hpp>

#include "../../fuzz/checkpoint_objects.hpp"

#include <string>

using namespace titans_test;
namespace io = titans::io;

namespace {

/// The model of fuzz/checkpoint_objects.hpp with max_grad_norm = c in every block.
titans::Model<float> legacy_model(double c) {
    auto cfg = titans_fuzz::checkpoint_model_config();
    for (auto& b : cfg.blocks) b.memory.max_grad_norm = c;
    return titans::Model<float>(cfg, titans::ModelParams<float>::random(cfg, 11));
}

const std::string data = TITANS_TEST_DATA_DIR;

}  // namespace

// io legacy: checkpoints before clipping load
TEST_CASE("io legacy: pre-clipping checkpoints", "[io][robustness]") {
    const auto off = legacy_model(0.0);
    const auto model_file = data + "/legacy_model_before_clipping.safetensors";
    const auto memory_file = data + "/legacy_memory_before_clipping.safetensors";
    auto st = io::load_checkpoint(model_file, off);
    CHECK(st.position == 3);
    const auto& mem = off.blocks()[3].memory();
    const auto ms = io::load_checkpoint(memory_file, mem);
    CHECK(ms.position() == st.blocks[3].memory().position());
    // Clipping on: another stream's meaning, refused naming the setting.
    const auto on = legacy_model(1.0);
    REQUIRE_THROWS_NAMING(io::load_checkpoint(model_file, on), titans::ConfigError,
                          "max_grad_norm = 0 in the checkpoint");
    REQUIRE_THROWS_NAMING(io::load_checkpoint(memory_file, on.blocks()[3].memory()),
                          titans::ConfigError, "max_grad_norm");
}
