#pragma once
// titans/activation.hpp: the Activation enum, shared by the memory, the feed-forward and the
// scalar math of detail/ (which depends on no layer's header).

#include <algorithm>
#include <iterator>
#include <string_view>

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
    // Written out rather than through detail::enum_from_string: base headers include no
    // detail/ header (tools/check_layering.sh).
    constexpr Activation all[] = {Activation::SiLU, Activation::GELU, Activation::Identity};
    const auto* it = std::find_if(std::begin(all), std::end(all),
                                  [s](Activation a) { return s == to_string(a); });
    if (it == std::end(all)) return false;
    out = *it;
    return true;
}

}  // namespace titans
