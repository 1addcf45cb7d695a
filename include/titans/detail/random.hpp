#pragma once
// titans/detail/random.hpp: a small deterministic generator for parameter initialisation.
//
// std::normal_distribution differs between standard libraries, so parameters created from a
// seed would differ between platforms. SplitMix64 plus Box-Muller gives the same numbers
// everywhere.

#include <cmath>
#include <cstdint>

#include "../types.hpp"

namespace titans::detail {

class SplitMix64 {
public:
    explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

    /// The whole state: SplitMix64(state()) continues with the same numbers as this one.
    [[nodiscard]] std::uint64_t state() const { return state_; }

    std::uint64_t next() {
        std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    /// Uniform in (0, 1).
    double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
    /// Standard normal (Box-Muller, one value per call).
    double normal() {
        const double u1 = uniform();
        const double u2 = uniform();
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }

private:
    std::uint64_t state_;
};

/// The tensors of the parameter structs' random(): rows x cols of N(0, stddev^2) drawn in
/// row-major order from SplitMix64(seed), or, with draw = false, zeros of the same shapes (for
/// zeros(): a loader needs the shapes, not the generator's work).
template <class T>
class TensorDraw {
public:
    TensorDraw(std::uint64_t seed, bool draw) : rng_(seed), draw_(draw) {}

    [[nodiscard]] Matrix<T> operator()(Eigen::Index rows, Eigen::Index cols, double stddev) {
        if (!draw_) {
            return Matrix<T>::Zero(rows, cols);
        }
        Matrix<T> m(rows, cols);
        for (Eigen::Index i = 0; i < m.size(); ++i) {
            m.data()[i] = static_cast<T>(stddev * rng_.normal());
        }
        return m;
    }

private:
    SplitMix64 rng_;
    bool draw_;
};

}  // namespace titans::detail
