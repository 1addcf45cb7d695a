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
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#if __has_include(<unistd.h>)
#include <unistd.h>  // fsync, getpid
#define TITANS_IO_HAVE_FSYNC 1
#endif
// POSIX file access: reading refuses anything but a regular file without blocking on a FIFO
// (open O_NONBLOCK, then fstat the descriptor), writing creates its temporary with O_EXCL.
#if (defined(__unix__) || defined(__APPLE__)) && __has_include(<fcntl.h>) && \
    __has_include(<sys/stat.h>) && __has_include(<unistd.h>)
#include <fcntl.h>
#include <sys/stat.h>
#define TITANS_IO_POSIX 1
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

/// "titans::io: cannot read '<path>': it is a <kind>, expected a regular file".
[[noreturn]] inline void not_regular_file(const std::string& path, const char* kind) {
    throw FileError("titans::io: cannot read '" + path + "': it is a " + kind +
                    ", expected a regular file");
}

inline std::string os_reason(int err) { return std::generic_category().message(err); }

#if defined(TITANS_IO_POSIX)
inline const char* file_kind(mode_t m) {
    if (S_ISDIR(m)) return "directory";
    if (S_ISFIFO(m)) return "FIFO";
    if (S_ISCHR(m)) return "character device";
    if (S_ISBLK(m)) return "block device";
    if (S_ISSOCK(m)) return "socket";
    return "special file";
}

/// Closes a descriptor at scope exit.
struct FdGuard {
    int fd;
    explicit FdGuard(int f) : fd(f) {}
    FdGuard(const FdGuard&) = delete;
    FdGuard& operator=(const FdGuard&) = delete;
    ~FdGuard() { ::close(fd); }
};

/// The whole content of the regular file `path`. Anything else (directory, FIFO, device,
/// socket) is a FileError at once, never a blocking open or read: stat() first (so a device is
/// not even opened), then open(O_NONBLOCK) and fstat() of the descriptor, which is what is read
/// (so a path swapped in between cannot slip through).
inline std::vector<std::byte> read_regular_file(const std::filesystem::path& path) {
    const std::string p = path.string();
    struct stat st{};
    if (::stat(p.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
        not_regular_file(p, file_kind(st.st_mode));
    }
    const int fd = ::open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        throw FileError("titans::io: cannot open '" + p + "' for reading: " + os_reason(errno));
    }
    const FdGuard guard{fd};
    if (::fstat(fd, &st) != 0) {
        throw FileError("titans::io: cannot determine the size of '" + p + "': " +
                        os_reason(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        not_regular_file(p, file_kind(st.st_mode));
    }
    if (const int flags = ::fcntl(fd, F_GETFL); flags != -1) {
        ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);  // blocking reads from here on
    }
    const auto size = static_cast<std::uint64_t>(st.st_size);
    std::vector<std::byte> bytes;
    try {
        if (size > std::numeric_limits<std::size_t>::max()) throw std::length_error("size");
        bytes.resize(static_cast<std::size_t>(size));
    } catch (const std::exception&) {  // bad_alloc / length_error: a huge size
        throw FileError("titans::io: cannot read '" + p + "': " + std::to_string(size) +
                        " bytes do not fit in memory");
    }
    std::size_t got = 0;
    while (got < bytes.size()) {
        const std::size_t want = std::min<std::size_t>(bytes.size() - got, std::size_t{1} << 30);
        const ::ssize_t r = ::read(fd, bytes.data() + got, want);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            throw FileError("titans::io: cannot read '" + p + "': " + os_reason(errno));
        }
        if (r == 0) {
            throw FileError("titans::io: short read from '" + p + "': got " +
                            std::to_string(got) + " of " + std::to_string(size) + " bytes");
        }
        got += static_cast<std::size_t>(r);
    }
    return bytes;
}
#else
inline std::vector<std::byte> read_regular_file(const std::filesystem::path& path) {
    const std::string p = path.string();
    std::error_code ec;
    const auto type = std::filesystem::status(path, ec).type();
    if (!ec && type != std::filesystem::file_type::regular &&
        type != std::filesystem::file_type::not_found) {
        not_regular_file(p, type == std::filesystem::file_type::directory ? "directory"
                                                                           : "special file");
    }
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) {
        throw FileError("titans::io: cannot open '" + p + "' for reading: " + os_reason(errno));
    }
    const std::streamoff size = in.tellg();
    if (size < 0) {
        throw FileError("titans::io: cannot determine the size of '" + p + "'");
    }
    std::vector<std::byte> bytes;
    try {
        bytes.resize(static_cast<std::size_t>(size));
    } catch (const std::exception&) {  // bad_alloc / length_error: a bogus or huge size
        throw FileError("titans::io: cannot read '" + p + "': " + std::to_string(size) +
                        " bytes do not fit in memory");
    }
    in.seekg(0);
    in.read(reinterpret_cast<char*>(bytes.data()), size);
    if (in.gcount() != size) {
        throw FileError("titans::io: short read from '" + p + "': got " +
                        std::to_string(in.gcount()) + " of " + std::to_string(size) + " bytes");
    }
    return bytes;
}
#endif

/// The temporary file of an atomic write: created exclusively in the target's directory under
/// a short name, ".titans-<16 hex digits>.tmp" (28 bytes, so any legal target name works), and
/// removed by the destructor unless commit() renamed it over the target.
class TempFile {
public:
    explicit TempFile(const std::filesystem::path& target) : target_(target) {
        for (int attempt = 0;; ++attempt) {
            path_ = target.parent_path() / (".titans-" + unique_suffix() + ".tmp");
#if defined(TITANS_IO_POSIX)
            fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
            if (fd_ >= 0) return;
            if (errno == EEXIST && attempt < 16) continue;  // another writer's name: draw again
#else
            file_ = std::fopen(path_.string().c_str(), "wb");
            if (file_ != nullptr) return;
#endif
            throw FileError("titans::io: cannot open '" + path_.string() + "' for writing (the " +
                            "temporary for '" + target.string() + "'): " + os_reason(errno));
        }
    }
    TempFile(const TempFile&) = delete;
    TempFile& operator=(const TempFile&) = delete;
    ~TempFile() {
        close_file();
        if (!committed_) {
            std::error_code ignored;
            std::filesystem::remove(path_, ignored);
        }
    }

    /// Writes `b`, flushes it to the disk (fsync on POSIX) and closes the file.
    void write_all(std::span<const std::byte> b) {
        int err = 0;  // the first failure's errno
#if defined(TITANS_IO_POSIX)
        for (std::size_t done = 0; err == 0 && done < b.size();) {
            const std::size_t want = std::min<std::size_t>(b.size() - done, std::size_t{1} << 30);
            const ::ssize_t r = ::write(fd_, b.data() + done, want);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) err = r < 0 ? errno : ENOSPC;
            if (r > 0) done += static_cast<std::size_t>(r);
        }
        if (err == 0 && ::fsync(fd_) != 0) err = errno;
#else
        if (std::fwrite(b.data(), 1, b.size(), file_) != b.size() || std::fflush(file_) != 0) {
            err = errno != 0 ? errno : EIO;
        }
#if defined(TITANS_IO_HAVE_FSYNC)
        if (err == 0 && ::fsync(::fileno(file_)) != 0) err = errno;
#endif
#endif
        if (!close_file() && err == 0) err = errno != 0 ? errno : EIO;
        if (err != 0) {
            throw FileError("titans::io: writing '" + path_.string() + "' failed: " +
                            os_reason(err));
        }
    }

    /// Renames the temporary over the target.
    void commit() {
        std::error_code ec;
        std::filesystem::rename(path_, target_, ec);
        if (ec) {
            throw FileError("titans::io: cannot rename '" + path_.string() + "' to '" +
                            target_.string() + "': " + ec.message());
        }
        committed_ = true;
    }

private:
    bool close_file() {
        bool ok = true;
#if defined(TITANS_IO_POSIX)
        if (fd_ >= 0) ok = ::close(fd_) == 0;
        fd_ = -1;
#else
        if (file_ != nullptr) ok = std::fclose(file_) == 0;
        file_ = nullptr;
#endif
        return ok;
    }

    std::filesystem::path target_, path_;
#if defined(TITANS_IO_POSIX)
    int fd_ = -1;
#else
    std::FILE* file_ = nullptr;
#endif
    bool committed_ = false;
};

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
