#pragma once
// titans/detail/enum_names.hpp: the inverse of an enum's to_string, shared by every enum.

#include <initializer_list>
#include <string_view>

namespace titans::detail {

/// Sets `out` to the enumerator of `all` whose to_string (found by ADL) is `s` and returns
/// true; returns false and leaves `out` unchanged if none is.
template <class E>
[[nodiscard]] bool enum_from_string(std::string_view s, E& out, std::initializer_list<E> all) {
    for (E e : all) {
        if (s == to_string(e)) {
            out = e;
            return true;
        }
    }
    return false;
}

}  // namespace titans::detail
