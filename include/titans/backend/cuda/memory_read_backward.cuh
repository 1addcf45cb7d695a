#pragma once
// titans/backend/cuda/memory_read_backward.cuh: MemoryTraining<Cuda, T>::ReadBackward, the
// reverse of Kernels::read_weights on the device (MAC's read of its segment-start memory,
// math §7 and §9): the query path without the conv (x W_Q, phi, the heads' norms), the lagged
// read y = M_W(q) per pair through the given weights, then W_O; reversed into dx, the
// weights' adjoint and the gradients of W_Q and W_O. Host matrices in and out (the callers'
// glue is on the host); included at the end of memory_training.cuh.

#include <utility>
#include <vector>

#include "fast_math.cuh"
#include "memory_training.cuh"

namespace titans::backend {

template <class T>
struct MemoryTraining<Cuda, T>::ReadBackward {
    using Layers = std::vector<Mat>;

    const MemoryConfig& cfg;
    const typename Kernels::Params& prm;
    const cuda::StreamContext& cx;
    cudaStream_t sm;
    int B, L;
    long long M, m, d, D, H, dh, P, wd, MW;
    std::vector<long long> lin, lout, lio;
    Buf xb, dyb, cb, preb, qb, nb, Qb, DYb, dyhb, yhb, dqb, dxb, gq, go, tmpb, dHb;
    std::vector<Buf> W, dW, hin, zr;
    std::vector<const T*> Wp;  // the weights read, per layer (W's, or a snapshot's)

    /// For `rows` rows of `batch` streams.
    ReadBackward(const MemoryConfig& c, const typename Kernels::Prepared& pp, long long rows,
                 int batch)
        : cfg(c), prm(*pp), cx(cuda::thread_context()), sm(cx.stream()), B(batch),
          L(c.depth), M(rows), m(rows / batch), d(c.d_model), D(c.inner_dim()),
          H(c.n_heads), dh(c.head_dim()), P(static_cast<long long>(batch) * c.n_heads), wd(dh) {
        for (int l = 1; l <= L; ++l) {
            lin.push_back(c.layer_in(l));
            lout.push_back(c.layer_out(l));
            lio.push_back(lin.back() * lout.back());
            wd = std::max({wd, lin.back(), lout.back()});
        }
        MW = m * wd;
    }

    /// dx (written), dweights (written) and g.w_q, g.w_o (added) from dy = dL/dy (host).
    static void run(ReadBackward& r, const std::vector<Layers>& weights, const Mat& x,
                    const Mat& dy, Mat& dx, std::vector<Layers>& dweights, MemoryParams<T>& g) {
        r.xb = upload_buffer(x);
        r.dyb = upload_buffer(dy);
        for (std::size_t l = 0; l < r.lin.size(); ++l) {
            r.W.push_back(Buf(static_cast<std::size_t>(r.P * r.lio[l])));
            for (long long p = 0; p < r.P; ++p) {
                upload_to(r.W[l].data() + p * r.lio[l], weights[static_cast<std::size_t>(p)][l]);
            }
            r.Wp.push_back(r.W[l].data());
        }
        compute(r);
        r.cx.synchronize();
        dx = download_mat(r.dxb.data(), r.M, r.d);
        dweights.assign(static_cast<std::size_t>(r.P), Layers{});
        for (long long p = 0; p < r.P; ++p) {
            for (std::size_t l = 0; l < r.lin.size(); ++l) {
                dweights[static_cast<std::size_t>(p)].push_back(
                    download_mat(r.dW[l].data() + p * r.lio[l], r.lin[l], r.lout[l]));
            }
        }
        const Mat gq = download_mat(r.gq.data(), r.d, r.D);
        const Mat go = download_mat(r.go.data(), r.D, r.d);
        g.w_q += gq;
        g.w_o += go;
    }

    /// The same on device views through a snapshot: dx written, dW the snapshot's adjoint,
    /// W_Q's and W_O's gradients added to the memory's flat gradient (W_Q first, W_O at
    /// flat_w_o_offset) only if they, dx and dW are finite, which it returns (one flag read).
    static bool run(ReadBackward& r, const CudaMemorySnapshot<T>& s, View<const T> x,
                    View<const T> dy, View<T> dx, CudaMemorySnapshot<T>& dW, View<T> grads) {
        r.xb = Buf(static_cast<std::size_t>(r.M * r.d));
        r.dyb = Buf(r.xb.size());
        copy_2d(r.sm, r.xb.data(), r.d, x.data, x.stride, r.M, r.d);
        copy_2d(r.sm, r.dyb.data(), r.d, dy.data, dy.stride, r.M, r.d);
        for (const Buf& b : s.w_) r.Wp.push_back(b.data());
        compute(r);
        copy_2d(r.sm, dx.data, dx.stride, r.dxb.data(), r.d, r.M, r.d);
        Buf flag = zeros(1);
        T* f = flag.data();
        Sweep::scan_finite(r.sm, r.dxb.data(), r.M * r.d, f);
        Sweep::scan_finite(r.sm, r.gq.data(), r.d * r.D, f);
        Sweep::scan_finite(r.sm, r.go.data(), r.D * r.d, f);
        for (const Buf& b : r.dW) Sweep::scan_finite(r.sm, b.data(), static_cast<long long>(b.size()), f);
        r.cx.synchronize();
        dW.cfg_ = r.cfg;
        dW.pairs_ = static_cast<std::size_t>(r.P);
        dW.w_ = std::move(r.dW);
        if (download_mat(flag.data(), 1, 1)(0, 0) != T(0)) {
            return false;
        }
        cuda::add_entries(r.sm, r.gq.data(), r.d * r.D, grads.data);
        cuda::add_entries(r.sm, r.go.data(), r.D * r.d, grads.data + flat_w_o_offset(r.cfg));
        cuda::idle(r.cx);
        return true;
    }

    /// The read and its reverse from xb, dyb and the weights Wp: dxb, dW, gq and go.
    static void compute(ReadBackward& r) {
        queries(r);
        pair_major(r);
        read(r);
        for (std::size_t l = r.lin.size(); l-- > 0;) {
            layer_backward(r, l);
        }
        inputs_backward(r);
    }

    /// rows x cols from (row stride lf) to to (row stride lt), device to device.
    static void copy_2d(cudaStream_t sm, T* to, long long lt, const T* from, long long lf,
                        long long rows, long long cols) {
        if (rows * cols == 0) return;
        cuda::settle_recorded();
        cuda::check(cudaMemcpy2DAsync(to, static_cast<std::size_t>(lt) * sizeof(T), from,
                                      static_cast<std::size_t>(lf) * sizeof(T),
                                      static_cast<std::size_t>(cols) * sizeof(T),
                                      static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice, sm),
                    "cudaMemcpy2DAsync (read backward)");
    }

    static Buf upload_buffer(const Mat& m) {
        Buf b(static_cast<std::size_t>(m.size()));
        upload_to(b.data(), m);
        return b;
    }

    /// c = x W_Q, pre = phi(c), the heads' norms, q (normalised when normalize_qk).
    static void queries(ReadBackward& r) {
        const auto MD = static_cast<std::size_t>(r.M * r.D);
        r.cb = Buf(MD);
        r.preb = Buf(MD);
        r.qb = Buf(MD);
        r.nb = Buf(static_cast<std::size_t>(r.M * 2 * r.H));
        mm(r.cx, false, false, r.M, r.D, r.d, T(1), r.xb.data(), r.d, 0, r.prm.w_qkv(),
           r.prm.ld_in, 0, T(0), r.cb.data(), r.D, 0, 1);
        const bool silu = r.cfg.qkv_activation == Activation::SiLU;
        const T* c = r.cb.data();
        T* pre = r.preb.data();
        cuda::each(r.sm, r.M * r.D, [=] __device__(unsigned i) {
            pre[i] = silu ? detail::silu(c[i]) : c[i];
        });
        Sweep::head_norms(r.sm, pre, r.nb.data(), r.M, r.D, r.H, r.dh);
        Sweep::normalize(r.sm, pre, r.nb.data(), r.qb.data(), r.M, r.D,
                         r.cfg.normalize_qk ? r.D : 0, r.H, r.dh);
    }

    /// q and dyh = dy W_O^T pair-major, [p][m][dh] at stride MW per pair (the read's first
    /// layer input in hin[0], dyh in DYb).
    static void pair_major(ReadBackward& r) {
        const long long m = r.m, dh = r.dh, H = r.H, D = r.D, MW = r.MW;
        const auto work = static_cast<std::size_t>(r.P * MW);
        r.hin.resize(r.lin.size() + 1);
        for (Buf& b : r.hin) b = zeros(work);
        r.zr.resize(r.lin.size());
        for (Buf& b : r.zr) b = zeros(work);
        r.DYb = zeros(work);
        r.tmpb = zeros(work);
        r.dHb = zeros(work);
        r.dyhb = Buf(static_cast<std::size_t>(r.M * D));
        mm(r.cx, false, true, r.M, D, r.d, T(1), r.dyb.data(), r.d, 0, r.prm.w_o.data(), r.d, 0,
           T(0), r.dyhb.data(), D, 0, 1);
        const T* q = r.qb.data();
        const T* dyh = r.dyhb.data();
        T* h0 = r.hin[0].data();
        T* DY = r.DYb.data();
        cuda::each(r.sm, r.P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), t = (i / cuda::u32(dh)) % cuda::u32(m),
                            j = i % cuda::u32(dh), row = (p / H) * m + t, col = (p % H) * dh + j;
            h0[p * MW + t * dh + j] = q[row * D + col];
            DY[p * MW + t * dh + j] = dyh[row * D + col];
        });
    }

    /// The read z_l = h_l W_l recomputed through Wp (per layer, pairs contiguous), y = z_L
    /// (+ q) row-major in yhb.
    static void read(ReadBackward& r) {
        const long long m = r.m, dh = r.dh, H = r.H, D = r.D, MW = r.MW, P = r.P;
        const Activation act = r.cfg.activation;
        const bool residual = r.cfg.residual;
        for (std::size_t l = 0; l < r.lin.size(); ++l) {
            r.dW.push_back(zeros(static_cast<std::size_t>(P * r.lio[l])));
            const long long in = r.lin[l], out = r.lout[l];
            T* z = r.zr[l].data();
            mm(r.cx, false, false, m, out, in, T(1), r.hin[l].data(), in, MW, r.Wp[l], out,
               r.lio[l], T(0), z, out, MW, P);
            T* hn = r.hin[l + 1].data();
            cuda::each(r.sm, P * m * out, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * out), rc = i % cuda::u32(m * out);
                hn[p * MW + rc] = cuda::kernel_activate(act, z[p * MW + rc]);
            });
        }
        r.yhb = Buf(static_cast<std::size_t>(r.M * D));
        const T* z = r.zr.back().data();
        const T* h0 = r.hin[0].data();
        T* yh = r.yhb.data();
        cuda::each(r.sm, P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), t = (i / cuda::u32(dh)) % cuda::u32(m),
                            j = i % cuda::u32(dh), e = p * MW + t * dh + j;
            yh[((p / H) * m + t) * D + (p % H) * dh + j] = z[e] + (residual ? h0[e] : T(0));
        });
    }

    /// Layer l reversed: tmp = dz_l (dyh for the last), dW_l = h_l^T tmp, dH = tmp W_l^T, then
    /// tmp = act'(z_{l-1}) . dH below it.
    static void layer_backward(ReadBackward& r, std::size_t l) {
        const long long in = r.lin[l], out = r.lout[l], m = r.m, MW = r.MW, P = r.P;
        const Activation act = r.cfg.activation;
        const T* dz = l + 1 == r.lin.size() ? r.DYb.data() : r.tmpb.data();
        mm(r.cx, true, false, in, out, m, T(1), r.hin[l].data(), in, MW, dz, out, MW, T(0),
           r.dW[l].data(), out, r.lio[l], P);
        mm(r.cx, false, true, m, in, out, T(1), dz, out, MW, r.Wp[l], out, r.lio[l], T(0),
           r.dHb.data(), in, MW, P);
        if (l > 0) {
            const T* zp = r.zr[l - 1].data();
            const T* dH = r.dHb.data();
            T* tm = r.tmpb.data();
            cuda::each(r.sm, P * m * in, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * in), rc = i % cuda::u32(m * in);
                tm[p * MW + rc] = cuda::kernel_activate_grad(act, zp[p * MW + rc]) * dH[p * MW + rc];
            });
        }
    }

    /// dq = dH (+ dyh) row-major, the norm and phi reversed, dx = dc W_Q^T, g_Q = x^T dc,
    /// g_O = y^T dy.
    static void inputs_backward(ReadBackward& r) {
        const long long m = r.m, dh = r.dh, H = r.H, D = r.D, MW = r.MW;
        const bool residual = r.cfg.residual;
        r.dqb = Buf(static_cast<std::size_t>(r.M * D));
        const T* dH = r.dHb.data();
        const T* DY = r.DYb.data();
        T* dq = r.dqb.data();
        cuda::each(r.sm, r.P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), t = (i / cuda::u32(dh)) % cuda::u32(m),
                            j = i % cuda::u32(dh), e = p * MW + t * dh + j;
            dq[((p / H) * m + t) * D + (p % H) * dh + j] = dH[e] + (residual ? DY[e] : T(0));
        });
        Sweep::norm_phi_backward(r.sm, dq, r.qb.data(), r.nb.data(), r.cb.data(), 1, r.M, 0, r.M,
                                 D, r.H, dh, r.cfg.normalize_qk,
                                 r.cfg.qkv_activation == Activation::SiLU);
        r.dxb = Buf(static_cast<std::size_t>(r.M * r.d));
        mm(r.cx, false, true, r.M, r.d, D, T(1), dq, D, 0, r.prm.w_qkv(), r.prm.ld_in, 0,
           T(0), r.dxb.data(), r.d, 0, 1);
        r.gq = Buf(static_cast<std::size_t>(r.d * D));
        r.go = Buf(static_cast<std::size_t>(D * r.d));
        mm(r.cx, true, false, r.d, D, r.M, T(1), r.xb.data(), r.d, 0, dq, D, 0, T(0), r.gq.data(),
           D, 0, 1);
        mm(r.cx, true, false, D, r.d, r.M, T(1), r.yhb.data(), D, 0, r.dyb.data(), r.d, 0, T(0),
           r.go.data(), r.d, 0, 1);
    }
};

}  // namespace titans::backend
