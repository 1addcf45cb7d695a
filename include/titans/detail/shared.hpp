#pragma once
// titans/detail/shared.hpp: parameters held once and shared between the objects that use them.

#include <memory>
#include <utility>

#include "../error.hpp"

namespace titans::detail {

/// `p` itself, or ConfigError "<where>: params is null, expected parameters" if it is empty.
template <class P>
std::shared_ptr<const P> require_shared(std::shared_ptr<const P> p, const char* where) {
    if (!p) {
        throw ConfigError(concat(where, ": params is null, expected parameters"));
    }
    return p;
}

/// A pointer to the member `part` of *whole that keeps *whole alive (shared_ptr aliasing): how a
/// block hands its sub-layers their parameters without copying them.
template <class Whole, class Part>
std::shared_ptr<const Part> share_part(const std::shared_ptr<const Whole>& whole,
                                       const Part& part) {
    return std::shared_ptr<const Part>(whole, &part);
}

}  // namespace titans::detail
