// tools/golden_outputs.cpp: writes the outputs and states of every layer family for fixed
// seeds (the memory in four modes, attention with a prefix, each block kind over three pieces,
// a two-block model of each kind, each block kind's training pass over two chained pieces, a
// model's training pass of each kind; double, then float) to one binary file and, given a second
// file, prints every value that differs from it. It checks that a refactoring is
// bit-identical: build it against the commit before and the tree after, and compare.
//
//   git worktree add /tmp/before <commit>
//   g++ -std=c++20 -O2 -fopenmp -I/tmp/before/include -I/usr/include/eigen3 \
//       tools/golden_outputs.cpp -o /tmp/golden_before && /tmp/golden_before /tmp/before.bin
//   g++ -std=c++20 -O2 -fopenmp -Iinclude -I/usr/include/eigen3 \
//       tools/golden_outputs.cpp -o /tmp/golden_after && /tmp/golden_after /tmp/after.bin /tmp/before.bin
//
// Each difference prints "<section> record <n>: before <x> after <y> rel <r>"; no line means
// bit-identical. Not part of the build or the tests (it compares two builds).
#include <titans/titans.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using namespace titans;

namespace {

std::FILE* out = nullptr;
std::FILE* before = nullptr;
const char* section = "";
int record = 0;

template <class V>
void write_value(V v) {
    std::fwrite(&v, sizeof v, 1, out);
    if (before == nullptr) return;
    V old{};
    if (std::fread(&old, sizeof old, 1, before) != 1) {
        std::printf("the file to compare with is shorter\n");
        std::exit(1);
    }
    if (old != v) {
        const double d = std::abs(double(old) - double(v)), s = std::abs(double(old));
        std::printf("%s record %d: before %.17g after %.17g rel %.3g\n", section, record,
                    double(old), double(v), d / (s > 0 ? s : 1));
    }
}

template <class M>
void write_matrix(const M& m) {
    ++record;
    write_value(static_cast<long>(m.rows()));
    write_value(static_cast<long>(m.cols()));
    for (long i = 0; i < m.rows(); ++i)
        for (long j = 0; j < m.cols(); ++j) write_value(m(i, j));
}

struct WriteTensor {
    template <class X>
    void operator()(const std::string&, const X& x) const {
        if constexpr (std::is_integral_v<X>) {
            write_value(x);
        } else {
            write_matrix(x);
        }
    }
};

template <class T>
Matrix<T> gaussian(long rows, long cols, unsigned seed) {
    std::mt19937_64 g(seed);
    std::normal_distribution<double> n(0, 1);
    Matrix<T> m(rows, cols);
    for (long i = 0; i < rows; ++i)
        for (long j = 0; j < cols; ++j) m(i, j) = T(n(g));
    return m;
}

template <class T>
void memories(int B, int N) {
    section = "memory";
    for (int mode = 0; mode < 4; ++mode) {
        MemoryConfig c{.d_model = 32, .n_heads = 2, .depth = 2, .chunk = 8};
        if (mode == 1) c.retrieval = Retrieval::InChunk;
        if (mode == 2) {
            c.update = UpdateMode::PerToken;
            c.depth = 1;
        }
        if (mode == 3) {
            c.gates = GateMode::Constant;
            c.residual = true;
            c.activation = Activation::GELU;
        }
        NeuralMemory<T> m(c, MemoryParams<T>::random(c, 3 + mode));
        auto st = m.make_state(B);
        const Matrix<T> x = gaussian<T>(B * N, 32, 11 + mode);
        write_matrix(m.forward(st, x));
        write_matrix(m.read(st, x.topRows(B * 3)));
        MemoryState<T>::tensors(std::as_const(st), WriteTensor{});
    }
}

template <class T>
void attention(int B, int N) {
    section = "attention";
    AttentionConfig c{.d_model = 32, .n_heads = 4, .window = 9, .rope = true};
    Attention<T> a(c, AttentionParams<T>::random(c, 5));
    auto st = a.make_state(B);
    const Matrix<T> p = gaussian<T>(3, 32, 99);
    write_matrix(a.forward(st, gaussian<T>(B * N, 32, 12), &p));
    write_matrix(a.forward(st, gaussian<T>(B * 5, 32, 13), &p));
    AttentionState<T>::tensors(std::as_const(st), WriteTensor{});
}

template <class T>
void blocks_and_models(int B, int N) {
    for (BlockKind k : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL}) {
        section = to_string(k);
        const auto c = BlockConfig::make(k, 32, 2, 2, 8, 4);
        Block<T> b(c, BlockParams<T>::random(c, 7));
        auto st = b.make_state(B);
        write_matrix(b.forward(st, gaussian<T>(B * N, 32, 21)));
        write_matrix(b.forward(st, gaussian<T>(B * 1, 32, 22)));
        write_matrix(b.forward(st, gaussian<T>(B * 13, 32, 23)));
        BlockState<T>::tensors(std::as_const(st), WriteTensor{});
        const auto mc = ModelConfig::uniform(k, 2, 32, 2, 2, 8, 50, 4);
        Model<T> m(mc, ModelParams<T>::random(mc, 9));
        auto ms = m.make_state(1);
        std::vector<int> ids;
        for (int i = 0; i < 40; ++i) ids.push_back((i * 7) % 50);
        write_matrix(m.forward_tokens(ms, ids));
        ModelState<T>::tensors(std::as_const(ms), WriteTensor{});
    }
}

/// Each block kind's training pass over two chained pieces (the first from a fresh state, so
/// P goes through it; the second at a chunk boundary): outputs, dx of each piece and every
/// gradient.
template <class T>
void block_training(int B) {
    for (BlockKind k : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL,
                        BlockKind::SWA}) {
        section = "training";
        const auto c = BlockConfig::make(k, 32, 2, 2, 8, 4);
        Block<T> b(c, BlockParams<T>::random(c, 17));
        auto st = b.make_state(B);
        typename Block<T>::Trace t1, t2;
        Matrix<T> y;
        b.forward(st, gaussian<T>(B * 12, 32, 31), y, t1);  // ends on a chunk boundary
        write_matrix(y);
        b.forward(st, gaussian<T>(B * 8, 32, 32), y, t2);
        write_matrix(y);
        auto g = BlockParams<T>::zeros(c);
        BlockStateGradient<T> d;
        Matrix<T> dx;
        b.backward(t2, gaussian<T>(B * 8, 32, 33), dx, g, &d);
        write_matrix(dx);
        b.backward(t1, gaussian<T>(B * 12, 32, 34), dx, g, nullptr, &d);
        write_matrix(dx);
        BlockParams<T>::tensors(std::as_const(g), c, WriteTensor{});
    }
    for (BlockKind k : {BlockKind::LMM, BlockKind::MAC, BlockKind::MAG, BlockKind::MAL}) {
        section = "model training";
        const auto mc = ModelConfig::uniform(k, 2, 32, 2, 2, 8, 50, 4);
        Model<T> m(mc, ModelParams<T>::random(mc, 19));
        auto ms = m.make_state(B);
        std::vector<int> ids;
        for (int i = 0; i < B * 12; ++i) ids.push_back((i * 11 + 3) % 50);
        typename Model<T>::Trace t;
        Matrix<T> logits, dx;
        m.forward_tokens(ms, ids, logits, t);
        write_matrix(logits);
        auto g = ModelParams<T>::zeros(mc);
        m.backward(t, gaussian<T>(B * 12, 50, 35), g, &dx);
        write_matrix(dx);
        ModelParams<T>::tensors(std::as_const(g), mc, WriteTensor{});
    }
}

template <class T>
void all() {
    const int B = 2, N = 37;
    memories<T>(B, N);
    attention<T>(B, N);
    blocks_and_models<T>(B, N);
    block_training<T>(B);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s OUT.bin [BEFORE.bin]\n", argv[0]);
        return 2;
    }
    out = std::fopen(argv[1], "wb");
    before = argc > 2 ? std::fopen(argv[2], "rb") : nullptr;
    if (out == nullptr || (argc > 2 && before == nullptr)) {
        std::fprintf(stderr, "cannot open the files\n");
        return 2;
    }
    all<double>();
    all<float>();
    std::fclose(out);
    return 0;
}
