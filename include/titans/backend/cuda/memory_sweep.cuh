#pragma once
// titans/backend/cuda/memory_sweep.cuh: MemoryTraining<Cuda, T>::Sweep, the memory's backward
// on the device (math §9), every (sequence, head) pair at once, in the CPU's stages:
//   1. the projections recomputed from the kept products (conv, phi, norm), pair-major q, k,
//      v, dy W_O^T and gate logits;
//   2. the reverse sweep, chunks last first: the key tape recomputed from the chunk's start
//      memory, the gates with clipping, the read recomputed and reversed (lagged or dual
//      form), the chunk end reversed, the coefficient recurrences, clipping, the key pass
//      with its second-order terms, the gates; the start memory's adjoint carried down;
//   3. the projections reversed (norm, phi, conv), dx, the parameter gradients (checked
//      finite and added to the caller's flat gradient on the device; the staged Reverse's
//      downloaded and added to host tensors) and the incoming state's adjoint (downloaded).
// Included at the end of memory_training.cuh. Each stage is a static function of the Sweep
// (device lambdas copy what they read into locals: a lambda that named the Sweep would copy
// it, which does not compile, so no host pointer reaches the device).

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "fast_math.cuh"
#include "memory_fused_backward.cuh"
#include "memory_training.cuh"

namespace titans::backend::cuda {

/// Row r of a pair's key tape (its rows at offset `pair`), layer by layer: the GradRows<T> of
/// a_{l-1} and delta_l that the gates' norms read.
template <class T>
__device__ auto tape_row(const PendingLayers<T>& ly, long long pair, long long r) {
    return [&ly, pair, r](int l) {
        return detail::GradRows<T>{ly.a[l] + pair + r * ly.in[l], ly.in[l],
                                   ly.d[l] + pair + r * ly.out[l], ly.out[l]};
    };
}

/// The backward's gates of a chunk's n rows (math §1, §10), a warp per (pair, row)
/// (backward_gate_row): theta0 (before the clip), theta, eta, alpha and g2 (0 without
/// clipping) into the pair's vector (offsets vo, pairs VS apart). lg: the chunk's logits,
/// pairs N rows apart.
template <class T, class Vec>
__global__ void sweep_gates_kernel(GateParams<T> gp, PendingLayers<T> ly, const T* lg, long long N,
                                   T* vec, Vec vo, long long VS, long long BW, long long P, int n) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= P * n) {
        return;
    }
    const long long p = w / n, r = w % n;
    const BackwardGates<T> g = backward_gate_row<T>(gp, ly.depth, lg + p * N * 3,
                                                    static_cast<int>(r), n,
                                                    tape_row(ly, p * BW, r), lane);
    if (lane == 0) {
        T* v = vec + p * VS;
        v[vo.theta0() + r] = g.theta0;
        v[vo.theta() + r] = g.theta;
        v[vo.eta() + r] = g.eta;
        v[vo.alpha() + r] = g.alpha;
        v[vo.g2() + r] = g.g2;
    }
}

/// theta = theta0 min(1, clip / sqrt(g2)) reversed for a chunk's n rows, a warp per (pair,
/// row) (clip_row_backward; only rows whose g2 passed clip^2 work): dtheta becomes theta0's
/// adjoint, g2's goes into the tape's adjoints adj.a[l], adj.d[l].
template <class T, class Vec, class Adj>
__global__ void sweep_clip_backward_kernel(T clip, PendingLayers<T> ly, Adj adj, T* vec, Vec vo,
                                           long long VS, long long BW, long long P, int n) {
    const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x % 32);
    if (w >= P * n) {
        return;
    }
    const long long p = w / n, r = w % n;
    T* v = vec + p * VS;
    const T g2 = v[vo.g2() + r];
    if (!(g2 > clip * clip)) {
        return;
    }
    const auto row = tape_row(ly, p * BW, r);
    const T f = clip_row_backward<T>(
        clip, ly.depth, row,
        [&](int l) {
            return AdjointRows<T>{adj.a[l] + p * BW + r * ly.in[l],
                                  adj.d[l] + p * BW + r * ly.out[l]};
        },
        v[vo.dtheta() + r], v[vo.theta0() + r], g2, lane);
    __syncwarp();  // every lane has read dtheta
    if (lane == 0) {
        v[vo.dtheta() + r] *= f;
    }
}

}  // namespace titans::backend::cuda

namespace titans::backend {

template <class T>
struct MemoryTraining<Cuda, T>::Sweep {

    const MemoryConfig& cfg;
    const typename Kernels::Params& prm;
    const Trace& tr;
    const cuda::StreamContext& cx;
    cudaStream_t sm;
    int B, L;
    long long M, N, d, D, H, dh, P, C3, G3, b, K, K1;
    bool gated, silu, norm, conv, residual, inchunk, clipping, given = false;
    Activation act;
    GateMode gmode;
    T tmax, se, sa, ct, ce, ca, clip;  // as cuda::GateParams
    // 1. the projections: c (conv), pre = phi(c), qkv (norm), the heads' norms; pair-major
    // ([p][N][dh]) q, k, v, dyh, the read y and their adjoints; logits ([p][N][3]).
    Buf cb, preb, qkvb, nb, dyhb, Qb, Kb, Vb, DYb, Yb, dQb, dKb, dVb, LGb, dLGb;
    // 2. per layer l (in_l x out_l, P of them): the adjoints at the chunk's start and end, the
    // key tape, the read's intermediates; workspaces of b x wd rows per pair.
    std::vector<long long> lin, lout, lio;
    long long wd = 0, BW = 0;
    std::size_t Ls = 0;
    std::vector<Buf> dW, dS, dWn, dSn, ta, tz, td1, tdelta, tback, tabar, tdbar, tzbar;
    std::vector<Buf> hin, zr, p1, p2, sc;
    Buf tmpb, dHb, scaledb, AWb, ASb, bbarb, dMb, vecb;
    Vec vo{1};
    long long VS = 0;
    std::vector<const T*> Wl, Sl;  // the chunk's start memory in the trace
    // The stages: rows >= cur are reversed; a tap's adjoint waiting for the stage below it
    // (tapW, per layer); whether the last chunk's end has an adjoint (d_out or a tap there).
    // Rows of the pair-major buffers and cur are counted from the chunk start before the
    // trace's row 0: off (= its start mod b) leading rows are the incoming pending ones (zero
    // q, k, v, dy; their logits the state's), NV = off + N per pair.
    long long cur = 0, off = 0, NV = 0;
    bool has_tap = false, final_end = false;
    // A trace ending mid-chunk with d_out (end_mid): its memory adjoint is the last chunk's
    // start memory's (dW_end, dS_end), its pending rows' (P x rows x width) are added to that
    // chunk's tape adjoints and logits in its top stage (add_out). A trace starting mid-chunk:
    // the incoming pending rows' adjoints gather in da_in, dd_in (P x off x width; the
    // logits' stay in dLGb's leading rows).
    bool end_mid = false, add_out = false;
    // A stage from a chunk's top, lagged, with no adjoint out: its start memory's adjoints are
    // written, not added to, by their first writers (the read's dW products, beta 0; the chunk
    // end's dS), so they are not cleared first (down).
    bool fresh = false;
    bool tape_fresh = false;  // the same for a stage's tape adjoints abar, dbar (stage)
    // Full chunks reversed by the fused kernel (memory_fused_backward.cuh; fused_plan), its
    // operands, how many of its b x hidden arrays stay on chip (the rest in fscratch).
    bool fuse = false;
    int fchip = 6;
    cuda::Operands fops = cuda::Operands::Exact;
    Buf fscratch;
    std::vector<Buf> dW_end, dS_end, pa_out, pd_out, da_in, dd_in;
    Buf pg_out;
    std::vector<Buf> tapW;
    View<const T> dy{};  // dL/dy, (B*N) x d on the device
    // 3. the projections reversed and the gradients; dxb: a range's dx, compact.
    Buf dqb, dub, dlgb, yhb, gq, gg, go, gt, gb, dtb, rowsb, dxb;
    std::vector<Mat> dtail_out;

    Sweep(const MemoryConfig& c, const typename Kernels::Prepared& pp, const Trace& t)
        : cfg(c), prm(*pp), tr(t), cx(cuda::thread_context()), sm(cx.stream()), B(t.batch),
          L(c.depth), M(t.rows()), N(M / B), d(c.d_model), D(c.inner_dim()), H(c.n_heads),
          dh(c.head_dim()), P(B * H), C3(3 * D), G3(3 * H), b(c.effective_chunk()),
          K(c.conv_kernel), K1(c.use_conv ? K - 1 : 0), gated(c.gates != GateMode::Constant),
          silu(c.qkv_activation == Activation::SiLU), norm(c.normalize_qk), conv(c.use_conv),
          residual(c.residual), inchunk(c.retrieval == Retrieval::InChunk),
          clipping(c.max_grad_norm > 0), act(c.activation), gmode(c.gates),
          tmax(static_cast<T>(c.gate_scale(0))), se(static_cast<T>(c.gate_scale(1))),
          sa(static_cast<T>(c.gate_scale(2))), ct(static_cast<T>(c.gate_constant(0))),
          ce(static_cast<T>(c.gate_constant(1))), ca(static_cast<T>(c.gate_constant(2))),
          clip(static_cast<T>(c.max_grad_norm)) {
        off = t.offset;
        NV = off + N;
    }

    /// The whole backward: dx (device), the gradients added to grads (device, flat) if they
    /// and d_in (host, if given) are finite (finish_flat's result).
    static bool run(Sweep& w, View<const T> dyv, View<T> dxv, View<T> grads,
                    const MemoryStateGradient<T>* d_out, MemoryStateGradient<T>* d_in) {
        init(w, dyv, d_out);
        down(w, 0);
        rows_backward(w, 0, w.N);
        input_rows(w, 0, w.N, dxv.data, dxv.stride);
        return finish_flat(w, grads, d_in);
    }

    /// Stage 1 and the sweep's buffers; dy (device) is read until finish.
    static void init(Sweep& w, View<const T> dyv, const MemoryStateGradient<T>* d_out) {
        w.dy = dyv;
        projections(w);
        pair_major(w, dyv);
        allocate(w, d_out);
        fused_plan(w);
        if (w.given) w.dtail_out = d_out->conv_tail;
        w.cur = w.NV;
        w.final_end = w.given && !w.end_mid;
        w.dqb = Buf(static_cast<std::size_t>(w.M * w.C3));
        w.dub = Buf(w.dqb.size());
        w.yhb = Buf(static_cast<std::size_t>(w.M * w.D));
        w.dlgb = zeros(static_cast<std::size_t>(w.gated ? w.M * w.G3 : 0));
    }

    /// After every row is reversed: the parameters' gradients, the incoming tails' adjoint,
    /// downloaded and added to g (and d_in). The staged Reverse's end (host gradients).
    static void finish(Sweep& w, MemoryParams<T>& g, MemoryStateGradient<T>* d_in) {
        parameter_gradients(w, w.dy);
        tails_in(w, d_in != nullptr);
        w.cx.synchronize();
        host_outputs(w, g, d_in);
    }

    /// After every row is reversed (MemoryTraining::backward): the parameters' gradients made
    /// and checked finite on the device (one flag down), d_in downloaded; if every entry is
    /// finite the gradients are added to `grads` (the memory's flat slice, device,
    /// MemoryParams::tensors order) there and true returned, else grads is unchanged.
    static bool finish_flat(Sweep& w, View<T> grads, MemoryStateGradient<T>* d_in) {
        parameter_gradients(w, w.dy);
        tails_in(w, d_in != nullptr);
        const Buf w0 = w.tr.start == 0 && w.N > 0 ? start_memory_gradient(w) : Buf{};
        bool finite = gradients_finite(w, w0);
        if (d_in != nullptr) {
            state_in(w, *d_in);
            finite = finite && d_in->finite();
        }
        if (finite) {
            add_flat(w, grads, w0);
            w.cx.synchronize();
        }
        return finite;
    }

    /// Entries of memory_init (every head's layers) in the flat gradient.
    static long long init_entries(const Sweep& w) {
        long long n = 0;
        for (const long long e : w.lio) n += e;
        return w.H * n;
    }

    /// memory_init's gradient in the flat layout ([h][l], each layer's in x out row-major):
    /// per head, the start memory's adjoint summed over the sequences in order (the CPU's).
    static Buf start_memory_gradient(Sweep& w) {
        const long long H = w.H, B = w.B, per_head = init_entries(w) / (H > 0 ? H : 1);
        Buf out(static_cast<std::size_t>(init_entries(w)));
        long long off = 0;
        for (std::size_t l = 0; l < w.Ls; ++l) {
            const long long n = w.lio[l];
            const T* dw = w.dWn[l].data();
            T* o = out.data();
            cuda::each(w.sm, H * n, [=] __device__(unsigned i) {
                const long long h = i / cuda::u32(n), j = i % cuda::u32(n);
                T acc = T(0);
                for (long long s = 0; s < B; ++s) acc += dw[(s * H + h) * n + j];
                o[h * per_head + off + j] = acc;
            });
            off += n;
        }
        return out;
    }

    /// Sets *flag (device) to 1 if one of x's n entries is not finite.
    static void scan_finite(cudaStream_t sm, const T* x, long long n, T* flag) {
        cuda::each(sm, n, [=] __device__(unsigned i) {
            if (cuda::not_finite(x[i])) flag[0] = T(1);
        });
    }

    /// Whether every gradient finish_flat adds (and memory_init's, w0) is finite.
    static bool gradients_finite(Sweep& w, const Buf& w0) {
        Buf flag = zeros(1);
        T* f = flag.data();
        scan_finite(w.sm, w.gq.data(), w.d * w.C3, f);
        if (w.N > 0) scan_finite(w.sm, w.go.data(), w.D * w.d, f);
        if (w.conv) scan_finite(w.sm, w.gt.data(), w.K * w.C3, f);
        if (w.gated) {
            scan_finite(w.sm, w.gg.data(), w.d * w.G3, f);
            scan_finite(w.sm, w.gb.data(), w.G3, f);
        }
        scan_finite(w.sm, w0.data(), static_cast<long long>(w0.size()), f);
        w.cx.synchronize();
        return download_mat(flag.data(), 1, 1)(0, 0) == T(0);
    }

    /// The gradients added to their slices of grads, in MemoryParams::tensors order: W_Q, W_K,
    /// W_V (gq's column blocks), the conv taps (gt's), the gates' weights and biases (gg's,
    /// gb's), memory_init (w0, for a trace from position 0 with rows), W_O (go, with rows).
    static void add_flat(Sweep& w, View<T> grads, const Buf& w0) {
        const long long d = w.d, D = w.D, H = w.H, K = w.K;
        T* at = grads.data;
        cuda::add_column_blocks(w.sm, w.gq.data(), d, 3, D, 0, at);
        at += 3 * d * D;
        if (w.conv) {
            cuda::add_column_blocks(w.sm, w.gt.data(), K, 3, D, 0, at);
            at += 3 * K * D;
        }
        if (w.gated) {
            cuda::add_column_blocks(w.sm, w.gg.data(), d, 3, H, 0, at);
            at += 3 * d * H;
            cuda::add_column_blocks(w.sm, w.gb.data(), 1, 3, H, 0, at);
            at += 3 * H;
        }
        cuda::add_entries(w.sm, w0.data(), static_cast<long long>(w0.size()), at);
        at += init_entries(w);
        if (w.N > 0) cuda::add_entries(w.sm, w.go.data(), D * d, at);
    }

    /// The sweep over rows [p, cur), chunk by chunk, last first, as the CPU's sweep_down: a
    /// chunk with a tap inside runs in stages split at it, each the reads of its rows and the
    /// chunk end (or the tap's partial end) of its prefix; a chunk's start memory's adjoint
    /// is carried down once its first row is done.
    /// p and cur count rows as the pair-major buffers do (from the chunk start before the
    /// trace's row 0, see off).
    static void down(Sweep& w, long long p) {
        while (w.cur > p) {
            if (const int k = fused_count(w, p); k > 0) {
                fused_chunks(w, k);
                continue;
            }
            const long long ch = (w.cur - 1) / w.b, c0 = ch * w.b, c1 = std::min(c0 + w.b, w.NV);
            w.add_out = w.cur == w.NV && w.end_mid;
            bool end = w.cur == c1 && (c1 < w.NV || w.final_end);
            if (!end && w.has_tap) {  // a tap's partial end
                for (std::size_t l = 0; l < w.Ls; ++l) {
                    copy(w, w.dWn[l], w.tapW[l]);
                    clear(w, w.dSn[l]);
                }
                end = true;
            }
            w.has_tap = false;
            w.fresh = w.cur == c1 && !w.add_out && !w.inchunk;
            if (w.cur == c1) {  // a new chunk from its top: its start memory
                load_chunk(w, ch);
                for (std::size_t l = 0; l < w.Ls; ++l) {
                    if (w.add_out) {  // the state after keeps this start memory
                        copy(w, w.dW[l], w.dW_end[l]);
                        copy(w, w.dS[l], w.dS_end[l]);
                    } else if (!w.fresh) {
                        clear(w, w.dW[l]);
                        clear(w, w.dS[l]);
                    } else if (!end) {  // no chunk end to write dS (the first chunk
                        clear(w, w.dS[l]);  // reversed, without d_out: still zero there)
                    }
                }
            }
            const long long lo = std::max(c0, p), reads = std::max(lo, c0 == 0 ? w.off : 0LL);
            stage(w, c0, w.cur - c0, reads - c0, end);
            w.add_out = false;
            w.fresh = false;
            w.cur = lo;
            if (lo == c0) {
                std::swap(w.dW, w.dWn);
                std::swap(w.dS, w.dSn);
            }
        }
    }

    /// Whether the sweep's full chunks may run in the fused backward kernel (set_fused_backward,
    /// and as the forward's fused_plan: a depth-2 memory with lagged retrieval, chunk, d_h and hidden width
    /// multiples of 32, its shared memory within the device's limit; FusedMemory::Auto where
    /// its products run on the tensor cores, TF32 allowed on the sweep's stream or bfloat16
    /// operands asked for (FusedOperands::BF16, float, as the forward's); On always).
    static void fused_plan(Sweep& w) {
        const cuda::FusedMemory mode = cuda::fused_memory();
        w.fops = !std::is_same_v<T, float>                              ? cuda::Operands::Exact
                 : cuda::fused_operands() == cuda::FusedOperands::BF16 ? cuda::Operands::BF16
                 : w.cx.tf32()                                         ? cuda::Operands::TF32
                                                                       : cuda::Operands::Exact;
        const cuda::FusedLayout lay{static_cast<int>(w.b), static_cast<int>(w.dh),
                                    static_cast<int>(w.cfg.layer_out(1))};
        if (!cuda::fused_backward_flag().load() || mode == cuda::FusedMemory::Off ||
            (mode == cuda::FusedMemory::Auto && w.fops == cuda::Operands::Exact) || w.L != 2 ||
            w.inchunk || !lay.tiles()) {
            return;
        }
        const int fits = cuda::FusedBackLayout::fitting(lay, sizeof(T), cuda::shared_memory_limit());
        const int cap = cuda::fused_backward_chip_flag().load();
        w.fchip = cap >= 0 && cap < fits ? cap : fits;
        w.fuse = fits >= 0;
    }

    /// How many full chunks from cur down (at most fused_keep_chunks) the fused kernel takes:
    /// each from its top, at or above p, after the incoming pending rows, no tap waiting.
    static int fused_count(const Sweep& w, long long p) {
        int k = 0;
        for (long long cur = w.cur; w.fuse && !w.has_tap && k < cuda::fused_keep_chunks; cur -= w.b) {
            const long long c0 = cur - w.b;
            if (cur % w.b != 0 || c0 < p || (c0 == 0 && w.off > 0)) {
                break;
            }
            ++k;
        }
        return k;
    }

    /// The k full chunks below cur reversed in one launch of the fused backward kernel (the
    /// stages' work, the start memory's adjoints carried down as down() carries them).
    static void fused_chunks(Sweep& w, int k) {
        cuda::FusedBackArgs<T> f{};
        f.q = w.Qb.data();
        f.k = w.Kb.data();
        f.v = w.Vb.data();
        f.dy = w.DYb.data();
        f.lg = w.gated ? w.LGb.data() : nullptr;
        f.y = w.Yb.data();
        f.dq = w.dQb.data();
        f.dk = w.dKb.data();
        f.dv = w.dVb.data();
        f.dlg = w.gated ? w.dLGb.data() : nullptr;
        for (std::size_t l = 0; l < 2; ++l) {
            f.dw[0][l] = w.dWn[l].data();
            f.dw[1][l] = w.dW[l].data();
            f.ds[0][l] = w.dSn[l].data();
            f.ds[1][l] = w.dS[l].data();
        }
        const long long top = w.cur / w.b - 1;
        for (int j = 0; j < k; ++j) {
            const auto at = static_cast<std::size_t>(top - j) * 2 * w.Ls;
            for (std::size_t i = 0; i < 4; ++i) {
                f.mem.at[4 * j + static_cast<int>(i)] = w.tr.memory[at + i].data();
            }
        }
        f.N = w.NV;
        f.P = w.P;
        f.top = static_cast<int>(top);
        f.chunks = k;
        f.end_top = w.cur < w.NV || w.final_end;
        f.fl = {{static_cast<int>(w.b), static_cast<int>(w.dh),
                 static_cast<int>(w.cfg.layer_out(1))}, w.fchip};
        f.gp = cuda::GateParams<T>::of(w.cfg);
        f.act = w.act;
        f.residual = w.residual;
        launch_fused(w, f);
        for (int j = 0; j < k; ++j) {
            std::swap(w.dW, w.dWn);
            std::swap(w.dS, w.dSn);
        }
        w.cur -= k * w.b;
    }

    /// The fused backward's launch: a block per pair, or with spilled arrays a block per
    /// multiprocessor at most, each with its scratch.
    static void launch_fused(Sweep& w, cuda::FusedBackArgs<T>& f) {
        long long grid = w.P;
        if (w.fchip < 6) {
            int device = 0, sms = 1;
            cuda::check(cudaGetDevice(&device), "cudaGetDevice");
            cuda::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                        "cudaDeviceGetAttribute (multiprocessors)");
            grid = std::min<long long>(grid, sms);
            const auto need = static_cast<std::size_t>(grid * f.fl.scratch());
            if (w.fscratch.size() < need) w.fscratch = Buf(need);
            f.scratch = w.fscratch.data();
        }
        void (*kernel)(cuda::FusedBackArgs<T>) = cuda::fused_backward_kernel<T, cuda::Operands::Exact>;
        if constexpr (std::is_same_v<T, float>) {
            if (w.fops == cuda::Operands::TF32) {
                kernel = cuda::fused_backward_kernel<T, cuda::Operands::TF32>;
            } else if (w.fops == cuda::Operands::BF16) {
                kernel = cuda::fused_backward_kernel<T, cuda::Operands::BF16>;
            }
        }
        const auto bytes = static_cast<std::size_t>(f.fl.shared()) * sizeof(T);
        cuda::raise_shared_limit(kernel, bytes);
        cuda::launch_shared(kernel, static_cast<unsigned>(grid), cuda::fused_threads, bytes, w.sm, f);
        cuda::check_launch("the fused memory backward");
        ++cuda::fused_backward_launches();
    }

    /// Adds dW (per pair, the weights' shapes, on the host) to the adjoint of the weights after
    /// cur tokens (uploaded, then tap_device).
    static void tap(Sweep& w, const std::vector<std::vector<Mat>>& dW) {
        std::vector<Buf> up(w.Ls);
        std::vector<const T*> from;
        for (std::size_t l = 0; l < w.Ls; ++l) {
            up[l] = Buf(w.dWn[l].size());
            for (long long p = 0; p < w.P; ++p) {
                upload_to(up[l].data() + p * w.lio[l], dW[static_cast<std::size_t>(p)][l]);
            }
            from.push_back(up[l].data());
        }
        tap_device(w, from);
        w.cx.synchronize();  // before up is freed
    }

    /// Adds dW (per layer, pairs contiguous as the state's, in device memory) to the adjoint
    /// of the weights after cur tokens: at a chunk start or the trace's end to the carried
    /// adjoint (dWn), else to the tap waiting for the stage that ends there.
    static void tap_device(Sweep& w, const std::vector<const T*>& dW) {
        if (w.cur == 0 && w.off > 0) {
            tap_before(w, dW);
            return;
        }
        const bool last = w.cur == w.NV, boundary = last || w.cur % w.b == 0;
        if (w.tapW.empty()) {
            w.tapW.resize(w.Ls);
            for (std::size_t l = 0; l < w.Ls; ++l) w.tapW[l] = zeros(w.dWn[l].size());
        }
        for (std::size_t l = 0; l < w.Ls; ++l) {
            T* to = boundary ? w.dWn[l].data() : w.tapW[l].data();
            const bool add = boundary || w.has_tap;
            const T* from = dW[l];
            cuda::each(w.sm, static_cast<long long>(w.dWn[l].size()), [=] __device__(unsigned i) {
                to[i] = add ? to[i] + from[i] : from[i];
            });
        }
        w.has_tap = w.has_tap || !boundary;
        w.final_end = w.final_end || last;
    }

    /// The trace's memory at chunk ch's start as the stages' W and S.
    static void load_chunk(Sweep& w, long long ch) {
        for (std::size_t l = 0; l < w.Ls; ++l) {
            w.Wl[l] = w.tr.memory[static_cast<std::size_t>(ch) * 2 * w.Ls + l].data();
            w.Sl[l] = w.tr.memory[static_cast<std::size_t>(ch) * 2 * w.Ls + w.Ls + l].data();
        }
    }

    /// A tap at the trace's row 0 when it starts mid-chunk (the sweep is down): the weights
    /// there are the incoming chunk's partial end f(W^s, S^s, pending rows), reversed as a
    /// stage of those rows alone into the start memory's adjoint (dWn, dSn) and theirs.
    static void tap_before(Sweep& w, const std::vector<const T*>& dW) {
        load_chunk(w, 0);
        std::swap(w.dW, w.dWn);
        std::swap(w.dS, w.dSn);
        for (std::size_t l = 0; l < w.Ls; ++l) {
            cuda::copy_async(w.dWn[l].data(), dW[l], w.dWn[l].size() * sizeof(T), w.sm,
                             "cudaMemcpyAsync (a tap)");
            clear(w, w.dSn[l]);
        }
        stage(w, 0, w.off, w.off, true);
        std::swap(w.dW, w.dWn);
        std::swap(w.dS, w.dSn);
    }

    static void copy(Sweep& w, Buf& to, const Buf& from) {
        cuda::copy_async(to.data(), from.data(), to.size() * sizeof(T), w.sm, "cudaMemcpyAsync");
    }

    /// The projections of rows [p, q) of every sequence reversed (all their later rows are):
    /// dq, dk, dv row-major, the norm, phi and the conv into du; d_out's tail adjoint where the
    /// next state's tail holds them; dlogits row-major.
    static void rows_backward(Sweep& w, long long p, long long q) {
        to_row_major(w, p, q);
        projections_backward(w, p, q);
        add_tail_out(w, p, q);
        logits_row_major(w, p, q);
    }

    // --- 1. The projections. -------------------------------------------------------------

    /// c (conv of the kept products with the incoming tails), pre = phi(c), each head's norm
    /// as n 2^e (detail::row_norm_parts: nrm[2k] = n, nrm[2k + 1] = e), qkv (normalised).
    static void projections(Sweep& w) {
        const long long M = w.M, C3 = w.C3, N = w.N, K = w.K, K1 = w.K1, H = w.H, dh = w.dh,
                        D = w.D;
        const bool conv = w.conv, silu = w.silu, norm = w.norm;
        w.cb = Buf(static_cast<std::size_t>(M * C3));
        w.preb = Buf(w.cb.size());
        w.qkvb = Buf(w.cb.size());
        w.nb = Buf(static_cast<std::size_t>(M * 4 * H));
        T* cc = w.cb.data();
        T* pre = w.preb.data();
        T* qkv = w.qkvb.data();
        T* nrm = w.nb.data();
        const T* u = w.tr.u.data();
        const T* tail = w.tr.tail_in.data();
        const T* taps = w.prm.taps.data();
        cuda::each(w.sm, M * C3, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(C3), j = i % cuda::u32(C3), s = cuda::u32(r) / cuda::u32(N),
                            t = cuda::u32(r) % cuda::u32(N);
            T v = u[i];
            if (conv) {
                v *= taps[(K - 1) * C3 + j];
                for (long long q = 0; q < K - 1; ++q) {
                    const long long tt = t - K + 1 + q;
                    v += taps[q * C3 + j] * (tt >= 0 ? u[(s * N + tt) * C3 + j]
                                                     : tail[(s * K1 + tt + K - 1) * C3 + j]);
                }
            }
            cc[i] = v;
            pre[i] = silu ? detail::silu(v) : v;
        });
        head_norms(w.sm, pre, nrm, M, C3, 2 * H, dh);
        normalize(w.sm, pre, nrm, qkv, M, C3, norm ? 2 * D : 0, 2 * H, dh);
    }

    /// Each row's first `heads` heads of dh columns (row stride ld): the norm as n 2^e
    /// (detail::row_norm_parts; e > 0 where the sum of squares overflows), nrm[2k] = n,
    /// nrm[2k + 1] = e for head k = r * heads + h.
    static void head_norms(cudaStream_t sm, const T* pre, T* nrm, long long rows, long long ld,
                           long long heads, long long dh) {
        cuda::each(sm, rows * heads, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(heads), h = i % cuda::u32(heads);
            int e = 0;
            nrm[2 * i] = detail::row_norm_parts(pre + r * ld + h * dh, dh, e);
            nrm[2 * i + 1] = static_cast<T>(e);
        });
    }

    /// out = pre with its first `normed` columns of each row divided by their head's norm
    /// (head_norms' nrm, `heads` per row; max(n, 1e-12)); rows x ld, dense.
    static void normalize(cudaStream_t sm, const T* pre, const T* nrm, T* out, long long rows,
                          long long ld, long long normed, long long heads, long long dh) {
        cuda::each(sm, rows * ld, [=] __device__(unsigned i) {
            const long long r = i / cuda::u32(ld), j = i % cuda::u32(ld);
            T v = pre[i];
            if (j < normed) {
                const long long k = r * heads + j / dh;
                const T n0 = nrm[2 * k];
                const int e = static_cast<int>(nrm[2 * k + 1]);
                v = e > 0 ? detail::scale_down(v, e) / n0 : v / (n0 > T(1e-12) ? n0 : T(1e-12));
            }
            out[i] = v;
        });
    }

    /// The norm and phi reversed in place on rows [p, p + m) of each of B sequences of N rows
    /// (row stride ld): dq's first `heads` heads through the norm (if norm; y the normalised
    /// values, nrm their norms), then every column through phi (if silu; c its input).
    static void norm_phi_backward(cudaStream_t sm, T* dq, const T* y, const T* nrm, const T* c,
                                  long long B, long long N, long long p, long long m,
                                  long long ld, long long heads, long long dh, bool norm,
                                  bool silu) {
        cuda::each(sm, B * m * heads, [=] __device__(unsigned i) {
            const long long k = i / cuda::u32(heads), h = i % cuda::u32(heads),
                            r = k / m * N + p + k % m, at = r * heads + h;
            T* dd = dq + r * ld + h * dh;
            const T* yy = y + r * ld + h * dh;
            if (norm) {
                const T n0 = nrm[2 * at];
                const int e = static_cast<int>(nrm[2 * at + 1]);
                if (e > 0 || n0 > T(1e-12)) {
                    T dot = T(0);
                    for (long long j = 0; j < dh; ++j) dot += yy[j] * dd[j];
                    for (long long j = 0; j < dh; ++j) {
                        dd[j] = detail::scale_down(dd[j] - dot * yy[j], e) / n0;
                    }
                } else {
                    for (long long j = 0; j < dh; ++j) dd[j] /= T(1e-12);
                }
            }
        });
        cuda::each(sm, B * m * ld, [=] __device__(unsigned i) {
            const long long k = i / cuda::u32(ld), at = (k / m * N + p + k % m) * ld + i % cuda::u32(ld);
            if (silu) dq[at] *= detail::silu_grad(c[at]);
        });
    }

    /// Pair-major q, k, v and dyh = dy W_O^T ([p][N][dh]), the logits ([p][N][3]); the
    /// adjoints dq, dk, dv, dlogits zeroed.
    static void pair_major(Sweep& w, View<const T> dyv) {
        const long long M = w.M, N = w.N, NV = w.NV, off = w.off, D = w.D, H = w.H, dh = w.dh,
                        C3 = w.C3, G3 = w.G3, b = w.b;
        const auto n = static_cast<std::size_t>(w.P * NV * dh);
        w.Qb = Buf(n);
        w.Kb = Buf(n);
        w.Vb = Buf(n);
        w.DYb = Buf(n);
        w.Yb = Buf(n);
        w.dQb = zeros(n);
        w.dKb = zeros(n);
        w.dVb = zeros(n);
        w.LGb = Buf(static_cast<std::size_t>(w.P * NV * 3));
        w.dLGb = zeros(w.LGb.size());
        w.dyhb = Buf(static_cast<std::size_t>(M * D));
        mm(w.cx, false, true, M, D, w.d, T(1), dyv.data, dyv.stride, 0, w.prm.w_o.data(), w.d, 0,
           T(0), w.dyhb.data(), D, 0, 1);
        const T* qkv = w.qkvb.data();
        T* Q = w.Qb.data();
        T* Kp = w.Kb.data();
        T* V = w.Vb.data();
        T* DY = w.DYb.data();
        const T* dyh = w.dyhb.data();
        cuda::each(w.sm, w.P * NV * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(NV * dh), tv = (i / cuda::u32(dh)) % cuda::u32(NV),
                            j = i % cuda::u32(dh), s = p / H, h = p % H, t = tv - off,
                            r = s * N + t;
            const bool pend = tv < off;  // an incoming pending row: no q, k, v or dy here
            Q[i] = pend ? T(0) : qkv[r * C3 + h * dh + j];
            Kp[i] = pend ? T(0) : qkv[r * C3 + D + h * dh + j];
            V[i] = pend ? T(0) : qkv[r * C3 + 2 * D + h * dh + j];
            DY[i] = pend ? T(0) : dyh[r * D + h * dh + j];
        });
        if (w.gated) {
            const T* lg = w.tr.logits.data();
            const T* pg = w.tr.pend_gates.data();
            T* LG = w.LGb.data();
            cuda::each(w.sm, w.P * NV * 3, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(NV * 3), tv = (i / 3) % cuda::u32(NV),
                                c = i % 3, s = p / H, h = p % H, t = tv - off;
                LG[i] = tv < off ? pg[(p * b + tv) * 3 + c] : lg[(s * N + t) * G3 + c * H + h];
            });
        }
    }

    // --- 2. The reverse sweep. -------------------------------------------------------------

    /// The layer sizes, the per-layer buffers, the pairs' vectors; d_out's memory adjoint
    /// uploaded as the last chunk end's.
    static void allocate(Sweep& w, const MemoryStateGradient<T>* d_out) {
        const auto Ls = static_cast<std::size_t>(w.L);
        w.Ls = Ls;
        w.lin.resize(Ls);
        w.lout.resize(Ls);
        w.lio.resize(Ls);
        w.wd = w.dh;
        for (std::size_t l = 0; l < Ls; ++l) {
            w.lin[l] = w.cfg.layer_in(static_cast<int>(l) + 1);
            w.lout[l] = w.cfg.layer_out(static_cast<int>(l) + 1);
            w.lio[l] = w.lin[l] * w.lout[l];
            w.wd = std::max({w.wd, w.lin[l], w.lout[l]});
        }
        w.BW = w.b * w.wd;
        const auto work = static_cast<std::size_t>(w.P * w.BW);
        for (std::vector<Buf>* v : {&w.dW, &w.dS, &w.dWn, &w.dSn, &w.ta, &w.tz, &w.td1,
                                    &w.tdelta, &w.tback, &w.tabar, &w.tdbar, &w.tzbar, &w.zr,
                                    &w.p1, &w.p2, &w.sc}) {
            v->resize(Ls);
        }
        for (std::size_t l = 0; l < Ls; ++l) {
            const auto io = static_cast<std::size_t>(w.P * w.lio[l]);
            for (std::vector<Buf>* v : {&w.dW, &w.dS, &w.dWn, &w.dSn}) (*v)[l] = zeros(io);
            for (std::vector<Buf>* v : {&w.ta, &w.tz, &w.td1, &w.tdelta, &w.tback, &w.tabar,
                                        &w.tdbar, &w.tzbar, &w.zr, &w.p1, &w.p2}) {
                (*v)[l] = zeros(work);
            }
            w.sc[l] = zeros(static_cast<std::size_t>(w.P * w.b * w.b));
        }
        w.hin.resize(Ls + 1);
        for (Buf& hb : w.hin) hb = zeros(work);
        for (Buf* x : {&w.tmpb, &w.dHb, &w.scaledb, &w.AWb, &w.ASb, &w.bbarb}) *x = zeros(work);
        w.dMb = zeros(static_cast<std::size_t>(w.P * w.b * w.b));
        w.vo = Vec{w.b};
        w.VS = w.vo.size();
        w.vecb = zeros(static_cast<std::size_t>(w.P * w.VS));
        w.given = d_out != nullptr && !d_out->empty();
        w.end_mid = w.given && w.NV % w.b != 0;
        if (w.end_mid) {
            w.dW_end.resize(Ls);
            w.dS_end.resize(Ls);
            for (std::size_t l = 0; l < Ls; ++l) {
                w.dW_end[l] = zeros(w.dW[l].size());
                w.dS_end[l] = zeros(w.dS[l].size());
            }
        }
        for (long long p = 0; p < w.P && w.given; ++p) {
            for (std::size_t l = 0; l < Ls; ++l) {
                const auto i = static_cast<std::size_t>(p);
                upload_to((w.end_mid ? w.dW_end : w.dWn)[l].data() + p * w.lio[l], d_out->weights[i][l]);
                upload_to((w.end_mid ? w.dS_end : w.dSn)[l].data() + p * w.lio[l], d_out->momentum[i][l]);
            }
        }
        pending_buffers(w, w.end_mid ? d_out : nullptr);
        w.Wl.resize(Ls);
        w.Sl.resize(Ls);
    }

    /// d_out's pending rows' adjoints uploaded (P x rows x width, empty parts as zeros) when
    /// the trace ends mid-chunk; the incoming pending rows' adjoints zeroed when it starts so.
    static void pending_buffers(Sweep& w, const MemoryStateGradient<T>* d_out) {
        const long long rows = w.NV % w.b;
        w.pa_out.assign(w.Ls, Buf{});
        w.pd_out.assign(w.Ls, Buf{});
        w.da_in.assign(w.Ls, Buf{});
        w.dd_in.assign(w.Ls, Buf{});
        for (std::size_t l = 0; l < w.Ls && d_out != nullptr; ++l) {
            w.pa_out[l] = zeros(static_cast<std::size_t>(w.P * rows * w.lin[l]));
            w.pd_out[l] = zeros(static_cast<std::size_t>(w.P * rows * w.lout[l]));
            for (long long p = 0; p < w.P; ++p) {
                const auto i = static_cast<std::size_t>(p);
                if (!d_out->pending_a.empty()) {
                    upload_to(w.pa_out[l].data() + p * rows * w.lin[l], d_out->pending_a[i][l]);
                }
                if (!d_out->pending_delta.empty()) {
                    upload_to(w.pd_out[l].data() + p * rows * w.lout[l], d_out->pending_delta[i][l]);
                }
            }
        }
        w.pg_out = zeros(static_cast<std::size_t>(d_out != nullptr && w.gated ? w.P * rows * 3 : 0));
        for (long long p = 0; p < w.P && d_out != nullptr && w.gated && !d_out->pending_gates.empty(); ++p) {
            upload_to(w.pg_out.data() + p * rows * 3, d_out->pending_gates[static_cast<std::size_t>(p)]);
        }
        for (std::size_t l = 0; l < w.Ls && w.off > 0; ++l) {
            w.da_in[l] = zeros(static_cast<std::size_t>(w.P * w.off * w.lin[l]));
            w.dd_in[l] = zeros(static_cast<std::size_t>(w.P * w.off * w.lout[l]));
        }
    }

    /// One stage of the chunk at c0: the prefix of n rows, the reads of rows [o, n); if end,
    /// the prefix's end W' = f(W, S, rows < n) with its adjoint in dWn, dSn. Adds into dW,
    /// dS (the chunk start's), dq, dk, dv and dlogits.
    static void stage(Sweep& w, long long c0, long long n, long long o, bool end) {
        const long long pre = c0 == 0 ? w.off : 0;  // the incoming pending rows in the prefix
        key_tape(w, c0, n, o);
        // With a chunk end, lagged and no adjoint out, the chunk end writes the tape's
        // adjoints first (end_rows_kernel's dbar, the first abar product's beta 0).
        w.tape_fresh = end && !w.add_out && !w.inchunk;
        for (std::size_t l = 0; l < w.Ls && !w.tape_fresh; ++l) {
            clear(w, w.tabar[l]);
            clear(w, w.tdbar[l]);
        }
        if (pre > 0) {
            pending_rows_in(w, pre);
        }
        if (w.add_out) {
            pending_rows_out(w, c0, n);
        }
        clear(w, w.vecb);
        gates(w, c0, n);
        read_forward(w, c0, n, o);
        for (std::size_t l = w.Ls; l-- > 0;) {
            read_layer_backward(w, l, n, o);
        }
        read_input_adjoint(w, c0, n, o);
        if (end) {
            end_backward(w, n);
        }
        coefficients_backward(w, n, end);
        if (w.clipping) {
            clip_backward(w, n);
        }
        if (pre > 0) {
            pending_adjoints_in(w, pre);
        }
        tape_backward(w, c0, n);
        if (w.gated) {
            gates_backward(w, c0, n);
        }
    }

    /// Rows [0, pre) of the key tape's a_l, delta_l: the trace's incoming pending rows (the
    /// state's P x b x width arrays), over the ones key_tape computed from zero keys.
    static void pending_rows_in(Sweep& w, long long pre) {
        const long long BW = w.BW, b = w.b;
        for (std::size_t l = 0; l < w.Ls; ++l) {
            for (int which = 0; which < 2; ++which) {
                const long long width = which == 0 ? w.lin[l] : w.lout[l];
                const T* from = (which == 0 ? w.tr.pend_a : w.tr.pend_delta)[l].data();
                T* to = (which == 0 ? w.ta : w.tdelta)[l].data();
                cuda::each(w.sm, w.P * pre * width, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(pre * width), rc = i % cuda::u32(pre * width);
                    to[p * BW + rc] = from[p * b * width + rc];
                });
            }
        }
    }

    /// d_out's pending rows' adjoints into the last chunk's tape adjoints (rows [0, n)) and
    /// its logits' (pair-major rows [c0, c0 + n)).
    static void pending_rows_out(Sweep& w, long long c0, long long n) {
        const long long BW = w.BW, NV = w.NV;
        for (std::size_t l = 0; l < w.Ls; ++l) {
            for (int which = 0; which < 2; ++which) {
                const long long width = which == 0 ? w.lin[l] : w.lout[l];
                const T* from = (which == 0 ? w.pa_out : w.pd_out)[l].data();
                T* to = (which == 0 ? w.tabar : w.tdbar)[l].data();
                cuda::each(w.sm, w.P * n * width, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * width), rc = i % cuda::u32(n * width);
                    to[p * BW + rc] += from[i];
                });
            }
        }
        if (w.gated) {
            const T* from = w.pg_out.data();
            T* dLG = w.dLGb.data() + c0 * 3;
            cuda::each(w.sm, w.P * n * 3, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(n * 3), rc = i % cuda::u32(n * 3);
                dLG[p * NV * 3 + rc] += from[i];
            });
        }
    }

    /// The incoming pending rows' tape adjoints (rows [0, pre)) moved into da_in, dd_in: they
    /// are the state's, not reversed through the key pass (zeroed, their rows add nothing).
    static void pending_adjoints_in(Sweep& w, long long pre) {
        const long long BW = w.BW;
        for (std::size_t l = 0; l < w.Ls; ++l) {
            for (int which = 0; which < 2; ++which) {
                const long long width = which == 0 ? w.lin[l] : w.lout[l];
                T* from = (which == 0 ? w.tabar : w.tdbar)[l].data();
                T* to = (which == 0 ? w.da_in : w.dd_in)[l].data();
                cuda::each(w.sm, w.P * pre * width, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(pre * width), rc = i % cuda::u32(pre * width);
                    to[i] += from[p * BW + rc];
                    from[p * BW + rc] = T(0);
                });
            }
        }
    }

    static void clear(Sweep& w, Buf& x) {
        cuda::memset_async(x.data(), 0, x.size() * sizeof(T), w.sm, "cudaMemsetAsync");
    }

    /// The device view of the key tape's layers (a_l, delta_l and their widths).
    static typename Kernels::Layers tape_layers(Sweep& w) {
        typename Kernels::Layers ly{};
        ly.depth = w.L;
        for (std::size_t l = 0; l < w.Ls; ++l) {
            ly.a[l] = w.ta[l].data();
            ly.d[l] = w.tdelta[l].data();
            ly.in[l] = static_cast<int>(w.lin[l]);
            ly.out[l] = static_cast<int>(w.lout[l]);
        }
        return ly;
    }

    /// The key tape of rows [c0, c0 + n) from the chunk's start memory: a_l, z_l, act'(z_l),
    /// the error delta_L = M(k) - v (+ k with the residual) and the deltas back through the
    /// layers. Its first pass also copies the read's inputs, q and dy of rows [o, n), for
    /// read_forward.
    static void key_tape(Sweep& w, long long c0, long long n, long long o) {
        const long long N = w.NV, dh = w.dh, BW = w.BW, P = w.P, skip = o * dh;
        const Activation act = w.act;
        const bool residual = w.residual;
        const T* Kp = w.Kb.data() + c0 * dh;
        const T* V = w.Vb.data() + c0 * dh;
        const T* Q = w.Qb.data() + c0 * dh;
        const T* DY = w.DYb.data() + c0 * dh;
        T* a0 = w.ta[0].data();
        T* h0 = w.hin[0].data();
        T* tm = w.tmpb.data();
        cuda::each(w.sm, P * n * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
            a0[p * BW + rc] = Kp[p * N * dh + rc];
            if (rc >= skip) {
                h0[p * BW + rc - skip] = Q[p * N * dh + rc];
                tm[p * BW + rc - skip] = DY[p * N * dh + rc];
            }
        });
        for (std::size_t l = 0; l < w.Ls; ++l) {
            const long long in = w.lin[l], out = w.lout[l];
            mm(w.cx, false, false, n, out, in, T(1), w.ta[l].data(), in, BW, w.Wl[l], out,
               w.lio[l], T(0), w.tz[l].data(), out, BW, P);
            if (l + 1 < w.Ls) {
                const T* z = w.tz[l].data();
                T* an = w.ta[l + 1].data();
                T* d1 = w.td1[l].data();
                cuda::each(w.sm, P * n * out, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * out), rc = i % cuda::u32(n * out);
                    an[p * BW + rc] = cuda::kernel_activate(act, z[p * BW + rc]);
                    d1[p * BW + rc] = cuda::kernel_activate_grad(act, z[p * BW + rc]);
                });
            }
        }
        const T* z = w.tz[w.Ls - 1].data();
        T* dl = w.tdelta[w.Ls - 1].data();
        cuda::each(w.sm, P * n * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
            T e = z[p * BW + rc] - V[p * N * dh + rc];
            if (residual) e += Kp[p * N * dh + rc];
            dl[p * BW + rc] = e;
        });
        for (std::size_t l = w.Ls - 1; l > 0; --l) {
            const long long in = w.lin[l], out = w.lout[l];
            mm(w.cx, false, true, n, in, out, T(1), w.tdelta[l].data(), out, BW, w.Wl[l], out,
               w.lio[l], T(0), w.tback[l].data(), in, BW, P);
            const T* bk = w.tback[l].data();
            const T* d1 = w.td1[l - 1].data();
            T* dp = w.tdelta[l - 1].data();
            cuda::each(w.sm, P * n * in, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(n * in), rc = i % cuda::u32(n * in);
                dp[p * BW + rc] = bk[p * BW + rc] * d1[p * BW + rc];
            });
        }
    }

    /// theta0, theta (clipped), eta, alpha and g2 of the chunk's rows into the pair's vectors.
    static void gates(Sweep& w, long long c0, long long n) {
        cuda::launch(cuda::sweep_gates_kernel<T, Vec>, cuda::warp_blocks(w.P * n), 256, w.sm,
                     cuda::GateParams<T>::of(w.cfg), tape_layers(w), w.LGb.data() + c0 * 3,
                     w.NV, w.vecb.data(), w.vo, w.VS, w.BW, w.P, static_cast<int>(n));
        cuda::check_launch("the backward's gates");
    }

    /// The read of rows [o, n) of a chunk prefix of n rows recomputed (lagged: z_l = h_l W_l;
    /// dual form: z_l = diag(beta) h_l W_l + diag(c) h_l S_l - (G . h_l A_l^T) Delta_l, G
    /// (n - o) x n), y kept; the adjoint of the last z (dy's rows) in tmp. h_0 = q and tmp =
    /// dy of those rows are copied by key_tape's first pass.
    static void read_forward(Sweep& w, long long c0, long long n, long long o) {
        const long long N = w.NV, dh = w.dh, BW = w.BW, VS = w.VS, P = w.P, m = n - o;
        const Vec vo = w.vo;
        const Activation act = w.act;
        const bool residual = w.residual;
        T* vec = w.vecb.data();
        const T* Q = w.Qb.data() + (c0 + o) * dh;
        if (w.inchunk) {
            const int ni = static_cast<int>(n), oi = static_cast<int>(o);
            cuda::pair_local<true>(
                w.sm, vec, P, VS, vo.G(),
                [=] __device__(unsigned, T* v, T* g, unsigned t, unsigned nt) {
                    if (t == 0) {
                        chunk_row_prefix<T>(ni, oi, v + vo.eta(), v + vo.alpha(), v + vo.beta(),
                                            v + vo.c());
                    }
                    for (int k = static_cast<int>(t); k < ni; k += static_cast<int>(nt)) {
                        chunk_row_column<T>(ni, oi, k, v + vo.theta(), v + vo.eta(),
                                            v + vo.alpha(), g + vo.G());
                    }
                });
        }
        for (std::size_t l = 0; l < w.Ls; ++l) {
            const long long in = w.lin[l], out = w.lout[l];
            T* z = w.zr[l].data();
            mm(w.cx, false, false, m, out, in, T(1), w.hin[l].data(), in, BW, w.Wl[l], out,
               w.lio[l], T(0), z, out, BW, P);
            if (w.inchunk) {
                dual_layer(w, l, n, o);
            }
            if (l + 1 < w.Ls) {
                T* hn = w.hin[l + 1].data();
                cuda::each(w.sm, P * m * out, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(m * out), rc = i % cuda::u32(m * out);
                    hn[p * BW + rc] = cuda::kernel_activate(act, z[p * BW + rc]);
                });
            }
        }
        const T* z = w.zr[w.Ls - 1].data();
        T* Y = w.Yb.data() + (c0 + o) * dh;
        cuda::each(w.sm, P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), rc = i % cuda::u32(m * dh);
            Y[p * N * dh + rc] = z[p * BW + rc] + (residual ? Q[p * N * dh + rc] : T(0));
        });
    }

    /// Layer l of the dual-form read (z_l holds h_l W_l): p1 = h_l W_l, p2 = h_l S_l,
    /// sc = h_l A_l^T, then z_l = diag(beta) p1 + diag(c) p2 - (G . sc) Delta_l.
    static void dual_layer(Sweep& w, std::size_t l, long long n, long long o) {
        const long long in = w.lin[l], out = w.lout[l], BW = w.BW, VS = w.VS, P = w.P,
                        bb = w.b * w.b, m = n - o;
        const Vec vo = w.vo;
        const T* vec = w.vecb.data();
        T* z = w.zr[l].data();
        T* q1 = w.p1[l].data();
        T* q2 = w.p2[l].data();
        T* s2 = w.sc[l].data();
        T* dM = w.dMb.data();
        cuda::copy_async(q1, z, static_cast<std::size_t>(P * BW) * sizeof(T), w.sm,
                         "cudaMemcpyAsync");
        mm(w.cx, false, false, m, out, in, T(1), w.hin[l].data(), in, BW, w.Sl[l], out, w.lio[l],
           T(0), q2, out, BW, P);
        mm(w.cx, false, true, m, n, in, T(1), w.hin[l].data(), in, BW, w.ta[l].data(), in, BW,
           T(0), s2, n, bb, P);
        cuda::each(w.sm, P * m * n, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * n), rc = i % cuda::u32(m * n);
            dM[p * bb + rc] = vec[p * VS + vo.G() + rc] * s2[p * bb + rc];
        });
        cuda::each(w.sm, P * m * out, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * out), r = (i / cuda::u32(out)) % cuda::u32(m),
                            rc = i % cuda::u32(m * out);
            const T* v = vec + p * VS;
            z[p * BW + rc] = v[vo.beta() + r] * q1[p * BW + rc] + v[vo.c() + r] * q2[p * BW + rc];
        });
        mm(w.cx, false, false, m, out, n, T(-1), dM, n, bb, w.tdelta[l].data(), out, BW, T(1), z,
           out, BW, P);
    }

    /// Layer l of the read reversed: tmp = dz_l in, dH = the adjoint of h_l out (then, below
    /// the first layer, tmp = dz_{l-1}); dW (and the dual form's dS, abar, dbar, dbeta, dc,
    /// dG) added.
    static void read_layer_backward(Sweep& w, std::size_t l, long long n, long long o) {
        const long long in = w.lin[l], out = w.lout[l], BW = w.BW, m = n - o;
        const Activation act = w.act;
        T* tm = w.tmpb.data();
        if (!w.inchunk) {
            mm(w.cx, true, false, in, out, m, T(1), w.hin[l].data(), in, BW, tm, out, BW,
               w.fresh ? T(0) : T(1), w.dW[l].data(), out, w.lio[l], w.P);
            mm(w.cx, false, true, m, in, out, T(1), tm, out, BW, w.Wl[l], out, w.lio[l], T(0),
               w.dHb.data(), in, BW, w.P);
        } else {
            dual_layer_backward(w, l, n, o);
        }
        if (l > 0) {
            const T* zp = w.zr[l - 1].data();
            const T* dH = w.dHb.data();
            cuda::each(w.sm, w.P * m * in, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * in), rc = i % cuda::u32(m * in);
                tm[p * BW + rc] = cuda::kernel_activate_grad(act, zp[p * BW + rc]) * dH[p * BW + rc];
            });
        }
    }

    /// dual_layer reversed (math §9, the CPU's dual_layer_backward).
    static void dual_layer_backward(Sweep& w, std::size_t l, long long n, long long o) {
        const long long in = w.lin[l], out = w.lout[l], BW = w.BW, VS = w.VS, P = w.P,
                        bb = w.b * w.b, m = n - o;
        const Vec vo = w.vo;
        T* vec = w.vecb.data();
        const T* tm = w.tmpb.data();
        const T* q1 = w.p1[l].data();
        const T* q2 = w.p2[l].data();
        cuda::each(w.sm, P * m, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m), r = i % cuda::u32(m);
            T s1 = T(0), s2 = T(0);
            for (long long c = 0; c < out; ++c) {
                s1 += tm[p * BW + r * out + c] * q1[p * BW + r * out + c];
                s2 += tm[p * BW + r * out + c] * q2[p * BW + r * out + c];
            }
            vec[p * VS + vo.dbeta() + o + r] += s1;
            vec[p * VS + vo.dc() + o + r] += s2;
        });
        T* scd = w.scaledb.data();
        for (int which = 0; which < 2; ++which) {
            const long long off = which == 0 ? vo.beta() : vo.c();
            cuda::each(w.sm, P * m * out, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * out), r = (i / cuda::u32(out)) % cuda::u32(m),
                                rc = i % cuda::u32(m * out);
                scd[p * BW + rc] = vec[p * VS + off + r] * tm[p * BW + rc];
            });
            mm(w.cx, true, false, in, out, m, T(1), w.hin[l].data(), in, BW, scd, out, BW, T(1),
               (which == 0 ? w.dW[l] : w.dS[l]).data(), out, w.lio[l], P);
            mm(w.cx, false, true, m, in, out, T(1), scd, out, BW, which == 0 ? w.Wl[l] : w.Sl[l],
               out, w.lio[l], which == 0 ? T(0) : T(1), w.dHb.data(), in, BW, P);
        }
        T* Mx = w.dMb.data();
        const T* s2 = w.sc[l].data();
        cuda::each(w.sm, P * m * n, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * n), rc = i % cuda::u32(m * n);
            Mx[p * bb + rc] = vec[p * VS + vo.G() + rc] * s2[p * bb + rc];
        });
        mm(w.cx, true, false, n, out, m, T(-1), Mx, n, bb, tm, out, BW, T(1), w.tdbar[l].data(),
           out, BW, P);
        // dM = -dZ Delta^T (reuse Mx), dG's rows [o, n) += dM . sc, dsc = dM . G (in Mx).
        mm(w.cx, false, true, m, n, out, T(-1), tm, out, BW, w.tdelta[l].data(), out, BW, T(0),
           Mx, n, bb, P);
        cuda::each(w.sm, P * m * n, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * n), rc = i % cuda::u32(m * n);
            T* v = vec + p * VS;
            v[vo.dG() + o * n + rc] += Mx[p * bb + rc] * s2[p * bb + rc];
            Mx[p * bb + rc] *= v[vo.G() + rc];
        });
        mm(w.cx, false, false, m, in, n, T(1), Mx, n, bb, w.ta[l].data(), in, BW, T(1),
           w.dHb.data(), in, BW, P);
        mm(w.cx, true, false, n, in, m, T(1), Mx, n, bb, w.hin[l].data(), in, BW, T(1),
           w.tabar[l].data(), in, BW, P);
    }

    /// dq of the read rows [c0 + o, c0 + n): the read's input adjoint (+ dy with the residual).
    static void read_input_adjoint(Sweep& w, long long c0, long long n, long long o) {
        const long long N = w.NV, dh = w.dh, BW = w.BW, m = n - o;
        const bool residual = w.residual;
        const T* dH = w.dHb.data();
        T* dQ = w.dQb.data() + (c0 + o) * dh;
        const T* DY = w.DYb.data() + (c0 + o) * dh;
        cuda::each(w.sm, w.P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), rc = i % cuda::u32(m * dh);
            dQ[p * N * dh + rc] += dH[p * BW + rc] + (residual ? DY[p * N * dh + rc] : T(0));
        });
    }

    /// The chunk end W' = beta W + c S - A^T diag(g) Delta, S' = P S - A^T diag(s) Delta,
    /// reversed from dWn, dSn: dW, dS, abar, dbar, dg, ds added; the end coefficients' adjoints
    /// (dbe, dce, dpe) in the pair's vector.
    static void end_backward(Sweep& w, long long n) {
        const long long VS = w.VS, BW = w.BW, P = w.P;
        const Vec vo = w.vo;
        T* vec = w.vecb.data();
        cuda::pair_local(w.sm, vec, P, VS, vo.G(), [=] __device__(unsigned, T* v, T*) {
            chunk_end_coefficients<T>(static_cast<int>(n), v + vo.theta(), v + vo.eta(),
                                      v + vo.alpha(), v + vo.g(), v + vo.s(), v + vo.ends(),
                                      v + vo.ends() + 1, v + vo.ends() + 2);
        });
        cuda::EndWeights<T> ew{};
        ew.depth = static_cast<int>(w.Ls);
        for (std::size_t l = 0; l < w.Ls; ++l) {
            ew.dwn[l] = w.dWn[l].data();
            ew.dsn[l] = w.dSn[l].data();
            ew.w[l] = w.Wl[l];
            ew.s[l] = w.Sl[l];
            ew.dw[l] = w.dW[l].data();
            ew.ds[l] = w.dS[l].data();
            ew.io[l] = w.lio[l];
        }
        ew.assign_s = w.fresh;
        cuda::launch(cuda::chunk_end_weights_kernel<T>, static_cast<unsigned>(P), 256, w.sm, ew,
                     vec + vo.ends(), VS);
        cuda::check_launch("the chunk end's weight terms");
        for (std::size_t l = 0; l < w.Ls; ++l) {
            const long long in = w.lin[l], out = w.lout[l], io = w.lio[l];
            const T* dwn = w.dWn[l].data();
            const T* dsn = w.dSn[l].data();
            T* AW = w.AWb.data();
            T* AS = w.ASb.data();
            mm(w.cx, false, false, n, out, in, T(1), w.ta[l].data(), in, BW, dwn, out, io, T(0),
               AW, out, BW, P);
            mm(w.cx, false, false, n, out, in, T(1), w.ta[l].data(), in, BW, dsn, out, io, T(0),
               AS, out, BW, P);
            const T* Dl = w.tdelta[l].data();
            cuda::launch(cuda::end_rows_kernel<T>, cuda::warp_blocks(P * n), 256, w.sm, AW, AS,
                         Dl, w.tdbar[l].data(), vec, VS, vo.g(), vo.s(), vo.dg(), vo.ds(), P, n,
                         out, BW, w.tape_fresh);
            cuda::check_launch("the chunk end's row terms");
            T* abar = w.tabar[l].data();
            mm(w.cx, false, true, n, in, out, T(1), AW, out, BW, dwn, out, io,
               w.tape_fresh ? T(0) : T(1), abar, in, BW, P);
            mm(w.cx, false, true, n, in, out, T(1), AS, out, BW, dsn, out, io, T(1), abar, in, BW, P);
        }
    }

    /// The coefficient recurrences reversed into dtheta, deta, dalpha (per pair).
    static void coefficients_backward(Sweep& w, long long n, bool end) {
        const long long VS = w.VS;
        const Vec vo = w.vo;
        const bool inchunk = w.inchunk;
        T* vec = w.vecb.data();
        cuda::pair_local(w.sm, vec, w.P, VS, vo.G(), [=] __device__(unsigned, T* v, T* g) {
            const int nn = static_cast<int>(n);
            if (end) {
                v[vo.dbeta() + nn - 1] += v[vo.ends() + 3];
                v[vo.dc() + nn - 1] += v[vo.ends() + 4];
            }
            chunk_coefficients_backward<T>(nn, v + vo.theta(), v + vo.eta(), v + vo.alpha(),
                                           v + vo.dbeta(), v + vo.dc(),
                                           inchunk ? g + vo.dG() : nullptr,
                                           end ? v + vo.dg() : nullptr,
                                           end ? v + vo.ds() : nullptr,
                                           end ? v[vo.ends() + 5] : T(0), v + vo.dtheta(),
                                           v + vo.deta(), v + vo.dalpha(), v + vo.scratch());
        });
    }

    /// theta = theta0 min(1, c / sqrt(g2)) reversed: dtheta becomes theta0's adjoint, g2's
    /// goes into the tape's abar and dbar (scaled where g2 overflowed).
    static void clip_backward(Sweep& w, long long n) {
        Adjoints lb{};
        for (std::size_t l = 0; l < w.Ls; ++l) {
            lb.a[l] = w.tabar[l].data();
            lb.d[l] = w.tdbar[l].data();
        }
        cuda::launch(cuda::sweep_clip_backward_kernel<T, Vec, Adjoints>,
                     cuda::warp_blocks(w.P * n), 256, w.sm, w.clip, tape_layers(w), lb,
                     w.vecb.data(), w.vo, w.VS, w.BW, w.P, static_cast<int>(n));
        cuda::check_launch("the clipping reversed");
    }

    /// detail::KeyTape::backward on the device: the deltas' adjoints back through the layers
    /// (second-order terms in zbar), then the forward's, into dW, dk and dv.
    static void tape_backward(Sweep& w, long long c0, long long n) {
        const long long N = w.NV, dh = w.dh, BW = w.BW, P = w.P;
        const Activation act = w.act;
        const bool residual = w.residual;
        // Each zbar's first write below is an assignment (no clearing memset a stage).
        for (std::size_t l = 1; l < w.Ls; ++l) {
            const long long in = w.lin[l], out = w.lout[l];  // delta[l-1] is n x in
            const T* db = w.tdbar[l - 1].data();
            const T* d1 = w.td1[l - 1].data();
            const T* bk = w.tback[l].data();
            const T* zp = w.tz[l - 1].data();
            T* zb = w.tzbar[l - 1].data();
            T* bb = w.bbarb.data();
            cuda::each(w.sm, P * n * in, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(n * in), e = p * BW + i % cuda::u32(n * in);
                bb[e] = db[e] * d1[e];
                zb[e] = db[e] * bk[e] * cuda::kernel_activate_grad2(act, zp[e]);
            });
            mm(w.cx, false, false, n, out, in, T(1), bb, in, BW, w.Wl[l], out, w.lio[l], T(1),
               w.tdbar[l].data(), out, BW, P);
            mm(w.cx, true, false, in, out, n, T(1), bb, in, BW, w.tdelta[l].data(), out, BW, T(1),
               w.dW[l].data(), out, w.lio[l], P);
        }
        const T* db = w.tdbar[w.Ls - 1].data();
        T* zl = w.tzbar[w.Ls - 1].data();
        T* dV = w.dVb.data() + c0 * dh;
        T* dK = w.dKb.data() + c0 * dh;
        cuda::each(w.sm, P * n * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh), e = p * BW + rc;
            zl[e] = db[e];
            dV[p * N * dh + rc] -= db[e];
            if (residual) dK[p * N * dh + rc] += db[e];
        });
        for (std::size_t l = w.Ls; l-- > 0;) {
            const long long in = w.lin[l], out = w.lout[l];
            T* zb = w.tzbar[l].data();
            if (l + 1 < w.Ls) {
                const T* ab = w.tabar[l + 1].data();
                const T* d1 = w.td1[l].data();
                cuda::each(w.sm, P * n * out, [=] __device__(unsigned i) {
                    const long long p = i / cuda::u32(n * out), e = p * BW + i % cuda::u32(n * out);
                    zb[e] += ab[e] * d1[e];
                });
            }
            mm(w.cx, true, false, in, out, n, T(1), w.ta[l].data(), in, BW, zb, out, BW, T(1),
               w.dW[l].data(), out, w.lio[l], P);
            mm(w.cx, false, true, n, in, out, T(1), zb, out, BW, w.Wl[l], out, w.lio[l], T(1),
               w.tabar[l].data(), in, BW, P);
        }
        const T* ab = w.tabar[0].data();
        cuda::each(w.sm, P * n * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(n * dh), rc = i % cuda::u32(n * dh);
            dK[p * N * dh + rc] += ab[p * BW + rc];
        });
    }

    /// The gate values' adjoints (dtheta of theta0, deta, dalpha) into the logits.
    static void gates_backward(Sweep& w, long long c0, long long n) {
        const long long N = w.NV, VS = w.VS;
        const Vec vo = w.vo;
        const GateMode gmode = w.gmode;
        const T tmax = w.tmax, se = w.se, sa = w.sa;
        const T* vec = w.vecb.data();
        const T* LG = w.LGb.data() + c0 * 3;
        T* dLG = w.dLGb.data() + c0 * 3;
        // A thread per (pair, row, gate): no thread walks the chunk's rows storing as it goes
        // (the chunk's mean, PerChunk, is summed by each of its rows' threads, in row order).
        cuda::each(w.sm, w.P * n * 3, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(n * 3), r = (i / 3) % cuda::u32(n), which = i % 3;
            const T* v = vec + p * VS;
            const T* adj = v + (which == 0 ? vo.dtheta() : which == 1 ? vo.deta() : vo.dalpha());
            const T scale = which == 0 ? tmax : which == 1 ? se : sa;
            dLG[p * N * 3 + r * 3 + which] += cuda::gate_logit_adjoint<T>(
                gmode, scale, LG + p * N * 3, adj, static_cast<int>(n), static_cast<int>(r),
                static_cast<int>(which));
        });
    }

    // --- 3. The projections reversed. ------------------------------------------------------

    /// Rows [p, q) of every sequence: dq, dk, dv back to row-major (in dqb, (B*N) x 3D) and
    /// the read y (in yhb, (B*N) x D).
    static void to_row_major(Sweep& w, long long p, long long q) {
        const long long C3 = w.C3, D = w.D, N = w.N, NV = w.NV, off = w.off, H = w.H, dh = w.dh,
                        m = q - p;
        T* dq = w.dqb.data();
        T* yh = w.yhb.data();
        const T* dQ = w.dQb.data();
        const T* dK = w.dKb.data();
        const T* dV = w.dVb.data();
        const T* Y = w.Yb.data();
        cuda::each(w.sm, w.B * m * D, [=] __device__(unsigned i) {
            const long long k = i / cuda::u32(D), c = i % cuda::u32(D), s = k / m, t = p + k % m,
                            r = s * N + t, h = c / dh, j = c % dh,
                            e = ((s * H + h) * NV + off + t) * dh + j;
            dq[r * C3 + c] = dQ[e];
            dq[r * C3 + D + c] = dK[e];
            dq[r * C3 + 2 * D + c] = dV[e];
            yh[r * D + c] = Y[e];
        });
    }

    /// The norm, phi and the conv of rows [p, q) reversed: dqb becomes dL/dc there, dub
    /// dL/du (the conv reads dL/dc of the K-1 rows after each, reversed already).
    static void projections_backward(Sweep& w, long long p, long long q) {
        const long long C3 = w.C3, N = w.N, H = w.H, dh = w.dh, K = w.K, m = q - p;
        const bool norm = w.norm, silu = w.silu, conv = w.conv;
        T* dq = w.dqb.data();
        T* du = w.dub.data();
        const T* qkv = w.qkvb.data();
        const T* nrm = w.nb.data();
        const T* cc = w.cb.data();
        const T* taps = w.prm.taps.data();
        norm_phi_backward(w.sm, dq, qkv, nrm, cc, w.B, N, p, m, C3, 2 * H, dh, norm, silu);
        cuda::each(w.sm, w.B * m * C3, [=] __device__(unsigned i) {
            const long long k = i / cuda::u32(C3), j = i % cuda::u32(C3), t = p + k % m,
                            r = k / m * N + t, at0 = r * C3 + j;
            if (!conv) {
                du[at0] = dq[at0];
                return;
            }
            T v = taps[(K - 1) * C3 + j] * dq[at0];
            for (long long c = 0; c < K - 1; ++c) {
                const long long at = t + K - 1 - c;
                if (at < N) v += taps[c * C3 + j] * dq[(r - t + at) * C3 + j];
            }
            du[at0] = v;
        });
    }

    /// The state after the trace keeps the last K-1 rows of [tail_in; u] per sequence:
    /// d_out's tail adjoint (row i) added to du's row N + i - (K-1) where that is in [p, q).
    static void add_tail_out(Sweep& w, long long p, long long q) {
        if (!(w.given && w.conv && w.K1 > 0)) {
            return;
        }
        w.cx.synchronize();
        T* du = w.dub.data();
        for (int s = 0; s < w.B; ++s) {
            for (long long i = 0; i < w.K1; ++i) {
                const long long t = w.N + i - w.K1;
                if (t >= p && t < q) {
                    Mat row = download_mat(du + (s * w.N + t) * w.C3, 1, w.C3);
                    row += w.dtail_out[static_cast<std::size_t>(s)].row(i);
                    upload_to(du + (s * w.N + t) * w.C3, row);
                }
            }
        }
    }

    /// dlogits of rows [p, q) row-major (in dlgb, (B*N) x 3H).
    static void logits_row_major(Sweep& w, long long p, long long q) {
        if (!w.gated) {
            return;
        }
        const long long G3 = w.G3, N = w.N, NV = w.NV, off = w.off, H = w.H, m = q - p;
        const T* dLG = w.dLGb.data();
        T* dl = w.dlgb.data();
        cuda::each(w.sm, w.B * m * G3, [=] __device__(unsigned i) {
            const long long k = i / cuda::u32(G3), c = i % cuda::u32(G3), s = k / m,
                            t = p + k % m, g = c / H, h = c % H;
            dl[(s * N + t) * G3 + c] = dLG[((s * H + h) * NV + off + t) * 3 + g];
        });
    }

    /// dx of rows [p, q) of every sequence, (B*(q-p)) x d at dx (row stride ld), sequence-
    /// major: du [W_Q|W_K|W_V]^T (+ dlogits W_gates^T), the rows gathered first unless they
    /// are all of them.
    static void input_rows(Sweep& w, long long p, long long q, T* dx, long long ld) {
        const long long m = q - p, C3 = w.C3, G3 = w.G3, rows = w.B * m;
        const T* du = w.dub.data();
        const T* dl = w.dlgb.data();
        if (m < w.N) {
            w.rowsb = Buf(static_cast<std::size_t>(rows * (C3 + (w.gated ? G3 : 0))));
            const ChunkRows cut{w.B, w.N, p, m};
            cut.gather(w.sm, w.dub.data(), C3, w.rowsb.data(), C3);
            du = w.rowsb.data();
            if (w.gated) {
                cut.gather(w.sm, w.dlgb.data(), G3, w.rowsb.data() + rows * C3, G3);
                dl = w.rowsb.data() + rows * C3;
            }
        }
        mm(w.cx, false, true, rows, w.d, C3, T(1), du, C3, 0, w.prm.w_qkv(), w.prm.ld_in, 0, T(0),
           dx, ld, 0, 1);
        if (w.gated) {
            mm(w.cx, false, true, rows, w.d, G3, T(1), dl, G3, 0, w.prm.w_gates(), w.prm.ld_in, 0,
               T(1), dx, ld, 0, 1);
        }
    }

    /// The parameters' gradients on the device: W_QKV, W_O, the gates and their biases, the
    /// conv taps.
    static void parameter_gradients(Sweep& w, View<const T> dyv) {
        const long long M = w.M, d = w.d, C3 = w.C3, G3 = w.G3, D = w.D, K = w.K, K1 = w.K1,
                        N = w.N, B = w.B;
        const T* x = w.tr.x.mem.data();
        w.gq = Buf(static_cast<std::size_t>(d * C3));
        w.gg = Buf(static_cast<std::size_t>(d * G3));
        w.go = Buf(static_cast<std::size_t>(D * d));
        w.gt = Buf(static_cast<std::size_t>(K * C3));
        w.gb = Buf(static_cast<std::size_t>(G3));
        mm(w.cx, true, false, d, C3, M, T(1), x, d, 0, w.dub.data(), C3, 0, T(0), w.gq.data(), C3,
           0, 1);
        mm(w.cx, true, false, D, d, M, T(1), w.yhb.data(), D, 0, dyv.data, dyv.stride, 0, T(0),
           w.go.data(), d, 0, 1);
        if (w.gated) {
            mm(w.cx, true, false, d, G3, M, T(1), x, d, 0, w.dlgb.data(), G3, 0, T(0),
               w.gg.data(), G3, 0, 1);
            const T* dl = w.dlgb.data();
            cuda::sum_rows(w.sm, M, G3, [=] __device__(unsigned r, unsigned c) {
                return dl[r * G3 + c];
            }, w.gb.data());
        }
        if (w.conv) {
            T* gtp = w.gt.data();
            const T* dc = w.dqb.data();
            const T* u = w.tr.u.data();
            const T* tail = w.tr.tail_in.data();
            // Tap j at lag K - 1 - j: row t of a sequence meets its input t - lag, or the
            // incoming tail's row t + j where t < lag.
            cuda::sum_rows(w.sm, B * N, K * C3, [=] __device__(unsigned r, unsigned i) {
                const long long j = i / cuda::u32(C3), col = i % cuda::u32(C3), lag = K - 1 - j;
                const long long s = r / cuda::u32(N), t = r % cuda::u32(N);
                const T in = t >= lag ? u[(r - lag) * C3 + col] : tail[(s * K1 + t + j) * C3 + col];
                return dc[r * C3 + col] * in;
            }, gtp);
        }
    }

    /// The incoming tails' adjoint through the conv (d_in only), in dtb.
    static void tails_in(Sweep& w, bool wanted) {
        const long long K1 = w.K1, C3 = w.C3, N = w.N;
        w.dtb = zeros(static_cast<std::size_t>(w.B * K1 * C3));
        if (!(wanted && w.conv && K1 > 0)) {
            return;
        }
        T* dt = w.dtb.data();
        const T* dc = w.dqb.data();
        const T* taps = w.prm.taps.data();
        cuda::each(w.sm, w.B * K1 * C3, [=] __device__(unsigned i) {
            const long long s = i / cuda::u32(K1 * C3), r = (i / cuda::u32(C3)) % cuda::u32(K1),
                            col = i % cuda::u32(C3);
            T acc = T(0);
            for (long long j = 0; j < K1; ++j) {
                const long long at = r - j;
                if (at >= 0 && at < N) acc += taps[j * C3 + col] * dc[(s * N + at) * C3 + col];
            }
            dt[i] = acc;
        });
    }

    /// The downloads, added to g in the CPU's order; W^0's adjoint for a trace from position
    /// 0 that holds tokens; d_in (the start memory's adjoint and the tails', passed through
    /// where the trace is shorter than the tail).
    static void host_outputs(Sweep& w, MemoryParams<T>& g, MemoryStateGradient<T>* d_in) {
        const long long d = w.d, C3 = w.C3, D = w.D, H = w.H, G3 = w.G3, K = w.K;
        const Mat Gq = download_mat(w.gq.data(), d, C3);
        g.w_q += Gq.leftCols(D);
        g.w_k += Gq.middleCols(D, D);
        g.w_v += Gq.rightCols(D);
        if (w.N > 0) g.w_o += download_mat(w.go.data(), D, d);
        if (w.conv) {
            const Mat Gt = download_mat(w.gt.data(), K, C3);
            g.conv_q += Gt.leftCols(D);
            g.conv_k += Gt.middleCols(D, D);
            g.conv_v += Gt.rightCols(D);
        }
        if (w.gated) {
            const Mat Gg = download_mat(w.gg.data(), d, G3), Gb = download_mat(w.gb.data(), 1, G3);
            g.w_theta += Gg.leftCols(H);
            g.w_eta += Gg.middleCols(H, H);
            g.w_alpha += Gg.rightCols(H);
            g.b_theta += Gb.leftCols(H);
            g.b_eta += Gb.middleCols(H, H);
            g.b_alpha += Gb.rightCols(H);
        }
        const bool init = w.tr.start == 0 && w.N > 0;
        if (!init && d_in == nullptr) {
            return;
        }
        MemoryStateGradient<T> din;
        state_in(w, din);
        if (init) {
            for (long long p = 0; p < w.P; ++p) {
                auto& w0 = g.memory_init[static_cast<std::size_t>(p % H)];
                for (std::size_t l = 0; l < w.Ls; ++l) {
                    w0[l] += din.weights[static_cast<std::size_t>(p)][l];
                }
            }
        }
        if (d_in != nullptr) {
            *d_in = std::move(din);
        }
    }

    /// The incoming pending rows' adjoints downloaded into d_in (none at a chunk boundary):
    /// per pair and layer da_in's and dd_in's rows, and the logits' (dLGb's leading rows).
    static void pending_in(Sweep& w, MemoryStateGradient<T>& d_in) {
        d_in.pending_a.clear();
        d_in.pending_delta.clear();
        d_in.pending_gates.clear();
        for (long long p = 0; p < w.P && w.off > 0; ++p) {
            std::vector<Mat> a, delta;
            for (std::size_t l = 0; l < w.Ls; ++l) {
                a.push_back(download_mat(w.da_in[l].data() + p * w.off * w.lin[l], w.off, w.lin[l]));
                delta.push_back(download_mat(w.dd_in[l].data() + p * w.off * w.lout[l], w.off, w.lout[l]));
            }
            d_in.pending_a.push_back(std::move(a));
            d_in.pending_delta.push_back(std::move(delta));
            if (w.gated) {
                d_in.pending_gates.push_back(download_mat(w.dLGb.data() + p * w.NV * 3, w.off, 3));
            }
        }
    }

    /// The incoming state's adjoint downloaded into d_in: the start memory's (W and S per pair
    /// and layer) and the tails' (passed through where the trace is shorter than the tail).
    static void state_in(Sweep& w, MemoryStateGradient<T>& d_in) {
        const long long C3 = w.C3, K1 = w.K1;
        w.cx.synchronize();
        d_in.weights.assign(static_cast<std::size_t>(w.P), {});
        d_in.momentum.assign(d_in.weights.size(), {});
        for (long long p = 0; p < w.P; ++p) {
            const auto i = static_cast<std::size_t>(p);
            for (std::size_t l = 0; l < w.Ls; ++l) {
                d_in.weights[i].push_back(download_mat(w.dWn[l].data() + p * w.lio[l], w.lin[l], w.lout[l]));
                d_in.momentum[i].push_back(download_mat(w.dSn[l].data() + p * w.lio[l], w.lin[l], w.lout[l]));
            }
        }
        pending_in(w, d_in);
        d_in.conv_tail.clear();
        for (int s = 0; s < w.B; ++s) {
            Mat m = Mat::Zero(K1, C3);
            if (w.conv && K1 > 0) m = download_mat(w.dtb.data() + s * K1 * C3, K1, C3);
            if (!w.dtail_out.empty() && K1 > 0) {
                for (long long i = 0; i + w.N < K1; ++i) m.row(w.N + i) += w.dtail_out[static_cast<std::size_t>(s)].row(i);
            }
            d_in.conv_tail.push_back(std::move(m));
        }
    }
};

/// The backward in stages on CUDA, the CPU's Reverse contract (math §9): rows are reversed
/// from the last down, and at a position the caller may add the adjoint of the weights after
/// that many tokens (per pair s * H + h, on the host). dy is copied to the device; dx comes
/// back to the host per call.
///
///     Reverse rev(cfg, prepared, trace, dy);
///     rev.down_to(p, dx);   // rows [p, previous position) of every sequence, final
///     rev.tap(dW);          // the adjoint of the weights after p tokens
///     rev.down_to(0, dx); rev.finish(grads);
template <class T>
class MemoryTraining<Cuda, T>::Reverse {
public:
    /// d_out: the adjoint of the state after the trace (null: none).
    Reverse(const MemoryConfig& cfg, const typename Kernels::Prepared& prepared, const Trace& tr,
            View<const T> dyv, const MemoryStateGradient<T>* d_out = nullptr)
        : w_(cfg, prepared, tr), dy_(DeviceMatrix::copy_of(dyv, "cudaMemcpy2D (memory dy)")) {
        Sweep::init(w_, dy_.view(), d_out);
    }

    /// Rows >= position() of every sequence are reversed.
    [[nodiscard]] Index position() const { return std::max(w_.cur - w_.off, 0LL); }

    /// Reverses rows [p, position()) of every sequence, then their projections: dx (resized)
    /// gets dL/dx of those rows, (B * (position() - p)) x d, sequence-major.
    void down_to(Index p, Mat& dx) {
        const long long q = position(), rows = w_.B * (q - p);
        Sweep::down(w_, p == 0 ? 0 : p + w_.off);
        Sweep::rows_backward(w_, p, q);
        Buf out(static_cast<std::size_t>(rows * w_.d));
        Sweep::input_rows(w_, p, q, out.data(), w_.d);
        w_.cx.synchronize();
        dx = download_mat(out.data(), rows, w_.d);
    }

    /// Adds dW[s * H + h] (L matrices each) to the adjoint of the weights after position()
    /// tokens.
    void tap(const std::vector<std::vector<Mat>>& dW) { Sweep::tap(w_, dW); }

    /// After down_to(0): every parameter's gradient added to g; d_in, if given, gets the
    /// adjoint of the state before the trace.
    void finish(MemoryParams<T>& g, MemoryStateGradient<T>* d_in = nullptr) {
        Sweep::finish(w_, g, d_in);
    }

    // The same on views in device memory (what a block on views drives, math §9 "MAC").

    /// down_to into dx ((B * (position() - p)) x d, device, written).
    void down_to(Index p, View<T> dx) {
        const long long q = position();
        Sweep::down(w_, p == 0 ? 0 : p + w_.off);
        Sweep::rows_backward(w_, p, q);
        Sweep::input_rows(w_, p, q, dx.data, dx.stride);
        cuda::idle(w_.cx);
    }
    /// tap with a snapshot in device memory.
    void tap(const CudaMemorySnapshot<T>& dW) {
        std::vector<const T*> from;
        for (const auto& b : dW.w_) from.push_back(b.data());
        Sweep::tap_device(w_, from);
        cuda::idle(w_.cx);
    }
    /// finish into the memory's flat gradient (device, added to) only if every gradient and
    /// d_in are finite, which it returns.
    bool finish_flat(View<T> grads, MemoryStateGradient<T>* d_in = nullptr) {
        return Sweep::finish_flat(w_, grads, d_in);
    }

private:
    Sweep w_;
    DeviceMatrix dy_;
};

}  // namespace titans::backend
