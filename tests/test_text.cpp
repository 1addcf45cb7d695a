// Text (include/titans/text/): the byte tokenizer's round trip, documents read from a folder,
// the split by whole documents, near-identical editions, the batch sampler (next-byte labels,
// deterministic and resumable), the Sampler (temperature 0 = argmax, a seed repeats, top-k and
// top-p never leave their set, draws follow the softmax, refusals) and generation through the
// decode path continued from a copy taken mid-stream. The file round trip of a generation is
// in tests/io/test_text_io.cpp.
#include "test_common.hpp"

#include "io/temp_dir.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>  // geteuid: an unreadable file is readable by root

namespace titans_text_test {

using titans::ConfigError;
using titans::FileError;
using titans::NonFiniteError;
using titans::ShapeError;
using titans::text::BatchSampler;
using titans::text::ByteTokenizer;
using titans::text::Document;
using titans::text::Sampler;
using titans::text::SamplerConfig;
using titans_test::Rng;
using titans_test::seed_for;
using titans_test::TempDir;
using titans_test::uniform_int;
namespace fs = std::filesystem;

/// `n` random bytes: any byte value, or (text) printable ASCII, spaces and newlines.
std::string text_test_bytes(Rng& rng, std::size_t n, bool text) {
    std::string s(n, '\0');
    for (char& c : s) {
        c = text ? static_cast<char>(uniform_int(rng, 0, 9) == 0 ? '\n' : uniform_int(rng, 32, 126))
                 : static_cast<char>(static_cast<unsigned char>(uniform_int(rng, 0, 255)));
    }
    return s;
}

void text_test_write(const fs::path& path, const std::string& bytes) {
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << bytes;
}

/// Documents named doc00, doc01, ... of random lengths in [lo, hi] (distinct names).
std::vector<Document> text_test_docs(Rng& rng, int count, int lo, int hi) {
    std::vector<Document> docs;
    for (int i = 0; i < count; ++i) {
        const auto n = static_cast<std::size_t>(uniform_int(rng, lo, hi));
        docs.push_back({titans::detail::concat("doc", i / 10, i % 10), text_test_bytes(rng, n, false)});
    }
    return docs;
}

std::vector<std::string> text_test_names(const std::vector<Document>& docs) {
    std::vector<std::string> names;
    for (const Document& d : docs) names.push_back(d.name);
    return names;
}

TEST_CASE("text: bytes round-trip", "[text]") {
    std::string all(256, '\0');
    for (int b = 0; b < 256; ++b) all[static_cast<std::size_t>(b)] = static_cast<char>(b);
    const std::vector<int> ids = ByteTokenizer::encode(all);
    REQUIRE(ids.size() == 256);
    for (int b = 0; b < 256; ++b) CHECK(ids[static_cast<std::size_t>(b)] == b);
    CHECK(ByteTokenizer::decode(ids) == all);
    Rng rng(seed_for("text: bytes round-trip"));
    for (int trial = 0; trial < 50; ++trial) {
        const std::string s = text_test_bytes(rng, static_cast<std::size_t>(uniform_int(rng, 0, 300)), false);
        const std::vector<int> e = ByteTokenizer::encode(s);
        CHECK(std::all_of(e.begin(), e.end(), [](int id) { return id >= 0 && id < 256; }));
        CHECK(ByteTokenizer::decode(e) == s);
    }
    CHECK(ByteTokenizer::decode(255) == '\xff');
    REQUIRE_THROWS_NAMING(ByteTokenizer::decode(256), ShapeError, "token id = 256");
    REQUIRE_THROWS_NAMING(ByteTokenizer::decode(std::vector<int>{65, -1}), ShapeError,
                          "ids[1] = -1, expected in [0, 256)");
}

TEST_CASE("text: read documents", "[text]") {
    Rng rng(seed_for("text: read documents"));
    TempDir dir("text_read");
    const std::string a = text_test_bytes(rng, 100, false), b = text_test_bytes(rng, 50, true);
    const std::string c = std::string("\0\xff\xc3(", 4);  // NUL, 0xFF, invalid UTF-8
    text_test_write(dir / "b.txt", b);
    text_test_write(dir / "sub/a.bin", a);
    text_test_write(dir / "a.txt", c);
    text_test_write(dir / "empty.txt", "");
    text_test_write(dir / ".hidden", "skipped");
    text_test_write(dir / ".git/objects/x", "skipped");
    const auto docs = titans::text::read_documents(dir.path);
    REQUIRE(text_test_names(docs) ==
            std::vector<std::string>{"a.txt", "b.txt", "empty.txt", "sub/a.bin"});
    CHECK(docs[0].bytes == c);
    CHECK(docs[1].bytes == b);
    CHECK(docs[2].bytes.empty());
    CHECK(docs[3].bytes == a);
    const auto one = titans::text::read_documents(dir / "sub/a.bin");
    REQUIRE(one.size() == 1);
    CHECK((one[0].name == "a.bin" && one[0].bytes == a));

    REQUIRE_THROWS_NAMING(titans::text::read_documents(dir / "missing"), FileError, "missing");
    fs::create_directories(dir / "none/.only_hidden");
    text_test_write(dir / "none/.only_hidden/x", "x");
    REQUIRE_THROWS_NAMING(titans::text::read_documents(dir / "none"), FileError,
                          "a folder with at least one file");
    if (geteuid() != 0) {  // root reads a file whatever its permissions
        fs::permissions(dir / "b.txt", fs::perms::none);
        REQUIRE_THROWS_NAMING(titans::text::read_documents(dir.path), FileError, "b.txt");
    }
}

TEST_CASE("text: split by document", "[text]") {
    Rng rng(seed_for("text: split by document"));
    for (int trial = 0; trial < 40; ++trial) {
        const int n = uniform_int(rng, 2, 30);
        const auto docs = text_test_docs(rng, n, 0, 20);
        const double fraction = titans_test::uniform(rng, 0.001, 0.999);
        const std::uint64_t seed = rng();
        const auto split = titans::text::split_documents(docs, fraction, seed);
        const auto train = text_test_names(split.train), val = text_test_names(split.validation);
        const auto want = std::clamp<long>(std::lround(fraction * n), 1, n - 1);
        CHECK(static_cast<long>(val.size()) == want);
        CHECK(static_cast<int>(train.size() + val.size()) == n);
        // Each document on one side, with its bytes, in the original order on both sides.
        std::vector<std::string> both = train;
        both.insert(both.end(), val.begin(), val.end());
        std::sort(both.begin(), both.end());
        CHECK(both == text_test_names(docs));
        CHECK(std::is_sorted(train.begin(), train.end()));
        CHECK(std::is_sorted(val.begin(), val.end()));
        for (const auto* side : {&split.train, &split.validation}) {
            for (const Document& d : *side) {
                CHECK(d.bytes == docs[static_cast<std::size_t>(std::stoi(d.name.substr(3)))].bytes);
            }
        }
        const auto again = titans::text::split_documents(docs, fraction, seed);
        CHECK((text_test_names(again.train) == train && text_test_names(again.validation) == val));
    }
    // The seed chooses: over a few seeds, more than one validation set appears.
    const auto docs = text_test_docs(rng, 10, 1, 5);
    std::set<std::vector<std::string>> seen;
    for (std::uint64_t s = 0; s < 8; ++s) {
        seen.insert(text_test_names(titans::text::split_documents(docs, 0.3, s).validation));
    }
    CHECK(seen.size() > 1);
    const auto single = titans::text::split_documents({docs[0]}, 0.5, 1);
    CHECK((single.train.size() == 1 && single.validation.empty()));

    for (const double bad : {0.0, 1.0, -0.1, std::nan("")}) {
        REQUIRE_THROWS_NAMING(titans::text::split_documents(docs, bad, 1), ConfigError,
                              "validation_fraction");
    }
    REQUIRE_THROWS_NAMING(titans::text::split_documents({}, 0.5, 1), ShapeError, "docs.size()");
}

/// An edition of `text` as early printings spell it: u -> v inside words, i -> j at the start
/// of some words, a final e added, some words upper-cased.
std::string text_test_edition(const std::string& text, Rng& rng) {
    std::string out;
    bool word_start = true;
    for (std::size_t i = 0; i < text.size(); ++i) {
        char c = text[i];
        const bool letter = c >= 'a' && c <= 'z';
        if (letter && c == 'u' && !word_start) c = 'v';
        if (letter && c == 'i' && word_start && uniform_int(rng, 0, 1) == 0) c = 'j';
        if (letter && word_start && uniform_int(rng, 0, 9) == 0) c = static_cast<char>(c - 32);
        out += c;
        const bool ends = letter && (i + 1 == text.size() || text[i + 1] == ' ');
        if (ends && c != 'e' && uniform_int(rng, 0, 3) == 0) out += 'e';
        word_start = !letter;
    }
    return out;
}

/// A work of `words` words drawn from its own vocabulary of `vocab` random words.
std::string text_test_work(Rng& rng, int words, int vocab) {
    std::vector<std::string> v;
    for (int i = 0; i < vocab; ++i) {
        std::string w;
        for (int k = uniform_int(rng, 3, 9); k > 0; --k) w += static_cast<char>(uniform_int(rng, 'a', 'z'));
        v.push_back(w);
    }
    std::string out;
    for (int i = 0; i < words; ++i) out += titans_test::pick(rng, v) + (i % 12 == 11 ? "\n" : " ");
    return out;
}

TEST_CASE("text: near-identical editions", "[text]") {
    Rng rng(seed_for("text: near-identical editions"));
    const std::string w1 = text_test_work(rng, 3000, 400), w2 = text_test_work(rng, 3000, 400);
    const std::string w3 = text_test_work(rng, 500, 100);
    const std::string e1 = text_test_edition(w1, rng) + "An added line.\n";  // the longest
    CHECK(titans::text::edition_similarity(w1, e1) > 0.9);
    CHECK(titans::text::edition_similarity(w1, w2) < 0.2);
    CHECK(titans::text::edition_words("Vnfold, HEARE: jest unfold hear iest") ==
          std::vector<std::string>{"hear", "iest", "unfold"});
    const std::vector<Document> docs = {{"a_modern", w1}, {"b_other", w2}, {"c_folio", e1},
                                        {"d_copy", w3},   {"e_copy", w3},  {"f_empty", ""},
                                        {"g_empty", ""}};
    const auto kept = titans::text::drop_near_duplicates(docs);
    // e1 is longer than w1: the folio is kept; one copy of w3 (the first by name), one empty.
    CHECK(text_test_names(kept) ==
          std::vector<std::string>{"b_other", "c_folio", "d_copy", "f_empty"});
    CHECK(text_test_names(titans::text::drop_near_duplicates(docs, 1.0)) ==
          std::vector<std::string>{"a_modern", "b_other", "c_folio", "d_copy", "f_empty"});
    for (const double bad : {0.0, 1.5, std::nan("")}) {
        REQUIRE_THROWS_NAMING(titans::text::drop_near_duplicates(docs, bad), ConfigError,
                              "min_similarity");
    }
}

/// Whether `window` occurs in one of `docs`.
bool text_test_in_a_document(const std::vector<Document>& docs, const std::string& window) {
    return std::any_of(docs.begin(), docs.end(), [&](const Document& d) {
        return d.bytes.find(window) != std::string::npos;
    });
}

TEST_CASE("text: batches resume", "[text]") {
    Rng rng(seed_for("text: batches resume"));
    const int length = uniform_int(rng, 4, 12), batch = uniform_int(rng, 1, 6);
    auto docs = text_test_docs(rng, 6, 0, 40);
    docs.push_back({"short", std::string(static_cast<std::size_t>(length), 'x')});  // no window
    docs.push_back({"long", text_test_bytes(rng, 60, false)});
    const std::uint64_t seed = rng();
    BatchSampler sampler(docs, batch, length, seed);
    std::int64_t windows = 0;
    for (const Document& d : docs) windows += std::max<std::int64_t>(0, std::ssize(d.bytes) - length);
    CHECK(sampler.windows() == windows);

    std::vector<titans::text::TokenBatch> run;
    for (int s = 0; s < 30; ++s) run.push_back(sampler.next());
    CHECK(sampler.step() == 30);
    const auto n = static_cast<std::size_t>(length);
    for (const auto& tb : run) {
        REQUIRE((tb.batch == batch && tb.length == length));
        REQUIRE((tb.ids.size() == n * static_cast<std::size_t>(batch) && tb.labels.size() == tb.ids.size()));
        for (std::size_t b = 0; b < static_cast<std::size_t>(batch); ++b) {
            // Sequence b: ids[b*N + t], labels the next byte: ids then the last label are N + 1
            // consecutive bytes of one document.
            std::vector<int> window(tb.ids.begin() + static_cast<std::ptrdiff_t>(b * n),
                                    tb.ids.begin() + static_cast<std::ptrdiff_t>((b + 1) * n));
            for (std::size_t t = 0; t + 1 < n; ++t) CHECK(tb.labels[b * n + t] == window[t + 1]);
            window.push_back(tb.labels[b * n + n - 1]);
            CHECK(text_test_in_a_document(docs, ByteTokenizer::decode(window)));
        }
    }
    // A resumed run (a new sampler, seeked) draws the same batches; batch_at is pure.
    BatchSampler resumed(docs, batch, length, seed);
    resumed.seek(17);
    for (std::size_t s = 17; s < run.size(); ++s) {
        const auto tb = resumed.next();
        CHECK((tb.ids == run[s].ids && tb.labels == run[s].labels));
    }
    CHECK(sampler.batch_at(3).ids == run[3].ids);
    CHECK(sampler.step() == 30);
    BatchSampler other(docs, batch, length, seed + 1);
    bool differs = false;
    for (int s = 0; s < 5; ++s) differs |= other.next().ids != run[static_cast<std::size_t>(s)].ids;
    CHECK(differs);

    REQUIRE_THROWS_NAMING(BatchSampler(docs, 0, length, 1), ConfigError, "batch = 0");
    REQUIRE_THROWS_NAMING(BatchSampler(docs, 1, 0, 1), ConfigError, "length = 0");
    REQUIRE_THROWS_NAMING(BatchSampler(docs, 1, 60, 1), ConfigError, "length = 60, expected at most 59");
    REQUIRE_THROWS_NAMING(BatchSampler({}, 1, 4, 1), ShapeError, "documents.size() = 0");
}

TEST_CASE("text: batches feed the model", "[text]") {
    // The layout Model::forward_tokens and cross_entropy_loss take: B*N ids of a batch-B state.
    Rng rng(seed_for("text: batches feed the model"));
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAG, 1, 8, 2, 1, 8, 256, 4);
    const titans::Model<double> model(cfg, titans::ModelParams<double>::random(cfg, rng()));
    BatchSampler sampler(text_test_docs(rng, 4, 10, 30), 3, 5, rng());
    const auto tb = sampler.next();
    auto st = model.make_state(tb.batch);
    const titans::Matrixd logits = model.forward_tokens(st, tb.ids);
    CHECK((logits.rows() == 15 && st.position == 5));
    titans::Matrixd dlogits;
    CHECK(std::isfinite(titans::cross_entropy_loss<double>(logits, tb.labels, dlogits)));
}

/// Documents of words from a five-word vocabulary, in a fixed cycle with random repeats: a
/// text with structure a tiny model learns in a few dozen steps.
std::vector<Document> text_test_words(Rng& rng, int count, int bytes) {
    const char* words[] = {"to ", "be ", "or ", "not ", "that "};
    std::vector<Document> docs;
    for (int i = 0; i < count; ++i) {
        std::string t;
        int w = uniform_int(rng, 0, 4);
        while (static_cast<int>(t.size()) < bytes) {
            t += words[w];
            if (uniform_int(rng, 0, 3) != 0) w = (w + 1) % 5;
        }
        docs.push_back({titans::detail::concat("words", i), t});
    }
    return docs;
}

/// Mean cross-entropy (nats per byte) of `model` on batches 0..n-1 of `sampler`.
double text_test_loss(const titans::Model<double>& model, const BatchSampler& sampler, int n) {
    double sum = 0;
    titans::Matrixd dlogits;
    for (int k = 0; k < n; ++k) {
        const auto b = sampler.batch_at(static_cast<std::uint64_t>(k));
        auto st = model.make_state(b.batch);
        sum += titans::cross_entropy_loss<double>(model.forward_tokens(st, b.ids), b.labels, dlogits);
    }
    return sum / n;
}

TEST_CASE("text: training lowers the loss", "[text][train]") {
    // A tiny MAG model trained by titans::Trainer on batches of one text, judged on windows of
    // other documents: its loss must fall from ~ln 256 towards the text's entropy (well under
    // 2 nats). Broken gradients (a wrong sign, zeros, a wrong layout of dlogits) do not.
    Rng rng(seed_for("text: training lowers the loss"));
    const std::vector<Document> docs = text_test_words(rng, 4, 400);
    const BatchSampler train({docs[0], docs[1], docs[2]}, 4, 16, rng());
    const BatchSampler valid({docs[3]}, 4, 16, rng());
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAG, 1, 8, 2, 1, 8, 256, 4);
    titans::TrainerConfig tc;
    tc.schedule = {1e-2, 5, 80, 0.1};
    titans::Trainer<double> trainer(cfg, titans::ModelParams<double>::random(cfg, rng()), tc);
    const double before = text_test_loss(trainer.model(), valid, 2);
    for (int step = 0; step < 80; ++step) {
        const auto b = train.batch_at(static_cast<std::uint64_t>(step));
        (void)trainer.step(b.ids, b.labels, b.batch);
    }
    const double after = text_test_loss(trainer.model(), valid, 2);
    INFO("validation loss " << before << " -> " << after << " nats per byte");
    CHECK(before > 4.5);
    CHECK(after < 2.0);
}

// ---------------------------------------------------------------------------------------------
// Sampler.

/// Random logits of width v: uniform, with repeats (ties), huge and tiny magnitudes.
titans::Matrixd text_test_logits(Rng& rng, int v, double scale) {
    titans::Matrixd l = titans_test::random_matrix(1, v, rng, -scale, scale);
    for (Eigen::Index i = 0; i < l.cols(); ++i) {
        const int kind = uniform_int(rng, 0, 9);
        if (kind == 0) l(0, i) = l(0, uniform_int(rng, 0, v - 1));     // a tie
        if (kind == 1) l(0, i) = 1e-300 * titans_test::uniform(rng);  // tiny
    }
    return l;
}

/// The ids a SamplerConfig may draw (the class comment's steps 1, 2, 4), computed separately:
/// false in `ambiguous` when the top-p cut falls within rounding of a boundary.
std::vector<int> text_test_allowed(const titans::Matrixd& l, const SamplerConfig& c, bool& ambiguous) {
    const auto v = static_cast<int>(l.cols());
    std::vector<int> ids(static_cast<std::size_t>(v));
    for (int i = 0; i < v; ++i) ids[static_cast<std::size_t>(i)] = i;
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return l(0, a) > l(0, b); });
    if (c.top_k > 0 && c.top_k < v) ids.resize(static_cast<std::size_t>(c.top_k));
    ambiguous = false;
    if (c.top_p < 1) {
        std::vector<long double> w;
        long double total = 0;
        for (int id : ids) {
            w.push_back(std::exp(static_cast<long double>(l(0, id) - l.maxCoeff()) / c.temperature));
            total += w.back();
        }
        long double acc = 0;
        std::size_t n = 0;
        while (n < ids.size() && (n == 0 || acc < c.top_p * total)) acc += w[n++];
        const long double gap = std::fabs(acc - w[n - 1] - c.top_p * total);
        ambiguous = std::fabs(acc - c.top_p * total) < 1e-9L * total || (n > 1 && gap < 1e-9L * total);
        ids.resize(n);
    }
    std::sort(ids.begin(), ids.end());
    return ids;
}

TEST_CASE("sampler: temperature 0 is argmax", "[text]") {
    Rng rng(seed_for("sampler: temperature 0 is argmax"));
    for (int trial = 0; trial < 200; ++trial) {
        const int v = uniform_int(rng, 1, 300);
        const double scale = titans_test::pick(rng, std::vector<double>{1.0, 1e-200, 1e300});
        titans::Matrixd l = text_test_logits(rng, v, scale);
        if (trial % 3 == 0) l.setConstant(titans_test::uniform(rng));  // all tied: id 0
        SamplerConfig c;
        c.temperature = 0;
        c.top_k = uniform_int(rng, 0, 5);
        c.top_p = titans_test::uniform(rng, 0.01, 1.0);
        c.seed = rng();
        Sampler s(c);
        Eigen::Index want = 0;
        l.row(0).maxCoeff(&want);  // Eigen: the first maximum
        for (Eigen::Index i = 0; i < want; ++i) REQUIRE(l(0, i) < l(0, want));
        CHECK(s.sample(l.row(0)) == want);
        CHECK(s.sample(l.row(0).transpose()) == want);
        if (scale <= 1) {  // float: the same rule on the rounded values
            const titans::RowVectorf f = l.row(0).cast<float>();
            Eigen::Index wf = 0;
            f.maxCoeff(&wf);
            CHECK(s.sample(f) == wf);
        }
        CHECK(s.state() == c.seed);  // greedy draws nothing
    }
}

TEST_CASE("sampler: a seed repeats", "[text]") {
    Rng rng(seed_for("sampler: a seed repeats"));
    SamplerConfig c;
    c.temperature = titans_test::uniform(rng, 0.5, 2.0);
    c.top_k = uniform_int(rng, 0, 20);
    c.top_p = titans_test::uniform(rng, 0.5, 1.0);
    c.seed = rng();
    std::vector<titans::Matrixd> rows;
    for (int i = 0; i < 200; ++i) rows.push_back(titans_test::random_matrix(1, 64, rng, -3, 3));
    Sampler a(c), b(c);
    std::vector<int> first;
    std::uint64_t mid = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
        if (i == 100) mid = a.state();
        first.push_back(a.sample(rows[i].row(0)));
        CHECK(b.sample(rows[i].row(0)) == first.back());
    }
    Sampler resumed(c);
    resumed.restore(mid);
    for (std::size_t i = 100; i < rows.size(); ++i) CHECK(resumed.sample(rows[i].row(0)) == first[i]);
    c.seed += 1;
    Sampler other(c);
    int same = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) same += other.sample(rows[i].row(0)) == first[i];
    CHECK(same < 150);
}

TEST_CASE("sampler: top-k and top-p sets", "[text]") {
    Rng rng(seed_for("sampler: top-k and top-p sets"));
    int checked = 0;
    for (int trial = 0; trial < 300; ++trial) {
        const int v = uniform_int(rng, 1, 40);
        const double scale = titans_test::pick(rng, std::vector<double>{1.0, 5.0, 1e-300, 1e300});
        const titans::Matrixd l = text_test_logits(rng, v, scale);
        SamplerConfig c;
        c.temperature = titans_test::pick(rng, std::vector<double>{0.1, 1.0, 3.0, 1e-6, 1e6});
        c.top_k = uniform_int(rng, 0, 3) == 0 ? 0 : uniform_int(rng, 1, v + 2);
        c.top_p = uniform_int(rng, 0, 3) == 0 ? 1.0 : titans_test::uniform(rng, 0.001, 1.0);
        c.seed = rng();
        bool ambiguous = false;
        const std::vector<int> allowed = text_test_allowed(l, c, ambiguous);
        if (ambiguous) continue;
        ++checked;
        Sampler s(c);
        std::set<int> drawn;
        for (int d = 0; d < 200; ++d) {
            const int id = s.sample(l.row(0));
            INFO("trial " << trial << ", v " << v << ", top_k " << c.top_k << ", top_p " << c.top_p);
            REQUIRE(std::binary_search(allowed.begin(), allowed.end(), id));
            drawn.insert(id);
        }
        if (allowed.size() == 1) CHECK(drawn.size() == 1);
    }
    CHECK(checked > 250);
}

/// Chi-square of `draws` draws of a Sampler(c) against softmax(l / t) restricted to the set
/// text_test_allowed gives and renormalised.
double text_test_chi_square(const titans::Matrixd& l, const SamplerConfig& c, int draws) {
    bool ambiguous = false;
    const std::vector<int> allowed = text_test_allowed(l, c, ambiguous);
    REQUIRE(!ambiguous);
    Sampler s(c);
    const auto v = static_cast<std::size_t>(l.cols());
    std::vector<int> counts(v, 0);
    for (int d = 0; d < draws; ++d) ++counts[static_cast<std::size_t>(s.sample(l.row(0)))];
    std::vector<long double> p(v, 0);
    long double total = 0;
    for (const int id : allowed) {
        p[static_cast<std::size_t>(id)] = std::exp(static_cast<long double>(l(0, id)) / c.temperature);
        total += p[static_cast<std::size_t>(id)];
    }
    double chi = 0;
    for (std::size_t i = 0; i < v; ++i) {
        const double expected = static_cast<double>(p[i] / total) * draws;
        if (expected == 0) {
            if (counts[i] != 0) return std::numeric_limits<double>::infinity();
            continue;
        }
        chi += (counts[i] - expected) * (counts[i] - expected) / expected;
    }
    return chi;
}

TEST_CASE("sampler: draws follow the softmax", "[text]") {
    // 6 outcomes (5 degrees of freedom): P(chi-square > 45) = 1.5e-8 for a correct sampler;
    // a wrong temperature, a missing renormalisation or a biased draw gives hundreds.
    Rng rng(seed_for("sampler: draws follow the softmax"));
    const titans::Matrixd l = titans_test::random_matrix(1, 6, rng, -1.5, 1.5);
    for (const double t : {1.0, 0.5, 2.0}) {
        INFO("temperature " << t);
        CHECK(text_test_chi_square(l, {.temperature = t, .seed = rng()}, 20000) < 45);
    }
    // Cut sets, renormalised: softmax(2, 1, 0.5, 0, -1, -2) = 0.557, 0.205, 0.124, 0.075, ...,
    // in a random order: top_k = 3 and top_p = 0.8 both keep the three largest (2 degrees of
    // freedom: P(chi-square > 35) = 2.5e-8).
    std::vector<double> values = {2, 1, 0.5, 0, -1, -2};
    std::shuffle(values.begin(), values.end(), rng);
    const titans::Matrixd cut = Eigen::Map<const titans::Matrixd>(values.data(), 1, 6);
    CHECK(text_test_chi_square(cut, {.top_k = 3, .seed = rng()}, 20000) < 35);
    CHECK(text_test_chi_square(cut, {.top_p = 0.8, .seed = rng()}, 20000) < 35);
}

TEST_CASE("sampler: refusals", "[text]") {
    const auto refused = [](SamplerConfig c, const char* field) {
        REQUIRE_THROWS_NAMING(Sampler(c), ConfigError, field);
        REQUIRE_THROWS_NAMING(c.validate(), ConfigError, field);
    };
    const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
    for (const double t : {-1.0, inf, nan}) refused({.temperature = t}, "temperature");
    refused({.top_k = -1}, "top_k");
    for (const double p : {0.0, -0.5, 1.5, nan}) refused({.top_p = p}, "top_p");

    Sampler s({.temperature = 1.0, .seed = 5});
    titans::Matrixd l(1, 4);
    l << 0.5, 1.0, -2.0, 0.0;
    REQUIRE_THROWS_NAMING(s.sample(titans::Matrixd(0, 0)), ShapeError, "logits is 0 x 0");
    REQUIRE_THROWS_NAMING(s.sample(titans::Matrixd::Zero(2, 3)), ShapeError, "logits is 2 x 3");
    for (const double bad : {nan, inf, -inf}) {
        titans::Matrixd m = l;
        m(0, 2) = bad;
        REQUIRE_THROWS_NAMING(s.sample(m.row(0)), NonFiniteError, "logits[2]");
        CHECK(s.state() == 5);  // the generator did not advance
    }
    titans::RowVectorf f = l.row(0).cast<float>();
    f(1) = std::numeric_limits<float>::quiet_NaN();
    REQUIRE_THROWS_NAMING(s.sample(f), NonFiniteError, "logits[1]");
    CHECK(s.state() == 5);
}

// ---------------------------------------------------------------------------------------------
// Generation through the decode path.

template <class T>
titans::Model<T> text_test_model(std::uint64_t seed) {
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::MAC, 1, 16, 2, 1, 8, 256, 4);
    cfg.blocks.push_back(titans::BlockConfig::make(titans::BlockKind::MAG, 16, 2, 1, 8, 4));
    return titans::Model<T>(cfg, titans::ModelParams<T>::random(cfg, seed));
}

TEMPLATE_TEST_CASE("generation: resumed copy", "[text]", float, double) {
    using T = TestType;
    Rng rng(seed_for("generation: resumed copy", sizeof(T)));
    const titans::Model<T> model = text_test_model<T>(rng());
    const std::vector<int> prompt = ByteTokenizer::encode(text_test_bytes(rng, 7, true));
    const SamplerConfig sc{.temperature = 1.0, .top_k = 50, .top_p = 0.95, .seed = rng()};
    const int total = 24, cut = uniform_int(rng, 1, total - 1);

    auto g = titans::text::start_generation(model, prompt, sc);
    CHECK((g.state.position == 6 && g.pending == prompt.back()));
    std::vector<int> all;
    titans::ModelState<T> saved_state;
    std::uint64_t saved_rng = 0;
    int saved_pending = -1;
    for (int i = 0; i < total; ++i) {
        if (i == cut) {  // the checkpoint: the three parts, as a file would hold them
            saved_state = g.state;
            saved_rng = g.sampler.state();
            saved_pending = g.pending;
        }
        all.push_back(titans::text::next_token(model, g));
    }
    CHECK(g.state.position == 6 + total);
    titans::text::Sampler sampler(sc);
    sampler.restore(saved_rng);
    titans::text::Generation<T> resumed{saved_state, sampler, saved_pending};
    for (int i = cut; i < total; ++i) {
        CHECK(titans::text::next_token(model, resumed) == all[static_cast<std::size_t>(i)]);
    }
    // A fresh start from the same prompt and seed repeats the whole continuation.
    auto again = titans::text::start_generation(model, prompt, sc);
    for (int i = 0; i < total; ++i) {
        CHECK(titans::text::next_token(model, again) == all[static_cast<std::size_t>(i)]);
    }
    // Greedy: each token is the argmax of the logits of the model fed everything so far.
    auto greedy = titans::text::start_generation(model, prompt, {.temperature = 0});
    auto st = model.make_state(1);
    std::vector<int> fed(prompt.begin(), prompt.end() - 1);
    (void)model.forward_tokens(st, fed);
    int last = prompt.back();
    for (int i = 0; i < 5; ++i) {
        Eigen::Index want = 0;
        model.forward_tokens(st, std::vector<int>{last}).row(0).maxCoeff(&want);
        last = titans::text::next_token(model, greedy);
        CHECK(last == want);
    }
}

TEST_CASE("generation: refusals", "[text]") {
    const titans::Model<double> model = text_test_model<double>(3);
    REQUIRE_THROWS_NAMING(titans::text::start_generation(model, std::vector<int>{}, {}),
                          ShapeError, "prompt.size() = 0");
    REQUIRE_THROWS_NAMING(titans::text::start_generation(model, std::vector<int>{65, 256}, {}),
                          ShapeError, "prompt[1] = 256");
    REQUIRE_THROWS_NAMING(titans::text::start_generation(model, std::vector<int>{65}, {.top_p = 2}),
                          ConfigError, "top_p");
    auto cfg = titans::ModelConfig::uniform(titans::BlockKind::LMM, 1, 8, 2, 1, 8, 0, 4);
    const titans::Model<double> vectors(cfg, titans::ModelParams<double>::random(cfg, 1));
    REQUIRE_THROWS_NAMING(titans::text::start_generation(vectors, std::vector<int>{65}, {}),
                          ConfigError, "vocab_size");
    // A pending id outside the vocabulary: refused by the model, nothing changes.
    auto g = titans::text::start_generation(model, std::vector<int>{65, 66}, {.seed = 9});
    g.pending = 300;
    REQUIRE_THROWS_NAMING(titans::text::next_token(model, g), ShapeError, "token id");
    CHECK((g.pending == 300 && g.state.position == 1 && g.sampler.state() == 9));
}

}  // namespace titans_text_test
