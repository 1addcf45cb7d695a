#pragma once
// titans/backend/cuda/glue_kernels.cuh: the glue between layers on CUDA (layers/glue.hpp):
// copies, residual sums, MAG's gate and its adjoint, row blocks, finiteness, the embedding
// gather and its scatter-add, the head's products, on device views. Stateless: each call runs
// on the calling host thread's stream and cuBLAS handle (thread_context(), call_scope.cuh)
// and returns with it idle, unless a CallScope is open (then it returns at once, its work
// queued in order).

#include <cstddef>
#include <cmath>
#include <span>
#include <utility>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../layers/glue.hpp"
#include "../../types.hpp"
#include "../backend.hpp"
#include "blas.cuh"
#include "call_scope.cuh"
#include "launch.cuh"
#include "layer_kernels.cuh"
#include "runtime.cuh"
#include "../../layers/kernels_decl.hpp"

namespace titans::backend {

struct Cuda;

/// The glue kernels on CUDA: one element-wise launch each (a thread per entry), the head's
/// product on cuBLAS. The device lambdas copy the views' fields into locals (no host object
/// reaches the device).
template <class T>
struct GlueKernels<Cuda, T> {
    static void copy(View<const T> from, View<T> to) {
        const T* a = from.data;
        T* o = to.data;
        const long long as = from.stride, os = to.stride;
        const unsigned c = cuda::u32(to.cols);
        run(to.rows * to.cols, [=] __device__(unsigned i) {
            o[(i / c) * os + i % c] = a[(i / c) * as + i % c];
        });
    }
    static void add(View<const T> a, View<const T> b, View<T> out) {
        binary(a, b, out, Sum{});
    }
    static void gate(View<const T> y, View<const T> m, View<T> out) {
        binary(y, m, out, Gated{});
    }
    static void gate_backward(View<const T> dout, View<const T> a, View<const T> m, View<T> da,
                              View<T> dm) {
        const T *d = dout.data, *av = a.data, *mv = m.data;
        T *oa = da.data, *om = dm.data;
        const long long ds = dout.stride, as = a.stride, ms = m.stride, oas = da.stride,
                        oms = dm.stride;
        const unsigned c = cuda::u32(da.cols);
        run(da.rows * da.cols, [=] __device__(unsigned i) {
            const unsigned r = i / c, j = i % c;
            const T g = detail::sigmoid(mv[r * ms + j]), dv = d[r * ds + j];
            oa[r * oas + j] = dv * g;
            om[r * oms + j] = dv * av[r * as + j] * g * (T(1) - g);
        });
    }
    static void fill(View<T> to, T value) {
        T* o = to.data;
        const long long os = to.stride;
        const unsigned c = cuda::u32(to.cols);
        run(to.rows * to.cols, [=] __device__(unsigned i) { o[(i / c) * os + i % c] = value; });
    }
    /// One thread per entry of a block's rows, every block.
    static void copy_rows(View<const T> from, View<T> to, RowBlocks r) {
        const T* f = from.data;
        T* o = to.data;
        const long long fs = from.stride, os = to.stride, fstep = r.from_step,
                        ffirst = r.from_first, tstep = r.to_step, tfirst = r.to_first;
        const unsigned c = cuda::u32(to.cols), n = cuda::u32(r.rows);
        run(r.count * r.rows * to.cols, [=] __device__(unsigned i) {
            const long long b = i / (n * c), q = (i / c) % n, j = i % c;
            o[(b * tstep + tfirst + q) * os + j] = f[(b * fstep + ffirst + q) * fs + j];
        });
    }
    /// One thread per entry of a block's rows, adding the blocks in order (deterministic, and
    /// a sum into the same rows when to_step is 0).
    static void add_rows(View<const T> from, View<T> to, RowBlocks r) {
        const T* f = from.data;
        T* o = to.data;
        const long long fs = from.stride, os = to.stride, fstep = r.from_step,
                        ffirst = r.from_first, tstep = r.to_step, tfirst = r.to_first,
                        count = r.count;
        const unsigned c = cuda::u32(to.cols);
        run(r.rows * to.cols, [=] __device__(unsigned i) {
            const long long q = i / c, j = i % c;
            for (long long b = 0; b < count; ++b) {
                o[(b * tstep + tfirst + q) * os + j] += f[(b * fstep + ffirst + q) * fs + j];
            }
        });
    }
    /// A device minimum of the rows holding a NaN or an infinity; the one scalar comes back.
    /// Inside a CallScope: -1 at once, the check deferred to the scope's flag.
    static std::ptrdiff_t nonfinite_row(View<const T> x) {
        cuda::DeviceBuffer<unsigned> flag(cuda::deferring() ? 0 : 1);  // deferred: the scope's
        return static_cast<std::ptrdiff_t>(
            cuda::checked_row<T>(cuda::thread_context().stream(), x, flag.data()));
    }
    /// out = a + b and out's first non-finite row (backend::add_nonfinite_row): inside a
    /// deferring scope the sum raises the scope's flag itself, in the same launch (-1 back).
    static std::ptrdiff_t add_checked(View<const T> a, View<const T> b, View<T> out) {
        if (!cuda::deferring()) {
            add(a, b, out);
            return nonfinite_row(View<const T>(out));
        }
        const T* x = a.data;
        const T* y = b.data;
        T* o = out.data;
        unsigned* f = cuda::CallScope::active()->flag();
        const long long as = a.stride, bs = b.stride, os = out.stride;
        const unsigned c = cuda::u32(out.cols);
        run(out.rows * out.cols, [=] __device__(unsigned i) {
            const unsigned r = i / c, j = i % c;
            const T v = Sum{}(x[r * as + j], y[r * bs + j]);
            o[r * os + j] = v;
            if (cuda::not_finite(v)) {
                atomicMax(f, 1u);
            }
        });
        return -1;
    }
    /// What Model::forward runs a call in (call_scope.cuh): one stream, no wait but the
    /// flag's at the edge (flagged()), and a strict rerun if it is raised.
    using CallScope = cuda::CallScope;
    /// Whether a deferring CallScope is active on this thread.
    static bool deferring() { return cuda::deferring(); }
    /// What a block holds around a sub-layer whose output a later check covers
    /// (backend::CoveredOf).
    using Covered = cuda::OutputCovered;
    /// Token ids in device memory.
    struct Ids {
        cuda::DeviceBuffer<int> ids;
        [[nodiscard]] std::size_t size() const { return ids.size(); }
    };
    /// One copy up (the ids checked by the caller).
    static Ids upload_ids(std::span<const int> ids) {
        return Ids{ids.empty() ? cuda::DeviceBuffer<int>()
                               : cuda::upload_array(ids.data(), ids.size())};
    }
    static void gather(View<const T> table, const Ids& ids, View<T> out) {
        if (ids.size() == 0 || out.cols == 0) {
            return;
        }
        const int* id = ids.ids.data();
        const T* t = table.data;
        T* o = out.data;
        const long long ts = table.stride, os = out.stride;
        const unsigned c = cuda::u32(out.cols);
        run(out.rows * out.cols, [=] __device__(unsigned i) {
            const unsigned r = i / c, j = i % c;
            o[r * os + j] = t[static_cast<long long>(id[r]) * ts + j];
        });
    }
    static void product(View<const T> x, View<const T> w, View<T> out) {
        gemm(false, x, false, w, out, x.cols);
    }
    static void product_plain(View<const T> x, View<const T> w, View<T> out) { product(x, w, out); }
    static void product_at(View<const T> a, View<const T> b, View<T> out) {
        gemm(true, a, false, b, out, a.rows);
    }
    static void product_bt(View<const T> a, View<const T> b, View<T> out) {
        gemm(false, a, true, b, out, a.cols);
    }
    /// The scalars in device memory; read() brings them back together.
    struct Scalars {
        cuda::DeviceBuffer<double> values;
    };
    static Scalars make_scalars() {
        Scalars s{cuda::DeviceBuffer<double>(scalar_slots)};
        cuda::set_now(s.values.data(), 0, scalar_slots * sizeof(double), "cudaMemset (scalars)");
        return s;
    }
    static ScalarValues read(const Scalars& s) {
        ScalarValues out{};
        cuda::copy_now(out.data(), s.values.data(), scalar_slots * sizeof(double),
                       cudaMemcpyDeviceToHost, "cudaMemcpy (scalars)");
        return out;
    }
    /// One thread per row (log-sum-exp in double, as the CPU's), then the rows' losses summed
    /// in order on the device into the slot.
    static void cross_entropy(View<const T> logits, std::span<const int> labels,
                              View<T> dlogits, Scalars& s, std::size_t slot) {
        fill(dlogits, T(0));
        double* out = s.values.data() + slot;
        long long counted = 0;
        for (const int label : labels) counted += label >= 0;
        if (counted == 0) {
            run(1, [=] __device__(unsigned) { *out = 0.0; });
            return;
        }
        const cuda::DeviceBuffer<int> dev = cuda::upload_array(labels.data(), labels.size());
        cuda::DeviceBuffer<double> row_loss(labels.size());
        const int* lab = dev.data();
        double* rl = row_loss.data();
        const T* z = logits.data;
        T* d = dlogits.data;
        const long long zs = logits.stride, ds = dlogits.stride, V = logits.cols,
                        rows = logits.rows;
        const double inv_n = 1.0 / static_cast<double>(counted);
        run(rows, [=] __device__(unsigned r) {
            const int label = lab[r];
            rl[r] = 0.0;
            if (label < 0) return;
            const T* zr = z + r * zs;
            double m = static_cast<double>(zr[0]), sum = 0.0;
            for (long long j = 1; j < V; ++j) m = fmax(m, static_cast<double>(zr[j]));
            for (long long j = 0; j < V; ++j) sum += exp(static_cast<double>(zr[j]) - m);
            rl[r] = log(sum) + m - static_cast<double>(zr[label]);
            for (long long j = 0; j < V; ++j) {
                d[r * ds + j] = static_cast<T>(exp(static_cast<double>(zr[j]) - m) / sum * inv_n);
            }
            d[r * ds + label] -= static_cast<T>(inv_n);
        });
        run(1, [=] __device__(unsigned) {
            double total = 0.0;
            for (long long r = 0; r < rows; ++r) total += rl[r];
            *out = total * inv_n;
        });
    }
    /// Chunks of x reduced by one thread each, then the chunks' results in order by one
    /// thread (deterministic): the largest |entry| (NaN propagates), then Σ (entry / scale)² in
    /// double, the norm into the slot and the clipping factor beside the chunks' sums, then x
    /// scaled by it; no branch on the host. The parts do not change the value beyond rounding
    /// (the CPU sums by part).
    static void clip(View<T> x, std::span<const std::ptrdiff_t> /*parts*/, double max_norm,
                     Scalars& s, std::size_t slot) {
        double* out = s.values.data() + slot;
        const long long n = x.rows * x.cols;
        if (n == 0) {
            run(1, [=] __device__(unsigned) { *out = 0.0; });
            return;
        }
        constexpr long long chunk = 4096;
        const long long parts = (n + chunk - 1) / chunk;
        cuda::DeviceBuffer<double> part(static_cast<std::size_t>(parts) + 2);
        double* pp = part.data();  // the chunks', then [parts] the scale, [parts + 1] the factor
        T* v = x.data;
        run(parts, [=] __device__(unsigned i) {
            double m = 0.0;
            const long long hi = (i + 1) * chunk, end = hi < n ? hi : n;
            for (long long j = i * chunk; j < end; ++j) {
                const double a = fabs(static_cast<double>(v[j]));
                if (!(a <= m)) m = a;
                if (m != m) break;  // NaN sticks
            }
            pp[i] = m;
        });
        run(1, [=] __device__(unsigned) {
            double r = 0.0;
            for (long long i = 0; i < parts; ++i) {
                if (!(pp[i] <= r)) r = pp[i];
                if (r != r) break;  // NaN sticks
            }
            pp[parts] = r;
        });
        run(parts, [=] __device__(unsigned i) {
            const double scale = pp[parts];
            double sum = 0.0;
            if (scale != 0.0 && scale - scale == 0.0) {  // 0, NaN or inf: no sum
                const long long hi = (i + 1) * chunk, end = hi < n ? hi : n;
                for (long long j = i * chunk; j < end; ++j) {
                    const double a = static_cast<double>(v[j]) / scale;
                    sum += a * a;
                }
            }
            pp[i] = sum;
        });
        run(1, [=] __device__(unsigned) {
            double sum = 0.0;
            for (long long i = 0; i < parts; ++i) sum += pp[i];
            const double scale = pp[parts];
            const double norm = scale == 0.0 || scale - scale != 0.0 ? scale : scale * sqrt(sum);
            *out = norm;
            pp[parts + 1] = max_norm > 0 && norm - norm == 0.0 && norm > max_norm
                                ? max_norm / norm : 1.0;
        });
        if (max_norm > 0) {
            run(n, [=] __device__(unsigned i) {
                const double f = pp[parts + 1];
                if (f != 1.0) v[i] *= static_cast<T>(f);
            });
        }
    }
    static void scale(View<T> x, T factor) {
        T* o = x.data;
        const long long os = x.stride;
        const unsigned c = cuda::u32(x.cols);
        run(x.rows * x.cols, [=] __device__(unsigned i) { o[(i / c) * os + i % c] *= factor; });
    }
    /// detail::adamw_entry per entry, a thread each (1 x n contiguous views), in one launch
    /// (a thread finds its part by bisection); any non-finite result clears the slot.
    /// AdamW's tensors on the device: each one's end, then each one's decay flag.
    struct Parts {
        cuda::DeviceBuffer<long long> layout;
        long long k = 0;
        [[nodiscard]] std::size_t size() const { return static_cast<std::size_t>(k); }
    };
    static Parts upload_parts(std::span<const detail::AdamWPart> parts) {
        const long long k = static_cast<long long>(parts.size());
        if (k == 0) return Parts{};
        std::vector<long long> layout(static_cast<std::size_t>(2 * k), 0);
        long long end = 0;
        for (long long j = 0; j < k; ++j) {
            end += parts[static_cast<std::size_t>(j)].size;
            layout[static_cast<std::size_t>(j)] = end;
            layout[static_cast<std::size_t>(k + j)] = parts[static_cast<std::size_t>(j)].decay;
        }
        return Parts{cuda::upload_array(layout.data(), layout.size()), k};
    }
    static void adamw(const detail::AdamWStep<T>& f, const Parts& parts, View<const T> p,
                      View<const T> g, View<const T> m, View<const T> v, View<T> p1, View<T> m1,
                      View<T> v1, Scalars& s, std::size_t slot) {
        double* flag = s.values.data() + slot;
        run(1, [=] __device__(unsigned) { *flag = 1.0; });
        const long long k = parts.k;
        if (p.cols == 0 || k == 0) {
            return;
        }
        const long long* ends = parts.layout.data();
        const T *pp = p.data, *gp = g.data, *mp = m.data, *vp = v.data;
        T *po = p1.data, *mo = m1.data, *vo = v1.data;
        const detail::AdamWStep<T> st = f;
        run(p.cols, [=] __device__(unsigned i) {
            long long lo = 0, hi = k - 1;  // the first part whose end lies beyond i
            while (lo < hi) {
                const long long mid = (lo + hi) / 2;
                if (ends[mid] > static_cast<long long>(i)) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            if (!detail::adamw_entry(st, ends[k + lo] != 0, pp[i], gp[i], mp[i], vp[i], po + i,
                                     mo + i, vo + i)) {
                *flag = 0.0;  // every writer stores the same value
            }
        });
    }
    /// One thread per column, the rows added in order (repeated ids add deterministically).
    static void scatter_add(View<const T> rows, const Ids& ids, View<T> table) {
        if (ids.size() == 0 || table.cols == 0) {
            return;
        }
        const int* id = ids.ids.data();
        const T* r = rows.data;
        T* t = table.data;
        const long long rs = rows.stride, ts = table.stride,
                        n = static_cast<long long>(ids.size());
        run(table.cols, [=] __device__(unsigned j) {
            for (long long i = 0; i < n; ++i) {
                t[static_cast<long long>(id[i]) * ts + j] += r[i * rs + j];
            }
        });
    }

    /// out = op(a) op(b) on cuBLAS (row-major; k the inner size), then waits for it.
    static void gemm(bool ta, View<const T> a, bool tb, View<const T> b, View<T> out,
                     std::ptrdiff_t k) {
        if (out.rows == 0 || out.cols == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        cuda::gemm<T>(cx.blas(), ta, tb, static_cast<int>(out.rows), static_cast<int>(out.cols),
                      static_cast<int>(k), T(1), {a.data, static_cast<int>(a.stride)},
                      {b.data, static_cast<int>(b.stride)}, T(0), out.data,
                      static_cast<int>(out.stride), 0, 1);
        cuda::idle(cx);
    }

    struct Sum {
        TITANS_HOST_DEVICE T operator()(T a, T b) const { return a + b; }
    };
    struct Gated {
        TITANS_HOST_DEVICE T operator()(T y, T m) const { return y * detail::sigmoid(m); }
    };
    /// out = op(x, y) entry by entry (out may be x or y).
    template <class Op>
    static void binary(View<const T> x, View<const T> y, View<T> out, Op op) {
        const T* a = x.data;
        const T* b = y.data;
        T* o = out.data;
        const long long as = x.stride, bs = y.stride, os = out.stride;
        const unsigned c = cuda::u32(out.cols);
        run(out.rows * out.cols, [=] __device__(unsigned i) {
            const unsigned r = i / c, j = i % c;
            o[r * os + j] = op(a[r * as + j], b[r * bs + j]);
        });
    }

    /// f(i) for i < n on this thread's stream, then waits for it.
    template <class F>
    static void run(long long n, F f) {
        const cuda::StreamContext& cx = cuda::thread_context();
        cuda::each(cx.stream(), n, f);
        cuda::idle(cx);
    }
};

template <class T>
void Transfer<Cuda, T>::accumulate(View<const T> host, View<T> to) {
    const Buffer up = upload(host);
    GlueKernels<Cuda, T>::add(view(up), to, to);
}

}  // namespace titans::backend
