// The CUDA tests' runner: Catch2's session, or exit code 77 (ctest: "skipped", never "passed")
// when this machine has no CUDA device.
#define CATCH_CONFIG_RUNNER
#include "catch.hpp"

#include <cstdio>

#include <titans/backend/cuda/runtime.cuh>

int main(int argc, char* argv[]) {
    if (titans::backend::cuda::device_count() == 0) {
        std::printf("titans CUDA tests: no CUDA device on this machine: skipped\n");
        return 77;
    }
    return Catch::Session().run(argc, argv);
}
