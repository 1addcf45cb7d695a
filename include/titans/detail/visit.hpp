#pragma once
// titans/detail/visit.hpp: helpers of the serialization visitors (the static fields() and
// tensors() of configs, parameters and states).
//
// A visitor is any callable v(name, x): name is a std::string, x a reference to the member
// (a setting, a Matrix<T> / RowVector<T>, or a std::int64_t position), const when the visited
// object is. Nested parts are visited through prefixed(), so a block's memory weight w_q
// reaches v as "memory.w_q".

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace titans::detail {

/// Calls v(prefix + "." + name, x). Holds a reference to v, which must outlive it.
template <class V>
class PrefixedVisitor {
public:
    PrefixedVisitor(std::string prefix, V& v) : prefix_(std::move(prefix)), v_(v) {}

    template <class X>
    void operator()(std::string_view name, X&& x) const {
        std::string full;
        full.reserve(prefix_.size() + 1 + name.size());
        full.append(prefix_).append(1, '.').append(name);
        v_(static_cast<const std::string&>(full), std::forward<X>(x));
    }

private:
    std::string prefix_;
    V& v_;
};

/// The visitor v with every name prefixed by `prefix + "."`.
template <class V>
[[nodiscard]] PrefixedVisitor<V> prefixed(std::string prefix, V& v) {
    return PrefixedVisitor<V>(std::move(prefix), v);
}

/// A dotted name from parts: visit_name("heads", 0, 2, "w", 1) == "heads.0.2.w.1".
template <class... Parts>
[[nodiscard]] std::string visit_name(const Parts&... parts) {
    std::string out;
    auto add = [&out](const auto& p) {
        if (!out.empty()) out += '.';
        if constexpr (std::is_convertible_v<decltype(p), std::string_view>) {
            out += std::string_view(p);
        } else {
            out += std::to_string(p);
        }
    };
    (add(parts), ...);
    return out;
}

}  // namespace titans::detail
