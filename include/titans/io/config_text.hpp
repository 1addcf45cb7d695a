#pragma once
// titans/io/config_text.hpp: a configuration as canonical text ("name=value" lines) and its
// hash, to record in a file which configuration wrote it and to name the first setting that
// differs when a checkpoint does not match.

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../models/model.hpp"

namespace titans::io {

namespace detail {

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

/// FNV-1a, 64 bits: a fingerprint (not a cryptographic hash).
class Fnv1a {
public:
    void update(const void* data, std::size_t n) {
        const auto* p = static_cast<const unsigned char*>(data);
        for (std::size_t i = 0; i < n; ++i) {
            h_ = (h_ ^ p[i]) * 0x100000001b3ull;
        }
    }
    void update(std::string_view s) { update(s.data(), s.size()); }
    [[nodiscard]] std::uint64_t value() const { return h_; }
    [[nodiscard]] std::string hex() const {
        static constexpr char digits[] = "0123456789abcdef";
        std::string s(16, '0');
        for (int i = 0; i < 16; ++i) s[15 - i] = digits[(h_ >> (4 * i)) & 0xF];
        return s;
    }

private:
    std::uint64_t h_ = 0xcbf29ce484222325ull;
};

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
/// must have to mean what the writer meant: `max_grad_norm` (math §10 clipping, added after
/// format_version 1 files were first written) is 0 (off) where a memory's settings lack it.
/// Text that has it is returned unchanged.
[[nodiscard]] inline std::string with_legacy_settings(std::string_view text) {
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
        const std::string next = prefix + "max_grad_norm=";
        if (text.substr(pos, next.size()) != next) {
            if (out.back() != '\n') out += '\n';
            out += next + "0\n";
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

}  // namespace titans::io
