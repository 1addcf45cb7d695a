#pragma once
// titans/io/file.hpp: the file access of titans::io. Reading refuses anything but a regular
// file, without blocking (a FIFO or a device is a FileError at once); writing is atomic (a
// temporary file created exclusively beside the target, flushed, then renamed over it).

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <system_error>
#include <vector>

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

#include "../error.hpp"

namespace titans::io::detail {

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

}  // namespace titans::io::detail
