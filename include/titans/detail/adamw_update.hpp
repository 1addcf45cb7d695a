#pragma once
// titans/detail/adamw_update.hpp: one AdamW step entry by entry (math §9), what the host
// optimiser (train/adamw.hpp) and every backend's glue kernel `adamw` compute: the same
// expression, so the CPU's bits are the host optimiser's.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include <Eigen/Core>

#include "../config.hpp"

namespace titans::detail {

/// The scalars of AdamW's step t, in T (train/adamw.hpp computes them from the settings and
/// the learning rate; the kernels take them by value).
template <class T>
struct AdamWStep {
    std::int64_t t = 0;  ///< the step's number, >= 1
    T b1{}, b2{}, eps{};
    T step{};    ///< lr / (1 - β1^t)
    T root2{};   ///< sqrt(1 - β2^t)
    T shrink{};  ///< 1 - lr λ (applied where a tensor is decayed)
};

/// One tensor of a flat parameter buffer, as AdamW sees it: its entries, and whether it is
/// decayed (AdamW<T>::decays).
struct AdamWPart {
    std::ptrdiff_t size = 0;
    bool decay = false;
};

/// Whether x is neither NaN nor infinite (x - x is 0 exactly then, NaN otherwise), on the host
/// and the device alike.
template <class T>
TITANS_HOST_DEVICE bool finite_entry(T x) {
    return x - x == T(0);
}

/// The update of n entries from p, g, m, v to p1, m1, v1 (which may be p, m, v themselves;
/// Eigen arrays or maps):
///
///     m1 = β1 m + (1 - β1) g,   v1 = β2 v + (1 - β2) g²
///     p1 = p (1 - lr λ if shrink) - step m1 / (sqrt(v1) / root2 + ε)
///
/// Every operation is correctly rounded, so each entry's bits depend on nothing but its
/// inputs (not on where the entry lies in memory, nor on the vector width): the square root
/// is std::sqrt entry by entry, because Eigen's vectorised float sqrt (EIGEN_FAST_MATH, on by
/// default) is an approximate reciprocal root with one Newton step, 1-2 bits off, and its
/// packets start where the data's alignment puts them. Returns whether every new entry (p1,
/// m1, v1) is finite.
template <class T, class In, class Out>
bool adamw_update(const AdamWStep<T>& f, bool shrink, const In& p, const In& g, const In& m,
                  const In& v, Out& p1, Out& m1, Out& v1) {
    m1 = f.b1 * m + (T(1) - f.b1) * g;
    v1 = f.b2 * v + (T(1) - f.b2) * g.square();
    if (shrink) {
        p1 = p * f.shrink;
    } else if (p1.data() != p.data()) {
        p1 = p;
    }
    bool finite = true;
    for (Eigen::Index i = 0; i < p1.size(); ++i) {
        p1[i] -= f.step * m1[i] / (std::sqrt(v1[i]) / f.root2 + f.eps);
        const bool m_ok = finite_entry(m1[i]), v_ok = finite_entry(v1[i]),
                   p_ok = finite_entry(p1[i]);
        finite &= m_ok & v_ok & p_ok;  // (no branch in the loop)
    }
    return finite;
}

/// adamw_update of one entry, returning whether its new values are finite (the device kernels' form: the same operations in the same
/// order; a compiler that fuses a multiply and an add, as nvcc does, rounds them once).
template <class T>
TITANS_HOST_DEVICE bool adamw_entry(const AdamWStep<T>& f, bool shrink, T p, T g, T m, T v,
                                    T* p1, T* m1, T* v1) {
    const T mn = f.b1 * m + (T(1) - f.b1) * g;
    const T vn = f.b2 * v + (T(1) - f.b2) * (g * g);
    const T base = shrink ? p * f.shrink : p;
    *m1 = mn;
    *v1 = vn;
    const T pn = base - f.step * mn / (std::sqrt(vn) / f.root2 + f.eps);
    *p1 = pn;
    return finite_entry(mn) && finite_entry(vn) && finite_entry(pn);
}

}  // namespace titans::detail
