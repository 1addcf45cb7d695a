#pragma once
// titans/activation.hpp: the Activation enum, shared by the memory, the feed-forward and the
// scalar math of detail/ (which depends on no layer's header).

#include <string_view>

#include "detail/enum_names.hpp"

namespace titans {

/// Element-wise nonlinearity. The memory MLP uses SiLU or GELU (exact, erf-based); the q/k/v
/// projections use SiLU or Identity (math §1-2).
enum class Activation { SiLU, GELU, Identity };

[[nodiscard]] inline const char* to_string(Activation a) {
    switch (a) {
        case Activation::SiLU: return "SiLU";
        case Activation::GELU: return "GELU";
        case Activation::Identity: return "Identity";
    }
    return "?";
}

/// Inverse of to_string: sets `out` and returns true if `s` is an enumerator's name (exact,
/// case-sensitive); leaves `out` unchanged and returns false otherwise.
[[nodiscard]] inline bool from_string(std::string_view s, Activation& out) {
    return detail::enum_from_string(s, out,
                                    {Activation::SiLU, Activation::GELU, Activation::Identity});
}

}  // namespace titans
