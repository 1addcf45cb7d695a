// Parameter files and checkpoints (titans/io/parameters.hpp, titans/io/checkpoint.hpp):
// round trips of every parameter kind in float and double, resume from a checkpoint equal bit
// for bit to the stream that never stopped (memory in every mode, the four blocks, a mixed
// model), and one test per rejected file: wrong format, version, object, dtype, configuration,
// parameters, batch, missing / unexpected / misshapen / mistyped / non-finite tensors and
// positions that contradict each other.
#include "backends.hpp"
#include "io/temp_dir.hpp"

#include <titans/io/checkpoint.hpp>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace titans_test;
using titans::Block;
using titans::BlockConfig;
using titans::BlockKind;
using titans::BlockParams;
using titans::Model;
using titans::ModelConfig;
using titans::ModelParams;
namespace io = titans::io;
namespace fs = std::filesystem;

namespace {


template <class T>
Matrix<T> random_input(Eigen::Index rows, int d, Rng& rng) {
    return random_matrix(rows, d, rng).cast<T>();
}

template <class T>
bool bit_equal(const Matrix<T>& a, const Matrix<T>& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() &&
           (a.size() == 0 ||
            std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)) == 0);
}

/// Every tensor and metadata entry of `f`, rewritten through `edit` (which may change the
/// metadata map, skip a tensor by returning false, or replace its dtype/shape/bytes), plus
/// `extra` tensors at the end.
struct Edit {
    std::map<std::string, std::string> meta = {};  // overrides; value "\x01" removes the key
    std::set<std::string> drop = {};
    std::function<bool(const io::TensorInfo&, io::DType&, std::vector<std::uint64_t>&,
                       std::vector<std::byte>&)>
        tensor = {};  // may modify; return false to drop
    std::vector<std::pair<std::string, std::vector<std::int64_t>>> extra_ints = {};
};

io::SafetensorsFile rewrite(const io::SafetensorsFile& f, const Edit& e) {
    io::SafetensorsWriter w;
    for (const auto& [k, v] : f.metadata()) {
        const auto it = e.meta.find(k);
        if (it == e.meta.end()) {
            w.metadata(k, v);
        } else if (it->second != "\x01") {
            w.metadata(k, it->second);
        }
    }
    for (const auto& [k, v] : e.meta) {
        if (f.metadata().count(k) == 0 && v != "\x01") w.metadata(k, v);
    }
    for (const io::TensorInfo& t : f.tensors()) {
        if (e.drop.count(t.name)) continue;
        const auto raw = f.data(t);
        io::DType dt = t.dtype;
        std::vector<std::uint64_t> shape = t.shape;
        std::vector<std::byte> bytes(raw.begin(), raw.end());
        if (e.tensor && !e.tensor(t, dt, shape, bytes)) continue;
        w.add_raw(t.name, dt, shape, bytes);
    }
    for (const auto& [name, ints] : e.extra_ints) {
        w.add_integers(name, ints);
    }
    return io::SafetensorsFile(w.bytes(), "edited");
}

io::SafetensorsFile parsed(const io::SafetensorsWriter& w, const std::string& name = "mem") {
    return io::SafetensorsFile(w.bytes(), name);
}

template <class T>
std::vector<ModelConfig> model_configs(Rng& rng) {
    std::vector<ModelConfig> out;
    for (BlockKind k : titans::all_block_kinds) {
        ModelConfig c = ModelConfig::uniform(k, 1, 16, 2, uniform_int(rng, 1, 3),
                                             uniform_int(rng, 3, 7), 0, uniform_int(rng, 2, 5));
        c.blocks[0].n_persistent = uniform_int(rng, 0, 3);
        c.blocks[0].attention.rope = k == BlockKind::MAG;
        out.push_back(c);
    }
    ModelConfig mixed = ModelConfig::uniform(BlockKind::MAC, 1, 16, 2, 2, 5, 11, 4);
    mixed.blocks.push_back(BlockConfig::make(BlockKind::MAL, 16, 2, 1, 4, 3));
    mixed.blocks.push_back(BlockConfig::make(BlockKind::MAG, 16, 4, 3, 6, 5));
    mixed.blocks.back().ffn.kind = titans::FeedForwardKind::GELU;
    mixed.blocks.back().memory.gates = GateMode::Constant;
    out.push_back(mixed);
    return out;
}

template <class M>
bool params_bit_equal(const M& a, const M& b, const ModelConfig& cfg) {
    bool same = true;
    std::vector<Matrix<typename decltype(a.head)::Scalar>> ta, tb;
    M::tensors(a, cfg, [&](const std::string&, const auto& m) { ta.emplace_back(m); });
    M::tensors(b, cfg, [&](const std::string&, const auto& m) { tb.emplace_back(m); });
    same = ta.size() == tb.size();
    for (std::size_t i = 0; same && i < ta.size(); ++i) same = bit_equal(ta[i], tb[i]);
    return same;
}

}  // namespace

// io: parameter files round trip bit for bit for every block kind and a mixed model
TEMPLATE_TEST_CASE("io: params round-trip", "[io]", float, double) {
    using T = TestType;
    Rng rng(seed_for("io params round trip", sizeof(T)));
    TempDir dir("params_round_trip");
    for (const ModelConfig& cfg : model_configs<T>(rng)) {
        CAPTURE(io::config_text(cfg));
        const ModelParams<T> p = ModelParams<T>::random(cfg, rng());
        const fs::path path = dir / "model.safetensors";
        const Model<T> model(cfg, p);
        io::save_parameters(path, model);
        // Only the file itself is left in the directory: the temporary was renamed.
        REQUIRE(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}) == 1);
        const auto q = io::load_parameters<ModelParams<T>>(path, cfg);
        REQUIRE(params_bit_equal(p, q, cfg));
        // The other precision reads with conversion: equal to a cast.
        using U = std::conditional_t<std::is_same_v<T, float>, double, float>;
        const auto r = io::load_parameters<ModelParams<U>>(path, cfg);
        std::vector<Matrix<U>> got, want;
        ModelParams<U>::tensors(r, cfg, [&](const std::string&, const auto& m) { got.emplace_back(m); });
        ModelParams<T>::tensors(p, cfg, [&](const std::string&, const auto& m) {
            want.emplace_back(m.template cast<U>());
        });
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(bit_equal(got[i], want[i]));
        // The metadata records the configuration.
        const auto f = io::SafetensorsFile::read(path);
        REQUIRE(f.metadata_or("format", "") == "titans.params");
        REQUIRE(f.metadata_or("config", "") == io::config_text(cfg));
        REQUIRE(f.metadata_or("object", "") == "model");
    }
    // Memory alone and a block alone.
    MemoryConfig mc{.d_model = 12, .n_heads = 3, .depth = 3, .use_conv = false, .chunk = 4};
    const auto mp = MemoryParams<T>::random(mc, rng());
    const auto mf = parsed(io::parameters_writer(mc, mp));
    const auto mq = io::load_parameters<MemoryParams<T>>(mf, mc);
    std::size_t n = 0;
    MemoryParams<T>::tensors(mq, mc, [&](const std::string& name, const auto& m) {
        CAPTURE(name);
        ++n;
        REQUIRE(bit_equal(Matrix<T>(m), Matrix<T>(mf.template matrix<T>(name))));
    });
    REQUIRE(n == mf.tensors().size());
    const BlockConfig bc = BlockConfig::make(BlockKind::MAL, 16, 2, 2, 4, 3);
    const auto bp = BlockParams<T>::random(bc, rng());
    const auto bq = io::load_parameters<BlockParams<T>>(parsed(io::parameters_writer(bc, bp)), bc);
    Block<T> b1(bc, bp), b2(bc, bq);
    auto s1 = b1.make_state(2);
    auto s2 = b2.make_state(2);
    const Matrix<T> x = random_input<T>(2 * 9, 16, rng);
    REQUIRE(bit_equal(b1.forward(s1, x), b2.forward(s2, x)));
}

// io: parameter files are rejected with the tensor named
TEST_CASE("io: bad params name the tensor", "[io]") {
    using T = double;
    Rng rng(seed_for("io params errors"));
    const BlockConfig cfg = BlockConfig::make(BlockKind::MAG, 16, 2, 2, 4, 3);
    const auto p = BlockParams<T>::random(cfg, rng());
    const auto f = parsed(io::parameters_writer(cfg, p), "params");
    REQUIRE_NOTHROW(io::load_parameters<BlockParams<T>>(f, cfg));

    SECTION("a missing tensor") {
        const auto g = rewrite(f, Edit{.drop = {"memory.w_k"}});
        REQUIRE_THROWS_NAMING(io::load_parameters<BlockParams<T>>(g, cfg), titans::FormatError,
                              "tensor 'memory.w_k' is missing");
    }
    SECTION("an unexpected tensor") {
        const auto g = rewrite(f, Edit{.extra_ints = {{"memory.w_z", {1}}}});
        REQUIRE_THROWS_NAMING(io::load_parameters<BlockParams<T>>(g, cfg), titans::FormatError,
                              "unexpected tensor 'memory.w_z'");
    }
    SECTION("a tensor of the wrong shape") {
        const auto g = rewrite(f, Edit{.tensor = [](const io::TensorInfo& t, io::DType&,
                                                    std::vector<std::uint64_t>& s,
                                                    std::vector<std::byte>&) {
                                           if (t.name == "memory.w_theta") std::swap(s[0], s[1]);
                                           return true;
                                       }});
        REQUIRE_THROWS_NAMING(io::load_parameters<BlockParams<T>>(g, cfg), titans::ShapeError,
                              "tensor 'memory.w_theta' has shape [2, 16], expected [16, 2]");
    }
    SECTION("a NaN weight") {
        const auto g = rewrite(f, Edit{.tensor = [](const io::TensorInfo& t, io::DType&,
                                                    std::vector<std::uint64_t>&,
                                                    std::vector<std::byte>& b) {
                                           if (t.name == "norm_y") {
                                               const double nan = std::numeric_limits<double>::quiet_NaN();
                                               std::memcpy(b.data() + 8, &nan, 8);
                                           }
                                           return true;
                                       }});
        REQUIRE_THROWS_NAMING(io::load_parameters<BlockParams<T>>(g, cfg), titans::NonFiniteError,
                              "tensor 'norm_y' has a NaN");
    }
    SECTION("a checkpoint is not a parameter file") {
        const auto g = rewrite(f, Edit{.meta = {{"format", "titans.checkpoint"}}});
        REQUIRE_THROWS_NAMING(io::load_parameters<BlockParams<T>>(g, cfg), titans::FormatError,
                              "format is \"titans.checkpoint\", expected \"titans.params\"");
    }
    SECTION("an unknown format_version") {
        const auto g = rewrite(f, Edit{.meta = {{"format_version", "2"}}});
        REQUIRE_THROWS_NAMING(io::load_parameters<BlockParams<T>>(g, cfg), titans::FormatError,
                              "format_version \"2\" is not supported");
    }
    SECTION("a file without metadata (another tool) loads, F16 converted") {
        // Same names and shapes, F16 data, no metadata: the values must equal the halves.
        io::SafetensorsWriter w;
        std::map<std::string, Matrix<T>> want;
        BlockParams<T>::tensors(p, cfg, [&](const std::string& name, const auto& m) {
            std::vector<std::uint16_t> h(static_cast<std::size_t>(m.size()));
            Matrix<T> v(m.rows(), m.cols());
            for (Eigen::Index i = 0; i < m.size(); ++i) {
                // 1 + i/1024 rounded to a half: exactly representable for i < 1024.
                const auto k = static_cast<std::uint16_t>(i % 1024);
                h[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(0x3C00 + k);
                v.data()[i] = 1.0 + k / 1024.0;
            }
            std::vector<std::uint64_t> shape{static_cast<std::uint64_t>(m.rows()),
                                             static_cast<std::uint64_t>(m.cols())};
            if (std::decay_t<decltype(m)>::RowsAtCompileTime == 1) shape = {shape[1]};
            w.add_raw(name, io::DType::F16, shape, std::as_bytes(std::span(h)));
            want.emplace(name, v);
        });
        const auto q = io::load_parameters<BlockParams<T>>(io::SafetensorsFile(w.bytes()), cfg);
        BlockParams<T>::tensors(q, cfg, [&](const std::string& name, const auto& m) {
            CAPTURE(name);
            REQUIRE(bit_equal(Matrix<T>(m), want.at(name)));
        });
    }
}

namespace {

/// Streams x1 then x2 through `object` twice: uninterrupted, and with a checkpoint written to
/// disk after x1 and restored into `other` (an object rebuilt from the saved parameter file).
/// Returns true if the outputs of x2 (and of a further x3) are bit-identical.
template <class Object, class MakeInput>
bool resume_equals_uninterrupted(const Object& object, const Object& other, int batch,
                                 MakeInput make, const fs::path& path) {
    auto st = object.make_state(batch);
    (void)object.forward(st, make(1));
    io::save_checkpoint(path, object, st);
    const auto y2 = object.forward(st, make(2));
    const auto y3 = object.forward(st, make(3));
    auto rs = io::load_checkpoint(path, other);
    const auto z2 = other.forward(rs, make(2));
    const auto z3 = other.forward(rs, make(3));
    return bit_equal(y2, z2) && bit_equal(y3, z3);
}

}  // namespace

// io: a memory resumed from a checkpoint equals the uninterrupted stream
TEMPLATE_LIST_TEST_CASE("io: memory resumes", "[io]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    Rng rng(seed_for("io memory resume", sizeof(T)));
    TempDir dir("memory_resume");
    std::vector<MemoryConfig> cfgs;
    MemoryConfig base{.d_model = 12, .n_heads = 2, .depth = 2, .chunk = 4};
    cfgs.push_back(base);
    auto in_chunk = base;
    in_chunk.retrieval = Retrieval::InChunk;
    cfgs.push_back(in_chunk);
    auto per_token = base;
    per_token.update = UpdateMode::PerToken;
    cfgs.push_back(per_token);
    auto constant = base;
    constant.gates = GateMode::Constant;
    constant.use_conv = false;
    cfgs.push_back(constant);
    auto per_chunk = base;
    per_chunk.gates = GateMode::PerChunk;
    per_chunk.depth = 3;
    cfgs.push_back(per_chunk);
    for (const MemoryConfig& cfg : cfgs) {
        CAPTURE(io::config_text(cfg));
        const NeuralMemory<T, Bk> mem(cfg, MemoryParams<T>::random(cfg, rng()));
        io::save_parameters(dir / "p.safetensors", mem);
        const NeuralMemory<T, Bk> other(cfg, io::load_parameters<MemoryParams<T>>(
                                             dir / "p.safetensors", cfg));
        const int B = uniform_int(rng, 1, 3);
        // Stop inside a chunk, at a chunk boundary and at the very start.
        for (int n1 : {uniform_int(rng, 1, 3) + 4 * uniform_int(rng, 0, 2), 8, 0}) {
            CAPTURE(B, n1);
            std::map<int, Matrix<T>> inputs;
            auto make = [&](int k) -> const Matrix<T>& {
                if (!inputs.count(k)) {
                    const int n = k == 1 ? n1 : uniform_int(rng, 1, 9);
                    inputs.emplace(k, random_input<T>(static_cast<Eigen::Index>(B) * n, 12, rng));
                }
                return inputs.at(k);
            };
            REQUIRE(resume_equals_uninterrupted(mem, other, B, make, dir / "ck.safetensors"));
        }
    }
}

// io: blocks and a mixed model resumed from a checkpoint equal the uninterrupted stream
TEMPLATE_LIST_TEST_CASE("io: blocks resume", "[io]", Both) {
    using T = typename TestType::Scalar;
    using Bk = typename TestType::Backend;
    Rng rng(seed_for("io model resume", sizeof(T)));
    TempDir dir("model_resume");
    for (const ModelConfig& cfg : model_configs<T>(rng)) {
        CAPTURE(io::config_text(cfg));
        const Model<T, Bk> model(cfg, ModelParams<T>::random(cfg, rng()));
        io::save_parameters(dir / "p.safetensors", model);
        const Model<T, Bk> other(cfg, io::load_parameters<ModelParams<T>>(dir / "p.safetensors", cfg));
        const int B = uniform_int(rng, 1, 2);
        for (int n1 : {uniform_int(rng, 1, 13), 0}) {
            CAPTURE(B, n1);
            std::map<int, Matrix<T>> inputs;
            auto make = [&](int k) -> const Matrix<T>& {
                if (!inputs.count(k)) {
                    const int n = k == 1 ? n1 : uniform_int(rng, 1, 11);
                    inputs.emplace(k, random_input<T>(static_cast<Eigen::Index>(B) * n, 16, rng));
                }
                return inputs.at(k);
            };
            REQUIRE(resume_equals_uninterrupted(model, other, B, make, dir / "ck.safetensors"));
        }
        // The first block alone, checkpointed as a block.
        const Block<T, Bk>& block = model.blocks()[0];
        std::map<int, Matrix<T>> inputs;
        auto make = [&](int k) -> const Matrix<T>& {
            if (!inputs.count(k)) {
                inputs.emplace(k, random_input<T>(static_cast<Eigen::Index>(B) * uniform_int(rng, 1, 9), 16, rng));
            }
            return inputs.at(k);
        };
        REQUIRE(resume_equals_uninterrupted(block, other.blocks()[0], B, make,
                                            dir / "block.safetensors"));
    }
}

// io: checkpoints that do not match or contradict themselves are rejected
TEST_CASE("io: bad checkpoints rejected", "[io]") {
    using T = double;
    Rng rng(seed_for("io checkpoint errors"));
    ModelConfig cfg = ModelConfig::uniform(BlockKind::MAL, 1, 16, 2, 2, 4, 0, 3);
    cfg.blocks.push_back(BlockConfig::make(BlockKind::MAC, 16, 2, 2, 5, 3));
    cfg.blocks[0].n_persistent = 2;
    const Model<T> model(cfg, ModelParams<T>::random(cfg, rng()));
    auto st = model.make_state(2);
    (void)model.forward(st, random_input<T>(2 * 7, 16, rng));
    const auto f = parsed(io::checkpoint_writer(model, st), "ck");
    REQUIRE_NOTHROW(io::restore_checkpoint(f, model));

    SECTION("a parameter file is not a checkpoint") {
        const auto g = parsed(io::parameters_writer(cfg, model.params()), "params");
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(g, model), titans::FormatError,
                              "expected \"titans.checkpoint\"");
        const auto h = rewrite(f, Edit{.meta = {{"format", "\x01"}}});
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(h, model), titans::FormatError,
                              "no __metadata__ \"format\"");
    }
    SECTION("another format_version") {
        const auto g = rewrite(f, Edit{.meta = {{"format_version", "7"}}});
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(g, model), titans::FormatError,
                              "format_version \"7\" is not supported, expected \"1\"");
    }
    SECTION("another object kind") {
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(f, model.blocks()[0]), titans::ConfigError,
                              "checkpoint of a model, expected a block");
    }
    SECTION("another precision") {
        const Model<float> mf(cfg, ModelParams<float>::random(cfg, 1));
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(f, mf), titans::ConfigError,
                              "checkpoint dtype F64, expected F32");
    }
    SECTION("another configuration, first differing setting named") {
        ModelConfig c2 = cfg;
        c2.blocks[1].memory.chunk = 4;
        const Model<T> m2(c2, ModelParams<T>::random(c2, 1));
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(f, m2), titans::ConfigError,
                              "blocks.1.memory.chunk = 3 in the checkpoint, 4 in this object");
        ModelConfig c3 = cfg;
        c3.blocks.pop_back();
        const Model<T> m3(c3, ModelParams<T>::random(c3, 1));
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(f, m3), titans::ConfigError,
                              "n_blocks = 2 in the checkpoint, 1 in this object");
        // flush_denormals is not part of a stream's identity.
        ModelConfig c4 = cfg;
        c4.blocks[0].memory.flush_denormals = !c4.blocks[0].memory.flush_denormals;
        const Model<T> m4(c4, model.params());
        REQUIRE_NOTHROW(io::restore_checkpoint(f, m4));
    }
    SECTION("other outer parameters") {
        ModelParams<T> p2 = model.params();
        p2.blocks[1].memory.w_o(0, 0) += 1e-12;
        const Model<T> m2(cfg, p2);
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(f, m2), titans::ConfigError,
                              "params_hash differs");
    }
    SECTION("corrupt metadata") {
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.meta = {{"config_hash", "0"}}}), model),
                              titans::FormatError, "config_hash does not match");
        for (const char* b : {"0", "-1", "abc", "2x", "99999999999"}) {
            REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.meta = {{"batch", b}}}), model),
                                  titans::FormatError, "batch");
        }
        // A batch that parses but disagrees with the tensors: shapes no longer match.
        REQUIRE_THROWS_AS(io::restore_checkpoint(rewrite(f, Edit{.meta = {{"batch", "1"}}}), model),
                          titans::FormatError);
        // A batch far beyond what the file holds is rejected before any allocation.
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.meta = {{"batch", "1000000"}}}), model),
                              titans::FormatError, "batch = 1000000 needs");
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.meta = {{"params_hash", "\x01"}}}), model),
                              titans::FormatError, "__metadata__ has no \"params_hash\"");
    }
    SECTION("missing and unexpected tensors") {
        REQUIRE_THROWS_NAMING(
            io::restore_checkpoint(rewrite(f, Edit{.drop = {"blocks.1.snapshot.1.0.1"}}), model),
            titans::FormatError, "tensor 'blocks.1.snapshot.1.0.1' is missing");
        REQUIRE_THROWS_NAMING(
            io::restore_checkpoint(rewrite(f, Edit{.drop = {"blocks.0.attention.position"}}), model),
            titans::FormatError, "tensor 'blocks.0.attention.position' is missing");
        REQUIRE_THROWS_NAMING(
            io::restore_checkpoint(rewrite(f, Edit{.extra_ints = {{"blocks.0.extra", {3}}}}), model),
            titans::FormatError, "unexpected tensor 'blocks.0.extra'");
    }
    SECTION("tensors of the wrong dtype, shape or value") {
        auto to_f32 = [](const io::TensorInfo& t, io::DType& dt, std::vector<std::uint64_t>&,
                         std::vector<std::byte>& b) {
            if (t.name == "blocks.0.memory.heads.1.0.w.0") {
                dt = io::DType::F32;
                b.resize(b.size() / 2);
            }
            return true;
        };
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.tensor = to_f32}), model),
                              titans::FormatError,
                              "tensor 'blocks.0.memory.heads.1.0.w.0' is F32, expected F64");
        auto reshape = [](const io::TensorInfo& t, io::DType&, std::vector<std::uint64_t>& s,
                          std::vector<std::byte>&) {
            if (t.name == "blocks.1.seg_k.0") s = {s[0] * s[1]};
            return true;
        };
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.tensor = reshape}), model),
                              titans::ShapeError, "tensor 'blocks.1.seg_k.0' has shape");
        auto pos_as_f64 = [](const io::TensorInfo& t, io::DType& dt, std::vector<std::uint64_t>&,
                             std::vector<std::byte>&) {
            if (t.name == "position") dt = io::DType::F64;
            return true;
        };
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.tensor = pos_as_f64}), model),
                              titans::FormatError, "tensor 'position' is F64 [1], expected I64 [1]");
        auto inf = [](const io::TensorInfo& t, io::DType&, std::vector<std::uint64_t>&,
                      std::vector<std::byte>& b) {
            if (t.name == "blocks.0.memory.heads.0.1.s.1") {
                const double v = std::numeric_limits<double>::infinity();
                std::memcpy(b.data(), &v, 8);
            }
            return true;
        };
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.tensor = inf}), model),
                              titans::NonFiniteError, "tensor 'blocks.0.memory.heads.0.1.s.1'");
    }
    SECTION("positions and buffers that contradict each other") {
        auto set_int = [](std::string name, std::int64_t v) {
            return [name, v](const io::TensorInfo& t, io::DType&, std::vector<std::uint64_t>&,
                             std::vector<std::byte>& b) {
                if (t.name == name) std::memcpy(b.data(), &v, 8);
                return true;
            };
        };
        REQUIRE_THROWS_NAMING(
            io::restore_checkpoint(rewrite(f, Edit{.tensor = set_int("blocks.0.memory.position", 8)}), model),
            titans::FormatError, "blocks.0.memory.position = 8, expected 9");
        REQUIRE_THROWS_NAMING(
            io::restore_checkpoint(rewrite(f, Edit{.tensor = set_int("position", 6)}), model),
            titans::FormatError, "blocks.0.position = 7, expected position = 6");
        REQUIRE_THROWS_NAMING(
            io::restore_checkpoint(rewrite(f, Edit{.tensor = set_int("blocks.1.position", -5)}), model),
            titans::FormatError, "blocks.1.position = -5, expected a value in [0, 2^62]");
        // The attention window keeps min(w - 1, position) = 3 rows: a longer history, or keys
        // and values of different lengths, would send the kernel outside its buffers.
        auto grow = [](const io::TensorInfo& t, io::DType&, std::vector<std::uint64_t>& s,
                       std::vector<std::byte>& b) {
            if (t.name == "blocks.0.attention.k.1") {
                s[0] += 1;
                b.resize(b.size() + s[1] * 8, std::byte{0});
            }
            return true;
        };
        REQUIRE_THROWS_NAMING(io::restore_checkpoint(rewrite(f, Edit{.tensor = grow}), model),
                              titans::FormatError, "blocks.0.attention.k/v.1 rows = 4, expected 3");
    }
}

// io: files that cannot be opened or written give FileError
TEST_CASE("io: unopenable file is FileError", "[io]") {
    const MemoryConfig cfg{.d_model = 8, .n_heads = 2, .depth = 1, .chunk = 2};
    const NeuralMemory<float> mem(cfg, MemoryParams<float>::random(cfg, 5));
    const fs::path nowhere = fs::temp_directory_path() / "titans_no_such_dir_9f3" / "x.safetensors";
    REQUIRE_THROWS_NAMING(io::load_checkpoint(nowhere, mem), titans::FileError, "cannot open");
    REQUIRE_THROWS_NAMING(io::save_parameters(nowhere, mem), titans::FileError, "cannot open");
    REQUIRE_THROWS_NAMING(io::load_parameters<MemoryParams<float>>(nowhere, cfg), titans::FileError,
                          "x.safetensors");
    // A failed write leaves neither the file nor a temporary behind, and keeps an old file.
    TempDir dir("write_failure");
    const fs::path target = dir / "p.safetensors";
    io::save_parameters(target, mem);
    const auto before = io::SafetensorsFile::read(target).metadata_or("config_hash", "");
    fs::create_directory(dir / "blocked.safetensors");  // a directory: rename over it fails
    REQUIRE_THROWS_AS(io::save_parameters(dir / "blocked.safetensors", mem), titans::FileError);
    REQUIRE(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator{}) == 2);
    REQUIRE(io::SafetensorsFile::read(target).metadata_or("config_hash", "") == before);
}
