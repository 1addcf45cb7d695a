#pragma once
// titans/io/config_text.hpp: a configuration as canonical text ("name=value" lines) and its
// hash, to record in a file which configuration wrote it and to name the first setting that
// differs when a checkpoint does not match; and the text read back (config_from_text).

#include <charconv>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../detail/fnv1a.hpp"
#include "../models/model.hpp"

namespace titans::io {

namespace detail {

using titans::detail::Fnv1a;  // detail/fnv1a.hpp

template <class X>
[[nodiscard]] std::string format_setting(const X& x) {
    if constexpr (std::is_same_v<X, bool>) {
        return x ? "true" : "false";
    } else if constexpr (std::is_enum_v<X>) {
        return to_string(x);  // titans::to_string overloads, found by ADL
    } else if constexpr (std::is_integral_v<X>) {
        return std::to_string(x);
    } else {
        static_assert(std::is_floating_point_v<X>, "config_text: unsupported setting type");
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, x);  // shortest exact round trip
        return std::string(buf, r.ptr);
    }
}

/// Sets x from the text format_setting writes; false (x unchanged) if `text` is not one.
template <class X>
[[nodiscard]] bool parse_setting(std::string_view text, X& x) {
    if constexpr (std::is_same_v<X, bool>) {
        if (text != "true" && text != "false") return false;
        x = text == "true";
        return true;
    } else if constexpr (std::is_enum_v<X>) {
        return from_string(text, x);  // titans::from_string overloads, found by ADL
    } else {
        X v{};
        const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
        if (r.ec != std::errc{} || r.ptr != text.data() + text.size()) return false;
        x = v;
        return true;
    }
}

/// What parse_setting<X> accepts, in words.
template <class X>
[[nodiscard]] const char* setting_kind() {
    if constexpr (std::is_same_v<X, bool>) {
        return "true or false";
    } else if constexpr (std::is_enum_v<X>) {
        return "one of the names config_text writes for it";
    } else if constexpr (std::is_integral_v<X>) {
        return "an integer";
    } else {
        return "a number";
    }
}

/// The "name=value" lines of a config_text() as a map (FormatError naming `src` and the line
/// for a line without '=' or a name given twice).
[[nodiscard]] inline std::map<std::string, std::string, std::less<>> setting_lines(
    std::string_view text, const std::string& src) {
    std::map<std::string, std::string, std::less<>> out;
    while (!text.empty()) {
        const auto nl = text.find('\n');
        const std::string_view line = text.substr(0, nl);
        text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
        const auto eq = line.find('=');
        if (eq == std::string_view::npos || eq == 0) {
            throw FormatError("titans::io: " + src + ": configuration line '" +
                              std::string(line) + "', expected name=value");
        }
        const bool added = out.emplace(std::string(line.substr(0, eq)),
                                       std::string(line.substr(eq + 1))).second;
        if (!added) {
            throw FormatError("titans::io: " + src + ": configuration setting " +
                              std::string(line.substr(0, eq)) + " is given twice");
        }
    }
    return out;
}

}  // namespace detail

/// Every setting of `cfg` (MemoryConfig, AttentionConfig, FeedForwardConfig, BlockConfig or
/// ModelConfig) as "name=value\n" lines in declaration order, doubles in their shortest exact
/// form: "memory.chunk=64\nmemory.theta_max=0.01\n...". MemoryConfig::flush_denormals is
/// excluded (it changes no stored value). A ModelConfig starts with "n_blocks=<count>".
template <class Config>
[[nodiscard]] std::string config_text(const Config& cfg) {
    std::string out;
    if constexpr (std::is_same_v<Config, ModelConfig>) {
        out += "n_blocks=" + std::to_string(cfg.blocks.size()) + "\n";
    }
    Config::fields(cfg, [&out](const std::string& name, const auto& value) {
        out += name;
        out += '=';
        out += detail::format_setting(value);
        out += '\n';
    });
    return out;
}

/// FNV-1a-64 of config_text(cfg), 16 hex digits.
template <class Config>
[[nodiscard]] std::string config_hash(const Config& cfg) {
    detail::Fnv1a h;
    h.update(config_text(cfg));
    return h.hex();
}

/// A config_text() written before a setting existed, completed with the value that setting
/// must have to mean what the writer meant. After a memory's `constant_alpha` come, in order:
/// `max_grad_norm` (math §10 clipping, added after format_version 1 files were first
/// written) = 0 (off), then `momentum` and `forget` (the ablation switches) = true; each one
/// missing there is inserted. Text that has them all is returned unchanged.
[[nodiscard]] inline std::string with_legacy_settings(std::string_view text) {
    static constexpr std::pair<std::string_view, std::string_view> later[] = {
        {"max_grad_norm=", "0"}, {"momentum=", "true"}, {"forget=", "true"}};
    std::string out;
    std::size_t pos = 0;
    while (pos < text.size()) {
        const auto nl = text.find('\n', pos);
        const std::size_t end = nl == std::string_view::npos ? text.size() : nl + 1;
        const std::string_view line = text.substr(pos, end - pos);
        out += line;
        pos = end;
        const auto key_end = line.find("constant_alpha=");
        if (key_end == std::string_view::npos ||
            (key_end > 0 && line[key_end - 1] != '.')) {
            continue;
        }
        const std::string prefix(line.substr(0, key_end));
        for (const auto& [name, value] : later) {
            const std::string key = prefix + std::string(name);
            if (out.back() != '\n') out += '\n';
            if (text.substr(pos, key.size()) == key) {  // present: copy its line
                const auto e = text.find('\n', pos);
                const std::size_t stop = e == std::string_view::npos ? text.size() : e + 1;
                out += text.substr(pos, stop - pos);
                pos = stop;
            } else {
                out += key + std::string(value) + "\n";
            }
        }
    }
    return out;
}

/// The first difference between two config_text()s as "memory.chunk = 64 in <a_name>, 32 in
/// <b_name>", or "" if they are equal.
[[nodiscard]] inline std::string config_difference(std::string_view a, std::string_view b,
                                                   std::string_view a_name,
                                                   std::string_view b_name) {
    auto lines = [](std::string_view text) {
        std::vector<std::pair<std::string, std::string>> out;
        while (!text.empty()) {
            const auto nl = text.find('\n');
            const std::string_view line = text.substr(0, nl);
            const auto eq = line.find('=');
            out.emplace_back(std::string(line.substr(0, eq)),
                             eq == std::string_view::npos ? "" : std::string(line.substr(eq + 1)));
            text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
        }
        return out;
    };
    const auto la = lines(a), lb = lines(b);
    for (std::size_t i = 0; i < la.size() || i < lb.size(); ++i) {
        if (i >= la.size()) {
            return lb[i].first + " is set in " + std::string(b_name) + " but absent in " +
                   std::string(a_name);
        }
        if (i >= lb.size()) {
            return la[i].first + " is set in " + std::string(a_name) + " but absent in " +
                   std::string(b_name);
        }
        if (la[i] != lb[i]) {
            if (la[i].first != lb[i].first) {
                return "setting " + la[i].first + " in " + std::string(a_name) + " vs " +
                       lb[i].first + " in " + std::string(b_name);
            }
            return la[i].first + " = " + la[i].second + " in " + std::string(a_name) + ", " +
                   lb[i].second + " in " + std::string(b_name);
        }
    }
    return "";
}

/// The configuration `text` (a config_text() of a Config) describes: every setting parsed
/// back, so config_text(config_from_text<C>(config_text(c))) == config_text(c). Text written
/// before a setting existed is completed as with_legacy_settings does. FormatError naming
/// `src` (the file it came from) and the setting: a line that is not name=value, a setting
/// given twice, missing, not of its type (integer, number, true/false, an enum's name) or not
/// one of Config's, n_blocks (ModelConfig) not in [1, limits::max_blocks]. The result is not
/// validated (the Model or layer built from it does that).
///
///     auto cfg = titans::io::config_from_text<titans::ModelConfig>(f.metadata().at("config"),
///                                                                   f.source());
template <class Config>
[[nodiscard]] Config config_from_text(std::string_view text, const std::string& src) {
    auto lines = detail::setting_lines(with_legacy_settings(text), src);
    const auto missing = [&src](const std::string& name) {
        return FormatError("titans::io: " + src + ": configuration setting " + name +
                           " is missing");
    };
    Config cfg;
    std::size_t used = 0;
    if constexpr (std::is_same_v<Config, ModelConfig>) {
        const auto it = lines.find("n_blocks");
        if (it == lines.end()) throw missing("n_blocks");
        int n = 0;
        if (!detail::parse_setting(it->second, n) || n < 1 || n > limits::max_blocks) {
            throw FormatError("titans::io: " + src + ": configuration setting n_blocks = " +
                              it->second + ", expected an integer in [1, " +
                              std::to_string(limits::max_blocks) + "]");
        }
        cfg.blocks.resize(static_cast<std::size_t>(n));
        ++used;
    }
    Config::fields(cfg, [&](const std::string& name, auto& value) {
        const auto it = lines.find(name);
        if (it == lines.end()) throw missing(name);
        if (!detail::parse_setting(it->second, value)) {
            throw FormatError("titans::io: " + src + ": configuration setting " + name + " = " +
                              it->second + ", expected " +
                              detail::setting_kind<std::decay_t<decltype(value)>>());
        }
        ++used;
    });
    if (used != lines.size()) {
        // A plain reference, not a structured binding: clang 14 cannot capture one in a lambda.
        for (const auto& entry : lines) {
            const std::string& name = entry.first;
            bool known = name == "n_blocks" && std::is_same_v<Config, ModelConfig>;
            Config::fields(cfg, [&](const std::string& n, const auto&) { known |= n == name; });
            if (!known) {
                throw FormatError("titans::io: " + src + ": configuration setting " + name +
                                  " is not a setting of this configuration");
            }
        }
    }
    return cfg;
}

}  // namespace titans::io
