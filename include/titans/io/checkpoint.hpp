#pragma once
// titans/io/checkpoint.hpp: checkpoint and restore of a stream's whole state (memory weights,
// momentum, pending chunk rows, conv tails, attention KV buffers, MAC segment buffers,
// positions), so a stream stopped and resumed produces bit-identical outputs to one that never
// stopped. Layout and checks: docs/formats.md.

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "../backend/cpu/cpu.hpp"  // io works on any backend; the CPU one comes with it
#include "../models/model.hpp"
#include "config_text.hpp"
#include "metadata.hpp"
#include "parameters.hpp"
#include "safetensors.hpp"

namespace titans::io {

namespace detail {

/// Positions beyond 2^62 would overflow as the stream advances: reject them (the library-wide
/// limit, titans/limits.hpp; forward refuses to pass it too).
using titans::limits::max_position;

[[noreturn]] inline void inconsistent(const std::string& src, const std::string& name,
                                      std::int64_t value, const std::string& expected) {
    throw FormatError("titans::io: " + src + ": " + name + " = " + std::to_string(value) +
                      ", expected " + expected + " (inconsistent checkpoint)");
}

inline void check_position(std::int64_t p, const std::string& name, const std::string& src) {
    if (p < 0 || p > max_position) {
        inconsistent(src, name, p, "a value in [0, 2^62]");
    }
}

/// The relations make_state() and forward() keep between a block's positions and buffers
/// (a checkpoint that breaks them was not written by this library and could make the hot
/// loops read outside their buffers).
template <class T, class B>
void check_block(const Block<T, B>& block, const BlockState<T, B>& st, const std::string& prefix,
                 const std::string& src) {
    const BlockConfig& cfg = block.config();
    const std::int64_t pos = st.position();
    check_position(pos, prefix + "position", src);
    const std::int64_t np = cfg.n_persistent;
    const bool prefix_streamed = cfg.kind == BlockKind::MAG || cfg.kind == BlockKind::MAL;
    const std::int64_t mem_pos = pos + (prefix_streamed ? np : 0);
    if (has_memory(cfg.kind) && st.memory().position() != mem_pos) {
        inconsistent(src, prefix + "memory.position", st.memory().position(),
                     std::to_string(mem_pos));
    }
    if (has_window(cfg.kind)) {
        const auto& a = st.attention();
        const std::int64_t att_pos = pos + (cfg.kind == BlockKind::MAL ? np : 0);
        if (a.position() != att_pos) {
            inconsistent(src, prefix + "attention.position", a.position(),
                         std::to_string(att_pos));
        }
        const std::int64_t kept = std::min<std::int64_t>(cfg.attention.window - 1, att_pos);
        // A malformed state (just loaded, sequences of unequal lengths) holds what was read.
        for (int b = 0; b < st.batch(); ++b) {
            const auto [k_rows, v_rows] = a.window_rows(b);
            if (k_rows != kept || v_rows != kept) {
                inconsistent(src, prefix + "attention.k/v." + std::to_string(b) + " rows",
                             k_rows != kept ? k_rows : v_rows,
                             std::to_string(kept) + " = min(window - 1, attention.position)");
            }
        }
    }
}

template <class Object>
struct CheckpointTraits;

template <class T, class B>
struct CheckpointTraits<NeuralMemory<T, B>> {
    using Scalar = T;
    using State = typename NeuralMemory<T, B>::State;
    static constexpr const char* object = "memory";
    static int batch(const State& st) { return st.batch(); }
    static void check_structure(const NeuralMemory<T, B>& mem, const State& st) {
        mem.validate_state(st);
    }
    static void check(const NeuralMemory<T, B>&, const State& st, const std::string& src) {
        check_position(st.position(), "position", src);
    }
};

template <class T, class B>
struct CheckpointTraits<Block<T, B>> {
    using Scalar = T;
    static constexpr const char* object = "block";
    static int batch(const BlockState<T, B>& st) { return st.batch(); }
    static void check_structure(const Block<T, B>& block, const BlockState<T, B>& st) {
        block.validate_state(st);
    }
    static void check(const Block<T, B>& block, const BlockState<T, B>& st,
                      const std::string& src) {
        check_block(block, st, "", src);
    }
};

template <class T, class B>
struct CheckpointTraits<Model<T, B>> {
    using Scalar = T;
    static constexpr const char* object = "model";
    static int batch(const ModelState<T, B>& st) { return st.batch; }
    /// What validate_state checks but the positions (check() reports those as the loader does).
    static void check_structure(const Model<T, B>& model, const ModelState<T, B>& st) {
        if (st.blocks.size() != model.blocks().size()) {
            model.validate_state(st);  // throws: made for another model
        }
        for (std::size_t i = 0; i < st.blocks.size(); ++i) {
            model.blocks()[i].validate_state(st.blocks[i]);
        }
    }
    static void check(const Model<T, B>& model, const ModelState<T, B>& st,
                      const std::string& src) {
        check_position(st.position, "position", src);
        for (std::size_t i = 0; i < st.blocks.size(); ++i) {
            const std::string prefix = "blocks." + std::to_string(i) + ".";
            check_block(model.blocks()[i], st.blocks[i], prefix, src);
            if (st.blocks[i].position() != st.position) {
                inconsistent(src, prefix + "position", st.blocks[i].position(),
                             "position = " + std::to_string(st.position));
            }
        }
    }
};

/// True for the tensors whose row count follows the position (attention KV history).
inline bool variable_rows(std::string_view name) {
    // "...attention.k.<b>" or "...attention.v.<b>"
    const auto last = name.rfind('.');
    if (last == std::string_view::npos) return false;
    const std::string_view head = name.substr(0, last);
    return head.ends_with("attention.k") || head.ends_with("attention.v");
}

inline int parse_batch(const std::string& text, const std::string& src) {
    int b = 0;
    const auto r = std::from_chars(text.data(), text.data() + text.size(), b);
    if (r.ec != std::errc{} || r.ptr != text.data() + text.size() || b < 1 || b > 1'000'000) {
        throw FormatError("titans::io: " + src + ": __metadata__ batch = \"" + text +
                          "\", expected an integer in [1, 1000000]");
    }
    return b;
}

/// Refuses, before anything is written, a state that load_checkpoint would refuse for
/// `object`, with the same error type: one this object cannot continue (ConfigError, from
/// object.validate_state), a batch outside [1, 1000000] or positions and buffers that
/// contradict each other (FormatError), a NaN or infinite value (NonFiniteError). `src` names
/// the destination in the messages.
template <class Object>
void check_checkpoint(const Object& object, const typename Object::State& state,
                      const std::string& src) {
    using Traits = CheckpointTraits<Object>;
    using State = typename Object::State;
    const std::string prefix = "titans::io: " + src + ": ";
    with_context(prefix, [&] {
        object.config().validate();
        Traits::check_structure(object, state);  // first: check() reads this object's buffers
    });
    (void)parse_batch(std::to_string(Traits::batch(state)), src);
    Traits::check(object, state, src);
    with_context(prefix, [&] { object.validate_state(state); });
    State::tensors(state, [&prefix](const std::string& name, const auto& x) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(x)>, std::int64_t>) {
            if (!titans::detail::all_finite(x)) {
                throw NonFiniteError(prefix + "tensor '" + name + "' has a NaN or infinite value");
            }
        }
    });
}

/// The writer of checkpoint_writer, without the checks.
template <class Object>
[[nodiscard]] SafetensorsWriter unchecked_checkpoint_writer(const Object& object,
                                                            const typename Object::State& state) {
    using Traits = CheckpointTraits<Object>;
    using T = typename Traits::Scalar;
    SafetensorsWriter w;
    w.metadata("format", "titans.checkpoint");
    w.metadata("format_version", std::to_string(format_version));
    w.metadata("object", Traits::object);
    w.metadata("dtype", to_string(dtype_of<T>()));
    w.metadata("batch", std::to_string(Traits::batch(state)));
    w.metadata("config", config_text(object.config()));
    w.metadata("config_hash", config_hash(object.config()));
    w.metadata("params_hash", params_hash(object.params(), object.config()));
    w.metadata("titans_version", version_string());
    using State = typename Object::State;
    State::tensors(state, [&w](const std::string& name, const auto& x) {
        if constexpr (std::is_same_v<std::decay_t<decltype(x)>, std::int64_t>) {
            w.add_integers(name, std::span<const std::int64_t>(&x, 1));
        } else {
            w.add(name, x);
        }
    });
    return w;
}

}  // namespace detail

/// A safetensors writer holding a stream's state. Metadata: format "titans.checkpoint",
/// format_version, object ("memory", "block", "model"), dtype, batch, config (config_text),
/// config_hash, params_hash (fingerprint of the outer parameters), titans_version.
/// Object: NeuralMemory<T>, Block<T> or Model<T>; state: a state it made. Refuses what
/// restore_checkpoint would refuse, with the same error type: a state this object cannot
/// continue (ConfigError), contradicting positions or buffers (FormatError), NaN or infinity
/// (NonFiniteError).
template <class Object>
[[nodiscard]] SafetensorsWriter checkpoint_writer(const Object& object,
                                                  const typename Object::State& state) {
    detail::check_checkpoint(object, state, "checkpoint_writer");
    return detail::unchecked_checkpoint_writer(object, state);
}

/// Writes a checkpoint of `state` (atomically: a crash while writing keeps the previous file).
/// Checks first, as checkpoint_writer does: nothing is created (not even a temporary) when it
/// refuses.
template <class Object>
void save_checkpoint(const std::filesystem::path& path, const Object& object,
                     const typename Object::State& state) {
    detail::check_checkpoint(object, state, detail::write_source(path));
    detail::unchecked_checkpoint_writer(object, state).write(path);
}

namespace detail {

/// restore_checkpoint's metadata checks (format, object kind, dtype, configuration,
/// config_hash, params_hash); returns the recorded batch.
template <class Object>
int check_checkpoint_metadata(const SafetensorsFile& f, const Object& object) {
    using Traits = CheckpointTraits<Object>;
    using T = typename Traits::Scalar;
    const std::string& src = f.source();
    check_format(f, "titans.checkpoint", /*required=*/true);
    const auto meta = [&f](const char* key) { return metadata_value(f, key); };
    if (const std::string o = meta("object"); o != Traits::object) {
        throw ConfigError("titans::io: " + src + ": checkpoint of a " + o + ", expected a " +
                          Traits::object);
    }
    if (const std::string d = meta("dtype"); d != to_string(dtype_of<T>())) {
        throw ConfigError("titans::io: " + src + ": checkpoint dtype " + d + ", expected " +
                          to_string(dtype_of<T>()) + " (a state restores only at the precision "
                          "it was written in)");
    }
    check_recorded_config(f, config_text(object.config()), "checkpoint", "the checkpoint",
                          "this object");
    if (meta("params_hash") != params_hash(object.params(), object.config())) {
        throw ConfigError("titans::io: " + src + ": checkpoint was written with other outer "
                          "parameters (params_hash differs): load the parameters it was "
                          "written with");
    }
    return parse_batch(meta("batch"), src);
}

/// Every fixed-shape state tensor belongs to one stream, so a state of `batch` streams holds
/// batch times the bytes of a one-stream state. Before allocating it, make sure the file
/// holds at least half that, so a hostile batch number cannot make us allocate more than
/// about twice the file's size. (A file that merely lacks some tensors passes here and is
/// rejected later, naming the first missing.)
template <class Object>
void check_state_size(const SafetensorsFile& f, const Object& object, int batch) {
    using T = typename CheckpointTraits<Object>::Scalar;
    using State = typename Object::State;
    std::uint64_t per_stream = 0;
    const State one = object.make_state(1);
    State::tensors(one, [&per_stream](const std::string& name, const auto& x) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(x)>, std::int64_t>) {
            if (!variable_rows(name)) {
                per_stream += static_cast<std::uint64_t>(x.size()) * sizeof(T);
            }
        }
    });
    const std::uint64_t need = per_stream * static_cast<std::uint64_t>(batch);
    std::uint64_t have = 0;
    for (const TensorInfo& t : f.tensors()) have += t.end - t.begin;
    if (have < need / 2) {
        throw FormatError("titans::io: " + f.source() + ": __metadata__ batch = " +
                          std::to_string(batch) + " needs " + std::to_string(need) +
                          " bytes of state, the file holds only " + std::to_string(have) +
                          " (truncated or corrupt checkpoint)");
    }
}

/// One state entry `x` (an int64 or a matrix of T) from the tensor `name`, checking its
/// dtype and shape (the rows of a window buffer may vary).
template <class T, class X>
void load_state_entry(const SafetensorsFile& f, const std::string& name, X& x) {
    const std::string& src = f.source();
    const TensorInfo& t = f.at(name);
    if constexpr (std::is_same_v<X, std::int64_t>) {
        if (t.dtype != DType::I64 || t.numel() != 1) {
            throw FormatError("titans::io: " + src + ": tensor '" + name + "' is " +
                              to_string(t.dtype) + " " + t.shape_string() + ", expected I64 [1]");
        }
        x = f.integers(name)[0];
    } else {
        if (t.dtype != dtype_of<T>()) {
            throw FormatError("titans::io: " + src + ": tensor '" + name + "' is " +
                              to_string(t.dtype) + ", expected " + to_string(dtype_of<T>()));
        }
        const bool rows_free = variable_rows(name);
        const auto& s = t.shape;
        const bool ok = s.size() == 2 && s[1] == static_cast<std::uint64_t>(x.cols()) &&
                        (rows_free || s[0] == static_cast<std::uint64_t>(x.rows()));
        if (!ok) {
            throw ShapeError("titans::io: " + src + ": tensor '" + name + "' has shape " +
                             t.shape_string() + ", expected " +
                             (rows_free ? "[rows, " + std::to_string(x.cols()) + "]"
                                        : shape_text(x.rows(), x.cols(), false)));
        }
        x = f.matrix<T>(name);
    }
}

}  // namespace detail

/// Restores a stream state from a parsed checkpoint, for `object`. Rejects, naming the cause:
/// a file that is not a titans checkpoint or has another format_version (FormatError); another
/// object kind, dtype, configuration (naming the first differing setting) or other outer
/// parameters (ConfigError); a missing, unexpected, wrongly typed or wrongly shaped tensor,
/// NaN/Inf, or positions and buffers that contradict each other (FormatError / ShapeError /
/// NonFiniteError). The restored state continues bit-identically.
template <class Object>
[[nodiscard]] typename Object::State restore_checkpoint(const SafetensorsFile& f,
                                                        const Object& object) {
    using Traits = detail::CheckpointTraits<Object>;
    using State = typename Object::State;
    const int batch = detail::check_checkpoint_metadata(f, object);
    detail::check_state_size(f, object, batch);
    State st = object.make_state(batch);
    std::unordered_set<std::string> used;
    State::tensors(st, [&](const std::string& name, auto& x) {
        detail::load_state_entry<typename Traits::Scalar>(f, name, x);
        used.insert(name);
    });
    detail::reject_unused(f, used, "part of the state");
    Traits::check(object, st, f.source());
    return st;
}

/// As above, reading the file at `path`.
template <class Object>
[[nodiscard]] typename Object::State load_checkpoint(const std::filesystem::path& path,
                                                     const Object& object) {
    return restore_checkpoint(SafetensorsFile::read(path), object);
}

}  // namespace titans::io
