#pragma once
// titans/io/safetensors_writer.hpp: SafetensorsWriter, which builds safetensors files the reader
// (safetensors_reader.hpp) accepts and writes them atomically.
//
// Requires nlohmann/json (Debian: nlohmann-json3-dev): link titans::io, not just titans::titans.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../error.hpp"
#include "../types.hpp"
#include "dtype.hpp"
#include "file.hpp"
#include "safetensors_reader.hpp"  // ReadLimits: the writer refuses what the reader would

namespace titans::io {

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
        if (const std::size_t max_rank = ReadLimits{}.max_rank; shape.size() > max_rank) {
            throw FormatError("titans::io::SafetensorsWriter: tensor '" + name + "' has rank " +
                              std::to_string(shape.size()) + ", expected at most " +
                              std::to_string(max_rank) + " (the reader's ReadLimits)");
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
        if (const std::uint64_t limit = ReadLimits{}.max_header_bytes; text.size() > limit) {
            throw FormatError("titans::io::SafetensorsWriter: header length " +
                              std::to_string(text.size()) + " exceeds the limit of " +
                              std::to_string(limit) + " bytes (the reader's ReadLimits)");
        }
        std::vector<std::byte> out(8 + text.size() + data_.size());
        const std::uint64_t n = text.size();
        std::memcpy(out.data(), &n, 8);
        std::memcpy(out.data() + 8, text.data(), text.size());
        if (!data_.empty()) std::memcpy(out.data() + 8 + text.size(), data_.data(), data_.size());
        return out;
    }

    /// Writes the file atomically: to a temporary file beside `path` with a short unique name
    /// (".titans-<16 hex digits>.tmp", created exclusively; any legal file name works for
    /// `path`), flushed to the disk (fsync on POSIX), then renamed over `path`, so a crash or a
    /// full disk never leaves a half-written file under `path`. FileError on failure (the
    /// temporary is removed).
    void write(const std::filesystem::path& path) const {
        const std::vector<std::byte> b = bytes();  // every check first: no file on refusal
        detail::TempFile tmp(path);
        tmp.write_all(b);
        tmp.commit();
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
