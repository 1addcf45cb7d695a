#pragma once
// titans/io/generation.hpp: a checkpoint of text being generated (text/generation.hpp): the
// model's stream state, the sampler (settings and generator state) and the pending token, so
// a generation stopped and resumed continues with the same tokens.

#include <cstdint>
#include <filesystem>
#include <string>

#include "../text/generation.hpp"
#include "checkpoint.hpp"
#include "config_text.hpp"

namespace titans::io {

namespace detail {

/// The metadata entry `key` of f parsed as X (FormatError naming the file and the key if it
/// is missing or is not an X).
template <class X>
[[nodiscard]] X generation_entry(const SafetensorsFile& f, const std::string& key) {
    const auto it = f.metadata().find(key);
    X x{};
    if (it == f.metadata().end() || !parse_setting(it->second, x)) {
        throw FormatError("titans::io: " + f.source() + ": __metadata__ \"" + key + "\" is " +
                          (it == f.metadata().end() ? "missing" : "\"" + it->second + "\"") +
                          ", expected " + setting_kind<X>() + " (a generation checkpoint)");
    }
    return x;
}

}  // namespace detail

/// Writes a checkpoint of generation `g` of `model` (atomically): the stream state exactly as
/// save_checkpoint writes it (the file is a "titans.checkpoint": load_checkpoint reads the
/// state back), plus metadata text.pending (the pending token), text.sampler.state (the
/// generator's state) and text.sampler.temperature, .top_k, .top_p, .seed. Refuses what
/// save_checkpoint refuses, a state of more than one stream and a pending token outside
/// [0, vocab_size) (ShapeError), before anything is created.
///
///     titans::io::save_generation("gen.safetensors", model, g);
///     auto resumed = titans::io::load_generation("gen.safetensors", model);
template <class T, class Backend>
void save_generation(const std::filesystem::path& path, const Model<T, Backend>& model,
                     const text::Generation<T, Backend>& g) {
    const std::string src = detail::write_source(path);
    detail::check_checkpoint(model, g.state, src);
    const std::string where = "titans::io: " + src + ": save_generation";
    titans::detail::require<ShapeError>(g.state.batch == 1, where.c_str(), "g.state.batch",
                                        g.state.batch, "1 (a generation is one stream)");
    const int vocab = model.config().vocab_size;
    titans::detail::require<ShapeError>(g.pending >= 0 && g.pending < vocab, where.c_str(),
                                        "g.pending", g.pending,
                                        titans::detail::concat("a token id in [0, ", vocab, ")"));
    SafetensorsWriter w = detail::unchecked_checkpoint_writer(model, g.state);
    const text::SamplerConfig& s = g.sampler.config();
    w.metadata("text.pending", std::to_string(g.pending));
    w.metadata("text.sampler.state", std::to_string(g.sampler.state()));
    w.metadata("text.sampler.temperature", detail::format_setting(s.temperature));
    w.metadata("text.sampler.top_k", std::to_string(s.top_k));
    w.metadata("text.sampler.top_p", detail::format_setting(s.top_p));
    w.metadata("text.sampler.seed", std::to_string(s.seed));
    w.write(path);
}

/// The generation a save_generation file holds, for `model`: the state as restore_checkpoint
/// reads it (and refuses), one stream (FormatError for another batch), the sampler's settings
/// (FormatError if an entry is missing or malformed, ConfigError if invalid) and generator
/// state, the pending token (FormatError outside [0, vocab_size)). It continues with the
/// tokens the saved generation would have produced.
template <class T, class Backend>
[[nodiscard]] text::Generation<T, Backend> restore_generation(const SafetensorsFile& f,
                                                              const Model<T, Backend>& model) {
    const std::string prefix = "titans::io: " + f.source() + ": ";
    auto state = restore_checkpoint(f, model);
    if (state.batch != 1) {
        throw FormatError(prefix + "batch = " + std::to_string(state.batch) +
                          ", expected 1 (a generation is one stream)");
    }
    text::SamplerConfig s;
    s.temperature = detail::generation_entry<double>(f, "text.sampler.temperature");
    s.top_k = detail::generation_entry<int>(f, "text.sampler.top_k");
    s.top_p = detail::generation_entry<double>(f, "text.sampler.top_p");
    s.seed = detail::generation_entry<std::uint64_t>(f, "text.sampler.seed");
    const auto rng = detail::generation_entry<std::uint64_t>(f, "text.sampler.state");
    const int pending = detail::generation_entry<int>(f, "text.pending");
    const int vocab = model.config().vocab_size;
    if (pending < 0 || pending >= vocab) {
        throw FormatError(prefix + "text.pending = " + std::to_string(pending) +
                          ", expected a token id in [0, " + std::to_string(vocab) + ")");
    }
    detail::with_context(prefix, [&] { s.validate(); });
    text::Sampler sampler(s);
    sampler.restore(rng);
    return text::Generation<T, Backend>{std::move(state), std::move(sampler), pending};
}

/// As above, reading the file at `path`.
template <class T, class Backend>
[[nodiscard]] text::Generation<T, Backend> load_generation(const std::filesystem::path& path,
                                                           const Model<T, Backend>& model) {
    return restore_generation(SafetensorsFile::read(path), model);
}

}  // namespace titans::io
