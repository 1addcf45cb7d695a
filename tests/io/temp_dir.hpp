#pragma once
// tests/io/temp_dir.hpp: TempDir, a fresh directory for a test's files.

#include <cstdint>
#include <filesystem>
#include <iterator>
#include <random>
#include <string>
#include <system_error>

namespace titans_test {

/// A fresh directory under the system temp dir, removed at scope exit. Its name is unique per
/// instance (ctest runs test cases, float and double instances included, in parallel).
struct TempDir {
    std::filesystem::path path;
    explicit TempDir(const std::string& name) {
        path = std::filesystem::temp_directory_path() /
               ("titans_test_" + name + "_" + std::to_string(std::random_device{}()) + "_" +
                std::to_string(reinterpret_cast<std::uintptr_t>(this)));
        std::filesystem::remove_all(path);
        std::filesystem::create_directories(path);
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    std::filesystem::path operator/(const std::string& f) const { return path / f; }
    /// How many entries the directory holds (a refused save must leave none).
    [[nodiscard]] long entries() const {
        return static_cast<long>(std::distance(std::filesystem::directory_iterator(path),
                                               std::filesystem::directory_iterator{}));
    }
};

}  // namespace titans_test
