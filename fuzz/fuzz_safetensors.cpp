// fuzz/fuzz_safetensors.cpp: libFuzzer target for titans::io::SafetensorsFile (parse, then read
// every tensor as float, double and integers, and the metadata). Built by fuzz/CMakeLists.txt:
// with clang as a libFuzzer binary (TITANS_BUILD_FUZZERS=ON), otherwise with replay_main.cpp as
// a driver that replays corpus files (the ctest fuzz_replay_safetensors).

#include "fuzz_safetensors.hpp"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    (void)titans_fuzz::fuzz_safetensors_bytes(data, size);
    return 0;
}
