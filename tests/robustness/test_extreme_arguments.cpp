// The public free functions at extreme positions, strides and head counts: apply_rope and
// prefix_window_attention (and its backward) refuse what would overflow 64 bits with an error
// naming the argument (never signed-overflow UB: the sanitizer build runs these), check every
// shape before anything is resized or allocated, and leave their outputs as they were.

#include "robust_common.hpp"

#include <cstdint>
#include <limits>

using namespace titans_test;
using titans::ConfigError;
using titans::ShapeError;

namespace {

constexpr std::int64_t extreme_top = std::numeric_limits<std::int64_t>::max();

}  // namespace

// apply_rope: row r sits at first_position + r, which must stay within limits::max_position
// (2^62): near INT64_MAX the sum overflowed before. The last valid start is accepted and equals
// the rotation at that position; a refused call leaves x bit for bit.
TEMPLATE_TEST_CASE("extreme: rope positions", "[limits][attention]", float, double) {
    using T = TestType;
    Rng rng(seed_for("extreme rope"));
    const Matrix<T> x0 = random_matrix(3, 8, rng).template cast<T>();
    const std::int64_t mp = titans::limits::max_position;
    for (std::int64_t first : {extreme_top, extreme_top - 1, extreme_top - 2, mp + 1, mp - 2,
                               mp - 1, mp}) {
        INFO("first_position = " << first);
        Matrix<T> x = x0;
        REQUIRE_THROWS_NAMING(titans::apply_rope(x, 2, 4, first), ConfigError, "first_position");
        CHECK(identical(x, x0));
        Matrix<T> none(0, 8);  // no row: the start alone must be within the limit
        if (first > mp) {
            REQUIRE_THROWS_NAMING(titans::apply_rope(none, 2, 4, first), ConfigError,
                                  "first_position");
        }
    }
    Matrix<T> x = x0;
    REQUIRE_NOTHROW(titans::apply_rope(x, 2, 4, mp - 3));  // rows at 2^62 - 3 .. 2^62 - 1
    Matrix<T> last = x0.bottomRows(1);
    titans::apply_rope(last, 2, 4, mp - 1);
    CHECK(identical(Matrix<T>(x.bottomRows(1)), last));
}

// prefix_window_attention: the last query's position first_query + query_stride * (n - 1)
// overflowing 64 bits (a stride or a first query near INT64_MAX) is a ShapeError naming both;
// before, it wrapped to a negative position that passed the key-row check.
TEMPLATE_TEST_CASE("extreme: attention strides", "[limits][attention]", float, double) {
    using T = TestType;
    Rng rng(seed_for("extreme attention strides"));
    const Matrix<T> q = random_matrix(3, 4, rng).template cast<T>();
    const Matrix<T> k = random_matrix(5, 4, rng).template cast<T>();
    const Matrix<T> none(0, 4);
    const Matrix<T> out0 = random_matrix(3, 4, rng).template cast<T>();
    const std::pair<Eigen::Index, Eigen::Index> cases[] = {
        {1, extreme_top}, {0, extreme_top / 2 + 1}, {extreme_top, 1}, {extreme_top - 1, 1},
        {extreme_top / 2, extreme_top / 4 + 2}};
    for (const auto& [first, stride] : cases) {
        INFO("first_query = " << first << " query_stride = " << stride);
        Matrix<T> out = out0;
        REQUIRE_THROWS_NAMING(titans::prefix_window_attention<T>(q, none, none, k, k, 2, 2, 4,
                                                                 first, out, stride),
                              ShapeError, "first_query + query_stride * (q.rows() - 1)");
        CHECK(identical(out, out0));
        Matrix<T> dq = out0, dkp(0, 0), dvp(0, 0), dks = Matrix<T>::Zero(5, 4), dvs = dks;
        REQUIRE_THROWS_NAMING(titans::prefix_window_attention_backward<T>(
                                  q, none, none, k, k, 2, 2, 4, first, q, dq, dkp, dvp, dks, dvs,
                                  stride),
                              ShapeError, "first_query + query_stride * (q.rows() - 1)");
        CHECK(identical(dq, out0));
    }
    // One query never steps: any stride is valid, and the key span it reads is clamped to the
    // keys (it overflowed as stride * (tile - 1) + window before).
    const Matrix<T> q1 = q.topRows(1);
    Matrix<T> o1(1, 4), ref(1, 4);
    titans::prefix_window_attention<T>(q1, none, none, k, k, 2, 2, 4, 3, ref, 1);
    for (Eigen::Index stride : {extreme_top, extreme_top / 63 + 1, Eigen::Index{1} << 40}) {
        INFO("query_stride = " << stride);
        REQUIRE_NOTHROW(titans::prefix_window_attention<T>(q1, none, none, k, k, 2, 2, 4, 3, o1,
                                                           stride));
        CHECK(identical(o1, ref));
        Matrix<T> dq, dkp(0, 0), dvp(0, 0), dks = Matrix<T>::Zero(5, 4), dvs = dks;
        REQUIRE_NOTHROW(titans::prefix_window_attention_backward<T>(
            q1, none, none, k, k, 2, 2, 4, 3, ref, dq, dkp, dvp, dks, dvs, stride));
        CHECK(dq.allFinite());
    }
}

// The Matrix overloads of prefix_window_attention check every shape before resizing out: a
// head count whose n_heads * d_head is far beyond memory (2^60 columns: Eigen's resize throws
// std::bad_alloc; 2^40: an 8 TiB allocation) is the ShapeError of q's width, and out is as it
// was.
TEMPLATE_TEST_CASE("extreme: attn head counts", "[limits][attention]", float, double) {
    using T = TestType;
    Rng rng(seed_for("extreme attention heads"));
    const Matrix<T> q = random_matrix(2, 4, rng).template cast<T>();
    const Matrix<T> none(0, 4);
    const Matrix<T> out0 = random_matrix(3, 3, rng).template cast<T>();
    const std::pair<int, int> heads[] = {{1 << 30, 1 << 30}, {1 << 20, 1 << 20},
                                         {std::numeric_limits<int>::max(), 2}};
    for (const auto& [h, dh] : heads) {
        INFO("n_heads = " << h << " d_head = " << dh);
        Matrix<T> out = out0;
        REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, none, none, q, q, h, dh, 4, 0, out),
                              ShapeError, "q has 4 columns");
        CHECK(identical(out, out0));
        REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, none, none, q, q, h, dh, 4),
                              ShapeError, "q has 4 columns");
    }
    // A refused stride, window or first query leaves out as it was too.
    Matrix<T> out = out0;
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, none, none, q, q, 2, 2, 0, 0, out),
                          ConfigError, "window");
    REQUIRE_THROWS_NAMING(titans::prefix_window_attention(q, none, none, q, q, 2, 2, 4, extreme_top,
                                                          out),
                          ShapeError, "q.rows() - 1");
    CHECK(identical(out, out0));
}
