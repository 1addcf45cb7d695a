// fuzz/make_corpus.cpp: writes the seed corpus of the safetensors fuzz target (target
// titans_make_corpus). Valid files are written with SafetensorsWriter; malformed ones are built
// by hand or by damaging a valid file. Every file is small (< 4 KiB).
//
//     ./build/release/fuzz/titans_make_corpus fuzz/corpus/safetensors
//
// Names starting with "valid_" parse; "bad_" are rejected with a FormatError.
//
//     ./build/release/fuzz/titans_make_corpus fuzz/corpus/checkpoint checkpoint
//
// writes the checkpoint corpus instead: valid checkpoints of the fuzz target's fixed model, of
// its MAL block and of that block's memory at positions 0, 3 and 7 (checkpoint_objects.hpp).
//
//     ./build/release/fuzz/titans_make_corpus fuzz/corpus/optimizer optimizer
//
// writes the optimiser corpus: AdamW files of the fuzz target's feed-forward, valid ones and
// ones load_optimizer refuses (optimizer_objects.hpp).

#include <titans/io/safetensors.hpp>

#include "checkpoint_objects.hpp"
#include "optimizer_objects.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using titans::io::DType;
using titans::io::SafetensorsWriter;
using Bytes = std::vector<std::byte>;

fs::path out_dir;
int written = 0;

std::size_t max_bytes = 4096;

void save(const std::string& name, const Bytes& b) {
    if (b.size() >= max_bytes) {
        std::fprintf(stderr, "make_corpus: %s is %zu bytes (>= 4 KiB)\n", name.c_str(), b.size());
        std::exit(1);
    }
    std::ofstream out(out_dir / name, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    if (!out) {
        std::fprintf(stderr, "make_corpus: cannot write %s\n", (out_dir / name).string().c_str());
        std::exit(1);
    }
    ++written;
}

/// 8-byte little-endian header length, header, data.
Bytes st_file(const std::string& header, const Bytes& data = {}) {
    Bytes out(8);
    const std::uint64_t n = header.size();
    std::memcpy(out.data(), &n, 8);
    for (char c : header) out.push_back(static_cast<std::byte>(c));
    out.insert(out.end(), data.begin(), data.end());
    return out;
}

template <class T>
std::span<const std::byte> as_bytes(const std::vector<T>& v) {
    return std::as_bytes(std::span<const T>(v));
}

titans::Matrixf ramp(int r, int c, float scale) {
    titans::Matrixf m(r, c);
    for (int i = 0; i < m.size(); ++i) m.data()[i] = scale * static_cast<float>(i - m.size() / 2);
    return m;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string mode = argc == 3 ? argv[2] : "";
    if (argc != 2 && !(argc == 3 && (mode == "checkpoint" || mode == "optimizer"))) {
        std::fprintf(stderr, "usage: %s <output directory> [checkpoint | optimizer]\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    fs::create_directories(out_dir);
    if (mode == "optimizer") {
        for (const auto& [name, bytes] : titans_fuzz::optimizer_seeds()) {
            save(name + ".safetensors", bytes);
        }
        std::printf("make_corpus: wrote %d optimiser files to %s\n", written,
                    out_dir.string().c_str());
        return 0;
    }
    if (mode == "checkpoint") {
        max_bytes = 65536;
        for (int tokens : {0, 3, 7}) {
            for (const auto& [name, bytes] : titans_fuzz::checkpoint_seeds(tokens)) {
                save(name + ".safetensors", bytes);
            }
        }
        std::printf("make_corpus: wrote %d checkpoints to %s\n", written, out_dir.string().c_str());
        return 0;
    }

    // ---- valid files ------------------------------------------------------------------------
    {
        SafetensorsWriter w;
        w.add("w", ramp(3, 4, 0.25f));
        save("valid_f32_rank2.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        w.add("w", ramp(2, 5, 0.5f).cast<double>().eval());
        save("valid_f64_rank2.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        const std::vector<std::uint16_t> h{0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x8000};
        const std::vector<std::uint16_t> b{0x3F80, 0xC020, 0x7F61, 0x0001};
        w.add_raw("half", DType::F16, {2, 3}, as_bytes(h));
        w.add_raw("bf16", DType::BF16, {4}, as_bytes(b));
        save("valid_f16_bf16.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        w.add_integers("steps", std::vector<std::int64_t>{0, 1, -1, std::numeric_limits<std::int64_t>::max()});
        const std::vector<std::int32_t> i32{1, -2, 3, -4};
        w.add_raw("i32", DType::I32, {2, 2}, as_bytes(i32));
        save("valid_i64_i32.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        w.metadata("format", "titans.params");
        w.metadata("version", "1");
        save("valid_metadata_only.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        w.metadata("format", "titans.checkpoint");
        w.metadata("config", R"({"d_model":4,"n_heads":2})");
        w.add("blocks.0.memory.w_q", ramp(4, 4, 0.125f));
        w.add("blocks.0.memory.b_eta", titans::RowVectorf::Constant(2, 0.5f));
        w.add_integers("position", std::vector<std::int64_t>{7});
        save("valid_metadata_tensors.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        const std::vector<float> s{3.5f};
        const std::vector<double> d{-1.25};
        w.add_raw("scalar_f32", DType::F32, {}, as_bytes(s));
        w.add_raw("scalar_f64", DType::F64, {}, as_bytes(d));
        save("valid_rank0.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        w.add("v", titans::RowVectorf::LinSpaced(6, -1.0f, 1.0f).eval());
        w.add("vd", titans::RowVectord::LinSpaced(3, 0.0, 2.0).eval());
        save("valid_rank1.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        const std::vector<float> v{1, 2, 3, 4, 5, 6, 7, 8};
        w.add_raw("cube", DType::F32, {2, 2, 2}, as_bytes(v));
        w.add("m", ramp(1, 2, 1.0f));
        save("valid_rank3.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;
        w.add("rows0", titans::Matrixf(0, 3));
        w.add("cols0", titans::Matrixd(2, 0));
        w.add("vec0", titans::RowVectorf(0));
        w.add_integers("ints0", std::vector<std::int64_t>{});
        w.add("one", ramp(1, 1, 1.0f));
        save("valid_empty_tensors.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;  // one tensor of every dtype
        const std::vector<std::uint8_t> b1{1, 0, 255, 7};
        const std::vector<std::uint16_t> b2{1, 0xFFFF};
        const std::vector<std::uint32_t> b4{1, 0xFFFFFFFFu};
        const std::vector<std::uint64_t> b8{1, ~std::uint64_t{0}};
        for (DType t : {DType::BOOL, DType::U8, DType::I8, DType::F8_E4M3, DType::F8_E5M2}) {
            w.add_raw(std::string("t_") + titans::io::to_string(t), t, {4}, as_bytes(b1));
        }
        for (DType t : {DType::U16, DType::I16}) {
            w.add_raw(std::string("t_") + titans::io::to_string(t), t, {2}, as_bytes(b2));
        }
        for (DType t : {DType::U32}) {
            w.add_raw(std::string("t_") + titans::io::to_string(t), t, {2}, as_bytes(b4));
        }
        for (DType t : {DType::U64}) {
            w.add_raw(std::string("t_") + titans::io::to_string(t), t, {1, 2}, as_bytes(b8));
        }
        save("valid_all_dtypes.safetensors", w.bytes());
    }
    {
        SafetensorsWriter w;  // parses; matrix() throws NonFiniteError
        const std::vector<float> v{1.0f, std::numeric_limits<float>::quiet_NaN(),
                                   std::numeric_limits<float>::infinity(), 0.0f};
        w.add_raw("nonfinite", DType::F32, {2, 2}, as_bytes(v));
        const std::vector<double> big{1e300};
        w.add_raw("too_big_for_float", DType::F64, {1}, as_bytes(big));
        save("valid_nonfinite.safetensors", w.bytes());
    }
    save("valid_empty_header.safetensors", st_file("{}"));
    save("valid_unordered_offsets.safetensors",
         st_file(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                 R"("a":{"data_offsets":[0,4],"shape":[],"dtype":"F32"},)"
                 R"("z":{"dtype":"F64","shape":[0,3],"data_offsets":[8,8]}}    )",
                 Bytes(8, std::byte{0x3f})));
    // Empty tensors sharing an offset, keys out of name order (the reader lists them by name,
    // so the fuzz target's write-back round trip keeps their order).
    save("valid_empty_tensors_key_order.safetensors",
         st_file(R"({"b":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                 R"("a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
                 Bytes{}));

    // ---- malformed files --------------------------------------------------------------------
    Bytes good;
    {
        SafetensorsWriter w;
        w.add("a", ramp(2, 2, 1.0f));
        w.add("b", ramp(3, 1, 2.0f).cast<double>().eval());
        good = w.bytes();
    }
    save("bad_truncated_data.safetensors", Bytes(good.begin(), good.end() - 5));
    save("bad_truncated_header.safetensors", Bytes(good.begin(), good.begin() + 20));
    save("bad_short.safetensors", Bytes(good.begin(), good.begin() + 5));
    save("bad_offsets_gap.safetensors",
         st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                 Bytes(12, std::byte{0})));
    save("bad_offsets_overlap.safetensors",
         st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 Bytes(12, std::byte{0})));
    save("bad_offsets_reversed.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", Bytes(8, std::byte{0})));
    save("bad_offsets_past_end.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[100,104]}})", Bytes(4, std::byte{0})));
    save("bad_duplicate_tensor.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                 R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                 Bytes(8, std::byte{0})));
    save("bad_duplicate_key.safetensors",
         st_file(R"({"w":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})",
                 Bytes(4, std::byte{0})));
    save("bad_dtype.safetensors",
         st_file(R"({"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", Bytes(4, std::byte{0})));
    save("bad_shape_overflow.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"));
    save("bad_bytes_overflow.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})"));
    save("bad_trailing_bytes.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", Bytes(6, std::byte{0})));
    save("bad_not_json.safetensors", st_file("{\"w\": [1, 2,"));
    save("bad_too_deep.safetensors",
         st_file(R"({"w":{"dtype":"F32","shape":[[[[[1]]]]],"data_offsets":[0,4]}})", Bytes(4, std::byte{0})));
    save("bad_metadata_value.safetensors", st_file(R"({"__metadata__":{"k":1}})"));
    // nlohmann::json stops at a NUL as if the input ended: bytes hidden after it.
    save("bad_nul_in_header.safetensors", st_file(std::string("{}\0hidden", 9)));

    std::printf("make_corpus: wrote %d files to %s\n", written, out_dir.string().c_str());
    return 0;
}
