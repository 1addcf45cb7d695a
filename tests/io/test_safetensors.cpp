// tests/io/test_safetensors.cpp: titans::io::SafetensorsFile / SafetensorsWriter.
//
//   * round trips (float, double, row vectors, empty tensors, integers, metadata, F32 <-> F64
//     conversion) on random shapes and values, bit-exact where nothing is converted;
//   * F16 over all 65536 bit patterns against independent references, BF16 hand values;
//   * one test case per malformed file: each builds the bytes by hand and checks that the
//     exception type AND the message (tensor name, specific problem) are right;
//   * the writer's layout (header padded to 8 bytes, offsets covering the data section), parsed
//     independently of the reader with nlohmann::json.

#include "catch.hpp"
#include "test_common.hpp"

#include <titans/io/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace {
/// "t<k>" (built by append: GCC 12 warns falsely, -Wrestrict, on "t" + std::to_string(k)).
std::string tensor_name(int k) {
    std::string s = "t";
    s += std::to_string(k);
    return s;
}
}  // namespace

namespace {

using titans::FileError;
using titans::FormatError;
using titans::NonFiniteError;
using titans::ShapeError;
using titans::io::DType;
using titans::io::ReadLimits;
using titans::io::SafetensorsFile;
using titans::io::SafetensorsWriter;
using Bytes = std::vector<std::byte>;

/// A file: the 8-byte little-endian header length, the header text, the data bytes.
Bytes st_file(const std::string& header, const Bytes& data = {}) {
    Bytes out(8);
    std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = std::byte((n >> (8 * i)) & 0xFF);
    for (char c : header) out.push_back(static_cast<std::byte>(c));
    out.insert(out.end(), data.begin(), data.end());
    return out;
}

/// A file whose length field says `n`, followed by `rest`.
Bytes with_length(std::uint64_t n, const std::string& rest) {
    Bytes out(8);
    std::memcpy(out.data(), &n, 8);
    for (char c : rest) out.push_back(static_cast<std::byte>(c));
    return out;
}

/// The little-endian bytes of some values.
template <class T>
Bytes raw(std::initializer_list<T> values) {
    Bytes out(values.size() * sizeof(T));
    if (values.size() != 0) std::memcpy(out.data(), values.begin(), out.size());
    return out;
}

Bytes zeros(std::size_t n) { return Bytes(n, std::byte{0}); }

SafetensorsFile parse(const Bytes& b, ReadLimits lim = {}) {
    return SafetensorsFile(b, "test.safetensors", lim);
}

/// `f()` throws exactly E (not just any titans::Error) whose message contains every part.
template <class E, class F>
void require_throws(F&& f, std::initializer_list<std::string_view> parts) {
    bool thrown = false;
    std::string msg;
    try {
        f();
    } catch (const E& e) {
        thrown = true;
        msg = e.what();
    }
    INFO("message: " << msg);
    REQUIRE(thrown);
    for (std::string_view p : parts) {
        CHECK_THAT(msg, TITANS_CONTAINS(std::string(p)));
    }
}

/// Parsing `b` throws FormatError naming the source and every part.
void require_format_error(const Bytes& b, std::initializer_list<std::string_view> parts,
                          ReadLimits lim = {}) {
    require_throws<FormatError>([&] { (void)parse(b, lim); }, parts);
    require_throws<FormatError>([&] { (void)parse(b, lim); }, {"test.safetensors"});
}

/// A one-tensor header {"w": {<entry>}}.
std::string one_tensor(const std::string& entry) { return R"({"w":{)" + entry + "}}"; }

template <class T>
bool bit_identical(const titans::Matrix<T>& a, const titans::Matrix<T>& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() &&
           (a.size() == 0 ||
            std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)) == 0);
}

template <class T>
titans::Matrix<T> random_values(Eigen::Index r, Eigen::Index c, titans_test::Rng& rng) {
    // Values across many binades (incl. tiny and huge), signs, and exact zeros.
    titans::Matrix<T> m(r, c);
    std::uniform_int_distribution<int> e(-30, 30), z(0, 9);
    for (Eigen::Index i = 0; i < m.size(); ++i) {
        m.data()[i] = z(rng) == 0 ? T(0)
                                  : static_cast<T>(std::ldexp(titans_test::uniform(rng), e(rng)));
    }
    return m;
}

}  // namespace

// =============================================================================================
// Round trips
// =============================================================================================

// safetensors: random matrices round-trip bit-exactly
TEMPLATE_TEST_CASE("safetensors: matrices exact", "[io]", float, double) {
    using T = TestType;
    for (int trial = 0; trial < 25; ++trial) {
        const auto seed = titans_test::seed_for("safetensors round trip", trial) ^ sizeof(T);
        INFO("seed " << seed);
        titans_test::Rng rng(seed);
        const int na = titans_test::uniform_int(rng, 1, 4);
        SafetensorsWriter w;
        std::vector<titans::Matrix<T>> ms;
        for (int k = 0; k < na; ++k) {
            ms.push_back(random_values<T>(titans_test::uniform_int(rng, 1, 9),
                                          titans_test::uniform_int(rng, 1, 9), rng));
            w.add(tensor_name(k), ms.back());
        }
        const SafetensorsFile f = parse(w.bytes());
        REQUIRE(f.tensors().size() == ms.size());
        for (int k = 0; k < na; ++k) {
            const std::string name = tensor_name(k);
            const auto& info = f.at(name);
            CHECK(info.dtype == titans::io::dtype_of<T>());
            CHECK(info.shape == std::vector<std::uint64_t>{static_cast<std::uint64_t>(ms[k].rows()),
                                                           static_cast<std::uint64_t>(ms[k].cols())});
            CHECK(bit_identical(f.matrix<T>(name), ms[static_cast<std::size_t>(k)]));
        }
    }
}

// safetensors: a row vector is written rank 1 and read as 1 x n
TEST_CASE("safetensors: row vector is rank 1", "[io]") {
    titans_test::Rng rng(titans_test::seed_for("safetensors row vector"));
    const int n = titans_test::uniform_int(rng, 1, 40);
    titans::RowVectorf v = random_values<float>(1, n, rng);
    titans::RowVectord vd = random_values<double>(1, n, rng);
    SafetensorsWriter w;
    w.add("v", v);
    w.add("vd", vd);
    const SafetensorsFile f = parse(w.bytes());
    CHECK(f.at("v").shape == std::vector<std::uint64_t>{static_cast<std::uint64_t>(n)});
    CHECK(f.at("vd").shape == std::vector<std::uint64_t>{static_cast<std::uint64_t>(n)});
    CHECK(bit_identical<float>(f.matrix<float>("v"), v));
    CHECK(bit_identical<double>(f.matrix<double>("vd"), vd));
}

// safetensors: empty tensors (0 rows, 0 cols, 0 x 0, rank 1 [0]) round-trip
TEST_CASE("safetensors: empty tensor round-trip", "[io]") {
    SafetensorsWriter w;
    w.add("r0", titans::Matrixf(0, 5));
    w.add("c0", titans::Matrixd(3, 0));
    w.add("e", titans::Matrixf(0, 0));
    w.add("v0", titans::RowVectorf(0));
    w.add("x", titans::Matrixf::Constant(1, 2, 1.5f));
    w.add_integers("i0", std::vector<std::int64_t>{});
    const SafetensorsFile f = parse(w.bytes());
    CHECK(f.at("r0").shape == std::vector<std::uint64_t>{0, 5});
    CHECK(f.at("c0").shape == std::vector<std::uint64_t>{3, 0});
    CHECK(f.at("v0").shape == std::vector<std::uint64_t>{0});
    const auto r0 = f.matrix<float>("r0");
    CHECK((r0.rows() == 0 && r0.cols() == 5));
    const auto c0 = f.matrix<double>("c0");
    CHECK((c0.rows() == 3 && c0.cols() == 0));
    const auto e = f.matrix<float>("e");
    CHECK((e.rows() == 0 && e.cols() == 0));
    const auto v0 = f.matrix<double>("v0");
    CHECK((v0.rows() == 1 && v0.cols() == 0));
    CHECK(f.integers("i0").empty());
    CHECK(f.matrix<float>("x") == titans::Matrixf::Constant(1, 2, 1.5f));
}

// safetensors: integers (I64 and I32) round-trip
TEST_CASE("safetensors: integer round-trip", "[io]") {
    titans_test::Rng rng(titans_test::seed_for("safetensors integers"));
    std::vector<std::int64_t> v(static_cast<std::size_t>(titans_test::uniform_int(rng, 1, 50)));
    for (auto& x : v) x = static_cast<std::int64_t>(rng());
    v.push_back(std::numeric_limits<std::int64_t>::min());
    v.push_back(std::numeric_limits<std::int64_t>::max());
    v.push_back(0);
    v.push_back(-1);
    SafetensorsWriter w;
    w.add_integers("i64", v);
    const std::vector<std::int32_t> v32{std::numeric_limits<std::int32_t>::min(), -7, 0, 42,
                                        std::numeric_limits<std::int32_t>::max(), 3};
    w.add_raw("i32", DType::I32, {2, 3}, std::as_bytes(std::span<const std::int32_t>(v32)));
    const SafetensorsFile f = parse(w.bytes());
    CHECK(f.at("i64").dtype == DType::I64);
    CHECK(f.integers("i64") == v);
    CHECK(f.integers("i32") == std::vector<std::int64_t>(v32.begin(), v32.end()));
    require_throws<FormatError>([&] { (void)f.matrix<double>("i32"); }, {"'i32'", "I32"});
}

// safetensors: metadata, rank 0, file round trip through write() and read()
TEST_CASE("safetensors: file write and read", "[io]") {
    titans_test::Rng rng(titans_test::seed_for("safetensors file round trip"));
    const titans::Matrixd m = random_values<double>(3, 4, rng);
    SafetensorsWriter w;
    w.metadata("format", "titans.params");
    w.metadata("note", "unicode \xc3\xa9 and \"quotes\"");
    w.metadata("empty", "");
    w.add("m", m);
    const float scalar = 2.75f;
    w.add_raw("s", DType::F32, {}, std::as_bytes(std::span<const float>(&scalar, 1)));
    const auto dir = std::filesystem::temp_directory_path() /
                     ("titans_st_" + std::to_string(titans_test::seed_for("st dir", rng())));
    std::filesystem::create_directories(dir);
    const auto path = dir / "x.safetensors";
    w.write(path);
    // Only the file itself is left: the temporary was renamed.
    CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator{}) == 1);
    const SafetensorsFile f = SafetensorsFile::read(path);
    CHECK(f.source() == path.string());
    CHECK(f.metadata().size() == 3);
    CHECK(f.metadata_or("format", "") == "titans.params");
    CHECK(f.metadata_or("note", "") == "unicode \xc3\xa9 and \"quotes\"");
    CHECK(f.metadata_or("empty", "x").empty());
    CHECK(f.metadata_or("absent", "fallback") == "fallback");
    CHECK(bit_identical<double>(f.matrix<double>("m"), m));
    CHECK(f.at("s").shape.empty());
    CHECK(f.at("s").numel() == 1);
    const auto s = f.matrix<float>("s");
    CHECK((s.rows() == 1 && s.cols() == 1 && s(0, 0) == 2.75f));
    CHECK(f.find("nope") == nullptr);
    std::filesystem::remove_all(dir);
}

// safetensors: F32 read as double and F64 read as float convert like static_cast
TEST_CASE("safetensors: F32 and F64 convert", "[io]") {
    titans_test::Rng rng(titans_test::seed_for("safetensors conversions"));
    const titans::Matrixf mf = random_values<float>(5, 7, rng);
    const titans::Matrixd md = random_values<double>(6, 3, rng);
    SafetensorsWriter w;
    w.add("f", mf);
    w.add("d", md);
    const SafetensorsFile f = parse(w.bytes());
    const titans::Matrixd fd = mf.cast<double>();
    const titans::Matrixf df = md.cast<float>();
    CHECK(bit_identical<double>(f.matrix<double>("f"), fd));  // exact widening
    CHECK(bit_identical<float>(f.matrix<float>("d"), df));    // rounded to nearest
}

// safetensors: a valid file without tensors, in any key order, with padding
TEST_CASE("safetensors: file without tensors", "[io]") {
    // Header only (padding spaces and newlines are JSON whitespace).
    CHECK(parse(st_file("{}")).tensors().empty());
    CHECK(parse(st_file("{}      \n")).tensors().empty());
    CHECK(parse(st_file(R"({"__metadata__":{"a":"b"}})")).metadata_or("a", "") == "b");
    // Tensors listed out of offset order; two empty tensors at the same offset.
    const auto f = parse(st_file(
        R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
        R"("a":{"data_offsets":[0,4],"shape":[],"dtype":"F32"},)"
        R"("z1":{"dtype":"F64","shape":[0,3],"data_offsets":[8,8]},)"
        R"("z2":{"dtype":"F16","shape":[2,0],"data_offsets":[8,8]}})",
        raw<float>({1.0f, 2.0f})));
    REQUIRE(f.tensors().size() == 4);
    CHECK(f.tensors()[0].name == "a");  // data-offset order
    CHECK(f.matrix<float>("a")(0, 0) == 1.0f);
    CHECK(f.matrix<double>("b")(0, 0) == 2.0);
    CHECK(f.matrix<float>("z1").rows() == 0);
    CHECK(f.matrix<float>("z2").cols() == 0);
}

// safetensors: empty tensors at one offset are listed by name, whatever the key order
TEST_CASE("safetensors: empty tensor key order", "[io]") {
    // The order must depend on the content only: a file read, written back and read again lists
    // its tensors identically (the writer's key order is its own).
    const auto f = parse(st_file(
        R"({"zb":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
        R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
        R"("za":{"dtype":"F64","shape":[0,2],"data_offsets":[4,4]},)"
        R"("y":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}})",
        raw<float>({3.0f})));
    std::vector<std::string> names;
    for (const auto& t : f.tensors()) names.push_back(t.name);
    CHECK(names == std::vector<std::string>{"y", "zb", "x", "za"});
    SafetensorsWriter w;
    w.add_raw("zb", f.at("zb").dtype, f.at("zb").shape, f.data(f.at("zb")));
    w.add_raw("y", f.at("y").dtype, f.at("y").shape, f.data(f.at("y")));
    const auto g = parse(w.bytes());
    REQUIRE(g.tensors().size() == 2);
    CHECK(g.tensors()[0].name == "y");
    CHECK(g.tensors()[1].name == "zb");
}

// =============================================================================================
// F16 / BF16
// =============================================================================================

namespace {
/// IEEE binary16 decoded with ldexp from its definition (independent of the library's bit
/// manipulation).
double half_reference(std::uint16_t h) {
    const int sign = (h >> 15) & 1;
    const int exp = (h >> 10) & 0x1F;
    const int mant = h & 0x3FF;
    double v;
    if (exp == 0x1F) {
        v = mant == 0 ? std::numeric_limits<double>::infinity()
                      : std::numeric_limits<double>::quiet_NaN();
    } else if (exp == 0) {
        v = std::ldexp(static_cast<double>(mant), -24);
    } else {
        v = std::ldexp(static_cast<double>(1024 + mant), exp - 25);
    }
    return sign ? -v : v;
}
}  // namespace

// safetensors: half_to_float is exact over all 65536 bit patterns
TEST_CASE("safetensors: half_to_float exact", "[io]") {
    long mismatches = 0, nans = 0;
    for (std::uint32_t u = 0; u < 65536; ++u) {
        const auto h = static_cast<std::uint16_t>(u);
        const float got = titans::io::half_to_float(h);
        const double want = half_reference(h);
        bool ok;
        if (std::isnan(want)) {
            ok = std::isnan(got);
            // The NaN keeps its sign and its payload (shifted into the top of the float's).
            ok = ok && (std::bit_cast<std::uint32_t>(got) >> 31) == (u >> 15) &&
                 ((std::bit_cast<std::uint32_t>(got) >> 13) & 0x3FFu) == (u & 0x3FFu);
            ++nans;
        } else {
            // Bit patterns, so -0 vs +0 counts.
            ok = std::bit_cast<std::uint32_t>(got) ==
                 std::bit_cast<std::uint32_t>(static_cast<float>(want));
        }
#ifdef __FLT16_MAX__
        // GCC's own conversion as a second, independent reference.
        const float gcc = static_cast<float>(std::bit_cast<_Float16>(h));
        if (std::isnan(gcc)) {
            ok = ok && std::isnan(got);
        } else {
            ok = ok && std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(gcc);
        }
#endif
        if (!ok) {
            if (++mismatches <= 10) {
                UNSCOPED_INFO("half 0x" << std::hex << u << std::dec << ": got " << got
                                        << ", want " << want);
            }
        }
    }
    CHECK(nans == 2 * 1023);
    CHECK(mismatches == 0);
}

// safetensors: bfloat16_to_float on hand values
TEST_CASE("safetensors: bfloat16_to_float", "[io]") {
    auto top = [](float f) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16); };
    auto truncated = [](float f) {
        return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) & 0xFFFF0000u);
    };
    CHECK(top(1.0f) == 0x3F80);
    CHECK(top(-2.5f) == 0xC020);
    CHECK(titans::io::bfloat16_to_float(top(1.0f)) == 1.0f);
    CHECK(titans::io::bfloat16_to_float(top(-2.5f)) == -2.5f);
    CHECK(titans::io::bfloat16_to_float(top(3.0e38f)) == truncated(3.0e38f));
    CHECK(titans::io::bfloat16_to_float(top(3.0e38f)) != 3.0e38f);  // really truncated
    CHECK(titans::io::bfloat16_to_float(top(1.0e-40f)) == truncated(1.0e-40f));  // subnormal
    CHECK(std::bit_cast<std::uint32_t>(titans::io::bfloat16_to_float(0x8000)) == 0x80000000u);
    CHECK(std::isinf(titans::io::bfloat16_to_float(0x7F80)));
    CHECK(std::isnan(titans::io::bfloat16_to_float(0x7FC0)));
}

// safetensors: F16 and BF16 tensors read as float and double
TEST_CASE("safetensors: F16 and BF16 tensors", "[io]") {
    // F16: 1, -2, 0.5, 65504 (max), 2^-24 (smallest subnormal), -0.
    const std::vector<std::uint16_t> h{0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x8000};
    const std::vector<double> hv{1.0, -2.0, 0.5, 65504.0, std::ldexp(1.0, -24), -0.0};
    // BF16: 1, -2.5, 3e38 truncated.
    auto top = [](float f) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16); };
    const std::vector<std::uint16_t> b{top(1.0f), top(-2.5f), top(3.0e38f)};
    const float big = std::bit_cast<float>(std::bit_cast<std::uint32_t>(3.0e38f) & 0xFFFF0000u);
    SafetensorsWriter w;
    w.add_raw("h", DType::F16, {2, 3}, std::as_bytes(std::span<const std::uint16_t>(h)));
    w.add_raw("b", DType::BF16, {3}, std::as_bytes(std::span<const std::uint16_t>(b)));
    const std::uint16_t inf = 0x7C00;
    w.add_raw("hinf", DType::F16, {1}, std::as_bytes(std::span<const std::uint16_t>(&inf, 1)));
    const SafetensorsFile f = parse(w.bytes());
    const auto hf = f.matrix<float>("h");
    const auto hd = f.matrix<double>("h");
    REQUIRE((hf.rows() == 2 && hf.cols() == 3 && hd.rows() == 2 && hd.cols() == 3));
    for (int i = 0; i < 6; ++i) {
        CHECK(hd.data()[i] == hv[static_cast<std::size_t>(i)]);
        CHECK(hf.data()[i] == static_cast<float>(hv[static_cast<std::size_t>(i)]));
    }
    CHECK(std::signbit(hf(1, 2)));
    const auto bf = f.matrix<float>("b");
    const auto bd = f.matrix<double>("b");
    REQUIRE((bf.rows() == 1 && bf.cols() == 3));
    CHECK(bf(0, 0) == 1.0f);
    CHECK(bf(0, 1) == -2.5f);
    CHECK(bf(0, 2) == big);
    CHECK(bd(0, 2) == static_cast<double>(big));
    require_throws<NonFiniteError>([&] { (void)f.matrix<float>("hinf"); }, {"'hinf'"});
}

// =============================================================================================
// Malformed files: each must throw FormatError naming the problem (and the tensor).
// =============================================================================================

// safetensors malformed: file shorter than 8 bytes
TEST_CASE("safetensors bad: file < 8 bytes", "[io]") {
    require_format_error(Bytes{}, {"0 bytes", "at least 8"});
    require_format_error(Bytes(5, std::byte{1}), {"5 bytes", "at least 8"});
    require_format_error(Bytes(7, std::byte{0}), {"7 bytes"});
}

// safetensors malformed: header length larger than the file
TEST_CASE("safetensors bad: header len > file", "[io]") {
    require_format_error(with_length(100, "{}"), {"header length 100", "truncated"});
    require_format_error(with_length(3, "{}"), {"header length 3"});
    require_format_error(with_length(1, "{"), {"header length 1", "at least 2"});
    require_format_error(with_length(0, ""), {"header length 0"});
    require_format_error(with_length(~std::uint64_t{0}, "{}"), {"exceeds"});
}

// safetensors malformed: header length above ReadLimits max_header_bytes
TEST_CASE("safetensors bad: header len > limit", "[io]") {
    require_format_error(with_length(100'000'001, "{}"),
                         {"header length 100000001", "limit of 100000000"});
    // A small custom limit rejects an otherwise valid file.
    SafetensorsWriter w;
    w.add("a_long_tensor_name", titans::Matrixf::Zero(2, 2));
    const Bytes b = w.bytes();
    REQUIRE_NOTHROW(parse(b));
    ReadLimits lim;
    lim.max_header_bytes = 16;
    require_format_error(b, {"limit of 16 bytes"}, lim);
}

// safetensors malformed: header not starting with an opening brace
TEST_CASE("safetensors bad: no leading brace", "[io]") {
    require_format_error(st_file(" {}"), {"does not start with '{'"});
    require_format_error(st_file("\n{}"), {"does not start with '{'"});
    require_format_error(st_file(std::string("\0{}", 3)), {"does not start with '{'"});
}

TEST_CASE("safetensors malformed: invalid JSON", "[io]") {
    require_format_error(st_file(R"({"w":)"), {"not valid JSON"});
    require_format_error(st_file(R"({"w":{"dtype":"F32",}})"), {"not valid JSON"});
    require_format_error(st_file("{'a':1}"), {"not valid JSON"});
    require_format_error(st_file("{/* c */}"), {"not valid JSON"});  // no comments
    require_format_error(st_file("{\"\xff\":{}}"), {"not valid JSON"});  // invalid UTF-8
}

// safetensors malformed: header not a JSON object
TEST_CASE("safetensors bad: header not object", "[io]") {
    require_format_error(st_file("[{}]"), {"JSON object"});
    require_format_error(st_file("\"{}\""), {"JSON object"});
    require_format_error(st_file("12"), {"JSON object"});
    require_format_error(st_file("null"), {"JSON object"});
}

// safetensors malformed: trailing garbage after the JSON inside the header
TEST_CASE("safetensors bad: junk after JSON", "[io]") {
    require_format_error(st_file("{} x"), {"not valid JSON"});
    require_format_error(st_file("{}{}"), {"not valid JSON"});
    // nlohmann::json alone would stop at a NUL and accept these.
    require_format_error(st_file(std::string("{}\0\0", 4)), {"not valid JSON", "NUL byte at header offset 2"});
    require_format_error(st_file(std::string("{}\0hidden", 9)), {"not valid JSON", "NUL"});
    require_format_error(
        st_file(std::string(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})") + '\0' + "  ",
                zeros(4)),
        {"NUL"});
}

// safetensors malformed: duplicate tensor names
TEST_CASE("safetensors bad: duplicate names", "[io]") {
    require_format_error(
        st_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                zeros(8)),
        {"'w'", "twice"});
    require_format_error(st_file(R"({"__metadata__":{},"__metadata__":{}})"),
                         {"'__metadata__'", "twice"});
}

// safetensors malformed: duplicate keys inside a tensor entry
TEST_CASE("safetensors bad: duplicate keys", "[io]") {
    require_format_error(
        st_file(R"({"w":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})",
                zeros(4)),
        {"'dtype'", "twice", "'w'"});
    require_format_error(
        st_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"shape":[1]}})", zeros(4)),
        {"'shape'", "twice", "'w'"});
    require_format_error(st_file(R"({"__metadata__":{"k":"a","k":"b"}})"),
                         {"'k'", "twice", "'__metadata__'"});
}

// safetensors malformed: nesting deeper than allowed
TEST_CASE("safetensors bad: nesting too deep", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[[[[1]]]],"data_offsets":[0,4])"), zeros(4)),
        {"nests deeper than 4"});
    require_format_error(st_file(R"({"__metadata__":{"a":{"b":{"c":{}}}}})"),
                         {"nests deeper than 4"});
    // Deep enough to overflow a recursive parser's stack if the limit were not enforced early.
    require_format_error(st_file("{\"w\":" + std::string(100000, '[') + std::string(100000, ']') + "}"),
                         {"nests deeper"});
    // A custom limit of 1 rejects a tensor entry (depth 1).
    ReadLimits lim;
    lim.max_json_depth = 1;
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1],"data_offsets":[0,4])"), zeros(4)),
        {"nests deeper than 1"}, lim);
}

TEST_CASE("safetensors malformed: unknown dtype", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"F33","shape":[1],"data_offsets":[0,4])"), zeros(4)),
        {"'w'", "unknown dtype 'F33'"});
    require_format_error(
        st_file(one_tensor(R"("dtype":"f32","shape":[1],"data_offsets":[0,4])"), zeros(4)),
        {"'w'", "unknown dtype 'f32'"});
    require_format_error(
        st_file(one_tensor(R"("dtype":32,"shape":[1],"data_offsets":[0,4])"), zeros(4)),
        {"'w'", "no dtype string"});
}

// safetensors malformed: missing dtype, shape or data_offsets
TEST_CASE("safetensors bad: missing fields", "[io]") {
    require_format_error(st_file(one_tensor(R"("shape":[1],"data_offsets":[0,4])"), zeros(4)),
                         {"'w'", "no dtype"});
    require_format_error(st_file(one_tensor(R"("dtype":"F32","data_offsets":[0,4])"), zeros(4)),
                         {"'w'", "no shape"});
    require_format_error(st_file(one_tensor(R"("dtype":"F32","shape":[1])"), zeros(4)),
                         {"'w'", "data_offsets"});
    require_format_error(st_file(one_tensor(R"("dtype":"F32","shape":1,"data_offsets":[0,4])"), zeros(4)),
                         {"'w'", "no shape array"});
    require_format_error(st_file(R"({"w":[1,2]})"), {"'w'", "not a JSON object"});
    require_format_error(st_file(R"({"w":"F32"})"), {"'w'", "not a JSON object"});
}

// safetensors malformed: negative, float or string shape entries
TEST_CASE("safetensors bad: shape entries", "[io]") {
    for (const char* s : {"[-1]", "[2.0]", "[1e1]", "[\"2\"]", "[null]", "[true]", "[-0]",
                          "[18446744073709551616]"}) {
        INFO(s);
        require_format_error(
            st_file(one_tensor(std::string(R"("dtype":"F32","data_offsets":[0,4],"shape":)") + s),
                    zeros(4)),
            {"'w'", "shape entry", "non-negative integer"});
    }
}

// safetensors malformed: shape product overflowing 64 bits
TEST_CASE("safetensors bad: shape overflow", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0])")),
        {"'w'", "shape product overflows"});
    require_format_error(
        st_file(one_tensor(
            R"("dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,0])")),
        {"'w'", "shape product overflows"});
    // A zero anywhere makes the product 0 even with huge other entries: valid (empty).
    const auto f = parse(st_file(
        one_tensor(R"("dtype":"F32","shape":[18446744073709551615,0],"data_offsets":[0,0])")));
    CHECK(f.at("w").numel() == 0);
    // ... but such a shape does not fit a matrix.
    require_throws<FormatError>([&] { (void)f.matrix<float>("w"); }, {"'w'", "too large"});
}

// safetensors malformed: byte size overflowing 64 bits
TEST_CASE("safetensors bad: byte size overflow", "[io]") {
    // 2^62 elements fit in 64 bits; x 4 bytes does not.
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0])")),
        {"'w'", "byte size", "overflows"});
    require_format_error(
        st_file(one_tensor(
            R"("dtype":"F64","shape":[2305843009213693952,1],"data_offsets":[0,0])")),
        {"'w'", "byte size", "overflows"});
}

// safetensors malformed: data_offsets not a pair, or end before begin
TEST_CASE("safetensors bad: data_offsets", "[io]") {
    for (const char* o : {"[0]", "[0,4,8]", "[]", "\"0,4\"", "[0,-4]", "[-1,3]", "[0,4.0]",
                          "[0,\"4\"]", "{\"begin\":0}"}) {
        INFO(o);
        require_format_error(
            st_file(one_tensor(std::string(R"("dtype":"F32","shape":[1],"data_offsets":)") + o),
                    zeros(4)),
            {"'w'", "data_offsets is not a pair"});
    }
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1],"data_offsets":[8,4])"), zeros(8)),
        {"'w'", "[8, 4]", "end before"});
}

// safetensors malformed: offsets beyond the data section (truncated file)
TEST_CASE("safetensors bad: offsets past end", "[io]") {
    SafetensorsWriter w;
    w.add("a", titans::Matrixf::Constant(2, 2, 1.0f));
    w.add("b", titans::Matrixd::Constant(3, 1, 2.0));
    const Bytes good = w.bytes();
    REQUIRE_NOTHROW(parse(good));
    for (std::size_t cut : {1, 7, 8, 24, 25}) {
        INFO("cut " << cut);
        Bytes b(good.begin(), good.end() - static_cast<std::ptrdiff_t>(cut));
        // b (after a) reaches past the end first; a too once its bytes are cut.
        require_format_error(b, {cut <= 24 ? "'b'" : "'a'", "past the data section", "truncated"});
    }
    // Offsets past the end of a file that is otherwise complete.
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1],"data_offsets":[100,104])"), zeros(4)),
        {"'w'", "[100, 104]", "past the data section of 4 bytes"});
    require_format_error(
        st_file(one_tensor(R"("dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615])")),
        {"'w'", "past the data section"});
}

// safetensors malformed: byte size disagreeing with dtype x shape
TEST_CASE("safetensors bad: wrong byte size", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[2],"data_offsets":[0,4])"), zeros(4)),
        {"'w'", "has 4 bytes, expected 8", "F32", "[2]"});
    require_format_error(
        st_file(one_tensor(R"("dtype":"BF16","shape":[2,2],"data_offsets":[0,16])"), zeros(16)),
        {"'w'", "has 16 bytes, expected 8", "BF16", "[2, 2]"});
}

// safetensors malformed: overlapping tensors
TEST_CASE("safetensors bad: overlapping tensors", "[io]") {
    require_format_error(
        st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                zeros(12)),
        {"'b'", "overlaps"});
    // Two tensors on the very same bytes.
    require_format_error(
        st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                zeros(4)),
        {"overlaps"});
}

// safetensors malformed: a gap between tensors
TEST_CASE("safetensors bad: gap between tensors", "[io]") {
    require_format_error(
        st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                zeros(12)),
        {"'b'", "starts at data offset 8, expected 4", "gap"});
    // A gap before the first tensor.
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1],"data_offsets":[4,8])"), zeros(8)),
        {"'w'", "gap"});
}

// safetensors malformed: trailing bytes after the last tensor
TEST_CASE("safetensors bad: trailing bytes", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1],"data_offsets":[0,4])"), zeros(5)),
        {"cover 4 bytes", "all 5", "trailing"});
    require_format_error(st_file("{}", zeros(1)), {"cover 0 bytes", "trailing"});
}

// safetensors malformed: unknown field in a tensor entry
TEST_CASE("safetensors bad: unknown field", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1],"data_offsets":[0,4],"stride":[1])"),
                zeros(4)),
        {"'w'", "unknown field 'stride'"});
}

// safetensors malformed: __metadata__ not an object or with a non-string value
TEST_CASE("safetensors bad: __metadata__", "[io]") {
    require_format_error(st_file(R"({"__metadata__":"x"})"), {"__metadata__ is not a JSON object"});
    require_format_error(st_file(R"({"__metadata__":["a","b"]})"), {"__metadata__ is not a JSON object"});
    require_format_error(st_file(R"({"__metadata__":null})"), {"__metadata__ is not a JSON object"});
    require_format_error(st_file(R"({"__metadata__":{"k":1}})"), {"__metadata__", "'k'", "not a string"});
    require_format_error(st_file(R"({"__metadata__":{"k":{}}})"), {"'k'", "not a string"});
    require_format_error(st_file(R"({"__metadata__":{"k":null}})"), {"'k'", "not a string"});
}

// safetensors malformed: empty tensor name
TEST_CASE("safetensors bad: empty tensor name", "[io]") {
    require_format_error(
        st_file(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", zeros(4)),
        {"empty name"});
}

// safetensors malformed: rank above max_rank
TEST_CASE("safetensors bad: rank > max_rank", "[io]") {
    require_format_error(
        st_file(one_tensor(R"("dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4])"),
                zeros(4)),
        {"'w'", "rank 9", "at most 8"});
    const Bytes rank3 =
        st_file(one_tensor(R"("dtype":"F32","shape":[1,1,1],"data_offsets":[0,4])"), zeros(4));
    REQUIRE_NOTHROW(parse(rank3));
    ReadLimits lim;
    lim.max_rank = 2;
    require_format_error(rank3, {"'w'", "rank 3", "at most 2"}, lim);
}

// safetensors: NaN and Inf values throw NonFiniteError naming the tensor
TEST_CASE("safetensors: NaN and Inf rejected", "[io]") {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    const auto f = parse(st_file(
        R"({"ok":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
        R"("has_nan":{"dtype":"F32","shape":[1,2],"data_offsets":[8,16]},)"
        R"("has_inf":{"dtype":"F32","shape":[2,1],"data_offsets":[16,24]},)"
        R"("has_ninf":{"dtype":"F64","shape":[],"data_offsets":[24,32]},)"
        R"("big":{"dtype":"F64","shape":[1],"data_offsets":[32,40]}})",
        [&] {
            Bytes d = raw<float>({1.0f, 2.0f, 1.0f, nan, inf, 0.0f});
            const Bytes e = raw<double>({-std::numeric_limits<double>::infinity(), 1e300});
            d.insert(d.end(), e.begin(), e.end());
            return d;
        }()));
    CHECK_NOTHROW(f.matrix<float>("ok"));
    for (const char* name : {"has_nan", "has_inf", "has_ninf"}) {
        INFO(name);
        require_throws<NonFiniteError>([&] { (void)f.matrix<float>(name); }, {name, "NaN or infinite"});
        require_throws<NonFiniteError>([&] { (void)f.matrix<double>(name); }, {name});
    }
    // 1e300 is finite as a double but overflows float.
    CHECK(f.matrix<double>("big")(0, 0) == 1e300);
    require_throws<NonFiniteError>([&] { (void)f.matrix<float>("big"); }, {"'big'"});
}

// safetensors: reading a rank-3 tensor as a matrix is a FormatError
TEST_CASE("safetensors: rank 3 is not a matrix", "[io]") {
    const auto f = parse(st_file(
        one_tensor(R"("dtype":"F32","shape":[1,2,1],"data_offsets":[0,8])"), zeros(8)));
    require_throws<FormatError>([&] { (void)f.matrix<float>("w"); },
                                {"'w'", "rank 3", "[1, 2, 1]"});
    require_throws<FormatError>([&] { (void)f.matrix<double>("w"); }, {"'w'", "rank 3"});
}

// safetensors: reading an I64 tensor as a matrix is a FormatError
TEST_CASE("safetensors: I64 is not a matrix", "[io]") {
    SafetensorsWriter w;
    w.add_integers("steps", std::vector<std::int64_t>{1, 2, 3});
    w.add("x", titans::Matrixf::Zero(1, 1));
    const auto f = parse(w.bytes());
    require_throws<FormatError>([&] { (void)f.matrix<float>("steps"); }, {"'steps'", "I64"});
    require_throws<FormatError>([&] { (void)f.matrix<double>("steps"); }, {"'steps'", "I64"});
    require_throws<FormatError>([&] { (void)f.integers("x"); }, {"'x'", "F32", "I64 or I32"});
    // Recognised but unconvertible dtypes.
    const auto g = parse(st_file(one_tensor(R"("dtype":"U8","shape":[2],"data_offsets":[0,2])"), zeros(2)));
    require_throws<FormatError>([&] { (void)g.matrix<float>("w"); }, {"'w'", "U8"});
}

// safetensors: a missing tensor name is a FormatError naming it
TEST_CASE("safetensors: missing tensor named", "[io]") {
    SafetensorsWriter w;
    w.add("present", titans::Matrixf::Zero(1, 1));
    const auto f = parse(w.bytes());
    require_throws<FormatError>([&] { (void)f.matrix<float>("absent.w_q"); },
                                {"'absent.w_q'", "missing", "test.safetensors"});
    require_throws<FormatError>([&] { (void)f.integers("absent"); }, {"'absent'", "missing"});
    require_throws<FormatError>([&] { (void)f.at("absent"); }, {"'absent'", "missing"});
}

// safetensors: read() of a nonexistent path or a directory is a FileError
TEST_CASE("safetensors: unreadable path", "[io]") {
    const auto missing = std::filesystem::temp_directory_path() / "titans_no_such_dir" / "x.safetensors";
    require_throws<FileError>([&] { (void)SafetensorsFile::read(missing); },
                              {missing.string(), "cannot open"});
    const auto dir = std::filesystem::temp_directory_path();
    require_throws<FileError>([&] { (void)SafetensorsFile::read(dir); }, {dir.string()});
    // A file that exists but is malformed: FormatError naming the path.
    const auto path = std::filesystem::temp_directory_path() /
                      ("titans_bad_" + std::to_string(titans_test::seed_for("bad file")) + ".safetensors");
    {
        std::ofstream out(path, std::ios::binary);
        out << "abc";
    }
    require_throws<FormatError>([&] { (void)SafetensorsFile::read(path); }, {path.string(), "3 bytes"});
    std::filesystem::remove(path);
}

// safetensors writer: duplicate, reserved and empty names are FormatErrors
TEST_CASE("safetensors writer: bad names", "[io]") {
    SafetensorsWriter w;
    w.add("w", titans::Matrixf::Zero(1, 1));
    require_throws<FormatError>([&] { w.add("w", titans::Matrixd::Zero(2, 2)); }, {"'w'", "twice"});
    require_throws<FormatError>([&] { w.add("__metadata__", titans::Matrixf::Zero(1, 1)); },
                                {"'__metadata__'", "reserved"});
    require_throws<FormatError>([&] { w.add("", titans::Matrixf::Zero(1, 1)); }, {"empty"});
    require_throws<FormatError>([&] { w.add_integers("w", std::vector<std::int64_t>{1}); },
                                {"'w'", "twice"});
    // The failed adds left the writer usable and unchanged.
    const auto f = parse(w.bytes());
    CHECK(f.tensors().size() == 1);
}

// safetensors writer: add_raw with a size disagreeing with dtype x shape is a ShapeError
TEST_CASE("safetensors writer: add_raw size", "[io]") {
    SafetensorsWriter w;
    const Bytes b = zeros(12);
    require_throws<ShapeError>([&] { w.add_raw("a", DType::F32, {2, 2}, b); },
                               {"'a'", "12 bytes", "expected 16"});
    require_throws<ShapeError>([&] { w.add_raw("b", DType::F64, {}, b); }, {"'b'", "expected 8"});
    // A shape whose byte size wraps around 2^64 to exactly the given size must not be accepted.
    require_throws<ShapeError>([&] { w.add_raw("c", DType::F32, {std::uint64_t{1} << 62}, {}); },
                               {"'c'"});
    require_throws<ShapeError>(
        [&] { w.add_raw("d", DType::U8, {std::uint64_t{1} << 32, std::uint64_t{1} << 32}, {}); },
        {"'d'"});
    // After the failures the names are still free.
    w.add_raw("a", DType::F32, {3}, b);
    CHECK(parse(w.bytes()).at("a").shape == std::vector<std::uint64_t>{3});
}

// safetensors writer: text that is not valid UTF-8 is a FormatError
TEST_CASE("safetensors writer: bad UTF-8", "[io]") {
    SafetensorsWriter w;
    w.metadata("k", "\xff\xfe");
    require_throws<FormatError>([&] { (void)w.bytes(); }, {"UTF-8"});
    SafetensorsWriter w2;
    w2.add("bad\xc3", titans::Matrixf::Zero(1, 1));
    require_throws<FormatError>([&] { (void)w2.bytes(); }, {"UTF-8"});
}

// safetensors writer: layout checked independently of the reader
TEST_CASE("safetensors writer: layout", "[io]") {
    titans_test::Rng rng(titans_test::seed_for("safetensors layout"));
    for (int trial = 0; trial < 10; ++trial) {
        SafetensorsWriter w;
        struct Added {
            std::string name, dtype;
            std::vector<std::uint64_t> shape;
            std::uint64_t size;
        };
        std::vector<Added> added;
        const int n = titans_test::uniform_int(rng, 0, 5);
        for (int k = 0; k < n; ++k) {
            const std::string name = std::string(static_cast<std::size_t>(titans_test::uniform_int(rng, 1, 9)), 'x') + std::to_string(k);
            const int r = titans_test::uniform_int(rng, 0, 4), c = titans_test::uniform_int(rng, 0, 5);
            if (k % 2 == 0) {
                w.add(name, random_values<float>(r, c, rng));
                added.push_back({name, "F32", {std::uint64_t(r), std::uint64_t(c)}, std::uint64_t(r * c * 4)});
            } else {
                w.add(name, random_values<double>(r, c, rng));
                added.push_back({name, "F64", {std::uint64_t(r), std::uint64_t(c)}, std::uint64_t(r * c * 8)});
            }
        }
        if (trial % 2 == 0) w.metadata("m" + std::to_string(trial), std::string(static_cast<std::size_t>(trial), 'v'));
        const Bytes b = w.bytes();
        REQUIRE(b.size() >= 8);
        std::uint64_t hlen = 0;
        for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | std::to_integer<std::uint64_t>(b[static_cast<std::size_t>(i)]);
        CHECK(hlen % 8 == 0);
        REQUIRE(8 + hlen <= b.size());
        const std::string text(reinterpret_cast<const char*>(b.data() + 8), hlen);
        CHECK(text.front() == '{');
        const auto h = nlohmann::json::parse(text);  // padding is trailing whitespace
        REQUIRE(h.is_object());
        const std::uint64_t data_size = b.size() - 8 - hlen;
        std::uint64_t expected = 0;
        for (const Added& a : added) {  // data in the order added
            INFO(a.name);
            REQUIRE(h.contains(a.name));
            const auto& e = h[a.name];
            CHECK(e.size() == 3);
            CHECK(e["dtype"] == a.dtype);
            CHECK(e["shape"].get<std::vector<std::uint64_t>>() == a.shape);
            const auto off = e["data_offsets"].get<std::vector<std::uint64_t>>();
            REQUIRE(off.size() == 2);
            CHECK(off[0] == expected);
            CHECK(off[1] - off[0] == a.size);
            expected = off[1];
        }
        CHECK(expected == data_size);  // the data section is exactly covered
        CHECK(h.size() == added.size() + (trial % 2 == 0 ? 1 : 0));
        if (trial % 2 == 0) {
            CHECK(h["__metadata__"]["m" + std::to_string(trial)] == std::string(static_cast<std::size_t>(trial), 'v'));
        }
    }
}
