#pragma once
// titans/layers/glue.hpp: what the glue kernels of a backend must provide (concept
// GlueBackend): the operations between layers that let a block and a model keep their
// activations in the backend's memory, so data crosses to the host at the model's edge only.

#include <array>
#include <concepts>
#include <cstddef>
#include <span>
#include <utility>

#include "../detail/adamw_update.hpp"
#include "../view.hpp"
#include "kernels_decl.hpp"

namespace titans::backend {

/// What GlueKernels<B, T> must provide, every view in B's memory and every shape checked by
/// the caller (a block or a model):
///   copy(from, to)             to = from (same shape, distinct)
///   add(a, b, out)             out = a + b, element-wise (out may be a or b)
///   gate(y, m, out)            out = y ⊙ σ(m), element-wise (out may be y or m): MAG's gate
///                              and MAC's output (math §7)
///   gate_backward(dout, a, m, da, dm)   the adjoint of out = a ⊙ σ(m): da = dout ⊙ σ(m),
///                              dm = dout ⊙ a ⊙ σ(m) ⊙ (1 - σ(m)) (da, dm distinct from the
///                              inputs and each other)
///   fill(to, value)            every entry of to = value
///   copy_rows(from, to, r)     the row blocks r (RowBlocks) of from copied into to's (to's
///                              blocks disjoint, distinct from from)
///   add_rows(from, to, r)      to's row blocks += from's, block 0 first (to's blocks disjoint
///                              or, with to_step 0, the same rows: a sum over blocks in order)
///   nonfinite_row(x)           the first row of x holding a NaN or an infinity, -1 if none
///                              (one scalar back to the host: how a block names the row of
///                              an overflow without downloading its activations)
///   Ids                        token ids in B's memory (movable, copyable; size() on the
///                              host): what gather and scatter_add read
///   upload_ids(ids)            Ids holding a copy of ids (host memory, each checked by the
///                              caller; one upload): a training forward keeps them for the
///                              backward's scatter_add
///   gather(table, ids, out)    out row i = table row ids[i] (ids: Ids, each in
///                              [0, table.rows)): the embedding of token ids
///   product(x, w, out)         out = x w (x rows x k, w k x n, out rows x n, out distinct from
///                              x and w): the model's head
///   product_plain(x, w, out)   out = x w as product does, rounded as a whole-matrix product
///                              on the CPU (Eigen's, not the few-row kernel): MAC's P W_K,
///                              P W_V, computed once per parameter set
///   product_at(a, b, out)      out = aᵀ b (a k x m, b k x n, out m x n, distinct): the head's
///                              gradient
///   product_bt(a, b, out)      out = a bᵀ (a m x k, b n x k, out m x n, distinct): the head's
///                              input gradient
///   Scalars                    a few doubles in B's memory (scalar_slots of them; movable):
///                              where the kernels below leave their results, so that the host
///                              reads a training step's loss, norm and AdamW's verdict at once
///   make_scalars()             Scalars, every slot 0
///   read(scalars)              ScalarValues, every slot (one download)
///   cross_entropy(logits, labels, dlogits, s, slot)   the mean cross-entropy of each row's
///                              softmax against its label (negative: ignored; 0 if none is
///                              scored) into slot `slot` of s, its gradient into dlogits
///                              (detail::cross_entropy_rows; labels in host memory, one per
///                              row, each < logits.cols, checked by the caller, copied with the
///                              call; logits finite)
///   scatter_add(rows, ids, table)   table row ids[i] += rows row i, i in order (ids: Ids;
///                              repeats add in order): the embedding's gradient
///   clip(x, parts, max_norm, s, slot)   the Euclidean norm of x (1 x n, contiguous) into
///                              slot `slot` of s: scale * sqrt(sum), scale = max |entry| (0 if
///                              all are 0, the norm then 0; NaN or inf, the norm then that, if
///                              an entry is), sum = Σ (entry / scale)² in double, the parts
///                              (lengths of consecutive tensors, summing to n) summed in order
///                              on the CPU (detail::scaled_norm); then, if max_norm > 0 and the
///                              norm is finite and above it, x *= T(max_norm / norm): a
///                              gradient buffer's global norm and clipping, with no scalar back
///   scale(x, factor)           x *= factor, entry by entry
///   Parts                      AdamW's tensors (detail::AdamWPart: size, decay flag) in B's
///                              memory (movable; size() on the host)
///   upload_parts(parts)        Parts holding a copy of parts (host; one upload): an
///                              optimiser's, once
///   adamw(f, parts, p, g, m, v, p1, m1, v1, s, slot)   AdamW's step f (detail::AdamWStep) on 1 x n
///                              contiguous views, entry by entry (detail::adamw_update), the
///                              tensors `parts` (Parts, consecutive, sizes summing to n) decayed
///                              where their flag says: p1, m1, v1 the new parameters and
///                              moments, distinct from p, g, m, v and each other; slot `slot`
///                              of s = 1 if every new entry is finite, else 0: a model's
///                              optimiser on its parameter buffer (ModelAdamW)
/// Optional: CallScope, what a model's forward call runs in on B (CUDA's: every layer on one
/// stream without waiting, the finiteness checks deferred to one device flag, flagged() read
/// at the call's edge, CallScope(false) a strict scope; backend/cuda/call_scope.cuh). A
/// backend without one runs every check at its place (CallScopeOf: NoCallScope). Also
/// optional: add_checked(a, b, out), a sum and its check in one kernel (add_nonfinite_row
/// falls back to add and nonfinite_row), and Covered, what a block holds around a sub-layer
/// whose output a later check covers (CoveredOf: NotCovered).
/// The CPU's are the plain loops the layers used on host matrices before, so their results are
/// the same bits; CUDA's are the same operations per entry (the product on cuBLAS).
/// How many doubles GlueKernels' Scalars hold, and what read() returns.
inline constexpr std::size_t scalar_slots = 4;
using ScalarValues = std::array<double, scalar_slots>;

template <class B, class T>
concept GlueBackend = requires(View<const T> a, View<T> out, std::span<const int> ids,
                               const typename GlueKernels<B, T>::Ids& device_ids,
                               std::span<const std::ptrdiff_t> parts,
                               const detail::AdamWStep<T>& f,
                               std::span<const detail::AdamWPart> tensors,
                               const typename GlueKernels<B, T>::Parts& device_parts,
                               typename GlueKernels<B, T>::Scalars& scalars) {
    GlueKernels<B, T>::copy(a, out);
    GlueKernels<B, T>::add(a, a, out);
    GlueKernels<B, T>::gate(a, a, out);
    GlueKernels<B, T>::gate_backward(a, a, a, out, out);
    GlueKernels<B, T>::fill(out, T(0));
    GlueKernels<B, T>::copy_rows(a, out, RowBlocks{});
    GlueKernels<B, T>::add_rows(a, out, RowBlocks{});
    { GlueKernels<B, T>::nonfinite_row(a) } -> std::same_as<std::ptrdiff_t>;
    { GlueKernels<B, T>::upload_ids(ids) } -> std::same_as<typename GlueKernels<B, T>::Ids>;
    { device_ids.size() } -> std::convertible_to<std::size_t>;
    GlueKernels<B, T>::gather(a, device_ids, out);
    GlueKernels<B, T>::product(a, a, out);
    GlueKernels<B, T>::product_plain(a, a, out);
    GlueKernels<B, T>::product_at(a, a, out);
    GlueKernels<B, T>::product_bt(a, a, out);
    GlueKernels<B, T>::scatter_add(a, device_ids, out);
    { GlueKernels<B, T>::make_scalars() } -> std::same_as<typename GlueKernels<B, T>::Scalars>;
    { GlueKernels<B, T>::read(std::as_const(scalars)) } -> std::same_as<ScalarValues>;
    GlueKernels<B, T>::cross_entropy(a, ids, out, scalars, 0);
    GlueKernels<B, T>::clip(out, parts, 1.0, scalars, 0);
    GlueKernels<B, T>::scale(out, T(1));
    { GlueKernels<B, T>::upload_parts(tensors) } -> std::same_as<typename GlueKernels<B, T>::Parts>;
    { device_parts.size() } -> std::convertible_to<std::size_t>;
    GlueKernels<B, T>::adamw(f, device_parts, a, a, a, a, out, out, out, scalars, 0);
};

/// The call scope of a backend whose glue has none: every check already ran at its place.
struct NoCallScope {
    explicit NoCallScope(bool = true) {}
    [[nodiscard]] bool flagged() const { return false; }
};
/// The settled() of a call run in no scope or a strict one: its checks all ran at their place.
struct AllChecked {
    bool operator()() const { return true; }
};
/// Whether this thread's call runs with its finiteness checks deferred (G::deferring(), where
/// the glue G has a CallScope; else false). A layer may then skip a check that a later one of
/// the same call covers (a non-finite entry stays non-finite through the sums after it): the
/// scope's flag is raised either way, and the strict rerun names the first failing check.
template <class G>
bool checks_deferred() {
    if constexpr (requires { G::deferring(); }) {
        return G::deferring();
    } else {
        return false;
    }
}

/// out = a + b (G::add's bits), then the first row of out holding a NaN or an infinity, -1 if
/// none (G::nonfinite_row: inside a deferring scope -1, the check deferred): in one kernel
/// where the glue G has it (G::add_checked), else the two calls. How a block takes its last
/// residual sum and its output's check.
template <class G, class T>
std::ptrdiff_t add_nonfinite_row(View<const T> a, View<const T> b, View<T> out) {
    if constexpr (requires { G::add_checked(a, b, out); }) {
        return G::add_checked(a, b, out);
    } else {
        G::add(a, b, out);
        return G::nonfinite_row(View<const T>(out));
    }
}

/// What a block holds around a sub-layer whose output a later check of the same call covers:
/// G::Covered where the glue G has one (CUDA's: inside a deferring scope the attention skips
/// its output's check), else nothing.
struct NotCovered {};
template <class G>
struct CoveredOf {
    using type = NotCovered;
};
template <class G>
    requires requires { typename G::Covered; }
struct CoveredOf<G> {
    using type = typename G::Covered;
};

/// G::CallScope where the glue G has one, else NoCallScope.
template <class G>
struct CallScopeOf {
    using type = NoCallScope;
};
template <class G>
    requires requires { typename G::CallScope; }
struct CallScopeOf<G> {
    using type = typename G::CallScope;
};

}  // namespace titans::backend
