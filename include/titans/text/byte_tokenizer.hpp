#pragma once
// titans/text/byte_tokenizer.hpp: text as bytes, one token per byte (vocabulary 256).
//
// Any byte string round-trips: NUL, 0xFF and invalid UTF-8 are tokens like any other. A
// multi-byte UTF-8 character is several tokens; the model learns to put them together.

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../error.hpp"

namespace titans::text {

/// Bytes <-> token ids: byte b (as unsigned char) is id b, so ids are in [0, 256).
///
///     std::vector<int> ids = titans::text::ByteTokenizer::encode("To be");  // {84, 111, ...}
///     std::string s = titans::text::ByteTokenizer::decode(ids);             // "To be"
struct ByteTokenizer {
    /// The number of ids: a model over bytes has ModelConfig::vocab_size = 256.
    static constexpr int vocab_size = 256;

    /// One id per byte of `bytes`, in order.
    [[nodiscard]] static std::vector<int> encode(std::string_view bytes) {
        std::vector<int> ids(bytes.size());
        for (std::size_t i = 0; i < bytes.size(); ++i) {
            ids[i] = static_cast<unsigned char>(bytes[i]);
        }
        return ids;
    }

    /// The byte of `id`. ShapeError naming the id unless it is in [0, 256).
    [[nodiscard]] static char decode(int id) {
        detail::require<ShapeError>(id >= 0 && id < vocab_size, "ByteTokenizer::decode",
                                    "token id", id, "in [0, 256)");
        return static_cast<char>(static_cast<unsigned char>(id));
    }

    /// The bytes of `ids`, in order. ShapeError naming the first id outside [0, 256) (and its
    /// index); nothing is returned then.
    [[nodiscard]] static std::string decode(std::span<const int> ids) {
        std::string bytes(ids.size(), '\0');
        for (std::size_t i = 0; i < ids.size(); ++i) {
            detail::require<ShapeError>(ids[i] >= 0 && ids[i] < vocab_size,
                                        "ByteTokenizer::decode",
                                        detail::concat("ids[", i, "]").c_str(), ids[i],
                                        "in [0, 256)");
            bytes[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
        }
        return bytes;
    }
};

}  // namespace titans::text
