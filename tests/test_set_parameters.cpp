// Model::set_parameters: a model that takes new values computes what a model built from them
// computes, bit for bit, every block kind (MAG's projected persistent prefix and MAC's P W_K,
// P W_V are made again), in place on the CPU when nothing else holds its parameters and as a
// fresh parameter object otherwise (a copy of the model, a layer's pointer, the simulated
// device); copies made before keep their values; refused values change nothing.
#include "backends.hpp"
#include "block_cases.hpp"
#include "trainer_common.hpp"

#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using namespace titans_test;

namespace {

/// p with every entry of every tensor `cfg` uses moved by up to 0.1.
template <class T>
ModelParams<T> setp_moved(const ModelParams<T>& p, const ModelConfig& cfg, Rng& rng) {
    ModelParams<T> q = p;
    for (const auto& s : titans::detail::tensor_slots(q, cfg)) {
        for (Eigen::Index i = 0; i < s.size(); ++i) s.data[i] += static_cast<T>(uniform(rng, -0.1, 0.1));
    }
    return q;
}

/// The logits of `model` over ids from a fresh state of B sequences.
template <class M>
auto setp_logits(const M& model, const std::vector<int>& ids, int B) {
    auto st = model.make_state(B);
    return model.forward_tokens(st, ids);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("model: set_parameters", "[model][training]", Both) {
    using T = typename TestType::Scalar;
    using Backend = typename TestType::Backend;
    using M = titans::Model<T, Backend>;
    constexpr bool cpu = std::is_same_v<Backend, titans::backend::Cpu>;
    const std::pair<BlockKind, BlockKind> stacks[] = {{BlockKind::MAC, BlockKind::MAG},
                                                      {BlockKind::MAL, BlockKind::LMM}};
    for (std::size_t s = 0; s < 2; ++s) {
        INFO("stack " << s);
        Rng rng(seed_for(std::string("model/set_parameters/") + type_name<T>(), s));
        const int vocab = 9, B = uniform_int(rng, 1, 2), N = uniform_int(rng, 4, 12);
        const ModelCase mc = make_model_case<T>(stacks[s].first, stacks[s].second, 8, vocab, 0, rng);
        const ModelConfig& cfg = mc.cfg;
        const ModelParams<T> p1 = cast_model<T>(mc.params), p2 = setp_moved(p1, cfg, rng);
        const std::vector<int> ids = random_ids(rng, B * N, vocab);
        const Matrix<T> y1 = setp_logits(M(cfg, p1), ids, B), y2 = setp_logits(M(cfg, p2), ids, B);
        REQUIRE(!identical(y1, y2));

        M model(cfg, p1);
        const ModelParams<T>* held = &model.params();
        model.set_parameters(p2);
        CHECK((&model.params() == held) == cpu);  // in place on the CPU only
        CHECK(same_param_bits(model.params(), p2, cfg));
        CHECK(identical(setp_logits(model, ids, B), y2));
        {  // A copy made before keeps its values; the model takes a new parameter object.
            const M copy = model;
            held = &model.params();
            model.set_parameters(p1);
            CHECK(&copy.params() == held);
            CHECK(&model.params() != held);
            CHECK(same_param_bits(copy.params(), p2, cfg));
            CHECK(identical(setp_logits(copy, ids, B), y2));
            CHECK(identical(setp_logits(model, ids, B), y1));
        }
        held = &model.params();  // alone again: in place on the CPU
        model.set_parameters(p2);
        CHECK((&model.params() == held) == cpu);
        CHECK(identical(setp_logits(model, ids, B), y2));
        {  // A layer's pointer to the parameters keeps them too.
            const auto kept = model.blocks()[1].shared_params();
            held = &model.params();
            model.set_parameters(p1);
            CHECK(&model.params() != held);
            CHECK(same_param_bits(*kept, p2.blocks[1], cfg.blocks[1]));
            CHECK(identical(setp_logits(model, ids, B), y1));
        }

        // Refused values: the model keeps its parameters (same object, same bits, same logits).
        held = &model.params();
        const auto refused = [&](ModelParams<T> bad) {
            model.set_parameters(std::move(bad));
        };
        ModelParams<T> bad = p2;
        bad.head.conservativeResize(Eigen::NoChange, vocab + 1);
        REQUIRE_THROWS_NAMING(refused(bad), titans::ShapeError, "head");
        bad = p2;
        bad.blocks[s].norm_ffn(0, 1) = std::numeric_limits<T>::quiet_NaN();
        REQUIRE_THROWS_NAMING(refused(bad), titans::NonFiniteError, "norm_ffn");
        bad = p2;
        bad.blocks[1].memory.w_q.conservativeResize(Eigen::NoChange, 3);
        REQUIRE_THROWS_NAMING(refused(bad), titans::ShapeError, "w_q");
        bad = p2;
        bad.blocks.pop_back();
        REQUIRE_THROWS_NAMING(refused(bad), titans::ShapeError, "blocks");
        CHECK(&model.params() == held);
        CHECK(same_param_bits(model.params(), p1, cfg));
        CHECK(identical(setp_logits(model, ids, B), y1));

        // The values flat in the backend's memory (ModelAdamW's layout): refused with a wrong
        // width or a NaN (named), nothing changing; then taken, as p2 itself.
        using Tr = titans::backend::Transfer<Backend, T>;
        Matrix<T> flat(1, model.parameter_count()), nan;
        titans::detail::flatten_tensors(p2, cfg, flat.data());
        nan = flat;
        nan(0, flat.cols() - 1) = std::numeric_limits<T>::quiet_NaN();
        const auto on_backend = Tr::upload(titans::view_of(std::as_const(flat)));
        const auto nan_backend = Tr::upload(titans::view_of(std::as_const(nan)));
        const titans::View<const T> fv = Tr::view(on_backend);
        REQUIRE_THROWS_NAMING(model.set_parameters(Tr::view(nan_backend)), titans::NonFiniteError,
                              "head");
        REQUIRE_THROWS_NAMING(
            model.set_parameters(titans::View<const T>{fv.data, 1, fv.cols - 1, fv.cols - 1}),
            titans::ShapeError, "flat");
        CHECK(same_param_bits(model.params(), p1, cfg));
        CHECK(identical(setp_logits(model, ids, B), y1));
        model.set_parameters(fv);
        CHECK(identical(setp_logits(model, ids, B), y2));
        CHECK(&model.params() == held);  // alone: the same host tensors, brought up to date
        CHECK(same_param_bits(model.params(), p2, cfg));
    }
}
