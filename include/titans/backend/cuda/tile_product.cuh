#pragma once
// titans/backend/cuda/tile_product.cuh: a thread block's matrix product C = A B in warp tiles,
// for the fused kernels (memory_fused.cuh).
//
// Each warp takes tiles of (16 MT) x (8 NT) entries of C in turn; a tile is MT x NT pieces of
// 16 x 8, the shape of the tensor cores' instructions (mma.sync m16n8k8 in TF32, m16n8k16 in
// bf16), and a lane owns the same four entries of each piece on every path: rows g and g + 8,
// columns 2q and 2q + 1 (g = lane / 4, q = lane % 4). The operands are read through functors
// a(i, k) and b(k, j) (shared or device memory, transposed or scaled on the way), and a
// finished tile's accumulators go to a tile epilogue, which may gather what its stores need
// first (so that those loads are in flight together) or hand each entry on (each_entry). The
// products' operands (Operands):
//   TF32, float, nvcc:   mma.sync m16n8k8 on the tensor cores, operands rounded to TF32
//                        (cvt.rna: 10-bit mantissa, to nearest, ties away), FP32 sums;
//   BF16, float, nvcc:   mma.sync m16n8k16, operands rounded to bfloat16 (cvt.rn: 7-bit
//                        mantissa, to nearest even), FP32 sums (their products are exact);
//   TF32 or BF16, emulation: the same roundings, FP32 sums in k order (what the tensor cores
//                        compute up to the order of their sums);
//   Exact:               plain FMAs in T (float or double), in k order.
// M must be a multiple of 16 MT, N of 8 NT and K of 8 (16 for BF16; the callers check their
// shapes). Operands read through RoundedRowMajor / RoundedTransposed (RowOperand,
// TransposedOperand) were rounded to TF32 when their tile was stored (tf32_stored): their
// fragments skip the conversion and see the same values.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../config.hpp"
#include "launch.cuh"

// How many k-steps of a block product's loop are unrolled (their operand loads in flight
// together): a build-time tuning knob. 2 by default: 4 fits too (128 registers a thread at 512
// threads a block, no spills on sm_90) but measured 1% slower on an H200 (docs/performance.md).
#ifndef TITANS_TILE_K_UNROLL
#define TITANS_TILE_K_UNROLL 2
#endif

namespace titans::backend::cuda {

#if TITANS_CUDA_DEVICE_CODE

/// x rounded to TF32 as cvt.rna.tf32.f32 does, for x neither infinite nor NaN: two integer
/// instructions, where cvt.rna's guard of those two cases makes three. A NaN's bits may carry
/// into the sign (the GPU's canonical NaN, 0x7fffffff, becomes -0), so a caller keeps NaN
/// some other way (the softmax's weights: their row's sum takes them unrounded).
__device__ inline float round_tf32_finite(float x) {
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    u = (u + 0x1000u) & ~0x1fffu;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

/// x rounded to TF32 as cvt.rna.tf32.f32 does (the low 13 mantissa bits cleared, to nearest,
/// ties away from zero; infinities and NaN unchanged).
__device__ inline float round_tf32(float x) {
#if defined(__CUDA_ARCH__)
    std::uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
#else
    return std::isfinite(x) ? round_tf32_finite(x) : x;
#endif
}

/// x rounded to bfloat16 as cvt.rn.bf16.f32 does (the low 16 bits of the float cleared, to
/// nearest, ties to even; infinities and NaN unchanged), as a float.
__device__ inline float round_bf16(float x) {
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) != 0x7f800000u) {
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    }
    std::memcpy(&x, &u, sizeof x);
    return x;
}

/// The operands of a warp tile's products: Exact (T, plain FMAs), TF32 or BF16 (float on the
/// tensor cores, operands rounded to TF32 or to bfloat16, FP32 sums).
enum class Operands { Exact, TF32, BF16 };

/// TF32 where a kernel's products may use the tensor cores (`tf32`), Exact otherwise.
template <bool TF32>
inline constexpr Operands tf32_or_exact = TF32 ? Operands::TF32 : Operands::Exact;

/// The k-step of a tile product on operands P: 16 for BF16 (an m16n8k16 instruction), else 8.
template <Operands P>
inline constexpr int k_step = P == Operands::BF16 ? 16 : 8;

/// An operand entry as products on operands P see it.
template <class T, Operands P>
__device__ inline T operand(T x) {
    if constexpr (P == Operands::TF32) {
        return round_tf32(x);
    } else if constexpr (P == Operands::BF16) {
        return round_bf16(x);
    } else {
        return x;
    }
}

/// Which k a lane's fragment slots hold in a k-step of 8 (slots q and q + 4, q = lane % 4):
/// Split, k0 + q and k0 + q + 4 (the instruction's own order); Pair, k0 + 2q and k0 + 2q + 1,
/// adjacent, so that an operand with a pair() accessor (RowMajor, Transposed) loads both in
/// one access. With shared rows padded to 8 mod 32 entries, row-major pairs (Pair) and k-major
/// entries (Split) are read without bank conflicts. The tensor cores sum the 8 products of a
/// k-step at once, so the order is free as long as both operands follow it.
enum class KOrder { Split, Pair };

template <KOrder O>
TITANS_HOST_DEVICE constexpr int slot_k(int k0, int q, int half) {
    return O == KOrder::Split ? k0 + q + 4 * half : k0 + 2 * q + half;
}

/// Two adjacent entries of an operand (p[0], p[1]).
template <class T>
struct EntryPair {
    T x, y;
};

/// p[0], p[1] in one 8-byte (float) or 16-byte (double) access on the GPU (p aligned to it).
template <class T>
__device__ inline EntryPair<T> load_pair(const T* p) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) {
        const float2 v = *reinterpret_cast<const float2*>(p);
        return {v.x, v.y};
    } else {
        const double2 v = *reinterpret_cast<const double2*>(p);
        return {v.x, v.y};
    }
#else
    return {p[0], p[1]};
#endif
}

/// p[0] = x, p[1] = y in one access on the GPU (p aligned as for load_pair).
template <class T>
__device__ inline void store_pair(T* p, T x, T y) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(x, y);
    } else {
        *reinterpret_cast<double2*>(p) = make_double2(x, y);
    }
#else
    p[0] = x;
    p[1] = y;
#endif
}

/// The 16 bytes at p (16-byte aligned) as entries of T, in one access on the GPU (entry by
/// entry on the host, where the tests read FragmentRows).
template <class T>
TITANS_HOST_DEVICE void load_16_bytes(const T* p, T (&x)[16 / sizeof(T)]) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) {
        const float4 v = *reinterpret_cast<const float4*>(p);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else {
        const double2 v = *reinterpret_cast<const double2*>(p);
        x[0] = v.x, x[1] = v.y;
    }
#else
    for (std::size_t e = 0; e < 16 / sizeof(T); ++e) {
        x[e] = p[e];
    }
#endif
}

/// x into the 16 bytes at p (16-byte aligned), in one access on the GPU.
template <class T>
TITANS_HOST_DEVICE void store_16_bytes(T* p, const T (&x)[16 / sizeof(T)]) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
    } else {
        *reinterpret_cast<double2*>(p) = make_double2(x[0], x[1]);
    }
#else
    for (std::size_t e = 0; e < 16 / sizeof(T); ++e) {
        p[e] = x[e];
    }
#endif
}

/// An operand m(r, k) = p[r ld + k] (row-major), whose pairs (r, k), (r, k + 1) are one access
/// in the KOrder::Pair fragments (ld and k even).
template <class T>
struct RowMajor {
    const T* p;
    int ld;
    __device__ T operator()(int r, int k) const { return p[r * ld + k]; }
    __device__ EntryPair<T> pair(int r, int k) const { return load_pair(p + r * ld + k); }
};

/// An operand m(k, c) = p[c ld + k] (a row-major matrix transposed), whose pairs (k, c),
/// (k + 1, c) are one access in the KOrder::Pair fragments (ld and k even).
template <class T>
struct Transposed {
    const T* p;
    int ld;
    __device__ T operator()(int k, int c) const { return p[c * ld + k]; }
    __device__ EntryPair<T> pair(int k, int c) const { return load_pair(p + c * ld + k); }
};

/// RowMajor and Transposed over entries the caller stored already rounded to TF32 (a tile
/// loaded into shared memory once and read by several warps or k-steps): their fragments skip
/// the conversion, the values the same.
template <class T>
struct RoundedRowMajor : RowMajor<T> {
    static constexpr bool rounded = true;
};
template <class T>
struct RoundedTransposed : Transposed<T> {
    static constexpr bool rounded = true;
};

/// Four entries of an operand, in a lane's fragment slot order.
template <class T>
struct EntryQuad {
    T x[4];
};

/// A 16-row A operand, its entries already TF32, stored in the order fragments in KOrder O
/// take them: for each k-step of 8, lane (g, q)'s four entries (rows g and g + 8 at the lane's
/// two k slots, slot_k<O>(k0, q, 0) and (.., 1): fragment slots 0-3) in 16 consecutive bytes,
/// the warp's 32 lanes one after another. So a lane's A fragment is one 16-byte load (quad), a
/// warp's 512 consecutive bytes, where a row-major tile takes four 4-byte loads (Split) or two
/// 8-byte loads whose halves the instruction wants interleaved (Pair: four register moves).
/// m(r, k) for r in [0, 16); at(r, k) its entry's place.
template <class T, KOrder O>
struct FragmentRows {
    static constexpr bool rounded = true;
    static constexpr KOrder order = O;
    const T* p;
    TITANS_HOST_DEVICE static constexpr int at(int r, int k) {
        const int q = O == KOrder::Pair ? (k & 7) >> 1 : k & 3;  // the lane's q, its slot half
        const int half = O == KOrder::Pair ? k & 1 : (k >> 2) & 1;
        return ((k >> 3) * 32 + (r & 7) * 4 + q) * 4 + (r >> 3) + 2 * half;
    }
    TITANS_HOST_DEVICE T operator()(int r, int k) const { return p[at(r, k)]; }
    /// Slots 0-3 of the fragment of row r (< 8) at its first k slot k: m(r, k), m(r + 8, k),
    /// m(r, kh), m(r + 8, kh), kh the second slot; one 16-byte access on the GPU.
    TITANS_HOST_DEVICE EntryQuad<T> quad(int r, int k) const {
        static_assert(sizeof(T) == 4, "TF32 operands: four entries in 16 bytes");
        EntryQuad<T> v;
        load_16_bytes(p + at(r, k), v.x);
        return v;
    }
};

/// Whether operand functor F's entries are already TF32 (F::rounded).
template <class F>
inline constexpr bool pre_rounded = requires { F::rounded; };

/// The operand functor a kernel reads a shared tile through: Rounded* where TF32 products read
/// a tile its loads rounded (tf32_stored), the plain one otherwise.
template <class T, bool TF32>
using RowOperand = std::conditional_t<TF32 && sizeof(T) == 4, RoundedRowMajor<T>, RowMajor<T>>;
template <class T, bool TF32>
using TransposedOperand =
    std::conditional_t<TF32 && sizeof(T) == 4, RoundedTransposed<T>, Transposed<T>>;

/// An operand functor Op (RowOperand, TransposedOperand) over p with leading dimension ld.
template <class Op, class T>
__device__ inline Op operand_at(const T* p, int ld) {
    if constexpr (pre_rounded<Op>) {
        return Op{{p, ld}};
    } else {
        return Op{p, ld};
    }
}

/// x as a tile of TF32 products stores it: rounded to TF32 (float with TF32), else x. Finite:
/// x is known to be neither infinite nor NaN, or its NaN is kept some other way
/// (round_tf32_finite).
template <class T, bool TF32, bool Finite = false>
__device__ inline T tf32_stored(T x) {
    if constexpr (TF32 && sizeof(T) == 4) {
        return Finite ? round_tf32_finite(x) : round_tf32(x);
    } else {
        return x;
    }
}

#if defined(__CUDA_ARCH__)

/// An operand entry's bits for a fragment on operands P: converted to TF32 unless F's
/// entries already are; for BF16 the float's bits (rounded when a pair is packed: bf16_pair).
template <Operands P, class F>
__device__ inline std::uint32_t fragment_bits(float x) {
    if constexpr (P == Operands::BF16 || pre_rounded<F>) {
        return __float_as_uint(x);
    } else {
        return __float_as_uint(round_tf32(x));
    }
}

/// The A fragments of a warp tile's MT pieces for the k-step of 8 at k0 (rows i + 16 mi (+ 8)).
template <KOrder O, Operands P, int MT, class FA>
__device__ inline void fragment_a(std::uint32_t (&af)[MT][4], const FA& a, int i, int k0, int q) {
    const int k = slot_k<O>(k0, q, 0), kh = slot_k<O>(k0, q, 1);
    if constexpr (requires(const FA& x) { x.quad(0, 0); }) {
        static_assert(MT == 1 && FA::order == O, "a FragmentRows operand: one piece, its order");
        const EntryQuad<float> v = a.quad(i, k);
        TITANS_UNROLL
        for (int s = 0; s < 4; ++s) {
            af[0][s] = fragment_bits<P, FA>(v.x[s]);
        }
    } else if constexpr (O == KOrder::Pair && requires(const FA& x) { x.pair(0, 0); }) {
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            const EntryPair<float> lo = a.pair(i + 16 * mi, k), hi = a.pair(i + 16 * mi + 8, k);
            af[mi][0] = fragment_bits<P, FA>(lo.x);
            af[mi][1] = fragment_bits<P, FA>(hi.x);
            af[mi][2] = fragment_bits<P, FA>(lo.y);
            af[mi][3] = fragment_bits<P, FA>(hi.y);
        }
    } else {
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            const int r = i + 16 * mi;
            af[mi][0] = fragment_bits<P, FA>(a(r, k));
            af[mi][1] = fragment_bits<P, FA>(a(r + 8, k));
            af[mi][2] = fragment_bits<P, FA>(a(r, kh));
            af[mi][3] = fragment_bits<P, FA>(a(r + 8, kh));
        }
    }
}

/// The B fragments of a warp tile's NT pieces for the k-step of 8 at k0 (column j + 8 ni).
template <KOrder O, Operands P, int NT, class FB>
__device__ inline void fragment_b(std::uint32_t (&bf)[NT][2], const FB& b, int j, int k0, int q) {
    const int k = slot_k<O>(k0, q, 0), kh = slot_k<O>(k0, q, 1);
    if constexpr (O == KOrder::Pair && requires(const FB& x) { x.pair(0, 0); }) {
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            const EntryPair<float> v = b.pair(k, j + 8 * ni);
            bf[ni][0] = fragment_bits<P, FB>(v.x);
            bf[ni][1] = fragment_bits<P, FB>(v.y);
        }
    } else {
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            bf[ni][0] = fragment_bits<P, FB>(b(k, j + 8 * ni));
            bf[ni][1] = fragment_bits<P, FB>(b(kh, j + 8 * ni));
        }
    }
}

/// Two floats' bits rounded to bfloat16 and packed into one register, lo in the low half (the
/// fragment's lower slot): cvt.rn.bf16x2.f32 puts its first source in the high half.
__device__ inline std::uint32_t bf16_pair(std::uint32_t lo, std::uint32_t hi) {
    std::uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;"
        : "=r"(r)
        : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));
    return r;
}

/// acc += A B for the fragments of one k-step: S = k_step<P> / 8 steps of 8 (fragment_a,
/// fragment_b). TF32 (S = 1): mma.sync m16n8k8. BF16 (S = 2): mma.sync m16n8k16, its lane's k
/// slots 2q, 2q + 1 (+ 8) taken from the two steps' slots q, q + 4 (any k order both operands
/// share gives the same sum), FP32 sums. Not volatile: the compiler may move the next k-step's
/// loads above these.
template <Operands P, int S, int MT, int NT>
__device__ inline void fragment_mma(float (&acc)[MT][NT][4], const std::uint32_t (&af)[S][MT][4],
                                    const std::uint32_t (&bf)[S][NT][2]) {
    static_assert(S == k_step<P> / 8 && P != Operands::Exact, "one instruction's k-steps");
    if constexpr (P == Operands::TF32) {
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            TITANS_UNROLL
            for (int ni = 0; ni < NT; ++ni) {
                float(&c)[4] = acc[mi][ni];
                asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
                    "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                    : "r"(af[0][mi][0]), "r"(af[0][mi][1]), "r"(af[0][mi][2]), "r"(af[0][mi][3]),
                      "r"(bf[0][ni][0]), "r"(bf[0][ni][1]));
            }
        }
    } else {
        std::uint32_t pa[MT][4], pb[NT][2];
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            TITANS_UNROLL
            for (int s = 0; s < 2; ++s) {  // rows g, g + 8 of k slots 2q, 2q + 1, then + 8
                pa[mi][2 * s] = bf16_pair(af[s][mi][0], af[s][mi][2]);
                pa[mi][2 * s + 1] = bf16_pair(af[s][mi][1], af[s][mi][3]);
            }
        }
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            pb[ni][0] = bf16_pair(bf[0][ni][0], bf[0][ni][1]);
            pb[ni][1] = bf16_pair(bf[1][ni][0], bf[1][ni][1]);
        }
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            TITANS_UNROLL
            for (int ni = 0; ni < NT; ++ni) {
                float(&c)[4] = acc[mi][ni];
                asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                    "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                    : "r"(pa[mi][0]), "r"(pa[mi][1]), "r"(pa[mi][2]), "r"(pa[mi][3]),
                      "r"(pb[ni][0]), "r"(pb[ni][1]));
            }
        }
    }
}

#endif

/// The lane's B entries of row k on the FMA path: bv[ni] = b(k, j0 + 8 ni), b(k, j0 + 8 ni + 1),
/// as products on operands P see them.
template <class T, Operands P, int NT, class FB>
__device__ inline void lane_b_row(T (&bv)[NT][2], const FB& b, int k, int j0) {
    TITANS_UNROLL
    for (int ni = 0; ni < NT; ++ni) {
        bv[ni][0] = operand<T, P>(b(k, j0 + 8 * ni));
        bv[ni][1] = operand<T, P>(b(k, j0 + 8 * ni + 1));
    }
}

/// acc[ni] += (a0, a1)^T bv[ni] on the FMA path: the lane's rows g (a0) and g + 8 (a1) of one k.
template <class T, int NT>
__device__ inline void lane_fma(T (&acc)[NT][4], T a0, T a1, const T (&bv)[NT][2]) {
    TITANS_UNROLL
    for (int ni = 0; ni < NT; ++ni) {
        acc[ni][0] += a0 * bv[ni][0];
        acc[ni][1] += a0 * bv[ni][1];
        acc[ni][2] += a1 * bv[ni][0];
        acc[ni][3] += a1 * bv[ni][1];
    }
}

/// One k-step (k_step<P>: 8, or 16 for BF16) for a warp's tile: acc[mi][ni][2h + c] +=
/// sum_k a(r, k) b(k, col), the lane's rows r = i + 16 mi + 8 h and columns
/// col = j + 8 ni + 2q + c (i = tile row + g, j = tile column), k in [k0, k0 + k_step<P>) (on
/// the tensor cores, in the order O).
template <class T, Operands P, int MT, int NT, KOrder O = KOrder::Split, class FA, class FB>
__device__ inline void tile_step(T (&acc)[MT][NT][4], const FA& a, const FB& b, int i, int j,
                                 int k0, int g, int q) {
    static_assert(P == Operands::Exact || sizeof(T) == 4, "tensor-core products are for float");
#if defined(__CUDA_ARCH__)
    if constexpr (P != Operands::Exact) {
        constexpr int S = k_step<P> / 8;
        std::uint32_t af[S][MT][4], bf[S][NT][2];
        TITANS_UNROLL
        for (int s = 0; s < S; ++s) {
            fragment_a<O, P>(af[s], a, i, k0 + 8 * s, q);
            fragment_b<O, P>(bf[s], b, j, k0 + 8 * s, q);
        }
        fragment_mma<P>(acc, af, bf);
        return;
    }
#endif
    const int j0 = j - g + 2 * q;  // the lane's first column of piece 0
    TITANS_UNROLL
    for (int kk = 0; kk < k_step<P>; ++kk) {
        const int k = k0 + kk;
        T bv[NT][2];
        lane_b_row<T, P>(bv, b, k, j0);
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            const T a0 = operand<T, P>(a(i + 16 * mi, k));
            lane_fma(acc[mi], a0, operand<T, P>(a(i + 16 * mi + 8, k)), bv);
        }
    }
}

/// One k-step of 8 for a warp's tile whose A operand the lane holds in registers, as a
/// product's result left it: acc[0][ni][2h + c] += sum_k A(g + 8h, k) b(k, col) over k in
/// [k0, k0 + 8), col = j + 8 ni + 2q + c - g, where `held` is the lane's four entries of A's
/// 16 x 8 piece at k0 in tile_step's accumulator layout (held[2h + c] = A(g + 8h, k0 + 2q + c)).
/// So a softmax's P (or an adjoint's dS) goes from one product to the next without a trip
/// through shared memory (flash-attention 2's way). On the tensor cores (TF32, held rounded to
/// TF32 by the caller) the held entries are the A fragment in KOrder::Pair's order, as they
/// are, and b is read in that order; elsewhere (FMAs, and the CPU emulation of CUDA) each k's
/// entries come from the lane of the quad that holds them (shuffles), summed in k order as
/// tile_step does. Every lane of the warp calls it.
template <class T, Operands P, int NT, class FB>
__device__ inline void tile_step_held(T (&acc)[1][NT][4], const T (&held)[4], const FB& b, int j,
                                      int k0, int g, int q) {
    static_assert(P != Operands::BF16, "held operands are TF32 or exact");
    static_assert(P == Operands::Exact || sizeof(T) == 4, "tensor-core products are for float");
#if defined(__CUDA_ARCH__)
    if constexpr (P == Operands::TF32) {
        const std::uint32_t af[1][1][4] = {{{__float_as_uint(held[0]), __float_as_uint(held[2]),
                                             __float_as_uint(held[1]), __float_as_uint(held[3])}}};
        std::uint32_t bf[1][NT][2];
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            bf[0][ni][0] = fragment_bits<P, FB>(b(k0 + 2 * q, j + 8 * ni));
            bf[0][ni][1] = fragment_bits<P, FB>(b(k0 + 2 * q + 1, j + 8 * ni));
        }
        fragment_mma<P>(acc, af, bf);
        return;
    }
#endif
    const int j0 = j - g + 2 * q;  // the lane's first column of piece 0
    const int quad = static_cast<int>(threadIdx.x % 32) & ~3;
    TITANS_PRAGMA(unroll 1)  // one k's operands live at a time (held entries picked, not indexed)
    for (int kk = 0; kk < 8; ++kk) {
        T bv[NT][2];
        lane_b_row<T, P>(bv, b, k0 + kk, j0);
        const bool odd = (kk & 1) != 0;
        const int from = quad + kk / 2;
        const T a0 = operand<T, P>(__shfl_sync(0xffffffffu, odd ? held[1] : held[0], from));
        const T a1 = operand<T, P>(__shfl_sync(0xffffffffu, odd ? held[3] : held[2], from));
        lane_fma(acc[0], a0, a1, bv);
    }
}

/// A warp tile's accumulators set to zero.
template <class T, int MT, int NT>
__device__ inline void tile_zero(T (&acc)[MT][NT][4]) {
    TITANS_UNROLL
    for (int mi = 0; mi < MT; ++mi) {
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = T(0);
        }
    }
}

/// A warp tile's entries to the epilogue: the lane's rows i + 16 mi (+ 8), columns
/// j0 + 8 ni (+ 1).
template <class T, int MT, int NT, class FE>
__device__ inline void tile_store(const T (&acc)[MT][NT][4], int i, int j0, const FE& e) {
    TITANS_UNROLL
    for (int mi = 0; mi < MT; ++mi) {
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            const int r = i + 16 * mi, c = j0 + 8 * ni;
            e(r, c, acc[mi][ni][0]);
            e(r, c + 1, acc[mi][ni][1]);
            e(r + 8, c, acc[mi][ni][2]);
            e(r + 8, c + 1, acc[mi][ni][3]);
        }
    }
}

/// The lane's entries of a warp tile, f(r, c) for each (as tile_store visits them): values
/// gathered before the stores that need them, so that their loads are in flight together.
template <class T, int MT, int NT, class F>
__device__ inline void tile_gather(T (&out)[MT][NT][4], int i, int j0, const F& f) {
    TITANS_UNROLL
    for (int mi = 0; mi < MT; ++mi) {
        TITANS_UNROLL
        for (int ni = 0; ni < NT; ++ni) {
            const int r = i + 16 * mi, c = j0 + 8 * ni;
            out[mi][ni][0] = f(r, c);
            out[mi][ni][1] = f(r, c + 1);
            out[mi][ni][2] = f(r + 8, c);
            out[mi][ni][3] = f(r + 8, c + 1);
        }
    }
}

/// A pair-wise epilogue e(i, j, value at j, value at j + 1) (j even) as a tile epilogue.
template <class FE>
__device__ inline auto each_pair(const FE& e) {
    return [&e](const auto& acc, int i, int j0) {
        constexpr int MT =
            static_cast<int>(std::extent_v<std::remove_reference_t<decltype(acc)>, 0>);
        constexpr int NT =
            static_cast<int>(std::extent_v<std::remove_reference_t<decltype(acc)>, 1>);
        TITANS_UNROLL
        for (int mi = 0; mi < MT; ++mi) {
            TITANS_UNROLL
            for (int ni = 0; ni < NT; ++ni) {
                e(i + 16 * mi, j0 + 8 * ni, acc[mi][ni][0], acc[mi][ni][1]);
                e(i + 16 * mi + 8, j0 + 8 * ni, acc[mi][ni][2], acc[mi][ni][3]);
            }
        }
    };
}

/// An entry-wise epilogue e(i, j, value) as a tile epilogue (block_product's).
template <class FE>
__device__ inline auto each_entry(const FE& e) {
    return [&e](const auto& acc, int i, int j0) { tile_store(acc, i, j0, e); };
}

/// C (M x N) = A (M x K) B (K x N) by the block's warps, a warp tile at a time: its
/// accumulators go to the tile epilogue ft(acc, i, j0) (the lane's rows i + 16 mi (+ 8),
/// columns j0 + 8 ni (+ 1); each_entry(e) for an entry-wise one). The block's threads must all
/// call it (blockDim.x a multiple of 32); it has no barrier.
template <class T, Operands P, int MT, int NT, KOrder O = KOrder::Split, class FA, class FB,
          class FT>
__device__ void block_product(int M, int N, int K, const FA& a, const FB& b, const FT& ft) {
    const int warp = static_cast<int>(threadIdx.x / 32), warps = static_cast<int>(blockDim.x / 32);
    const int lane = static_cast<int>(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    const int tiles_n = N / (8 * NT), tiles = (M / (16 * MT)) * tiles_n;
    for (int tile = warp; tile < tiles; tile += warps) {
        const int i = tile / tiles_n * 16 * MT + g, j = tile % tiles_n * 8 * NT + g;
        T acc[MT][NT][4];
        tile_zero(acc);
        TITANS_PRAGMA(unroll TITANS_TILE_K_UNROLL)
        for (int k0 = 0; k0 < K; k0 += k_step<P>) {
            tile_step<T, P, MT, NT, O>(acc, a, b, i, j, k0, g, q);
        }
        ft(acc, i, j - g + 2 * q);
    }
}

#endif

}  // namespace titans::backend::cuda
