// Minimal titans consumer: compiles against the umbrella header through titans::titans.
#include <titans/titans.hpp>

#include <cstdio>

int main() {
    std::printf("titans %d.%d\n", TITANS_VERSION_MAJOR, TITANS_VERSION_MINOR);
#if defined(TITANS_CONSUMER_EXPECT_OPENMP)
#if defined(_OPENMP)
    constexpr int have_openmp = 1;
#else
    constexpr int have_openmp = 0;
#endif
    if (have_openmp != TITANS_CONSUMER_EXPECT_OPENMP) {
        std::printf("OpenMP propagation mismatch: expected %d, got %d\n", TITANS_CONSUMER_EXPECT_OPENMP,
                    have_openmp);
        return 1;
    }
#endif
    return 0;
}
