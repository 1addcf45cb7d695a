#pragma once
// titans/io/trainer.hpp: a Trainer's whole state in a directory (its model's parameters, its
// optimiser, its settings and progress), so that training stopped and resumed takes
// bit-identical steps. Layout: docs/formats.md §10.

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "../train/trainer.hpp"
#include "config_text.hpp"
#include "metadata.hpp"
#include "optimizer.hpp"
#include "parameters.hpp"
#include "safetensors.hpp"

namespace titans::io {

/// The files save_trainer writes into its directory, in the order it writes them.
inline constexpr std::array<const char*, 3> trainer_files = {
    "parameters.safetensors", "optimizer.safetensors", "trainer.safetensors"};

namespace detail {

/// FNV-1a-64 (16 hex digits) over an optimiser's state: its steps, its settings and every
/// moment's name, shape and bytes.
template <class T>
[[nodiscard]] std::string optimizer_hash(const AdamW<T>& opt) {
    Fnv1a h;
    const std::int64_t steps = opt.steps();
    h.update(&steps, sizeof steps);
    AdamWConfig::fields(opt.config(), [&h](const std::string& name, const auto& x) {
        titans::detail::add_setting(h, name, x);
    });
    for (const auto& [name, mo] : opt.moments()) {
        h.update(name);
        for (const Matrix<T>* m : {&mo.m, &mo.v}) {
            const std::int64_t shape[2] = {static_cast<std::int64_t>(m->rows()),
                                           static_cast<std::int64_t>(m->cols())};
            h.update(shape, sizeof shape);
            h.update(m->data(), static_cast<std::size_t>(m->size()) * sizeof(T));
        }
    }
    return h.hex();
}

/// Adds every field `Fields::fields(x, .)` visits as a one-entry tensor "<prefix><name>":
/// integers and bools (0 / 1) I64 [1], doubles F64 [1].
template <class X>
void add_fields(SafetensorsWriter& w, const std::string& prefix, const X& x) {
    X::fields(x, [&](const std::string& name, const auto& v) {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_integral_v<V>) {
            const std::array<std::int64_t, 1> one{static_cast<std::int64_t>(v)};
            w.add_integers(prefix + name, one);
        } else {
            w.add(prefix + name, RowVector<double>::Constant(1, v));
        }
    });
}

/// Fills every field of x from the tensors add_fields wrote (FormatError: missing, not one
/// entry, a bool other than 0 / 1), recording the names read in `used`.
template <class X>
void read_fields(const SafetensorsFile& f, const std::string& prefix, X& x,
                 std::unordered_set<std::string>& used) {
    X::fields(x, [&](const std::string& field, auto& v) {
        using V = std::decay_t<decltype(v)>;
        const std::string name = prefix + field;
        const auto fail = [&](const std::string& what) {
            throw FormatError("titans::io: " + f.source() + ": tensor '" + name + "' " + what);
        };
        if constexpr (std::is_integral_v<V>) {
            const auto ints = f.integers(name);
            if (ints.size() != 1) fail("has " + std::to_string(ints.size()) + " entries, expected 1");
            if (std::is_same_v<V, bool> && ints[0] != 0 && ints[0] != 1) fail("is not 0 or 1");
            v = static_cast<V>(ints[0]);
        } else {
            const Matrix<double> m = f.matrix<double>(name);
            if (m.size() != 1) fail("has " + std::to_string(m.size()) + " entries, expected 1");
            v = m(0, 0);
        }
        used.insert(name);
    });
}

/// The trainer file: metadata format "titans.trainer", format_version, dtype, config
/// (config_text of the model's), config_hash, params_hash, optimizer_hash, titans_version;
/// tensors "steps", "config.*" (TrainerConfig::fields) and "progress.*"
/// (TrainerProgress::fields).
template <class T, class B>
[[nodiscard]] SafetensorsWriter trainer_writer(const Trainer<T, B>& t) {
    const ModelConfig& mc = t.model().config();
    SafetensorsWriter w;
    w.metadata("format", "titans.trainer");
    w.metadata("format_version", std::to_string(format_version));
    w.metadata("dtype", to_string(dtype_of<T>()));
    w.metadata("config", config_text(mc));
    w.metadata("config_hash", config_hash(mc));
    w.metadata("params_hash", params_hash(t.params(), mc));
    w.metadata("optimizer_hash", optimizer_hash(t.optimizer()));
    w.metadata("titans_version", version_string());
    const std::array<std::int64_t, 1> steps{t.steps()};
    w.add_integers("steps", steps);
    add_fields(w, "config.", t.config());
    add_fields(w, "progress.", t.progress());
    return w;
}

/// load_trainer's checks of the trainer file against the caller's model configuration and
/// scalar type: format, dtype (ConfigError), configuration (ConfigError naming the first
/// difference), config_hash.
template <class T>
void check_trainer_file(const SafetensorsFile& f, const ModelConfig& mc) {
    check_format(f, "titans.trainer", /*required=*/true);
    if (const std::string d = metadata_value(f, "dtype"); d != to_string(dtype_of<T>())) {
        throw ConfigError("titans::io: " + f.source() + ": trainer dtype " + d + ", expected " +
                          to_string(dtype_of<T>()) + " (a trainer resumes only at the precision "
                          "it was saved in)");
    }
    check_recorded_config(f, config_text(mc), "model", "the trainer file", "model_config");
}

/// FormatError unless `actual` equals the trainer file's metadata `key`: `file` is not the
/// one the trainer file was saved with.
inline void require_same_save(const SafetensorsFile& f, const char* key, const std::string& actual,
                              const std::filesystem::path& file) {
    if (metadata_value(f, key) != actual) {
        throw FormatError("titans::io: " + file.string() + " is not the file " + f.source() +
                          " was saved with (" + key + " differs: files of different saves, or a "
                          "save that did not finish)");
    }
}

}  // namespace detail

/// Saves a Trainer's whole state into the directory `dir` (created if missing): the model's
/// parameters (save_parameters), the optimiser (save_optimizer) and trainer.safetensors (its
/// settings, steps, progress and the fingerprints of the other two), in that order, each file
/// atomically. A save interrupted between files leaves a set load_trainer refuses. FileError
/// if the directory cannot be made or a file written.
///
///     titans::io::save_trainer("run/step_1000", trainer);
template <class T, class B>
void save_trainer(const std::filesystem::path& dir, const Trainer<T, B>& trainer) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || !std::filesystem::is_directory(dir)) {
        throw FileError("titans::io: cannot make the directory '" + dir.string() + "': " +
                        (ec ? ec.message() : std::string("not a directory")));
    }
    save_parameters(dir / trainer_files[0], trainer.model());
    save_optimizer(dir / trainer_files[1], trainer.optimizer());
    detail::trainer_writer(trainer).write(dir / trainer_files[2]);
}

/// The Trainer save_trainer wrote into `dir`, for its model configuration (the files record it
/// as text; ConfigError naming the first setting that differs) in T (ConfigError for another
/// dtype): the next steps are bit for bit those the saved trainer would have taken. Throws
/// FileError (a file missing or unreadable), FormatError (malformed files, or files of
/// different saves), and what load_parameters, load_optimizer and the Trainer constructor
/// throw.
///
///     auto trainer = titans::io::load_trainer<float>("run/step_1000", cfg);
template <class T, class B = backend::Cpu>
[[nodiscard]] Trainer<T, B> load_trainer(const std::filesystem::path& dir,
                                         const ModelConfig& model_config) {
    const SafetensorsFile f = SafetensorsFile::read(dir / trainer_files[2]);
    detail::check_trainer_file<T>(f, model_config);
    std::unordered_set<std::string> used{"steps"};
    TrainerConfig config;
    TrainerProgress progress;
    detail::read_fields(f, "config.", config, used);
    detail::read_fields(f, "progress.", progress, used);
    detail::reject_unused(f, used, "a trainer setting");
    const auto steps = f.integers("steps");
    const std::filesystem::path pfile = dir / trainer_files[0], ofile = dir / trainer_files[1];
    auto params = load_parameters<ModelParams<T>>(pfile, model_config);
    detail::require_same_save(f, "params_hash", detail::params_hash(params, model_config), pfile);
    AdamW<T> opt = load_optimizer<T>(ofile);
    detail::require_same_save(f, "optimizer_hash", detail::optimizer_hash(opt), ofile);
    if (steps.size() != 1 || steps[0] != opt.steps()) {
        throw FormatError("titans::io: " + f.source() + ": tensor 'steps' does not hold the "
                          "optimiser's " + std::to_string(opt.steps()) + " steps");
    }
    return Trainer<T, B>(model_config, std::move(params), config, std::move(opt), progress);
}

}  // namespace titans::io
