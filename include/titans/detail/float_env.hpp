#pragma once
// titans/detail/float_env.hpp: scoped flush-to-zero for the hot loops, and a vectorised
// finiteness check.
//
// A memory whose forget gate wins over its writes decays towards zero and, in float, through
// the subnormal range, where every product runs many times slower on x86. While a
// DenormalFlushScope lives, the calling thread flushes subnormal results and inputs to zero
// (MXCSR FTZ and DAZ); the caller's setting is restored on exit, also by an exception. On
// other architectures it does nothing.

#include <vector>

#include <Eigen/Core>

#if defined(__SSE2__) || defined(_M_X64)
#include <xmmintrin.h>
#define TITANS_HAS_MXCSR 1
#else
#define TITANS_HAS_MXCSR 0
#endif

namespace titans::detail {

class DenormalFlushScope {
public:
    explicit DenormalFlushScope(bool enable) {
#if TITANS_HAS_MXCSR
        if (enable) {
            saved_ = _mm_getcsr();
            active_ = true;
            _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
        }
#else
        (void)enable;
#endif
    }
    ~DenormalFlushScope() {
#if TITANS_HAS_MXCSR
        if (active_) {
            _mm_setcsr(saved_);
        }
#endif
    }
    DenormalFlushScope(const DenormalFlushScope&) = delete;
    DenormalFlushScope& operator=(const DenormalFlushScope&) = delete;

private:
    unsigned saved_ = 0;
    bool active_ = false;
};

/// True if every entry is finite. x * 0 is 0 for finite x and NaN for NaN or infinity, and the
/// sum of the products is a vectorised reduction (Eigen's allFinite() is not vectorised).
template <class Derived>
[[nodiscard]] bool all_finite(const Derived& x) {
    using T = typename Derived::Scalar;
    return (x.array() * T(0)).sum() == T(0);
}

/// all_finite over every matrix of a (nested) std::vector of matrices: the state gradients'
/// per-sequence and per-(sequence, head) parts.
template <class Derived>
[[nodiscard]] bool all_finite_each(const Eigen::MatrixBase<Derived>& x) {
    return all_finite(x.derived());
}
template <class X>
[[nodiscard]] bool all_finite_each(const std::vector<X>& xs) {
    for (const X& x : xs) {
        if (!all_finite_each(x)) {
            return false;
        }
    }
    return true;
}

/// The first row of m holding a NaN or an infinity; m.rows() if every row is finite. What the
/// errors name when a call's output or state would not be finite.
template <class Derived>
[[nodiscard]] Eigen::Index first_nonfinite_row(const Derived& m) {
    Eigen::Index r = 0;
    while (r < m.rows() && all_finite(m.row(r))) {
        ++r;
    }
    return r;
}

}  // namespace titans::detail
