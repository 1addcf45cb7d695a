// Files that could not be read back are never written, and files that are not regular files
// or have huge headers are refused quickly (titans/io): save_parameters / save_checkpoint
// check first and refuse with the error loading would give, leaving no file (not even a
// temporary); loading a FIFO, a device or a directory fails at once; a header of 100 000
// tensors parses in linear time; a 255-byte file name works (short temporary name).
#include "test_common.hpp"
#include "io/temp_dir.hpp"

#include <titans/io/checkpoint.hpp>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdint>
#include <filesystem>
#include <future>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define TITANS_TEST_POSIX 1
#endif

using namespace titans_test;
using titans::BlockConfig;
using titans::BlockKind;
using titans::Model;
using titans::ModelConfig;
using titans::ModelParams;
namespace io = titans::io;
namespace fs = std::filesystem;

namespace {


/// The message of the E that `f` throws (a test failure if it throws nothing or another type).
template <class E, class F>
std::string message_of(F&& f) {
    try {
        f();
    } catch (const E& e) {
        return e.what();
    }
    FAIL("no exception of the expected type was thrown");
    return {};
}

/// The message after "titans::io: <source>: " (required to start so).
std::string after_source(const std::string& msg, const std::string& source) {
    const std::string head = "titans::io: " + source + ": ";
    INFO(msg);
    REQUIRE(msg.rfind(head, 0) == 0);
    return msg.substr(head.size());
}

std::string write_source(const fs::path& p) { return "cannot write '" + p.string() + "'"; }

/// What loading a parameter file holding `p` (written without the checks) reports.
template <class Params, class Config>
std::string load_message_params(const Config& cfg, const Params& p) {
    const io::SafetensorsFile f(io::detail::unchecked_parameters_writer(cfg, p).bytes(), "raw");
    return message_of<titans::Error>([&] { (void)io::load_parameters<Params>(f, cfg); });
}

const MemoryConfig io_small_memory{.d_model = 8, .n_heads = 2, .depth = 1, .chunk = 2};

ModelConfig two_block_model() {
    ModelConfig cfg = ModelConfig::uniform(BlockKind::MAL, 1, 16, 2, 2, 4, 0, 3);
    cfg.blocks.push_back(BlockConfig::make(BlockKind::MAC, 16, 2, 2, 5, 3));
    cfg.blocks[0].n_persistent = 2;
    return cfg;
}

}  // namespace

// io files: save refuses NaN parameters, leaves no file
TEST_CASE("io files: save refuses NaN params", "[io]") {
    TempDir dir("nan");
    const fs::path path = dir / "p.safetensors";
    auto p = MemoryParams<float>::random(io_small_memory, 3);
    p.w_k(1, 2) = std::numeric_limits<float>::quiet_NaN();
    const std::string msg = message_of<titans::NonFiniteError>(
        [&] { io::save_parameters(path, io_small_memory, p); });
    CHECK(after_source(msg, write_source(path)) == "tensor 'w_k' has a NaN or infinite value");
    // The same words as loading such a file.
    CHECK(after_source(load_message_params(io_small_memory, p), "raw") ==
          after_source(msg, write_source(path)));
    REQUIRE_THROWS_NAMING(io::parameters_writer(io_small_memory, p), titans::NonFiniteError,
                          "tensor 'w_k'");

    const ModelConfig mc = two_block_model();
    auto mp = ModelParams<double>::random(mc, 4);
    mp.blocks[1].memory.memory_init[1][0](0, 0) = std::numeric_limits<double>::infinity();
    REQUIRE_THROWS_NAMING(io::save_parameters(path, mc, mp), titans::NonFiniteError,
                          "tensor 'blocks.1.memory.memory_init.1.0' has a NaN or infinite");
    CHECK(dir.entries() == 0);  // neither the file nor a temporary
}

// io files: save refuses misshapen parameters
TEST_CASE("io files: save refuses bad shapes", "[io]") {
    TempDir dir("shape");
    const fs::path path = dir / "p.safetensors";
    const auto good = MemoryParams<float>::random(io_small_memory, 5);
    {
        auto p = good;
        p.w_q = Matrix<float>::Ones(8, 6);
        const std::string msg =
            message_of<titans::ShapeError>([&] { io::save_parameters(path, io_small_memory, p); });
        CHECK(after_source(msg, write_source(path)) ==
              "tensor 'w_q' has shape [8, 6], expected [8, 8]");
        CHECK(after_source(load_message_params(io_small_memory, p), "raw") ==
              after_source(msg, write_source(path)));
    }
    {
        auto p = good;
        p.b_eta = titans::RowVector<float>::Zero(3);
        REQUIRE_THROWS_NAMING(io::save_parameters(path, io_small_memory, p), titans::ShapeError,
                              "tensor 'b_eta' has shape [3], expected [2]");
        p = good;
        p.memory_init.pop_back();
        REQUIRE_THROWS_NAMING(io::save_parameters(path, io_small_memory, p), titans::ShapeError,
                              "memory_init");
    }
    const ModelConfig mc = two_block_model();
    auto mp = ModelParams<float>::random(mc, 6);
    mp.blocks.pop_back();
    REQUIRE_THROWS_NAMING(io::save_parameters(path, mc, mp), titans::ShapeError,
                          "blocks has 1 entries, expected 2");
    CHECK(dir.entries() == 0);
}

// io files: save refuses an invalid configuration
TEST_CASE("io files: save refuses bad config", "[io]") {
    TempDir dir("config");
    const fs::path path = dir / "p.safetensors";
    const auto p = MemoryParams<float>::random(io_small_memory, 7);
    MemoryConfig bad = io_small_memory;
    bad.chunk = 0;
    REQUIRE_THROWS_NAMING(io::save_parameters(path, bad, p), titans::ConfigError, "chunk");
    REQUIRE_THROWS_NAMING(io::save_parameters(path, bad, p), titans::ConfigError,
                          write_source(path));
    CHECK(dir.entries() == 0);
}

// io files: save refuses a state of another object
TEST_CASE("io files: save refuses foreign state", "[io]") {
    TempDir dir("foreign");
    const fs::path path = dir / "s.ckpt";
    const NeuralMemory<float> m1(io_small_memory, MemoryParams<float>::random(io_small_memory, 1));
    MemoryConfig other = io_small_memory;
    other.chunk = 4;
    const NeuralMemory<float> m2(other, MemoryParams<float>::random(other, 1));
    REQUIRE_THROWS_NAMING(io::save_checkpoint(path, m1, m2.make_state(1)), titans::ConfigError,
                          write_source(path));
    REQUIRE_THROWS_AS(io::save_checkpoint(path, m1, titans::MemoryState<float>{}),
                      titans::ConfigError);
    REQUIRE_THROWS_AS(io::checkpoint_writer(m1, m2.make_state(1)), titans::ConfigError);

    const BlockConfig bc = BlockConfig::make(BlockKind::MAL, 16, 2, 2, 4, 3);
    const BlockConfig gc = BlockConfig::make(BlockKind::MAG, 16, 2, 2, 4, 3);
    const titans::Block<float> mal(bc, titans::BlockParams<float>::random(bc, 2));
    const titans::Block<float> mag(gc, titans::BlockParams<float>::random(gc, 2));
    REQUIRE_THROWS_AS(io::save_checkpoint(path, mal, mag.make_state(1)), titans::ConfigError);

    const ModelConfig mc = two_block_model();
    const Model<float> model(mc, ModelParams<float>::random(mc, 3));
    auto st = model.make_state(1);
    st.blocks.pop_back();
    REQUIRE_THROWS_AS(io::save_checkpoint(path, model, st), titans::ConfigError);
    st = model.make_state(1);
    st.blocks[0] = model.make_state(2).blocks[0];  // another batch
    REQUIRE_THROWS_AS(io::save_checkpoint(path, model, st), titans::ConfigError);
    CHECK(dir.entries() == 0);
}

// io files: save refuses inconsistent positions
TEST_CASE("io files: save refuses bad positions", "[io]") {
    TempDir dir("positions");
    const fs::path path = dir / "s.ckpt";
    const ModelConfig mc = two_block_model();
    const Model<double> model(mc, ModelParams<double>::random(mc, 8));
    Rng rng(seed_for("io files positions"));
    auto st = model.make_state(2);
    (void)model.forward(st, random_matrix(2 * 7, 16, rng));
    REQUIRE_NOTHROW(io::checkpoint_writer(model, st));

    auto bad = st;
    bad.position += 3;
    const std::string msg =
        message_of<titans::FormatError>([&] { io::save_checkpoint(path, model, bad); });
    CHECK(after_source(msg, write_source(path)) ==
          "blocks.0.position = 7, expected position = 10 (inconsistent checkpoint)");
    // Loading such a file (written without the checks) says the same.
    const io::SafetensorsFile f(io::detail::unchecked_checkpoint_writer(model, bad).bytes(), "raw");
    const std::string load_msg =
        message_of<titans::FormatError>([&] { (void)io::restore_checkpoint(f, model); });
    CHECK(after_source(load_msg, "raw") == after_source(msg, write_source(path)));

    bad = st;
    bad.position = -1;
    REQUIRE_THROWS_NAMING(io::save_checkpoint(path, model, bad), titans::FormatError,
                          "position = -1, expected a value in [0, 2^62]");
    bad = st;
    bad.batch = 0;
    REQUIRE_THROWS_NAMING(io::save_checkpoint(path, model, bad), titans::FormatError,
                          "expected an integer in [1, 1000000]");
    CHECK(dir.entries() == 0);
    io::save_checkpoint(path, model, st);  // the consistent state is written
    CHECK(dir.entries() == 1);
}

// io files: loading a directory or /dev/null fails
TEST_CASE("io files: load dir or /dev/null", "[io]") {
    TempDir dir("dir");
    REQUIRE_THROWS_NAMING(io::SafetensorsFile::read(dir.path), titans::FileError,
                          "it is a directory, expected a regular file");
    REQUIRE_THROWS_NAMING(io::load_parameters<MemoryParams<float>>(dir.path, io_small_memory),
                          titans::FileError, dir.path.string());
#if defined(TITANS_TEST_POSIX)
    if (fs::exists("/dev/null")) {
        REQUIRE_THROWS_NAMING(io::SafetensorsFile::read("/dev/null"), titans::FileError,
                              "'/dev/null': it is a character device, expected a regular file");
    }
#endif
}

#if defined(TITANS_TEST_POSIX)
namespace {

/// What load() throws (its FileError's message, "other exception: ..." or "no exception"),
/// run on another thread so that a regression that blocks on the FIFO (in open() without a
/// writer, in read() with a live one) fails here instead of hanging the test binary: after 5 s
/// the reader is unblocked (a write end opened and closed completes a blocked open; closing
/// `writer`, the live write end if any, ends a blocked read) and the test fails. A load that
/// returns must return at once.
template <class Load>
std::string load_fifo_within(const fs::path& fifo, int& writer, Load load) {
    const auto t0 = std::chrono::steady_clock::now();
    auto done = std::async(std::launch::async, [&]() -> std::string {
        try {
            load();
        } catch (const titans::FileError& e) {
            return e.what();
        } catch (const std::exception& e) {
            return std::string("other exception: ") + e.what();
        }
        return "no exception";
    });
    if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
        const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
        if (w >= 0) ::close(w);
        if (writer >= 0) ::close(std::exchange(writer, -1));
        (void)done.wait_for(std::chrono::seconds(5));
        FAIL("reading a FIFO blocked");
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(seconds < 4.0);  // at once: a blocked open or read would wait for the writer forever
    return done.get();
}

/// Each loader of titans::io on `fifo` refuses it as a FIFO.
void check_fifo_refused(const fs::path& fifo, int& writer) {
    const NeuralMemory<float> mem(io_small_memory, MemoryParams<float>::random(io_small_memory, 1));
    const std::string what = "it is a FIFO, expected a regular file";
    std::string msg = load_fifo_within(fifo, writer, [&] { (void)io::SafetensorsFile::read(fifo); });
    CHECK_THAT(msg, TITANS_CONTAINS(what) && TITANS_CONTAINS(fifo.string()));
    msg = load_fifo_within(fifo, writer, [&] { (void)io::load_checkpoint(fifo, mem); });
    CHECK_THAT(msg, TITANS_CONTAINS(what));
    msg = load_fifo_within(
        fifo, writer, [&] { (void)io::load_parameters<MemoryParams<float>>(fifo, io_small_memory); });
    CHECK_THAT(msg, TITANS_CONTAINS(what));
}

}  // namespace

// io files: loading a FIFO fails at once
TEST_CASE("io files: load FIFO fails at once", "[io]") {
    TempDir dir("fifo");
    const fs::path fifo = dir / "pipe.safetensors";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    int no_writer = -1;
    check_fifo_refused(fifo, no_writer);
}

// io files: a FIFO with a live writer (a checkpoint streamed into a pipe by another thread or
// process) is refused at once too: opening it would not block, but reading would wait for the
// writer to finish, forever if it never does.
TEST_CASE("io files: FIFO with a live writer", "[io]") {
    TempDir dir("fifo_writer");
    const fs::path fifo = dir / "stream.safetensors";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    // The write end, held open by this process (O_RDWR opens a FIFO without waiting for a
    // reader), with the start of a checkpoint written: its 8-byte header length and more.
    int writer = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);
    REQUIRE(writer >= 0);
    const fs::path file = dir / "real.safetensors";
    io::save_parameters(file, io_small_memory, MemoryParams<float>::random(io_small_memory, 2));
    const auto bytes = io::detail::read_regular_file(file);
    const std::size_t part = std::min<std::size_t>(bytes.size() / 2, 4096);
    REQUIRE(::write(writer, bytes.data(), part) == static_cast<::ssize_t>(part));
    check_fifo_refused(fifo, writer);
    if (writer >= 0) ::close(writer);
}
#endif

namespace {

/// A safetensors file of n one-byte tensors: tensor "t<i>" at data offset perm[i], so the
/// JSON order, the name order and the offset order all differ.
std::vector<std::byte> many_tensors(int n, std::uint64_t seed, bool overlap_last) {
    std::vector<std::uint64_t> perm(static_cast<std::size_t>(n));
    std::iota(perm.begin(), perm.end(), std::uint64_t{0});
    std::shuffle(perm.begin(), perm.end(), Rng(seed));
    std::string h = "{\"__metadata__\":{\"format\":\"x\"}";
    for (int i = 0; i < n; ++i) {
        std::uint64_t b = perm[static_cast<std::size_t>(i)];
        if (overlap_last && i == n - 1) b = b == 0 ? 1 : b - 1;  // overlaps a neighbour
        h += ",\"t";
        h += std::to_string(i);
        h += "\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[";
        h += std::to_string(b);
        h += ",";
        h += std::to_string(b + 1);
        h += "]}";
    }
    h += "}";
    std::vector<std::byte> out(8 + h.size() + static_cast<std::size_t>(n), std::byte{7});
    const std::uint64_t len = h.size();
    std::memcpy(out.data(), &len, 8);
    std::memcpy(out.data() + 8, h.data(), h.size());
    return out;
}

}  // namespace

// io files: a header of 100000 tensors parses quickly
TEST_CASE("io files: 100000-tensor header fast", "[io]") {
    // Linear in the header size: nlohmann's callback parser (used before) took ~370 s here;
    // now ~0.2 s in Release, ~1 s under ASan. The bound is on this process's CPU time (not
    // wall time, which a loaded machine stretches) and separates linear from quadratic.
    constexpr int n = 100000;
    constexpr double bound_s = 10.0;
    auto cpu_s = [](std::clock_t a, std::clock_t b) {
        return static_cast<double>(b - a) / CLOCKS_PER_SEC;
    };
    auto bytes = many_tensors(n, seed_for("io files many"), false);
    std::clock_t t0 = std::clock();
    const io::SafetensorsFile f(std::move(bytes), "many");
    CHECK(cpu_s(t0, std::clock()) < bound_s);
    REQUIRE(f.tensors().size() == static_cast<std::size_t>(n));
    REQUIRE(f.find("t99999") != nullptr);
    CHECK(f.metadata_or("format", "") == "x");
    // Refused (an overlap, or the gap it leaves, found after the offset sort) just as quickly.
    bytes = many_tensors(n, seed_for("io files many"), true);
    t0 = std::clock();
    const std::string msg = message_of<titans::FormatError>(
        [&] { (void)io::SafetensorsFile(std::move(bytes), "many"); });
    CHECK(cpu_s(t0, std::clock()) < bound_s);
    CHECK_THAT(msg, TITANS_CONTAINS("starts at data offset"));
}

// io files: a 255-byte file name round trips
TEST_CASE("io files: 255-byte file name", "[io]") {
    TempDir dir("long_name");
    const std::string ext = ".safetensors";
    const fs::path path = dir / (std::string(255 - ext.size(), 'n') + ext);
    REQUIRE(path.filename().string().size() == 255);
    const auto p = MemoryParams<float>::random(io_small_memory, 9);
    io::save_parameters(path, io_small_memory, p);
    CHECK(dir.entries() == 1);  // no temporary left
    const auto q = io::load_parameters<MemoryParams<float>>(path, io_small_memory);
    CHECK(identical(q.w_q, p.w_q));
    const NeuralMemory<float> mem(io_small_memory, p);
    auto st = mem.make_state(1);
    io::save_checkpoint(path, mem, st);  // replaces the parameter file
    CHECK(dir.entries() == 1);
    CHECK(io::load_checkpoint(path, mem).position() == 0);
}

// io files: writer refuses a rank the reader rejects
TEST_CASE("io files: writer refuses bad rank", "[io]") {
    io::SafetensorsWriter w;
    const std::vector<std::byte> one(4);
    REQUIRE_THROWS_NAMING(w.add_raw("r9", io::DType::F32, std::vector<std::uint64_t>(9, 1), one),
                          titans::FormatError, "rank 9, expected at most 8");
    REQUIRE_NOTHROW(w.add_raw("r8", io::DType::F32, std::vector<std::uint64_t>(8, 1), one));
}
