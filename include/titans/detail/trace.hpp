#pragma once
// titans/detail/trace.hpp: what identifies a training trace (math §9) and the checks every
// backward runs on one before it reads it: filled (a moved-from trace reads as empty), made by a
// layer of the same configuration (the first differing setting named) and holding the sizes its
// training forward left.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../error.hpp"
#include "../view.hpp"

namespace titans::detail {

/// Whether a trace holds a training forward's record: a bool, except that a move leaves the
/// source false, so a moved-from trace reads as empty() (its buffers were moved away).
class TraceFilled {
public:
    TraceFilled() = default;
    TraceFilled(bool filled) : filled_(filled) {}  // NOLINT: a bool in all but moves
    TraceFilled(const TraceFilled&) = default;
    TraceFilled& operator=(const TraceFilled&) = default;
    TraceFilled(TraceFilled&& o) noexcept : filled_(std::exchange(o.filled_, false)) {}
    TraceFilled& operator=(TraceFilled&& o) noexcept {
        const bool filled = std::exchange(o.filled_, false);
        filled_ = filled;  // self-move keeps the value
        return *this;
    }
    ~TraceFilled() = default;
    operator bool() const { return filled_; }  // NOLINT: reads as the bool it replaces

private:
    bool filled_ = false;
};

/// A setting's value as text: enumerators by name (to_string, found by ADL), bools as
/// true / false, numbers exactly (doubles in their shortest round-trip form).
template <class X>
[[nodiscard]] std::string setting_text(const X& x) {
    if constexpr (std::is_enum_v<X>) {
        return to_string(x);
    } else if constexpr (std::is_same_v<X, bool>) {
        return x ? "true" : "false";
    } else {
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, x);
        return std::string(buf, r.ptr);
    }
}

/// "" if `made` and `expected` agree on every setting Config::fields visits (so not on
/// MemoryConfig::flush_denormals, which changes no stored value), else the first that differs
/// as "<name> = <made's>, expected <expected's>".
template <class Config>
[[nodiscard]] std::string first_setting_difference(const Config& made, const Config& expected) {
    using Settings = std::vector<std::pair<std::string, std::string>>;
    auto settings = [](const Config& cfg) {
        Settings out;
        Config::fields(cfg, [&out](const std::string& name, const auto& value) {
            out.emplace_back(name, setting_text(value));
        });
        return out;
    };
    const Settings a = settings(made), b = settings(expected);
    for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
        if (a[i] == b[i]) {
            continue;
        }
        return a[i].first == b[i].first
                   ? concat(a[i].first, " = ", a[i].second, ", expected ", b[i].second)
                   : concat(a[i].first, " = ", a[i].second, ", expected ", b[i].first, " = ",
                            b[i].second);
    }
    return a.size() == b.size() ? std::string()
                                : concat(a.size(), " settings, expected ", b.size());
}

/// ShapeError "<where>: trace is empty, ..." unless the trace was filled by a training forward
/// (a default-constructed, moved-from or abandoned trace is not).
inline void check_trace_filled(bool filled, const char* where) {
    if (!filled) {
        throw ShapeError(concat(where, ": trace is empty, expected one filled by the training "
                                       "forward (a default-constructed or moved-from trace "
                                       "holds nothing)"));
    }
}

/// ConfigError unless the configuration a trace recorded (`made`) is this layer's, naming the
/// first differing setting: "<where>: trace was made by <maker> of another configuration
/// (<name> = <made's>, expected <this layer's>)".
template <class Config>
void check_trace_config(const Config& made, const Config& expected, const char* where,
                        const char* maker) {
    const std::string diff = first_setting_difference(made, expected);
    if (!diff.empty()) {
        throw ConfigError(concat(where, ": trace was made by ", maker,
                                 " of another configuration (", diff, ")"));
    }
}

/// ShapeError "<where>: trace.<part> = <value>, expected <expected>" unless ok: a size inside a
/// trace that its training forward would not have left.
template <class V>
void check_trace_part(bool ok, const char* where, const std::string& part, const V& value,
                      const std::string& expected) {
    if (!ok) {
        throw ShapeError(concat(where, ": trace.", part, " = ", value, ", expected ", expected));
    }
}

/// check_trace_part for a matrix part: rows x cols.
template <class M>
void check_trace_shape(const M& m, Eigen::Index rows, Eigen::Index cols, const char* where,
                       const std::string& part) {
    check_trace_part(m.rows() == rows && m.cols() == cols, where, part + " shape",
                     concat(m.rows(), " x ", m.cols()), concat(rows, " x ", cols));
}

/// check_trace_shape of a view (a buffer in a backend's memory).
template <class X>
void check_trace_shape(View<X> v, Eigen::Index rows, Eigen::Index cols, const char* where,
                       const std::string& part) {
    check_trace_part(v.rows == rows && v.cols == cols, where, part + " shape",
                     concat(v.rows, " x ", v.cols), concat(rows, " x ", cols));
}

/// The batch, rows and start position of a trace of B sequences of rows / B tokens each from
/// position `start`: B >= 1, rows a multiple of B, start >= 0 (ShapeError naming the part).
inline void check_trace_stream(int batch, Eigen::Index rows, std::int64_t start,
                               const char* where) {
    check_trace_part(batch >= 1, where, "batch", batch, ">= 1");
    check_trace_part(rows >= 0 && rows % batch == 0, where, "rows", rows,
                     concat("a multiple of trace.batch = ", batch));
    check_trace_part(start >= 0, where, "start", start, ">= 0");
}

}  // namespace titans::detail
