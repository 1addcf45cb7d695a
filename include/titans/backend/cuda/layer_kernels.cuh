#pragma once
// titans/backend/cuda/layer_kernels.cuh: RMSNorm and FeedForward on CUDA (math §7, and their
// backward passes of math §9), float and double.
//
// Stateless layers have no state to own a stream: their calls run on the calling host
// thread's own stream and cuBLAS handle (thread_context()), and return with it idle.

#include <memory>

#include "../../detail/flat_tensors.hpp"
#include "../../detail/activation.hpp"
#include "../../detail/norm_scale.hpp"
#include "../../layers/feed_forward.hpp"
#include "../../layers/rms_norm.hpp"
#include "../../types.hpp"
#include "../backend.hpp"
#include "blas.cuh"
#include "call_scope.cuh"
#include "feed_forward_rows.cuh"
#include "launch.cuh"
#include "rms_rows.cuh"
#include "transfer.cuh"
#include "../../layers/kernels_decl.hpp"

namespace titans::backend {

struct Cuda;

namespace cuda {

/// Where gated_norms_kernel reads and writes: o (ld os, overwritten) and m (ld ms), d wide,
/// the norms' weights wo, wm and their eps; an entry of o or m that is not finite raises
/// `raise` (when given: a deferring call scope's flag, the check of both inputs).
template <class T>
struct GatedNorms {
    T* o;
    long long os;
    const T* m;
    long long ms;
    const T *wo, *wm;
    int d;
    T eps_o, eps_m;
    unsigned* raise;
};

#if TITANS_CUDA_DEVICE_CODE
/// MAG's output of row blockIdx.x in one pass: o = RMSNorm_o(o) ⊙ σ(RMSNorm_m(m)), each norm
/// as rms_rows_kernel takes it, the gate as GlueKernels::gate (the same bits as the three
/// launches).
template <class T>
__global__ void gated_norms_kernel(GatedNorms<T> g) {
    __shared__ T part[256];
    const long long r = blockIdx.x;
    T* o = g.o + r * g.os;
    const T* m = g.m + r * g.ms;
    int eo = 0, em = 0;
    const T ro = row_inv_rms(part, o, g.d, g.eps_o, eo);
    const T rm = row_inv_rms(part, m, g.d, g.eps_m, em);
    bool bad = false;
    for (int j = threadIdx.x; j < g.d; j += blockDim.x) {
        bad = bad || not_finite(o[j]) || not_finite(m[j]);
        const T mj = detail::scale_down(m[j], em) * rm * g.wm[j];
        const T yj = detail::scale_down(o[j], eo) * ro * g.wo[j];
        o[j] = yj * detail::sigmoid(mj);
    }
    if (bad && g.raise != nullptr) {
        atomicMax(g.raise, 1u);
    }
}

/// RMSNorm backward of row blockIdx.x through xh = x / rms (|xh_j| <= sqrt(d), no overflow):
/// with u = dy ⊙ w, 1 / rms = rr 2^-e and c = <u, xh> / d, dx = ((u - xh c) rr) 2^-e. rr is
/// the kept 1 / rms (e = 0) unless that is subnormal (rms beyond 2^(max exponent - 2), where
/// eps is below the rounding of mean(x^2)): then it is taken again from the row, scaled.
/// scale[2 r], scale[2 r + 1] get rr and e, for the weight gradient.
template <class T>
__global__ void rms_backward_rows_kernel(const T* x, long long xs, const T* inv, long long is,
                                         const T* dy, long long dys, T* dx, long long dxs,
                                         const T* w, int d, T* scale) {
    __shared__ T part[256];
    const long long r = blockIdx.x;
    const T* xr = x + r * xs;
    T rr = inv[r * is];
    int e = 0;
    if (!(rr >= detail::smallest_normal<T>())) {
        const T scaled = scaled_row_sum(part, xr, d, e);
        rr = detail::scaled_inv_rms(scaled, T(1) / static_cast<T>(d), T(0), e);
    }
    T dot = T(0);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        dot += dy[r * dys + j] * w[j] * (detail::scale_down(xr[j], e) * rr);
    }
    const T c = block_reduce<false>(part, dot) / static_cast<T>(d);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const T xh = detail::scale_down(xr[j], e) * rr;
        dx[r * dxs + j] = detail::scale_down((dy[r * dys + j] * w[j] - xh * c) * rr, e);
    }
    if (threadIdx.x == 0) {
        scale[2 * r] = rr;
        scale[2 * r + 1] = static_cast<T>(e);
    }
}
#endif

}  // namespace cuda

/// RMSNorm on CUDA: the weight uploaded once; a block per row. Right for every finite row, as
/// on the CPU (a row whose sum of squares overflows is normalised scaled by a power of two);
/// the backward always goes through the normalised row (no plain branch to keep bits of).
template <class T>
struct NormKernels<Cuda, T> {
    using Prepared = std::shared_ptr<const cuda::DeviceBuffer<T>>;

    static Prepared prepare(const std::shared_ptr<const RowVector<T>>& weight) {
        return std::make_shared<const cuda::DeviceBuffer<T>>(cuda::upload_array(
            weight->data(), static_cast<std::size_t>(weight->size())));
    }
    /// The weight from a 1 x d device view: a copy on the device.
    static Prepared prepare_flat(View<const T> flat) {
        return std::make_shared<const cuda::DeviceBuffer<T>>(cuda::concat_columns({flat}));
    }
    static void forward(const Prepared& w, T eps, View<const T> x, View<T> y) {
        run(w, eps, x, y, nullptr, 0);
    }
    /// s = a + s, then y = RMSNorm(s), in one launch (the sum in the order Glue::add takes it);
    /// inside a deferring scope a sum that is not finite raises the scope's flag.
    static void forward_sum(const Prepared& w, T eps, View<const T> a, View<T> s, View<T> y) {
        run(w, eps, View<const T>(s), y, nullptr, 0, a, s.data);
    }
    static void forward_train(const Prepared& w, T eps, View<const T> x, View<T> y,
                              View<T> inv_rms) {
        run(w, eps, x, y, inv_rms.data, inv_rms.stride);
    }
    /// o = RMSNorm_o(o) ⊙ σ(RMSNorm_m(m)) in one launch (MAG's output; m left as it was);
    /// inside a deferring scope an input entry that is not finite raises the scope's flag.
    static void forward_gated(const Prepared& wo, T eps_o, const Prepared& wm, T eps_m,
                              View<T> o, View<const T> m) {
        if (o.rows == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        unsigned* raise = cuda::deferred_flag();
        const cuda::GatedNorms<T> g{o.data,    o.stride,  m.data,    m.stride,
                                    wo->data(), wm->data(), static_cast<int>(o.cols),
                                    eps_o,     eps_m,     raise};
        cuda::launch(cuda::gated_norms_kernel<T>, static_cast<unsigned>(o.rows), 256, cx.stream(),
                     g);
        cuda::check_launch("the gated RMSNorm kernel");
        cuda::idle(cx);
    }
    /// dx from dy; dweight (1 x d) += Σ_rows dy ⊙ xh, xh = x / rms as the row kernel scaled it
    /// (a thread per column, rows in order).
    static void backward(const Prepared& w, View<const T> x, View<const T> inv, View<const T> dy,
                         View<T> dx, View<T> dweight) {
        if (x.rows == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        const int d = static_cast<int>(x.cols);
        cuda::DeviceBuffer<T> scale(2 * static_cast<std::size_t>(x.rows));
        cuda::launch(cuda::rms_backward_rows_kernel<T>, static_cast<unsigned>(x.rows), 256,
                     cx.stream(), x.data, x.stride, inv.data, inv.stride, dy.data, dy.stride,
                     dx.data, dx.stride, w->data(), d, scale.data());
        cuda::check_launch("the RMSNorm backward kernel");
        const T* xp = x.data;
        const T* sp = scale.data();
        const T* dyp = dy.data;
        T* dw = dweight.data;
        const long long rows = x.rows, xs = x.stride, dys = dy.stride;
        cuda::each(cx.stream(), d, [=] __device__(unsigned j) {
            T s = T(0);
            for (long long r = 0; r < rows; ++r) {
                const int e = static_cast<int>(sp[2 * r + 1]);
                s += dyp[r * dys + j] * (detail::scale_down(xp[r * xs + j], e) * sp[2 * r]);
            }
            dw[j] += s;
        });
        cuda::idle(cx);
    }

    static void run(const Prepared& w, T eps, View<const T> x, View<T> y, T* inv,
                    std::ptrdiff_t is, View<const T> add = {}, T* sum = nullptr) {
        if (x.rows == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        unsigned* raise = sum != nullptr ? cuda::deferred_flag() : nullptr;
        const cuda::RmsRows<T> a{x.data,   x.stride, y.data, y.stride, w->data(),
                                 static_cast<int>(x.cols), eps, inv, is, add.data,
                                 add.stride, sum,   x.stride, raise};
        cuda::launch(cuda::rms_rows_kernel<T>, static_cast<unsigned>(x.rows), 256, cx.stream(), a);
        cuda::check_launch("the RMSNorm kernel");
        cuda::idle(cx);
    }
};

/// FeedForward on CUDA: the products on cuBLAS, the activations element-wise. SwiGLU's W1 and
/// W3 are held side by side (w13, d x 2h): a forward takes x [W1 | W3] in one product.
template <class T>
struct FeedForwardKernels<Cuda, T> {
    struct Params {
        cuda::DeviceBuffer<T> w13, w2;  // w13: [W1 | W3] (SwiGLU) or W1, row-major
        int d = 0, h = 0, ld13 = 0;     // ld13: w13's columns (2h or h)
        [[nodiscard]] const T* w1() const { return w13.data(); }
        [[nodiscard]] const T* w3() const { return w13.data() + h; }
    };
    using Prepared = std::shared_ptr<const Params>;

    static Prepared prepare(const FeedForwardConfig& cfg,
                            const std::shared_ptr<const FeedForwardParams<T>>& hp) {
        const bool glu = cfg.kind == FeedForwardKind::SwiGLU;
        Matrix<T> w13(hp->w1.rows(), hp->w1.cols() * (glu ? 2 : 1));
        w13.leftCols(hp->w1.cols()) = hp->w1;
        if (glu) w13.rightCols(hp->w3.cols()) = hp->w3;
        auto p = std::make_shared<Params>();
        p->w13 = cuda::upload_array(w13.data(), static_cast<std::size_t>(w13.size()));
        p->w2 = cuda::upload_array(hp->w2.data(), static_cast<std::size_t>(hp->w2.size()));
        p->d = static_cast<int>(hp->w1.rows());
        p->h = static_cast<int>(hp->w1.cols());
        p->ld13 = static_cast<int>(w13.cols());
        return p;
    }
    /// The parameters from their flat form in device memory (FeedForwardParams::tensors order:
    /// w1, w3 for SwiGLU, w2), copied on the device.
    static Prepared prepare_flat(const FeedForwardConfig& cfg, const FeedForwardParams<T>& shapes,
                                 View<const T> flat) {
        const auto v = detail::flat_views(flat, shapes, cfg);
        const bool glu = cfg.kind == FeedForwardKind::SwiGLU;
        auto p = std::make_shared<Params>();
        p->w13 = glu ? cuda::concat_columns({v[0], v[1]}) : cuda::concat_columns({v[0]});
        p->w2 = cuda::concat_columns({v[glu ? 2 : 1]});
        p->d = static_cast<int>(shapes.w1.rows());
        p->h = static_cast<int>(shapes.w1.cols());
        p->ld13 = glu ? 2 * p->h : p->h;
        return p;
    }

    /// a and g side by side in one buffer (rows x ld13): forward_train's one product; or, for
    /// a few rows with set_fused_feed_forward(true), one launch (feed_forward_rows.cuh).
    static void forward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> x,
                        View<T> y) {
        if (cuda::feed_forward_rows_apply(x.rows)) {
            rows_launch(rows_args(cfg, p, x, y));
            return;
        }
        const auto rows = static_cast<std::size_t>(x.rows);
        cuda::DeviceBuffer<T> ag = cuda::call_buffer<T>(rows * static_cast<std::size_t>(p->ld13));
        const View<T> av{ag.data(), x.rows, p->h, p->ld13},
            gv{cfg.kind == FeedForwardKind::SwiGLU ? ag.data() + p->h : nullptr, x.rows, p->h,
               p->ld13};
        forward_train(cfg, p, x, y, av, gv);
    }

    /// A norm's weight and eps, as forward_sums takes them.
    struct Norm {
        const typename NormKernels<Cuda, T>::Prepared& w;
        T eps;
    };

    /// A block's feed-forward with the sums and norms around it: s = a + s, u = pre(s),
    /// y = FFN(u), s = y + s, u_next = next(s) (inside a deferring scope a sum that is not
    /// finite raises the scope's flag). For a few rows with set_fused_feed_forward(true), all in
    /// the feed-forward's one launch (feed_forward_rows.cuh: the same bits as the separate
    /// launches); otherwise NormKernels::forward_sum, forward, NormKernels::forward_sum.
    static void forward_sums(const FeedForwardConfig& cfg, const Prepared& p, Norm pre,
                             View<const T> a, View<T> s, View<T> u, View<T> y, Norm next,
                             View<T> u_next) {
        if (!cuda::feed_forward_rows_apply(a.rows)) {
            NormKernels<Cuda, T>::forward_sum(pre.w, pre.eps, a, s, u);
            forward(cfg, p, View<const T>(u), y);
            NormKernels<Cuda, T>::forward_sum(next.w, next.eps, View<const T>(y), s, u_next);
            return;
        }
        cuda::FeedForwardRows<T> f = rows_args(cfg, p, View<const T>(u), y);
        unsigned* raise = cuda::deferred_flag();
        f.pre = {s.data, s.stride, u.data, u.stride, pre.w->data(), p->d, pre.eps, nullptr, 0,
                 a.data, a.stride, nullptr, 0, raise};
        f.then = {s.data, s.stride, u_next.data, u_next.stride, next.w->data(), p->d, next.eps,
                  nullptr, 0, y.data, y.stride, s.data, s.stride, raise};
        rows_launch(f);
    }

    /// forward, keeping a = x W1 and (SwiGLU) g = x W3 for backward: one product x [W1 | W3]
    /// when g sits right of a in one buffer, else one each.
    static void forward_train(const FeedForwardConfig& cfg, const Prepared& p, View<const T> x,
                              View<T> y, View<T> a, View<T> g) {
        if (x.rows == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        const bool swiglu = cfg.kind == FeedForwardKind::SwiGLU;
        if (swiglu && g.data == a.data + p->h && g.stride == a.stride) {
            product(cx, x, p->w1(), p->ld13, View<T>{a.data, a.rows, p->ld13, a.stride});
        } else {
            product(cx, x, p->w1(), p->ld13, a);
            if (swiglu) {
                product(cx, x, p->w3(), p->ld13, g);
            }
        }
        cuda::DeviceBuffer<T> hb =
            cuda::call_buffer<T>(static_cast<std::size_t>(x.rows) * static_cast<std::size_t>(p->h));
        activation(cx, swiglu, a, g, hb.data());
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(x.rows), p->d, p->h, T(1),
                      {hb.data(), p->h}, {p->w2.data(), p->d}, T(0), y.data,
                      static_cast<int>(y.stride), 0, 1);
        cuda::idle(cx);
    }

    /// math §9 (feed-forward): dW2 += h^T dy, da = dh ⊙ act'(a) (⊙ g), dg = dh ⊙ silu(a),
    /// dW1 += x^T da, dW3 += x^T dg, dx = da W1^T + dg W3^T, with dh = dy W2^T.
    static void backward(const FeedForwardConfig& cfg, const Prepared& p, View<const T> x,
                         View<const T> a, View<const T> g, View<const T> dy, View<T> dx,
                         View<T> dw1, View<T> dw3, View<T> dw2) {
        if (x.rows == 0) {
            return;
        }
        const cuda::StreamContext& cx = cuda::thread_context();
        const bool swiglu = cfg.kind == FeedForwardKind::SwiGLU;
        const int rows = static_cast<int>(x.rows), d = p->d, hd = p->h;
        const auto n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(hd);
        cuda::DeviceBuffer<T> hb(n), dh(n), dg(swiglu ? n : 0);
        activation(cx, swiglu, a, g, hb.data());
        auto bl = cx.blas();
        cuda::gemm<T>(bl, true, false, hd, d, rows, T(1), {hb.data(), hd},
                      {dy.data, static_cast<int>(dy.stride)}, T(1), dw2.data,
                      static_cast<int>(dw2.stride), 0, 1);
        cuda::gemm<T>(bl, false, true, rows, hd, d, T(1), {dy.data, static_cast<int>(dy.stride)},
                      {p->w2.data(), d}, T(0), dh.data(), hd, 0, 1);
        gates_backward(cx, swiglu, a, g, dh.data(), dg.data(), rows, hd);
        const cuda::Operand<T> xo{x.data, static_cast<int>(x.stride)};
        cuda::gemm<T>(bl, true, false, d, hd, rows, T(1), xo, {dh.data(), hd}, T(1), dw1.data,
                      static_cast<int>(dw1.stride), 0, 1);
        cuda::gemm<T>(bl, false, true, rows, d, hd, T(1), {dh.data(), hd}, {p->w1(), p->ld13},
                      T(0), dx.data, static_cast<int>(dx.stride), 0, 1);
        if (swiglu) {
            cuda::gemm<T>(bl, true, false, d, hd, rows, T(1), xo, {dg.data(), hd}, T(1),
                          dw3.data, static_cast<int>(dw3.stride), 0, 1);
            cuda::gemm<T>(bl, false, true, rows, d, hd, T(1), {dg.data(), hd},
                          {p->w3(), p->ld13}, T(1), dx.data, static_cast<int>(dx.stride), 0, 1);
        }
        cuda::idle(cx);
    }

    /// out = x W (rows x out.cols, W d x out.cols of row stride ldw).
    static void product(const cuda::StreamContext& cx, View<const T> x, const T* w, int ldw,
                        View<T> out) {
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(x.rows),
                      static_cast<int>(out.cols), static_cast<int>(x.cols), T(1),
                      {x.data, static_cast<int>(x.stride)}, {w, ldw}, T(0), out.data,
                      static_cast<int>(out.stride), 0, 1);
    }

    /// h = silu(a) ⊙ g (SwiGLU) or gelu(a), dense rows x h.
    static void activation(const cuda::StreamContext& cx, bool swiglu, View<const T> a,
                           View<const T> g, T* h) {
        const long long cols = a.cols, as = a.stride, gs = g.stride;
        const T* ap = a.data;
        const T* gp = g.data;
        cuda::each(cx.stream(), a.rows * cols, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(cols), c = i % cuda::u32(cols);
            const T z = ap[r * as + c];
            h[i] = swiglu ? detail::silu(z) * gp[r * gs + c] : detail::gelu(z);
        });
    }

    /// dh (dense) -> da in place; dg = dh ⊙ silu(a) (SwiGLU): da = dh ⊙ g ⊙ silu'(a), or
    /// dh ⊙ gelu'(a).
    static void gates_backward(const cuda::StreamContext& cx, bool swiglu, View<const T> a,
                               View<const T> g, T* dh, T* dg, int rows, int hd) {
        const long long as = a.stride, gs = g.stride, cols = hd;
        const T* ap = a.data;
        const T* gp = g.data;
        cuda::each(cx.stream(), static_cast<long long>(rows) * hd, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(cols), c = i % cuda::u32(cols);
            const T z = ap[r * as + c];
            if (swiglu) {
                dg[i] = dh[i] * detail::silu(z);
                dh[i] = dh[i] * gp[r * gs + c] * detail::silu_grad(z);
            } else {
                dh[i] = dh[i] * detail::gelu_grad(z);
            }
        });
    }

private:  // (no device lambdas below: nvcc refuses them in private members)
    /// feed_forward_rows' arguments for y = FFN(x), nothing after it.
    static cuda::FeedForwardRows<T> rows_args(const FeedForwardConfig& cfg, const Prepared& p,
                                              View<const T> x, View<T> y) {
        return {x.data,   x.stride, p->w13.data(), p->ld13, p->w2.data(),
                y.data,   y.stride, nullptr,       nullptr, static_cast<int>(x.rows),
                p->d,     p->h,     cfg.kind == FeedForwardKind::SwiGLU, {}, {}};
    }
    static void rows_launch(const cuda::FeedForwardRows<T>& a) {
        const cuda::StreamContext& cx = cuda::thread_context();
        cuda::feed_forward_rows<T>(cx.stream(), a);
        cuda::idle(cx);
    }
};

}  // namespace titans::backend
