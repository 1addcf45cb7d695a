#pragma once
// titans/backend/cuda/memory_kernels.cuh: the neural memory on the GPU (math §1-5), float and
// double.
//
// The same algorithm as the CPU backend (backend/cpu/memory_kernels.hpp), with every
// (sequence, head) pair p = s * H + h processed at once: the projections are one cuBLAS GEMM
// over the piece; conv, phi, the L2 norm and the gates are kernels of ours; the inputs are
// then laid out pair-major ([p][t][d_h]), so that each chunk segment's products (the keys
// forward and backward through the memory MLP, the lagged read, the dual form of §5, the
// closed-form chunk end of §4) are strided-batched GEMMs over the B*H pairs. The chunk
// coefficients are the shared TITANS_HOST_DEVICE functions of memory/chunk_coefficients.hpp,
// run for each pair by one thread on the pair's row copied into shared memory
// (cuda::pair_local). UpdateMode::PerToken runs as the chunked form with b = 1 (the same
// recurrence, math §4). Every call ends with its stream idle.

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "../../detail/activation.hpp"
#include "../../detail/flat_tensors.hpp"
#include "../../error.hpp"
#include "../../limits.hpp"
#include "../../memory/chunk_coefficients.hpp"
#include "../../memory/config.hpp"
#include "../../memory/diagnostics.hpp"
#include "../../memory/params.hpp"
#include "../../types.hpp"
#include "../../view.hpp"
#include "../backend.hpp"
#include "blas.cuh"
#include "call_scope.cuh"
#include "fast_math.cuh"
#include "launch.cuh"
#include "memory_conv.cuh"
#include "memory_decode.cuh"
#include "memory_device.cuh"
#include "memory_cluster.cuh"
#include "memory_fused.cuh"
#include "memory_state.cuh"
#include "transfer.cuh"
#include "../../memory/kernels_decl.hpp"

namespace titans::backend {

/// The memory's kernels on CUDA. Only forward, read, read_weights, make_state, prepare, the
/// transactions and current_weights / current_momentum are the seam (MemoryBackend); the other
/// members are its pieces (public only because nvcc's device lambdas need a public enclosing
/// function).
template <class T>
struct MemoryKernels<Cuda, T> {
    using State = CudaMemoryState<T>;
    using Mat = Matrix<T>;
    using Buf = cuda::DeviceBuffer<T>;

    /// The context a state's call runs on (call_scope.cuh): its own, or the open CallScope's.
    static const cuda::StreamContext& ctx(const State& st) { return cuda::call_context(*st.ctx_); }

    /// The outer parameters in device memory, laid out for the kernels.
    struct Params {
        /// d x ld_in: [W_Q | W_K | W_V | w_theta | w_eta | w_alpha], the gates' 3H columns only
        /// for data-dependent gates: one product makes a call's projections and gate logits.
        Buf w_in;
        int ld_in = 0;     // 3D + 3H, or 3D (GateMode::Constant)
        int gates_at = 0;  // 3D: the gates' first column
        Buf b_gates;       // 3H
        Buf taps;     // K x 3D: [conv_q | conv_k | conv_v]
        Buf w_o;      // D x d
        Buf init;     // memory_init, head after head, each's layers in order, row-major

        /// W_Q, W_K, W_V (d x 3D, row stride ld_in).
        const T* w_qkv() const { return w_in.data(); }
        /// [w_theta | w_eta | w_alpha] (d x 3H, row stride ld_in).
        const T* w_gates() const { return w_in.data() + gates_at; }
        void set_widths(const MemoryConfig& cfg) {
            gates_at = 3 * cfg.inner_dim();
            ld_in = gates_at + (cfg.gates != GateMode::Constant ? 3 * cfg.n_heads : 0);
        }
    };
    using Prepared = std::shared_ptr<const Params>;

    /// Per-layer pointers a kernel reads (captured by value).
    using Layers = cuda::PendingLayers<T>;

    static Buf upload(const Mat& m) {
        return cuda::upload_array(m.data(), static_cast<std::size_t>(m.size()));
    }
    static Mat concat(std::initializer_list<const Mat*> parts) {
        Eigen::Index cols = 0;
        for (const Mat* m : parts) {
            cols += m->cols();
        }
        Mat out((*parts.begin())->rows(), cols);
        Eigen::Index c = 0;
        for (const Mat* m : parts) {
            out.middleCols(c, m->cols()) = *m;
            c += m->cols();
        }
        return out;
    }

    static Prepared prepare(const MemoryConfig& cfg,
                            const std::shared_ptr<const MemoryParams<T>>& hp) {
        const MemoryParams<T>& p = *hp;
        auto out = std::make_shared<Params>();
        out->w_in = cfg.gates != GateMode::Constant
                        ? upload(concat({&p.w_q, &p.w_k, &p.w_v, &p.w_theta, &p.w_eta, &p.w_alpha}))
                        : upload(concat({&p.w_q, &p.w_k, &p.w_v}));
        out->set_widths(cfg);
        const Mat bt = p.b_theta, be = p.b_eta, ba = p.b_alpha;
        out->b_gates = upload(concat({&bt, &be, &ba}));
        out->taps = upload(concat({&p.conv_q, &p.conv_k, &p.conv_v}));
        out->w_o = upload(p.w_o);
        Mat init(1, head_init_size(cfg) * static_cast<Eigen::Index>(p.memory_init.size()));
        Eigen::Index at = 0;
        for (const auto& head : p.memory_init) {
            for (const Mat& w : head) {
                init.middleCols(at, w.size()) = Eigen::Map<const Mat>(w.data(), 1, w.size());
                at += w.size();
            }
        }
        out->init = upload(init);
        return out;
    }

    /// The parameters from their flat form in device memory (1 x the count, MemoryParams::
    /// tensors order; shapes: host parameters of the same shapes), laid out on the device.
    static Prepared prepare_flat(const MemoryConfig& cfg, const MemoryParams<T>& shapes,
                                 View<const T> flat) {
        const auto slots = detail::tensor_slots(shapes, cfg);
        const auto views = detail::flat_views(flat, shapes, cfg);
        const auto find = [&](const char* name) {
            for (std::size_t i = 0; i < slots.size(); ++i) {
                if (slots[i].name == name) return views[i];
            }
            return View<const T>{};
        };
        const auto row = [](View<const T> v) { return View<const T>{v.data, 1, v.rows * v.cols,
                                                                   v.rows * v.cols}; };
        auto out = std::make_shared<Params>();
        out->w_in = cuda::concat_columns({find("w_q"), find("w_k"), find("w_v"), find("w_theta"),
                                          find("w_eta"), find("w_alpha")});
        out->set_widths(cfg);
        out->b_gates =
            cuda::concat_columns({row(find("b_theta")), row(find("b_eta")), row(find("b_alpha"))});
        out->taps = cuda::concat_columns({find("conv_q"), find("conv_k"), find("conv_v")});
        out->w_o = cuda::concat_columns({find("w_o")});
        const Eigen::Index n = head_init_size(cfg) * cfg.n_heads;  // one run of tensors
        std::size_t first = 0;  // memory_init.0.0
        while (first < slots.size() && slots[first].name.rfind("memory_init", 0) != 0) ++first;
        if (first < slots.size()) {
            out->init = cuda::concat_columns({View<const T>{views[first].data, 1, n, n}});
        }
        return out;
    }

    /// Entries of one head's memory_init (every layer): how far apart Params::init keeps the
    /// heads, and where make_state finds each layer.
    static Eigen::Index head_init_size(const MemoryConfig& cfg) {
        Eigen::Index n = 0;
        for (int l = 1; l <= cfg.depth; ++l) n += Eigen::Index{cfg.layer_in(l)} * cfg.layer_out(l);
        return n;
    }

    /// Every pair p's weights of one layer (size entries each) from head p % H's memory_init
    /// (heads `head_stride` apart in `init`), on the device: a fresh state's memory.
    static void replicate_init(cudaStream_t sm, const T* init, long long head_stride,
                               unsigned size, unsigned H, T* w, long long n) {
        cuda::each(sm, n, [=] __device__(unsigned i) {
            const unsigned p = i / size;
            w[i] = init[static_cast<long long>(p % H) * head_stride + i % size];
        });
        cuda::check_launch("the memory's initial weights");
        cuda::wait_now(sm, "cudaStreamSynchronize (initial weights)");
    }

    static void zero(Buf& b, std::size_t n) {
        b = Buf(n);
        cuda::set_now(b.data(), 0, n * sizeof(T), "cudaMemset");
    }

    static State make_state(const MemoryConfig& cfg, const Prepared& prepared, int batch) {
        State st;
        st.cfg_ = cfg;
        st.batch_ = batch;
        st.chunk_ = cfg.effective_chunk();
        st.position_ = 0;
        st.ctx_.emplace();
        const int H = cfg.n_heads, b = st.chunk_, P = batch * H;
        const long long head_size = head_init_size(cfg);
        long long layer_at = 0;  // layer l's offset in a head's memory_init
        for (int l = 1; l <= cfg.depth; ++l) {
            const std::size_t in = static_cast<std::size_t>(cfg.layer_in(l)),
                              out = static_cast<std::size_t>(cfg.layer_out(l));
            const std::size_t n = static_cast<std::size_t>(P) * in * out;
            st.w_.push_back(Buf(n));
            replicate_init(ctx(st).stream(), prepared->init.data() + layer_at, head_size,
                           static_cast<unsigned>(in * out), static_cast<unsigned>(H),
                           st.w_.back().data(), static_cast<long long>(n));
            layer_at += static_cast<long long>(in * out);
            st.s_.emplace_back();
            zero(st.s_.back(), n);
            st.a_.emplace_back();
            zero(st.a_.back(), static_cast<std::size_t>(P * b) * in);
            st.delta_.emplace_back();
            zero(st.delta_.back(), static_cast<std::size_t>(P * b) * out);
        }
        zero(st.gates_, static_cast<std::size_t>(P * b) * 3);
        const int tail = cfg.use_conv ? cfg.conv_kernel - 1 : 0;
        zero(st.tail_, static_cast<std::size_t>(batch * tail) * 3 * cfg.inner_dim());
        return st;
    }

    // ---------------------------------------------------------------------------------------
    // Transactions (forward opens its own when none is open).
    // ---------------------------------------------------------------------------------------
    static void copy_into(Buf& dst, const Buf& src, cudaStream_t sm) {
        dst.reserve(src.size());
        if (src.size() > 0) {
            cuda::copy_async(dst.data(), src.data(), src.size() * sizeof(T), sm,
                             "cudaMemcpyAsync (state snapshot)");
        }
    }
    static void copy_all(std::vector<Buf>& dst, const std::vector<Buf>& src, cudaStream_t sm) {
        dst.resize(src.size());
        for (std::size_t i = 0; i < src.size(); ++i) {
            copy_into(dst[i], src[i], sm);
        }
    }
    static bool begin(State& st) {
        if (st.undo_.open) {
            return false;
        }
        copy_into(st.undo_.tail, st.tail_, ctx(st).stream());
        cuda::idle(ctx(st));
        st.undo_.position = st.position_;  // opened only once nothing above can throw
        st.undo_.full = false;
        st.undo_.saved_hi = st.pending();
        st.undo_.open = true;
        return true;
    }
    static void commit(State& st) { st.undo_.open = false; }
    static void rollback(State& st) {
        if (!st.undo_.open) {
            return;
        }
        const cudaStream_t sm = ctx(st).stream();
        auto& u = st.undo_;
        const int row0 = static_cast<int>(u.position % st.chunk_);
        if (u.full) {
            for (std::size_t l = 0; l < st.w_.size(); ++l) {
                copy_into(st.w_[l], u.w[l], sm);
                copy_into(st.s_[l], u.s[l], sm);
            }
            pending_rows(st, true, 0, std::max(u.saved_hi, row0));
        } else {
            pending_rows(st, true, row0, u.saved_hi - row0);
        }
        copy_into(st.tail_, u.tail, sm);
        st.position_ = st.undo_.position;
        st.undo_.open = false;
        ctx(st).synchronize();
    }
    /// Before the first chunk end inside a transaction: the memory and the rows pending at
    /// begin [0, row0) are still as they were then (the rows written since were saved by
    /// save_rows before they were). With `in_kernel`, W and S are left to the fused launch
    /// that follows (its chunk 0 copies them as it loads them): returns where (FusedKeep;
    /// at[0] null where nothing is to be copied), and the caller marks the save done
    /// (undo_.full) once the launch is made, so that a launch that throws leaves a rollback
    /// nothing of W and S to restore (they are as they were).
    static cuda::FusedKeep<T> save_full(State& st, bool in_kernel = false) {
        cuda::FusedKeep<T> undo{};
        auto& u = st.undo_;
        if (!u.open || u.full) {
            return undo;
        }
        if (in_kernel) {
            u.w.resize(st.w_.size());
            u.s.resize(st.s_.size());
            for (std::size_t l = 0; l < st.w_.size(); ++l) {  // W1, W2, S1, S2: FusedKeep's order
                u.w[l].reserve(st.w_[l].size());
                u.s[l].reserve(st.s_[l].size());
                undo.at[l] = u.w[l].data();
                undo.at[2 + l] = u.s[l].data();
            }
        } else {
            const cudaStream_t sm = ctx(st).stream();
            copy_all(u.w, st.w_, sm);
            copy_all(u.s, st.s_, sm);
        }
        pending_rows(st, false, 0, static_cast<int>(u.position % st.chunk_));
        u.full = !in_kernel;
        return undo;
    }
    /// Before rows [o, o+m) of the pending arrays (A, Delta, gates) are written: saves those
    /// not saved yet since begin (until the first chunk end saves the rest), so a rollback
    /// gives back every row as it was, the rows past the pending count too (checkpoints
    /// write all b of them). The CPU's MemoryUndo::save_rows.
    static void save_rows(State& st, int o, long long m) {
        auto& u = st.undo_;
        if (!u.open || u.full || o + m <= u.saved_hi) {
            return;
        }
        pending_rows(st, false, u.saved_hi, static_cast<int>(o + m - u.saved_hi));
        u.saved_hi = static_cast<int>(o + m);
    }
    /// Rows [lo, lo+n) of every pair of A_l, Delta_l (each layer) and the gate logits: from the
    /// state into the undo buffers (sized on first use), or back when `restore`.
    static void pending_rows(State& st, bool restore, int lo, int n) {
        if (n <= 0) {
            return;
        }
        auto& u = st.undo_;
        const long long P = static_cast<long long>(st.batch_) * st.cfg_.n_heads;
        const int b = st.chunk_;
        reserve_undo(st);
        CopyStage copies(ctx(st).stream());  // every layer's rows in one launch
        auto one = [&](Buf& live, Buf& saved, long long width) {
            T* dst = restore ? live.data() : saved.data();
            const T* src = restore ? saved.data() : live.data();
            copies.add(dst, src, P, b, b, lo, lo, n, width);
        };
        for (std::size_t l = 0; l < st.a_.size(); ++l) {
            const auto L = static_cast<int>(l) + 1;
            one(st.a_[l], u.a[l], st.cfg_.layer_in(L));
            one(st.delta_[l], u.delta[l], st.cfg_.layer_out(L));
        }
        if (st.gates_.size() > 0) {
            one(st.gates_, u.gates, 3);
        }
        copies.launch();
    }

    /// The undo rows sized as the pending arrays (allocated on first use).
    static void reserve_undo(State& st) {
        auto& u = st.undo_;
        u.a.resize(st.a_.size());
        u.delta.resize(st.delta_.size());
        for (std::size_t l = 0; l < st.a_.size(); ++l) {
            u.a[l].reserve(st.a_[l].size());
            u.delta[l].reserve(st.delta_[l].size());
        }
        u.gates.reserve(st.gates_.size());
    }
    /// Where decode_rows_kernel saves rows [o, o+m) of the pending arrays before it writes
    /// them (save_rows in the same launch), or nowhere: nothing to save, or rows saved already
    /// (then save_rows copies the rest first, as before the key pass).
    static typename cuda::DecodeRows<T>::Pending undo_rows(State& st, int o, long long m) {
        auto& u = st.undo_;
        if (!u.open || u.full || o + m <= u.saved_hi || u.saved_hi != o) {
            save_rows(st, o, m);
            return {};
        }
        reserve_undo(st);
        u.saved_hi = static_cast<int>(o + m);
        return {u.a[0].data(), u.a[1].data(), u.delta[0].data(), u.delta[1].data(),
                st.gates_.size() > 0 ? u.gates.data() : nullptr};
    }

    // ---------------------------------------------------------------------------------------
    // Workspaces and small kernels.
    // ---------------------------------------------------------------------------------------
    static int widest(const MemoryConfig& cfg) {
        int w = cfg.head_dim();
        for (int l = 1; l <= cfg.depth; ++l) {
            w = std::max(w, cfg.layer_out(l));
        }
        return w;
    }

    /// Grows the workspaces for B sequences of N rows with chunk b. The per-pair scratch of
    /// the scan (t1, z) holds at most a chunk's b rows; the hidden activations of a read
    /// (hid) hold `read_rows` per pair: b in the scan, all N in read_through.
    static void reserve(const MemoryConfig& cfg, typename State::Work& w, int B, long long N,
                        int b, long long read_rows) {
        const long long H = cfg.n_heads, D = cfg.inner_dim(), P = B * H, M = B * N;
        const long long R = b, wd = widest(cfg);
        auto sz = [](long long n) { return static_cast<std::size_t>(n); };
        w.u.reserve(sz(M * (3 * D + 3 * H)));
        w.q.reserve(sz(M * D));
        w.k.reserve(sz(M * D));
        w.v.reserve(sz(M * D));
        w.lp.reserve(sz(M * 3 * H));
        w.yp.reserve(sz(M * D));
        w.yh.reserve(sz(M * D));
        w.t1.reserve(sz(P * R * wd));
        w.scores.reserve(sz(P * b * b));
        w.g.reserve(sz(P * b * b));
        w.coef.reserve(sz(P * coef_stride(b)));
        w.scratch.reserve(sz(P * b * wd));
        w.diag.reserve(sz(2 * M * H));
        w.z.resize(static_cast<std::size_t>(cfg.depth));
        w.hid.resize(static_cast<std::size_t>(cfg.depth));
        for (int l = 1; l <= cfg.depth; ++l) {
            w.z[static_cast<std::size_t>(l - 1)].reserve(sz(P * R * cfg.layer_out(l)));
            w.hid[static_cast<std::size_t>(l - 1)].reserve(sz(P * read_rows * cfg.layer_out(l)));
        }
        w.flags.reserve(5);
    }

    /// Which entry a non-finite check reports, as a key whose minimum wins: entry (p, r, c)
    /// (matrix p of P, row r) has key (p / div) * a + r * b. Keys of the forward's checks:
    ///   pair-major rows [s H + h][t][.]  by row:             div H, a N, b 1  -> s N + t
    ///   pair-major rows, by position then pair:               div 1, a 1, b P  -> t P + p
    ///   per pair:                                             div 1, a 1, b 0  -> p
    ///   one sequence-major matrix (B*N rows):                 div 1, a 0, b 1  -> r
    struct FlagKey {
        long long div, a, b;
    };
    /// No entry flagged (cudaMemset with byte 0x7f: larger than every key).
    static constexpr int unflagged = 0x7f7f7f7f;

    /// The non-finite checks of a forward call, launched together at its end
    /// (cuda::flag_rows_kernel): add(x, P, rows, cols, ld, ps, slot, key) queues the rows of
    /// P matrices (rows x cols, row stride ld, pair stride ps), flags[slot] getting the
    /// smallest key of a row with a NaN or an infinity (the slot starts at `unflagged`), or
    /// raising `raise` instead where given (a CallScope's flag: the check deferred);
    /// launch() runs what is queued (a full queue launches by itself).
    class FlagStage {
    public:
        FlagStage(cudaStream_t sm, int* flags, unsigned* raise)
            : sm_(sm), flags_(flags), raise_(raise) {
            sets_.first[0] = 0;
        }
        void add(const T* x, long long P, long long rows, long long cols, long long ld,
                 long long ps, int slot, FlagKey key) {
            if (P * rows * cols == 0) {
                return;
            }
            cuda::flag_check_entries() += P * rows * cols;
            if (sets_.count == cuda::flag_sets_max) {
                launch();
            }
            sets_.set[sets_.count] = cuda::FlagRows<T>{x,  P,   rows,    static_cast<int>(cols),
                                                       ld, ps,  slot,    key.div,
                                                       key.a, key.b};
            sets_.first[sets_.count + 1] =
                sets_.first[sets_.count] + cuda::flag_warps(sets_.set[sets_.count]);
            ++sets_.count;
        }
        void launch() {
            if (sets_.count == 0) {
                return;
            }
            cuda::launch(cuda::flag_rows_kernel<T>, cuda::warp_blocks(sets_.first[sets_.count]),
                         256, sm_, sets_, flags_, unflagged, raise_);
            cuda::check_launch("the non-finite check");
            sets_.count = 0;
        }
        /// Where a kernel that checks what it writes reports (cuda::FlagSink): these slots.
        [[nodiscard]] cuda::FlagSink sink() const { return {flags_, raise_, unflagged}; }

    private:
        cudaStream_t sm_;
        int* flags_;
        unsigned* raise_;
        cuda::FlagSets<T> sets_{};
    };

    /// Row copies queued and run in one launch of copy_rows_kernel (up to row_copies_max,
    /// whose destinations are distinct and none of them another's source): add() takes
    /// copy_rows' arguments, launch() runs what is queued (add launches when full, or when
    /// the entries would pass 2^32 - 1).
    class CopyStage {
    public:
        explicit CopyStage(cudaStream_t sm) : sm_(sm) { c_.first[0] = 0; }
        CopyStage(const CopyStage&) = delete;
        CopyStage& operator=(const CopyStage&) = delete;
        void add(T* dst, const T* src, long long P, int b, long long N, long long t, int o,
                 long long m, long long width) {
            const long long run = m * width, n = P * run;
            if (n == 0) {
                return;
            }
            constexpr long long most = std::numeric_limits<unsigned>::max();
            if (c_.count == cuda::row_copies_max || c_.first[c_.count] + n > most) {
                launch();
            }
            if (n > most) {  // alone past 32-bit indices: copy_rows splits nothing either
                copy_rows(sm_, dst, src, P, b, N, t, o, m, width);
                return;
            }
            c_.set[c_.count] = cuda::RowCopy<T>{dst + o * width, src + t * width,
                                                static_cast<unsigned>(run), b * width,
                                                N * width};
            c_.first[c_.count + 1] = c_.first[c_.count] + static_cast<unsigned>(n);
            ++c_.count;
        }
        void launch() {
            if (c_.count == 0) {
                return;
            }
            const long long total = c_.first[c_.count];
            const long long blocks = std::min<long long>((total + 255) / 256, 1LL << 16);
            cuda::launch(cuda::copy_rows_kernel<T>, static_cast<unsigned>(blocks), 256, sm_, c_);
            c_.count = 0;
            cuda::check_launch("the row copies");
        }

    private:
        cudaStream_t sm_;
        cuda::RowCopies<T> c_{};
    };

    static Layers layers(const MemoryConfig& cfg, const std::vector<Buf>& a,
                         const std::vector<Buf>& d) {
        Layers ly{};
        ly.depth = cfg.depth;
        for (int l = 0; l < cfg.depth; ++l) {
            const auto li = static_cast<std::size_t>(l);
            ly.a[l] = a[li].data();
            ly.d[l] = d[li].data();
            ly.in[l] = cfg.layer_in(l + 1);
            ly.out[l] = cfg.layer_out(l + 1);
        }
        return ly;
    }

    // ---------------------------------------------------------------------------------------
    // math §1: projections.
    // ---------------------------------------------------------------------------------------
    /// x (M x d, M = B*N) into the pair-major q (and k, v, gate logits unless queries_only):
    /// one GEMM (x [W_Q | W_K | W_V | gates], Params::w_in), then one kernel for the conv
    /// continuing `tail` (when given; advanced when `advance`), phi and the gate logits' bias and
    /// layout; the L2 norm unless `norm_later` (the decode kernel normalises the rows it reads),
    /// in the conv kernel where its blocks cover whole heads (cuda::conv_norms), else after it.
    /// With `later` given (a call decoded whole: norm_later too), the conv kernel's arguments go
    /// there instead of into a launch: the decode kernel's first launch runs them. With `sink`
    /// on, the launched kernels check what they write (cuda::ConvTile, l2_rows_kernel); returns
    /// whether they checked all of q, k, v and the gate logits (else none of it is known).
    static bool project(const MemoryConfig& cfg, const Params& p, const cuda::StreamContext& cx,
                        typename State::Work& w, View<const T> x, int B, long long N, bool conv,
                        T* tail, bool advance, bool queries_only, bool norm_later = false,
                        cuda::ConvTile<T>* later = nullptr, cuda::FlagSink sink = {}) {
        const cudaStream_t sm = cx.stream();
        const long long M = x.rows, H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim();
        const long long C = queries_only ? D : 3 * D, C3 = 3 * D;
        const long long G = queries_only ? 0 : p.ld_in - p.gates_at, ld = C + G;
        const int d = cfg.d_model, K = cfg.conv_kernel;
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(M), static_cast<int>(ld), d, T(1),
                      {x.data, static_cast<int>(x.stride)}, {p.w_in.data(), p.ld_in}, T(0),
                      w.u.data(), static_cast<int>(ld), 0, 1);
        constexpr int rows = cuda::conv_rows, threads = cuda::conv_threads;
        const long long tiles = (N + rows - 1) / rows;
        // With one tile a sequence (N <= 32: decode) the thread of each column walks the whole
        // sequence, so it advances the tail itself: one launch fewer.
        const bool advancing = conv && advance && K > 1,
                   in_conv = advancing && tiles == 1 && C == C3;
        // the L2 norm's kernel checks q and k where it runs here, else the conv kernel; the conv
        // kernel normalises them itself where its blocks cover whole heads
        const bool norm_here = cfg.normalize_qk && !norm_later;
        bool norm_done = !norm_here;
        bool checked = M > 0 && sink.on();
        if (M > 0) {
            const cuda::ConvTile<T> a{w.u.data(), ld,   p.taps.data(), tail, w.q.data(), w.k.data(),
                                      w.v.data(), N,    static_cast<int>(C), static_cast<int>(C3),
                                      K,          static_cast<int>(D), static_cast<int>(dh),
                                      static_cast<int>(H), conv, cfg.qkv_activation == Activation::SiLU,
                                      rows,       tiles, in_conv, p.b_gates.data(), w.lp.data(),
                                      static_cast<int>(G), {}, false, false};
            const dim3 grid(static_cast<unsigned>(B * tiles),
                            static_cast<unsigned>(std::min<long long>((ld + threads - 1) / threads,
                                                                      65535)));
            if (later != nullptr && tiles == 1 && (!advancing || in_conv)) {
                *later = a;  // one tile a sequence: the whole column in one thread's walk
                checked = false;
            } else {
                cuda::ConvTile<T> c = a;
                c.sink = sink;
                c.check_qk = !norm_here;
                c.norm = norm_here && cuda::conv_norms(dh);
                norm_done = norm_done || c.norm;
                const auto kernel = cuda::conv_compiled_k(conv, K) == 4
                                        ? cuda::conv_tile_kernel<T, 4>
                                        : cuda::conv_tile_kernel<T, 0>;
                cuda::launch_shared(kernel, grid, threads,
                                    c.norm ? cuda::conv_norm_shared<T>() : 0, sm, c);
                cuda::check_launch("the conv kernel");  // *later stays empty: ran here
            }
        }
        if (advancing && !(M > 0 && in_conv)) {
            advance_tail(sm, w.u.data(), ld, tail, B, N, K, C3);
        }
        const long long norm_rows = B * H * N;
        if (!norm_done && norm_rows > 0) {
            cuda::launch(cuda::l2_rows_kernel<T>,
                         cuda::warp_blocks(queries_only ? norm_rows : 2 * norm_rows), 256, sm,
                         w.q.data(), queries_only ? nullptr : w.k.data(), norm_rows,
                         static_cast<int>(dh), sink, N, static_cast<int>(H));
            cuda::check_launch("the L2 norm kernel");
        }
        return checked && !queries_only;
    }

    /// The conv tails: the last K-1 pre-conv rows of [tail; u] per sequence (u's rows ld apart).
    static void advance_tail(cudaStream_t sm, const T* u, long long ld, T* tail, int B,
                             long long N, int K, long long C3) {
        cuda::each(sm, static_cast<long long>(B) * C3, [=] __device__(unsigned i) {
            const long long s = i / cuda::u32(C3), c = i % cuda::u32(C3);
            for (int r = 0; r < K - 1; ++r) {  // ascending: row r reads row r + N > r
                const long long tt = N - (K - 1) + r;
                tail[(s * (K - 1) + r) * C3 + c] =
                    tt >= 0 ? u[(s * N + tt) * ld + c] : tail[(s * (K - 1) + tt + K - 1) * C3 + c];
            }
        });
    }

    // ---------------------------------------------------------------------------------------
    // math §2: the memory MLP, batched over pairs.
    // ---------------------------------------------------------------------------------------
    /// In place over P matrices of rows x cols (row stride cols, pair stride ps): act(z), and
    /// when `grad` is given, grad <- act'(z) (same layout).
    static void activate(cudaStream_t sm, Activation act, T* z, T* into, long long into_ps,
                         T* grad, long long P, long long rows, long long cols, long long ps) {
        cuda::each(sm, P * rows * cols, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(rows * cols), rc = i % cuda::u32(rows * cols);
            const T zz = z[p * ps + rc];
            if (grad != nullptr) {
                grad[p * ps + rc] = cuda::kernel_activate_grad(act, zz);
            }
            into[p * into_ps + rc] = cuda::kernel_activate(act, zz);
        });
    }

    /// y = M_W(q) for m rows of each pair (math §2): q rows at q + p*qs (ld d_h), W[l] pair
    /// stride in*out, workspaces hid (rows >= m), y rows at y + p*ys (ld d_h).
    static void mlp_read(const MemoryConfig& cfg, const cuda::StreamContext& cx,
                         const std::vector<const T*>& W, const T* q, long long qs, long long m,
                         std::vector<Buf>& hid, long long hid_rows, T* y, long long ys, int P) {
        const int L = cfg.depth, dh = cfg.head_dim();
        for (int l = 0; l < L; ++l) {
            const int in = cfg.layer_in(l + 1), out = cfg.layer_out(l + 1);
            const T* hin = l == 0 ? q : hid[static_cast<std::size_t>(l - 1)].data();
            const long long hs = l == 0 ? qs : hid_rows * in;
            const bool last = l + 1 == L;
            T* o = last ? y : hid[static_cast<std::size_t>(l)].data();
            const long long os = last ? ys : hid_rows * out;
            cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(m), out, in, T(1),
                          {hin, in, hs}, {W[static_cast<std::size_t>(l)], out,
                                          static_cast<long long>(in) * out},
                          T(0), o, out, os, P);
            if (!last) {
                activate(cx.stream(), cfg.activation, o, o, os, nullptr, P, m, out, os);
            }
        }
        if (cfg.residual) {
            add_rows(cx.stream(), y, ys, q, qs, P, m, dh);
        }
    }

    // ---------------------------------------------------------------------------------------
    // math §1 gates, §10 clipping, §4-5 chunk coefficients. coef holds per pair, CS apart:
    // rows theta, eta, alpha, beta_i, c_i, g_k, s_k (b each), then beta_end, c_end, p_end.
    // ---------------------------------------------------------------------------------------
    static long long coef_stride(int b) { return 7LL * b + 3; }

    /// theta, eta, alpha of pending rows [0, n) (clipped, math §10) into coef.
    static void gate_values(const MemoryConfig& cfg, cudaStream_t sm, const Layers& ly,
                            const T* gates, T* coef, long long P, int b, int n) {
        if (P * n == 0) {
            return;
        }
        cuda::launch(cuda::gate_values_kernel<T>, cuda::warp_blocks(P * n), 256, sm,
                     cuda::GateParams<T>::of(cfg), ly, gates, coef, P, b, n, coef_stride(b));
        cuda::check_launch("the gate kernel");
    }

    /// Dual-form row coefficients (math §5) for rows [row0, n): beta, c and G (m x n, ld n).
    static void row_coefficients(cudaStream_t sm, T* coef, T* G, long long P, int b, int n,
                                 int row0) {
        const long long CS = coef_stride(b);
        // beta and c on one thread, G's columns on all of them (independent recurrences)
        cuda::pair_local<true>(sm, coef, P, CS, CS,
                               [=] __device__(unsigned p, T* cf, T*, unsigned t, unsigned nt) {
                                   if (t == 0) {
                                       chunk_row_prefix<T>(n, row0, cf + b, cf + 2 * b,
                                                           cf + 3 * b, cf + 4 * b);
                                   }
                                   for (int k = static_cast<int>(t); k < n;
                                        k += static_cast<int>(nt)) {
                                       chunk_row_column<T>(n, row0, k, cf, cf + b, cf + 2 * b,
                                                           G + p * b * b);
                                   }
                               });
    }

    /// Chunk-end coefficients (math §4) over n rows: g, s and beta_end, c_end, p_end.
    static void end_coefficients(cudaStream_t sm, T* coef, long long P, int b, int n) {
        const long long CS = coef_stride(b);
        cuda::pair_local(sm, coef, P, CS, CS, [=] __device__(unsigned, T* cf, T*) {
            chunk_end_coefficients<T>(n, cf, cf + b, cf + 2 * b, cf + 5 * b, cf + 6 * b,
                                      cf + 7 * b, cf + 7 * b + 1, cf + 7 * b + 2);
        });
    }

    /// math §4 chunk end over n pending rows, in place on W, S (per layer, pairs contiguous):
    /// W <- beta_n W + c_n S - A^T diag(g) Delta,  S <- P_n S - A^T diag(s) Delta.
    static void chunk_end(const MemoryConfig& cfg, const cuda::StreamContext& cx,
                          typename State::Work& w, const Layers& ly, const T* gates,
                          const std::vector<T*>& W, const std::vector<T*>& S, long long P, int b,
                          int n) {
        const cudaStream_t sm = cx.stream();
        T* coef = w.coef.data();
        gate_values(cfg, sm, ly, gates, coef, P, b, n);
        end_coefficients(sm, coef, P, b, n);
        const long long CS = coef_stride(b), wd = widest(cfg);
        T* sd = w.scratch.data();
        for (int l = 0; l < cfg.depth; ++l) {
            const long long in = ly.in[l], out = ly.out[l], io = in * out;
            T* wl = W[static_cast<std::size_t>(l)];
            T* sl = S[static_cast<std::size_t>(l)];
            scale_rows(sm, coef, 5, ly.d[l], sd, P, b, n, out, wd);
            cuda::each(sm, P * io, [=] __device__(unsigned i) {
                const T* cf = coef + (i / cuda::u32(io)) * CS + 7 * b;
                wl[i] = wl[i] * cf[0] + cf[1] * sl[i];
            });
            minus_at_sd(cx, ly.a[l], sd, wl, P, b, n, in, out, wd);
            scale_rows(sm, coef, 6, ly.d[l], sd, P, b, n, out, wd);
            cuda::each(sm, P * io, [=] __device__(unsigned i) {
                sl[i] *= coef[(i / cuda::u32(io)) * CS + 7 * b + 2];
            });
            minus_at_sd(cx, ly.a[l], sd, sl, P, b, n, in, out, wd);
        }
    }

    /// sd = diag(coef row `row`) Delta over n rows (sd pair stride b * wd, ld out).
    static void scale_rows(cudaStream_t sm, const T* coef, long long row, const T* dl, T* sd,
                           long long P, int b, int n, long long out, long long wd) {
        const long long CS = coef_stride(b);
        cuda::each(sm, P * n * out, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(n * out), r = (i / cuda::u32(out)) % cuda::u32(n), c = i % cuda::u32(out);
            sd[p * b * wd + r * out + c] = coef[p * CS + row * b + r] * dl[(p * b + r) * out + c];
        });
    }

    /// target -= A^T sd per pair (A: n x in pending rows, sd: n x out, target: in x out).
    static void minus_at_sd(const cuda::StreamContext& cx, const T* a, const T* sd, T* target,
                            long long P, int b, int n, long long in, long long out, long long wd) {
        cuda::gemm<T>(cx.blas(), true, false, static_cast<int>(in), static_cast<int>(out), n,
                      T(-1), {a, static_cast<int>(in), b * in}, {sd, static_cast<int>(out), b * wd},
                      T(1), target, static_cast<int>(out), in * out, static_cast<int>(P));
    }

    // ---------------------------------------------------------------------------------------
    // math §4-5: one chunk segment of the scan, all pairs at once.
    // ---------------------------------------------------------------------------------------
    /// Rows [t, t+m) of the pair-major src (N rows, `width` wide) to rows [o, o+m) of dst
    /// (b rows), per pair. A kernel, not cudaMemcpy2D: a piece's pitch N width may pass the
    /// device's largest copy pitch (cudaDevAttrMaxPitch).
    static void copy_rows(cudaStream_t sm, T* dst, const T* src, long long P, int b, long long N,
                          long long t, int o, long long m, long long width) {
        const long long run = m * width, ds = b * width, ss = N * width;
        T* d0 = dst + o * width;
        const T* s0 = src + t * width;
        cuda::each(sm, P * run, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(run), rc = i % cuda::u32(run);
            d0[p * ds + rc] = s0[p * ss + rc];
        });
    }

    /// Keys of tokens [t, t+m) forward through W^s and backward through the loss (math §2)
    /// into pending rows [o, o+m): A_l, Delta_L = M(k) - v, Delta_l = (Delta_{l+1} W^T) . act'.
    /// The keys are already in A_0's rows (scan copies them there with the gate logits).
    static void key_pass(const MemoryConfig& cfg, State& st, long long N, long long t, int o,
                         long long m) {
        const cuda::StreamContext& cx = ctx(st);
        const cudaStream_t sm = cx.stream();
        auto& w = *st.work_;
        const int L = cfg.depth, b = st.chunk_;
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads;
        for (int l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            const int in = cfg.layer_in(l + 1), out = cfg.layer_out(l + 1);
            T* z = w.z[li].data();
            cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(m), out, in, T(1),
                          {st.a_[li].data() + o * in, in, static_cast<long long>(b) * in},
                          {st.w_[li].data(), out, static_cast<long long>(in) * out}, T(0), z, out,
                          static_cast<long long>(b) * out, static_cast<int>(P));
            if (l + 1 < L) {
                activate(sm, cfg.activation, z, st.a_[li + 1].data() + o * out,
                         static_cast<long long>(b) * out, z, P, m, out,
                         static_cast<long long>(b) * out);
            }
        }
        output_error(cfg, st, N, t, o, m);
        for (int l = L - 1; l >= 1; --l) {
            const auto li = static_cast<std::size_t>(l);
            const int in = cfg.layer_in(l + 1), out = cfg.layer_out(l + 1);
            T* dl = st.delta_[li - 1].data() + o * in;
            cuda::gemm<T>(cx.blas(), false, true, static_cast<int>(m), in, out, T(1),
                          {st.delta_[li].data() + o * out, out, static_cast<long long>(b) * out},
                          {st.w_[li].data(), out, static_cast<long long>(in) * out}, T(0), dl, in,
                          static_cast<long long>(b) * in, static_cast<int>(P));
            const T* zg = w.z[li - 1].data();
            const long long bi = static_cast<long long>(b) * in, row = in;
            cuda::each(sm, P * m * in, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * row), rc = i % cuda::u32(m * row);
                dl[p * bi + rc] *= zg[p * bi + rc];
            });
        }
    }

    /// The most rows a segment may have for decode_rows (a block per pair walks them).
    static constexpr long long decode_rows_max = 4;
    static constexpr int decode_threads = cuda::decode_most_threads<T>;

    /// How a call's short segments run: in decode_rows_kernel (`kernel`); whether that kernel
    /// runs every segment of the call (`whole`: at most decode_rows_max rows a sequence, fewer
    /// than a fused chunk's), and then also the conv, phi and the gate logits' layout of the
    /// call's rows (in its first launch) and, with cfg.normalize_qk, the L2 norm of q and k
    /// (`norm`); project then leaves them. Decided once a call.
    struct DecodePlan {
        bool kernel = false;
        bool whole = false;
        bool norm = false;
    };
    static DecodePlan decode_plan(const MemoryConfig& cfg, long long N) {
        const bool kernel = decode_applies(cfg), whole = kernel && N <= decode_rows_max;
        return {kernel, whole, whole && cfg.normalize_qk};
    }

    /// Whether decode_rows_kernel takes a memory's segments of at most decode_rows_max rows:
    /// depth 2, lagged retrieval, its shared memory within 48 KB, cuda::fused_memory() not Off.
    static bool decode_applies(const MemoryConfig& cfg) {
        const std::size_t shared =
            cuda::decode_shared_bytes<T>(cfg.head_dim(), cfg.layer_out(1), decode_threads);
        return cfg.depth == 2 && cfg.retrieval == Retrieval::Lagged && shared <= 48 * 1024 &&
               cuda::fused_memory() != cuda::FusedMemory::Off;
    }
    /// The lagged read and the key pass of tokens [t, t+m) (pending rows [o, o+m)), with the
    /// keys and the gate logits copied into their pending rows and, when `norm`, the L2 norm of
    /// q and k, in one launch of decode_rows_kernel (memory_decode.cuh), where it applies
    /// (`plan.kernel`: decode_applies at the call's start; m <= decode_rows_max). Returns
    /// whether it ran (else the caller saves and copies the rows and key_pass and mlp_read run);
    /// the rows it overwrites are saved for a rollback in the same launch (undo_rows). With
    /// conv.u given, the launch first runs the conv kernel's work for its pair's columns.
    static bool decode_rows(const MemoryConfig& cfg, State& st, long long N, long long t, int o,
                            long long m, DecodePlan plan, const cuda::ConvTile<T>& conv) {
        if (m > decode_rows_max || !plan.kernel) {
            return false;
        }
        const int dh = cfg.head_dim(), h = cfg.layer_out(1);
        auto& w = *st.work_;
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads;
        const bool gated = cfg.gates != GateMode::Constant;
        const typename cuda::DecodeRows<T>::Pending live{
            st.a_[0].data(), st.a_[1].data(), st.delta_[0].data(), st.delta_[1].data(),
            gated ? st.gates_.data() : nullptr};
        const cuda::DecodeRows<T> d{w.q.data() + t * dh, w.k.data() + t * dh,
                                    w.v.data() + t * dh, w.yp.data() + t * dh,
                                    N * dh,              st.w_[0].data(),
                                    st.w_[1].data(),     live,
                                    undo_rows(st, o, m), w.lp.data() + t * 3,
                                    N * 3,               st.chunk_,
                                    o,                   static_cast<int>(m),
                                    dh,                  h,
                                    cfg.activation,      cfg.residual,
                                    plan.norm,           cuda::deferred_flag(),
                                    conv};
        const int threads = cuda::decode_block_threads<T>(P), ranks = cuda::decode_cluster_ranks(P);
        if (ranks > 1) {  // a cluster of blocks a pair, each on h / ranks hidden columns
            cuda::DecodeRows<T> dc = d;
            dc.ranks = ranks;
            cuda::launch_cluster(cuda::decode_cluster_kernel<T>,
                                 dim3(static_cast<unsigned>(P * ranks)), dim3(threads),
                                 cuda::decode_shared_bytes<T>(dh, h, threads, ranks),
                                 dim3(static_cast<unsigned>(ranks)), ctx(st).stream(), dc);
        } else {
            cuda::launch_shared(cuda::decode_rows_kernel<T>, static_cast<unsigned>(P), threads,
                                cuda::decode_shared_bytes<T>(dh, h, threads), ctx(st).stream(), d);
        }
        cuda::check_launch("the decode kernel");
        return true;
    }

    /// Delta_L rows [o, o+m) = M(k) - v (+ k when residual), from the last layer's z.
    static void output_error(const MemoryConfig& cfg, State& st, long long N, long long t, int o,
                             long long m) {
        const int L = cfg.depth, b = st.chunk_;
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads, dh = cfg.head_dim();
        const T* z = st.work_->z[static_cast<std::size_t>(L - 1)].data();
        const T* k = st.work_->k.data();
        const T* v = st.work_->v.data();
        T* dL = st.delta_[static_cast<std::size_t>(L - 1)].data();
        const bool residual = cfg.residual;
        cuda::each(ctx(st).stream(), P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), r = (i / cuda::u32(dh)) % cuda::u32(m), c = i % cuda::u32(dh);
            const long long in_row = (p * N + t + r) * dh + c;
            T e = z[(p * b + r) * dh + c] - v[in_row];
            if (residual) {
                e += k[in_row];
            }
            dL[(p * b + o + r) * dh + c] = e;
        });
    }

    /// Diagnostics of tokens [t, t+m): the loss 1/2 ||Delta_L||^2 and the gradient norm,
    /// into work.diag (loss then grad_norm, each [p][N]).
    static void surprise(const MemoryConfig& cfg, State& st, long long N, long long t, int o,
                         long long m) {
        const Layers ly = layers(cfg, st.a_, st.delta_);
        const int b = st.chunk_;
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads;
        T* out = st.work_->diag.data();
        cuda::each(ctx(st).stream(), P * m, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m), r = o + i % cuda::u32(m);
            T g2 = T(0), loss = T(0);
            for (int l = 0; l < ly.depth; ++l) {
                T sa = T(0), sd = T(0);
                for (int c = 0; c < ly.in[l]; ++c) {
                    sa += ly.a[l][(p * b + r) * ly.in[l] + c] * ly.a[l][(p * b + r) * ly.in[l] + c];
                }
                for (int c = 0; c < ly.out[l]; ++c) {
                    sd += ly.d[l][(p * b + r) * ly.out[l] + c] * ly.d[l][(p * b + r) * ly.out[l] + c];
                }
                g2 += sa * sd;
                loss = sd;
            }
            out[p * N + t + i % cuda::u32(m)] = T(0.5) * loss;
            out[P * N + p * N + t + i % cuda::u32(m)] =
                g2 <= detail::largest_finite<T>()
                    ? sqrt(g2)
                    : detail::scaled_grad_norm<T>(ly.depth, [&](int l) {
                          return detail::GradRows<T>{ly.a[l] + (p * b + r) * ly.in[l], ly.in[l],
                                                     ly.d[l] + (p * b + r) * ly.out[l],
                                                     ly.out[l]};
                      }).value();
        });
    }

    /// math §5 dual form for query rows [o, o+m) of the chunk prefix n = o + m, into the
    /// pair-major output rows [t, t+m):
    /// Z_l = diag(beta) H W^s + diag(c) H S^s - (G . (H A_{l-1}^T)) Delta_l, H_l = act(Z_l).
    static void read_in_chunk(const MemoryConfig& cfg, State& st, long long N, long long t, int o,
                              long long m) {
        const cuda::StreamContext& cx = ctx(st);
        const cudaStream_t sm = cx.stream();
        auto& w = *st.work_;
        const int L = cfg.depth, b = st.chunk_, n = o + static_cast<int>(m);
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads, dh = cfg.head_dim();
        const long long CS = coef_stride(b), wd = widest(cfg), bb = static_cast<long long>(b) * b;
        gate_values(cfg, sm, layers(cfg, st.a_, st.delta_), st.gates_.data(), w.coef.data(), P, b, n);
        row_coefficients(sm, w.coef.data(), w.g.data(), P, b, n, o);
        const T* q = w.q.data() + t * dh;
        for (int l = 0; l < L; ++l) {
            const auto li = static_cast<std::size_t>(l);
            const int in = cfg.layer_in(l + 1), out = cfg.layer_out(l + 1);
            const bool last = l + 1 == L;
            const T* hin = l == 0 ? q : w.hid[li - 1].data();
            const long long hs = l == 0 ? N * dh : static_cast<long long>(b) * in;
            T* z = last ? w.yp.data() + t * dh : w.hid[li].data();
            const long long zs = last ? N * dh : static_cast<long long>(b) * out;
            const cuda::Operand<T> H{hin, in, hs};
            const auto io = static_cast<long long>(in) * out;
            cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(m), out, in, T(1), H,
                          {st.w_[li].data(), out, io}, T(0), z, out, zs, static_cast<int>(P));
            T* t1 = w.t1.data();
            cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(m), out, in, T(1), H,
                          {st.s_[li].data(), out, io}, T(0), t1, out, b * wd, static_cast<int>(P));
            const T* coef = w.coef.data();
            cuda::each(sm, P * m * out, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * out), r = (i / cuda::u32(out)) % cuda::u32(m), rc = i % cuda::u32(m * out);
                z[p * zs + rc] = coef[p * CS + 3 * b + r] * z[p * zs + rc] +
                                 coef[p * CS + 4 * b + r] * t1[p * b * wd + rc];
            });
            T* sc = w.scores.data();
            cuda::gemm<T>(cx.blas(), false, true, static_cast<int>(m), n, in, T(1), H,
                          {st.a_[li].data(), in, static_cast<long long>(b) * in}, T(0), sc, n, bb,
                          static_cast<int>(P));
            const T* G = w.g.data();
            cuda::each(sm, P * m * n, [=] __device__(unsigned i) {
                const long long p = i / cuda::u32(m * n), rc = i % cuda::u32(m * n);
                sc[p * bb + rc] *= G[p * bb + rc];
            });
            cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(m), out, n, T(-1),
                          {sc, n, bb}, {st.delta_[li].data(), out, static_cast<long long>(b) * out},
                          T(1), z, out, zs, static_cast<int>(P));
            if (!last) {
                activate(sm, cfg.activation, z, z, zs, nullptr, P, m, out, zs);
            }
        }
        if (cfg.residual) {
            add_rows(sm, w.yp.data() + t * dh, N * dh, q, N * dh, P, m, dh);
        }
    }

    /// y += q over m rows of each pair (both ld dh; pair strides ys, qs).
    static void add_rows(cudaStream_t sm, T* y, long long ys, const T* q, long long qs,
                         long long P, long long m, long long dh) {
        cuda::each(sm, P * m * dh, [=] __device__(unsigned i) {
            const long long p = i / cuda::u32(m * dh), rc = i % cuda::u32(m * dh);
            y[p * ys + rc] += q[p * qs + rc];
        });
    }

    /// A training forward's chunk-start memory (memory_training.cuh): W1, W2, S1, S2 (each P
    /// pairs, the state's layout) for each full chunk of a piece, in order; the fused launches
    /// of forward_piece copy each chunk's into them (FusedKeep) and count it in kept.
    struct KeepChunks {
        std::vector<T*> at;  // 4 a chunk
        long long kept = 0;
        /// The next `chunks` chunks' pointers into a launch's arguments.
        void into(cuda::FusedKeep<T>& k, int chunks) {
            if (chunks > cuda::fused_keep_chunks ||
                static_cast<long long>(at.size()) < 4 * (kept + chunks)) {
                throw Error("MemoryTraining::forward: a fused launch past the trace's chunks "
                            "(an internal error)");
            }
            for (int i = 0; i < 4 * chunks; ++i) {
                k.at[i] = at[static_cast<std::size_t>(4 * kept + i)];
            }
            kept += chunks;
        }
    };
    /// What scan did: whether a chunk ended inside the piece, whether every segment ran in the
    /// decode kernel (which, inside a deferring scope, checked its rows itself), whether the
    /// fused kernel checked the last chunk end's W and S, how many of the piece's rows it read
    /// (and checked), and whether it wrote all of them into w.yh (sequence-major) directly.
    struct Scanned {
        bool ended = false;
        bool decoded = true;
        bool state_checked = false;
        long long fused_rows = 0;
        bool sequence_major = false;
    };
    /// math §3-5 over the piece: chunk segments at absolute positions, all pairs at once
    /// (`decode`: the call's decode_plan); the fused launches check what they write into
    /// `sink` (FusedArgs::sink).
    static Scanned scan(const MemoryConfig& cfg, State& st, long long N, bool want_diag,
                        DecodePlan decode, cuda::FlagSink sink, cuda::ConvTile<T> conv = {},
                        KeepChunks* keep = nullptr) {
        const int b = st.chunk_;
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads, dh = cfg.head_dim();
        const cudaStream_t sm = ctx(st).stream();
        auto& w = *st.work_;
        // The state's buffers do not move during a call: their pointers once, not per segment.
        const std::vector<T*> W = pointers(st.w_), S = pointers(st.s_);
        const std::vector<const T*> Wc = as_const(W);
        const Layers pending = layers(cfg, st.a_, st.delta_);
        const FusedPlan fused = fused_plan(cfg, st, want_diag);
        Scanned done;
        // Whole chunks from a chunk start: every row in the fused kernel, which then writes its
        // reads in the output product's layout (no transposition: output()).
        const bool direct = fused.use && st.position_ % b == 0 && N % b == 0;
        long long t = 0;
        while (t < N) {
            const int o = static_cast<int>((st.position_ + t) % b);
            if (fused.use && o == 0 && N - t >= b) {
                const int most = keep != nullptr ? cuda::fused_keep_chunks : 1 << 20;
                const int chunks = static_cast<int>(std::min<long long>((N - t) / b, most));
                save_rows(st, 0, b);
                FusedExtras x{sink, false, direct, save_full(st, keep == nullptr)};
                // no chunk end after this launch: it checks the call's W and S
                const bool last = N - (t + static_cast<long long>(chunks) * b) < b;
                x.check_state = last;
                fused_chunks(cfg, st, N, t, chunks, fused, x, keep);
                st.undo_.full = st.undo_.full || x.undo.at[0] != nullptr;  // (save_full)
                if (cfg.gates != GateMode::Constant) {
                    copy_rows(sm, st.gates_.data(), w.lp.data(), P, b, N,
                              t + static_cast<long long>(chunks - 1) * b, 0, b, 3);
                }
                done = {true, false, last, done.fused_rows + static_cast<long long>(chunks) * b,
                        direct};
                t += static_cast<long long>(chunks) * b;
                continue;
            }
            const long long m = std::min<long long>(b - o, N - t);
            // the read, the keys and their pending rows at once (saved for a rollback first)
            const bool decoded = decode_rows(cfg, st, N, t, o, m, decode, conv);
            conv.u = nullptr;  // the first launch ran the conv of every row
            done.decoded = done.decoded && decoded;
            if (!decoded) {
                save_rows(st, o, m);
                CopyStage rows(sm);  // the keys (A_0) and the gate logits into the pending rows
                rows.add(st.a_[0].data(), w.k.data(), P, b, N, t, o, m, dh);
                if (cfg.gates != GateMode::Constant) {
                    rows.add(st.gates_.data(), w.lp.data(), P, b, N, t, o, m, 3);
                }
                rows.launch();
                key_pass(cfg, st, N, t, o, m);
            }
            if (want_diag) {
                surprise(cfg, st, N, t, o, m);
            }
            if (!decoded && cfg.retrieval == Retrieval::Lagged) {
                mlp_read(cfg, ctx(st), Wc, w.q.data() + t * dh, N * dh, m, w.hid, b,
                         w.yp.data() + t * dh, N * dh, static_cast<int>(P));
            } else if (!decoded) {
                read_in_chunk(cfg, st, N, t, o, m);
            }
            if (o + m == b) {
                save_full(st);
                chunk_end(cfg, ctx(st), w, pending, st.gates_.data(), W, S, P, b, b);
                done.ended = true;
                done.state_checked = false;
            }
            t += m;
        }
        return done;
    }

    /// Whether this call's full chunks run in the fused kernel (memory_fused.cuh), and on the
    /// tensor cores: a depth-2 memory with lagged retrieval, no diagnostics, chunk, d_h and
    /// hidden width multiples of 32 (FusedLayout::tiles), the kernel's shared memory within the
    /// device's limit;
    /// cuda::fused_memory() decides the rest. `ranks`: the cluster kernel's blocks a pair
    /// (memory_cluster.cuh; cluster_ranks), 0 for fused_chunks_kernel.
    struct FusedPlan {
        bool use = false;
        cuda::Operands operands = cuda::Operands::Exact;
        int ranks = 0;
    };
    /// The cluster kernel's ranks for chunk b (cuda::fused_cluster(): 0 none; -1 the fewest
    /// of 2, 4, 8 that cover the shape with shared memory within the device's limit; else
    /// that many where they do), 0 where none does.
    static int cluster_ranks(const MemoryConfig& cfg, int b) {
        const int want = cuda::fused_cluster();
        for (int r : {2, 4, 8}) {
            if (want == 0 || (want > 0 && r != want) ||
                !cuda::ClusterLayout::covers(b, cfg.head_dim(), cfg.layer_out(1), r)) {
                continue;
            }
            const auto cl = cuda::ClusterLayout::of(b, cfg.head_dim(), cfg.layer_out(1), r);
            if (static_cast<std::size_t>(cl.entries()) * sizeof(T) <= cuda::shared_memory_limit()) {
                return r;
            }
        }
        return 0;
    }
    static FusedPlan fused_plan(const MemoryConfig& cfg, const State& st, bool want_diag) {
        const cuda::FusedMemory mode = cuda::fused_memory();
        cuda::Operands ops = cuda::Operands::Exact;
        if constexpr (std::is_same_v<T, float>) {
            ops = cuda::fused_operands() == cuda::FusedOperands::BF16 ? cuda::Operands::BF16
                  : ctx(st).tf32()                                     ? cuda::Operands::TF32
                                                                       : cuda::Operands::Exact;
        }
        if (mode == cuda::FusedMemory::Off ||
            (mode == cuda::FusedMemory::Auto && ops == cuda::Operands::Exact) ||
            cfg.depth != 2 || cfg.retrieval != Retrieval::Lagged || want_diag) {
            return {};
        }
        const int ranks = cluster_ranks(cfg, st.chunk_);
        const cuda::FusedLayout lay{st.chunk_, cfg.head_dim(), cfg.layer_out(1)};
        if (ranks == 0 && (!lay.tiles() || static_cast<std::size_t>(lay.entries()) * sizeof(T) >
                                               cuda::shared_memory_limit())) {
            return {};
        }
        return {true, ops, ranks};
    }

    /// Whether forward_piece runs a piece's full chunks (from a chunk start) in a fused kernel
    /// (one block a pair or clusters), which can keep their start memory (KeepChunks).
    static bool training_fusable(const MemoryConfig& cfg, const State& st) {
        return fused_plan(cfg, st, false).use;
    }

    /// Calls pick.template operator()<O>() with O the kernel variant `ops` names: TF32 and
    /// BF16 exist for float only, so double always takes Exact.
    template <class Pick>
    static void with_operands(cuda::Operands ops, Pick&& pick) {
        if constexpr (std::is_same_v<T, float>) {
            if (ops == cuda::Operands::TF32) {
                pick.template operator()<cuda::Operands::TF32>();
                return;
            }
            if (ops == cuda::Operands::BF16) {
                pick.template operator()<cuda::Operands::BF16>();
                return;
            }
        }
        pick.template operator()<cuda::Operands::Exact>();
    }

    /// What a fused launch does besides its chunks: it checks its reads into `sink`, and its
    /// last W and S where `check_state`; it writes the reads into w.yh ((B N) x D) where
    /// `sequence_major`, else into w.yp; its chunk 0 copies W and S into `undo` where that is
    /// given (save_full), unless a training trace keeps every chunk's.
    struct FusedExtras {
        cuda::FlagSink sink;
        bool check_state = false;
        bool sequence_major = false;
        cuda::FusedKeep<T> undo{};
    };

    /// math §2-5 over `chunks` full chunks of every pair from piece row t (a chunk start), in
    /// one launch of the fused kernel (plan: its operands, and clusters of plan.ranks blocks
    /// a pair where that is not 0), with `x` (FusedExtras); the last chunk's rows of A, Delta
    /// into the state.
    static void fused_chunks(const MemoryConfig& cfg, State& st, long long N, long long t,
                             int chunks, const FusedPlan& plan, const FusedExtras& x,
                             KeepChunks* keep = nullptr) {
        const cuda::Operands ops = plan.operands;
        auto& w = *st.work_;
        const long long dh = cfg.head_dim(), P = static_cast<long long>(st.batch_) * cfg.n_heads;
        cuda::FusedArgs<T> f{};
        f.q = w.q.data() + t * dh;
        f.k = w.k.data() + t * dh;
        f.v = w.v.data() + t * dh;
        f.gates = cfg.gates == GateMode::Constant ? nullptr : w.lp.data() + t * 3;
        f.ld_y = x.sequence_major ? cfg.inner_dim() : dh;
        f.y_heads = x.sequence_major ? cfg.n_heads : 1;
        f.y = (x.sequence_major ? w.yh.data() : w.yp.data()) + t * f.ld_y;
        for (std::size_t l = 0; l < 2; ++l) {
            f.w[l] = st.w_[l].data();
            f.s[l] = st.s_[l].data();
            f.a[l] = st.a_[l].data();
            f.d[l] = st.delta_[l].data();
        }
        f.N = N;
        f.chunks = chunks;
        f.lay = {st.chunk_, cfg.head_dim(), cfg.layer_out(1)};
        f.gp = cuda::GateParams<T>::of(cfg);
        f.act = cfg.activation;
        f.residual = cfg.residual;
        f.sink = x.sink;
        f.row0 = t;
        f.pairs = P;
        f.check_state = x.check_state;
        if (keep != nullptr) {  // either kernel keeps them (training_fusable)
            keep->into(f.keep, chunks);
        } else {
            f.keep = x.undo;
        }
        if (plan.ranks > 0) {
            fused_cluster(st, f, ops, plan.ranks, P);
            return;
        }
        void (*kernel)(cuda::FusedArgs<T>) = nullptr;
        with_operands(ops, [&]<cuda::Operands O>() { kernel = cuda::fused_chunks_kernel<T, O>; });
        const auto bytes = static_cast<std::size_t>(f.lay.entries()) * sizeof(T);
        cuda::raise_shared_limit(kernel, bytes);
        cuda::launch_shared(kernel, static_cast<unsigned>(P), cuda::fused_threads, bytes,
                            ctx(st).stream(), f);
        cuda::check_launch("the fused chunk kernel");
        ++cuda::fused_launches();
    }

    /// fused_chunks' launch as clusters of `ranks` blocks a pair (memory_cluster.cuh): f.lay's
    /// hidden width becomes a rank's share.
    static void fused_cluster(const State& st, cuda::FusedArgs<T> f, cuda::Operands ops,
                              int ranks, long long P) {
        const auto cl = cuda::ClusterLayout::of(f.lay.b, f.lay.dh, f.lay.h, ranks);
        f.lay = cl.lay;
        void (*kernel)(cuda::FusedArgs<T>, int) = nullptr;
        with_operands(ops, [&]<cuda::Operands O>() { kernel = cuda::fused_cluster_kernel<T, O>; });
        const auto bytes = static_cast<std::size_t>(cl.entries()) * sizeof(T);
        cuda::raise_shared_limit(kernel, bytes);
        cuda::launch_cluster(kernel, dim3(static_cast<unsigned>(P * ranks)),
                             dim3(cuda::fused_threads), bytes,
                             dim3(static_cast<unsigned>(ranks)), ctx(st).stream(), f, ranks);
        ++cuda::fused_launches();
        ++cuda::fused_cluster_launches();
    }

    static std::vector<T*> pointers(std::vector<Buf>& v) {
        std::vector<T*> out;
        for (Buf& x : v) {
            out.push_back(x.data());
        }
        return out;
    }

    /// Flags the non-finite entries of a forward call: 0 projections, 1 memory read,
    /// 2 memory state (weights and momentum after a chunk end, pending rows), 3 output.
    /// `ended`: a chunk ended whose W and S no fused launch checked (Scanned::state_checked).
    static void check_state(const MemoryConfig& cfg, const State& st, bool ended,
                            FlagStage& checks, bool rows_checked) {
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads;
        const int b = st.chunk_, n = st.pending();
        const FlagKey pair{1, 1, 0};
        for (int l = 1; l <= cfg.depth; ++l) {
            const auto li = static_cast<std::size_t>(l - 1);
            const long long in = cfg.layer_in(l), out = cfg.layer_out(l);
            if (ended) {
                checks.add(st.w_[li].data(), P, in, out, out, in * out, 2, pair);
                checks.add(st.s_[li].data(), P, in, out, out, in * out, 2, pair);
            }
            if (!rows_checked) {  // else the decode kernel checked the rows it wrote
                checks.add(st.a_[li].data(), P, n, in, in, b * in, 2, pair);
                checks.add(st.delta_[li].data(), P, n, out, out, b * out, 2, pair);
            }
        }
    }

    /// The pair-major rows yp ([p][N][d_h]) back to (B*N) x D, then y = yh W_O. With one
    /// token a sequence (decode) the pair-major rows are that layout already, and where the
    /// fused kernel wrote yh itself (`sequence_major`) there is nothing to move: no kernel.
    static void output(const MemoryConfig& cfg, const Params& p, const cuda::StreamContext& cx,
                       typename State::Work& w, int B, long long N, View<T> y,
                       bool sequence_major = false) {
        const long long H = cfg.n_heads, dh = cfg.head_dim(), D = cfg.inner_dim(), M = B * N;
        const T* yp = w.yp.data();
        const T* rows = sequence_major ? w.yh.data() : yp;
        if (N != 1 && !sequence_major) {
            T* yh = w.yh.data();
            cuda::each(cx.stream(), M * D, [=] __device__(unsigned i) {
                const long long r = i / cuda::u32(D), c = i % cuda::u32(D), s = cuda::u32(r) / cuda::u32(N), t = cuda::u32(r) % cuda::u32(N),
                                h = cuda::u32(c) / cuda::u32(dh), j = cuda::u32(c) % cuda::u32(dh);
                yh[i] = yp[((s * H + h) * N + t) * dh + j];
            });
            rows = yh;
        }
        cuda::gemm<T>(cx.blas(), false, false, static_cast<int>(M), cfg.d_model,
                      static_cast<int>(D), T(1), {rows, static_cast<int>(D)},
                      {p.w_o.data(), cfg.d_model}, T(0), y.data, static_cast<int>(y.stride), 0, 1);
    }

    /// math §1-5 over a piece: x (B*N) x d and y (B*N) x d in device memory, diag optional
    /// (host). Throws NonFiniteError if an output or the new state holds a NaN or an infinity;
    /// the state is then as before the call (or as at the open transaction's begin).
    static void forward(const MemoryConfig& cfg, const Prepared& pp, State& st, View<const T> x,
                        View<T> y, Diagnostics<T>* diag) {
        if (diag != nullptr) {
            diag->loss.setZero(x.rows, cfg.n_heads);
            diag->grad_norm.setZero(x.rows, cfg.n_heads);
        }
        if (x.rows == 0) {
            return;
        }
        const bool own = begin(st);
        try {
            forward_piece(cfg, *pp, st, x, y, diag);
        } catch (...) {
            rollback(st);
            throw;
        }
        if (own) {
            commit(st);
        }
    }

    static void forward_piece(const MemoryConfig& cfg, const Params& p, State& st,
                              View<const T> x, View<T> y, Diagnostics<T>* diag,
                              KeepChunks* keep = nullptr) {
        const int B = st.batch_;
        const long long N = x.rows / B, P = static_cast<long long>(B) * cfg.n_heads,
                        dh = cfg.head_dim();
        const cuda::StreamContext& cx = ctx(st);
        auto& w = *st.work_;
        reserve(cfg, w, B, N, st.chunk_, st.chunk_);
        int* flags = w.flags.data();
        const FlagKey by_row{cfg.n_heads, N, 1};
        // Deferred (inside a CallScope): the checks raise the scope's flag themselves, and the
        // five ints are neither cleared nor read.
        const bool defer = cuda::deferring() && diag == nullptr;
        if (!defer) {
            cuda::memset_async(flags, 0x7f, 5 * sizeof(int), cx.stream(), "cudaMemsetAsync");
        }
        // a decode call: the L2 norm of q and k in the decode kernel, not a launch of its own
        const DecodePlan decode = decode_plan(cfg, N);
        // Every check of the call at its end, up to 12 row sets a launch, but those the kernels
        // make of what they write (into checks.sink()): the buffers the checks read stay as
        // they are until then, and which error is named depends on the slots, not on the
        // order the checks ran in.
        FlagStage checks(cx.stream(), flags, defer ? cuda::deferred_flag() : nullptr);
        cuda::ConvTile<T> tile{};  // the conv's arguments, for the decode kernel (decode.whole)
        const bool projected = project(cfg, p, cx, w, x, B, N, cfg.use_conv, st.tail_.data(),
                                       true, false, decode.norm,
                                       decode.whole ? &tile : nullptr, checks.sink());
        const Scanned done = scan(cfg, st, N, diag != nullptr, decode, checks.sink(), tile, keep);
        // Deferred, a call decoded whole had its rows checked by the decode kernel, and its
        // output's check is left to a later one where that covers it (cuda::OutputCovered).
        const bool rows_checked = defer && done.decoded;
        if (!rows_checked && !projected) {  // else the projection's kernels checked them
            for (const Buf* b : {&w.q, &w.k, &w.v}) {
                checks.add(b->data(), P, N, dh, dh, N * dh, 0, by_row);
            }
            if (cfg.gates != GateMode::Constant) {
                checks.add(w.lp.data(), P, N, 3, 3, N * 3, 4, by_row);
            }
        }
        if (!rows_checked && done.fused_rows < N) {  // else the fused kernel checked the reads
            checks.add(w.yp.data(), P, N, dh, dh, N * dh, 1, FlagKey{1, 1, P});
        }
        const std::int64_t pos0 = st.position_;
        st.position_ += N;  // rolled back with the rest if a check fails below
        check_state(cfg, st, done.ended && !done.state_checked, checks, rows_checked);
        output(cfg, p, cx, w, B, N, y, done.sequence_major);
        if (!(rows_checked && cuda::output_covered())) {
            checks.add(y.data, 1, x.rows, cfg.d_model, y.stride, 0, 3, FlagKey{1, 0, 1});
        }
        checks.launch();
        if (defer) {  // the scope's flag is read once at the call's edge
            return;
        }
        int host[5] = {0, 0, 0, 0, 0};
        cuda::settle_recorded();
        cuda::check(cudaMemcpyAsync(host, flags, sizeof(host), cudaMemcpyDeviceToHost, cx.stream()),
                    "cudaMemcpyAsync (flags)");
        cx.synchronize();
        throw_if_flagged(host, pos0, N, cfg.n_heads, P);
        if (diag != nullptr) {
            download_diag(cfg, w, B, N, *diag);
        }
    }

    /// The first non-finite entry of a forward call, named as the CPU names it: slots 0
    /// (q, k, v) and 4 (gate logits) and 3 (output) hold the first bad row s N + t, slot 1 (the
    /// memory's reads) the first t P + p, slot 2 (weights, momentum, pending rows) the first
    /// pair p = s H + h (a chunk end somewhere in the piece).
    static void throw_if_flagged(const int* f, std::int64_t pos0, long long N, int H,
                                 long long P) {
        constexpr const char* tail = ", expected finite values; the state is unchanged";
        constexpr const char* diverged =
            ", expected finite values (the memory diverged; see max_grad_norm and theta_max); "
            "the state is unchanged";
        auto row = [&](int r, const char* what) {
            throw NonFiniteError(detail::concat("NeuralMemory::forward: ", what, " at sequence ",
                                                r / N, ", position ", pos0 + r % N,
                                                " (all heads)", tail));
        };
        const char* proj = "the projections of x (q, k, v or gate logits) overflow";
        if (f[0] != unflagged || f[4] != unflagged) {
            row(f[0] != unflagged ? f[0] : f[4], proj);
        }
        if (f[1] != unflagged) {
            const long long t = f[1] / P, p = f[1] % P;
            throw NonFiniteError(detail::concat(
                "NeuralMemory::forward: a non-finite memory read at sequence ", p / H, ", head ",
                p % H, ", position ", pos0 + t, diverged));
        }
        if (f[2] != unflagged) {
            throw NonFiniteError(detail::concat(
                "NeuralMemory::forward: non-finite memory weights, momentum or key errors "
                "(surprise) at sequence ", f[2] / H, ", head ", f[2] % H, ", positions ", pos0,
                "..", pos0 + N - 1, " of this piece", diverged));
        }
        if (f[3] != unflagged) {
            row(f[3], "the output projection W_O overflows");
        }
    }

    static void download_diag(const MemoryConfig& cfg, typename State::Work& w, int B,
                              long long N, Diagnostics<T>& diag) {
        const long long H = cfg.n_heads, P = B * H;
        std::vector<T> host(static_cast<std::size_t>(2 * P * N));
        cuda::copy_now(host.data(), w.diag.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost,
                       "cudaMemcpy (diagnostics)");
        for (long long p = 0; p < P; ++p) {
            for (long long t = 0; t < N; ++t) {
                const auto r = static_cast<Eigen::Index>((p / H) * N + t);
                const auto h = static_cast<Eigen::Index>(p % H);
                diag.loss(r, h) = host[static_cast<std::size_t>(p * N + t)];
                diag.grad_norm(r, h) = host[static_cast<std::size_t>(P * N + p * N + t)];
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Reads and the memory as it is now.
    // ---------------------------------------------------------------------------------------
    /// The memory after the last token into work.w / work.s: W^s, S^s with the pending rows'
    /// closed-form chunk end applied (math §4); returns the weights' (or momentum's) pointers.
    static std::vector<T*> materialise(const MemoryConfig& cfg, const State& st, bool weights) {
        auto& w = *st.work_;
        State& ms = const_cast<State&>(st);  // workspaces only; the state is not changed
        const long long P = static_cast<long long>(st.batch_) * cfg.n_heads;
        const int n = st.pending();
        if (n == 0) {
            return pointers(weights ? ms.w_ : ms.s_);
        }
        reserve(cfg, w, st.batch_, 1, st.chunk_, st.chunk_);
        const cudaStream_t sm = ctx(st).stream();
        copy_all(w.w, st.w_, sm);
        copy_all(w.s, st.s_, sm);
        chunk_end(cfg, ctx(st), w, layers(cfg, st.a_, st.delta_), st.gates_.data(),
                  pointers(w.w), pointers(w.s), P, st.chunk_, n);
        return pointers(weights ? w.w : w.s);
    }

    /// Queries of x ((B*N) x d) read through the pair-major weights W, then W_O into y.
    static void read_through(const MemoryConfig& cfg, const Params& p,
                             const cuda::StreamContext& cx, typename State::Work& w,
                             View<const T> x, int B, int b, bool conv, const T* tail,
                             const std::vector<const T*>& W, View<T> y) {
        const long long N = x.rows / B, dh = cfg.head_dim();
        if (N == 0) {
            return;
        }
        reserve(cfg, w, B, N, b, N);
        project(cfg, p, cx, w, x, B, N, conv, const_cast<T*>(tail), false, true);
        mlp_read(cfg, cx, W, w.q.data(), N * dh, N, w.hid, N, w.yp.data(),
                 N * dh, B * cfg.n_heads);
        output(cfg, p, cx, w, B, N, y);
        cuda::idle(cx);  // (a local workspace is freed stream-ordered after it)
    }

    static std::vector<const T*> as_const(const std::vector<T*>& v) {
        return std::vector<const T*>(v.begin(), v.end());
    }

    /// Read-only retrieval with the memory after the last token (conv continuing the stream,
    /// tails not advanced).
    static void read(const MemoryConfig& cfg, const Prepared& p, const State& st,
                     View<const T> x, View<T> y) {
        if (x.rows == 0) {
            return;
        }
        const std::vector<T*> W = materialise(cfg, st, true);
        read_through(cfg, *p, ctx(st), *st.work_, x, st.batch_, st.chunk_,
                     cfg.use_conv, st.tail_.data(), as_const(W), y);
    }

    /// Retrieval through given host weights (weights[s * H + h][l]), no conv, no state.
    static void read_weights(const MemoryConfig& cfg, const Prepared& p,
                             const std::vector<std::vector<Mat>>& weights, View<const T> x,
                             int batch, View<T> y) {
        if (x.rows > 0) {
            read_snapshot(cfg, p, make_snapshot(cfg, weights), x, batch, y);
        }
    }

    /// The weights of every pair now (MAC's segment start), copied on the device.
    using Snapshot = CudaMemorySnapshot<T>;
    static void snapshot(const MemoryConfig& cfg, const State& st, Snapshot& out) {
        const std::vector<T*> src = materialise(cfg, st, true);
        const auto P = static_cast<std::size_t>(st.batch_) * static_cast<std::size_t>(cfg.n_heads);
        out.cfg_ = cfg;
        out.pairs_ = P;
        out.w_.resize(static_cast<std::size_t>(cfg.depth));
        for (int l = 1; l <= cfg.depth; ++l) {
            Buf& to = out.w_[static_cast<std::size_t>(l - 1)];
            const std::size_t n = P * static_cast<std::size_t>(cfg.layer_in(l) * cfg.layer_out(l));
            if (to.size() != n) {
                to = Buf(n);
            }
            cuda::copy_async(to.data(), src[static_cast<std::size_t>(l - 1)], n * sizeof(T),
                             ctx(st).stream(), "cudaMemcpyAsync (memory snapshot)");
        }
        cuda::idle(ctx(st));
    }
    /// Retrieval through a snapshot (no conv, no state) on this thread's stream.
    static void read_snapshot(const MemoryConfig& cfg, const Prepared& p, const Snapshot& s,
                              View<const T> x, int batch, View<T> y) {
        if (x.rows == 0) {
            return;
        }
        // The thread's own workspaces, kept across calls (MAC reads a snapshot every segment
        // part: no allocation once they are large enough); used on the thread's stream only.
        thread_local typename State::Work w;
        std::vector<const T*> W;
        for (const Buf& layer : s.w_) {
            W.push_back(layer.data());
        }
        read_through(cfg, *p, cuda::thread_context(), w, x, batch, 1, false, nullptr, W, y);
    }
    /// A snapshot's weights on the host (one download per layer), and host weights on the
    /// device (one upload per layer).
    static std::vector<std::vector<Mat>> snapshot_weights(const MemoryConfig& cfg,
                                                          const Snapshot& s) {
        std::vector<const T*> src;
        for (const Buf& layer : s.w_) {
            src.push_back(layer.data());
        }
        cuda::thread_context().synchronize();  // a snapshot taken in a call scope is complete
        return to_host_pairs(cfg, s.pairs_, src);
    }
    static Snapshot make_snapshot(const MemoryConfig& cfg,
                                  const std::vector<std::vector<Mat>>& weights) {
        Snapshot s;
        s.cfg_ = cfg;
        s.pairs_ = weights.size();
        for (int l = 0; l < cfg.depth; ++l) {
            std::vector<T> host;
            for (const auto& pair : weights) {
                const Mat& m = pair[static_cast<std::size_t>(l)];
                host.insert(host.end(), m.data(), m.data() + m.size());
            }
            s.w_.push_back(cuda::upload_array(host.data(), host.size()));
        }
        return s;
    }

    /// The memory (weights or momentum) of sequence s, head h after the last token, on the host.
    static std::vector<Mat> current(const MemoryConfig& cfg, const State& st, int s, int h,
                                    bool weights) {
        const std::vector<T*> src = materialise(cfg, st, weights);
        ctx(st).synchronize();
        const long long p = static_cast<long long>(s) * cfg.n_heads + h;
        std::vector<Mat> out;
        for (int l = 1; l <= cfg.depth; ++l) {
            Mat m(cfg.layer_in(l), cfg.layer_out(l));
            cuda::copy_now(m.data(), src[static_cast<std::size_t>(l - 1)] + p * m.size(),
                           static_cast<std::size_t>(m.size()) * sizeof(T), cudaMemcpyDeviceToHost,
                           "cudaMemcpy (current memory)");
            out.push_back(std::move(m));
        }
        return out;
    }
    static std::vector<Mat> current_weights(const MemoryConfig& cfg, const State& st, int s,
                                            int h) {
        return current(cfg, st, s, h, true);
    }
    static std::vector<Mat> current_momentum(const MemoryConfig& cfg, const State& st, int s,
                                             int h) {
        return current(cfg, st, s, h, false);
    }
    /// Every pair's weights: materialised once, one download per layer.
    static std::vector<std::vector<Mat>> all_weights(const MemoryConfig& cfg, const State& st) {
        const std::vector<T*> src = materialise(cfg, st, true);
        ctx(st).synchronize();
        const auto P = static_cast<std::size_t>(st.batch_) * static_cast<std::size_t>(cfg.n_heads);
        return to_host_pairs(cfg, P, as_const(src));
    }
    /// P pairs' weights, pair-major per layer at src[l - 1] (device, idle), on the host.
    static std::vector<std::vector<Mat>> to_host_pairs(const MemoryConfig& cfg, std::size_t P,
                                                       const std::vector<const T*>& src) {
        std::vector<std::vector<Mat>> out(P);
        std::vector<T> layer;
        for (int l = 1; l <= cfg.depth; ++l) {
            const Eigen::Index in = cfg.layer_in(l), o = cfg.layer_out(l);
            const auto size = static_cast<std::size_t>(in * o);
            layer.resize(P * size);
            cuda::copy_now(layer.data(), src[static_cast<std::size_t>(l - 1)],
                           layer.size() * sizeof(T), cudaMemcpyDeviceToHost,
                           "cudaMemcpy (current memory)");
            for (std::size_t p = 0; p < P; ++p) {
                out[p].push_back(Eigen::Map<const Mat>(layer.data() + p * size, in, o));
            }
        }
        return out;
    }
};

}  // namespace titans::backend
