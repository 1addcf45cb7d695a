// tests/mpi/test_mpi.cpp: data-parallel training over MPI (component titans::mpi), run by
// ctest as `mpirun -np 2 titans_mpi_tests`. Every rank runs every test case; the exit status is
// the worst rank's. Also runs alone (one rank): the cases then check a run of one.
#if !(defined(TITANS_CATCH2_V3) && TITANS_CATCH2_V3)
#define CATCH_CONFIG_RUNNER
#endif
#include "catch.hpp"
#include "trainer_common.hpp"

#include <titans/mpi/mpi.hpp>
#if defined(TITANS_TEST_HAS_IO) && TITANS_TEST_HAS_IO
#include <titans/io/trainer.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

using namespace titans_test;

namespace {

std::shared_ptr<titans::mpi::Communicator> world() {
    return std::make_shared<titans::mpi::Communicator>();
}

/// FNV-1a of every tensor's bytes: what the ranks compare to be bit-identical.
std::uint64_t print_of(const titans::ModelParams<double>& p, const ModelConfig& cfg) {
    titans::detail::Fnv1a h;
    titans::detail::print_tensors(h, p, cfg);
    return h.value();
}

/// The largest error of any tensor of got against want, each relative to want's largest
/// entry.
double params_error(const titans::ModelParams<double>& got, const titans::ModelParams<double>& want,
                    const ModelConfig& cfg) {
    const auto g = titans::detail::tensor_slots(got, cfg);
    const auto w = titans::detail::tensor_slots(want, cfg);
    double e = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
        if (g[i].size() == 0) continue;
        const double scale = std::max(w[i].array().abs().maxCoeff(), 1e-300);
        e = std::max(e, (g[i].array() - w[i].array()).abs().maxCoeff() / scale);
    }
    return e;
}

/// Whether every rank holds `value`.
bool same_on_ranks(titans::mpi::Communicator& c, std::uint64_t value) {
    const std::vector<std::uint64_t> all = c.gather(value);
    for (const std::uint64_t v : all) {
        if (v != all[0]) return false;
    }
    return true;
}

}  // namespace

// The communicator's collectives: sums the same bits on every rank, gathers in rank order.
TEST_CASE("mpi: collectives", "[mpi]") {
    auto c = world();
    const int r = c->rank(), n = c->size();
    std::vector<double> d{0.1 * (r + 1), -1.0, 1e300};
    c->sum(std::span<double>(d));
    CHECK(std::abs(d[0] - 0.05 * n * (n + 1)) <= 1e-15 * n * n);
    CHECK(d[1] == -n);
    CHECK(d[2] == 1e300 * n);
    std::vector<float> f{static_cast<float>(r), 2.0f};
    c->sum(std::span<float>(f));
    CHECK(f[0] == static_cast<float>(n * (n - 1) / 2));
    CHECK(f[1] == 2.0f * static_cast<float>(n));
    const std::vector<std::uint64_t> all = c->gather(static_cast<std::uint64_t>(10 + r));
    REQUIRE(all.size() == static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) CHECK(all[static_cast<std::size_t>(i)] == 10u + static_cast<unsigned>(i));
    // A value that differs on a rank is named.
    if (n > 1) {
        CHECK_THROWS_WITH(titans::detail::require_same_on_ranks(*c, r == 1 ? 7 : 3, "here", "x"),
                          Catch::Contains("rank 1 has other x than rank 0"));
    }
    CHECK_NOTHROW(titans::detail::require_same_on_ranks(*c, 5, "here", "x"));
}

// Data parallelism: each rank steps on its shard of the batch (sequences, uneven shards too),
// the gradient buffer summed over the ranks; after 20 steps the parameters equal those of one
// process on the whole batch within 1e-12 (relative to each tensor's largest entry), and are
// bit-identical on every rank; the losses and gradient norms agree within 1e-12.
TEST_CASE("mpi: ranks take the whole step", "[mpi]") {
    auto c = world();
    double worst = 0;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAG, BlockKind::LMM},
                                                      {BlockKind::MAC, BlockKind::SWA},
                                                      {BlockKind::MAL, BlockKind::MAG}};
    for (std::size_t s = 0; s < std::size(stacks); ++s) {
        Rng rng(seed_for("mpi: whole step", s));
        const int vocab = 11, B = 3 + static_cast<int>(s % 2), N = 6;
        const ModelCase m = trainer_model_case<double>(stacks[s].first, stacks[s].second, vocab, rng);
        const TrainerConfig tc = trainer_test_config(s == 1 ? 0.0 : 1.0);
        Trainer<double> alone(m.cfg, m.params, tc);
        Trainer<double> ranked(m.cfg, m.params, tc);
        ranked.set_communicator(c, 5);
        INFO(titans::to_string(stacks[s].first) << " + " << titans::to_string(stacks[s].second)
                                                << " B " << B << " rank " << c->rank());
        double worst_loss = 0, worst_norm = 0;
        for (int step = 0; step < 20; ++step) {
            const StepData d = step_data("mpi: whole step data", static_cast<std::uint64_t>(step),
                                         B, N, vocab);
            const double la = alone.step(d.ids, d.labels, B);
            const double lr = ranked.step(d.ids, d.labels, B);
            worst_loss = std::max(worst_loss, std::abs(lr - la) / std::max(std::abs(la), 1e-300));
            worst_norm = std::max(worst_norm, std::abs(ranked.last_gradient_norm() -
                                                       alone.last_gradient_norm()) /
                                                  std::max(alone.last_gradient_norm(), 1e-300));
        }
        const double e = params_error(ranked.params(), alone.params(), m.cfg);
        INFO("loss " << worst_loss << " norm " << worst_norm << " params " << e);
        CHECK(worst_loss <= 1e-12);
        CHECK(worst_norm <= 1e-12);
        CHECK(e <= 1e-12);
        worst = std::max({worst, worst_loss, worst_norm, e});
        CHECK(same_on_ranks(*c, print_of(ranked.params(), m.cfg)));
        CHECK(ranked.data_position() == 20 * B);
        CHECK(ranked.steps() == 20);
    }
    if (c->rank() == 0) {
        std::printf("mpi: %d ranks, 3 stacks x 20 steps: worst relative difference from one "
                    "process %.3g (bound 1e-12)\n", c->size(), worst);
    }
}

// A run refuses ranks that disagree, every rank throwing together and nothing changing: other
// settings or parameters at set_communicator, a batch smaller than the ranks, another batch on
// one rank, an id a rank refuses (that rank its own error, the others a CommunicationError
// naming it).
TEST_CASE("mpi: refusals", "[mpi]") {
    auto c = world();
    const int r = c->rank(), n = c->size();
    Rng rng(seed_for("mpi: refusals", 0));
    const int vocab = 9, N = 4;
    const ModelCase m = trainer_model_case<double>(BlockKind::LMM, BlockKind::MAG, vocab, rng);
    const TrainerConfig tc = trainer_test_config(1.0);
    if (n > 1) {
        TrainerConfig other = tc;
        other.clip_norm = r == 1 ? 2.0 : 1.0;
        Trainer<double> a(m.cfg, m.params, other);
        CHECK_THROWS_WITH(a.set_communicator(c),
                          Catch::Contains("rank 1 has other model configuration, trainer settings"));
        CHECK(a.communicator() == nullptr);
        titans::ModelParams<double> p = m.params;
        if (r == 1) p.head(0, 0) += 1e-9;
        Trainer<double> b(m.cfg, p, tc);
        CHECK_THROWS_AS(b.set_communicator(c), titans::CommunicationError);
    }
    Trainer<double> t(m.cfg, m.params, tc);
    t.set_communicator(c);
    const StepData d = step_data("mpi: refusals data", 0, n, N, vocab);
    if (n > 1) {
        const StepData one = step_data("mpi: refusals data", 1, 1, N, vocab);
        CHECK_THROWS_AS(t.step(one.ids, one.labels, 1), titans::ConfigError);  // batch < ranks
        StepData mine = d;
        if (r == 1) mine.labels[0] = mine.labels[0] < 0 ? 1 : -1;
        CHECK_THROWS_WITH(t.step(mine.ids, mine.labels, n), Catch::Contains("rank 1 has other batch"));
        StepData bad = d;
        if (r == 1) bad.ids[0] = vocab;  // out of range: rank 1 refuses
        if (r == 1) {
            CHECK_THROWS_AS(t.step(bad.ids, bad.labels, n), titans::ShapeError);
        } else {
            CHECK_THROWS_WITH(t.step(bad.ids, bad.labels, n), Catch::Contains("rank 1 refused"));
        }
        CHECK(t.steps() == 0);
        CHECK(same_param_bits(t.params(), m.params, m.cfg));
    }
    CHECK_NOTHROW(t.step(d.ids, d.labels, n));  // the run goes on
    CHECK(t.steps() == 1);
    CHECK_THROWS_AS(t.set_communicator(c, -1), titans::ConfigError);
}

#if defined(TITANS_TEST_HAS_IO) && TITANS_TEST_HAS_IO
// A run resumed from rank 0's checkpoint (every rank loading it) takes the uninterrupted run's
// steps bit for bit.
TEST_CASE("mpi: resume from a checkpoint", "[mpi]") {
    auto c = world();
    Rng rng(seed_for("mpi: resume", 0));
    const int vocab = 9, B = 4, N = 5;
    const ModelCase m = trainer_model_case<double>(BlockKind::MAC, BlockKind::MAL, vocab, rng);
    const TrainerConfig tc = trainer_test_config(1.0);
    Trainer<double> whole(m.cfg, m.params, tc);
    whole.set_communicator(c);
    const auto data = [&](int s) {
        return step_data("mpi: resume data", static_cast<std::uint64_t>(s), B, N, vocab);
    };
    std::vector<double> pid(1, c->rank() == 0 ? static_cast<double>(::getpid()) : 0.0);
    c->sum(std::span<double>(pid));  // rank 0's process id names the run's directory
    const std::filesystem::path dir =
        std::filesystem::temp_directory_path() /
        ("titans_mpi_resume_" + std::to_string(static_cast<long long>(pid[0])));
    for (int s = 0; s < 4; ++s) whole.step(data(s).ids, data(s).labels, B);
    if (c->rank() == 0) titans::io::save_trainer(dir, whole);
    (void)c->gather(0);  // every rank waits for the save
    Trainer<double> resumed = titans::io::load_trainer<double>(dir, m.cfg);
    resumed.set_communicator(c);
    for (int s = 4; s < 8; ++s) {
        const double a = whole.step(data(s).ids, data(s).labels, B);
        CHECK(resumed.step(data(s).ids, data(s).labels, B) == a);
    }
    CHECK(same_trainers(whole, resumed));
    (void)c->gather(0);
    if (c->rank() == 0) std::filesystem::remove_all(dir);
}
#endif

int main(int argc, char** argv) {
    titans::mpi::Session mpi(argc, argv);
    const int rc = Catch::Session().run(argc, argv);
    int worst = 0;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}
