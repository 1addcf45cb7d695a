#pragma once
// titans/io/dtype.hpp: the element types of the safetensors format, their names and sizes, and
// the exact conversions of the 16-bit float formats (F16, BF16) to float.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

namespace titans::io {

/// The element types of the safetensors format. F64, F32, F16 and BF16 convert to float or
/// double; I64 and I32 read as integers; the others are recognised (so their sizes validate)
/// but not convertible.
enum class DType : std::uint8_t { BOOL, U8, I8, F8_E4M3, F8_E5M2, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64 };

namespace detail {
struct DTypeInfo {
    DType dtype;
    const char* name;
    std::size_t size;
};
inline constexpr DTypeInfo dtype_table[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},   {DType::I8, "I8", 1},
    {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::U16, "U16", 2},   {DType::I16, "I16", 2}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::U32, "U32", 4}, {DType::I32, "I32", 4},
    {DType::F32, "F32", 4},   {DType::U64, "U64", 8}, {DType::I64, "I64", 8},
    {DType::F64, "F64", 8},
};
}  // namespace detail

[[nodiscard]] inline const char* to_string(DType t) {
    for (const auto& e : detail::dtype_table) {
        if (e.dtype == t) return e.name;
    }
    return "?";
}
/// Bytes per element.
[[nodiscard]] inline std::size_t dtype_size(DType t) {
    for (const auto& e : detail::dtype_table) {
        if (e.dtype == t) return e.size;
    }
    return 0;
}
/// The dtype named `s` ("F32", ...), or nullopt for a name the format does not define.
[[nodiscard]] inline std::optional<DType> dtype_from_string(std::string_view s) {
    for (const auto& e : detail::dtype_table) {
        if (s == e.name) return e.dtype;
    }
    return std::nullopt;
}
/// The dtype a Matrix<T> is written as.
template <class T>
[[nodiscard]] constexpr DType dtype_of() {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "titans::io: only float and double tensors are written");
    return std::is_same_v<T, float> ? DType::F32 : DType::F64;
}

/// IEEE binary16 bits -> float (exact: every half is a float), subnormals, infinities and NaN
/// included.
[[nodiscard]] inline float half_to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1Fu;
    std::uint32_t mant = h & 0x3FFu;
    std::uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);  // inf / NaN (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
    } else if (mant == 0) {
        bits = sign;  // signed zero
    } else {
        // Subnormal half: mant * 2^-24. Normalise: shift until the implicit bit (0x400) is set.
        int e = -1;
        do {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400u) == 0);
        bits = sign | (static_cast<std::uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
    }
    return std::bit_cast<float>(bits);
}

/// bfloat16 bits -> float (exact: bf16 is the top half of a float).
[[nodiscard]] inline float bfloat16_to_float(std::uint16_t b) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace titans::io
