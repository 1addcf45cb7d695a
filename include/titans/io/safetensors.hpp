#pragma once
// titans/io/safetensors.hpp: a strict reader and a writer of the safetensors format.
//
// The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian unsigned header
// length n, n bytes of UTF-8 JSON
//     {"__metadata__": {"key": "value", ...},
//      "name": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, ...}
// then the data section: every tensor's bytes, little-endian and row-major, at
// [begin, end) relative to the start of the data section. The reader treats the file as
// untrusted (docs/formats.md lists every check): every failure is a titans::FormatError that
// names the source, the tensor and the problem; no read ever leaves the buffer.
//
// Requires nlohmann/json (Debian: nlohmann-json3-dev): link titans::io, not just titans::titans.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#if __has_include(<unistd.h>)
#include <unistd.h>  // fsync, getpid
#define TITANS_IO_HAVE_FSYNC 1
#endif

#include "../detail/float_env.hpp"
#include "../error.hpp"
#include "../types.hpp"

static_assert(std::endian::native == std::endian::little,
              "titans/io: safetensors data is little-endian; big-endian hosts are not supported");

namespace titans::io {

/// The element types of the safetensors format. F64, F32, F16 and BF16 convert to float or
/// double; I64 and I32 read as integers; the others are recognised (so their sizes validate)
/// but not convertible.
enum class DType : std::uint8_t { BOOL, U8, I8, F8_E4M3, F8_E5M2, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64 };

namespace detail {

/// A suffix unlikely to collide between processes and calls: time, a counter and an address.
inline std::string unique_suffix() {
    static std::atomic<std::uint64_t> counter{0};
    const auto t = static_cast<std::uint64_t>(
        std::chrono::steady_clock::now().time_since_epoch().count());
    std::uint64_t h = t ^ (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull) ^
                      reinterpret_cast<std::uintptr_t>(&counter);
#if defined(TITANS_IO_HAVE_FSYNC)
    h ^= static_cast<std::uint64_t>(::getpid()) << 32;
#endif
    static constexpr char digits[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 0; i < 16; ++i) s[15 - i] = digits[(h >> (4 * i)) & 0xF];
    return s;
}

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

/// One tensor of a safetensors file: its dtype, shape and byte range within the data section.
struct TensorInfo {
    std::string name;
    DType dtype = DType::F32;
    std::vector<std::uint64_t> shape;
    std::uint64_t begin = 0, end = 0;

    /// Product of the shape (1 for a scalar, shape []).
    [[nodiscard]] std::uint64_t numel() const {
        std::uint64_t n = 1;
        for (auto s : shape) n *= s;  // cannot overflow: checked when the file was parsed
        return n;
    }
    /// "[2, 3]"
    [[nodiscard]] std::string shape_string() const {
        std::string s = "[";
        for (std::size_t i = 0; i < shape.size(); ++i) {
            s += (i ? ", " : "") + std::to_string(shape[i]);
        }
        return s + "]";
    }
};

/// Limits on what the reader accepts (beyond them a file is rejected, not read).
struct ReadLimits {
    std::uint64_t max_header_bytes = 100'000'000;  ///< the reference implementation's limit
    std::size_t max_rank = 8;                      ///< dimensions per tensor
    int max_json_depth = 4;                        ///< nesting: file > tensor > shape array
};

/// A parsed safetensors file held in memory. Construction validates everything (header
/// length, JSON, duplicate keys, dtypes, shapes, overflow, offsets in range, contiguous and
/// non-overlapping, covering the data section exactly); afterwards every accessor is safe.
///
///     auto f = titans::io::SafetensorsFile::read("weights.safetensors");
///     titans::Matrixf w = f.matrix<float>("blocks.0.memory.w_q");   // F32/F64/F16/BF16 -> float
///     std::string fmt = f.metadata_or("format", "");
class SafetensorsFile {
public:
    /// Parses `bytes` (the whole file). `source` names it in error messages.
    explicit SafetensorsFile(std::vector<std::byte> bytes, std::string source = "<memory>",
                             ReadLimits limits = {})
        : bytes_(std::move(bytes)), source_(std::move(source)) {
        parse(limits);
    }

    /// Reads and parses a file. FileError if it cannot be read, FormatError if malformed.
    [[nodiscard]] static SafetensorsFile read(const std::filesystem::path& path,
                                              ReadLimits limits = {}) {
        std::error_code dir_ec;
        if (std::filesystem::is_directory(path, dir_ec)) {
            // An ifstream opens a directory on Linux and tellg() reports a bogus size there.
            throw FileError("titans::io: cannot read '" + path.string() + "': it is a directory");
        }
        std::ifstream in(path, std::ios::binary | std::ios::ate);
        if (!in) {
            throw FileError("titans::io: cannot open '" + path.string() +
                            "' for reading: " + std::generic_category().message(errno));
        }
        const std::streamoff size = in.tellg();
        if (size < 0) {
            throw FileError("titans::io: cannot determine the size of '" + path.string() + "'");
        }
        std::vector<std::byte> bytes;
        try {
            bytes.resize(static_cast<std::size_t>(size));
        } catch (const std::exception&) {  // bad_alloc / length_error: a bogus or huge size
            throw FileError("titans::io: cannot read '" + path.string() + "': " +
                            std::to_string(size) + " bytes do not fit in memory");
        }
        in.seekg(0);
        in.read(reinterpret_cast<char*>(bytes.data()), size);
        if (in.gcount() != size) {
            throw FileError("titans::io: short read from '" + path.string() + "': got " +
                            std::to_string(in.gcount()) + " of " + std::to_string(size) +
                            " bytes");
        }
        return SafetensorsFile(std::move(bytes), path.string(), limits);
    }

    /// Where the bytes came from (a path or "<memory>").
    [[nodiscard]] const std::string& source() const { return source_; }
    /// Every tensor, in data-offset order.
    [[nodiscard]] const std::vector<TensorInfo>& tensors() const { return tensors_; }
    /// The "__metadata__" map (empty if the file has none).
    [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }
    [[nodiscard]] std::string metadata_or(const std::string& key, std::string fallback) const {
        const auto it = metadata_.find(key);
        return it == metadata_.end() ? std::move(fallback) : it->second;
    }

    /// The tensor named `name`, or nullptr.
    [[nodiscard]] const TensorInfo* find(std::string_view name) const {
        const auto it = index_.find(std::string(name));
        return it == index_.end() ? nullptr : &tensors_[it->second];
    }
    /// The tensor named `name`; FormatError if there is none.
    [[nodiscard]] const TensorInfo& at(std::string_view name) const {
        const TensorInfo* t = find(name);
        if (t == nullptr) {
            fail(std::string("tensor '") + std::string(name) + "' is missing");
        }
        return *t;
    }
    /// The raw bytes of a tensor (inside the buffer by construction).
    [[nodiscard]] std::span<const std::byte> data(const TensorInfo& t) const {
        return {bytes_.data() + data_start_ + t.begin, static_cast<std::size_t>(t.end - t.begin)};
    }

    /// A tensor of rank 0, 1 or 2 as a rows x cols matrix (rank 0: 1 x 1, rank 1 [n]: 1 x n),
    /// converted from F64, F32, F16 or BF16. FormatError for another dtype or rank,
    /// NonFiniteError (naming the tensor) if a value is NaN or infinite.
    template <class T>
    [[nodiscard]] Matrix<T> matrix(std::string_view name) const {
        const TensorInfo& t = at(name);
        if (t.shape.size() > 2) {
            fail("tensor '" + t.name + "' has rank " + std::to_string(t.shape.size()) +
                 " (shape " + t.shape_string() + "), expected rank 0, 1 or 2");
        }
        const std::uint64_t rows = t.shape.size() == 2 ? t.shape[0] : 1;
        const std::uint64_t cols = t.shape.empty() ? 1 : t.shape.back();
        const std::uint64_t limit = static_cast<std::uint64_t>(std::numeric_limits<Eigen::Index>::max());
        if (rows > limit || cols > limit) {
            fail("tensor '" + t.name + "' shape " + t.shape_string() + " is too large");
        }
        Matrix<T> m(static_cast<Eigen::Index>(rows), static_cast<Eigen::Index>(cols));
        convert(t, m.data());
        if (!titans::detail::all_finite(m)) {
            throw NonFiniteError("titans::io: " + source_ + ": tensor '" + t.name +
                                 "' has a NaN or infinite value");
        }
        return m;
    }

    /// An integer tensor (I64 or I32, any shape) flattened.
    [[nodiscard]] std::vector<std::int64_t> integers(std::string_view name) const {
        const TensorInfo& t = at(name);
        const auto raw = data(t);
        std::vector<std::int64_t> out(static_cast<std::size_t>(t.numel()));
        if (t.dtype == DType::I64) {
            if (!out.empty()) std::memcpy(out.data(), raw.data(), raw.size());
        } else if (t.dtype == DType::I32) {
            for (std::size_t i = 0; i < out.size(); ++i) {
                std::int32_t v;
                std::memcpy(&v, raw.data() + 4 * i, 4);
                out[i] = v;
            }
        } else {
            fail("tensor '" + t.name + "' has dtype " + to_string(t.dtype) +
                 ", expected I64 or I32");
        }
        return out;
    }

private:
    using json = nlohmann::json;

    [[noreturn]] void fail(const std::string& what) const {
        throw FormatError("titans::io: " + source_ + ": " + what);
    }

    template <class T>
    void convert(const TensorInfo& t, T* out) const {
        const std::byte* p = bytes_.data() + data_start_ + t.begin;
        const std::size_t n = static_cast<std::size_t>(t.numel());
        switch (t.dtype) {
            case DType::F64:
                for (std::size_t i = 0; i < n; ++i) {
                    double v;
                    std::memcpy(&v, p + 8 * i, 8);
                    if constexpr (std::is_same_v<T, float>) {
                        // A double beyond float's range: infinity (rejected as non-finite),
                        // not the undefined behaviour of an out-of-range conversion.
                        constexpr double fmax = std::numeric_limits<float>::max();
                        if (v > fmax || v < -fmax) {
                            v = v > 0 ? std::numeric_limits<double>::infinity()
                                      : -std::numeric_limits<double>::infinity();
                        }
                    }
                    out[i] = static_cast<T>(v);
                }
                return;
            case DType::F32:
                for (std::size_t i = 0; i < n; ++i) {
                    float v;
                    std::memcpy(&v, p + 4 * i, 4);
                    out[i] = static_cast<T>(v);
                }
                return;
            case DType::F16:
            case DType::BF16:
                for (std::size_t i = 0; i < n; ++i) {
                    std::uint16_t v;
                    std::memcpy(&v, p + 2 * i, 2);
                    out[i] = static_cast<T>(t.dtype == DType::F16 ? half_to_float(v)
                                                                  : bfloat16_to_float(v));
                }
                return;
            default:
                fail("tensor '" + t.name + "' has dtype " + to_string(t.dtype) +
                     ", expected a floating type (F64, F32, F16 or BF16)");
        }
    }

    void parse(const ReadLimits& lim) {
        const std::size_t size = bytes_.size();
        if (size < 8) {
            fail("file is " + std::to_string(size) +
                 " bytes, expected at least 8 (the header length)");
        }
        std::uint64_t n;
        std::memcpy(&n, bytes_.data(), 8);
        if (n > lim.max_header_bytes) {
            fail("header length " + std::to_string(n) + " exceeds the limit of " +
                 std::to_string(lim.max_header_bytes) + " bytes");
        }
        if (n > size - 8) {
            fail("header length " + std::to_string(n) + " exceeds the " +
                 std::to_string(size - 8) + " bytes after the length field (truncated file?)");
        }
        if (n < 2) {
            fail("header length " + std::to_string(n) + ", expected at least 2 (a JSON object)");
        }
        const char* hb = reinterpret_cast<const char*>(bytes_.data() + 8);
        if (hb[0] != '{') {
            fail("header does not start with '{', expected a JSON object");
        }
        // nlohmann::json stops at a NUL byte as if the input ended there, so "{}\0<anything>"
        // would parse; a raw NUL is never valid JSON text, so reject it outright.
        if (const void* nul = std::memchr(hb, 0, static_cast<std::size_t>(n)); nul != nullptr) {
            fail("header is not valid JSON: NUL byte at header offset " +
                 std::to_string(static_cast<const char*>(nul) - hb));
        }
        data_start_ = 8 + static_cast<std::size_t>(n);
        const std::uint64_t data_size = size - data_start_;

        // Duplicate keys (which the JSON standard leaves undefined and nlohmann would silently
        // collapse) and excessive nesting are rejected while parsing.
        // Each open object: the key it is the value of ("" for the header itself), its keys.
        std::vector<std::pair<std::string, std::unordered_set<std::string>>> open_objects;
        std::string last_key;
        auto on_event = [&](int depth, json::parse_event_t ev, json& parsed) -> bool {
            switch (ev) {
                case json::parse_event_t::object_start:
                case json::parse_event_t::array_start:
                    if (depth >= lim.max_json_depth) {
                        fail("header JSON nests deeper than " +
                             std::to_string(lim.max_json_depth) + " levels");
                    }
                    if (ev == json::parse_event_t::object_start) {
                        open_objects.emplace_back(open_objects.empty() ? "" : last_key,
                                                  std::unordered_set<std::string>{});
                    }
                    break;
                case json::parse_event_t::object_end:
                    if (!open_objects.empty()) open_objects.pop_back();
                    break;
                case json::parse_event_t::key:
                    last_key = parsed.get<std::string>();
                    if (!open_objects.empty() && !open_objects.back().second.insert(last_key).second) {
                        const std::string& owner = open_objects.back().first;
                        fail("header has the key '" + last_key + "' twice" +
                             (owner.empty() ? std::string() : " in '" + owner + "'"));
                    }
                    break;
                default: break;
            }
            return true;
        };
        json header;
        try {
            header = json::parse(hb, hb + n, on_event, /*allow_exceptions=*/true,
                                 /*ignore_comments=*/false);
        } catch (const json::exception& e) {
            fail(std::string("header is not valid JSON: ") + e.what());
        }
        if (!header.is_object()) {
            fail("header is not a JSON object");
        }

        for (const auto& [key, value] : header.items()) {
            if (key == "__metadata__") {
                if (!value.is_object()) fail("__metadata__ is not a JSON object");
                for (const auto& [mk, mv] : value.items()) {
                    if (!mv.is_string()) {
                        fail("__metadata__ value of '" + mk + "' is not a string");
                    }
                    metadata_.emplace(mk, mv.get<std::string>());
                }
                continue;
            }
            tensors_.push_back(parse_tensor(key, value, lim));
        }

        // Offsets: inside the data section, sized dtype x shape, contiguous and non-overlapping,
        // covering the data section exactly (no hidden bytes).
        std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
            return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
        });
        std::uint64_t expected = 0;
        for (const TensorInfo& t : tensors_) {
            if (t.end > data_size) {
                fail("tensor '" + t.name + "' data_offsets [" + std::to_string(t.begin) + ", " +
                     std::to_string(t.end) + "] reach past the data section of " +
                     std::to_string(data_size) + " bytes (truncated file?)");
            }
            if (t.begin != expected) {
                fail("tensor '" + t.name + "' starts at data offset " + std::to_string(t.begin) +
                     ", expected " + std::to_string(expected) +
                     (t.begin < expected ? " (overlaps the previous tensor)"
                                         : " (gap after the previous tensor)"));
            }
            expected = t.end;
        }
        if (expected != data_size) {
            fail("tensors cover " + std::to_string(expected) + " bytes of the data section, "
                 "expected all " + std::to_string(data_size) + " (trailing bytes)");
        }
        for (std::size_t i = 0; i < tensors_.size(); ++i) {
            index_.emplace(tensors_[i].name, i);
        }
    }

    TensorInfo parse_tensor(const std::string& name, const json& v, const ReadLimits& lim) const {
        const std::string where = "tensor '" + name + "'";
        if (name.empty()) fail("a tensor has an empty name");
        if (!v.is_object()) fail(where + " is not a JSON object");
        for (const auto& [k, unused] : v.items()) {
            (void)unused;
            if (k != "dtype" && k != "shape" && k != "data_offsets") {
                fail(where + " has an unknown field '" + k +
                     "', expected only dtype, shape, data_offsets");
            }
        }
        TensorInfo t;
        t.name = name;
        const auto dt = v.find("dtype");
        if (dt == v.end() || !dt->is_string()) fail(where + " has no dtype string");
        const auto parsed = dtype_from_string(dt->get<std::string>());
        if (!parsed) fail(where + " has an unknown dtype '" + dt->get<std::string>() + "'");
        t.dtype = *parsed;

        const auto sh = v.find("shape");
        if (sh == v.end() || !sh->is_array()) fail(where + " has no shape array");
        if (sh->size() > lim.max_rank) {
            fail(where + " has rank " + std::to_string(sh->size()) + ", expected at most " +
                 std::to_string(lim.max_rank));
        }
        std::uint64_t numel = 1;
        for (const json& d : *sh) {
            if (!d.is_number_unsigned()) {
                fail(where + " has a shape entry that is not a non-negative integer");
            }
            const std::uint64_t s = d.get<std::uint64_t>();
            if (s != 0 && numel > std::numeric_limits<std::uint64_t>::max() / s) {
                fail(where + " shape product overflows 64 bits");
            }
            numel *= s;
            t.shape.push_back(s);
        }
        const std::uint64_t esize = dtype_size(t.dtype);
        if (numel > std::numeric_limits<std::uint64_t>::max() / esize) {
            fail(where + " byte size (shape product x " + std::to_string(esize) +
                 ") overflows 64 bits");
        }
        const std::uint64_t nbytes = numel * esize;

        const auto off = v.find("data_offsets");
        if (off == v.end() || !off->is_array() || off->size() != 2 ||
            !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned()) {
            fail(where + " data_offsets is not a pair of non-negative integers");
        }
        t.begin = (*off)[0].get<std::uint64_t>();
        t.end = (*off)[1].get<std::uint64_t>();
        if (t.end < t.begin) {
            fail(where + " data_offsets [" + std::to_string(t.begin) + ", " +
                 std::to_string(t.end) + "] end before they begin");
        }
        if (t.end - t.begin != nbytes) {
            fail(where + " has " + std::to_string(t.end - t.begin) + " bytes, expected " +
                 std::to_string(nbytes) + " for dtype " + to_string(t.dtype) + " and shape " +
                 t.shape_string());
        }
        return t;
    }

    std::vector<std::byte> bytes_;
    std::string source_;
    std::size_t data_start_ = 0;
    std::vector<TensorInfo> tensors_;
    std::map<std::string, std::size_t> index_;
    std::map<std::string, std::string> metadata_;
};

/// Builds a safetensors file: tensors in the order added, metadata strings, the header padded
/// with spaces to a multiple of 8 bytes so every tensor's data is 8-byte aligned in the file.
///
///     titans::io::SafetensorsWriter w;
///     w.metadata("format", "titans.params");
///     w.add("w_q", params.w_q);        // Matrix<float> -> F32 [rows, cols]
///     w.add("b_eta", params.b_eta);    // RowVector -> rank 1 [n]
///     w.write("weights.safetensors");  // atomic: a temporary file, then rename
class SafetensorsWriter {
public:
    /// Adds a float/double matrix: rank 2 [rows, cols], or rank 1 [n] for a compile-time row
    /// vector. FormatError on a duplicate name or the reserved name "__metadata__".
    template <class Derived>
    void add(const std::string& name, const Eigen::MatrixBase<Derived>& m) {
        using T = typename Derived::Scalar;
        std::vector<std::uint64_t> shape;
        if constexpr (Derived::RowsAtCompileTime == 1) {
            shape = {static_cast<std::uint64_t>(m.cols())};
        } else {
            shape = {static_cast<std::uint64_t>(m.rows()), static_cast<std::uint64_t>(m.cols())};
        }
        if constexpr (std::is_same_v<Derived, Matrix<T>> || std::is_same_v<Derived, RowVector<T>>) {
            // Already row-major and contiguous: no copy.
            add_raw(name, dtype_of<T>(), std::move(shape),
                    std::as_bytes(std::span<const T>(m.derived().data(),
                                                     static_cast<std::size_t>(m.size()))));
        } else {
            const Matrix<T> rm = m;  // row-major, contiguous
            add_raw(name, dtype_of<T>(), std::move(shape),
                    std::as_bytes(std::span<const T>(rm.data(), static_cast<std::size_t>(rm.size()))));
        }
    }
    /// Adds an I64 tensor of shape [values.size()].
    void add_integers(const std::string& name, std::span<const std::int64_t> values) {
        add_raw(name, DType::I64, {static_cast<std::uint64_t>(values.size())},
                std::as_bytes(values));
    }
    /// Adds raw little-endian bytes with an explicit dtype and shape (checked to agree).
    void add_raw(const std::string& name, DType dtype, std::vector<std::uint64_t> shape,
                 std::span<const std::byte> bytes) {
        if (name.empty() || name == "__metadata__") {
            throw FormatError("titans::io::SafetensorsWriter: tensor name '" + name +
                              "' is reserved or empty");
        }
        if (names_.count(name) != 0) {
            throw FormatError("titans::io::SafetensorsWriter: tensor '" + name +
                              "' added twice");
        }
        // dtype size x shape product, without wrapping around 2^64 (an empty shape is 0 bytes).
        std::uint64_t n = dtype_size(dtype);
        if (std::find(shape.begin(), shape.end(), std::uint64_t{0}) != shape.end()) {
            n = 0;
        } else {
            for (auto s : shape) {
                if (n > std::numeric_limits<std::uint64_t>::max() / s) {
                    throw ShapeError("titans::io::SafetensorsWriter: tensor '" + name +
                                     "' byte size (dtype size x shape product) overflows 64 bits");
                }
                n *= s;
            }
        }
        if (n != bytes.size()) {
            throw ShapeError("titans::io::SafetensorsWriter: tensor '" + name + "' has " +
                             std::to_string(bytes.size()) + " bytes, expected " +
                             std::to_string(n) + " for its dtype and shape");
        }
        names_.insert(name);  // only once the tensor is accepted, so a failed add can be retried
        Entry e{name, dtype, std::move(shape), data_.size(), data_.size() + bytes.size()};
        data_.insert(data_.end(), bytes.begin(), bytes.end());
        entries_.push_back(std::move(e));
    }
    /// Sets a "__metadata__" entry.
    void metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

    /// The whole file.
    [[nodiscard]] std::vector<std::byte> bytes() const {
        nlohmann::json h = nlohmann::json::object();
        if (!metadata_.empty()) h["__metadata__"] = metadata_;
        for (const Entry& e : entries_) {
            h[e.name] = {{"dtype", to_string(e.dtype)},
                         {"shape", e.shape},
                         {"data_offsets", {e.begin, e.end}}};
        }
        std::string text;
        try {
            text = h.dump();
        } catch (const nlohmann::json::exception& e) {  // a name or metadata string not UTF-8
            throw FormatError(std::string("titans::io::SafetensorsWriter: header is not valid UTF-8 "
                                          "text: ") + e.what());
        }
        text.append((8 - text.size() % 8) % 8, ' ');
        std::vector<std::byte> out(8 + text.size() + data_.size());
        const std::uint64_t n = text.size();
        std::memcpy(out.data(), &n, 8);
        std::memcpy(out.data() + 8, text.data(), text.size());
        if (!data_.empty()) std::memcpy(out.data() + 8 + text.size(), data_.data(), data_.size());
        return out;
    }

    /// Writes the file atomically: to a uniquely named temporary file beside `path`, flushed to
    /// the disk (fsync on POSIX), then renamed over `path`, so a crash or a full disk never
    /// leaves a half-written file under `path`. FileError on failure (the temporary is removed).
    void write(const std::filesystem::path& path) const {
        const std::vector<std::byte> b = bytes();
        std::filesystem::path tmp = path;
        tmp += ".tmp-" + detail::unique_suffix();
        std::FILE* out = std::fopen(tmp.string().c_str(), "wb");
        if (out == nullptr) {
            throw FileError("titans::io: cannot open '" + tmp.string() +
                            "' for writing: " + std::generic_category().message(errno));
        }
        bool ok = std::fwrite(b.data(), 1, b.size(), out) == b.size() && std::fflush(out) == 0;
#if defined(TITANS_IO_HAVE_FSYNC)
        ok = ok && ::fsync(::fileno(out)) == 0;
#endif
        const int saved = errno;
        ok = (std::fclose(out) == 0) && ok;
        std::error_code ec;
        if (!ok) {
            std::filesystem::remove(tmp, ec);
            throw FileError("titans::io: writing '" + tmp.string() +
                            "' failed: " + std::generic_category().message(saved));
        }
        std::filesystem::rename(tmp, path, ec);
        if (ec) {
            std::error_code ignored;
            std::filesystem::remove(tmp, ignored);
            throw FileError("titans::io: cannot rename '" + tmp.string() + "' to '" +
                            path.string() + "': " + ec.message());
        }
    }

private:
    struct Entry {
        std::string name;
        DType dtype;
        std::vector<std::uint64_t> shape;
        std::uint64_t begin, end;
    };
    std::vector<Entry> entries_;
    std::vector<std::byte> data_;
    std::map<std::string, std::string> metadata_;
    std::unordered_set<std::string> names_;
};

}  // namespace titans::io
