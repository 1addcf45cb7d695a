// The neural memory on the CUDA backend against the CPU backend (math §1-5): every update,
// retrieval and gate mode with the 32 combinations of the other options, streams in pieces,
// reads, the memory after the last token, diagnostics, errors. CPU double is the reference:
// CUDA double within 1e-12, CUDA float (TF32 off) within 1e-5 of the same problem rounded
// to float on the CPU. Outputs are poisoned (NaN) before each kernel-level call.

#include <titans/backend/cuda/cuda.cuh>

#include "cuda_common.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <utility>

namespace {

using namespace titans_test;

using titans::backend::Cuda;
using titans::backend::Transfer;

template <class T>
using CudaMemory = NeuralMemory<T, Cuda>;

/// Pieces of random lengths (some 0) that add up to N.
std::vector<int> memory_pieces(int N, Rng& rng) {
    std::vector<int> out;
    int left = N;
    while (left > 0) {
        const int n = std::min(left, uniform_int(rng, 0, 9));
        out.push_back(n);
        left -= n;
    }
    return out;
}

/// Rows of sequence-major x for tokens [t, t+n) of every sequence.
Matrixd piece_rows(const Matrixd& x, int B, int N, int t, int n) {
    Matrixd out(static_cast<Eigen::Index>(B) * n, x.cols());
    for (int s = 0; s < B; ++s) {
        out.middleRows(static_cast<Eigen::Index>(s) * n, n) =
            x.middleRows(static_cast<Eigen::Index>(s) * N + t, n);
    }
    return out;
}
void put_rows(Matrixd& y, const Matrixd& piece, int B, int N, int t, int n) {
    for (int s = 0; s < B; ++s) {
        y.middleRows(static_cast<Eigen::Index>(s) * N + t, n) =
            piece.middleRows(static_cast<Eigen::Index>(s) * n, n);
    }
}

std::string detail_string(std::size_t i, int t, int n, double e) {
    std::ostringstream os;
    os << "piece " << i << " at t " << t << ", " << n << " rows, error " << e;
    return os.str();
}

/// The forward of x through the kernel seam, y poisoned with NaN before the call.
template <class T>
Matrix<T> kernel_forward(const CudaMemory<T>& mem, typename CudaMemory<T>::State& st,
                         const Matrix<T>& x) {
    using K = titans::backend::MemoryKernels<Cuda, T>;
    auto xb = Transfer<Cuda, T>::upload(titans::view_of(x));
    auto yb = Transfer<Cuda, T>::allocate(x.rows(), x.cols());
    if (yb.mem.size() > 0) {
        REQUIRE(cudaMemset(yb.mem.data(), 0xff, yb.mem.size() * sizeof(T)) == cudaSuccess);
    }
    const auto prepared = K::prepare(mem.config(), mem.shared_params());
    K::forward(mem.config(), prepared, st, Transfer<Cuda, T>::view(std::as_const(xb)),
               Transfer<Cuda, T>::view(yb), nullptr);
    Matrix<T> y(x.rows(), x.cols());
    Transfer<Cuda, T>::download(Transfer<Cuda, T>::view(std::as_const(yb)), titans::view_of(y));
    return y;
}

/// One case: x through the CPU (double, one call) and CUDA (T, in pieces), compared after
/// every piece's position: outputs, the memory after the last token, a read.
template <class T>
double compare_case(const MemoryConfig& cfg, const titans::MemoryParamsd& p, const Matrixd& x,
                    int B, int N, Rng& rng, double bound, std::vector<int> pieces = {}) {
    NeuralMemory<double> cpu(cfg, p);
    CudaMemory<T> gpu(cfg, cast_params<T>(p));
    auto cs = cpu.make_state(B);
    auto gs = gpu.make_state(B);
    const Matrixd xr = round_through<T>(x);
    Matrixd y_cpu;
    cpu.forward(cs, xr, y_cpu);
    Matrixd y_gpu(y_cpu.rows(), y_cpu.cols());
    int t = 0;
    std::string first_bad;
    if (pieces.empty()) {
        pieces = memory_pieces(N, rng);
    }
    for (std::size_t i = 0; i < pieces.size(); ++i) {
        const Matrix<T> xp = piece_rows(xr, B, N, t, pieces[i]).template cast<T>();
        const Matrix<T> yp = i % 2 == 0 ? kernel_forward(gpu, gs, xp) : gpu.forward(gs, xp);
        put_rows(y_gpu, yp.template cast<double>(), B, N, t, pieces[i]);
        const double e = rel_error(yp.template cast<double>(), piece_rows(y_cpu, B, N, t, pieces[i]));
        if (e > bound && first_bad.empty()) {
            first_bad = detail_string(i, t, pieces[i], e);
        }
        t += pieces[i];
    }
    INFO("first bad piece: " << first_bad);
    REQUIRE(gs.position() == cs.position());
    const double ey = rel_error(y_gpu, y_cpu);
    const int s = uniform_int(rng, 0, B - 1), h = uniform_int(rng, 0, cfg.n_heads - 1);
    const double ew = rel_error(cast_layers<double>(gpu.current_weights(gs, s, h)),
                                cpu.current_weights(cs, s, h));
    // Every pair at once (one download per layer): the same values as pair by pair.
    const auto all = gpu.current_weights(gs);
    REQUIRE(all.size() == static_cast<std::size_t>(B * cfg.n_heads));
    const auto one = gpu.current_weights(gs, s, h);
    const auto& same = all[static_cast<std::size_t>(s * cfg.n_heads + h)];
    REQUIRE(same.size() == one.size());
    for (std::size_t l = 0; l < one.size(); ++l) CHECK(same[l] == one[l]);
    const double es = rel_error(cast_layers<double>(gpu.current_momentum(gs, s, h)),
                                cpu.current_momentum(cs, s, h), 1e-12);
    const Matrixd q = round_through<T>(random_matrix(B * 3, cfg.d_model, rng));
    const double er = rel_error(gpu.read(gs, q.cast<T>()).template cast<double>(), cpu.read(cs, q));
    INFO("errors: outputs " << ey << ", weights " << ew << ", momentum " << es << ", read " << er);
    CHECK(std::max({ey, ew, es, er}) <= bound);
    return std::max({ey, ew, es, er});
}

/// The reference of T: the problem rounded to T, run in double on the CPU; the bound is
/// relative to it (double: rounding only; float: float arithmetic over the whole stream).
/// TITANS_CUDA_PARITY_CASES (environment) caps the cases per mode: a short sweep for slow
/// runs (compute-sanitizer).
template <class T>
void parity_sweep(const char* name, int cases_per_mode, double bound) {
    const auto run = [&](const Modes& base, int k, int index, Rng& rng) {
        const Modes m = with_flags(base, k % 32);
        Limits lim;
        lim.min_head_dim = 3;
        const MemoryConfig cfg = random_config(m, rng, lim);
        const int B = uniform_int(rng, 1, 3);
        const int N = random_tokens(cfg, rng, 40);
        const auto p = random_params(cfg, rng);
        const Matrixd x = random_matrix(static_cast<Eigen::Index>(B) * N, cfg.d_model, rng);
        INFO("case " << index << ": " << to_string(cfg.update) << "/" << to_string(cfg.retrieval)
                     << "/" << to_string(cfg.gates) << " flags " << k % 32 << " depth "
                     << cfg.depth << " chunk " << cfg.chunk << " conv " << cfg.conv_kernel << " clip "
                     << cfg.max_grad_norm << " B " << B << " N " << N);
        return compare_case<T>(cfg, p, x, B, N, rng, bound);
    };
    (void)mode_sweep(name, cases_per_mode, bound, run);
}

}  // namespace

TEST_CASE("cuda memory: parity, double", "[cuda]") {
    parity_sweep<double>("cuda parity double", 32, 1e-12);
}

TEST_CASE("cuda memory: parity, float", "[cuda]") {
    parity_sweep<float>("cuda parity float", 12, 1e-5);
}

namespace {

namespace tcu = titans::backend::cuda;

/// Pieces that add up to N: runs of whole chunks from a chunk start (the fused kernel's; the
/// first piece holds one), and short or ragged ones that leave a chunk pending (the unfused
/// path's).
std::vector<int> chunky_pieces(int N, int b, Rng& rng) {
    std::vector<int> out{std::min(N, pick(rng, std::vector<int>{b, 2 * b + uniform_int(rng, 0, 5)}))};
    int left = N - out[0];
    while (left > 0) {
        const int n = std::min(left, pick(rng, std::vector<int>{uniform_int(rng, 0, 9), b,
                                                                2 * b + uniform_int(rng, 0, 5),
                                                                3 * b - uniform_int(rng, 1, 5)}));
        out.push_back(n);
        left -= n;
    }
    return out;
}

/// Cases of fused_config through compare_case with the fused kernel on, its float products on
/// operands `ops` (TF32: allowed on the states' streams; BF16: FusedOperands::BF16), as
/// clusters of `ranks` blocks a pair where that is not 0: the worst error; every case must
/// have launched the kernel (the cluster kernel where ranks is not 0). The draws depend on T
/// and ranks only, so that the float sweeps on each kind of operands run the same cases; case
/// i's streams are of stream_kind i (drawn, constant, periodic, huge, tiny).
template <class T>
double fused_sweep(const char* name, int cases_per_mode, double bound, tcu::Operands ops,
                   int ranks = 0) {
    cases_per_mode = parity_cases(cases_per_mode);
    tcu::set_fused_memory(tcu::FusedMemory::On);
    tcu::set_fused_cluster(ranks);
    tcu::set_allow_tf32(ops == tcu::Operands::TF32);
    tcu::set_fused_operands(ops == tcu::Operands::BF16 ? tcu::FusedOperands::BF16
                                                        : tcu::FusedOperands::Float);
    double worst = 0;
    int index = 0;
    for (GateMode g : {GateMode::DataDependent, GateMode::PerChunk, GateMode::Constant}) {
        for (int k = 0; k < cases_per_mode; ++k, ++index) {
            Rng rng(seed_for(type_name<T>(), static_cast<std::uint64_t>(index + 100 * ranks)));
            Modes m = with_flags(Modes{}, (k * 7 + index) % 32);
            m.gates = g;
            MemoryConfig cfg = fused_config<T>(m, rng, ranks);
            if (index % 5 == 3 && cfg.max_grad_norm == 0) {
                cfg.max_grad_norm = 1;  // huge streams diverge an unclipped memory in float
            }
            const int B = uniform_int(rng, 1, 2);
            const int N = uniform_int(rng, 3 * cfg.chunk, 5 * cfg.chunk);
            const auto p = random_params(cfg, rng);
            // Streams as real ones come too: constant, periodic, huge (x 1e3), tiny (x 1e-6).
            const Matrixd x = stream_kind(
                random_matrix(static_cast<Eigen::Index>(B) * N, cfg.d_model, rng), B, index);
            INFO(name << " case " << index << " (stream kind " << index % 5 << "): "
                      << to_string(g) << " flags "
                      << (k * 7 + index) % 32 << " d_h " << cfg.head_dim() << " e "
                      << cfg.expansion << " chunk " << cfg.chunk << " clip " << cfg.max_grad_norm
                      << " B " << B << " N " << N);
            const long long launches = tcu::fused_launches();
            const long long clusters = tcu::fused_cluster_launches();
            worst = std::max(worst, compare_case<T>(cfg, p, x, B, N, rng, bound,
                                                    chunky_pieces(N, cfg.chunk, rng)));
            CHECK(tcu::fused_launches() > launches);
            CHECK((tcu::fused_cluster_launches() > clusters) == (ranks != 0));
        }
    }
    tcu::set_fused_cluster(0);
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
    tcu::set_fused_operands(tcu::FusedOperands::Float);
    tcu::set_allow_tf32(false);
    std::printf("%s: %d cases, worst relative error %.3g (bound %.0e)\n", name, index, worst,
                bound);
    return worst;
}

}  // namespace

// The fused chunk kernel (memory_fused.cuh) against the CPU, as the parity sweep: double to
// rounding, float within 1e-5; on the tensor cores, TF32 within 1e-2 (operands rounded to
// 10-bit mantissas, unit roundoff 2^-11 = 4.9e-4, through a stream of chunk updates) and
// bfloat16 within 8e-2 (7-bit mantissas, unit roundoff 2^-8 = 3.9e-3: each bound about 20
// unit roundoffs); the same float cases on each, each coarser rounding worse than the finer
// one (docs/cuda.md has the figures).
TEST_CASE("cuda memory: fused chunks", "[cuda]") {
    fused_sweep<double>("cuda fused double", 4, 1e-12, tcu::Operands::Exact);
    const double e = fused_sweep<float>("cuda fused float", 3, 1e-5, tcu::Operands::Exact);
    const double et = fused_sweep<float>("cuda fused tf32", 3, 1e-2, tcu::Operands::TF32);
    const double eb = fused_sweep<float>("cuda fused bf16", 3, 8e-2, tcu::Operands::BF16);
    CHECK(et > 2 * e);
    CHECK(eb > 2 * et);
}

// The fused kernel as clusters of 2, 4 and 8 blocks a pair (memory_cluster.cuh: W and S split
// over the ranks' shared memory, the read's and D2's partial sums and the rows' norms summed
// across the cluster), against the CPU as "fused chunks": double to rounding, float within
// 1e-5, TF32 and bfloat16 within their bounds there.
TEST_CASE("cuda memory: fused cluster", "[cuda]") {
    fused_sweep<double>("cuda cluster double, 2 ranks", 2, 1e-12, tcu::Operands::Exact, 2);
    fused_sweep<double>("cuda cluster double, 8 ranks", 1, 1e-12, tcu::Operands::Exact, 8);
    fused_sweep<float>("cuda cluster float, 4 ranks", 1, 1e-5, tcu::Operands::Exact, 4);
    fused_sweep<float>("cuda cluster tf32, 4 ranks", 1, 1e-2, tcu::Operands::TF32, 4);
    fused_sweep<float>("cuda cluster bf16, 4 ranks", 1, 8e-2, tcu::Operands::BF16, 4);
}

// Values near 1e20 in float (W_V scaled up, clipping on): D2's rows and X's have squared norms
// beyond float's range, so math §10's clip takes the scaled norm, in the cluster kernel from
// the ranks' shares of each row (mantissa and exponent): against the CPU, with one block a
// pair and as clusters of 4, both within float's bound.
TEST_CASE("cuda memory: cluster huge values", "[cuda]") {
    tcu::set_fused_memory(tcu::FusedMemory::On);
    for (int ranks : {0, 4}) {
        tcu::set_fused_cluster(ranks);
        Rng rng(seed_for("cuda cluster huge", static_cast<std::uint64_t>(ranks)));
        MemoryConfig cfg = fused_config<float>(Modes{}, rng, 4);
        cfg.max_grad_norm = 1;
        auto p = random_params(cfg, rng);
        p.w_v *= 1e20;
        const int B = 2, N = 3 * cfg.chunk;
        const Matrixd x = random_matrix(static_cast<Eigen::Index>(B) * N, cfg.d_model, rng);
        INFO("ranks " << ranks << " d_h " << cfg.head_dim() << " e " << cfg.expansion << " chunk "
                      << cfg.chunk);
        const long long clusters = tcu::fused_cluster_launches();
        (void)compare_case<float>(cfg, p, x, B, N, rng, 1e-5, {N});
        CHECK((tcu::fused_cluster_launches() > clusters) == (ranks != 0));
    }
    tcu::set_fused_cluster(0);
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
}

// A forward whose fused chunks diverge (values of 1e200, clipping off: the keys overflow after
// the first chunk end), with one block a pair and as clusters of 2: NonFiniteError, and every
// tensor of the state as it was, bit for bit.
TEST_CASE("cuda memory: fused errors keep state", "[cuda]") {
    tcu::set_fused_memory(tcu::FusedMemory::On);
    for (int ranks : {0, 2}) {
        tcu::set_fused_cluster(ranks);
        Rng rng(seed_for("cuda fused errors", static_cast<std::uint64_t>(ranks)));
        MemoryConfig cfg = fused_config<double>(Modes{}, rng, ranks);
        cfg.max_grad_norm = 0;
        auto p = random_params(cfg, rng);
        p.w_v *= 1e200;
        CudaMemory<double> gpu(cfg, p);
        auto gs = gpu.make_state(2);
        (void)gpu.forward(gs, random_matrix(2 * 5, cfg.d_model, rng));
        const auto before = state_tensors(gs);
        const int n = 3 * cfg.chunk;
        const Matrixd x = random_matrix(2 * n, cfg.d_model, rng);
        const long long launches = tcu::fused_launches(), clusters = tcu::fused_cluster_launches();
        INFO("ranks " << ranks);
        REQUIRE_THROWS_NAMING(gpu.forward(gs, x), titans::NonFiniteError, "expected finite");
        CHECK(tcu::fused_launches() > launches);
        CHECK((tcu::fused_cluster_launches() > clusters) == (ranks != 0));
        CHECK(gs.position() == 5);
        CHECK(same_tensors(state_tensors(gs), before));
    }
    tcu::set_fused_cluster(0);
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
}

namespace {

/// gpu.forward(st, x) with the fused kernel `mode`: the NonFiniteError's message ("" if none)
/// or, in a CallScope, "flagged" where the scope's flag was raised; a thrown call must leave
/// the state as it was.
std::string fused_outcome(const CudaMemory<double>& gpu, CudaMemory<double>::State& st,
                          const Matrixd& x, tcu::FusedMemory mode, bool scoped) {
    tcu::set_fused_memory(mode);
    const auto before = state_tensors(st);
    std::string what;
    if (scoped) {
        tcu::CallScope scope;
        (void)gpu.forward(st, x);
        what = scope.flagged() ? "flagged" : "";
    } else {
        try {
            (void)gpu.forward(st, x);
        } catch (const titans::NonFiniteError& e) {
            what = e.what();
            CHECK(same_tensors(state_tensors(st), before));
        }
    }
    tcu::set_fused_memory(tcu::FusedMemory::Auto);
    return what;
}

}  // namespace

namespace {

/// The check kernel's entries (flag_check_entries) after fused calls of whole chunks from a
/// chunk start (the output alone), of 3 rows (decoded whole: q, k, v, the gate logits, the
/// reads, the pending rows), of whole chunks from inside one (the reads and the pending rows;
/// W and S still the fused launch's, q, k, v and the logits the projection's), of 5 rows; the
/// outputs against the CPU's. The first call, whose reads the fused kernel writes in the output
/// product's layout, makes 6 kernels (counted by the emulator): the conv (with the L2 norm
/// where its blocks cover whole heads, else 7 kernels: the L2 norm after it), the tails'
/// advance, the rollback's row save, the fused kernel, the gate logits' rows and the checks
/// (the reads' transposition made one more), and copies no W or S with
/// cudaMemcpy: the fused kernel's first chunk copies them for the rollback as it loads them.
void fused_check_counts(MemoryConfig cfg, const titans::MemoryParamsd& p, Rng& rng) {
    cfg.theta_max = MemoryConfig{}.theta_max;  // a memory that stays finite over the calls
    const int B = 2, b = cfg.chunk, d = cfg.d_model;
    const long long P = static_cast<long long>(B) * cfg.n_heads, dh = cfg.head_dim(),
                    h = cfg.layer_out(1);
    const CudaMemory<double> gpu(cfg, p);
    NeuralMemory<double> cpu(cfg, p);
    auto st = gpu.make_state(B);
    auto cs = cpu.make_state(B);
#if TITANS_CUDA_EMULATION
    long kernels = 0;
    unsigned long long copied = 0;  // device to device, by cudaMemcpy(Async)
#endif
    const auto checked = [&](int N) {
        const long long launches = tcu::fused_launches(), before = tcu::flag_check_entries();
        const Matrixd x = random_matrix(B * N, d, rng);
        tcu::set_fused_memory(tcu::FusedMemory::On);
#if TITANS_CUDA_EMULATION
        const long k0 = cuda_emulation::total_launches();
        const unsigned long long c0 = cuda_emulation::device_copy_bytes();
#endif
        const Matrixd y = gpu.forward(st, x);
#if TITANS_CUDA_EMULATION
        kernels = cuda_emulation::total_launches() - k0;
        copied = cuda_emulation::device_copy_bytes() - c0;
#endif
        tcu::set_fused_memory(tcu::FusedMemory::Auto);
        CHECK(rel_error(y, cpu.forward(cs, x)) <= 1e-12);
        return std::pair{tcu::fused_launches() - launches, tcu::flag_check_entries() - before};
    };
    const auto output = [&](long long N) { return B * N * d; };
    const long long pending = P * 3 * 2 * (dh + h);  // 3 rows of A and Delta, both layers
    CHECK(checked(2 * b) == std::pair{1LL, output(2 * b)});
#if TITANS_CUDA_EMULATION
    CHECK(kernels == (cfg.normalize_qk && !tcu::conv_norms(dh) ? 7 : 6));
    // The rollback's copy of W and S made by the fused kernel: the copies move the conv tails
    // alone, less than one layer's W.
    CHECK(copied < static_cast<unsigned long long>(P * dh * h) * sizeof(double));
#endif
    // 3 rows a sequence: decoded whole, the conv in the decode kernel (q, k, v and the gate
    // logits checked after it)
    CHECK(checked(3) == std::pair{0LL, output(3) + P * 3 * (4 * dh + 3) + pending});
    // From position 3: b - 3 rows unfused (a chunk end), a fused chunk, 3 pending rows.
    CHECK(checked(2 * b) == std::pair{1LL, output(2 * b) + P * 2 * b * dh + pending});
    // 2 b + 5 rows from position 3: no fused launch, the projection's kernels check.
    CHECK(checked(5) == std::pair{0LL, output(5) + P * 5 * dh + P * 8 * 2 * (dh + h)});
}

/// Hostile pieces (W_V x 1e100 to 1e308; W_V, W_Q or w_theta x 1e300 and x's rows from N / 3
/// on x 1e10): the outcome
/// (fused_outcome) with the fused kernel on equals the one with it off and, where the error is
/// the projections', the CPU's; the CPU throws where they do. For pieces of whole chunks and
/// from inside one, in a CallScope and outside, the first sequence's stream tiny or not. Each
/// kind of outcome must come up.
void fused_check_outcomes(const MemoryConfig& cfg, const titans::MemoryParamsd& p, Rng& rng) {
    const int B = 2, b = cfg.chunk, d = cfg.d_model;
    std::set<std::string> seen;
    bool second = false;  // an error named at sequence 1 (the first one's stream kept tiny)
    struct Hostile {
        double v, q, theta, gain;  // W_V's, W_Q's and w_theta's factors, x's
    };
    for (const Hostile k :
         {Hostile{1e100, 1, 1, 1}, Hostile{1e200, 1, 1, 1}, Hostile{1e300, 1, 1, 1},
          Hostile{1e305, 1, 1, 1}, Hostile{1e308, 1, 1, 1}, Hostile{1e300, 1, 1, 1e10},
          Hostile{1, 1e300, 1, 1e10}, Hostile{1, 1, 1e300, 1e10}}) {
        auto big = p;
        big.w_v *= k.v;
        big.w_q *= k.q;
        big.w_theta *= k.theta;
        const CudaMemory<double> gpu(cfg, big);
        for (const int prefix : {0, 5}) {
            for (const int N : {b, 3 * b}) {
                for (const int shape : {0, 1, 2, 3}) {  // bit 0: in a CallScope; bit 1: tiny first
                    Matrixd head = random_matrix(B * prefix, d, rng, 0.5, 1.0);
                    Matrixd x = random_matrix(B * N, d, rng, 0.5, 1.0);
                    for (int sq = 0; sq < B; ++sq) {  // the gain from a third of the way on
                        x.middleRows(sq * N + N / 3, N - N / 3) *= k.gain;
                    }
                    if ((shape & 2) != 0) {
                        head.topRows(prefix) *= 1e-200;
                        x.topRows(N) *= 1e-200;
                    }
                    std::string named[2], cpu_named;
                    {  // the CPU's own checks
                        NeuralMemory<double> cpu(cfg, big);
                        auto cs = cpu.make_state(B);
                        try {
                            if (prefix > 0) (void)cpu.forward(cs, head);
                        } catch (const titans::NonFiniteError&) {
                        }
                        try {
                            (void)cpu.forward(cs, x);
                        } catch (const titans::NonFiniteError& e) {
                            cpu_named = (shape & 1) != 0 ? "flagged" : e.what();
                        }
                    }
                    for (const int fused : {0, 1}) {
                        auto st = gpu.make_state(B);
                        if (prefix > 0) {
                            (void)fused_outcome(gpu, st, head, tcu::FusedMemory::Off, false);
                        }
                        named[fused] = fused_outcome(
                            gpu, st, x, fused ? tcu::FusedMemory::On : tcu::FusedMemory::Off,
                            (shape & 1) != 0);
                    }
                    INFO("W_V x " << k.v << ", W_Q x " << k.q << ", w_theta x " << k.theta
                                  << ", x x " << k.gain << ", prefix " << prefix << ", N " << N
                                  << ", shape " << shape << ": " << named[0]);
                    CHECK(named[1] == named[0]);
                    // The CPU checks at each chunk end, so it may name an earlier error of
                    // the memory's; it throws where the GPU does, and names projections alike.
                    CHECK(named[1].empty() == cpu_named.empty());
                    if (cpu_named.find("projections") != std::string::npos) {
                        CHECK(named[1] == cpu_named);
                    }
                    seen.insert(named[0].substr(0, named[0].find(" at ")));
                    second = second || named[0].find("at sequence 1") != std::string::npos;
                }
            }
        }
    }
    CHECK(seen.count("NeuralMemory::forward: a non-finite memory read") == 1);
    CHECK(seen.count("NeuralMemory::forward: non-finite memory weights, momentum or key errors "
                     "(surprise)") == 1);
    CHECK(seen.count("NeuralMemory::forward: the projections of x (q, k, v or gate logits) "
                     "overflow") == 1);
    CHECK(seen.count("flagged") == 1);
    CHECK(seen.count("") == 1);
    CHECK(second);
}

}  // namespace

// The fused launches check what they write: each chunk's reads, and W and S where a launch
// ends the call's last chunk; the check kernel reads only the rest (fused_check_counts). The
// errors they name are the check kernel's (fused_check_outcomes; clipping off, theta_max 1e3:
// a chunk end can overflow W before a read does). One block a pair with q and k normalised,
// and clusters of 2 without.
TEST_CASE("cuda memory: fused launches check what they write", "[cuda]") {
    for (const int ranks : {0, 2}) {
        Rng rng(seed_for("cuda fused checks", static_cast<std::uint64_t>(ranks)));
        MemoryConfig cfg = fused_config<double>(Modes{}, rng, ranks);
        cfg.gates = GateMode::DataDependent;
        cfg.max_grad_norm = 0;
        cfg.theta_max = 1e3;
        cfg.normalize_qk = ranks == 0;  // q's check in the L2 norm's kernel, or in the conv's
        const auto p = random_params(cfg, rng);
        INFO("ranks " << ranks << ", d_h " << cfg.head_dim() << ", hidden " << cfg.layer_out(1)
                      << ", chunk " << cfg.chunk << ", heads " << cfg.n_heads);
        tcu::set_fused_cluster(ranks);
        const long long clusters = tcu::fused_cluster_launches();
        fused_check_counts(cfg, p, rng);
        fused_check_outcomes(cfg, p, rng);
        CHECK((tcu::fused_cluster_launches() > clusters) == (ranks != 0));
        tcu::set_fused_cluster(0);
    }
}

// q and k normalised in the conv kernel (memory_conv.cuh, norm_tile) where its blocks of 128
// columns cover whole heads (d_h 32, 64, 128), and by the L2 norm kernel after it otherwise
// (d_h 16, 48: the emulator counts which ran, and that K = 4 took its compiled row loop),
// against the CPU (double to rounding, float within 1e-5): one head, and 3 heads (a block
// holding k's and v's columns where d_h is 32), tiles of 32 rows and ragged ones, pieces of
// every length, streams of every kind (float: but x 1e3, whose drift is not the norm's), and
// rows whose sums of squares overflow (W_Q and W_K x 1e155 in double, x 1e20 in float: the
// scaled norm of detail/norm_scale.hpp; the norms of the keys stay finite).
TEMPLATE_TEST_CASE("cuda memory: the L2 norm in the conv kernel", "[cuda]", float, double) {
    using T = TestType;
    const double bound = std::is_same_v<T, double> ? 1e-12 : 1e-5;
    const double big = std::is_same_v<T, double> ? 1e155 : 1e20;
    int index = 0;
    for (const int dh : {16, 32, 48, 64, 128}) {
        for (const int heads : {1, 3}) {
            for (const bool huge : {false, true}) {
                Rng rng(seed_for(std::string("cuda conv norm ") + type_name<T>(),
                                  static_cast<std::uint64_t>(index)));
                MemoryConfig cfg;
                cfg.normalize_qk = true;
                cfg.d_head = dh;
                cfg.n_heads = heads;
                cfg.d_model = uniform_int(rng, 8, 40);
                cfg.depth = uniform_int(rng, 1, 2);
                cfg.expansion = uniform_int(rng, 1, 2);
                cfg.chunk = pick(rng, std::vector<int>{1, 8, 32});
                cfg.conv_kernel = pick(rng, std::vector<int>{1, 4});
                cfg.validate();
                const int B = 2, N = uniform_int(rng, 40, 80);
                auto p = random_params(cfg, rng);
                if (huge) {
                    p.w_q *= big;
                    p.w_k *= big;
                }
                // float: no x 1e3 streams (kind 3), on which a float memory drifts up to 3e-5
                // from the reference over the stream, with the L2 norm kernel too (d_h 16)
                const int kind = std::is_same_v<T, float> && index % 5 == 3 ? 0 : index;
                const Matrixd x = stream_kind(
                    random_matrix(static_cast<Eigen::Index>(B) * N, cfg.d_model, rng), B, kind);
                INFO("d_h " << dh << ", heads " << heads << ", huge " << huge << ", chunk "
                            << cfg.chunk << ", conv " << cfg.conv_kernel << ", N " << N
                            << ", stream kind " << kind % 5);
#if TITANS_CUDA_EMULATION
                const void* norm = reinterpret_cast<const void*>(&tcu::l2_rows_kernel<T>);
                const void* k4 = reinterpret_cast<const void*>(&tcu::conv_tile_kernel<T, 4>);
                const void* any_k = reinterpret_cast<const void*>(&tcu::conv_tile_kernel<T, 0>);
                const long before = cuda_emulation::launches(norm),
                           before_k4 = cuda_emulation::launches(k4),
                           before_any = cuda_emulation::launches(any_k);
#endif
                std::vector<int> pieces{N - N / 3};  // a ragged tile at its end
                for (const int n : random_pieces(rng, N / 3, 32)) pieces.push_back(n);
                (void)compare_case<T>(cfg, p, x, B, N, rng, bound, pieces);
#if TITANS_CUDA_EMULATION
                CHECK((cuda_emulation::launches(norm) > before) == !tcu::conv_norms(dh));
                // K = 4 (the default) on the row loop compiled for it, other K on the general one
                const bool four = cfg.use_conv && cfg.conv_kernel == 4;
                CHECK((cuda_emulation::launches(k4) > before_k4) == four);
                CHECK((cuda_emulation::launches(any_k) > before_any) == !four);
#endif
                ++index;
            }
        }
    }
}

namespace {

/// A mid-sized case with every default on (data-dependent gates, conv, clipping).
struct Fixture {
    MemoryConfig cfg;
    titans::MemoryParamsd p;
    Fixture(std::uint64_t seed, Retrieval r, int chunk) {
        Rng rng(seed);
        cfg.d_model = 24;
        cfg.n_heads = 3;
        cfg.depth = 2;
        cfg.expansion = 2;
        cfg.chunk = chunk;
        cfg.retrieval = r;
        p = random_params(cfg, rng);
    }
};

}  // namespace

TEST_CASE("cuda memory: diagnostics, read_weights", "[cuda]") {
    for (Retrieval r : {Retrieval::Lagged, Retrieval::InChunk}) {
        Rng rng(seed_for("cuda diag", static_cast<std::uint64_t>(r)));
        const Fixture f(rng(), r, 5);
        NeuralMemory<double> cpu(f.cfg, f.p);
        CudaMemory<double> gpu(f.cfg, f.p);
        auto cs = cpu.make_state(2);
        auto gs = gpu.make_state(2);
        const Matrixd x = random_matrix(2 * 13, f.cfg.d_model, rng);
        Diagnostics<double> dc, dg;
        const Matrixd yc = cpu.forward(cs, x, &dc);
        const Matrixd yg = gpu.forward(gs, x, &dg);
        CHECK(rel_error(yg, yc) <= 1e-12);
        CHECK(rel_error(dg.loss, dc.loss) <= 1e-12);
        CHECK(rel_error(dg.grad_norm, dc.grad_norm) <= 1e-12);
        std::vector<std::vector<Matrixd>> weights;
        for (int s = 0; s < 2; ++s) {
            for (int h = 0; h < f.cfg.n_heads; ++h) {
                weights.push_back(cpu.current_weights(cs, s, h));
            }
        }
        const Matrixd q = random_matrix(2 * 4, f.cfg.d_model, rng);
        CHECK(rel_error(gpu.read_weights(weights, q, 2), cpu.read_weights(weights, q, 2)) <= 1e-12);
    }
}

TEST_CASE("cuda memory: real streams", "[cuda]") {
    // Constant rows, a repeated short pattern, bursts, huge and tiny magnitudes.
    Rng rng(seed_for("cuda streams"));
    const Fixture f(rng(), Retrieval::InChunk, 8);
    const int N = 70;
    const Matrixd row = random_matrix(1, f.cfg.d_model, rng);
    const Matrixd pattern = random_matrix(3, f.cfg.d_model, rng);
    for (int kind = 0; kind < 4; ++kind) {
        Matrixd x(N, f.cfg.d_model);
        for (int t = 0; t < N; ++t) {
            x.row(t) = kind == 0 ? row : pattern.row(t % 3);
        }
        if (kind == 2) {
            x *= 1e3;
        } else if (kind == 3) {
            x *= 1e-6;
        }
        NeuralMemory<double> cpu(f.cfg, f.p);
        CudaMemory<double> gpu(f.cfg, f.p);
        auto cs = cpu.make_state(1);
        auto gs = gpu.make_state(1);
        INFO("stream kind " << kind);
        CHECK(rel_error(gpu.forward(gs, x), cpu.forward(cs, x)) <= 1e-12);
        CHECK(rel_error(gpu.current_weights(gs, 0, 1), cpu.current_weights(cs, 0, 1)) <= 1e-12);
    }
}

// The non-finite checks of a forward call run together at its end, 12 row sets a launch,
// where a launch per checked buffer ran once (3 + 1 + 2 depth a one-token call, 10 at depth
// 2), then one per stage (3): one token at a time, a chunk ending inside some calls, one
// launch of flag_rows_kernel a call at depth 2; a deeper memory's sets take more (2 at depth
// 6). Outputs as the CPU's; the overflow messages are the CPU's ("cuda memory:
// errors leave the state"). Counted by the emulator (its launches per kernel): a GPU run
// skips the counts.
TEST_CASE("cuda memory: the checks in one launch", "[cuda]") {
    for (const int depth : {2, 6}) {
        Rng rng(seed_for("cuda check launches", static_cast<std::uint64_t>(depth)));
        Fixture f(rng(), Retrieval::Lagged, 3);
        f.cfg.depth = depth;
        f.cfg.gates = titans::GateMode::DataDependent;
        f.p = random_params(f.cfg, rng);
        NeuralMemory<double> cpu(f.cfg, f.p);
        CudaMemory<double> gpu(f.cfg, f.p);
        auto cs = cpu.make_state(2);
        auto gs = gpu.make_state(2);
        for (int t = 0; t < 5; ++t) {  // the call at t = 2 ends a chunk
            const Matrixd x = random_matrix(2, f.cfg.d_model, rng);
#if TITANS_CUDA_EMULATION
            const void* kernel =
                reinterpret_cast<const void*>(&titans::backend::cuda::flag_rows_kernel<double>);
            const long before = cuda_emulation::launches(kernel);
#endif
            const Matrixd yg = gpu.forward(gs, x);
            INFO("depth " << depth << ", token " << t);
#if TITANS_CUDA_EMULATION
            // Every check at the call's end, 12 row sets a launch: q, k, v and the gate
            // logits, the read, two sets per layer (the pending rows' a and delta, or, after
            // a chunk end, W and S), the output.
            const long sets = 4 + 1 + 2L * depth + 1;
            CHECK(cuda_emulation::launches(kernel) - before == (sets + 11) / 12);
#endif
            CHECK(rel_error(yg, cpu.forward(cs, x)) <= 1e-12);
        }
    }
}

namespace {

/// Host reference of flag_rows_kernel: per slot, the smallest capped key of the rows (of the
/// sets' P x rows x cols, strides ld and ps) that hold a non-finite entry.
template <class T>
std::vector<int> flags_reference(const std::vector<T>& x,
                                 const std::vector<titans::backend::cuda::FlagRows<T>>& sets,
                                 const std::vector<long long>& at, int slots, int cap, int none) {
    std::vector<int> flags(static_cast<std::size_t>(slots), none);
    for (std::size_t i = 0; i < sets.size(); ++i) {
        const auto& f = sets[i];
        for (long long p = 0; p < f.P; ++p) {
            for (long long r = 0; r < f.rows; ++r) {
                bool bad = false;
                for (int c = 0; c < f.cols; ++c) {
                    const T v = x[static_cast<std::size_t>(at[i] + p * f.ps + r * f.ld + c)];
                    bad = bad || !std::isfinite(v);
                }
                if (bad) {
                    const long long key = std::min<long long>((p / f.div) * f.a + r * f.b, cap - 1);
                    int& slot = flags[static_cast<std::size_t>(f.slot)];
                    slot = std::min(slot, static_cast<int>(key));
                }
            }
        }
    }
    return flags;
}

}  // namespace

// flag_rows_kernel alone against a host reference: 1 to 12 row sets a launch, flat (rows end
// to end: a warp per 512 entries) and strided (padding past each row, between matrices, or
// both: a warp per row, the padding NaN and never flagged), widths 1 to 100 and a set of 197,184
// entries (386 warps, the last partial), NaN and infinities planted at random entries (none
// in some sets, several in others), finite extremes elsewhere (the largest finite value,
// subnormals), keys capped; then the deferred form (raise set, flags untouched).
TEMPLATE_TEST_CASE("cuda memory: the non-finite check kernel", "[cuda]", float, double) {
    using T = TestType;
    namespace cu = titans::backend::cuda;
    using Lim = std::numeric_limits<T>;
    constexpr int slots = 5, none = 0x7f7f7f7f;
    for (int c = 0; c < 16; ++c) {
        Rng rng(seed_for(std::string("cuda flag rows ") + type_name<T>(), static_cast<std::uint64_t>(c)));
        const int count = c == 0 ? 1 : uniform_int(rng, 1, cu::flag_sets_max);
        const int cap = c % 4 == 3 ? 40 : 1 << 30;
        std::vector<cu::FlagRows<T>> sets;
        std::vector<long long> at;
        std::vector<T> x;
        for (int i = 0; i < count; ++i) {
            cu::FlagRows<T> f{};
            const bool big = c == 0 || (c == 5 && i == 0);
            f.P = big ? 3 : uniform_int(rng, 1, 5);
            f.rows = big ? 1027 : uniform_int(rng, 1, 40);
            f.cols = big ? 64 : pick(rng, std::vector<int>{1, 3, 7, 32, 33, 64, 100});
            const bool flat = big || uniform_int(rng, 0, 1) == 1;
            // Strided: padding past each row, or only between the matrices (P >= 2).
            f.ld = flat ? f.cols : f.cols + uniform_int(rng, 0, 3);
            if (!flat && f.ld == f.cols) {
                f.P = std::max<long long>(f.P, 2);
            }
            f.ps = flat ? f.rows * f.ld
                        : f.rows * f.ld + uniform_int(rng, f.ld == f.cols ? 1 : 0, 5);
            if (!flat && f.ld > f.cols && uniform_int(rng, 0, 2) == 0) {
                f.ps = 0;  // every matrix the same rows (as the output's check, P = 1)
                f.P = 1;
            }
            CHECK(f.flat() == flat);
            f.slot = uniform_int(rng, 0, slots - 1);
            f.div = uniform_int(rng, 1, 3);
            f.a = uniform_int(rng, 0, 1000);
            f.b = uniform_int(rng, 0, 30);
            const long long span = (f.P - 1) * f.ps + f.rows * f.ld;
            at.push_back(static_cast<long long>(x.size()));
            const std::size_t base = x.size();
            x.resize(base + static_cast<std::size_t>(span), Lim::quiet_NaN());  // padding: NaN
            for (long long p = 0; p < f.P; ++p) {
                for (long long r = 0; r < f.rows; ++r) {
                    for (int k = 0; k < f.cols; ++k) {
                        const int kind = uniform_int(rng, 0, 30);
                        const T v = kind == 0 ? Lim::max() : kind == 1 ? -Lim::denorm_min()
                                    : static_cast<T>(uniform(rng, -2.0, 2.0));
                        x[base + static_cast<std::size_t>(p * f.ps + r * f.ld + k)] = v;
                    }
                }
            }
            const int planted = c == 1 ? 0 : uniform_int(rng, 0, 3);
            for (int j = 0; j < planted; ++j) {
                const long long p = uniform_int(rng, 0, static_cast<int>(f.P) - 1),
                                r = uniform_int(rng, 0, static_cast<int>(f.rows) - 1);
                const int k = uniform_int(rng, 0, f.cols - 1), kind = uniform_int(rng, 0, 2);
                x[base + static_cast<std::size_t>(p * f.ps + r * f.ld + k)] =
                    kind == 0 ? Lim::quiet_NaN() : kind == 1 ? Lim::infinity() : -Lim::infinity();
            }
            sets.push_back(f);
        }
        const cu::DeviceBuffer<T> dx = cu::upload_array(x.data(), x.size());
        cu::FlagSets<T> fs{};
        fs.first[0] = 0;
        for (int i = 0; i < count; ++i) {
            fs.set[i] = sets[static_cast<std::size_t>(i)];
            fs.set[i].x = dx.data() + at[static_cast<std::size_t>(i)];
            fs.first[i + 1] = fs.first[i] + cu::flag_warps(fs.set[i]);
        }
        fs.count = count;
        const std::vector<int> ref = flags_reference(x, sets, at, slots, cap, none);
        INFO("case " << c << ": " << count << " sets");
        const std::vector<int> start(slots, none);
        cu::DeviceBuffer<int> flags = cu::upload_array(start.data(), start.size());
        const unsigned zero = 0;
        cu::DeviceBuffer<unsigned> raise = cu::upload_array(&zero, 1);
        const cudaStream_t sm = cu::thread_context().stream();
        for (const bool deferred : {false, true}) {
            cu::launch(cu::flag_rows_kernel<T>, cu::warp_blocks(fs.first[count]), 256, sm, fs,
                       flags.data(), cap, deferred ? raise.data() : nullptr);
            cu::check(cudaStreamSynchronize(sm), "cudaStreamSynchronize (test)");
            std::vector<int> got(slots);
            unsigned raised = 0;
            cu::check(cudaMemcpy(got.data(), flags.data(), slots * sizeof(int),
                                 cudaMemcpyDeviceToHost), "cudaMemcpy (test)");
            cu::check(cudaMemcpy(&raised, raise.data(), sizeof(unsigned), cudaMemcpyDeviceToHost),
                      "cudaMemcpy (test)");
            CHECK(got == ref);  // the deferred launch leaves the flags as the first one set them
            CHECK(raised == (deferred && ref != start ? 1u : 0u));
        }
        if (c == 1) {
            CHECK(ref == start);  // nothing planted: nothing flagged
        }
    }
}

/// A chunk's end coefficients (math §4) over the pair's row cf (the forward's layout).
template <class T>
struct EndCoefficients {
    int n;
    __device__ void operator()(T* cf) const {
        titans::chunk_end_coefficients<T>(n, cf, cf + n, cf + 2 * n, cf + 5 * n, cf + 6 * n,
                                          cf + 7 * n, cf + 7 * n + 1, cf + 7 * n + 2);
    }
};

/// The host copy of a device buffer.
template <class T>
std::vector<T> host_copy(const titans::backend::cuda::DeviceBuffer<T>& b) {
    std::vector<T> out(b.size());
    titans::backend::cuda::check(cudaMemcpy(out.data(), b.data(), b.size() * sizeof(T),
                                            cudaMemcpyDeviceToHost),
                                 "cudaMemcpy");
    return out;
}

namespace {

/// The running block's linear index in the grid (x fastest).
__device__ unsigned linear_block() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

/// Each thread writes lin 1000 + t into its block's dynamic shared memory, then (after the
/// cluster's barrier) reads entry t of the block ranked after its own in the cluster (n
/// blocks a cluster) into out[lin blockDim.x + t]; ranks[lin] = its block's rank.
__global__ void cluster_next_kernel(int* out, int* ranks, unsigned n) {
    int* mine = titans::backend::cuda::dynamic_shared<int>();
    const unsigned r = titans::backend::cuda::cluster_rank(), lin = linear_block();
    mine[threadIdx.x] = static_cast<int>(lin * 1000 + threadIdx.x);
    if (threadIdx.x == 0) {
        ranks[lin] = static_cast<int>(r);
    }
    titans::backend::cuda::cluster_sync();
    const int* next = titans::backend::cuda::cluster_shared(static_cast<const int*>(mine),
                                                            (r + 1) % n);
    out[lin * blockDim.x + threadIdx.x] = next[threadIdx.x];
    titans::backend::cuda::cluster_sync();  // no block leaves while another reads its memory
}

/// Every block of a cluster of n: out[lin][j] = the sum of the cluster's rows in[.][j] in rank
/// order, each read from its block's shared memory.
__global__ void cluster_sum_kernel(const double* in, double* out, unsigned n, int width) {
    double* mine = titans::backend::cuda::dynamic_shared<double>();
    const unsigned lin = linear_block();
    for (int j = static_cast<int>(threadIdx.x); j < width; j += static_cast<int>(blockDim.x)) {
        mine[j] = in[static_cast<long long>(lin) * width + j];
    }
    titans::backend::cuda::cluster_sync();
    for (int j = static_cast<int>(threadIdx.x); j < width; j += static_cast<int>(blockDim.x)) {
        double sum = 0;
        for (unsigned q = 0; q < n; ++q) {
            sum += titans::backend::cuda::cluster_shared(static_cast<const double*>(mine), q)[j];
        }
        out[static_cast<long long>(lin) * width + j] = sum;
    }
    titans::backend::cuda::cluster_sync();
}

/// The rank CUDA gives block (x, y, z) in clusters of c: its place in its cluster, x fastest.
unsigned cluster_rank_of(unsigned x, unsigned y, unsigned z, dim3 c) {
    return x % c.x + c.x * (y % c.y + c.y * (z % c.z));
}

/// The linear index in `grid` of the block ranked q in the cluster (of shape c) that holds
/// block (x, y, z): the cluster's origin plus q's place, x fastest.
unsigned cluster_member(unsigned x, unsigned y, unsigned z, dim3 grid, dim3 c, unsigned q) {
    const unsigned qx = x - x % c.x + q % c.x, qy = y - y % c.y + q / c.x % c.y,
                   qz = z - z % c.z + q / (c.x * c.y);
    return qx + grid.x * (qy + grid.y * qz);
}

/// Calls f(x, y, z, linear index) for every block of `grid`, x fastest.
template <class F>
void for_blocks(dim3 grid, F&& f) {
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) {
                f(x, y, z, x + grid.x * (y + grid.y * z));
            }
        }
    }
}

}  // namespace

// Thread-block clusters (launch_cluster, cluster_rank, cluster_sync, cluster_shared: the
// distributed shared memory a cluster kernel will use): 1-D, 2-D and 3-D clusters of 1 to 8
// blocks; every block's rank as CUDA numbers it, each thread reading the next block's shared
// memory after the barrier, a sum across the
// cluster's blocks in rank order (the same bits as on the host); a cluster of 16 (past the
// portable 8) and a grid that is not a multiple of the cluster refused with CudaError.
TEST_CASE("cuda launch: clusters", "[cuda]") {
    namespace cu = titans::backend::cuda;
    for (const auto& [grid, cluster] : std::vector<std::pair<dim3, dim3>>{
             {dim3(6), dim3(2)}, {dim3(8), dim3(8)}, {dim3(4, 6), dim3(2, 3)},
             {dim3(4, 2, 4), dim3(2, 1, 2)}, {dim3(3), dim3(1)}}) {
        const unsigned n = cluster.x * cluster.y * cluster.z;
        const unsigned blocks = grid.x * grid.y * grid.z, threads = 96;
        INFO("grid " << grid.x << " x " << grid.y << " x " << grid.z << ", cluster " << cluster.x
                     << " x " << cluster.y << " x " << cluster.z);
        {
            std::vector<int> start(static_cast<std::size_t>(blocks) * threads, -1);
            cu::DeviceBuffer<int> out = cu::upload_array(start.data(), start.size());
            cu::DeviceBuffer<int> ranks = cu::upload_array(start.data(), blocks);
            cu::launch_cluster(cluster_next_kernel, grid, dim3(threads), threads * sizeof(int),
                               cluster, cudaStream_t{}, out.data(), ranks.data(), n);
            const std::vector<int> got = host_copy(out), rank = host_copy(ranks);
            bool all = true;
            for_blocks(grid, [&](unsigned x, unsigned y, unsigned z, unsigned lin) {
                const unsigned r = cluster_rank_of(x, y, z, cluster);
                const unsigned next = cluster_member(x, y, z, grid, cluster, (r + 1) % n);
                all = all && rank[lin] == static_cast<int>(r);
                for (unsigned t = 0; t < threads; ++t) {
                    const int want = static_cast<int>(next * 1000 + t);
                    all = all && got[static_cast<std::size_t>(lin) * threads + t] == want;
                }
            });
            CHECK(all);
        }
        Rng rng(seed_for("cuda clusters", n));
        const int width = 150;
        std::vector<double> in(static_cast<std::size_t>(blocks) * width);
        for (double& v : in) v = uniform(rng, -1.0, 1.0);
        cu::DeviceBuffer<double> din = cu::upload_array(in.data(), in.size()),
                                 dout(in.size());
        cu::launch_cluster(cluster_sum_kernel, grid, dim3(64), width * sizeof(double), cluster,
                           cudaStream_t{}, din.data(), dout.data(), n, width);
        const std::vector<double> sums = host_copy(dout);
        bool same = true;
        const auto w = static_cast<std::size_t>(width);
        for_blocks(grid, [&](unsigned x, unsigned y, unsigned z, unsigned lin) {
            for (std::size_t j = 0; j < w; ++j) {
                double sum = 0;
                for (unsigned q = 0; q < n; ++q) {  // rank q's block, in rank order
                    sum += in[cluster_member(x, y, z, grid, cluster, q) * w + j];
                }
                same = same && sums[lin * w + j] == sum;
            }
        });
        CHECK(same);
    }
    cu::DeviceBuffer<int> out(16 * 32), ranks(16);
    CHECK_THROWS_AS(cu::launch_cluster(cluster_next_kernel, dim3(16), dim3(32), 32 * sizeof(int),
                                       dim3(16), cudaStream_t{}, out.data(), ranks.data(), 16u),
                    titans::CudaError);
    CHECK_THROWS_AS(cu::launch_cluster(cluster_next_kernel, dim3(3), dim3(32), 32 * sizeof(int),
                                       dim3(2), cudaStream_t{}, out.data(), ranks.data(), 2u),
                    titans::CudaError);
}

// pair_local runs a pair's serial recurrence against a shared-memory copy of the pair's
// first `head` entries: the same bits as a thread per pair on device memory, for heads in
// shared memory and past its 48 KB (then in place), and entries past the head untouched.
TEMPLATE_TEST_CASE("cuda launch: per-pair recurrences", "[cuda]", float, double) {
    using T = TestType;
    namespace cu = titans::backend::cuda;
    Rng rng(seed_for("cuda pair_local", sizeof(T)));
    const long long big = 48 * 1024 / static_cast<long long>(sizeof(T)) + 5;
    for (const auto& [P, b, head] : std::vector<std::array<long long, 3>>{
             {1, 1, 10}, {7, 16, 7 * 16 + 3}, {33, 64, 7 * 64 + 3}, {3, 8, big}}) {
        const long long stride = head + 11;
        std::vector<T> v(static_cast<std::size_t>(P * stride));
        for (T& x : v) x = static_cast<T>(uniform(rng, 0.05, 0.95));
        auto fast = cu::upload_array(v.data(), v.size());
        auto plain = cu::upload_array(v.data(), v.size());
        const EndCoefficients<T> coefficients{static_cast<int>(b)};
        // the last entry of the head and one past it: the first is written back, the second
        // never seen (nor written) by the local copy
        const long long last = head - 1;
        cu::pair_local(cudaStream_t{}, fast.data(), P, stride, head,
                       [=] __device__(unsigned, T* local, T* dev) {
                           coefficients(local);
                           local[last] += T(1);
                           dev[last + 1] += T(2);
                       });
        T* pp = plain.data();
        cu::each(cudaStream_t{}, P, [=] __device__(unsigned p) {
            T* cf = pp + p * stride;
            coefficients(cf);
            cf[last] += T(1);
            cf[last + 1] += T(2);
        });
        INFO("P " << P << " b " << b << " head " << head);
        const std::vector<T> a = host_copy(fast), e = host_copy(plain);
        CHECK(a == e);
        CHECK(a != v);
    }
}

// sum_rows against a plain sum in long double, for row counts around its slices.
TEMPLATE_TEST_CASE("cuda launch: row sums", "[cuda]", float, double) {
    using T = TestType;
    namespace cu = titans::backend::cuda;
    Rng rng(seed_for("cuda sum_rows", sizeof(T)));
    for (const auto& [rows, cols] : std::vector<std::array<long long, 2>>{
             {0, 3}, {1, 1}, {5, 24}, {17, 7}, {1000, 3}, {4097, 24}}) {
        std::vector<T> x(static_cast<std::size_t>(std::max(rows * cols, 1LL)));
        for (T& e : x) {
            e = static_cast<T>(uniform(rng, -1.0, 1.0) * (uniform_int(rng, 0, 9) == 0 ? 1e3 : 1.0));
        }
        auto xb = cu::upload_array(x.data(), x.size());
        cu::DeviceBuffer<T> out(static_cast<std::size_t>(cols));
        const T* xp = xb.data();
        const long long c = cols;
        cu::sum_rows(cudaStream_t{}, rows, cols,
                     [=] __device__(unsigned r, unsigned j) { return T(2) * xp[r * c + j]; },
                     out.data());
        const std::vector<T> got = host_copy(out);
        for (long long j = 0; j < cols; ++j) {
            long double sum = 0, mag = 0;
            for (long long r = 0; r < rows; ++r) {
                sum += 2.0L * x[static_cast<std::size_t>(r * cols + j)];
                mag += std::fabs(2.0L * x[static_cast<std::size_t>(r * cols + j)]);
            }
            INFO("rows " << rows << " cols " << cols << " column " << j);
            const double eps = std::numeric_limits<T>::epsilon();
            CHECK(std::fabs(static_cast<double>(got[static_cast<std::size_t>(j)] - sum)) <=
                  4 * eps * std::sqrt(static_cast<double>(rows) + 1) * static_cast<double>(mag) + 1e-300);
        }
    }
}

// Segments of at most 4 rows of a depth-2 memory with lagged retrieval (decode) run the read
// and the key pass in one launch of decode_rows_kernel (memory_decode.cuh), which also copies
// the keys and gate logits into the pending rows and, in a call of at most 4 rows a
// sequence, normalises q and k: against the CPU in both precisions, both activations the
// memory takes, with and without the residual, with and without the q/k norm, each gate mode,
// one token a call and pieces of 2-4 rows, and the same cases with the kernel off
// (FusedMemory::Off: the batched products). Under the emulator: one launch a segment, none
// when off.
TEMPLATE_TEST_CASE("cuda memory: decode kernel", "[cuda]", float, double) {
    using T = TestType;
    const double bound = std::is_same_v<T, double> ? 1e-12 : 1e-5;
    int index = 0;
    for (const Activation act : {Activation::SiLU, Activation::GELU}) {
        for (const bool residual : {false, true}) {
            // each (activation, residual) with its own q/k norm and gate mode
            const int v = (act == Activation::SiLU ? 0 : 2) + (residual ? 1 : 0);
            for (const tcu::FusedMemory mode : {tcu::FusedMemory::Auto, tcu::FusedMemory::Off}) {
                Rng rng(seed_for("cuda decode kernel", static_cast<std::uint64_t>(index++)));
                Fixture f(rng(), Retrieval::Lagged, 5);
                f.cfg.activation = act;
                f.cfg.residual = residual;
                f.cfg.normalize_qk = v != 1;
                f.cfg.gates = v == 2   ? titans::GateMode::Constant
                              : v == 3 ? titans::GateMode::PerChunk
                                       : titans::GateMode::DataDependent;
                f.p = random_params(f.cfg, rng);
                const int B = 2, N = 17;
                const Matrixd x = random_matrix(B * N, f.cfg.d_model, rng);
                std::vector<int> pieces(7, 1);  // 7 single tokens, then 2, 4, 3 and one
                for (const int n : {2, 4, 3, 1}) pieces.push_back(n);
                tcu::set_fused_memory(mode);
#if TITANS_CUDA_EMULATION
                const void* kernel =
                    reinterpret_cast<const void*>(&tcu::decode_rows_kernel<T>);
                const long before = cuda_emulation::launches(kernel);
#endif
                INFO(to_string(act) << " residual " << residual << " norm " << f.cfg.normalize_qk
                                    << " gates " << to_string(f.cfg.gates) << " kernel "
                                    << (mode == tcu::FusedMemory::Off ? "off" : "on"));
                const double e = compare_case<T>(f.cfg, f.p, x, B, N, rng, bound, pieces);
                tcu::set_fused_memory(tcu::FusedMemory::Auto);
                CHECK(e <= bound);
#if TITANS_CUDA_EMULATION
                // a segment per piece, or two where a piece crosses a chunk end (at 5, 10, 15)
                const long launched = cuda_emulation::launches(kernel) - before;
                CHECK(launched == (mode == tcu::FusedMemory::Off ? 0 : 7 + 4 + 2));
#endif
            }
        }
    }
}

namespace {

/// A decode case of 2 heads of d_h with expansion e and data-dependent gates (the fixture's
/// other settings), B streams of 17 tokens, fed as 7 single tokens and then pieces of 2, 4, 3
/// and 1 (13 segments: a piece crossing a chunk end at 5, 10, 15 makes two).
struct WideDecode {
    Fixture f;
    Matrixd x;
    std::vector<int> pieces;
    static constexpr int N = 17, segments = 7 + 4 + 2;
    WideDecode(Rng& rng, int dh, int e, int B, bool residual)
        : f(rng(), Retrieval::Lagged, 5), pieces(7, 1) {
        f.cfg.d_model = 2 * dh;
        f.cfg.n_heads = 2;
        f.cfg.expansion = e;
        f.cfg.residual = residual;
        f.cfg.gates = titans::GateMode::DataDependent;
        f.p = random_params(f.cfg, rng);
        x = random_matrix(B * N, f.cfg.d_model, rng);
        for (const int n : {2, 4, 3, 1}) pieces.push_back(n);
    }
};

}  // namespace

// The decode kernel with heads wider than the fixture's (h 16): h 36 (d_h 12, e 3), 128 (d_h
// 32, e 4) and 256 (d_h 64, e 4, the headline's), so that each warp takes several rows of W2 in
// the error's way back (4 at once, decode_rows_per_warp), some groups cut short by h, the
// first layer's slices of W1's rows are many, a few or one (decode_w1_slices), and the first
// layer's and second layer's loops run past their unrolled 16; 4 pairs (512 threads a block
// in float) and, at h 256, 130 (more than decode_wide_pairs: 256 threads); against the CPU
// over 17 tokens, chunk ends included (the pending rows Delta_1 enter the updates there).
TEMPLATE_TEST_CASE("cuda memory: decode kernel, wide heads", "[cuda]", float, double) {
    using T = TestType;
    const double bound = std::is_same_v<T, double> ? 1e-12 : 1e-5;
    struct Shape {
        int dh, e, B;
    };
    const Shape shapes[] = {{12, 3, 2}, {32, 4, 2}, {64, 4, 2}, {64, 4, 65}};
    int index = 0;
    for (const auto& [dh, e, B] : shapes) {
        Rng rng(seed_for("cuda decode kernel, wide heads", static_cast<std::uint64_t>(index++)));
        const WideDecode w(rng, dh, e, B, index == 1);
        INFO("d_h " << dh << " expansion " << e << " streams " << B << " threads "
                    << tcu::decode_block_threads<T>(2LL * B));
#if TITANS_CUDA_EMULATION
        const void* kernel = reinterpret_cast<const void*>(&tcu::decode_rows_kernel<T>);
        const long before = cuda_emulation::launches(kernel);
#endif
        CHECK(compare_case<T>(w.f.cfg, w.f.p, w.x, B, w.N, rng, bound, w.pieces) <= bound);
#if TITANS_CUDA_EMULATION
        CHECK(cuda_emulation::launches(kernel) - before == w.segments);
#endif
    }
}

// The decode kernel as clusters of 2, 4 and 8 blocks a pair (decode_cluster_kernel,
// set_decode_cluster): each block on its share of the hidden columns (h 36 over 8 ranks: shares
// of 5 and a last one of 1), the second layer's sums added across the blocks in rank order
// through distributed shared memory, the conv's columns strided over the blocks, each block's
// own q/k norm, the lead block alone writing the rows the blocks share; against the CPU over 17 tokens in pieces of 1-4, chunk
// ends included, in both precisions. Under the emulator: the cluster kernel's launches counted,
// none where the pairs are more than decode_wide_pairs (B 65 x 2 heads: the one-block kernel
// instead), and set_decode_cluster's refusal of other sizes, the switch as it was.
TEMPLATE_TEST_CASE("cuda memory: decode kernel as clusters", "[cuda]", float, double) {
    using T = TestType;
    const double bound = std::is_same_v<T, double> ? 1e-12 : 1e-5;
    struct Shape {
        int dh, e, B, ranks;
    };
    const Shape shapes[] = {{12, 3, 2, 8}, {32, 4, 2, 2}, {64, 4, 3, 4}, {16, 2, 65, 4}};
    int index = 0;
    for (const auto& [dh, e, B, ranks] : shapes) {
        Rng rng(seed_for("cuda decode clusters", static_cast<std::uint64_t>(index++)));
        WideDecode w(rng, dh, e, B, index % 2 == 0);
        w.f.cfg.normalize_qk = index != 2;
        const bool clustered = 2LL * B <= tcu::decode_wide_pairs;
        INFO("d_h " << dh << " expansion " << e << " streams " << B << " ranks " << ranks
                    << (clustered ? "" : " (too many pairs: one block a pair)"));
        tcu::set_decode_cluster(ranks);
        CHECK(tcu::decode_cluster_ranks(2LL * B) == (clustered ? ranks : 1));
#if TITANS_CUDA_EMULATION
        const void* kernel = reinterpret_cast<const void*>(&tcu::decode_cluster_kernel<T>);
        const void* single = reinterpret_cast<const void*>(&tcu::decode_rows_kernel<T>);
        const long before = cuda_emulation::launches(kernel),
                   before_single = cuda_emulation::launches(single);
#endif
        const double err = compare_case<T>(w.f.cfg, w.f.p, w.x, B, w.N, rng, bound, w.pieces);
        tcu::set_decode_cluster(0);
        CHECK(err <= bound);
#if TITANS_CUDA_EMULATION
        CHECK(cuda_emulation::launches(kernel) - before == (clustered ? w.segments : 0));
        CHECK(cuda_emulation::launches(single) - before_single == (clustered ? 0 : w.segments));
#endif
    }
    tcu::set_decode_cluster(4);
    for (const int bad : {-1, 3, 5, 16}) {
        CHECK_THROWS_AS(tcu::set_decode_cluster(bad), titans::ConfigError);
        CHECK(tcu::decode_cluster() == 4);
    }
    tcu::set_decode_cluster(0);
}

// A decode call (one token a sequence, no chunk end) of the headline kind of memory (depth 2,
// lagged retrieval, conv, q/k norm, data-dependent gates) makes one product for the
// projections and the gate logits, the decode kernel (first the conv, phi and the gate
// logits' bias and layout of its pair's columns, then the read, the key pass, the q/k norm,
// the keys' and gates' pending rows, each saved for the call's transaction before it is
// overwritten), the checks and the output product: 2 kernels and 2 GEMMs, inside a CallScope
// (the checks raise its flag) as outside (the flags cleared by a memset and read back). It
// made 7 and 3, then 4 and 2 with the row save and 3 and 2 with the conv a launch of their
// own (2026-11-29). Counted by the emulator; the outputs against the CPU everywhere.
TEST_CASE("cuda memory: decode in few launches", "[cuda]") {
    Rng rng(seed_for("cuda decode launches"));
    Fixture f(rng(), Retrieval::Lagged, 5);
    f.cfg.gates = titans::GateMode::DataDependent;
    f.p = random_params(f.cfg, rng);
    NeuralMemory<double> cpu(f.cfg, f.p);
    CudaMemory<double> gpu(f.cfg, f.p);
    auto cs = cpu.make_state(2);
    auto gs = gpu.make_state(2);
    for (int t = 0; t < 4; ++t) {  // the chunk ends at the fifth token
        const Matrixd x = random_matrix(2, f.cfg.d_model, rng);
        const bool scoped = t % 2 == 1;
#if TITANS_CUDA_EMULATION
        const long kernels = cuda_emulation::total_launches(), gemms = cuda_emulation::gemm_calls();
#endif
        Matrixd yg;
        if (scoped) {
            tcu::CallScope scope;
            yg = gpu.forward(gs, x);
            CHECK_FALSE(scope.flagged());
        } else {
            yg = gpu.forward(gs, x);
        }
        INFO("token " << t << (scoped ? ", in a CallScope" : ""));
#if TITANS_CUDA_EMULATION
        CHECK(cuda_emulation::total_launches() - kernels == 2);
        CHECK(cuda_emulation::gemm_calls() - gemms == 2);
#endif
        CHECK(rel_error(yg, cpu.forward(cs, x)) <= 1e-12);
    }
}

// Inside a deferring scope a call decoded whole has its rows checked by the decode kernel
// itself (q, k, v, the gate logits, the read, the pending rows written), and with its output's
// check left to a later one (cuda::OutputCovered, as a block holds it around the memory) it
// launches no check of its own: 1 kernel and 2 GEMMs a token. A query or a value that
// overflows (W_Q or W_V x 1e300, one token's x x 1e10; the query's norm then NaN) raises the
// scope's flag; finite tokens do not.
TEST_CASE("cuda memory: decode checks in the kernel", "[cuda]") {
    Rng rng(seed_for("cuda decode checks"));
    Fixture f(rng(), Retrieval::Lagged, 5);
    f.cfg.gates = titans::GateMode::DataDependent;
    f.p = random_params(f.cfg, rng);
    titans::MemoryParamsd big_q = f.p, big_v = f.p;
    big_q.w_q *= 1e300;
    big_v.w_v *= 1e300;
    const CudaMemory<double> gpu(f.cfg, f.p), gq(f.cfg, big_q), gv(f.cfg, big_v);
    auto gs = gpu.make_state(2);
    auto sq = gq.make_state(2);
    auto sv = gv.make_state(2);
    const auto scoped = [](const CudaMemory<double>& m, auto& st, const Matrixd& x) {
        tcu::CallScope scope;
        const tcu::OutputCovered covered;
        (void)m.forward(st, x);
        return scope.flagged();
    };
    for (int t = 0; t < 4; ++t) {  // the chunk ends at the fifth token
        INFO("token " << t);
        const Matrixd x = random_matrix(2, f.cfg.d_model, rng, 0.5, 1.0);
        Matrixd huge = x;
        huge.row(t % 2) *= 1e10;
        auto bad_q = sq;
        auto bad_v = sv;
        CHECK(scoped(gq, bad_q, huge));
        CHECK(scoped(gv, bad_v, huge));
        CHECK_FALSE(scoped(gq, sq, x));
        CHECK_FALSE(scoped(gv, sv, x));
#if TITANS_CUDA_EMULATION
        const long kernels = cuda_emulation::total_launches(), gemms = cuda_emulation::gemm_calls();
#endif
        CHECK_FALSE(scoped(gpu, gs, x));
#if TITANS_CUDA_EMULATION
        CHECK(cuda_emulation::total_launches() - kernels == 1);
        CHECK(cuda_emulation::gemm_calls() - gemms == 2);
#endif
    }
}

// Queries and keys whose squares overflow float (W_Q and W_K x 1e22, entries near 1e22): the
// decode kernel's q/k norm takes the scaled path of the L2 norm kernel (detail/norm_scale.hpp),
// one token a call and pieces of 2-4 rows, and so does the batched path (FusedMemory::Off);
// both against the CPU in double.
TEST_CASE("cuda memory: decode of huge keys", "[cuda]") {
    int index = 0;
    for (const tcu::FusedMemory mode : {tcu::FusedMemory::Auto, tcu::FusedMemory::Off}) {
        Rng rng(seed_for("cuda decode huge keys", static_cast<std::uint64_t>(index++)));
        Fixture f(rng(), Retrieval::Lagged, 5);
        f.p.w_q *= 1e22;
        f.p.w_k *= 1e22;
        const int B = 2, N = 12;
        const Matrixd x = random_matrix(B * N, f.cfg.d_model, rng);
        std::vector<int> pieces(5, 1);
        for (const int n : {4, 3}) pieces.push_back(n);
        tcu::set_fused_memory(mode);
        const double e = compare_case<float>(f.cfg, f.p, x, B, N, rng, 1e-5, pieces);
        tcu::set_fused_memory(tcu::FusedMemory::Auto);
        INFO((mode == tcu::FusedMemory::Off ? "batched" : "decode kernel"));
        CHECK(e <= 1e-5);
    }
}

// A default-constructed state, and one made for another configuration: ConfigError, and the
// stream's own state untouched.
TEST_CASE("cuda memory: foreign states", "[cuda]") {
    Rng rng(seed_for("cuda foreign states"));
    const Fixture f(rng(), Retrieval::Lagged, 4);
    CudaMemory<double> gpu(f.cfg, f.p);
    const Matrixd x1 = random_matrix(2 * 6, f.cfg.d_model, rng);
    typename CudaMemory<double>::State none;
    REQUIRE_THROWS_NAMING(gpu.forward(none, x1), titans::ConfigError, "configuration");
    MemoryConfig other = f.cfg;
    other.chunk = f.cfg.chunk + 1;
    CudaMemory<double> gpu3(other, f.p);
    auto foreign = gpu3.make_state(2);
    REQUIRE_THROWS_NAMING(gpu.forward(foreign, x1), titans::ConfigError, "configuration");
    REQUIRE_THROWS_AS(gpu.read(foreign, x1), titans::ConfigError);
    REQUIRE(foreign.position() == 0);
}

TEST_CASE("cuda memory: errors leave the state", "[cuda]") {
    Rng rng(seed_for("cuda errors"));
    const Fixture f(rng(), Retrieval::Lagged, 4);
    NeuralMemory<double> cpu(f.cfg, f.p);
    CudaMemory<double> gpu(f.cfg, f.p);
    auto cs = cpu.make_state(2);
    auto gs = gpu.make_state(2);
    const Matrixd x1 = random_matrix(2 * 6, f.cfg.d_model, rng);
    (void)cpu.forward(cs, x1);
    (void)gpu.forward(gs, x1);
    // Values of 1e200 with clipping off: the memory's next keys overflow after the chunk end
    // inside the call. NonFiniteError (as on the CPU), and the state as it was.
    {
        MemoryConfig cfg2 = f.cfg;
        cfg2.max_grad_norm = 0;
        titans::MemoryParamsd p2 = f.p;
        p2.w_v *= 1e200;
        NeuralMemory<double> cpu2(cfg2, p2);
        CudaMemory<double> gpu2(cfg2, p2);
        auto cs2 = cpu2.make_state(2);
        auto gs2 = gpu2.make_state(2);
        const Matrixd x = random_matrix(2 * 7, f.cfg.d_model, rng);
        const auto before = state_tensors(gs2);  // every row, the unused pending ones too
        REQUIRE_THROWS_AS(cpu2.forward(cs2, x), titans::NonFiniteError);
        REQUIRE_THROWS_NAMING(gpu2.forward(gs2, x), titans::NonFiniteError, "expected finite");
        REQUIRE(gs2.position() == 0);
        CHECK(same_tensors(state_tensors(gs2), before));
        CHECK(rel_error(gpu2.current_weights(gs2, 1, 1), f.p.memory_init[1]) == 0.0);
        CHECK(rel_error(gpu2.forward(gs2, x.topRows(6)), cpu2.forward(cs2, x.topRows(6))) <= 1e-12);
    }
    // One token's projections overflow (w_q x 1e300, that token's x x 1e10; no conv, no
    // q/k norm): the same NonFiniteError text as the CPU's, naming sequence 1, position 4.
    {
        MemoryConfig cfg3 = f.cfg;
        cfg3.use_conv = false;
        cfg3.normalize_qk = false;
        titans::MemoryParamsd p3 = f.p;
        p3.w_q *= 1e300;
        NeuralMemory<double> cpu3(cfg3, p3);
        CudaMemory<double> gpu3(cfg3, p3);
        auto cs3 = cpu3.make_state(2);
        auto gs3 = gpu3.make_state(2);
        Matrixd x = random_matrix(2 * 7, f.cfg.d_model, rng, 0.5, 1.0);
        x.row(7 + 4) *= 1e10;
        const std::string cpu_message = nonfinite_message([&] { (void)cpu3.forward(cs3, x); });
        const std::string gpu_message = nonfinite_message([&] { (void)gpu3.forward(gs3, x); });
        INFO("CPU: " << cpu_message << "\nCUDA: " << gpu_message);
        REQUIRE(cpu_message.find("sequence 1, position 4") != std::string::npos);
        CHECK(gpu_message == cpu_message);
        CHECK(gs3.position() == 0);
    }
    // A transaction over two calls (from mid-chunk, over a chunk end), rolled back: a
    // checkpoint would write what it wrote before, bit for bit.
    const Matrixd x_one = random_matrix(2 * 1, f.cfg.d_model, rng);
    (void)gpu.forward(gs, x_one);
    (void)cpu.forward(cs, x_one);
    const auto at_begin = state_tensors(gs);
    REQUIRE(gpu.begin(gs));
    (void)gpu.forward(gs, random_matrix(2 * 1, f.cfg.d_model, rng));
    (void)gpu.forward(gs, random_matrix(2 * 3, f.cfg.d_model, rng));
    gpu.rollback(gs);
    REQUIRE(gs.position() == 7);
    CHECK(same_tensors(state_tensors(gs), at_begin));
    // A copy is a snapshot: advance the original, then continue the copy.
    auto snapshot = gs;
    (void)gpu.forward(gs, random_matrix(2 * 9, f.cfg.d_model, rng));
    const Matrixd x2 = random_matrix(2 * 11, f.cfg.d_model, rng);
    const Matrixd yc = cpu.forward(cs, x2);
    CHECK(rel_error(gpu.forward(snapshot, x2), yc) <= 1e-12);
    CHECK(rel_error(gpu.current_momentum(snapshot, 1, 2), cpu.current_momentum(cs, 1, 2)) <= 1e-12);
}

namespace {

/// x rounded to bfloat16 independently of round_bf16: scaled to 8 significant bits (the
/// binade's leading one and 7 below it; the spacing fixed at 2^-133 below the normal range),
/// rounded to nearest even by nearbyint in double, scaled back; past the largest bfloat16 an
/// infinity of x's sign.
float bf16_reference(float x) {
    if (!std::isfinite(x) || x == 0) {
        return x;
    }
    const int e = std::max(std::ilogb(x), -126);
    const double r = std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(x), 7 - e)), e - 7);
    if (std::fabs(r) > std::numeric_limits<float>::max()) {
        return std::copysign(std::numeric_limits<float>::infinity(), x);
    }
    return static_cast<float>(r);
}

float float_of_bits(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

}  // namespace

// The bfloat16 rounding of the CPU emulation's tensor-core products (round_bf16,
// tile_product.cuh: what cvt.rn.bf16x2.f32 does on the GPU), run in a kernel, against
// bf16_reference bit for bit: random bit patterns (subnormals, both signs, every binade),
// exact ties between two bfloat16 values and their neighbours, the edge of overflow; infinities
// and NaN unchanged.
TEST_CASE("cuda memory: bfloat16 rounding", "[cuda]") {
    Rng rng(seed_for("cuda bf16 rounding"));
    std::vector<float> x;
    for (int i = 0; i < 4000; ++i) {
        const auto u = static_cast<std::uint32_t>(rng());
        const float f = float_of_bits(u);
        if (std::isfinite(f)) {
            x.push_back(f);
        }
        const std::uint32_t tie = (u & 0xffff0000u) | 0x8000u;  // halfway: to the even one
        for (std::uint32_t v : {tie, tie - 1, tie + 1}) {
            if (std::isfinite(float_of_bits(v))) {
                x.push_back(float_of_bits(v));
            }
        }
    }
    for (std::uint32_t u : {0x7f7fffffu, 0x7f7f7fffu, 0x7f7f8000u, 0x00000001u, 0x80008000u,
                            0x00018000u, 0x3f808000u, 0x3f818000u}) {
        x.push_back(float_of_bits(u));
    }
    const std::size_t finite = x.size();
    x.push_back(std::numeric_limits<float>::infinity());
    x.push_back(-std::numeric_limits<float>::infinity());
    x.push_back(std::numeric_limits<float>::quiet_NaN());
    auto buf = tcu::upload_array(x.data(), x.size());
    float* d = buf.data();
    tcu::each(cudaStream_t{}, static_cast<long long>(x.size()),
              [=] __device__(unsigned i) { d[i] = tcu::round_bf16(d[i]); });
    const std::vector<float> y = host_copy(buf);
    int wrong = 0;
    for (std::size_t i = 0; i < finite + 2; ++i) {
        const float r = bf16_reference(x[i]);
        if (std::memcmp(&r, &y[i], sizeof r) != 0 && ++wrong <= 5) {
            FAIL_CHECK("round_bf16(" << x[i] << ") = " << y[i] << ", expected " << r);
        }
    }
    CHECK(wrong == 0);
    CHECK(std::isnan(y.back()));
}
