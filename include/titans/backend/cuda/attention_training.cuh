#pragma once
// titans/backend/cuda/attention_training.cuh: the attention layer's training pass on CUDA
// (math §9), float and double: AttentionTraining<Cuda, T>.
//
// forward: the inference forward (attention_kernels.cuh) from any state, keeping in device
// memory the input, the prefix rows, the incoming position and each sequence's kept keys and
// values. backward, on the device:
//   1. qkv = x [W_Q | W_K | W_V] (one GEMM), RoPE, the prefix's P W_K, P W_V, and each
//      sequence's [kept ; new] keys and values; o recomputed (as the forward:
//      Kernels::attend_rows), g_O += o^T dy,
//      dout = dy W_O^T (GEMMs);
//   2. the attention backward, three deterministic passes, no atomics: in tiles where the
//      forward's are (attention_tiled_backward.cuh: a block per query tile writes dq and the
//      softmax statistics, a block per key tile of the window and of the prefix sums dk, dv
//      over the query tiles that see it), else the functors of
//      attention/attention_row_backward.hpp (a thread per query row, window row, prefix row);
//   3. the adjoint of the window the call left added, the kept rows' adjoint downloaded, the
//      transposed RoPE, then g_QKV += x^T [dq | dk | dv], dx = [dq | dk | dv] [W_Q|W_K|W_V]^T,
//      g_KV += P^T [dk_P | dv_P], dprefix = [dk_P | dv_P] [W_K | W_V]^T (GEMMs).
// The gradients are downloaded and added to the host's only after every device step
// succeeded: a call that throws changes none of its outputs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "../../attention/attention_row.hpp"
#include "../../attention/attention_row_backward.hpp"
#include "../../attention/state_gradient.hpp"
#include "../../detail/trace.hpp"
#include "attention_kernels.cuh"
#include "attention_tiled_backward.cuh"
#include "attention_warp_tiles_backward.cuh"
#include "../../attention/kernels_decl.hpp"

namespace titans::backend {

struct Cuda;

template <class T>
struct AttentionTraining<Cuda, T> {
    static constexpr bool available = true;
    using Kernels = AttentionKernels<Cuda, T>;
    using Buf = cuda::DeviceBuffer<T>;
    using Mat = Matrix<T>;
    using Index = Eigen::Index;

    using DeviceMatrix = cuda::DeviceMatrix<T>;

    /// What backward needs, in device memory: the input, the prefix rows (0 rows if none) and
    /// their sharing, the incoming position and each sequence's kept keys (rotated) and values
    /// (kept_k / kept_v: batch x kept x D, sequence b's rows at b * kept * D).
    struct Trace {
        AttentionConfig cfg;
        DeviceMatrix x, prefix;
        PrefixSharing sharing = PrefixSharing::Shared;
        int batch = 0;
        std::int64_t start = 0;
        long long kept = 0;
        Buf kept_k, kept_v;
        detail::TraceFilled filled;  // a moved-from trace is empty
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Index rows() const { return x.rows(); }
    };

    /// The sizes forward leaves in a trace for cfg, past the checks of batch, rows and start
    /// (Attention::validate_trace), as the CPU's check_trace: the input's and prefix's elements,
    /// the prefix as detail::check_trace_prefix has it, kept = min(window - 1, start) rows
    /// and batch * kept x D kept keys and values. ShapeError naming the part otherwise.
    static void check_trace(const AttentionConfig& cfg, const Trace& tr, const char* where) {
        using detail::check_trace_part;
        const long long h = std::min<long long>(cfg.window - 1, tr.start), D = cfg.inner_dim();
        const auto size = [&](const Buf& buf, long long expected, const char* part) {
            check_trace_part(static_cast<long long>(buf.size()) == expected, where, part,
                             buf.size(), detail::concat(expected, " elements"));
        };
        size(tr.x.mem, tr.x.rows() * tr.x.cols(), "x.mem.size()");
        detail::check_trace_prefix(cfg.d_model, tr.prefix.rows(), tr.prefix.cols(), tr.sharing,
                                   tr.batch, where);
        size(tr.prefix.mem, tr.prefix.rows() * tr.prefix.cols(), "prefix.mem.size()");
        check_trace_part(tr.kept == h, where, "kept", tr.kept, "min(window - 1, trace.start)");
        size(tr.kept_k, tr.batch * h * D, "kept_k.size()");
        size(tr.kept_v, tr.batch * h * D, "kept_v.size()");
    }

    /// Kernels::forward from any state, recording the trace. x: device rows; prefix: checked
    /// device rows (0 rows: none), copied on the device.
    static void forward(const AttentionConfig& cfg, const typename Kernels::Prepared& p,
                        typename Kernels::State& st, View<const T> x, View<T> y,
                        View<const T> prefix, PrefixSharing sharing, Trace& trace) {
        Trace t;
        t.cfg = cfg;
        t.batch = st.batch();
        t.sharing = sharing;
        t.start = st.position();
        const long long D = cfg.inner_dim();
        t.x = DeviceMatrix::copy_of(x, "cudaMemcpy2D (attention trace input)");
        if (prefix.rows > 0) {
            t.prefix = DeviceMatrix::copy_of(prefix, "cudaMemcpy2D (attention trace prefix)");
        } else {
            t.prefix.c = cfg.d_model;
        }
        const long long h = st.rows_;
        t.kept = h;
        t.kept_k = Buf(static_cast<std::size_t>(t.batch * h * D));
        t.kept_v = Buf(static_cast<std::size_t>(t.batch * h * D));
        if (h > 0) {
            const cudaStream_t sm = Kernels::ctx(st).stream();
            Kernels::move_rows(sm, t.kept_k.data(), st.k_.data() + st.off_ * D, t.batch, h * D,
                               h * D, st.cap_ * D);
            Kernels::move_rows(sm, t.kept_v.data(), st.v_.data() + st.off_ * D, t.batch, h * D,
                               h * D, st.cap_ * D);
            cuda::idle(Kernels::ctx(st));  // before the forward may move the window
        }
        if (t.prefix.rows() > 0) {
            const auto projected = Kernels::project_prefix(cfg, p, t.prefix.view(), sharing);
            const PrefixView<T> view = projected.view();
            Kernels::forward(cfg, p, st, x, y, &view);
        } else {
            Kernels::forward(cfg, p, st, x, y, nullptr);
        }
        t.filled = true;
        trace = std::move(t);
    }

    /// dL/dx (written, device), the parameters' gradients added to `grads` (device, 1 x the
    /// parameters' count: W_Q, W_K, W_V, W_O row-major one after the other) and, if dprefix is
    /// not empty, dL/dprefix added to it (device, the prefix's shape) from dy = dL/dy
    /// (device); nothing crosses to the host but d_in. d_out (checked, or null): the adjoint
    /// of the window the call left; d_in (or null) receives the incoming window's.
    static void backward(const AttentionConfig& cfg, const typename Kernels::Prepared& prepared,
                         const Trace& tr, View<const T> dyv, View<T> dxv, View<T> grads,
                         View<T> dprefix, const AttentionStateGradient<T>* d_out = nullptr,
                         AttentionStateGradient<T>* d_in = nullptr) {
        Pass ps = recompute(cfg, prepared, tr);                    // 1.
        output_backward(cfg, prepared, ps, dyv);
        attend_backward(cfg, ps);                                  // 2.
        window_backward(cfg, tr, ps, d_out);                       // 3.
        projections_backward(cfg, prepared, tr, ps, dxv);
        add_gradients(ps, grads, dprefix);                         // 4.
        state_adjoint(ps, d_in);
    }

    // The backward's stages (public: nvcc's device lambdas cannot sit in private members).
    /// What the stages share: the sizes, the forward recomputed (qkv after RoPE, the prefix's
    /// keys and values, each sequence's window of cap = kept + N rows, the heads' outputs o),
    /// the adjoints and the gradients on the device.
    struct Pass {
        int B = 0, H = 0, dh = 0;
        long long D = 0, d = 0, rows = 0, N = 0, h = 0, cap = 0, prows = 0, np = 0;
        bool shared = false;
        T scale = T(0);
        Buf qkv, kw, vw, o;
        typename Kernels::Prefix proj;
        const T* kp = nullptr;  // the prefix's keys and values (qkv when none: never read)
        const T* vp = nullptr;
        Buf dout, dqkv, dkw, dvw, dkvp, gqkv, go, dp;
        Buf stats;                 // each (row, head)'s maximum, 1 / sum and delta
        bool stats_ready = false;  // the recomputed forward left the first two (warp tiles)
    };

    /// Stage 1: qkv = x [W_Q | W_K | W_V], RoPE, the prefix projected, the windows assembled
    /// (kept rows, then the call's), o recomputed.
    static Pass recompute(const AttentionConfig& cfg, const typename Kernels::Prepared& prepared,
                          const Trace& tr) {
        const typename Kernels::Params& p = *prepared;
        const cuda::StreamContext& cx = cuda::thread_context();
        const cudaStream_t sm = cx.stream();
        Pass ps;
        ps.B = tr.batch;
        ps.H = cfg.n_heads;
        ps.dh = cfg.head_dim();
        ps.D = cfg.inner_dim();
        ps.d = cfg.d_model;
        ps.rows = tr.x.rows();
        ps.N = ps.rows / ps.B;
        ps.h = tr.kept;
        ps.cap = ps.h + ps.N;
        const long long D = ps.D, rows = ps.rows;
        ps.qkv = Buf(static_cast<std::size_t>(rows * 3 * D));
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(rows), 3 * static_cast<int>(D),
                      static_cast<int>(ps.d), T(1), {tr.x.mem.data(), static_cast<int>(ps.d)},
                      {p.w_qkv.data(), 3 * static_cast<int>(D)}, T(0), ps.qkv.data(),
                      3 * static_cast<int>(D), 0, 1);
        ps.prows = tr.prefix.rows();
        ps.shared = tr.sharing == PrefixSharing::Shared;
        ps.np = ps.prows == 0 ? 0 : ps.shared ? ps.prows : ps.prows / ps.B;
        if (ps.prows > 0) {
            ps.proj = Kernels::project_prefix(cfg, prepared, tr.prefix.view(), tr.sharing);
        }
        ps.kw = Buf(static_cast<std::size_t>(ps.B * ps.cap * D));
        ps.vw = Buf(ps.kw.size());
        if (ps.h > 0) {
            Kernels::move_rows(sm, ps.kw.data(), tr.kept_k.data(), ps.B, ps.h * D, ps.cap * D,
                               ps.h * D);
            Kernels::move_rows(sm, ps.vw.data(), tr.kept_v.data(), ps.B, ps.h * D, ps.cap * D,
                               ps.h * D);
        }
        cuda::rope_then(cfg, sm, ps.qkv.data(), rows, ps.N, tr.start,
                        detail::AppendWindow<T>{ps.qkv.data(), ps.kw.data(), ps.vw.data(), ps.N,
                                                D, ps.cap, ps.h});
        ps.scale = T(1) / std::sqrt(static_cast<T>(ps.dh));
        ps.kp = ps.prows > 0 ? ps.proj.k.data() : ps.qkv.data();
        ps.vp = ps.prows > 0 ? ps.proj.v.data() : ps.qkv.data();
        ps.o = Buf(static_cast<std::size_t>(rows * D));
        ps.stats = Buf(static_cast<std::size_t>(3 * rows * ps.H));
        if (rows > 0) {
            ps.stats_ready = Kernels::attend_rows(
                sm, detail::AttendRows<T>{ps.qkv.data(), ps.kp, ps.vp, ps.np, D, D, ps.shared,
                                          ps.kw.data(), ps.vw.data(), ps.cap, ps.h, ps.N, D,
                                          ps.H, ps.dh, cfg.window, ps.scale, ps.o.data()},
                ps.B, cx.tf32(), ps.stats.data(), ps.stats.data() + rows * ps.H);
        }
        return ps;
    }

    /// The output projection reversed: g_O = o^T dy, dout = dy W_O^T.
    static void output_backward(const AttentionConfig&, const typename Kernels::Prepared& prepared,
                                Pass& ps, View<const T> dyv) {
        const cuda::StreamContext& cx = cuda::thread_context();
        const int iD = static_cast<int>(ps.D), id = static_cast<int>(ps.d);
        const int irows = static_cast<int>(ps.rows);
        ps.dout = Buf(static_cast<std::size_t>(ps.rows * ps.D));
        ps.go = Buf(static_cast<std::size_t>(ps.D * ps.d));
        if (ps.rows > 0) {
            cuda::gemm<T>(cx.blas(), true, false, iD, id, irows, T(1), {ps.o.data(), iD},
                          {dyv.data, static_cast<int>(dyv.stride)}, T(0), ps.go.data(), id, 0, 1);
            cuda::gemm<T>(cx.blas(), false, true, irows, iD, id, T(1),
                          {dyv.data, static_cast<int>(dyv.stride)}, {prepared->w_o.data(), id},
                          T(0), ps.dout.data(), iD, 0, 1);
        }
    }

    /// Stage 2: the attention backward, three deterministic passes: dq (with the softmax
    /// statistics), the window rows' dk, dv, the prefix rows'.
    static void attend_backward(const AttentionConfig& cfg, Pass& ps) {
        const cudaStream_t sm = cuda::thread_context().stream();
        const long long rows = ps.rows, D = ps.D, H = ps.H;
        T* stats = ps.stats.data();
        ps.dqkv = Buf(static_cast<std::size_t>(rows * 3 * D));
        const detail::AttentionBackwardOperands<T> ops{
            ps.qkv.data(), ps.kp, ps.vp, ps.np, D, D, ps.shared, ps.kw.data(), ps.vw.data(),
            ps.cap, ps.h, ps.N, D, ps.H, ps.dh, cfg.window, ps.scale, ps.dout.data(),
            stats, stats + rows * H, stats + 2 * rows * H};
        ps.dkw = Buf(static_cast<std::size_t>(ps.B * ps.cap * D));
        ps.dvw = Buf(ps.dkw.size());
        ps.dkvp = Buf(static_cast<std::size_t>(ps.prows * 2 * D));
        if (tiled_backward(cfg, ps, ops)) {
            return;
        }
        cuda::each(sm, rows * H, detail::QueryRowsBackward<T>{ops, ps.dqkv.data(), 3 * D});
        cuda::each(sm, ps.B * ps.cap * H, detail::KeyRowsBackward<T>{ops, ps.dkw.data(),
                                                                      ps.dvw.data()});
        cuda::each(sm, ps.prows * H,
                   detail::PrefixRowsBackward<T>{ops, ps.B, ps.dkvp.data(), 2 * D});
    }

    /// Stage 2 in tiles (cuda::tiled_backward_passes: warp tiles, or the scalar tiles of
    /// attention_tiled_backward.cuh; a query pass writing dq and the statistics, then the
    /// window's and the prefix's key passes) when tiles are on and fit, as the forward's; false
    /// (nothing done) otherwise. ops: the per-row operands (their statistics arrays reused).
    static bool tiled_backward(const AttentionConfig& cfg, Pass& ps,
                               const detail::AttentionBackwardOperands<T>& ops) {
        const cuda::StreamContext& cx = cuda::thread_context();
        const long long D = ps.D;
        const cuda::TiledBackwardArgs<T> a{
            {ps.qkv.data(), 3 * D, ps.kp, ps.vp, ps.np, D, D, ps.shared, ps.kw.data(),
             ps.vw.data(), ps.cap, D, ps.N, ps.h, 1, ps.H, ps.dh, cfg.window, ps.scale, nullptr,
             0},
            ps.dout.data(), D, ps.o.data(), D, ops.mx, ops.inv, ops.delta, ps.stats_ready};
        return cuda::tiled_backward_passes(
            cx.stream(), a, ps.B, ps.dqkv.data(), 3 * D,
            cuda::TiledKeyGrads<T>{ps.dkw.data(), ps.dvw.data(), D},
            cuda::TiledKeyGrads<T>{ps.dkvp.data(), ps.dkvp.data() + D, 2 * D}, cx.tf32());
    }

    /// Stage 3a: the adjoint of the window the call left added, the call's rows' window
    /// adjoints gathered into dqkv, the transposed RoPE.
    static void window_backward(const AttentionConfig& cfg, const Trace& tr, Pass& ps,
                                const AttentionStateGradient<T>* d_out) {
        const cudaStream_t sm = cuda::thread_context().stream();
        const long long D = ps.D, B = ps.B;
        const long long keep = d_out != nullptr ? d_out->keys[0].rows() : 0;
        Buf dwin;
        if (keep > 0) {
            dwin = Buf(static_cast<std::size_t>(2 * B * keep * D));
            for (int b = 0; b < ps.B; ++b) {
                const auto i = static_cast<std::size_t>(b);
                upload(dwin.data() + b * keep * D, d_out->keys[i]);
                upload(dwin.data() + (B + b) * keep * D, d_out->values[i]);
            }
            add_window(sm, ps.dkw.data(), ps.dvw.data(), dwin.data(), B, keep, ps.cap, D);
        }
        cuda::each(sm, ps.rows * D, detail::GatherWindowGrad<T>{ps.dkw.data(), ps.dvw.data(),
                                                                 ps.dqkv.data(), ps.N, D, ps.cap,
                                                                 ps.h});
        if (cfg.rope) {
            cuda::each(sm, ps.rows * 2 * ps.H * (ps.dh / 2),
                       detail::RopeQKTranspose<T>{ps.dqkv.data(), ps.N, D, ps.H, ps.dh,
                                                  tr.start, cfg.rope_base});
        }
    }

    /// Stage 3b: g_QKV = x^T [dq | dk | dv], dx = [dq | dk | dv] [W_Q|W_K|W_V]^T, and the
    /// prefix's g_KV += P^T [dk_P | dv_P], dprefix = [dk_P | dv_P] [W_K | W_V]^T.
    static void projections_backward(const AttentionConfig&,
                                     const typename Kernels::Prepared& prepared, const Trace& tr,
                                     Pass& ps, View<T> dxv) {
        const typename Kernels::Params& p = *prepared;
        const cuda::StreamContext& cx = cuda::thread_context();
        const int iD = static_cast<int>(ps.D), id = static_cast<int>(ps.d);
        const int irows = static_cast<int>(ps.rows);
        ps.gqkv = Buf(static_cast<std::size_t>(ps.d * 3 * ps.D));
        if (ps.rows > 0) {
            cuda::gemm<T>(cx.blas(), true, false, id, 3 * iD, irows, T(1), {tr.x.mem.data(), id},
                          {ps.dqkv.data(), 3 * iD}, T(0), ps.gqkv.data(), 3 * iD, 0, 1);
            cuda::gemm<T>(cx.blas(), false, true, irows, id, 3 * iD, T(1),
                          {ps.dqkv.data(), 3 * iD}, {p.w_qkv.data(), 3 * iD}, T(0), dxv.data,
                          static_cast<int>(dxv.stride), 0, 1);
        }
        ps.dp = Buf(static_cast<std::size_t>(ps.prows * ps.d));
        if (ps.prows > 0) {
            const int ip = static_cast<int>(ps.prows);
            // rows == 0: gqkv's k and v columns are set here (beta 0), else added to
            cuda::gemm<T>(cx.blas(), true, false, id, 2 * iD, ip, T(1),
                          {tr.prefix.mem.data(), id}, {ps.dkvp.data(), 2 * iD},
                          ps.rows > 0 ? T(1) : T(0), ps.gqkv.data() + ps.D, 3 * iD, 0, 1);
            cuda::gemm<T>(cx.blas(), false, true, ip, id, 2 * iD, T(1), {ps.dkvp.data(), 2 * iD},
                          {p.w_qkv.data() + ps.D, 3 * iD}, T(0), ps.dp.data(), id, 0, 1);
        }
    }

    /// Stage 4: the gradients added to the flat buffer's slices (gqkv's column blocks to W_Q,
    /// W_K, W_V where the call had queries / keys, go to W_O) and dL/dprefix to dprefix, on
    /// the device.
    static void add_gradients(const Pass& ps, View<T> grads, View<T> dprefix) {
        const cudaStream_t sm = cuda::thread_context().stream();
        const long long D = ps.D, d = ps.d;
        if (ps.rows > 0 || ps.prows > 0) {  // no queries: gqkv's q columns are unset
            cuda::add_column_blocks(sm, ps.gqkv.data(), d, 3, D, ps.rows > 0 ? 0 : 1, grads.data);
        }
        if (ps.rows > 0) {
            cuda::add_entries(sm, ps.go.data(), D * d, grads.data + 3 * d * D);
        }
        if (!dprefix.empty() && ps.prows > 0) {
            const T* const dp = ps.dp.data();
            T* const to = dprefix.data;
            const long long stride = dprefix.stride;
            cuda::each(sm, ps.prows * d, [=] __device__(unsigned i) {
                to[i / cuda::u32(d) * stride + i % cuda::u32(d)] += dp[i];
            });
        }
    }

    /// The incoming window's adjoint downloaded into *d_in (host, per sequence), if asked.
    static void state_adjoint(const Pass& ps, AttentionStateGradient<T>* d_in) {
        const long long D = ps.D;
        AttentionStateGradient<T> din;
        if (d_in != nullptr) {
            din.keys.assign(static_cast<std::size_t>(ps.B), Mat());
            din.values.assign(static_cast<std::size_t>(ps.B), Mat());
            for (int b = 0; b < ps.B; ++b) {
                const auto i = static_cast<std::size_t>(b);
                din.keys[i] = download(ps.dkw.data() + b * ps.cap * D, ps.h, D);
                din.values[i] = download(ps.dvw.data() + b * ps.cap * D, ps.h, D);
            }
        }
        cuda::thread_context().synchronize();
        if (d_in != nullptr) {
            *d_in = std::move(din);
        }
    }

    /// A dense host matrix's entries to device memory at `to` (synchronous).
    static void upload(T* to, const Mat& m) {
        cuda::copy_now(to, m.data(), static_cast<std::size_t>(m.size()) * sizeof(T),
                       cudaMemcpyHostToDevice, "cudaMemcpy (attention state adjoint to device)");
    }
    /// rows x cols dense device entries at `from` as a host matrix (synchronous).
    static Mat download(const T* from, long long rows, long long cols) {
        Mat m = Mat::Zero(rows, cols);  // (GCC's -Wmaybe-uninitialized: the emulator reads it)
        cuda::copy_now(m.data(), from, static_cast<std::size_t>(m.size()) * sizeof(T),
                       cudaMemcpyDeviceToHost, "cudaMemcpy (attention gradient to host)");
        return m;
    }
    /// The adjoint of the window the call left (per sequence, the last `keep` of its cap
    /// rows): keys at src (B x keep x D), values after them, added to dk_win / dv_win.
    static void add_window(cudaStream_t sm, T* dk, T* dv, const T* src, long long B,
                           long long keep, long long cap, long long D) {
        const long long n = keep * D;
        cuda::each(sm, B * n, [=] __device__(unsigned i) {
            const long long b = i / cuda::u32(n), j = i % cuda::u32(n);
            const long long at = (b * cap + cap - keep) * D + j;
            dk[at] += src[b * n + j];
            dv[at] += src[(B + b) * n + j];
        });
    }
};

}  // namespace titans::backend
