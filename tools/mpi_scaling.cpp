// tools/mpi_scaling.cpp: data-parallel scaling of a Trainer over MPI (docs/performance.md,
// "Training on several processes"). Trains one model for --steps steps on a fixed global batch,
// once alone (no communicator) and once as a rank of the run it is launched in, and prints, from
// rank 0: tokens/s of the whole run and per process, the step's time, and the share of it spent
// in the gradient sum (the all-reduce), timed by a communicator that wraps MPI's.
//
//     mpicxx -std=c++20 -O3 -march=native -DNDEBUG -fopenmp -I include -isystem /usr/include/eigen3 \
//         tools/mpi_scaling.cpp -o build/mpi_scaling
//     OMP_NUM_THREADS=1 mpirun -np 1 build/mpi_scaling
//     OMP_NUM_THREADS=1 mpirun -np 2 --oversubscribe build/mpi_scaling
#include <titans/mpi/mpi.hpp>
#include <titans/titans.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// MPI's communicator, the seconds spent in its sums counted.
class Timed final : public titans::Communicator {
public:
    explicit Timed(std::shared_ptr<titans::Communicator> inner) : inner_(std::move(inner)) {}
    [[nodiscard]] int rank() const override { return inner_->rank(); }
    [[nodiscard]] int size() const override { return inner_->size(); }
    void sum(std::span<double> x) override { timed([&] { inner_->sum(x); }); }
    void sum(std::span<float> x) override { timed([&] { inner_->sum(x); }); }
    [[nodiscard]] std::vector<std::uint64_t> gather(std::uint64_t v) override {
        return inner_->gather(v);
    }
    double seconds = 0;

private:
    template <class F>
    void timed(F f) {
        const auto t0 = Clock::now();
        f();
        seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    std::shared_ptr<titans::Communicator> inner_;
};

struct Batch {
    std::vector<int> ids, labels;
};

Batch batch_of(int step, int B, int N, int vocab) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(step) * 7919 + 1);
    Batch b;
    for (int i = 0; i < B * N; ++i) b.ids.push_back(static_cast<int>(rng() % vocab));
    for (int i = 0; i < B * N; ++i) b.labels.push_back(b.ids[(i + 1) % (B * N)]);
    return b;
}

}  // namespace

int main(int argc, char** argv) {
    titans::mpi::Session mpi(argc, argv);
    const auto world = std::make_shared<titans::mpi::Communicator>();
    int steps = 20, B = 8, N = 128, d = 64;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        if (a == "--steps") steps = std::atoi(argv[i + 1]);
        if (a == "--batch") B = std::atoi(argv[i + 1]);
        if (a == "--length") N = std::atoi(argv[i + 1]);
        if (a == "--d") d = std::atoi(argv[i + 1]);
    }
    const int vocab = 256;
    titans::ModelConfig cfg = titans::ModelConfig::uniform(titans::BlockKind::MAG, 2, d, 4, 2, 64,
                                                           vocab, 16);
    const titans::TrainerConfig tc{.schedule = {.peak = 1e-3, .warmup = 2, .total = steps}};
    const auto params = titans::ModelParams<float>::random(cfg, 1);
    const auto run = [&](bool ranked, double& sum_seconds) {
        titans::Trainer<float> t(cfg, params, tc);
        auto timed = std::make_shared<Timed>(world);
        if (ranked) t.set_communicator(timed, 0);
        t.step(batch_of(0, B, N, vocab).ids, batch_of(0, B, N, vocab).labels, B);  // warm-up
        timed->seconds = 0;
        const auto t0 = Clock::now();
        for (int s = 1; s <= steps; ++s) {
            const Batch b = batch_of(s, B, N, vocab);
            t.step(b.ids, b.labels, B);
        }
        sum_seconds = timed->seconds;
        return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    const int n = world->size();
    double unused = 0, sums = 0;
    const double alone = world->rank() == 0 ? run(false, unused) : 0.0;
    (void)world->gather(0);
    const double ranked = run(true, sums);
    if (world->rank() == 0) {
        const double tokens = static_cast<double>(steps) * B * N;
        std::printf("model: 2 MAG blocks, d %d, %lld parameters; global batch %d x %d tokens, %d steps\n",
                    d, static_cast<long long>(cfg.parameter_count()), B, N, steps);
        std::printf("one process alone: %.0f tokens/s (%.1f ms per step)\n", tokens / alone,
                    1e3 * alone / steps);
        std::printf("%d ranks: %.0f tokens/s in all, %.0f per process (%.1f ms per step), "
                    "speed-up %.2fx; the gradient sum takes %.1f%% of the step (%.2f ms)\n",
                    n, tokens / ranked, tokens / ranked / n, 1e3 * ranked / steps, alone / ranked,
                    100 * sums / ranked, 1e3 * sums / steps);
    }
    return 0;
}
