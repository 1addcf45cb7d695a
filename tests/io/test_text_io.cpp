// Text generation and files (titans/io/generation.hpp, titans/io/model_file.hpp,
// config_from_text in titans/io/config_text.hpp): a generation checkpointed mid-stream and
// resumed (the model loaded from its file too) continues with the same tokens as one that never
// stopped; configurations read back from their text; and one test per refused file.
#include "test_common.hpp"

#include "io/temp_dir.hpp"

#include <titans/io/generation.hpp>
#include <titans/io/model_file.hpp>

#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace titans_text_io_test {

using titans::ConfigError;
using titans::FormatError;
using titans::ModelConfig;
using titans::ShapeError;
using titans::text::SamplerConfig;
using titans_test::Rng;
using titans_test::seed_for;
using titans_test::TempDir;
using titans_test::uniform_int;
namespace io = titans::io;

template <class T>
titans::Model<T> text_io_model(std::uint64_t seed) {
    auto cfg = ModelConfig::uniform(titans::BlockKind::MAC, 1, 16, 2, 1, 8, 256, 4);
    cfg.blocks.push_back(titans::BlockConfig::make(titans::BlockKind::MAL, 16, 2, 2, 8, 4));
    cfg.blocks[1].n_persistent = 2;
    return titans::Model<T>(cfg, titans::ModelParams<T>::random(cfg, seed));
}

/// The file at `path` again with metadata `key` set to `value` (removed if value is empty).
void text_io_set_metadata(const std::filesystem::path& path, const std::string& key,
                          const std::string& value) {
    const io::SafetensorsFile f = io::SafetensorsFile::read(path);
    io::SafetensorsWriter w;
    for (const auto& [k, v] : f.metadata()) {
        if (k != key) w.metadata(k, v);
    }
    if (!value.empty()) w.metadata(key, value);
    for (const io::TensorInfo& t : f.tensors()) {
        const auto raw = f.data(t);
        w.add_raw(t.name, t.dtype, t.shape, std::vector<std::byte>(raw.begin(), raw.end()));
    }
    w.write(path);
}

TEMPLATE_TEST_CASE("io: generation resumes", "[text][io]", float, double) {
    using T = TestType;
    Rng rng(seed_for("io: generation resumes", sizeof(T)));
    TempDir dir("text_generation");
    const titans::Model<T> model = text_io_model<T>(rng());
    const std::vector<int> prompt = titans::text::ByteTokenizer::encode("To be, or not");
    const SamplerConfig sc{.temperature = titans_test::uniform(rng, 0.5, 1.5),
                           .top_k = uniform_int(rng, 0, 100),
                           .top_p = titans_test::uniform(rng, 0.8, 1.0),
                           .seed = rng()};
    const int total = 20, cut = uniform_int(rng, 1, total - 1);
    auto g = titans::text::start_generation(model, prompt, sc);
    std::vector<int> all;
    for (int i = 0; i < total; ++i) {
        if (i == cut) {
            io::save_parameters(dir / "model.safetensors", model);
            io::save_generation(dir / "gen.safetensors", model, g);
        }
        all.push_back(titans::text::next_token(model, g));
    }
    // As a restarted program: the model and the generation from their files.
    const auto loaded = io::load_model<T>(dir / "model.safetensors");
    auto resumed = io::load_generation(dir / "gen.safetensors", loaded);
    CHECK(resumed.sampler.config().temperature == sc.temperature);
    CHECK((resumed.sampler.config().top_k == sc.top_k && resumed.sampler.config().top_p == sc.top_p &&
           resumed.sampler.config().seed == sc.seed));
    for (int i = cut; i < total; ++i) {
        CHECK(titans::text::next_token(loaded, resumed) == all[static_cast<std::size_t>(i)]);
    }
    // The file is a checkpoint of the model's state as well.
    const auto st = io::load_checkpoint(dir / "gen.safetensors", model);
    CHECK(st.position == static_cast<std::int64_t>(prompt.size()) - 1 + cut);
}

TEST_CASE("io: generation file refusals", "[text][io]") {
    TempDir dir("text_generation_refusals");
    const titans::Model<double> model = text_io_model<double>(5);
    auto g = titans::text::start_generation(model, std::vector<int>{72, 105}, {.seed = 3});
    const auto path = dir / "gen.safetensors";

    g.pending = 256;
    REQUIRE_THROWS_NAMING(io::save_generation(path, model, g), ShapeError, "g.pending = 256");
    g.pending = 105;
    titans::text::Generation<double> two{model.make_state(2), g.sampler, 105};
    REQUIRE_THROWS_NAMING(io::save_generation(path, model, two), ShapeError, "g.state.batch = 2");
    CHECK(dir.entries() == 0);  // nothing written

    io::save_checkpoint(path, model, model.make_state(2));
    REQUIRE_THROWS_NAMING(io::load_generation(path, model), FormatError, "batch = 2, expected 1");
    io::save_checkpoint(path, model, g.state);  // a model checkpoint without the text entries
    REQUIRE_THROWS_NAMING(io::load_generation(path, model), FormatError,
                          "\"text.sampler.temperature\" is missing");

    const std::map<std::string, std::pair<std::string, std::string>> malformed = {
        {"text.sampler.top_k", {"x", "expected an integer"}},
        {"text.sampler.state", {"-1", "expected an integer"}},
        {"text.sampler.temperature", {"warm", "expected a number"}},
        {"text.pending", {"999", "text.pending = 999, expected a token id in [0, 256)"}},
    };
    for (const auto& [key, bad] : malformed) {
        io::save_generation(path, model, g);
        text_io_set_metadata(path, key, bad.first);
        INFO(key);
        REQUIRE_THROWS_NAMING(io::load_generation(path, model), FormatError, bad.second);
    }
    io::save_generation(path, model, g);
    text_io_set_metadata(path, "text.sampler.top_p", "2");
    REQUIRE_THROWS_NAMING(io::load_generation(path, model), ConfigError, "top_p = 2");
    io::save_generation(path, model, g);
    const titans::Model<double> other = text_io_model<double>(6);  // other parameters
    REQUIRE_THROWS_NAMING(io::load_generation(path, other), ConfigError, "params_hash");
}

/// A model configuration with every block kind and settings away from their defaults.
ModelConfig text_io_config(Rng& rng) {
    ModelConfig c = ModelConfig::uniform(titans::BlockKind::LMM, 1, 32, 4, 2, 16, 300, 8);
    for (const auto kind : {titans::BlockKind::MAC, titans::BlockKind::MAG, titans::BlockKind::MAL}) {
        c.blocks.push_back(titans::BlockConfig::make(kind, 32, 4, uniform_int(rng, 1, 3),
                                                     uniform_int(rng, 4, 20), uniform_int(rng, 2, 9)));
    }
    c.blocks[1].memory.gates = titans::GateMode::PerChunk;
    c.blocks[1].memory.retrieval = titans::Retrieval::Lagged;
    c.blocks[1].memory.theta_max = titans_test::uniform(rng, 0.001, 0.1);
    c.blocks[2].memory.update = titans::UpdateMode::PerToken;
    c.blocks[2].use_ffn = true;
    c.blocks[2].ffn.kind = titans::FeedForwardKind::GELU;
    c.blocks[3].memory.activation = titans::Activation::GELU;
    c.blocks[3].attention.rope = false;
    c.norm_eps = titans_test::uniform(rng, 1e-7, 1e-3);
    c.validate();
    return c;
}

/// `text` with the line `name=...` replaced by `line` (removed if empty).
std::string text_io_edit_line(std::string text, const std::string& name, const std::string& line) {
    const auto found = ("\n" + text).find("\n" + name + "=");  // at the start of a line
    REQUIRE(found != std::string::npos);
    const auto at = found;
    text.replace(at, text.find('\n', at) + 1 - at, line.empty() ? "" : line + "\n");
    return text;
}

TEST_CASE("io: config from text", "[text][io]") {
    Rng rng(seed_for("io: config from text"));
    const ModelConfig c = text_io_config(rng);
    const std::string text = io::config_text(c);
    CHECK(io::config_text(io::config_from_text<ModelConfig>(text, "t")) == text);
    const titans::BlockConfig& b = c.blocks[2];
    CHECK(io::config_text(io::config_from_text<titans::BlockConfig>(io::config_text(b), "t")) ==
          io::config_text(b));
    CHECK(io::config_text(io::config_from_text<titans::MemoryConfig>(io::config_text(b.memory), "t")) ==
          io::config_text(b.memory));
    // Written before max_grad_norm existed: read as 0 (off).
    ModelConfig clipped = c;
    clipped.blocks[0].memory.max_grad_norm = 1.5;
    const std::string legacy =
        text_io_edit_line(io::config_text(clipped), "blocks.0.memory.max_grad_norm", "");
    CHECK(io::config_from_text<ModelConfig>(legacy, "t").blocks[0].memory.max_grad_norm == 0);
    // Written before the ablation switches existed: read as on; switched off, they round-trip.
    ModelConfig ablated = c;
    ablated.blocks[1].memory.momentum = false;
    ablated.blocks[2].memory.forget = false;
    const std::string switched = io::config_text(ablated);
    CHECK(io::config_text(io::config_from_text<ModelConfig>(switched, "t")) == switched);
    CHECK(switched.find("blocks.1.memory.momentum=false\nblocks.1.memory.forget=true\n") !=
          std::string::npos);
    std::string before = switched;
    for (const std::string name : {"momentum", "forget"}) {
        for (int b = 0; b < static_cast<int>(c.blocks.size()); ++b) {
            before = text_io_edit_line(before, "blocks." + std::to_string(b) + ".memory." + name, "");
        }
    }
    const ModelConfig read = io::config_from_text<ModelConfig>(before, "t");
    CHECK(io::config_text(read) == io::config_text(c));
    CHECK((read.blocks[1].memory.momentum && read.blocks[2].memory.forget));
    CHECK(io::with_legacy_settings(before) == io::config_text(c));
    // Before clipping and the switches: all three completed, in their places.
    const std::string oldest =
        text_io_edit_line(before, "blocks.0.memory.max_grad_norm", "");
    ModelConfig unclipped = c;
    unclipped.blocks[0].memory.max_grad_norm = 0;
    CHECK(io::with_legacy_settings(oldest) == io::config_text(unclipped));

    const std::vector<std::pair<std::string, std::string>> refused = {
        {text_io_edit_line(text, "n_blocks", ""), "setting n_blocks is missing"},
        {text_io_edit_line(text, "n_blocks", "n_blocks=0"), "n_blocks = 0, expected an integer in [1, 4096]"},
        {text_io_edit_line(text, "blocks.1.memory.depth", ""), "setting blocks.1.memory.depth is missing"},
        {text_io_edit_line(text, "blocks.1.memory.depth", "blocks.1.memory.depth=two"),
         "blocks.1.memory.depth = two, expected an integer"},
        {text_io_edit_line(text, "blocks.2.use_ffn", "blocks.2.use_ffn=yes"), "expected true or false"},
        {text_io_edit_line(text, "blocks.0.kind", "blocks.0.kind=XYZ"), "blocks.0.kind = XYZ"},
        {text_io_edit_line(text, "norm_eps", "norm_eps=small"), "norm_eps = small, expected a number"},
        {text + "blocks.0.bogus=1\n", "blocks.0.bogus is not a setting"},
        {text + "norm_eps=1\n", "norm_eps is given twice"},
        {text + "no equals sign\n", "configuration line 'no equals sign'"},
    };
    for (const auto& [bad, message] : refused) {
        INFO(message);
        REQUIRE_THROWS_NAMING(io::config_from_text<ModelConfig>(bad, "cfg.txt"), FormatError, message);
        REQUIRE_THROWS_NAMING(io::config_from_text<ModelConfig>(bad, "cfg.txt"), FormatError, "cfg.txt");
    }
}

TEST_CASE("io: load_model", "[text][io]") {
    Rng rng(seed_for("io: load_model"));
    TempDir dir("text_load_model");
    const ModelConfig cfg = text_io_config(rng);
    const titans::Model<float> model(cfg, titans::ModelParams<float>::random(cfg, rng()));
    io::save_parameters(dir / "m.safetensors", model);
    const auto loaded = io::load_model<float>(dir / "m.safetensors");
    CHECK(io::config_text(loaded.config()) == io::config_text(cfg));
    CHECK(io::detail::params_hash(loaded.params(), cfg) == io::detail::params_hash(model.params(), cfg));
    auto s1 = model.make_state(1), s2 = loaded.make_state(1);
    const std::vector<int> ids = titans::text::ByteTokenizer::encode("loaded");
    const titans::Matrixf a = model.forward_tokens(s1, ids), b = loaded.forward_tokens(s2, ids);
    CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0);
    const auto d = io::load_model<double>(dir / "m.safetensors");  // another precision
    CHECK(d.params().head.cast<float>() == model.params().head);

    const auto path = dir / "m.safetensors";
    text_io_set_metadata(path, "config", "");
    REQUIRE_THROWS_NAMING(io::load_model<float>(path), FormatError, "no \"config\"");
    io::save_parameters(path, model);
    text_io_set_metadata(path, "config",
                         text_io_edit_line(io::config_text(cfg), "d_model", "d_model=0"));
    REQUIRE_THROWS_NAMING(io::load_model<float>(path), ConfigError, "d_model = 0");
    io::save_parameters(path, model.blocks()[0].config(), model.params().blocks[0]);
    REQUIRE_THROWS_NAMING(io::load_model<float>(path), FormatError, "object = \"block\"");
    io::save_parameters(path, model);
    text_io_set_metadata(path, "format", "");
    REQUIRE_THROWS_NAMING(io::load_model<float>(path), FormatError, "\"format\"");
}

}  // namespace titans_text_io_test
