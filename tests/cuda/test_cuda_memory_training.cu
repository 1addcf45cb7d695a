// The neural memory's training pass on the CUDA backend (math §9), IN PROGRESS: the device
// trace and the training forward (backend/cuda/memory_training.cuh) against the CPU's
// (cpu/memory_training.hpp), every update, retrieval and gate mode with the other options
// drawn: outputs, the state after, and every kept tensor (input, conv tails, pre-conv
// products, gate logits, the memory at each chunk start). CPU double is the reference: CUDA
// double within 1e-12, CUDA float within 1e-5 of the same problem rounded to float. Outputs are
// poisoned (NaN) before each call. backward is not on the device yet (available = false).

#include <titans/backend/cuda/cuda.cuh>

#include "cuda_common.hpp"

namespace {

using namespace titans_test;

using titans::backend::Cuda;
using titans::backend::Transfer;

template <class T>
using CudaMemory = NeuralMemory<T, Cuda>;
template <class T>
using CudaTraining = titans::backend::MemoryTraining<Cuda, T>;

static_assert(!CudaTraining<float>::available && !CudaTraining<double>::available,
              "the CUDA memory backward is not done: the training pass must stay unavailable");

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
/// forward of N tokens on both backends; y, the state after and the trace compared.
template <class T>
double trace_case(const MemoryConfig& cfg, const titans::MemoryParamsd& p, int B, int h0, int N,
                  Rng& rng, double bound) {
    using K = titans::backend::MemoryKernels<Cuda, T>;
    NeuralMemory<double> cpu(cfg, p);
    CudaMemory<T> gpu(cfg, cast_params<T>(p));
    auto cs = cpu.make_state(B);
    auto gs = gpu.make_state(B);
    const Matrixd head = round_through<T>(random_matrix(static_cast<Eigen::Index>(B) * h0, cfg.d_model, rng));
    const Matrixd x = round_through<T>(random_matrix(static_cast<Eigen::Index>(B) * N, cfg.d_model, rng));
    Matrixd y0;
    cpu.forward(cs, head, y0);
    (void)gpu.forward(gs, head.cast<T>());
    NeuralMemory<double>::Trace ct;
    Matrixd y_cpu;
    cpu.forward(cs, x, y_cpu, ct);
    typename CudaTraining<T>::Trace gt;
    const Matrix<T> xt = x.cast<T>();
    auto xb = Transfer<Cuda, T>::upload(titans::view_of(xt));
    auto yb = Transfer<Cuda, T>::allocate(xt.rows(), xt.cols());
    if (yb.mem.size() > 0) {
        REQUIRE(cudaMemset(yb.mem.data(), 0xff, yb.mem.size() * sizeof(T)) == cudaSuccess);
    }
    const auto prepared = K::prepare(gpu.config(), gpu.shared_params());
    CudaTraining<T>::forward(gpu.config(), prepared, gs, Transfer<Cuda, T>::view(std::as_const(xb)),
                             Transfer<Cuda, T>::view(yb), gt);
    Matrix<T> y(xt.rows(), xt.cols());
    Transfer<Cuda, T>::download(Transfer<Cuda, T>::view(std::as_const(yb)), titans::view_of(y));
    REQUIRE(gs.position() == cs.position());
    const double ey = rel_error(y.template cast<double>(), y_cpu);
    const int s = uniform_int(rng, 0, B - 1), h = uniform_int(rng, 0, cfg.n_heads - 1);
    const double ew = rel_error(cast_layers<double>(gpu.current_weights(gs, s, h)),
                                cpu.current_weights(cs, s, h));
    const double et = compare_trace<T>(cfg, gt, ct);
    INFO("errors: outputs " << ey << ", weights " << ew << ", trace " << et);
    CHECK(std::max({ey, ew, et}) <= bound);
    return std::max({ey, ew, et});
}

template <class T>
void trace_sweep(const char* name, int cases_per_mode, double bound) {
    cases_per_mode = parity_cases(cases_per_mode);
    int index = 0;
    double worst = 0;
    for (const Modes& base : all_primary_modes()) {
        for (int k = 0; k < cases_per_mode; ++k, ++index) {
            Rng rng(seed_for(name, static_cast<std::uint64_t>(index)));
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
            worst = std::max(worst, trace_case<T>(cfg, p, B, h0, N, rng, bound));
        }
    }
    std::printf("%s: %d cases, worst relative error %.3g (bound %.0e)\n", name, index, worst, bound);
}

}  // namespace

TEST_CASE("cuda memory training: trace double", "[cuda]") {
    trace_sweep<double>("cuda memory training: trace double", 3, 1e-12);
}

TEST_CASE("cuda memory training: trace float", "[cuda]") {
    trace_sweep<float>("cuda memory training: trace float", 2, 1e-5);
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

TEST_CASE("cuda memory training: errors keep state", "[cuda]") {
    // A non-finite input fails the training forward and leaves the state as it was.
    Rng rng(seed_for("cuda memory training: errors keep state", 0));
    Modes m;
    m.update = UpdateMode::Chunked;
    MemoryConfig cfg = random_config(m, rng);
    cfg.chunk = 2;
    const auto p = random_params(cfg, rng);
    CudaMemory<double> gpu(cfg, p);
    auto gs = gpu.make_state(1);
    (void)gpu.forward(gs, random_matrix(4, cfg.d_model, rng));
    const auto before = state_tensors(gs);
    Matrixd x = random_matrix(7, cfg.d_model, rng);
    x(5, 0) = std::numeric_limits<double>::quiet_NaN();  // the third chunk
    using K = titans::backend::MemoryKernels<Cuda, double>;
    auto xb = Transfer<Cuda, double>::upload(titans::view_of(x));
    auto yb = Transfer<Cuda, double>::allocate(x.rows(), x.cols());
    typename CudaTraining<double>::Trace gt;
    CHECK_THROWS_AS(CudaTraining<double>::forward(cfg, K::prepare(cfg, gpu.shared_params()), gs,
                                                  Transfer<Cuda, double>::view(std::as_const(xb)),
                                                  Transfer<Cuda, double>::view(yb), gt),
                    titans::NonFiniteError);
    CHECK(gt.empty());
    CHECK(same_tensors(state_tensors(gs), before));
}
