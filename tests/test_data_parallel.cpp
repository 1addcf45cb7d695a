// Data-parallel training without MPI: a Communicator whose ranks are threads of this process
// (LoopbackRanks), so that the Trainer's part of a run (shards, the weighted sum of the gradient
// buffer, the ranks agreeing on a step, the checks at joining and every K steps) is tested in
// every build, under the sanitizers; tests/mpi/ runs the same over MPI.
#include "catch.hpp"
#include "trainer_common.hpp"

#include <titans/train/communicator.hpp>

#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace titans_test;

namespace {

/// n ranks as n threads: every collective meets at a barrier; sums add the ranks' spans in
/// rank order into rank 0's, then copy it to the others (the same bits everywhere).
class LoopbackRanks {
public:
    explicit LoopbackRanks(int n) : n_(n), meet_(n), spans_(static_cast<std::size_t>(n)),
                                    words_(static_cast<std::size_t>(n)) {}

    class Comm final : public titans::Communicator {
    public:
        Comm(LoopbackRanks& r, int rank) : r_(r), rank_(rank) {}
        [[nodiscard]] int rank() const override { return rank_; }
        [[nodiscard]] int size() const override { return r_.n_; }
        void sum(std::span<double> x) override { r_.sum(rank_, x); }
        void sum(std::span<float> x) override { r_.sum(rank_, x); }
        [[nodiscard]] std::vector<std::uint64_t> gather(std::uint64_t v) override {
            r_.words_[static_cast<std::size_t>(rank_)] = v;
            r_.meet_.arrive_and_wait();
            std::vector<std::uint64_t> all = r_.words_;
            r_.meet_.arrive_and_wait();
            return all;
        }

    private:
        LoopbackRanks& r_;
        int rank_;
    };

    /// Runs body(rank, comm) on n threads and waits for them.
    void run(const std::function<void(int, std::shared_ptr<titans::Communicator>)>& body) {
        std::vector<std::thread> threads;
        for (int r = 0; r < n_; ++r) {
            threads.emplace_back([this, r, &body] { body(r, std::make_shared<Comm>(*this, r)); });
        }
        for (auto& t : threads) t.join();
    }

private:
    template <class X>
    void sum(int rank, std::span<X> x) {
        spans_[static_cast<std::size_t>(rank)] = x.data();
        meet_.arrive_and_wait();
        if (rank == 0) {
            for (int r = 1; r < n_; ++r) {
                const X* y = static_cast<const X*>(spans_[static_cast<std::size_t>(r)]);
                for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
            }
        }
        meet_.arrive_and_wait();
        if (rank != 0) {
            const X* y = static_cast<const X*>(spans_[0]);
            for (std::size_t i = 0; i < x.size(); ++i) x[i] = y[i];
        }
        meet_.arrive_and_wait();
    }

    int n_;
    std::barrier<> meet_;
    std::vector<const void*> spans_;
    std::vector<std::uint64_t> words_;
};

}  // namespace

// Two and three ranks (threads) with their shards of the batch take the step of one process
// on the whole batch: 12 steps, parameters within 1e-12 of it (relative to each tensor's
// largest entry) and bit-identical across the ranks; the data position counts the whole batch.
TEST_CASE("trainer: data parallel, threads", "[train][parallel]") {
    for (const int n : {2, 3}) {
        Rng rng(seed_for("trainer: data parallel", static_cast<std::uint64_t>(n)));
        const int vocab = 11, B = n + 1, N = 5;
        const ModelCase m = trainer_model_case<double>(n == 2 ? BlockKind::MAG : BlockKind::MAC,
                                                       BlockKind::LMM, vocab, rng);
        const TrainerConfig tc = trainer_test_config(1.0);
        Trainer<double> alone(m.cfg, m.params, tc);
        alone.set_threads(titans::Threads{1});
        std::vector<StepData> data;
        for (int s = 0; s < 12; ++s) {
            data.push_back(step_data("trainer: data parallel data", static_cast<std::uint64_t>(s),
                                     B, N, vocab));
            alone.step(data.back().ids, data.back().labels, B);
        }
        std::vector<titans::ModelParams<double>> got(static_cast<std::size_t>(n));
        std::vector<double> losses(static_cast<std::size_t>(n));
        LoopbackRanks ranks(n);
        ranks.run([&](int r, std::shared_ptr<titans::Communicator> comm) {
            Trainer<double> t(m.cfg, m.params, tc);
            t.set_threads(titans::Threads{1});
            t.set_communicator(comm, 4);
            for (const StepData& d : data) losses[static_cast<std::size_t>(r)] = t.step(d.ids, d.labels, B);
            got[static_cast<std::size_t>(r)] = t.params();
        });
        INFO(n << " ranks");
        CHECK(std::abs(losses[0] - alone.last_loss()) <= 1e-12 * alone.last_loss());
        for (int r = 1; r < n; ++r) {
            CHECK(same_param_bits(got[static_cast<std::size_t>(r)], got[0], m.cfg));
            CHECK(losses[static_cast<std::size_t>(r)] == losses[0]);
        }
        const auto g = titans::detail::tensor_slots(got[0], m.cfg);
        const auto w = titans::detail::tensor_slots(alone.params(), m.cfg);
        double e = 0;
        for (std::size_t i = 0; i < g.size(); ++i) {
            const double scale = std::max(w[i].array().abs().maxCoeff(), 1e-300);
            e = std::max(e, (g[i].array() - w[i].array()).abs().maxCoeff() / scale);
        }
        CHECK(e <= 1e-12);
    }
}

// A run refuses ranks that disagree, every rank together, nothing changing: other parameters
// or another check_every at joining (the rank named), a rank refusing its own arguments at
// joining or its part of a step (its own error there, the rank named on the others), another
// batch on one rank; a batch smaller than the ranks.
TEST_CASE("trainer: data parallel refusals", "[train][parallel]") {
    Rng rng(seed_for("trainer: data parallel refusals", 0));
    const int vocab = 9, N = 4;
    const ModelCase m = trainer_model_case<double>(BlockKind::LMM, BlockKind::SWA, vocab, rng);
    const TrainerConfig tc = trainer_test_config(0.0);
    const StepData d = step_data("trainer: data parallel refusals", 1, 2, N, vocab);
    std::vector<std::string> said(2);
    std::vector<int> fine(2, 0);  // the checks of each rank (Catch2 asserts on one thread only)
    LoopbackRanks ranks(2);
    ranks.run([&](int r, std::shared_ptr<titans::Communicator> comm) {
        titans::ModelParams<double> p = m.params;
        if (r == 1) p.norm_final(0, 1) += 1e-12;
        Trainer<double> other(m.cfg, p, tc);
        try {
            other.set_communicator(comm);
        } catch (const titans::CommunicationError& e) {
            said[static_cast<std::size_t>(r)] = e.what();
        }
        Trainer<double> t(m.cfg, m.params, tc);
        t.set_threads(titans::Threads{1});
        bool own_join = false, named_join = false, other_every = false;
        try {  // rank 1 refuses its own argument: rank 0 learns it at the first gather
            t.set_communicator(comm, r == 1 ? -1 : 4);
        } catch (const titans::ConfigError&) {
            own_join = true;
        } catch (const titans::CommunicationError& e) {
            named_join = std::string(e.what()).find("rank 1 refused") != std::string::npos;
        }
        try {
            t.set_communicator(comm, r == 1 ? 5 : 4);
        } catch (const titans::CommunicationError& e) {
            other_every = std::string(e.what()).find("check_every") != std::string::npos;
        }
        const bool joined_none = t.communicator() == nullptr;
        t.set_communicator(comm);
        StepData bad = d;
        if (r == 1) bad.ids[3] = -1;
        bool own = false, named = false;
        try {
            t.step(bad.ids, bad.labels, 2);
        } catch (const titans::ShapeError&) {
            own = true;
        } catch (const titans::CommunicationError& e) {
            named = std::string(e.what()).find("rank 1 refused") != std::string::npos;
        }
        StepData moved = d;
        if (r == 0) moved.labels[0] = moved.labels[0] < 0 ? 2 : -1;
        bool other_batch = false, too_small = false;
        try {
            t.step(moved.ids, moved.labels, 2);
        } catch (const titans::CommunicationError& e) {
            other_batch = std::string(e.what()).find("rank 1 has other batch") != std::string::npos;
        }
        try {
            t.step(d.ids, d.labels, 1);
        } catch (const titans::ConfigError&) {
            too_small = true;
        }
        const bool unchanged = t.steps() == 0 && same_param_bits(t.params(), m.params, m.cfg);
        t.step(d.ids, d.labels, 2);
        fine[static_cast<std::size_t>(r)] = (r == 1 ? own : named) && other_batch && too_small &&
                                            unchanged && t.steps() == 1 &&
                                            (r == 1 ? own_join : named_join) && other_every &&
                                            joined_none;
    });
    for (int r = 0; r < 2; ++r) {
        INFO("rank " << r << ": " << said[static_cast<std::size_t>(r)]);
        CHECK(fine[static_cast<std::size_t>(r)] == 1);
        CHECK(said[static_cast<std::size_t>(r)].find("rank 1 has other parameters than rank 0") !=
              std::string::npos);
    }
}
