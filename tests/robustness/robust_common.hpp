#pragma once
// tests/robustness/robust_common.hpp: helpers of the red-team suite.
//
//   snapshot(state)         every value a state's tensors() visits (positions, matrices) in
//                           visiting order, with the names: two snapshots are equal only if the
//                           states are bit-identical as far as a checkpoint can tell
//   constant_rows(n, d, v)  n copies of one row (a stuck sensor), the input that makes a memory
//                           with large steps diverge

#include "../test_common.hpp"

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace robust {

using namespace titans_test;

struct Snapshot {
    std::vector<std::string> names;
    std::vector<std::uint64_t> bits;  // the bit patterns, so NaNs compare too
    bool operator==(const Snapshot&) const = default;
};

template <class State>
Snapshot snapshot(const State& st) {
    Snapshot s;
    State::tensors(st, [&s](const std::string& name, const auto& x) {
        s.names.push_back(name);
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_integral_v<X>) {
            s.bits.push_back(static_cast<std::uint64_t>(x));
        } else {
            s.bits.push_back(static_cast<std::uint64_t>(x.rows()));
            s.bits.push_back(static_cast<std::uint64_t>(x.cols()));
            for (Eigen::Index i = 0; i < x.size(); ++i) {
                double v = static_cast<double>(x.data()[i]);
                std::uint64_t b = 0;
                std::memcpy(&b, &v, sizeof b);
                s.bits.push_back(b);
            }
        }
    });
    return s;
}

template <class T>
titans::Matrix<T> constant_rows(Eigen::Index n, Eigen::Index d, std::uint64_t seed) {
    Rng rng(seed);
    const Matrixd row = random_matrix(1, d, rng);
    return row.replicate(n, 1).cast<T>();
}

}  // namespace robust
