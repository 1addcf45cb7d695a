// fuzz/replay_main.cpp: a main() for the fuzz targets when they are not built with libFuzzer
// (GCC, or the ctests fuzz_replay_*): runs LLVMFuzzerTestOneInput once over every file given on
// the command line, recursing into directories. Exits non-zero if a path cannot be read or no
// input was found (so a missing corpus fails the test instead of passing vacuously); a crash or
// an escaping exception fails it too.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

bool run_file(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) {
        std::fprintf(stderr, "replay: cannot read %s\n", p.string().c_str());
        return false;
    }
    const std::vector<char> buf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "replay: %s (%zu bytes)\n", p.string().c_str(), buf.size());
    // A fresh heap copy of exactly the file's size, so ASan catches reads past the end.
    std::vector<std::uint8_t> copy(buf.begin(), buf.end());
    LLVMFuzzerTestOneInput(copy.empty() ? nullptr : copy.data(), copy.size());
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    std::size_t count = 0;
    bool ok = true;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (!arg.empty() && arg[0] == '-') continue;  // libFuzzer-style flags are ignored
        const std::filesystem::path p(arg);
        std::error_code ec;
        if (std::filesystem::is_directory(p, ec)) {
            std::vector<std::filesystem::path> files;
            for (const auto& e : std::filesystem::recursive_directory_iterator(p)) {
                if (e.is_regular_file()) files.push_back(e.path());
            }
            std::sort(files.begin(), files.end());
            for (const auto& f : files) {
                ok = run_file(f) && ok;
                ++count;
            }
        } else {
            ok = run_file(p) && ok;
            ++count;
        }
    }
    std::fprintf(stderr, "replay: %zu input(s) ran\n", count);
    if (count == 0) {
        std::fprintf(stderr, "replay: no inputs (usage: %s <file|dir>...)\n", argv[0]);
        return 2;
    }
    return ok ? 0 : 1;
}
