#pragma once
// titans/io/optimizer.hpp: an AdamW's state in a safetensors file, so that training stopped
// and resumed (parameters from save_parameters, the optimiser from here) takes bit-identical
// steps. Layout: docs/formats.md.

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "../train/adamw.hpp"
#include "parameters.hpp"
#include "safetensors.hpp"

namespace titans::io {

namespace detail {

/// Refuses, before anything is written, an optimiser state load_optimizer would refuse
/// (AdamW<T>::validate_state: the config, the step count, each m and v of one shape, finite,
/// v >= 0), with its error type; `src` names the destination in the messages.
template <class T>
void check_optimizer(const AdamW<T>& opt, const std::string& src) {
    with_context("titans::io: " + src + ": ", [&] {
        AdamW<T>::validate_state(opt.config(), opt.steps(), opt.moments(), "AdamW");
    });
}

/// The writer of optimizer_writer, without the checks.
template <class T>
[[nodiscard]] SafetensorsWriter unchecked_optimizer_writer(const AdamW<T>& opt) {
    SafetensorsWriter w;
    w.metadata("format", "titans.adamw");
    w.metadata("format_version", std::to_string(format_version));
    w.metadata("dtype", to_string(dtype_of<T>()));
    w.metadata("titans_version", version_string());
    const std::array<std::int64_t, 1> step{opt.steps()};
    w.add_integers("step", step);
    const AdamWConfig& c = opt.config();
    RowVector<double> cfg(5);
    cfg << c.beta1, c.beta2, c.eps, c.weight_decay, c.decay_vectors ? 1.0 : 0.0;
    w.add("config", cfg);
    for (const auto& [name, mo] : opt.moments()) {
        w.add("m." + name, mo.m);
        w.add("v." + name, mo.v);
    }
    return w;
}

}  // namespace detail

/// A writer of an AdamW's state: metadata format "titans.adamw", format_version, dtype;
/// tensors "step" (I64 [1]), "config" (F64 [5]: beta1, beta2, eps, weight_decay,
/// decay_vectors as 0 / 1) and, per parameter tensor X, its moments "m.X" and "v.X" in T.
/// Refuses what load_optimizer would refuse, with the same error type (detail::check_optimizer).
template <class T>
[[nodiscard]] SafetensorsWriter optimizer_writer(const AdamW<T>& opt) {
    detail::check_optimizer(opt, "optimizer_writer");
    return detail::unchecked_optimizer_writer(opt);
}

/// Writes optimizer_writer(opt) to `path` (atomically). Checks first, as optimizer_writer
/// does: nothing is created (not even a temporary) when it refuses.
template <class T>
void save_optimizer(const std::filesystem::path& path, const AdamW<T>& opt) {
    detail::check_optimizer(opt, detail::write_source(path));
    detail::unchecked_optimizer_writer(opt).write(path);
}

/// An AdamW resumed from a parsed file written by save_optimizer. FormatError for another
/// format, a missing "step" / "config", a moment without its pair or a tensor of another
/// name; the constructor's errors for invalid values (AdamW<T>::validate_state: settings valid
/// for T, steps >= 0, finite moments, v >= 0), prefixed "titans::io: <source>: ".
template <class T>
[[nodiscard]] AdamW<T> load_optimizer(const SafetensorsFile& f) {
    detail::check_format(f, "titans.adamw", /*required=*/true);
    const auto fail = [&f](const std::string& what) {
        throw FormatError("titans::io: " + f.source() + ": " + what);
    };
    const auto step = f.integers("step");
    if (step.size() != 1) fail("tensor 'step' has " + std::to_string(step.size()) +
                               " entries, expected 1");
    const Matrix<double> c = f.matrix<double>("config");
    if (c.size() != 5) fail("tensor 'config' has " + std::to_string(c.size()) +
                            " entries, expected 5");
    const AdamWConfig cfg{.beta1 = c(0), .beta2 = c(1), .eps = c(2), .weight_decay = c(3),
                          .decay_vectors = c(4) != 0.0};
    std::map<std::string, typename AdamW<T>::Moments> moments;
    for (const TensorInfo& t : f.tensors()) {
        const std::string_view name = t.name;
        if (name == "step" || name == "config" || name.starts_with("v.")) continue;
        if (!name.starts_with("m.")) fail("unexpected tensor '" + t.name + "'");
        const std::string param(name.substr(2));
        if (f.find("v." + param) == nullptr) fail("tensor '" + t.name + "' has no 'v." + param + "'");
        moments[param] = {f.matrix<T>(t.name), f.matrix<T>("v." + param)};
    }
    for (const TensorInfo& t : f.tensors()) {
        if (std::string_view(t.name).starts_with("v.") && !moments.contains(t.name.substr(2))) {
            fail("tensor '" + t.name + "' has no 'm." + t.name.substr(2) + "'");
        }
    }
    std::optional<AdamW<T>> opt;
    detail::with_context("titans::io: " + f.source() + ": ",
                         [&] { opt.emplace(cfg, step[0], std::move(moments)); });
    return std::move(*opt);
}

/// As above, reading the file at `path`.
template <class T>
[[nodiscard]] AdamW<T> load_optimizer(const std::filesystem::path& path) {
    return load_optimizer<T>(SafetensorsFile::read(path));
}

}  // namespace titans::io
