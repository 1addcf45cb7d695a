#pragma once
// titans/layers/glue.hpp: what the glue kernels of a backend must provide (concept
// GlueBackend): the operations between layers that let a block and a model keep their
// activations in the backend's memory, so data crosses to the host at the model's edge only.

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
///   product_at(a, b, out)      out = aᵀ b (a k x m, b k x n, out m x n, distinct): the head's
///                              gradient
///   product_bt(a, b, out)      out = a bᵀ (a m x k, b n x k, out m x n, distinct): the head's
///                              input gradient
///   cross_entropy(logits, labels, dlogits)   the mean cross-entropy of each row's softmax
///                              against its label (negative: ignored), returned (one scalar
///                              back), its gradient into dlogits (detail::cross_entropy_rows;
///                              labels in host memory, one per row, each < logits.cols,
///                              checked by the caller, copied with the call; logits finite)
///   scatter_add(rows, ids, table)   table row ids[i] += rows row i, i in order (ids: Ids;
///                              repeats add in order): the embedding's gradient
///   scaled_norm(x, parts)      the Euclidean norm of x (1 x n, contiguous) as {scale, sum}:
///                              scale = max |entry| (NaN or inf if an entry is; 0 if all are),
///                              sum = Σ (entry / scale)² in double, the parts (lengths of
///                              consecutive tensors, summing to n) summed in order on the CPU
///                              (detail::scaled_norm); two scalars back: a gradient buffer's
///                              global norm
///   scale(x, factor)           x *= factor, entry by entry: the clipping of a gradient buffer
///   Parts                      AdamW's tensors (detail::AdamWPart: size, decay flag) in B's
///                              memory (movable; size() on the host)
///   upload_parts(parts)        Parts holding a copy of parts (host; one upload): an
///                              optimiser's, once
///   adamw(f, parts, p, g, m, v, p1, m1, v1)   AdamW's step f (detail::AdamWStep) on 1 x n
///                              contiguous views, entry by entry (detail::adamw_update), the
///                              tensors `parts` (Parts, consecutive, sizes summing to n) decayed
///                              where their flag says: p1, m1, v1 the new parameters and
///                              moments, distinct from p, g, m, v and each other; returns
///                              whether every new entry is finite (one scalar back): a model's
///                              optimiser on its parameter buffer (ModelAdamW)
/// The CPU's are the plain loops the layers used on host matrices before, so their results are
/// the same bits; CUDA's are the same operations per entry (the product on cuBLAS).
template <class B, class T>
concept GlueBackend = requires(View<const T> a, View<T> out, std::span<const int> ids,
                               const typename GlueKernels<B, T>::Ids& device_ids,
                               std::span<const std::ptrdiff_t> parts,
                               const detail::AdamWStep<T>& f,
                               std::span<const detail::AdamWPart> tensors,
                               const typename GlueKernels<B, T>::Parts& device_parts) {
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
    GlueKernels<B, T>::product_at(a, a, out);
    GlueKernels<B, T>::product_bt(a, a, out);
    GlueKernels<B, T>::scatter_add(a, device_ids, out);
    { GlueKernels<B, T>::cross_entropy(a, ids, out) } -> std::same_as<double>;
    { GlueKernels<B, T>::scaled_norm(a, parts) } -> std::same_as<std::pair<double, double>>;
    GlueKernels<B, T>::scale(out, T(1));
    { GlueKernels<B, T>::upload_parts(tensors) } -> std::same_as<typename GlueKernels<B, T>::Parts>;
    { device_parts.size() } -> std::convertible_to<std::size_t>;
    { GlueKernels<B, T>::adamw(f, device_parts, a, a, a, a, out, out, out) } -> std::same_as<bool>;
};

}  // namespace titans::backend
