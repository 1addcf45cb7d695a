#pragma once
// fuzz/checkpoint_objects.hpp: the fixed objects the checkpoint fuzz target restores into (a
// tiny model with one block of each kind, in float), and the valid checkpoints of the seed
// corpus (written by titans_make_corpus). Shared so the corpus always matches the target.

#include <titans/io/checkpoint.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace titans_fuzz {

/// LMM, MAC, MAG, MAL blocks, d = 8, 2 heads, windows/segments of 3, chunk 2, 1 persistent token.
inline titans::ModelConfig checkpoint_model_config() {
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::LMM, 1, 8, 2, 2, 3, 0, 2);
    for (auto k : {titans::BlockKind::MAC, titans::BlockKind::MAG, titans::BlockKind::MAL}) {
        cfg.blocks.push_back(titans::BlockConfig::make(k, 8, 2, 2, 3, 2));
        cfg.blocks.back().n_persistent = 1;
        cfg.blocks.back().ffn.hidden = 8;
    }
    cfg.blocks[0].ffn.hidden = 8;
    return cfg;
}

/// The model of checkpoint_model_config(), parameters from seed 11.
inline const titans::Model<float>& checkpoint_model() {
    static const titans::Model<float> model = [] {
        const auto cfg = checkpoint_model_config();
        return titans::Model<float>(cfg, titans::ModelParams<float>::random(cfg, 11));
    }();
    return model;
}

/// Valid checkpoints of the model, of its MAL block and of that block's memory, after
/// `tokens` tokens of 2 streams: (name, file bytes).
inline std::vector<std::pair<std::string, std::vector<std::byte>>> checkpoint_seeds(int tokens) {
    const auto& model = checkpoint_model();
    auto st = model.make_state(2);
    titans::Matrixf x(2 * tokens, 8);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((i * 37 % 17) - 8) / 8.0f;
    if (tokens > 0) (void)model.forward(st, x);
    const auto& block = model.blocks()[3];
    const std::string t = std::to_string(tokens);
    return {
        {"valid_model_" + t, titans::io::checkpoint_writer(model, st).bytes()},
        {"valid_block_" + t, titans::io::checkpoint_writer(block, st.blocks[3]).bytes()},
        {"valid_memory_" + t, titans::io::checkpoint_writer(block.memory(), st.blocks[3].memory()).bytes()},
    };
}

}  // namespace titans_fuzz
