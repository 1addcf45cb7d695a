#pragma once
// titans/backend/cpu/glue_kernels.hpp: the glue between layers on the CPU (layers/glue.hpp):
// residual sums, MAG's gate, finiteness, the embedding gather and the head's product, on
// host views through Eigen maps.

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/cross_entropy.hpp"
#include "../../detail/float_env.hpp"
#include "../../detail/product.hpp"
#include "../../detail/scaled_norm.hpp"
#include "../../detail/tensor_slots.hpp"
#include "../../layers/glue.hpp"
#include "../../types.hpp"
#include "../backend.hpp"
#include "transfer.hpp"

namespace titans::backend {

struct Cpu;

/// The glue kernels on the CPU: the expressions the blocks evaluated on host matrices, on
/// views (the same bits).
template <class T>
struct GlueKernels<Cpu, T> {
    static void copy(View<const T> from, View<T> to) { cpu::as_eigen(to) = cpu::as_eigen(from); }
    static void add(View<const T> a, View<const T> b, View<T> out) {
        cpu::as_eigen(out) = cpu::as_eigen(a) + cpu::as_eigen(b);
    }
    static void gate(View<const T> y, View<const T> m, View<T> out) {
        cpu::as_eigen(out) =
            (cpu::as_eigen(y).array() *
             cpu::as_eigen(m).unaryExpr([](T v) { return detail::sigmoid(v); }).array())
                .matrix();
    }
    static void gate_backward(View<const T> dout, View<const T> a, View<const T> m, View<T> da,
                              View<T> dm) {
        const auto g = cpu::as_eigen(m).unaryExpr([](T v) { return detail::sigmoid(v); });
        const auto d = cpu::as_eigen(dout).array();
        cpu::as_eigen(da) = (d * g.array()).matrix();
        cpu::as_eigen(dm) = (d * cpu::as_eigen(a).array() * g.array() * (T(1) - g.array()))
                                .matrix();
    }
    static void fill(View<T> to, T value) { cpu::as_eigen(to).setConstant(value); }
    static void copy_rows(View<const T> from, View<T> to, RowBlocks r) {
        const auto f = cpu::as_eigen(from);
        auto t = cpu::as_eigen(to);
        for (std::ptrdiff_t i = 0; i < r.count; ++i) {
            t.middleRows(i * r.to_step + r.to_first, r.rows) =
                f.middleRows(i * r.from_step + r.from_first, r.rows);
        }
    }
    static void add_rows(View<const T> from, View<T> to, RowBlocks r) {
        const auto f = cpu::as_eigen(from);
        auto t = cpu::as_eigen(to);
        for (std::ptrdiff_t i = 0; i < r.count; ++i) {
            t.middleRows(i * r.to_step + r.to_first, r.rows) +=
                f.middleRows(i * r.from_step + r.from_first, r.rows);
        }
    }
    static std::ptrdiff_t nonfinite_row(View<const T> x) {
        const auto m = cpu::as_eigen(x);
        if (detail::all_finite(m)) {
            return -1;
        }
        return static_cast<std::ptrdiff_t>(detail::first_nonfinite_row(m));
    }
    /// Token ids as the kernels read them: a host copy (the CPU reads host memory).
    using Ids = std::vector<int>;
    static Ids upload_ids(std::span<const int> ids) { return Ids(ids.begin(), ids.end()); }
    static void gather(View<const T> table, std::span<const int> ids, View<T> out) {
        const auto t = cpu::as_eigen(table);
        auto o = cpu::as_eigen(out);
        for (std::size_t i = 0; i < ids.size(); ++i) {
            o.row(static_cast<Eigen::Index>(i)) = t.row(ids[i]);
        }
    }
    static void product(View<const T> x, View<const T> w, View<T> out) {
        detail::multiply(cpu::as_eigen(out), cpu::as_eigen(x), cpu::as_eigen(w));
    }
    /// Eigen's product assigned to a matrix of its own, then copied: not multiply()'s row
    /// kernel, which sums a few rows in another order (MAC's P W_K, P W_V: the bits they had).
    static void product_plain(View<const T> x, View<const T> w, View<T> out) {
        Matrix<T> t;
        t = cpu::as_eigen(x) * cpu::as_eigen(w);
        cpu::as_eigen(out) = t;
    }
    static void product_at(View<const T> a, View<const T> b, View<T> out) {
        cpu::as_eigen(out).noalias() = cpu::as_eigen(a).transpose() * cpu::as_eigen(b);
    }
    static void product_bt(View<const T> a, View<const T> b, View<T> out) {
        cpu::as_eigen(out).noalias() = cpu::as_eigen(a) * cpu::as_eigen(b).transpose();
    }
    /// The scalars on the host, read in place.
    struct Scalars {
        ScalarValues values{};
    };
    static Scalars make_scalars() { return Scalars{}; }
    static ScalarValues read(const Scalars& s) { return s.values; }
    static void cross_entropy(View<const T> logits, std::span<const int> labels,
                              View<T> dlogits, Scalars& s, std::size_t slot) {
        s.values[slot] =
            detail::cross_entropy_rows(cpu::as_eigen(logits), labels, cpu::as_eigen(dlogits));
    }
    /// detail::scaled_norm over the parts of x (what gradient_norm computes tensor by tensor),
    /// then the clipping (the expression clip_gradient_norm evaluates).
    static void clip(View<T> x, std::span<const std::ptrdiff_t> parts, double max_norm,
                     Scalars& s, std::size_t slot) {
        std::vector<detail::TensorSlot<const T>> slots;
        slots.reserve(parts.size());
        const T* at = x.data;
        for (const std::ptrdiff_t n : parts) {
            slots.push_back({std::string(), at, 1, n});
            at += n;
        }
        const auto [scale_of, sum] = detail::scaled_norm(slots);
        const double norm =
            scale_of == 0.0 || !std::isfinite(scale_of) ? scale_of : scale_of * std::sqrt(sum);
        s.values[slot] = norm;
        if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) {
            scale(x, static_cast<T>(max_norm / norm));
        }
    }
    static void scale(View<T> x, T factor) { cpu::as_eigen(x).array() *= factor; }
    using Parts = std::vector<detail::AdamWPart>;
    static Parts upload_parts(std::span<const detail::AdamWPart> parts) {
        return Parts(parts.begin(), parts.end());
    }
    /// detail::adamw_update on each part's entries (the host AdamW's expression: the same
    /// bits).
    static void adamw(const detail::AdamWStep<T>& f, const Parts& parts,
                      View<const T> p, View<const T> g, View<const T> m, View<const T> v,
                      View<T> p1, View<T> m1, View<T> v1, Scalars& s, std::size_t slot) {
        using A = Eigen::Array<T, Eigen::Dynamic, 1>;
        bool finite = true;
        std::ptrdiff_t at = 0;
        for (const detail::AdamWPart& part : parts) {
            const auto in = [&](View<const T> x) { return Eigen::Map<const A>(x.data + at, part.size); };
            Eigen::Map<A> op(p1.data + at, part.size), om(m1.data + at, part.size),
                ov(v1.data + at, part.size);
            finite &= detail::adamw_update(f, part.decay, in(p), in(g), in(m), in(v), op, om, ov);
            at += part.size;
        }
        s.values[slot] = finite ? 1.0 : 0.0;
    }
    static void scatter_add(View<const T> rows, std::span<const int> ids, View<T> table) {
        const auto r = cpu::as_eigen(rows);
        auto t = cpu::as_eigen(table);
        for (std::size_t i = 0; i < ids.size(); ++i) {
            t.row(ids[i]) += r.row(static_cast<Eigen::Index>(i));
        }
    }
};

}  // namespace titans::backend
