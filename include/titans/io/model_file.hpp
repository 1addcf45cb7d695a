#pragma once
// titans/io/model_file.hpp: a whole Model from the one file save_parameters(path, model)
// writes: the configuration recorded in its metadata, then the parameters.

#include <filesystem>
#include <string>

#include "config_text.hpp"
#include "parameters.hpp"
#include "safetensors.hpp"

namespace titans::io {

/// The configuration recorded in a parameters file of a model (metadata "config", written by
/// save_parameters). FormatError naming the file: not a "titans.params" file of the current
/// format_version, metadata "object" not "model", no "config", or a configuration that does not
/// parse (config_from_text); ConfigError (prefixed with the file) if it is not valid for T.
template <class T>
[[nodiscard]] ModelConfig recorded_model_config(const SafetensorsFile& f) {
    const std::string& src = f.source();
    detail::check_format(f, "titans.params", /*required=*/true);
    const auto& meta = f.metadata();
    const auto object = meta.find("object");
    if (object == meta.end() || object->second != "model") {
        throw FormatError("titans::io: " + src + ": __metadata__ object = \"" +
                          (object == meta.end() ? std::string("(none)") : object->second) +
                          "\", expected \"model\" (parameters written by save_parameters of "
                          "a Model)");
    }
    const auto text = meta.find("config");
    if (text == meta.end()) {
        throw FormatError("titans::io: " + src + ": __metadata__ has no \"config\", expected "
                          "the configuration save_parameters records");
    }
    auto cfg = config_from_text<ModelConfig>(text->second, src);
    detail::with_context("titans::io: " + src + ": ", [&] { cfg.validate_for<T>(); });
    return cfg;
}

/// The model saved by save_parameters(path, model): recorded_model_config<T>, then
/// load_parameters under it (what those throw: FileError, FormatError, ConfigError,
/// ShapeError, NonFiniteError, naming the file).
///
///     titans::io::save_parameters("model.safetensors", model);
///     auto loaded = titans::io::load_model<float>("model.safetensors");
template <class T, class Backend = backend::Cpu>
[[nodiscard]] Model<T, Backend> load_model(const std::filesystem::path& path) {
    const SafetensorsFile f = SafetensorsFile::read(path);
    ModelConfig cfg = recorded_model_config<T>(f);
    ModelParams<T> params = load_parameters<ModelParams<T>>(f, cfg);
    return Model<T, Backend>(std::move(cfg), std::move(params));
}

}  // namespace titans::io
