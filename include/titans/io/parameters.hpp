#pragma once
// titans/io/parameters.hpp: the outer parameters of a memory, attention layer, feed-forward,
// block or model to and from safetensors. Names and shapes: docs/formats.md.

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../models/model.hpp"
#include "config_text.hpp"
#include "safetensors.hpp"

namespace titans::io {

/// The version of the titans metadata layout written into every file (docs/formats.md).
inline constexpr int format_version = 1;

namespace detail {

template <class P>
struct ParamsTraits;
template <class C, class T>
struct ParamsInfo {
    using Config = C;
    using Scalar = T;
};
template <class T>
struct ParamsTraits<MemoryParams<T>> : ParamsInfo<MemoryConfig, T> {
    static constexpr const char* object = "memory";
};
template <class T>
struct ParamsTraits<AttentionParams<T>> : ParamsInfo<AttentionConfig, T> {
    static constexpr const char* object = "attention";
};
template <class T>
struct ParamsTraits<FeedForwardParams<T>> : ParamsInfo<FeedForwardConfig, T> {
    static constexpr const char* object = "feed_forward";
};
template <class T>
struct ParamsTraits<BlockParams<T>> : ParamsInfo<BlockConfig, T> {
    static constexpr const char* object = "block";
};
template <class T>
struct ParamsTraits<ModelParams<T>> : ParamsInfo<ModelConfig, T> {
    static constexpr const char* object = "model";
};

inline std::string version_string() {
    return std::to_string(TITANS_VERSION_MAJOR) + "." + std::to_string(TITANS_VERSION_MINOR) +
           "." + std::to_string(TITANS_VERSION_PATCH);
}

/// Fingerprint of parameters: names, shapes and bytes of every visited tensor.
template <class Params, class Config>
[[nodiscard]] std::string params_hash(const Params& p, const Config& cfg) {
    Fnv1a h;
    Params::tensors(p, cfg, [&h](const std::string& name, const auto& m) {
        h.update(name);
        const std::int64_t shape[2] = {static_cast<std::int64_t>(m.rows()),
                                       static_cast<std::int64_t>(m.cols())};
        h.update(shape, sizeof shape);
        h.update(m.data(), static_cast<std::size_t>(m.size()) * sizeof(*m.data()));
    });
    return h.hex();
}

inline std::string shape_text(Eigen::Index r, Eigen::Index c, bool row_vector) {
    return row_vector ? "[" + std::to_string(c) + "]"
                      : "[" + std::to_string(r) + ", " + std::to_string(c) + "]";
}

/// Fills `m` (already sized as the configuration expects) from the tensor `name` of `f`:
/// FormatError if it is missing, ShapeError if its shape differs (a row vector is [n] or
/// [1, n]), NonFiniteError if a value is NaN or infinite. Any float dtype converts.
template <class M>
void read_expected(const SafetensorsFile& f, const std::string& name, M& m) {
    using T = typename M::Scalar;
    constexpr bool row_vector = M::RowsAtCompileTime == 1;
    const TensorInfo* t = f.find(name);
    if (t == nullptr) {
        throw FormatError("titans::io: " + f.source() + ": tensor '" + name +
                          "' is missing, expected shape " +
                          shape_text(m.rows(), m.cols(), row_vector));
    }
    const auto& s = t->shape;
    const auto r = static_cast<std::uint64_t>(m.rows()), c = static_cast<std::uint64_t>(m.cols());
    const bool ok = (s.size() == 2 && s[0] == r && s[1] == c) ||
                    (row_vector && s.size() == 1 && s[0] == c);
    if (!ok) {
        throw ShapeError("titans::io: " + f.source() + ": tensor '" + name + "' has shape " +
                         t->shape_string() + ", expected " +
                         shape_text(m.rows(), m.cols(), row_vector));
    }
    m = f.matrix<T>(name);
}

/// FormatError naming the first tensor of `f` that is not in `used`.
inline void reject_unused(const SafetensorsFile& f, const std::unordered_set<std::string>& used,
                          const char* what) {
    for (const TensorInfo& t : f.tensors()) {
        if (used.count(t.name) == 0) {
            throw FormatError("titans::io: " + f.source() + ": unexpected tensor '" + t.name +
                              "' (not " + what + " of this configuration; docs/formats.md "
                              "lists the names)");
        }
    }
}

/// FormatError unless metadata "format" is absent or equals `expected`.
inline void check_format(const SafetensorsFile& f, const char* expected, bool required) {
    const auto it = f.metadata().find("format");
    if (it == f.metadata().end()) {
        if (required) {
            throw FormatError("titans::io: " + f.source() + ": no __metadata__ \"format\", "
                              "expected \"" + expected + "\"");
        }
        return;
    }
    if (it->second != expected) {
        throw FormatError("titans::io: " + f.source() + ": __metadata__ format is \"" +
                          it->second + "\", expected \"" + expected + "\"");
    }
    const auto v_it = f.metadata().find("format_version");
    if (v_it == f.metadata().end()) {
        throw FormatError("titans::io: " + f.source() + ": __metadata__ has no \"format_version\", "
                          "expected \"" + std::to_string(format_version) + "\"");
    }
    const std::string& v = v_it->second;
    if (v != std::to_string(format_version)) {
        throw FormatError("titans::io: " + f.source() + ": format_version \"" + v +
                          "\" is not supported, expected \"" + std::to_string(format_version) +
                          "\"");
    }
}

using titans::detail::with_context;

/// ShapeError naming, as the loader does, the first tensor whose shape differs from what `cfg`
/// expects (returns if none does or the structure itself differs: the caller then reports the
/// params' own validate() message). Only on the error path: it allocates Params::zeros(cfg).
template <class Params, class Config>
void name_misshapen(const Config& cfg, const Params& p, const std::string& src) {
    struct Shape {
        Eigen::Index rows, cols;
        bool row_vector;
    };
    std::vector<Shape> expected;
    const Params zeros = Params::zeros(cfg);
    Params::tensors(zeros, cfg, [&](const std::string&, const auto& m) {
        using M = std::decay_t<decltype(m)>;
        expected.push_back({m.rows(), m.cols(), M::RowsAtCompileTime == 1});
    });
    std::size_t i = 0;
    try {
        Params::tensors(p, cfg, [&](const std::string& name, const auto& m) {
            const Shape& e = expected.at(i++);
            if (m.rows() != e.rows || m.cols() != e.cols) {
                throw ShapeError("titans::io: " + src + ": tensor '" + name + "' has shape " +
                                 shape_text(m.rows(), m.cols(), e.row_vector) + ", expected " +
                                 shape_text(e.rows, e.cols, e.row_vector));
            }
        });
    } catch (const std::out_of_range&) {  // another structure: no tensor-by-tensor answer
    } catch (const ShapeError& e) {
        if (std::string_view(e.what()).starts_with("titans::io: ")) throw;
    }
}

/// Every tensor `cfg` uses finite: NonFiniteError naming the first that is not, as the loader
/// does.
template <class Params, class Config>
void check_finite_params(const Config& cfg, const Params& p, const std::string& src) {
    Params::tensors(p, cfg, [&](const std::string& name, const auto& m) {
        if (!titans::detail::all_finite(m)) {
            throw NonFiniteError("titans::io: " + src + ": tensor '" + name +
                                 "' has a NaN or infinite value");
        }
    });
}

/// Refuses, before anything is written, parameters that could not be loaded back under `cfg`:
/// an invalid configuration (ConfigError), a tensor of another shape (ShapeError), a NaN or
/// infinite value (NonFiniteError). `src` names the destination in the messages.
template <class Params, class Config>
void check_parameters(const Config& cfg, const Params& p, const std::string& src) {
    const std::string prefix = "titans::io: " + src + ": ";
    with_context(prefix, [&] { cfg.validate(); });
    try {
        p.validate(cfg);
    } catch (const ShapeError& e) {
        name_misshapen(cfg, p, src);
        throw ShapeError(prefix + e.what());
    } catch (const NonFiniteError& e) {
        try {
            check_finite_params(cfg, p, src);  // throws naming the tensor as the loader does
        } catch (const ShapeError&) {          // another structure: validate()'s words below
        }
        throw NonFiniteError(prefix + e.what());
    }
}

/// "cannot write '<path>'": the source named by a refused save.
inline std::string write_source(const std::filesystem::path& path) {
    return "cannot write '" + path.string() + "'";
}

/// The writer of parameters_writer, without the checks.
template <class Params, class Config>
[[nodiscard]] SafetensorsWriter unchecked_parameters_writer(const Config& cfg, const Params& p) {
    using Traits = ParamsTraits<Params>;
    SafetensorsWriter w;
    w.metadata("format", "titans.params");
    w.metadata("format_version", std::to_string(format_version));
    w.metadata("object", Traits::object);
    w.metadata("dtype", to_string(dtype_of<typename Traits::Scalar>()));
    w.metadata("config", config_text(cfg));
    w.metadata("config_hash", config_hash(cfg));
    w.metadata("titans_version", version_string());
    Params::tensors(p, cfg, [&w](const std::string& name, const auto& m) { w.add(name, m); });
    return w;
}

}  // namespace detail

/// A safetensors writer holding every parameter `cfg` uses, plus metadata: format
/// "titans.params", format_version, object, dtype, config (config_text), config_hash,
/// titans_version. Params: MemoryParams, AttentionParams, FeedForwardParams, BlockParams or
/// ModelParams of float or double. Refuses what load_parameters would refuse, with the same
/// error type: an invalid `cfg` (ConfigError), a tensor of another shape (ShapeError), NaN or
/// infinity (NonFiniteError).
template <class Params, class Config>
[[nodiscard]] SafetensorsWriter parameters_writer(const Config& cfg, const Params& p) {
    using Traits = detail::ParamsTraits<Params>;
    static_assert(std::is_same_v<Config, typename Traits::Config>,
                  "titans::io: parameters and configuration types do not match");
    detail::check_parameters(cfg, p, "parameters_writer");
    return detail::unchecked_parameters_writer(cfg, p);
}

/// Writes every parameter `cfg` uses to a safetensors file (atomically). Checks first, as
/// parameters_writer does: nothing is created (not even a temporary) when it refuses.
template <class Params, class Config>
void save_parameters(const std::filesystem::path& path, const Config& cfg, const Params& p) {
    using Traits = detail::ParamsTraits<Params>;
    static_assert(std::is_same_v<Config, typename Traits::Config>,
                  "titans::io: parameters and configuration types do not match");
    detail::check_parameters(cfg, p, detail::write_source(path));
    detail::unchecked_parameters_writer(cfg, p).write(path);
}

/// Writes the parameters of a NeuralMemory, Attention-free Block or Model: the object's
/// config() and params().
template <class Object>
void save_parameters(const std::filesystem::path& path, const Object& object) {
    save_parameters(path, object.config(), object.params());
}

/// Reads the parameters `cfg` needs from a parsed file. Every expected tensor must be present
/// with the expected shape (any float dtype: F64, F32, F16, BF16, converted to T) and finite;
/// a tensor the configuration does not use is an error, so a misnamed tensor is never silently
/// ignored. The file's metadata is optional (files written by other tools), but if it has a
/// "format" it must be "titans.params". The configuration recorded in the file is not
/// compared: parameters may be loaded under other settings of the same shapes.
///
///     auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAG, 2, 64, 4, 2, 32, 256);
///     titans::Model<float> model(cfg, titans::io::load_parameters<titans::ModelParams<float>>(
///                                         "model.safetensors", cfg));
template <class Params, class Config>
[[nodiscard]] Params load_parameters(const SafetensorsFile& f, const Config& cfg) {
    using Traits = detail::ParamsTraits<Params>;
    static_assert(std::is_same_v<Config, typename Traits::Config>,
                  "titans::io: parameters and configuration types do not match");
    detail::check_format(f, "titans.params", /*required=*/false);
    Params p = Params::zeros(cfg);  // every tensor at its expected shape
    std::unordered_set<std::string> used;
    Params::tensors(p, cfg, [&](const std::string& name, auto& m) {
        detail::read_expected(f, name, m);
        used.insert(name);
    });
    detail::reject_unused(f, used, "a parameter");
    return p;
}

/// As above, reading the file at `path`.
template <class Params, class Config>
[[nodiscard]] Params load_parameters(const std::filesystem::path& path, const Config& cfg) {
    return load_parameters<Params>(SafetensorsFile::read(path), cfg);
}

}  // namespace titans::io
