// Checkpoints across backends (titans/io/checkpoint.hpp on the simulated device of
// tests/backend/simulated_device.hpp): a state saved on one backend restores on the other and
// the stream continues bit for bit, for a block of every kind and a mixed model; a device state
// reaches the file only through its tensors() transfer, and a file that contradicts itself is
// refused on the device as on the CPU.
#include "block_cases.hpp"

#include "backend/simulated_device.hpp"

#include <titans/io/checkpoint.hpp>

#include <string>
#include <utility>
#include <vector>

using namespace titans_test;
namespace io = titans::io;

namespace {

/// The checkpoint of `state` written by `from` and restored for `to`, in memory.
template <class From, class To>
typename To::State carry(const From& from, const typename From::State& state, const To& to) {
    const io::SafetensorsFile f(io::checkpoint_writer(from, state).bytes(), "<carried>");
    return io::restore_checkpoint(f, to);
}

}  // namespace

TEMPLATE_TEST_CASE("io: checkpoint on devices", "[io][backend]", float, double) {
    using T = TestType;
    const std::size_t live0 = sim::Arena::instance().live();
    for (BlockKind kind : titans::all_block_kinds) {
        Rng rng(seed_for(std::string("io/backends/") + type_name<T>() + titans::to_string(kind), 0));
        BlockOptions o;
        o.kind = kind;
        o.n_persistent = 2;
        o.retrieval = kind == BlockKind::MAC ? titans::Retrieval::InChunk : titans::Retrieval::Lagged;
        const BlockConfig cfg = random_block_config<T>(o, rng);
        const BlockParams<T> params = cast_block<T>(random_block_params<T>(cfg, rng));
        const titans::Block<T> cpu(cfg, params);
        const titans::Block<T, SimulatedDevice> dev(cfg, params);
        const int B = 2, N = uniform_int(rng, 5, 13);
        INFO(titans::to_string(kind) << " N=" << N);
        const Matrix<T> x = random_matrix(B * N, cfg.d_model, rng).cast<T>();
        const Matrix<T> more = random_matrix(B * 5, cfg.d_model, rng).cast<T>();
        auto sc = cpu.make_state(B);
        auto sd = dev.make_state(B);
        (void)cpu.forward(sc, x);
        (void)dev.forward(sd, x);
        // Device -> CPU and CPU -> device: every continuation equals the one that never stopped.
        auto c_from_d = carry(dev, sd, cpu);
        auto d_from_c = carry(cpu, sc, dev);
        const Matrix<T> y = cpu.forward(sc, more);
        CHECK(identical(cpu.forward(c_from_d, more), y));
        CHECK(identical(dev.forward(d_from_c, more), y));
        CHECK(identical(dev.forward(sd, more), y));
    }
    {
        Rng rng(seed_for(std::string("io/backends/model/") + type_name<T>(), 0));
        const ModelCase mc = make_model_case<T>(BlockKind::MAC, BlockKind::MAL, 8, 0, 3, rng);
        const auto params = cast_model<T>(mc.params);
        const titans::Model<T> cpu(mc.cfg, params);
        const titans::Model<T, SimulatedDevice> dev(mc.cfg, params);
        const Matrix<T> x = random_matrix(7, 8, rng).cast<T>(), more = random_matrix(4, 8, rng).cast<T>();
        auto sd = dev.make_state(1);
        (void)dev.forward(sd, x);
        auto sc = carry(dev, sd, cpu);
        CHECK(identical(cpu.forward(sc, more), dev.forward(sd, more)));
        // A checkpoint whose attention window contradicts its position is refused on the device.
        auto w = io::checkpoint_writer(dev, sd);
        io::SafetensorsWriter bad;
        const io::SafetensorsFile good(w.bytes(), "<good>");
        for (const auto& [key, value] : good.metadata()) bad.metadata(key, value);
        for (const auto& t : good.tensors()) {
            if (t.name == "blocks.1.attention.position") {
                const std::int64_t wrong = 1;
                bad.add_integers(t.name, std::span<const std::int64_t>(&wrong, 1));
            } else if (t.dtype == io::DType::I64) {
                const std::vector<std::int64_t> v = good.integers(t.name);
                bad.add_integers(t.name, std::span<const std::int64_t>(v));
            } else {
                bad.add(t.name, good.matrix<T>(t.name));
            }
        }
        CHECK_THROWS_AS(io::restore_checkpoint(io::SafetensorsFile(bad.bytes(), "<bad>"), dev),
                        titans::FormatError);
    }
    CHECK(sim::Arena::instance().live() == live0);
}
