#pragma once
// titans/detail/tensor_slots.hpp: the tensors of a parameter struct as flat slots (name, data,
// shape), as its tensors() visitor names them; the optimiser pairs them with the gradients',
// and every backward checks and adds its gradients through them (math §9).

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "float_env.hpp"
#include "../error.hpp"
#include "check.hpp"

namespace titans {

namespace detail {

/// The scalar type of a parameter struct: P::Scalar where the struct names it (a user's own
/// struct), else T of a template P<T> (FeedForwardParams<T>, ModelParams<T>, ...).
template <class P>
struct ParamsScalar {
    using type = typename P::Scalar;
};
template <template <class> class P, class T>
struct ParamsScalar<P<T>> {
    using type = T;
};

/// One tensor of a parameter struct as its visitor names it: entries [data, data + size()),
/// contiguous (Matrix<T> and RowVector<T> both are). X is T or const T.
template <class X>
struct TensorSlot {
    std::string name;
    X* data;
    Eigen::Index rows, cols;
    [[nodiscard]] Eigen::Index size() const { return rows * cols; }
    [[nodiscard]] auto array() const {
        using T = std::remove_const_t<X>;
        using A = Eigen::Array<T, Eigen::Dynamic, 1>;
        using Map = std::conditional_t<std::is_const_v<X>, Eigen::Map<const A>, Eigen::Map<A>>;
        return Map(data, size());
    }
};

/// The tensors Params::tensors(p, cfg, .) visits, in its order (p const or not).
template <class Params, class Config>
[[nodiscard]] auto tensor_slots(Params& p, const Config& cfg) {
    using T = typename ParamsScalar<std::remove_const_t<Params>>::type;
    using X = std::conditional_t<std::is_const_v<Params>, const T, T>;
    std::vector<TensorSlot<X>> out;
    std::remove_const_t<Params>::tensors(p, cfg, [&](const std::string& name, auto& m) {
        out.push_back(TensorSlot<X>{name, m.data(), m.rows(), m.cols()});
    });
    return out;
}

/// ShapeError (naming `what` and the tensor) unless slot g has the shape of slot p.
template <class P, class G>
void check_slot_shape(const P& p, const G& g, const char* where, const char* what) {
    if (g.rows != p.rows || g.cols != p.cols) {
        throw ShapeError(concat(where, ": ", what, " '", g.name, "' is ", g.rows, " x ", g.cols,
                                ", expected ", p.rows, " x ", p.cols,
                                " (the shape of the parameter)"));
    }
}

/// ShapeError "<where>: <what> do not fit cfg: <reason>" unless `p` holds every tensor
/// Params::tensors(., cfg, .) names at the shape `cfg` gives it; ConfigError "<where>: cfg:
/// ..." if cfg has a validate() that refuses it. Reads p only (const visits). Our parameter
/// structs are checked by their validate(cfg); where it stops at a NaN, the shapes are compared
/// with those of Params::zeros(cfg) instead (allocated only then). A user's own struct without
/// validate(cfg) is checked by its const tensors() visit only (the pairing with another struct
/// is the caller's check).
template <class Params, class Config>
void check_fits(const Params& p, const Config& cfg, const char* where, const char* what) {
    if constexpr (requires { cfg.validate(); }) {
        with_context(concat(where, ": cfg: "), [&] { cfg.validate(); });
    }
    with_context(concat(where, ": ", what, " do not fit cfg: "), [&] {
        if constexpr (requires { p.validate(cfg); }) {
            try {
                p.validate(cfg);
                return;
            } catch (const NonFiniteError&) {  // the shapes after the NaN are unchecked
            }
        }
        if constexpr (requires { Params::zeros(cfg); }) {
            const Params zeros = Params::zeros(cfg);
            const auto expected = tensor_slots(zeros, cfg);
            const auto got = tensor_slots(p, cfg);
            for (std::size_t i = 0; i < got.size(); ++i) {
                const auto &e = expected[i], &g = got[i];
                if (g.rows != e.rows || g.cols != e.cols) {
                    throw ShapeError(concat("'", g.name, "' is ", g.rows, " x ", g.cols,
                                            ", expected ", e.rows, " x ", e.cols));
                }
            }
        } else {
            (void)tensor_slots(p, cfg);  // the struct's own structure checks
        }
    });
}

/// The gradients a backward adds to: ShapeError unless every tensor of grads has the shape of
/// params' tensor of the same name, NonFiniteError if an entry is NaN or infinite. Reads grads
/// only (a const visit). A struct of another configuration's counts (blocks, memory heads or
/// layers), which the const visit refuses, is refused naming `what` (e.g. "grads") and the
/// counts expected.
template <class Params, class Config>
void check_same_tensors(const Params& params, const Params& grads, const Config& cfg,
                        const char* where, const char* what) {
    const auto ps = tensor_slots(params, cfg);
    const auto gs = [&] {
        try {
            return tensor_slots(grads, cfg);
        } catch (const ShapeError& e) {  // "<Params>::tensors: <the counts and the expected>"
            const std::string msg = e.what();
            const auto colon = msg.find(": ");
            throw ShapeError(concat(where, ": ", what, " does not have this configuration's "
                                    "tensors: ", colon == std::string::npos ? msg
                                                                            : msg.substr(colon + 2),
                                    " (expected the shapes of params(), e.g. zeros(config()))"));
        }
    }();
    for (std::size_t i = 0; i < ps.size(); ++i) {
        check_slot_shape(ps[i], gs[i], where, what);
        if (!all_finite(gs[i].array())) {
            throw NonFiniteError(concat(where, ": ", what, " '", gs[i].name,
                                        "' has a NaN or infinite entry"));
        }
    }
}

/// The flat form of p's tensors (Params::tensors order, each row-major) added to the entries
/// at `to` in host memory, tensor after tensor: how a host kernel hands its gradients to a
/// slice of a gradient buffer.
template <class Params, class Config, class T>
void add_flat_host(const Params& p, const Config& cfg, T* to) {
    for (const auto& s : tensor_slots(p, cfg)) {
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(to, s.size()) += s.array();
        to += s.size();
    }
}

/// The flat form of p's tensors (Params::tensors order, each row-major) written at `to`.
template <class Params, class Config, class T>
void flatten_tensors(const Params& p, const Config& cfg, T* to) {
    for (const auto& s : tensor_slots(p, cfg)) {
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(to, s.size()) = s.array();
        to += s.size();
    }
}

/// The inverse of flatten_tensors: p's tensors take the entries at `from`, tensor after tensor.
template <class Params, class Config, class T>
void unflatten_tensors(const T* from, Params& p, const Config& cfg) {
    for (const auto& s : tensor_slots(p, cfg)) {
        s.array() = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(from, s.size());
        from += s.size();
    }
}

/// A copy of `shapes` (a parameter struct) whose tensors hold the entries of `flat` (host
/// memory, its tensors() order, each row-major): how a host kernel prepares a layer's
/// parameters from a slice of a parameter buffer.
template <class Params, class Config, class T>
[[nodiscard]] std::shared_ptr<const Params> from_flat(const Params& shapes, const Config& cfg,
                                                      const T* flat) {
    auto p = std::make_shared<Params>(shapes);
    unflatten_tensors(flat, *p, cfg);
    return p;
}

/// Whether every entry of every tensor of p is finite.
template <class Params, class Config>
[[nodiscard]] bool tensors_finite(const Params& p, const Config& cfg) {
    for (const auto& s : tensor_slots(p, cfg)) {
        if (!all_finite(s.array())) return false;
    }
    return true;
}

/// to += from, tensor by tensor (same shapes).
template <class Params, class Config>
void add_tensors(const Params& from, Params& to, const Config& cfg) {
    const auto fs = tensor_slots(from, cfg);
    const auto ts = tensor_slots(to, cfg);
    for (std::size_t i = 0; i < fs.size(); ++i) {
        ts[i].array() += fs[i].array();
    }
}

}  // namespace detail

}  // namespace titans
