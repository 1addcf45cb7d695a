#pragma once
// titans/backend/cuda/memory_training.cuh: the neural memory's training pass on CUDA (math §9)
// -- IN PROGRESS, not exposed (available = false).
//
// Done: the device trace and the training forward. forward runs Kernels::forward a chunk at
// a time (from a chunk boundary; one transaction over the call, so an error leaves the state
// as it was), keeping in device memory what the CPU's Trace keeps (cpu/memory_training.hpp):
// the input, the incoming conv tails, the pre-conv products u = x [W_Q | W_K | W_V], the gate
// logits (bias added) and the memory (W, S) at every chunk start, laid out as the state's
// (per layer, pairs contiguous) so that a chunk's start memory feeds the forward's batched
// GEMMs (mlp_read, key_pass) as is.
//
// Not done: backward (the reverse sweep of cpu/memory_training.hpp on the device). Until it
// is, NeuralMemory<T, Cuda>'s training calls stay unavailable (they require available).
// The plan, all pairs at once, chunks last first (deterministic, no atomics):
//   1. Kernels::project on the kept input with the kept tails (advance off) gives q, k, v
//      and the gate logits pair-major; dyh = dy W_O^T, g_O = yh^T dy once yh is recomputed.
//   2. Per chunk (start memory from `memory`): the key pass as Kernels::key_pass (batched
//      GEMMs over pairs) keeping A_l, Z_l, Delta_l; gates with clipping (gate_values_kernel);
//      the read reversed (lagged: mlp_read's GEMMs transposed; in-chunk: the dual form's
//      products with G from chunk_row_coefficients); the chunk end reversed (GEMMs
//      A dW', Delta dW'^T); the coefficients by the TITANS_HOST_DEVICE
//      chunk_coefficients_backward, a thread per pair; clipping and the key pass's
//      second-order terms (detail::KeyTape::backward as batched GEMMs); dW, dS carried.
//   3. The projections reversed (cpu::MemoryProjections' steps as element-wise kernels: norm,
//      phi, conv transposed, tails) and the GEMMs for dx and the parameter gradients.
//   MAC's staged Reverse (taps) and read_weights_backward come after.

#include <cstdint>
#include <utility>
#include <vector>

#include "../backend.hpp"
#include "launch.cuh"
#include "memory_kernels.cuh"
#include "runtime.cuh"
#include "transfer.cuh"

namespace titans::backend {

template <class T>
struct MemoryTraining<Cuda, T> {
    /// False until backward runs on the device (see the header comment).
    static constexpr bool available = false;
    using Kernels = MemoryKernels<Cuda, T>;
    using Buf = cuda::DeviceBuffer<T>;
    using Mat = Matrix<T>;
    using Index = Eigen::Index;

    /// A dense row-major rows x cols matrix in device memory.
    struct DeviceMatrix {
        Buf mem;
        Index r = 0, c = 0;
        [[nodiscard]] Index rows() const { return r; }
        [[nodiscard]] Index cols() const { return c; }
        [[nodiscard]] View<const T> view() const { return View<const T>{mem.data(), r, c, c}; }
    };

    /// What backward needs, in device memory (the CPU Trace's members, same meaning):
    /// x (B*N) x d; tail_in B x (K-1) x 3D; u (B*N) x 3D; logits (B*N) x 3H (Constant gates:
    /// none); memory[ch * 2L + l] the weights W_{l+1} and memory[ch * 2L + L + l] the momentum
    /// S_{l+1} at chunk ch's start (P x layer_in x layer_out, pair p = s H + h), chunks =
    /// ceil(N / b).
    struct Trace {
        MemoryConfig cfg;
        DeviceMatrix x;
        int batch = 0;
        std::int64_t start = 0;
        Buf tail_in, u, logits;
        std::vector<Buf> memory;
        long long chunks = 0;
        bool filled = false;
        [[nodiscard]] bool empty() const { return !filled; }
        [[nodiscard]] Index rows() const { return x.rows(); }
    };

    /// Kernels::forward from a state at a chunk boundary, recording the trace (x, y device
    /// views, (B*N) x d, sequence-major). On an error the state is as before.
    static void forward(const MemoryConfig& cfg, const typename Kernels::Prepared& pp,
                        typename Kernels::State& st, View<const T> x, View<T> y, Trace& trace) {
        const int B = st.batch();
        const long long N = x.rows / B, d = cfg.d_model, D = cfg.inner_dim(), H = cfg.n_heads,
                        b = cfg.effective_chunk(), L = cfg.depth, P = B * H;
        const long long K1 = cfg.use_conv ? cfg.conv_kernel - 1 : 0;
        Trace t;
        t.cfg = cfg;
        t.batch = B;
        t.start = st.position();
        t.x.r = x.rows;
        t.x.c = x.cols;
        t.x.mem = Buf(static_cast<std::size_t>(x.rows * x.cols));
        Transfer<Cuda, T>::copy(View<T>{t.x.mem.data(), t.x.r, t.x.c, t.x.c}, x,
                                cudaMemcpyDeviceToDevice, "cudaMemcpy2D (memory trace input)");
        const cudaStream_t sm = st.ctx_->stream();
        t.tail_in = Buf(static_cast<std::size_t>(B * K1 * 3 * D));
        if (K1 > 0) {
            Kernels::copy_into(t.tail_in, st.tail_, sm);
        }
        t.u = Buf(static_cast<std::size_t>(B * N * 3 * D));
        const bool gated = cfg.gates != GateMode::Constant;
        t.logits = Buf(static_cast<std::size_t>(gated ? B * N * 3 * H : 0));
        t.chunks = (N + b - 1) / b;
        t.memory.resize(static_cast<std::size_t>(t.chunks * 2 * L));
        Buf xs(static_cast<std::size_t>(B * b * d)), ys(static_cast<std::size_t>(B * b * d));
        const bool own = Kernels::begin(st);
        try {
            for (long long ch = 0; ch < t.chunks; ++ch) {
                const long long t0 = ch * b, m = std::min(b, N - t0);
                for (long long l = 0; l < L; ++l) {
                    const auto li = static_cast<std::size_t>(l);
                    const auto at = static_cast<std::size_t>(ch * 2 * L + l);
                    t.memory[at] = Buf(st.w_[li].size());
                    t.memory[at + static_cast<std::size_t>(L)] = Buf(st.s_[li].size());
                    Kernels::copy_into(t.memory[at], st.w_[li], sm);
                    Kernels::copy_into(t.memory[at + static_cast<std::size_t>(L)], st.s_[li], sm);
                }
                // The chunk's rows of every sequence, contiguous (B*m x d).
                const T* xd = x.data;
                const long long xst = x.stride;
                T* xp = xs.data();
                cuda::each(sm, B * m * d, [=] __device__(unsigned i) {
                    const long long r = i / cuda::u32(d), c = i % cuda::u32(d),
                                    s = cuda::u32(r) / cuda::u32(m), tt = cuda::u32(r) % cuda::u32(m);
                    xp[i] = xd[(s * N + t0 + tt) * xst + c];
                });
                Kernels::forward_piece(cfg, *pp, st, View<const T>{xs.data(), B * m, d, d},
                                       View<T>{ys.data(), B * m, d, d}, nullptr);
                const T* yp = ys.data();
                T* yd = y.data;
                const long long yst = y.stride;
                cuda::each(sm, B * m * d, [=] __device__(unsigned i) {
                    const long long r = i / cuda::u32(d), c = i % cuda::u32(d),
                                    s = cuda::u32(r) / cuda::u32(m), tt = cuda::u32(r) % cuda::u32(m);
                    yd[(s * N + t0 + tt) * yst + c] = yp[i];
                });
                auto& w = *st.work_;
                const T* up = w.u.data();
                T* ut = t.u.data();
                const long long C3 = 3 * D;
                cuda::each(sm, B * m * C3, [=] __device__(unsigned i) {
                    const long long r = i / cuda::u32(C3), c = i % cuda::u32(C3),
                                    s = cuda::u32(r) / cuda::u32(m), tt = cuda::u32(r) % cuda::u32(m);
                    ut[(s * N + t0 + tt) * C3 + c] = up[i];
                });
                if (gated) {
                    const T* lg = w.logits.data();
                    const T* bias = pp->b_gates.data();
                    T* lt = t.logits.data();
                    const long long C = 3 * H;
                    cuda::each(sm, B * m * C, [=] __device__(unsigned i) {
                        const long long r = i / cuda::u32(C), c = i % cuda::u32(C),
                                        s = cuda::u32(r) / cuda::u32(m), tt = cuda::u32(r) % cuda::u32(m);
                        lt[(s * N + t0 + tt) * C + c] = lg[i] + bias[c];
                    });
                }
            }
            st.ctx_->synchronize();
        } catch (...) {
            Kernels::rollback(st);
            throw;
        }
        if (own) {
            Kernels::commit(st);
        }
        (void)P;
        t.filled = true;
        trace = std::move(t);
    }
};

}  // namespace titans::backend
