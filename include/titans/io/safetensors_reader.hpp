#pragma once
// titans/io/safetensors_reader.hpp: SafetensorsFile, the strict reader of the safetensors format
// (titans/io/safetensors.hpp describes the format). The file is untrusted (docs/formats.md
// lists every check): every failure is a titans::FormatError that names the source, the tensor
// and the problem; no read ever leaves the buffer.
//
// Requires nlohmann/json (Debian: nlohmann-json3-dev): link titans::io, not just titans::titans.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../detail/float_env.hpp"
#include "../error.hpp"
#include "../types.hpp"
#include "dtype.hpp"
#include "file.hpp"

static_assert(std::endian::native == std::endian::little,
              "titans/io: safetensors data is little-endian; big-endian hosts are not supported");

namespace titans::io {

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

    /// Reads and parses a file. FileError if it cannot be read or is not a regular file (a
    /// directory, FIFO, device or socket is refused at once, never waited on), FormatError if
    /// malformed.
    [[nodiscard]] static SafetensorsFile read(const std::filesystem::path& path,
                                              ReadLimits limits = {}) {
        return SafetensorsFile(detail::read_regular_file(path), path.string(), limits);
    }

    /// Where the bytes came from (a path or "<memory>").
    [[nodiscard]] const std::string& source() const { return source_; }
    /// Every tensor, in data-offset order; empty tensors sharing an offset by name (byte order),
    /// so the order depends on the file's content only, never on the order of its JSON keys
    /// (a file written back by SafetensorsWriter lists its tensors in the same order).
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

    /// What the checks need of a JSON value: which of these it is (a missing field: Other).
    enum class JType : std::uint8_t { Other, Unsigned, String, Object, Array };
    static constexpr std::size_t no_index = std::numeric_limits<std::size_t>::max();

    /// A top-level key of the header and what the checks need of its value: its type and, for
    /// a tensor entry, its dtype, shape and data_offsets fields and its first unknown field.
    struct HeaderEntry {
        std::string key;
        JType type = JType::Other;
        JType dtype_type = JType::Other, shape_type = JType::Other, offsets_type = JType::Other;
        std::string dtype = {};
        std::vector<std::uint64_t> shape = {};  ///< elements (0 where not unsigned)
        std::size_t shape_other = no_index;     ///< first shape element not an unsigned integer
        std::uint64_t offsets[2] = {0, 0};      ///< the first two data_offsets elements
        std::size_t offsets_size = 0;
        bool offsets_other = false;             ///< a data_offsets element not unsigned
        std::optional<std::string> unknown = {};  ///< the first unknown field in key order
    };
    /// A "__metadata__" pair.
    struct MetaField {
        std::string key;
        JType type = JType::Other;
        std::string text = {};
    };

    /// Reads the header in one pass of SAX events (no DOM: linear in the header size; the
    /// callback DOM parser used before rescans the parent object at the end of every child,
    /// quadratic in the tensor count), keeping the three levels the checks need. A syntax
    /// error, a key twice in one object (the JSON standard leaves duplicates undefined; a DOM
    /// would silently keep one) and nesting deeper than the limit fail at once.
    struct HeaderReader {
        enum class Field : std::uint8_t { Other, Dtype, Shape, Offsets, Meta };
        struct Frame {  // an open object or array
            bool object = false;
            std::string owner;                          // the key the object is the value of
            std::vector<std::string> keys;              // its keys (up to 16, then `many`)
            std::unordered_set<std::string> many = {};  // its keys, once it has more than 16

            bool add(const std::string& k) {  // false if the object has the key already
                if (many.empty() && keys.size() < 16) {
                    if (std::find(keys.begin(), keys.end(), k) != keys.end()) return false;
                    keys.push_back(k);
                    return true;
                }
                if (many.empty()) many.insert(keys.begin(), keys.end());
                return many.insert(k).second;
            }
        };
        const SafetensorsFile& file;
        int max_depth;
        std::deque<HeaderEntry> entries = {};  // stable addresses (parse() sorts pointers)
        std::vector<MetaField> meta = {};
        std::vector<Frame> frames = {};  // frames[0, depth) are open; reused, never shrunk
        std::size_t depth = 0;
        std::string last_key = {};
        bool in_meta = false;            // inside the "__metadata__" entry
        Field field = Field::Other;      // the field of the current entry being read

        void value(JType t, std::uint64_t number = 0, const std::string* text = nullptr) {
            if (depth == 1) {
                entries.back().type = t;
            } else if (depth == 2 && frames[1].object && in_meta) {
                meta.back().type = t;
                if (text != nullptr) meta.back().text = *text;
            } else if (depth == 2 && frames[1].object) {
                HeaderEntry& e = entries.back();
                if (field == Field::Dtype) {
                    e.dtype_type = t;
                    if (text != nullptr) e.dtype = *text;
                }
                if (field == Field::Shape) e.shape_type = t;
                if (field == Field::Offsets) e.offsets_type = t;
            } else if (depth == 3 && frames[1].object && !frames[2].object && !in_meta) {
                element(entries.back(), t, number);
            }
        }
        void element(HeaderEntry& e, JType t, std::uint64_t number) const {
            if (field == Field::Shape) {
                if (t != JType::Unsigned && e.shape_other == no_index) {
                    e.shape_other = e.shape.size();
                }
                e.shape.push_back(number);
            } else if (field == Field::Offsets) {
                e.offsets_other = e.offsets_other || t != JType::Unsigned;
                if (e.offsets_size < 2) e.offsets[e.offsets_size] = number;
                ++e.offsets_size;
            }
        }
        bool open(bool object) {
            if (depth >= static_cast<std::size_t>(std::max(max_depth, 0))) {
                file.fail("header JSON nests deeper than " + std::to_string(max_depth) +
                          " levels");
            }
            value(object ? JType::Object : JType::Array);
            if (frames.size() <= depth) frames.emplace_back();
            Frame& f = frames[depth++];
            f.object = object;
            f.owner = object && depth > 1 ? last_key : std::string();
            f.keys.clear();
            f.many.clear();
            return true;
        }
        bool key(std::string& k) {
            // Top-level keys (the tensors) are checked once sorted, by parse().
            if (depth > 1 && !frames[depth - 1].add(k)) {
                const std::string& owner = frames[depth - 1].owner;
                file.fail("header has the key '" + k + "' twice" +
                          (owner.empty() ? std::string() : " in '" + owner + "'"));
            }
            last_key = k;
            if (depth == 1) {
                entries.push_back(HeaderEntry{k});
                in_meta = k == "__metadata__";
            } else if (depth == 2 && in_meta) {
                meta.push_back(MetaField{k});
            } else if (depth == 2) {
                field = k == "dtype" ? Field::Dtype
                        : k == "shape" ? Field::Shape
                        : k == "data_offsets" ? Field::Offsets : Field::Other;
                auto& unknown = entries.back().unknown;
                if (field == Field::Other && (!unknown || k < *unknown)) unknown = k;
            }
            return true;
        }
        bool start_object(std::size_t) { return open(true); }
        bool start_array(std::size_t) { return open(false); }
        bool end_object() { return --depth, true; }
        bool end_array() { return --depth, true; }
        bool null() { return value(JType::Other), true; }
        bool boolean(bool) { return value(JType::Other), true; }
        bool number_integer(json::number_integer_t) { return value(JType::Other), true; }
        bool number_unsigned(json::number_unsigned_t v) { return value(JType::Unsigned, v), true; }
        bool number_float(json::number_float_t, const std::string&) {
            return value(JType::Other), true;
        }
        bool string(std::string& s) { return value(JType::String, 0, &s), true; }
        bool binary(json::binary_t&) { return value(JType::Other), true; }
        bool parse_error(std::size_t, const std::string&, const json::exception& e) {
            file.fail(std::string("header is not valid JSON: ") + e.what());
        }
    };

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

        HeaderReader reader{*this, lim.max_json_depth};
        if (!json::sax_parse(hb, hb + n, &reader, json::input_format_t::json, /*strict=*/true,
                             /*ignore_comments=*/false)) {
            fail("header is not valid JSON");
        }
        // A top-level key twice (a tensor name: the first repeat in file order), then every
        // entry in file order.
        std::unordered_set<std::string_view> seen;
        seen.reserve(reader.entries.size());
        for (const HeaderEntry& e : reader.entries) {
            if (!seen.insert(e.key).second) fail("header has the key '" + e.key + "' twice");
        }
        std::vector<TensorInfo> infos;
        infos.reserve(reader.entries.size());
        for (HeaderEntry& e : reader.entries) {
            if (e.key == "__metadata__") {
                read_metadata(e, reader.meta);
            } else {
                infos.push_back(parse_tensor(e, lim));
            }
        }
        order_by_offsets(infos, data_size);
        index_.reserve(tensors_.size());
        for (std::size_t i = 0; i < tensors_.size(); ++i) {
            index_.emplace(tensors_[i].name, i);
        }
    }

    /// Offsets: inside the data section, contiguous and non-overlapping, covering the data
    /// section exactly (no hidden bytes); then tensors_ = infos in offset order (ties by name).
    /// O(n log n):
    /// one sort (of offsets and indices), one scan.
    void order_by_offsets(std::vector<TensorInfo>& infos, std::uint64_t data_size) {
        struct Span {
            std::uint64_t begin, end;
            std::size_t index;
        };
        std::vector<Span> spans(infos.size());
        for (std::size_t i = 0; i < infos.size(); ++i) spans[i] = {infos[i].begin, infos[i].end, i};
        // Ties (empty tensors at one offset) by name: names are unique, so the order is total
        // and independent of the key order in the header.
        std::sort(spans.begin(), spans.end(), [&infos](const Span& a, const Span& b) {
            return a.begin != b.begin ? a.begin < b.begin
                   : a.end != b.end   ? a.end < b.end
                                      : infos[a.index].name < infos[b.index].name;
        });
        std::uint64_t expected = 0;
        for (const Span& sp : spans) {
            const std::string& name = infos[sp.index].name;
            if (sp.end > data_size) {
                fail("tensor '" + name + "' data_offsets [" + std::to_string(sp.begin) + ", " +
                     std::to_string(sp.end) + "] reach past the data section of " +
                     std::to_string(data_size) + " bytes (truncated file?)");
            }
            if (sp.begin != expected) {
                fail("tensor '" + name + "' starts at data offset " + std::to_string(sp.begin) +
                     ", expected " + std::to_string(expected) +
                     (sp.begin < expected ? " (overlaps the previous tensor)"
                                          : " (gap after the previous tensor)"));
            }
            expected = sp.end;
        }
        if (expected != data_size) {
            fail("tensors cover " + std::to_string(expected) + " bytes of the data section, "
                 "expected all " + std::to_string(data_size) + " (trailing bytes)");
        }
        tensors_.reserve(infos.size());
        for (const Span& sp : spans) tensors_.push_back(std::move(infos[sp.index]));
    }

    void read_metadata(const HeaderEntry& e, const std::vector<MetaField>& fields) {
        if (e.type != JType::Object) fail("__metadata__ is not a JSON object");
        const MetaField* bad = nullptr;  // the first non-string value in key order
        for (const MetaField& f : fields) {
            if (f.type != JType::String && (bad == nullptr || f.key < bad->key)) bad = &f;
        }
        if (bad != nullptr) fail("__metadata__ value of '" + bad->key + "' is not a string");
        for (const MetaField& f : fields) metadata_.emplace(f.key, f.text);
    }

    /// The checks of one tensor entry (its key and shape are moved into the result).
    TensorInfo parse_tensor(HeaderEntry& e, const ReadLimits& lim) const {
        const std::string where = "tensor '" + e.key + "'";
        if (e.key.empty()) fail("a tensor has an empty name");
        if (e.type != JType::Object) fail(where + " is not a JSON object");
        if (e.unknown) {
            fail(where + " has an unknown field '" + *e.unknown +
                 "', expected only dtype, shape, data_offsets");
        }
        TensorInfo t;
        if (e.dtype_type != JType::String) fail(where + " has no dtype string");
        const auto parsed = dtype_from_string(e.dtype);
        if (!parsed) fail(where + " has an unknown dtype '" + e.dtype + "'");
        t.dtype = *parsed;

        if (e.shape_type != JType::Array) fail(where + " has no shape array");
        if (e.shape.size() > lim.max_rank) {
            fail(where + " has rank " + std::to_string(e.shape.size()) + ", expected at most " +
                 std::to_string(lim.max_rank));
        }
        std::uint64_t numel = 1;
        for (std::size_t i = 0; i < e.shape.size(); ++i) {
            if (i == e.shape_other) {
                fail(where + " has a shape entry that is not a non-negative integer");
            }
            const std::uint64_t s = e.shape[i];
            if (s != 0 && numel > std::numeric_limits<std::uint64_t>::max() / s) {
                fail(where + " shape product overflows 64 bits");
            }
            numel *= s;
        }
        t.shape = std::move(e.shape);
        const std::uint64_t esize = dtype_size(t.dtype);
        if (numel > std::numeric_limits<std::uint64_t>::max() / esize) {
            fail(where + " byte size (shape product x " + std::to_string(esize) +
                 ") overflows 64 bits");
        }
        const std::uint64_t nbytes = numel * esize;

        if (e.offsets_type != JType::Array || e.offsets_size != 2 || e.offsets_other) {
            fail(where + " data_offsets is not a pair of non-negative integers");
        }
        t.begin = e.offsets[0];
        t.end = e.offsets[1];
        if (t.end < t.begin) {
            fail(where + " data_offsets [" + std::to_string(t.begin) + ", " +
                 std::to_string(t.end) + "] end before they begin");
        }
        if (t.end - t.begin != nbytes) {
            fail(where + " has " + std::to_string(t.end - t.begin) + " bytes, expected " +
                 std::to_string(nbytes) + " for dtype " + to_string(t.dtype) + " and shape " +
                 t.shape_string());
        }
        t.name = std::move(e.key);  // (parse() reads no key after this)
        return t;
    }

    std::vector<std::byte> bytes_;
    std::string source_;
    std::size_t data_start_ = 0;
    std::vector<TensorInfo> tensors_;
    std::unordered_map<std::string, std::size_t> index_;
    std::map<std::string, std::string> metadata_;
};

}  // namespace titans::io
