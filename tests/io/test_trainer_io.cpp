// titans::io::save_trainer / load_trainer: a trainer saved after k steps and loaded takes the
// next steps bit for bit as the trainer that never stopped (N steps == k, save, load, N - k),
// in float and double, from before the first step too; and what load_trainer refuses: another
// model configuration or dtype, files of different saves, a missing file, a foreign format.
#include "test_common.hpp"
#include "io/temp_dir.hpp"
#include "trainer_common.hpp"

#include <titans/io/trainer.hpp>

#include <filesystem>
#include <fstream>
#include <string>

using namespace titans_test;
using titans::ConfigError;
using titans::FileError;
using titans::FormatError;
using titans::io::load_trainer;
using titans::io::save_trainer;

namespace {

/// A trainer on a MAC + MAG model (both derive data from their parameters), every setting
/// other than the default.
template <class T>
Trainer<T> trainer_io_case(const std::string& name, ModelConfig& cfg) {
    Rng rng(seed_for(name));
    const ModelCase mc = trainer_model_case<T>(BlockKind::MAC, BlockKind::MAG, 6, rng);
    cfg = mc.cfg;
    return Trainer<T>(cfg, cast_model<T>(mc.params), trainer_test_config(0.5));
}

/// Step t of the run named `name` (B = 2, N = 5, vocab 6).
template <class T>
double trainer_io_step(Trainer<T>& t, const std::string& name, int step) {
    const StepData d = step_data(name + "/data", static_cast<std::uint64_t>(step), 2, 5, 6);
    return t.step(d.ids, d.labels, 2);
}

}  // namespace

TEMPLATE_TEST_CASE("io: trainer resumes", "[io][training]", float, double) {
    using T = TestType;
    const int k = GENERATE(0, 2);
    const std::string name = std::string("io/trainer/resume/") + type_name<T>();
    const TempDir dir("trainer_resume");
    ModelConfig cfg;
    Trainer<T> straight = trainer_io_case<T>(name, cfg);
    Trainer<T> stopped = straight;
    std::vector<double> losses;
    for (int t = 1; t <= 5; ++t) losses.push_back(trainer_io_step(straight, name, t));
    for (int t = 1; t <= k; ++t) trainer_io_step(stopped, name, t);
    stopped.set_data_position(stopped.data_position() + 7);  // a position the user moved
    save_trainer(dir.path / "run", stopped);
    Trainer<T> resumed = load_trainer<T>(dir.path / "run", cfg);
    REQUIRE(same_trainers(resumed, stopped));
    CHECK(resumed.config().clip_norm == 0.5);
    CHECK(resumed.config().schedule.total == 6);
    CHECK(resumed.config().adamw.decay_vectors);
    for (int t = k + 1; t <= 5; ++t) {
        INFO("step " << t);
        CHECK(trainer_io_step(resumed, name, t) == losses[static_cast<std::size_t>(t - 1)]);
    }
    CHECK(same_param_bits(resumed.params(), straight.params(), cfg));
    CHECK(same_optimizer(resumed.optimizer(), straight.optimizer()));
    CHECK(resumed.last_gradient_norm() == straight.last_gradient_norm());
    CHECK(resumed.data_position() == straight.data_position() + 7);
}

TEST_CASE("io: trainer refusals", "[io][training][errors]") {
    using T = double;
    const std::string name = "io/trainer/refusals";
    const TempDir dir("trainer_refusals");
    ModelConfig cfg;
    Trainer<T> t = trainer_io_case<T>(name, cfg);
    trainer_io_step(t, name, 1);
    save_trainer(dir.path / "a", t);
    trainer_io_step(t, name, 2);
    save_trainer(dir.path / "b", t);
    REQUIRE(same_trainers(load_trainer<T>(dir.path / "b", cfg), t));

    ModelConfig other = cfg;
    other.blocks[1].memory.chunk += 1;
    REQUIRE_THROWS_NAMING(load_trainer<T>(dir.path / "a", other), ConfigError,
                          "blocks.1.memory.chunk");
    REQUIRE_THROWS_NAMING(load_trainer<float>(dir.path / "a", cfg), ConfigError, "dtype");
    REQUIRE_THROWS_AS(load_trainer<T>(dir.path / "missing", cfg), FileError);

    // A set mixing two saves (a save that stopped between its files): refused by name.
    namespace fs = std::filesystem;
    for (const char* file : {"parameters.safetensors", "optimizer.safetensors"}) {
        INFO(file);
        fs::remove_all(dir.path / "mixed");
        fs::copy(dir.path / "a", dir.path / "mixed");
        fs::copy_file(dir.path / "b" / file, dir.path / "mixed" / file,
                      fs::copy_options::overwrite_existing);
        REQUIRE_THROWS_NAMING(load_trainer<T>(dir.path / "mixed", cfg), FormatError,
                              "files of different saves");
    }
    fs::remove(dir.path / "mixed" / "optimizer.safetensors");
    REQUIRE_THROWS_AS(load_trainer<T>(dir.path / "mixed", cfg), FileError);

    // Another format where the trainer file should be.
    fs::copy_file(dir.path / "a" / "optimizer.safetensors", dir.path / "a" / "trainer.safetensors",
                  fs::copy_options::overwrite_existing);
    REQUIRE_THROWS_NAMING(load_trainer<T>(dir.path / "a", cfg), FormatError, "titans.trainer");

    // The directory cannot be made: a file is in the way.
    { std::ofstream(dir.path / "file") << "x"; }
    REQUIRE_THROWS_AS(save_trainer(dir.path / "file", t), FileError);
}
