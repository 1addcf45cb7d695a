// The neural memory's training pass on the CUDA backend (math §9): the device trace and the
// training forward (backend/cuda/memory_training.cuh) against the CPU's
// (cpu/memory_training.hpp), every update, retrieval and gate mode with the other options
// drawn: outputs, the state after, and every kept tensor (input, conv tails, pre-conv
// products, gate logits, the memory at each chunk start); the backward (memory_sweep.cuh),
// whole, chained, and in stages with taps of mid-stream reads at cuts of any length (the
// staged API MAC's training drives); the reverse of read_weights (memory_read_backward.cuh).
// CPU double is the reference: CUDA double within 1e-12, CUDA float within 1e-5 of the same
// problem rounded to float. Outputs are poisoned (NaN) before each call.

#include <titans/backend/cuda/cuda.cuh>

#include <thread>

#include "cuda_common.hpp"
#include "staged_views_case.hpp"
#include "training_pass.hpp"

namespace {

using namespace titans_test;

using titans::backend::Cuda;
using titans::backend::Transfer;

template <class T>
using CudaMemory = NeuralMemory<T, Cuda>;
template <class T>
using CudaTraining = titans::backend::MemoryTraining<Cuda, T>;

static_assert(CudaTraining<float>::available && CudaTraining<double>::available);

/// n entries of a device buffer from `offset` as a rows x cols host matrix in double.
template <class T>
Matrixd download(const titans::backend::cuda::DeviceBuffer<T>& b, long long offset,
                 Eigen::Index rows, Eigen::Index cols) {
    Matrix<T> m(rows, cols);
    if (m.size() > 0) {
        REQUIRE(cudaMemcpy(m.data(), b.data() + offset, static_cast<std::size_t>(m.size()) * sizeof(T),
                           cudaMemcpyDeviceToHost) == cudaSuccess);
    }
    return m.template cast<double>();
}

/// Every tensor of the CUDA trace against the CPU's; the largest relative error.
template <class T>
double compare_trace(const MemoryConfig& cfg, const typename CudaTraining<T>::Trace& g,
                     const NeuralMemory<double>::Trace& c) {
    const int B = c.batch, H = cfg.n_heads, L = cfg.depth, D = cfg.inner_dim();
    REQUIRE(g.filled == c.filled);
    REQUIRE(g.batch == B);
    REQUIRE(g.start == c.start);
    REQUIRE(g.rows() == c.rows());
    REQUIRE(g.x.cols() == c.x.cols());
    double e = rel_error(download(g.x.mem, 0, g.x.rows(), g.x.cols()), c.x);
    e = std::max(e, rel_error(download(g.u, 0, c.kept.u.rows(), c.kept.u.cols()), c.kept.u));
    if (cfg.gates != GateMode::Constant) {
        e = std::max(e, rel_error(download(g.logits, 0, c.kept.logits.rows(), c.kept.logits.cols()),
                                  c.kept.logits));
    }
    for (std::size_t s = 0; s < c.tail_in.size(); ++s) {
        const Matrixd& tl = c.tail_in[s];
        e = std::max(e, rel_error(download(g.tail_in, static_cast<long long>(s) * tl.size(),
                                           tl.rows(), tl.cols()),
                                  tl, 1e-12));
    }
    for (int p = 0; p < B * H; ++p) {
        const auto& snap = c.kept.memory[static_cast<std::size_t>(p)];
        REQUIRE(static_cast<long long>(snap.size()) == g.chunks * 2 * L);
        for (std::size_t i = 0; i < snap.size(); ++i) {
            const Matrixd& m = snap[i];
            e = std::max(e, rel_error(download(g.memory[i], static_cast<long long>(p) * m.size(),
                                               m.rows(), m.cols()),
                                      m, 1e-12));
        }
    }
    (void)D;
    return e;
}

/// One case: a head of h0 tokens (a whole number of chunks) through forward, then the training
/// forward of N tokens on both backends; y, the state after and the trace compared, and the
/// diagnostics where `diagnostics` asks for them (the fused kernel runs only without).
template <class T>
double trace_case(const MemoryConfig& cfg, const titans::MemoryParamsd& p, int B, int h0, int N,
                  Rng& rng, double bound, bool diagnostics = true, int kind = 0) {
    using K = titans::backend::MemoryKernels<Cuda, T>;
    NeuralMemory<double> cpu(cfg, p);
    CudaMemory<T> gpu(cfg, cast_params<T>(p));
    auto cs = cpu.make_state(B);
    auto gs = gpu.make_state(B);
    const Matrixd head = round_through<T>(random_matrix(static_cast<Eigen::Index>(B) * h0, cfg.d_model, rng));
    const Matrixd x = round_through<T>(
        stream_kind(random_matrix(static_cast<Eigen::Index>(B) * N, cfg.d_model, rng), B, kind));
    Matrixd y0;
    cpu.forward(cs, head, y0);
    (void)gpu.forward(gs, head.cast<T>());
    NeuralMemory<double>::Trace ct;
    Matrixd y_cpu;
    Diagnostics<double> d_cpu;
    cpu.forward(cs, x, y_cpu, ct, &d_cpu);
    typename CudaTraining<T>::Trace gt;
    Diagnostics<T> d_gpu;
    const Matrix<T> xt = x.cast<T>();
    auto xb = Transfer<Cuda, T>::upload(titans::view_of(xt));
    auto yb = Transfer<Cuda, T>::allocate(xt.rows(), xt.cols());
    if (yb.mem.size() > 0) {
        REQUIRE(cudaMemset(yb.mem.data(), 0xff, yb.mem.size() * sizeof(T)) == cudaSuccess);
    }
    const auto prepared = K::prepare(gpu.config(), gpu.shared_params());
    CudaTraining<T>::forward(gpu.config(), prepared, gs, Transfer<Cuda, T>::view(std::as_const(xb)),
                             Transfer<Cuda, T>::view(yb), gt, diagnostics ? &d_gpu : nullptr);
    Matrix<T> y(xt.rows(), xt.cols());
    Transfer<Cuda, T>::download(Transfer<Cuda, T>::view(std::as_const(yb)), titans::view_of(y));
    REQUIRE(gs.position() == cs.position());
    const double ey = rel_error(y.template cast<double>(), y_cpu);
    const int s = uniform_int(rng, 0, B - 1), h = uniform_int(rng, 0, cfg.n_heads - 1);
    const double ew = rel_error(cast_layers<double>(gpu.current_weights(gs, s, h)),
                                cpu.current_weights(cs, s, h));
    const double et = compare_trace<T>(cfg, gt, ct);
    // The training forward's diagnostics (per-token surprise), as forward's.
    REQUIRE(d_gpu.loss.rows() == (diagnostics ? x.rows() : 0));
    const double ed =
        diagnostics ? std::max(rel_error(d_gpu.loss.template cast<double>(), d_cpu.loss),
                               rel_error(d_gpu.grad_norm.template cast<double>(), d_cpu.grad_norm))
                    : 0.0;
    INFO("errors: outputs " << ey << ", weights " << ew << ", trace " << et << ", diagnostics " << ed);
    CHECK(std::max({ey, ew, et, ed}) <= bound);
    return std::max({ey, ew, et, ed});
}

template <class T>
void trace_sweep(const char* name, int cases_per_mode, double bound) {
    const auto run = [&](const Modes& base, int k, int index, Rng& rng) {
        const Modes m = with_flags(base, (k * 7 + index) % 32);
        Limits lim;
        lim.min_head_dim = 3;
        const MemoryConfig cfg = random_config(m, rng, lim);
        const int B = uniform_int(rng, 1, 3);
        const int h0 = cfg.effective_chunk() * uniform_int(rng, 0, 2);
        const int N = uniform_int(rng, 0, 5) == 0 ? 0 : random_tokens(cfg, rng, 17);
        const auto p = random_params(cfg, rng);
        INFO("case " << index << ": " << to_string(cfg.update) << "/" << to_string(cfg.retrieval)
                     << "/" << to_string(cfg.gates) << " depth " << cfg.depth << " chunk "
                     << cfg.chunk << " conv " << cfg.use_conv << "/" << cfg.conv_kernel
                     << " B " << B << " head " << h0 << " N " << N);
        return trace_case<T>(cfg, p, B, h0, N, rng, bound);
    };
    (void)mode_sweep(name, cases_per_mode, bound, run);
}


/// A chained training case: config, parameters, the stream cut at chunk boundaries (cuts[0] =
/// 0 .. N; an empty piece sometimes) or, for odd indices, anywhere (the memory left
/// mid-chunk), upstream gradients, non-zero starting gradients.
struct TrainCase {
    MemoryConfig cfg;
    titans::MemoryParamsd p, g0;
    int B = 1;
    Matrixd x, dy;
    std::vector<Eigen::Index> cuts;
};

template <class T>
TrainCase train_case(const Modes& base, int index, Rng& rng, bool chained) {
    TrainCase c;
    Limits lim;
    lim.min_head_dim = 3;
    lim.max_depth = 3;
    c.cfg = random_config(with_flags(base, (index * 11) % 32), rng, lim);
    for (double* v : {&c.cfg.theta_max, &c.cfg.constant_theta, &c.cfg.constant_eta,
                      &c.cfg.constant_alpha, &c.cfg.max_grad_norm}) {
        *v = static_cast<double>(static_cast<T>(*v));
    }
    c.p = cast_params<double>(cast_params<T>(random_params(c.cfg, rng)));
    c.g0 = cast_params<double>(cast_params<T>(random_params(c.cfg, rng)));
    c.B = uniform_int(rng, 1, 2);
    const int N = random_tokens(c.cfg, rng, 12);
    c.x = round_through<T>(random_matrix(c.B * N, c.cfg.d_model, rng));
    c.dy = round_through<T>(random_matrix(c.B * N, c.cfg.d_model, rng));
    const int b = c.cfg.effective_chunk();
    c.cuts = {0};
    if (chained && index % 2 == 1) {
        while (c.cuts.back() < N) {
            c.cuts.push_back(std::min<Eigen::Index>(N, c.cuts.back() + uniform_int(rng, 0, b + 2)));
        }
        return c;
    }
    while (chained && c.cuts.back() + b < N) c.cuts.push_back(c.cuts.back() + b * uniform_int(rng, 1, 2));
    c.cuts.back() = std::min<Eigen::Index>(c.cuts.back(), N);
    if (c.cuts.back() != N) c.cuts.push_back(N);
    if (chained && index % 3 == 1) {
        const auto at = static_cast<std::size_t>(uniform_int(rng, 0, static_cast<int>(c.cuts.size()) - 2));
        c.cuts.insert(c.cuts.begin() + static_cast<std::ptrdiff_t>(at) + 1, c.cuts[at]);
    }
    return c;
}

/// What a chained pass gives, in double: each piece's dx and d_state_in, the gradients.
struct TrainResult {
    std::vector<Matrixd> dx;
    std::vector<titans::MemoryStateGradient<double>> d_in;
    titans::MemoryParamsd g;
};

/// A state gradient in another scalar, every part (the pending rows' too).
template <class To, class From>
titans::MemoryStateGradient<To> cast_state_gradient(const titans::MemoryStateGradient<From>& d) {
    titans::MemoryStateGradient<To> r;
    for (const auto& w : d.weights) r.weights.push_back(cast_layers<To>(w));
    for (const auto& w : d.momentum) r.momentum.push_back(cast_layers<To>(w));
    for (const auto& t : d.conv_tail) r.conv_tail.push_back(t.template cast<To>());
    for (const auto& w : d.pending_a) r.pending_a.push_back(cast_layers<To>(w));
    for (const auto& w : d.pending_delta) r.pending_delta.push_back(cast_layers<To>(w));
    for (const auto& t : d.pending_gates) r.pending_gates.push_back(t.template cast<To>());
    return r;
}
template <class T>
titans::MemoryStateGradient<double> to_double(const titans::MemoryStateGradient<T>& d) {
    return cast_state_gradient<double>(d);
}

/// The pieces forward with traces, then backward last first, chained; dx NaN-poisoned.
template <class T, class Backend>
TrainResult run_chained(const TrainCase& c) {
    NeuralMemory<T, Backend> mem(c.cfg, cast_params<T>(c.p));
    auto st = mem.make_state(c.B);
    const Eigen::Index N = c.x.rows() / c.B;
    const std::size_t K = c.cuts.size() - 1;
    std::vector<typename NeuralMemory<T, Backend>::Trace> traces(K);
    for (std::size_t k = 0; k < K; ++k) {
        const Matrix<T> xp = take_tokens(c.x, c.B, N, c.cuts[k], c.cuts[k + 1]).template cast<T>();
        Matrix<T> y;
        mem.forward(st, xp, y, traces[k]);
    }
    auto g = cast_params<T>(c.g0);
    TrainResult r;
    r.dx.resize(K);
    r.d_in.resize(K);
    titans::MemoryStateGradient<T> next;
    for (std::size_t k = K; k-- > 0;) {
        const Matrix<T> dyp = take_tokens(c.dy, c.B, N, c.cuts[k], c.cuts[k + 1]).template cast<T>();
        Matrix<T> dx = Matrix<T>::Constant(dyp.rows(), dyp.cols(), std::numeric_limits<T>::quiet_NaN());
        titans::MemoryStateGradient<T> d_in;
        mem.backward(traces[k], dyp, dx, g, &d_in, k + 1 < K ? &next : nullptr);
        r.dx[k] = dx.template cast<double>();
        r.d_in[k] = to_double(d_in);
        next = std::move(d_in);
    }
    r.g = cast_params<double>(g);
    return r;
}

double layers_rel(const std::vector<std::vector<Matrixd>>& a, const std::vector<std::vector<Matrixd>>& b,
                  double floor) {
    if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
    double e = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
        if (a[i].size() != b[i].size()) return std::numeric_limits<double>::infinity();
        for (std::size_t l = 0; l < a[i].size(); ++l) e = std::max(e, rel_error(a[i][l], b[i][l], floor));
    }
    return e;
}

/// The largest relative error of a CUDA result against the CPU's: dx, d_state_in and every
/// gradient tensor, each relative to its largest entry or 1e-3 of the case's scale.
double compare_results(const TrainResult& a, const TrainResult& ref, const MemoryConfig& cfg) {
    double scale = 0;
    for (const Matrixd& m : ref.dx) scale = std::max(scale, m.size() ? m.cwiseAbs().maxCoeff() : 0.0);
    titans::MemoryParamsd::tensors(ref.g, cfg, [&](const std::string&, const auto& t) {
        scale = std::max(scale, Matrixd(t).cwiseAbs().maxCoeff());
    });
    const double floor = std::max(1e-3 * scale, 1e-300);
    double e = 0;
    for (std::size_t k = 0; k < ref.dx.size(); ++k) {
        e = std::max(e, rel_error(a.dx[k], ref.dx[k], floor));
        e = std::max(e, layers_rel(a.d_in[k].weights, ref.d_in[k].weights, floor));
        e = std::max(e, layers_rel(a.d_in[k].momentum, ref.d_in[k].momentum, floor));
        e = std::max(e, layers_rel(a.d_in[k].pending_a, ref.d_in[k].pending_a, floor));
        e = std::max(e, layers_rel(a.d_in[k].pending_delta, ref.d_in[k].pending_delta, floor));
        REQUIRE(a.d_in[k].pending_gates.size() == ref.d_in[k].pending_gates.size());
        for (std::size_t i = 0; i < ref.d_in[k].pending_gates.size(); ++i) {
            e = std::max(e, rel_error(a.d_in[k].pending_gates[i], ref.d_in[k].pending_gates[i], floor));
        }
        REQUIRE(a.d_in[k].conv_tail.size() == ref.d_in[k].conv_tail.size());
        for (std::size_t s = 0; s < ref.d_in[k].conv_tail.size(); ++s) {
            e = std::max(e, rel_error(a.d_in[k].conv_tail[s], ref.d_in[k].conv_tail[s], floor));
        }
    }
    titans::MemoryParamsd::tensors(a.g, cfg, [&](const std::string& name, const auto& t) {
        titans::MemoryParamsd::tensors(ref.g, cfg, [&](const std::string& n2, const auto& t2) {
            if (n2 != name) return;
            const double en = rel_error(Matrixd(t), Matrixd(t2), floor);
            if (!(en <= 1e-12)) UNSCOPED_INFO("tensor " << name << " error " << en);
            e = std::max(e, en);
        });
    });
    return e;
}

/// Adjoints of the weights after some tokens: per tap, per pair, the layer shapes.
using Taps = std::vector<std::vector<std::vector<Matrixd>>>;

/// The staged pass at the backend level (MemoryTraining's start, forward_part and Reverse):
/// one trace fed in the pieces at c.cuts (any lengths), then reversed in stages at the same
/// cuts, taps[k] added at cuts[k] (the last at N first, the first at 0 last); dx per piece,
/// the incoming state's adjoint (in d_in[0]) and the gradients.
template <class T, class Backend>
TrainResult run_staged(const TrainCase& c, const Taps& taps) {
    using Kernels = titans::backend::MemoryKernels<Backend, T>;
    using Pass = titans::backend::MemoryTraining<Backend, T>;
    const auto prepared = Kernels::prepare(
        c.cfg, std::make_shared<const titans::MemoryParams<T>>(cast_params<T>(c.p)));
    auto st = Kernels::make_state(c.cfg, prepared, c.B);
    const Eigen::Index N = c.x.rows() / c.B;
    const std::size_t K = c.cuts.size() - 1;
    typename Pass::Trace tr;
    Pass::start(c.cfg, st, N, c.cfg.d_model, tr);
    for (std::size_t k = 0; k < K; ++k) {
        const Matrix<T> xp = take_tokens(c.x, c.B, N, c.cuts[k], c.cuts[k + 1]).template cast<T>();
        Matrix<T> y;
        const titans::backend::Upload<Backend, T> in(xp);
        titans::backend::Download<Backend, T> out(y, xp.rows(), xp.cols());
        Pass::forward_part(c.cfg, prepared, st, in.view(), out.view(), tr);
        out.finish();
    }
    REQUIRE(!tr.empty());
    auto g = cast_params<T>(c.g0);
    const Matrix<T> dy = c.dy.template cast<T>();
    const titans::backend::Upload<Backend, T> dyu(dy);
    typename Pass::Reverse rev(c.cfg, prepared, tr, dyu.view(), nullptr);
    const auto tap = [&](std::size_t k) {
        std::vector<std::vector<Matrix<T>>> dW;
        for (const auto& pair : taps[k]) dW.push_back(cast_layers<T>(pair));
        rev.tap(dW);
    };
    TrainResult r;
    r.dx.resize(K);
    r.d_in.resize(K);
    tap(K);
    for (std::size_t k = K; k-- > 0;) {
        Matrix<T> dx;
        rev.down_to(c.cuts[k], dx);
        r.dx[k] = dx.template cast<double>();
        tap(k);
    }
    titans::MemoryStateGradient<T> d_in;
    rev.finish(g, &d_in);
    r.d_in[0] = to_double(d_in);
    r.g = cast_params<double>(g);
    return r;
}

/// A random tap at each of c's cuts.
void random_taps(const TrainCase& c, Taps& taps, Rng& rng) {
    taps.clear();
    for (std::size_t k = 0; k < c.cuts.size(); ++k) {
        std::vector<std::vector<Matrixd>> pairs(static_cast<std::size_t>(c.B * c.cfg.n_heads));
        for (auto& layers : pairs) {
            for (int l = 1; l <= c.cfg.depth; ++l) {
                layers.push_back(random_matrix(c.cfg.layer_in(l), c.cfg.layer_out(l), rng));
            }
        }
        taps.push_back(std::move(pairs));
    }
}

/// Cuts of any length (empty pieces too) and a random tap at each cut.
void staged_cuts(TrainCase& c, Taps& taps, Rng& rng) {
    const Eigen::Index N = c.x.rows() / c.B;
    c.cuts = {0};
    while (c.cuts.back() < N) {
        c.cuts.push_back(std::min<Eigen::Index>(N, c.cuts.back() + uniform_int(rng, 0, 4)));
    }
    random_taps(c, taps, rng);
}

template <class T>
void staged_sweep(const char* name, int cases_per_mode, double bound) {
    mode_sweep(name, cases_per_mode, bound, [&](const Modes& base, int, int index, Rng& rng) {
        TrainCase c = train_case<T>(base, index, rng, false);
        Taps taps;
        staged_cuts(c, taps, rng);
        INFO("case " << index << ": " << to_string(c.cfg.update) << "/"
                     << to_string(c.cfg.retrieval) << "/" << to_string(c.cfg.gates) << " chunk "
                     << c.cfg.chunk << " B " << c.B << " N " << c.x.rows() / c.B << " pieces "
                     << c.cuts.size() - 1);
        const TrainResult ref = run_staged<double, titans::backend::Cpu>(c, taps);
        return compare_results(run_staged<T, Cuda>(c, taps), ref, c.cfg);
    });
}

template <class T>
void train_sweep(const char* name, int cases_per_mode, bool chained, double bound) {
    mode_sweep(name, cases_per_mode, bound, [&](const Modes& base, int, int index, Rng& rng) {
        const TrainCase c = train_case<T>(base, index, rng, chained);
        INFO("case " << index << ": " << to_string(c.cfg.update) << "/" << to_string(c.cfg.retrieval)
                     << "/" << to_string(c.cfg.gates) << " flags " << (index * 11) % 32
                     << " depth " << c.cfg.depth << " chunk " << c.cfg.chunk << " conv "
                     << c.cfg.use_conv << "/" << c.cfg.conv_kernel << " clip "
                     << c.cfg.max_grad_norm << " B " << c.B << " N " << c.x.rows() / c.B
                     << " pieces " << c.cuts.size() - 1);
        const TrainResult ref = run_chained<double, titans::backend::Cpu>(c);
        return compare_results(run_chained<T, Cuda>(c), ref, c.cfg);
    });
}
}  // namespace

TEST_CASE("cuda memory training: trace double", "[cuda]") {
    trace_sweep<double>("cuda memory training: trace double", 3, 1e-12);
}

TEST_CASE("cuda memory training: trace float", "[cuda]") {
    trace_sweep<float>("cuda memory training: trace float", 2, 1e-5);
}

// The training forward through the fused chunk kernel (FusedMemory::On; one launch runs a
// piece's full chunks and keeps each chunk's start memory as it loads it, FusedKeep): the
// trace, outputs and state against the CPU in double to rounding and in float within 1e-5, with
// heads that leave the state mid-chunk (the first piece short, then the full chunks, then a
// ragged tail), streams longer than one launch's chunks (fused_keep_chunks) and, case i, streams
// of stream_kind i (drawn, constant, periodic, huge in double, tiny; the head before them drawn); the launches
// counted: one per fused_keep_chunks full chunks, as one block a pair or as clusters of
// `ranks` blocks (each rank keeps its share of W and S).
template <class T>
void fused_trace_sweep(const char* name, int cases, double bound, int ranks = 0) {
    namespace tcu = titans::backend::cuda;
    tcu::set_fused_memory(tcu::FusedMemory::On);
    tcu::set_fused_cluster(ranks);
    double worst = 0.0;
    for (int i = 0; i < parity_cases(cases); ++i) {
        Rng rng(seed_for(name, static_cast<std::uint64_t>(i)));
        const MemoryConfig cfg = fused_config<T>(random_flags(Modes{}, rng), rng, ranks);
        const int b = cfg.chunk, B = uniform_int(rng, 1, 2);
        const int h0 = i % 3 == 0 ? 0 : uniform_int(rng, 1, b - 1) + (i % 2) * b;
        // A stream longer than one launch's chunks: case 1 (a constant stream) one block a pair,
        // case 0 (drawn) as clusters. The constant stream of the clusters' case 1 over 34 chunks
        // is ill-conditioned: one block a pair ends 1.6e-9 from the CPU's double there, the
        // clusters 6.1e-9, whether they keep the trace or ran a launch a chunk before.
        const bool long_case = ranks == 0 ? i == 1 : i == 0;
        const int chunks = long_case ? tcu::fused_keep_chunks + 2 : uniform_int(rng, 1, 4);
        const int N = chunks * b + (i % 2 == 0 ? 0 : uniform_int(rng, 1, b - 1));
        // Huge streams (x 1e3) can overflow a float memory within a few hundred tokens, the
        // CPU's float as well (NonFiniteError): float takes the tiny kind there instead.
        const int kind = std::is_same_v<T, float> && i % 5 == 3 ? 4 : i % 5;
        INFO(name << " case " << i << ": d_h " << cfg.head_dim() << " e " << cfg.expansion
                  << " chunk " << b << " gates " << to_string(cfg.gates) << " B " << B
                  << " head " << h0 << " N " << N << " stream kind " << kind);
        const long long launches = tcu::fused_launches(), clusters = tcu::fused_cluster_launches();
        worst = std::max(worst, trace_case<T>(cfg, random_params(cfg, rng), B, h0, N, rng, bound,
                                              false, kind));
        const int first = (b - h0 % b) % b, full = N > first ? (N - first) / b : 0;
        const int per = tcu::fused_keep_chunks, launched = (full + per - 1) / per;
        const long long ran = tcu::fused_launches() - launches;
        CHECK(ran == (h0 >= b ? 1 : 0) + launched);
        CHECK(tcu::fused_cluster_launches() - clusters == (ranks > 0 ? ran : 0));
    }
    tcu::set_fused_cluster(0);
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
    std::printf("%s: worst relative error %.3g (bound %.0e)\n", name, worst, bound);
}

TEST_CASE("cuda memory training: fused trace", "[cuda]") {
    fused_trace_sweep<double>("cuda fused trace double", 6, 1e-12);
    fused_trace_sweep<float>("cuda fused trace float", 5, 1e-5);
    fused_trace_sweep<double>("cuda fused trace, clusters of 2", 2, 1e-12, 2);
    fused_trace_sweep<float>("cuda fused trace float, clusters of 4", 1, 1e-5, 4);
}

/// A training case of the shapes the fused backward takes (fused_config), the gate modes in
/// turn, clipping off for every fourth: 1-4 full chunks (34,
/// more than one launch's fused_keep_chunks, for case 1 in double), a ragged tail for odd
/// cases, streams of stream_kind i % 5 (float: tiny for huge); one call (i % 3 == 0), pieces
/// cut at chunk boundaries (1) or anywhere (2: the sweep takes the partial chunks).
template <class T>
TrainCase fused_train_case(int i, Rng& rng, int ranks = 0) {
    namespace tcu = titans::backend::cuda;
    TrainCase c;
    Modes m;
    m.gates = std::vector<GateMode>{GateMode::DataDependent, GateMode::Constant,
                                    GateMode::PerChunk}[static_cast<std::size_t>((i + i / 3) % 3)];
    c.cfg = fused_config<T>(random_flags(m, rng), rng, ranks);
    if (i % 4 == 3) c.cfg.max_grad_norm = 0.0;  // no clipping
    for (double* v : {&c.cfg.theta_max, &c.cfg.constant_theta, &c.cfg.constant_eta,
                      &c.cfg.constant_alpha, &c.cfg.max_grad_norm}) {
        *v = static_cast<double>(static_cast<T>(*v));
    }
    c.p = cast_params<double>(cast_params<T>(random_params(c.cfg, rng)));
    c.g0 = cast_params<double>(cast_params<T>(random_params(c.cfg, rng)));
    c.B = uniform_int(rng, 1, 2);
    const int b = c.cfg.chunk;
    const int chunks = i == 1 && std::is_same_v<T, double> ? tcu::fused_keep_chunks + 2
                                                            : uniform_int(rng, 1, 4);
    const int N = chunks * b + (i % 2 == 1 ? uniform_int(rng, 1, b - 1) : 0);
    const int kind = std::is_same_v<T, float> && i % 5 == 3 ? 4 : i % 5;
    c.x = round_through<T>(stream_kind(random_matrix(c.B * N, c.cfg.d_model, rng), c.B, kind));
    c.dy = round_through<T>(random_matrix(c.B * N, c.cfg.d_model, rng));
    c.cuts = {0};
    while (i % 3 != 0 && c.cuts.back() < N) {
        const int step = i % 3 == 1 ? b * uniform_int(rng, 1, 2) : uniform_int(rng, 1, 2 * b);
        c.cuts.push_back(std::min<Eigen::Index>(N, c.cuts.back() + step));
    }
    if (c.cuts.back() != N) c.cuts.push_back(N);
    return c;
}

// The backward's full chunks through the fused kernel (memory_fused_backward.cuh;
// FusedMemory::On, set_fused_backward), its b x hidden arrays in shared memory, all spilled to
// the scratch, or two on chip (set_fused_backward_chip): dx,
// d_state_in and every gradient against the CPU in double to rounding and in float within
// 1e-5, every gate mode, clipping, residual, conv and normalisation drawn; the launches
// counted for one call (one per fused_keep_chunks full chunks); in double the pieces also
// reversed in stages with a tap at each cut (the staged Reverse, whose full chunks between
// taps run fused); with `ranks`, the training forward as clusters of that many blocks a pair
// (set_fused_cluster), whose trace the backward reverses.
template <class T>
void fused_backward_sweep(const char* name, int cases, double bound, int chip, int ranks = 0) {
    namespace tcu = titans::backend::cuda;
    tcu::set_fused_memory(tcu::FusedMemory::On);
    tcu::set_fused_cluster(ranks);
    tcu::set_fused_backward(true);
    tcu::set_fused_backward_chip(chip);
    double worst = 0.0;
    for (int i = 0; i < parity_cases(cases); ++i) {
        Rng rng(seed_for(name, static_cast<std::uint64_t>(i)));
        const TrainCase c = fused_train_case<T>(i, rng, ranks);
        const int b = c.cfg.chunk;
        const long long N = c.x.rows() / c.B;
        INFO(name << " case " << i << ": d_h " << c.cfg.head_dim() << " e " << c.cfg.expansion
                  << " chunk " << b << " gates " << to_string(c.cfg.gates) << " clip "
                  << c.cfg.max_grad_norm << " residual " << c.cfg.residual << " B " << c.B
                  << " N " << N << " pieces " << c.cuts.size() - 1);
        const TrainResult ref = run_chained<double, titans::backend::Cpu>(c);
        const long long launches = tcu::fused_backward_launches();
        const double e = compare_results(run_chained<T, Cuda>(c), ref, c.cfg);
        const long long ran = tcu::fused_backward_launches() - launches;
        INFO("error " << e << ", fused backward launches " << ran);
        CHECK(e <= bound);
        if (c.cuts.size() == 2) {
            CHECK(ran == (N / b + tcu::fused_keep_chunks - 1) / tcu::fused_keep_chunks);
        }
        worst = std::max(worst, e);
        if (std::is_same_v<T, double> && c.cuts.size() > 2) {  // staged, a tap at each cut
            Taps taps;
            random_taps(c, taps, rng);
            const double es = compare_results(run_staged<T, Cuda>(c, taps),
                                              run_staged<double, titans::backend::Cpu>(c, taps),
                                              c.cfg);
            INFO("staged with taps: error " << es);
            CHECK(es <= bound);
            worst = std::max(worst, es);
        }
    }
    tcu::set_fused_backward_chip(-1);
    tcu::set_fused_backward(false);
    tcu::set_fused_cluster(0);
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
    std::printf("%s: worst relative error %.3g (bound %.0e)\n", name, worst, bound);
}

TEST_CASE("cuda memory training: fused backward", "[cuda]") {
    fused_backward_sweep<double>("cuda fused backward double", 6, 1e-12, -1);
    fused_backward_sweep<double>("cuda fused backward double, all spilled", 3, 1e-12, 0);
    fused_backward_sweep<double>("cuda fused backward double, 2 on chip", 2, 1e-12, 2);
    fused_backward_sweep<float>("cuda fused backward float", 5, 1e-5, -1);
    fused_backward_sweep<double>("cuda fused backward double, cluster forward", 2, 1e-12, -1, 2);
}

// The same on the tensor cores, FusedMemory::Auto and set_fused_backward: TF32 allowed (the
// forward's fused kernel and the backward's both take TF32), or bfloat16 operands
// (FusedOperands::BF16: both kernels' products on bfloat16 operands with FP32 sums), against
// the CPU in double within the fused forward's bounds (TF32 1e-2, bfloat16 8e-2). A thread's
// stream context takes the TF32 setting of its first use, so each pass runs on a thread of its
// own.
void fused_backward_tensor_cores(const char* name, int cases, double bound, bool bf16) {
    namespace tcu = titans::backend::cuda;
    tcu::set_fused_backward(true);
    tcu::set_fused_operands(bf16 ? tcu::FusedOperands::BF16 : tcu::FusedOperands::Float);
    double worst = 0.0;
    for (int i = 0; i < parity_cases(cases); ++i) {
        Rng rng(seed_for(name, static_cast<std::uint64_t>(i)));
        const TrainCase c = fused_train_case<float>(i, rng);
        const TrainResult ref = run_chained<double, titans::backend::Cpu>(c);
        TrainResult r;
        long long ran = 0;
        std::thread([&] {
            tcu::set_allow_tf32(!bf16);
            const long long before = tcu::fused_backward_launches();
            r = run_chained<float, Cuda>(c);
            ran = tcu::fused_backward_launches() - before;
            tcu::set_allow_tf32(false);
        }).join();
        const double e = compare_results(r, ref, c.cfg);
        INFO(name << " case " << i << ": d_h " << c.cfg.head_dim() << " e " << c.cfg.expansion
                  << " chunk " << c.cfg.chunk << " gates " << to_string(c.cfg.gates) << " N "
                  << c.x.rows() / c.B << " pieces " << c.cuts.size() - 1 << ": error " << e
                  << ", fused backward launches " << ran);
        CHECK(e <= bound);
        if (i % 3 != 2) CHECK(ran >= 1);  // pieces cut anywhere may hold no full chunk
        worst = std::max(worst, e);
    }
    tcu::set_fused_operands(tcu::FusedOperands::Float);
    tcu::set_fused_backward(false);
    std::printf("%s: worst relative error %.3g (bound %.0e)\n", name, worst, bound);
}

TEST_CASE("cuda memory training: fused backward, TF32", "[cuda]") {
    fused_backward_tensor_cores("cuda fused backward tf32", 3, 1e-2, false);
}

TEST_CASE("cuda memory training: fused backward, bf16", "[cuda]") {
    fused_backward_tensor_cores("cuda fused backward bf16", 3, 8e-2, true);
}

TEST_CASE("cuda memory training: a wrong trace", "[cuda]") {
    // The comparison catches a deliberately wrong kept value (one chunk-start weight).
    Rng rng(seed_for("cuda memory training: a wrong trace", 0));
    Modes m;
    m.update = UpdateMode::Chunked;
    const MemoryConfig cfg = random_config(m, rng);
    const auto p = random_params(cfg, rng);
    NeuralMemory<double> cpu(cfg, p);
    CudaMemory<double> gpu(cfg, p);
    auto cs = cpu.make_state(2);
    auto gs = gpu.make_state(2);
    const Matrixd x = random_matrix(2 * 7, cfg.d_model, rng);
    NeuralMemory<double>::Trace ct;
    Matrixd y;
    cpu.forward(cs, x, y, ct);
    using K = titans::backend::MemoryKernels<Cuda, double>;
    auto xb = Transfer<Cuda, double>::upload(titans::view_of(x));
    auto yb = Transfer<Cuda, double>::allocate(x.rows(), x.cols());
    typename CudaTraining<double>::Trace gt;
    CudaTraining<double>::forward(cfg, K::prepare(cfg, gpu.shared_params()), gs,
                                  Transfer<Cuda, double>::view(std::as_const(xb)),
                                  Transfer<Cuda, double>::view(yb), gt);
    REQUIRE(compare_trace<double>(cfg, gt, ct) <= 1e-12);
    ct.kept.memory[1][0](0, 0) += 1e-6;
    CHECK(compare_trace<double>(cfg, gt, ct) > 1e-12);
}

/// A chunked memory of a random configuration with chunk `chunk` (double), for the tests of
/// the training forward's errors and waits.
struct ChunkedMemory {
    MemoryConfig cfg;
    titans::MemoryParamsd p;
    ChunkedMemory(Rng& rng, int chunk) {
        Modes m;
        m.update = UpdateMode::Chunked;
        cfg = random_config(m, rng);
        cfg.chunk = chunk;
        p = random_params(cfg, rng);
    }
    /// The training forward of x from gs (host in, host y out), its trace into gt.
    void train(CudaMemory<double>& gpu, typename CudaMemory<double>::State& gs, const Matrixd& x,
               Matrixd& y, typename CudaTraining<double>::Trace& gt) const {
        using K = titans::backend::MemoryKernels<Cuda, double>;
        using X = Transfer<Cuda, double>;
        auto xb = X::upload(titans::view_of(x));
        auto yb = X::allocate(x.rows(), x.cols());
        CudaTraining<double>::forward(cfg, K::prepare(cfg, gpu.shared_params()), gs,
                                      X::view(std::as_const(xb)), X::view(yb), gt);
        y.resize(x.rows(), x.cols());
        X::download(X::view(std::as_const(yb)), titans::view_of(y));
    }
};

TEST_CASE("cuda memory training: errors keep state", "[cuda]") {
    // A non-finite input fails the training forward and leaves the state as it was.
    Rng rng(seed_for("cuda memory training: errors keep state", 0));
    const ChunkedMemory c(rng, 2);
    CudaMemory<double> gpu(c.cfg, c.p);
    auto gs = gpu.make_state(1);
    (void)gpu.forward(gs, random_matrix(4, c.cfg.d_model, rng));
    const auto before = state_tensors(gs);
    Matrixd x = random_matrix(7, c.cfg.d_model, rng), y;
    x(5, 0) = std::numeric_limits<double>::quiet_NaN();  // the third chunk
    typename CudaTraining<double>::Trace gt;
    // The checks deferred to the call's end found it; the pieces ran again strictly and the
    // first failing check named its place: row 5 of the call, 4 tokens in.
    CHECK_THROWS_WITH(c.train(gpu, gs, x, y, gt), Catch::Contains("at sequence 0, position 9"));
    CHECK(gt.empty());
    CHECK(same_tensors(state_tensors(gs), before));
}

#if TITANS_CUDA_EMULATION
// A training forward waits for its finiteness checks once, not once per chunk: the host waits
// of a call over 2 chunks and over 8 are the same (counted by the emulator), and the results
// are the inference forward's.
TEST_CASE("cuda memory training: one wait for the checks", "[cuda]") {
    Rng rng(seed_for("cuda memory training: one wait", 0));
    const ChunkedMemory c(rng, 3);
    CudaMemory<double> gpu(c.cfg, c.p);
    std::vector<long> waits;
    for (const int chunks : {2, 8}) {
        const Matrixd x = random_matrix(2 * 3 * chunks, c.cfg.d_model, rng);
        auto gs = gpu.make_state(2);
        typename CudaTraining<double>::Trace gt;
        Matrixd y;
        const long before = cuda_emulation::host_waits();
        c.train(gpu, gs, x, y, gt);
        waits.push_back(cuda_emulation::host_waits() - before);
        auto is = gpu.make_state(2);
        CHECK(rel_error(y, gpu.forward(is, x)) <= 1e-12);
    }
    INFO("host waits: " << waits[0] << " over 2 chunks, " << waits[1] << " over 8");
    CHECK(waits[0] == waits[1]);
}
// The backward's launches a chunk (a depth-2 memory, lagged retrieval, full chunks), counted by
// the emulator as the difference between a trace of 6 chunks and one of 2, over 4. Per stage
// (memory_sweep.cuh): the key tape 4 kernels and 3 products (a_1 = k with the read's q and
// dy, act with act', the error, delta_1), the gates 1, the read 2 and 2 (act, y out), its
// reverse 1 and 4 (the act' between its layers) and dq 1, the chunk end 4 and 8 (its
// coefficients; dW, dS and
// the sums of every layer in one; then a layer's row terms, which also leave -diag(g) Delta and
// -diag(s) Delta for the two products that add the input's adjoint into abar), the
// coefficients reversed 1, the clipping 1 when on, the key pass's second-order terms 4 and 6,
// the gates' logits 1 when gated: 18 kernels, + 1 clipping, + 1 gated, and 23 products. Before
// 2026-12-02 the chunk end's input adjoint was two products into scratch and a kernel a layer,
// its dW, dS and sums two kernels a layer, and the read's inputs a copy of their own: 24.
TEST_CASE("cuda memory training: backward launches", "[cuda]") {
    Rng rng(seed_for("cuda memory training: backward launches", 0));
    for (const bool gated : {false, true}) {
        for (const bool clip : {false, true}) {
            Modes m;
            m.gates = gated ? titans::GateMode::DataDependent : titans::GateMode::Constant;
            MemoryConfig cfg = fused_config<double>(m, rng);
            cfg.max_grad_norm = clip ? 0.5 : 0.0;
            const auto p = random_params(cfg, rng);
            const NeuralMemory<double, Cuda> gpu(cfg, p);
            long launches[2], gemms[2];
            for (const int chunks : {2, 6}) {
                const int B = 2, N = chunks * cfg.chunk, k = chunks == 6;
                const Matrixd x = random_matrix(B * N, cfg.d_model, rng);
                const Matrixd dy = random_matrix(B * N, cfg.d_model, rng);
                auto st = gpu.make_state(B);
                typename NeuralMemory<double, Cuda>::Trace tr;
                Matrixd y, dx;
                gpu.forward(st, x, y, tr);
                auto g = titans::MemoryParamsd::zeros(cfg);
                launches[k] = -cuda_emulation::total_launches();
                gemms[k] = -cuda_emulation::gemm_calls();
                gpu.backward(tr, dy, dx, g);
                launches[k] += cuda_emulation::total_launches();
                gemms[k] += cuda_emulation::gemm_calls();
            }
            INFO("gated " << gated << " clip " << clip << ": " << launches[0] << " and "
                          << launches[1] << " launches, " << gemms[0] << " and " << gemms[1]
                          << " products");
            CHECK(launches[1] - launches[0] == 4 * (18 + (clip ? 1 : 0) + (gated ? 1 : 0)));
            CHECK(gemms[1] - gemms[0] == 4 * 23);
        }
    }
}

#endif

TEST_CASE("cuda memory training: double", "[cuda]") {
    train_sweep<double>("cuda memory training: double", 4, false, 1e-12);
}

TEST_CASE("cuda memory training: chained double", "[cuda]") {
    train_sweep<double>("cuda memory training: chained double", 4, true, 1e-12);
}

TEST_CASE("cuda memory training: staged double", "[cuda]") {
    staged_sweep<double>("cuda memory training: staged double", 3, 1e-12);
}

TEST_CASE("cuda memory training: staged float", "[cuda]") {
    staged_sweep<float>("cuda memory training: staged float", 1, 1e-5);
}

// NeuralMemory::read_weights_backward on CUDA (MAC's read of its segment-start memory
// reversed on the device) against the CPU's: dx, the weights' adjoint and W_Q's and W_O's
// gradients, every option flag, batches 1-2, 0-5 rows.
TEMPLATE_TEST_CASE("cuda memory: read backward", "[cuda]", float, double) {
    using T = TestType;
    const std::string name = std::string("cuda read backward ") + type_name<T>();
    mode_sweep(name.c_str(), 2, bound<T>(), [&](const Modes& base, int, int index, Rng& rng) {
        const TrainCase c = train_case<T>(base, index, rng, false);
        const int m = uniform_int(rng, 0, 5);
        std::vector<std::vector<Matrixd>> W(static_cast<std::size_t>(c.B * c.cfg.n_heads));
        std::vector<std::vector<Matrix<T>>> Wt;
        for (auto& layers : W) {
            for (int l = 1; l <= c.cfg.depth; ++l) {
                layers.push_back(round_through<T>(random_matrix(c.cfg.layer_in(l), c.cfg.layer_out(l), rng)));
            }
            Wt.push_back(cast_layers<T>(layers));
        }
        const Matrixd x = round_through<T>(random_matrix(c.B * m, c.cfg.d_model, rng));
        const Matrixd dy = round_through<T>(random_matrix(c.B * m, c.cfg.d_model, rng));
        auto g_ref = c.g0;
        auto g = cast_params<T>(c.g0);
        Matrixd dx_ref;
        Matrix<T> dx;
        std::vector<std::vector<Matrixd>> dW_ref;
        std::vector<std::vector<Matrix<T>>> dW;
        NeuralMemory<double>(c.cfg, c.p).read_weights_backward(W, x, c.B, dy, dx_ref, dW_ref, g_ref);
        CudaMemory<T>(c.cfg, cast_params<T>(c.p))
            .read_weights_backward(Wt, Matrix<T>(x.cast<T>()), c.B, Matrix<T>(dy.cast<T>()), dx, dW, g);
        INFO("case " << index << " B " << c.B << " rows " << m << " residual " << c.cfg.residual
                     << " norm " << c.cfg.normalize_qk);
        REQUIRE(dW.size() == dW_ref.size());
        double e = rel_error(Matrixd(dx.template cast<double>()), dx_ref, 1e-3);
        for (std::size_t i = 0; i < dW.size(); ++i) {
            e = std::max(e, rel_error(cast_layers<double>(dW[i]), dW_ref[i], 1e-3));
        }
        e = std::max(e, rel_error(Matrixd(g.w_q.template cast<double>()), g_ref.w_q, 1e-3));
        e = std::max(e, rel_error(Matrixd(g.w_o.template cast<double>()), g_ref.w_o, 1e-3));
        return std::max(e, rel_error(Matrixd(g.w_k.template cast<double>()), g_ref.w_k, 1e-3));
    });
}

TEST_CASE("cuda memory training: float", "[cuda]") {
    train_sweep<float>("cuda memory training: float", 2, true, 1e-5);
}

TEST_CASE("cuda memory training: wrong dy caught", "[cuda]") {
    // The comparison catches a deliberately wrong value: one entry of dy changed by 1e-6 on
    // the CUDA side moves dx or a gradient beyond the bound.
    Rng rng(seed_for("cuda memory training: wrong dy caught", 0));
    Modes m;
    m.update = UpdateMode::Chunked;
    m.retrieval = Retrieval::InChunk;
    TrainCase c = train_case<double>(m, 0, rng, true);
    const TrainResult ref = run_chained<double, titans::backend::Cpu>(c);
    REQUIRE(compare_results(run_chained<double, Cuda>(c), ref, c.cfg) <= 1e-12);
    c.dy(0, 0) += 1e-6;
    CHECK(compare_results(run_chained<double, Cuda>(c), ref, c.cfg) > 1e-12);
}

namespace {

/// The refusal tests' memory (chunk 3), a training forward of 2 x 4 tokens, gradients g (g0
/// drawn), dx and d_in, and unchanged(): whether g, dx and d_in are as they were.
struct Refusals {
    Rng rng{seed_for("cuda memory training: refusals", 0)};
    MemoryConfig cfg = config(rng);
    titans::MemoryParamsd p = random_params(cfg, rng);
    CudaMemory<double> mem{cfg, p};
    CudaMemory<double>::State st = mem.make_state(2);
    Matrixd x = random_matrix(2 * 4, cfg.d_model, rng);
    CudaMemory<double>::Trace trace;
    titans::MemoryParamsd g0 = random_params(cfg, rng), g = g0;
    Matrixd dx = Matrixd::Constant(1, 1, 7.0);
    titans::MemoryStateGradient<double> d_in;
    Refusals() {
        Matrixd y;
        mem.forward(st, x, y, trace);
    }
    static MemoryConfig config(Rng& rng) {
        Modes m;
        m.update = UpdateMode::Chunked;
        MemoryConfig c = random_config(m, rng);
        c.chunk = 3;
        return c;
    }
    bool unchanged() const {
        bool same = true;
        titans::MemoryParamsd::tensors(g, cfg, [&](const std::string& name, const auto& t) {
            titans::MemoryParamsd::tensors(g0, cfg, [&](const std::string& n2, const auto& t2) {
                if (n2 == name) same = same && identical(Matrixd(t), Matrixd(t2));
            });
        });
        return same && dx.rows() == 1 && dx(0, 0) == 7.0 && d_in.empty();
    }
};

}  // namespace

// The refusals throw the CPU's exception types and leave grads, dx and d_state_in as they were
// (gradients that overflow included: "cuda memory training: overflowing gradients").
TEST_CASE("cuda memory training: refusals", "[cuda]") {
    Refusals r;
    Rng& rng = r.rng;
    const MemoryConfig& cfg = r.cfg;
    CudaMemory<double>& mem = r.mem;
    const CudaMemory<double>::Trace& trace = r.trace;
    titans::MemoryParamsd& g = r.g;
    Matrixd& dx = r.dx;
    titans::MemoryStateGradient<double>& d_in = r.d_in;
    CHECK_THROWS_AS(mem.backward(trace, random_matrix(2 * 4 + 1, cfg.d_model, rng), dx, g, &d_in),
                    titans::ShapeError);
    CHECK(r.unchanged());
    CHECK_THROWS_AS(mem.backward(CudaMemory<double>::Trace{}, random_matrix(0, cfg.d_model, rng),
                                 dx, g, &d_in),
                    titans::ShapeError);
    CHECK(r.unchanged());
    {  // a moved-from trace reads as empty; a trace whose sizes were changed is refused
        CudaMemory<double>::Trace moved = trace, kept = std::move(moved);
        CHECK(moved.empty());
        const Matrixd dy8 = random_matrix(2 * 4, cfg.d_model, rng);
        REQUIRE_THROWS_NAMING(mem.backward(moved, dy8, dx, g, &d_in), titans::ShapeError,
                              "trace is empty");
        kept.chunks += 1;
        REQUIRE_THROWS_NAMING(mem.backward(kept, dy8, dx, g, &d_in), titans::ShapeError,
                              "trace.chunks");
        kept = trace;
        kept.memory.pop_back();
        REQUIRE_THROWS_NAMING(mem.backward(kept, dy8, dx, g, &d_in), titans::ShapeError,
                              "trace.memory.size()");
        kept = trace;
        kept.u = titans::backend::cuda::DeviceBuffer<double>(3);
        REQUIRE_THROWS_NAMING(mem.backward(kept, dy8, dx, g, &d_in), titans::ShapeError,
                              "trace.u.size()");
        CHECK(r.unchanged());
    }
    // d_state_out for a trace that ends inside a chunk (4 tokens, chunk 3): pending rows of
    // the wrong count.
    auto d_out = titans::MemoryStateGradient<double>::zeros(cfg, 2, 1);
    d_out.pending_a[0][0].resize(2, d_out.pending_a[0][0].cols());
    CHECK_THROWS_AS(mem.backward(trace, random_matrix(2 * 4, cfg.d_model, rng), dx, g, &d_in, &d_out),
                    titans::ShapeError);
    CHECK(r.unchanged());
}

// Gradients that overflow (dy finite, half the largest double): refused by the host call and
// by the view call, whose dx is the caller's to check, so the device's finiteness scan
// decides; the flat gradient on the device stays as it was. Backward of one trace twice gives
// the same result (the trace is not consumed).
TEST_CASE("cuda memory training: overflowing gradients", "[cuda]") {
    Refusals r;
    const Matrixd huge = Matrixd::Constant(2 * 4, r.cfg.d_model,
                                           std::numeric_limits<double>::max() / 2);
    REQUIRE_THROWS_AS(r.mem.backward(r.trace, huge, r.dx, r.g, &r.d_in), titans::NonFiniteError);
    CHECK(r.unchanged());
    Matrixd flat0(1, r.mem.parameter_count()), flat(1, r.mem.parameter_count());
    titans::detail::flatten_tensors(r.g0, r.cfg, flat0.data());
    using X = Transfer<Cuda, double>;
    auto gb = X::upload(titans::view_of(std::as_const(flat0)));
    const auto hb = X::upload(titans::view_of(huge));
    auto dxb = X::allocate(huge.rows(), huge.cols());
    REQUIRE_THROWS_AS(r.mem.backward(r.trace, X::view(hb), X::view(dxb), X::view(gb), &r.d_in),
                      titans::NonFiniteError);
    X::download(X::view(std::as_const(gb)), titans::view_of(flat));
    CHECK(identical(flat, flat0));
    CHECK(r.d_in.empty());
    const Matrixd dy = random_matrix(2 * 4, r.cfg.d_model, r.rng);
    Matrixd dx1, dx2;
    auto g1 = r.g0, g2 = r.g0;
    r.mem.backward(r.trace, dy, dx1, g1);
    r.mem.backward(r.trace, dy, dx2, g2);
    CHECK(identical(dx1, dx2));
}

// The q / k L2 normalisation on heads whose sums of squares overflow T (x scaled by 2^k; no
// learning, phi the identity, clipping off: tests/robustness/test_training_numerics.cpp shows
// the CPU right there): the CUDA forward, training forward and backward agree with the CPU's.
TEMPLATE_TEST_CASE("cuda memory training: qk norm", "[cuda]", float, double) {
    using T = TestType;
    Rng rng(seed_for("cuda memory training: qk norm"));
    MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 2, .chunk = 4};
    cfg.gates = GateMode::Constant;
    cfg.constant_theta = 0.0;
    cfg.qkv_activation = Activation::Identity;
    cfg.max_grad_norm = 0;
    const auto p = MemoryParams<T>::random(cfg, rng());
    const NeuralMemory<T> cpu(cfg, p);
    const CudaMemory<T> gpu(cfg, p);
    const int k = std::is_same_v<T, float> ? 100 : 900;
    const Matrix<T> x = random_matrix(8, cfg.d_model, rng).template cast<T>().unaryExpr(
        [k](T v) { return std::ldexp(v, k); });
    const Matrix<T> dy = random_matrix(8, cfg.d_model, rng).template cast<T>();
    auto sc = cpu.make_state(1);
    auto sg = gpu.make_state(1);
    CHECK(rel_error(gpu.forward(sg, x), cpu.forward(sc, x)) <= tol<T>());
    typename NeuralMemory<T>::Trace tc;
    typename CudaMemory<T>::Trace tg;
    Matrix<T> yc, yg, dxc, dxg;
    auto s1 = cpu.make_state(1);
    auto s2 = gpu.make_state(1);
    cpu.forward(s1, x, yc, tc);
    gpu.forward(s2, x, yg, tg);
    CHECK(rel_error(yg, yc) <= tol<T>());
    auto gc = MemoryParams<T>::zeros(cfg), gg = gc;
    cpu.backward(tc, dy, dxc, gc);
    gpu.backward(tg, dy, dxg, gg);
    CHECK(rel_error(dxg, dxc, 0.0) <= tol<T>());
    CHECK(rel_error(gg.w_q, gc.w_q) <= tol<T>());
    CHECK(gc.w_q.cwiseAbs().maxCoeff() > T(0));
}

// math §10's clipping where the squared gradient norm overflows T (x at 2^80 in float, 2^540
// in double, v and delta with it): the CUDA inference pass (its gradient-norm diagnostics
// too), training forward and backward match the CPU, whose scaled norm
// tests/robustness/test_training_numerics.cpp checks against the same inputs at a scale
// without overflow.
/// A stream of keys near the top of T's range (x 2^80 in float, 2^540 in double), clipping on:
/// the squared gradient norms overflow and the clip factor comes from the scaled norm, in the
/// forward, the training forward and the backward, as on the CPU. N rows, one sequence.
template <class T>
void clip_overflow_case(const MemoryConfig& cfg, int N) {
    Rng rng(seed_for("cuda memory: clip overflow"));
    const auto p = MemoryParams<T>::random(cfg, rng());
    const NeuralMemory<T> cpu(cfg, p);
    const CudaMemory<T> gpu(cfg, p);
    const int k = std::is_same_v<T, float> ? 80 : 540;
    const Matrix<T> x = random_matrix(N, cfg.d_model, rng, 0.5, 1.0).template cast<T>().unaryExpr(
        [k](T v) { return std::ldexp(v, k); });
    const Matrix<T> dy = random_matrix(N, cfg.d_model, rng).template cast<T>();
    titans::Diagnostics<T> dc, dg;
    auto sc = cpu.make_state(1);
    auto sg = gpu.make_state(1);
    CHECK(rel_error(gpu.forward(sg, x, &dg), cpu.forward(sc, x, &dc)) <= tol<T>());
    CHECK(rel_error(dg.grad_norm, dc.grad_norm) <= tol<T>());
    CHECK(std::isfinite(double(dc.grad_norm.maxCoeff())));
    typename NeuralMemory<T>::Trace tc;
    typename CudaMemory<T>::Trace tg;
    Matrix<T> yc, yg, dxc, dxg;
    auto s1 = cpu.make_state(1);
    auto s2 = gpu.make_state(1);
    cpu.forward(s1, x, yc, tc);
    gpu.forward(s2, x, yg, tg);
    CHECK(rel_error(yg, yc) <= tol<T>());
    auto gc = MemoryParams<T>::zeros(cfg), gg = gc;
    cpu.backward(tc, dy, dxc, gc);
    gpu.backward(tg, dy, dxg, gg);
    CHECK(rel_error(dxg, dxc, 0.0) <= tol<T>());
    CHECK(rel_error(gg.w_v, gc.w_v) <= tol<T>());
    CHECK(rel_error(gg.w_k, gc.w_k) <= tol<T>());
    CHECK(gc.w_k.cwiseAbs().maxCoeff() > T(0));
}

TEMPLATE_TEST_CASE("cuda memory: clip overflow", "[cuda]", float, double) {
    MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 2, .chunk = 4};
    cfg.gates = GateMode::Constant;
    cfg.constant_theta = 0.5;
    cfg.qkv_activation = Activation::Identity;
    cfg.max_grad_norm = 1.0;
    clip_overflow_case<TestType>(cfg, 12);
}

// The same through the fused kernels (forward and backward; FusedMemory::On,
// set_fused_backward), at a shape they take: two chunks of 32.
TEMPLATE_TEST_CASE("cuda memory: clip overflow, fused", "[cuda]", float, double) {
    namespace tcu = titans::backend::cuda;
    MemoryConfig cfg{.d_model = 64, .n_heads = 2, .depth = 2, .chunk = 32};
    cfg.expansion = 2;
    cfg.gates = GateMode::Constant;
    cfg.constant_theta = 0.5;
    cfg.qkv_activation = Activation::Identity;
    cfg.max_grad_norm = 1.0;
    tcu::set_fused_memory(tcu::FusedMemory::On);
    tcu::set_fused_backward(true);
    const long long launches = tcu::fused_backward_launches();
    clip_overflow_case<TestType>(cfg, 64);
    CHECK(tcu::fused_backward_launches() - launches == 1);
    tcu::set_fused_backward(false);
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
}

// The memory's staged training API on device views (forward_part, read_snapshot_backward,
// Reverse's down_to / tap / finish into the flat gradient: nothing crosses to the host) against
// the CPU's host-matrix API in double and CUDA's own host-matrix API: every primary mode, two
// parts, a read through the snapshot between them tapped into the sweep.
TEMPLATE_TEST_CASE("cuda memory train: staged views", "[cuda]", float, double) {
    using T = TestType;
    for (int i = 0; i < parity_cases(16); ++i) {
        Rng rng(seed_for("cuda memory train: staged views", static_cast<std::uint64_t>(i)));
        const StagedCase c = staged_case(rng, i);
        INFO("case " << i << " B " << c.B << " N " << c.N << " t1 " << c.t1 << " chunk "
                     << c.cfg.effective_chunk());
        const StagedResult ref = staged_host<double, titans::backend::Cpu>(c);
        const StagedResult got = staged_views<T, Cuda>(c);
        CHECK(note_error<T>("staged views", staged_error(got, ref)) <= bound<T>());
        CHECK(staged_error(got, staged_host<T, Cuda>(c)) <= bound<T>());
    }
}
