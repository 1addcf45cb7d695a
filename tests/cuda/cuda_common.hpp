#pragma once
// tests/cuda/cuda_common.hpp: what the CUDA tests share beyond test_common.hpp.
//
//   nonfinite_message(f)   the what() of the NonFiniteError f() throws ("" if none)
//   parity_cases(n)        n, capped by TITANS_CUDA_PARITY_CASES (short compute-sanitizer runs)

#include "test_common.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

namespace titans_test {

template <class F>
std::string nonfinite_message(F&& f) {
    try {
        f();
    } catch (const titans::NonFiniteError& e) {
        return e.what();
    }
    return "";
}

inline int parity_cases(int cases) {
    if (const char* cap = std::getenv("TITANS_CUDA_PARITY_CASES"); cap != nullptr) {
        return std::min(cases, std::max(1, std::atoi(cap)));
    }
    return cases;
}

}  // namespace titans_test
