#pragma once
// titans/detail/fnv1a.hpp: FNV-1a-64, the fingerprint files record of what wrote them and the
// ranks of a data-parallel run compare.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace titans::detail {

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

/// Adds one setting of a configuration's fields() visitor to a fingerprint: its name, then its
/// value (arithmetic, bool or enum) as a double.
template <class V>
void add_setting(Fnv1a& h, const std::string& name, const V& v) {
    double x = 0;
    if constexpr (std::is_enum_v<V>) {
        x = static_cast<double>(static_cast<long long>(v));
    } else {
        x = static_cast<double>(v);
    }
    h.update(name);
    h.update(&x, sizeof x);
}

}  // namespace titans::detail
