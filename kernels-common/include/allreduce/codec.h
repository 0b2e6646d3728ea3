// The block codecs of the quantized all-reduce on the GPU: FP8 E4M3, Q8, Q6, Q4 and the adaptive
// Q8a/Q6a/Q4a, written once for nvcc and HIP clang. The format is docs/codecs.md; the
// specification is the Rust reference (crates/core/src/codec), and every function here says
// which reference function it must match bit for bit.
//
// Work shape: a group of 32 / N consecutive lanes codes one 32-element block, N elements per
// lane; lane q of the group holds block elements Nq..Nq+N-1. The functions are templated on N
// (deduced from their arrays):
//   N = 8, a "quad" of 4 lanes, one 16-byte vector of f16/bf16 per lane: the all-reduce
//     kernels' shape (many blocks in flight, few registers). Block-wide steps (the max, the
//     Hadamard stages h = 8 and 16, the absolute sums) cross lanes with xor-1 / xor-2
//     shuffles, which stay inside the quad on 32- and 64-lane warps alike.
//   N = 32, one lane per block: no shuffles at all, and the per-block scalar work (scale,
//     reciprocal) is done once instead of by four lanes. More registers; the segment kernels
//     use it where it pays (quantized.h, EncodeShape).
// The arithmetic and its order are the same for every N: each lane keeps groups of 8
// elements, and the cross-lane steps of N = 8 are the in-lane steps of N = 32.
//
// Every lane of a warp must call the group functions together (they may shuffle), so nothing
// here branches around a shuffle: the adaptive candidate is always computed and then selected.
#pragma once

#include "allreduce/shim.h"

namespace ar {

constexpr int kBlock = 32;
constexpr int kQuad = 4;
constexpr int kPerLane = kBlock / kQuad;  // 8
constexpr uint16_t kFlagBit = 1;
constexpr uint16_t kPoisonScale = 0x7FC0;
constexpr uint32_t kHadamardSigns = 0x6A09E667u;
constexpr float kAdaptiveRestWeight = 0.75f;  // codec::ADAPTIVE_REST_WEIGHT

// ---- Arithmetic the format pins down (docs/codecs.md, "Arithmetic rules") -------------------

// One correctly rounded f32 operation each, never fused with a neighbour into an FMA: the
// adaptive encoder's absolute sum and forward transform round in a specified order.
#if AR_HIP
AR_DEVICE float add_rn(float a, float b) {
#pragma clang fp contract(off)
  return a + b;
}
AR_DEVICE float sub_rn(float a, float b) {
#pragma clang fp contract(off)
  return a - b;
}
AR_DEVICE float mul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
// HIP clang's f32 division is correctly rounded by default (-fhip-fp32-correctly-rounded-
// divide-sqrt); build-support never passes fast-math.
AR_DEVICE float div_rn(float a, float b) { return a / b; }
AR_DEVICE float fma_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
AR_DEVICE float add_rn(float a, float b) { return __fadd_rn(a, b); }
AR_DEVICE float sub_rn(float a, float b) { return __fsub_rn(a, b); }
AR_DEVICE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
AR_DEVICE float div_rn(float a, float b) { return __fdiv_rn(a, b); }
AR_DEVICE float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#endif

// RN(1 / s), the same value as div_rn(1.0f, s): CUDA's correctly rounded reciprocal skips the
// division's general numerator path.
#if AR_HIP
AR_DEVICE float rcp_rn(float s) { return div_rn(1.0f, s); }
#else
AR_DEVICE float rcp_rn(float s) { return __frcp_rn(s); }
#endif

// |x| as the FP operand modifier (a compare or min/max takes it for free), not an integer AND.
#if AR_HIP
AR_DEVICE float abs_f(float x) { return __builtin_fabsf(x); }
#else
AR_DEVICE float abs_f(float x) { return fabsf(x); }
#endif
AR_DEVICE bool is_finite_f(float x) { return (as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// codec::round_scale of a value known not to be NaN, as the f32 bits of scale_value of the
// field (the field is the top 16 bits): nearest-even at f32 bit 17, flag bit clear.
AR_DEVICE uint32_t round_scale_bits(float s) {
  const uint32_t b = as_uint(s);
  return (b + 0xFFFFu + ((b >> 17) & 1u)) & 0xFFFE0000u;
}

// codec::round_scale.
AR_DEVICE uint16_t round_scale(float s) {
  if (s != s) return kPoisonScale;
  return static_cast<uint16_t>(round_scale_bits(s) >> 16);
}

// codec::scale_value.
AR_DEVICE float scale_value(uint16_t field) {
  return as_float(uint32_t(field & ~kFlagBit) << 16);
}

// codec::rne_small: nearest-even to an integer for |y| <= 2^22, one add and one subtract.
AR_DEVICE float rne_small(float y) {
  const float kMagic = 12582912.0f;  // 1.5 * 2^23
  return sub_rn(add_rn(y, kMagic), kMagic);
}

// codec::f32_to_e4m3: nearest-even, saturating to +-448, NaN -> 0x7F, every zero -> 0x00.
// Integer arithmetic, so it needs no FP8 conversion instruction (sm_89+/gfx942+) and matches
// on every target.
AR_DEVICE uint32_t f32_to_e4m3(float x) {
  if (x != x) return 0x7Fu;
  const uint32_t sign = (as_uint(x) >> 24) & 0x80u;
  const float a = abs_f(x);
  uint32_t mag;
  if (a >= 448.0f) {
    mag = 0x7Eu;
  } else if (a < 0.015625f) {
    mag = static_cast<uint32_t>(rne_small(a * 512.0f));  // exact product; k * 2^-9, k <= 8
  } else {
    const uint32_t b = as_uint(a);
    mag = ((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return mag == 0 ? 0u : (sign | mag);
}

// codec::e4m3_to_f32 (exact), without branches: the code's 7 magnitude bits placed at f32
// bits 20..26 are the value times 2^-120 (an f32 subnormal for exponent 0, exactly like E4M3's
// subnormals), so one exact multiply by 2^120 rescales both kinds. No FTZ anywhere (docs/
// codecs.md), HIP included (build-support keeps f32 denormals).
AR_DEVICE float e4m3_to_f32(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24, mag = c & 0x7Fu;
  if (mag == 0x7Fu) return as_float(sign | 0x7FC00000u);
  return as_float(as_uint(as_float(mag << 20) * 0x1p120f) | sign);
}

#if AR_HW_E4M3
// Four FP8 codes of four f32 (element 0 in the low byte), f32_to_e4m3 of each: the hardware
// conversion rounds and saturates exactly as the format does (nearest even from the f32,
// subnormals kept, >= 448 to 448, NaN to 0x7F); it only keeps the sign of a negative value
// that rounds to zero (0x80), which the format encodes as 0x00. Each byte's sign survives only
// where its magnitude is non-zero: adding 0x7F to a 7-bit magnitude sets bit 7 exactly when
// the magnitude is non-zero, without a carry into the next byte.
AR_DEVICE uint32_t f32x4_to_e4m3x4(float a, float b, float c, float d) {
  const uint32_t w = cvt_e4m3x2(a, b) | (cvt_e4m3x2(c, d) << 16);
  const uint32_t mag = w & 0x7F7F7F7Fu;
  return mag | (((mag + 0x7F7F7F7Fu) | mag) & w & 0x80808080u);
}
#endif

// ---- Division by a block scale -----------------------------------------------------------

// Exponent range of a scale s (f32 exponent field) where quotients_by_scale divides with three
// FMA-unit operations per element: s in [2^-100, 2^101).
constexpr uint32_t kFastScaleExpLo = 127 - 100, kFastScaleExpHi = 127 + 100;

AR_DEVICE bool fast_scale(float s) {
  const uint32_t e = (as_uint(s) >> 23) & 0xFFu;
  return e >= kFastScaleExpLo && e <= kFastScaleExpHi;
}

// q[j] = div_rn(x[j], s) for a scale s = scale_value(field) with fast_scale(s), bit for bit
// wherever the codes depend on it: one correctly rounded reciprocal y = RN(1/s) per block, then
// per element Markstein's correction, q0 = RN(x * y), r = fma(-s, q0, x) (exact),
// q = fma(r, y, q0). For s with 7 significant bits (every scale_value) this is RN(x / s) for
// every normal x and normal quotient: checked exhaustively over all 64 scale significands and
// all 2^23 dividend significands (crates/core/src/codec/tests.rs,
// `markstein_division_is_exact_for_scales`), and the computation is scale-invariant while r
// stays a multiple of 2^-149, i.e. for |x| >= 2^-119. With s >= 2^-100 every element whose
// code depends on its quotient's bits (|x / s| >= 2^-11: an FP8 code above zero or an integer
// code) has |x| >= 2^-111; smaller elements get a quotient within a few 2^-149 of x / s, far
// below half the smallest code step, and s < 2^101 keeps y and every quotient normal. (The
// compiler's div.rn instead recomputes the reciprocal and range-checks per element.)
template <int kN>
AR_DEVICE void quotients_by_scale(const float (&x)[kN], float s, float (&q)[kN]) {
  const float y = rcp_rn(s);
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float q0 = mul_rn(x[j], y);
    q[j] = fma_rn(fma_rn(-s, q0, x[j]), y, q0);
  }
}

// ---- Quad shuffles -----------------------------------------------------------------------

// Value of lane (lane ^ mask), mask 1 or 2: both stay inside the lane's quad.
template <int kMask>
AR_DEVICE uint32_t quad_xor(uint32_t v) {
  static_assert(kMask == 1 || kMask == 2, "quad shuffles only");
#if AR_HIP
  // DPP quad_perm: no LDS round trip. Lane i of a quad reads lane sel_i.
  constexpr int kCtrl = kMask == 1 ? 0xB1 /* [1,0,3,2] */ : 0x4E /* [2,3,0,1] */;
  return static_cast<uint32_t>(
      __builtin_amdgcn_mov_dpp(static_cast<int>(v), kCtrl, 0xF, 0xF, false));
#else
  return __shfl_xor_sync(0xffffffffu, v, kMask);
#endif
}
template <int kMask>
AR_DEVICE float quad_xor(float v) {
  return as_float(quad_xor<kMask>(as_uint(v)));
}

// ---- Codec descriptions (QuickReduce's codec-as-template-parameter) -------------------------

// Integer codec of kBits bits: codes in [-H, H-1], stored biased by H.
template <int kBits, bool kAdaptive>
struct IntCodec {
  using Side = uint16_t;  // the block's scale field
  static constexpr int kSide0 = 2, kSide1 = 0;  // bytes per block of each side-field array
  static constexpr bool kV2 = false;
  static constexpr bool kFp4 = false;
  static constexpr bool kFp8 = false;
  static constexpr bool kAdaptiveCodec = kAdaptive;
  static constexpr int kH = 1 << (kBits - 1);
  static constexpr int kCodeBytes = kBits * kBlock / 8;  // 32, 24, 16
};
struct Fp8Codec {
  using Side = uint16_t;
  static constexpr int kSide0 = 2, kSide1 = 0;
  static constexpr bool kV2 = false;
  static constexpr bool kFp4 = false;
  static constexpr bool kFp8 = true;
  static constexpr bool kAdaptiveCodec = false;
  static constexpr int kH = 0;
  static constexpr int kCodeBytes = 32;
};
using CodecFp8 = Fp8Codec;
using CodecQ8 = IntCodec<8, false>;
using CodecQ6 = IntCodec<6, false>;
using CodecQ4 = IntCodec<4, false>;
using CodecQ8a = IntCodec<8, true>;
using CodecQ6a = IntCodec<6, true>;
using CodecQ4a = IntCodec<4, true>;

// Integer codecs whose encoder leaves codes unclamped for pack_codes' saturating packs
// (AR_PACK_SAT targets). Not plain q8: measured 3% slower encoding on the H200 with them
// (q8a, q6, q6a, q4, q4a: equal or faster; q4a 118.4 -> 109.7 us per 256 MiB). The v2
// encoders' codes are already in range; the packs take two codes an instruction.
template <typename C>
constexpr bool kPackSat =
    AR_PACK_SAT && !C::kFp8 && (C::kCodeBytes != 32 || C::kAdaptiveCodec || C::kV2);
// q6 packs by saturation only 16 codes at a time (pack_q6_by_bytes).
template <typename C, int kN>
constexpr bool kPackSatN = kPackSat<C> && (C::kCodeBytes != 24 || kN % 16 == 0);

// Segment layout (codec::encode): codes of every block from 0, then one array per side field
// (v1: the u16 scales) from align16(nb * kCodeBytes), kSide0 and kSide1 bytes per block; each
// region padded to 16 bytes.
AR_DEVICE u64 align16(u64 x) { return (x + 15) & ~u64(15); }
AR_DEVICE u64 blocks_of(u64 n) { return (n + kBlock - 1) / kBlock; }
template <typename C>
AR_DEVICE u64 scales_offset(u64 n) {
  return align16(blocks_of(n) * C::kCodeBytes);
}
template <typename C>
AR_DEVICE u64 encoded_len(u64 n) {
  return scales_offset<C>(n) + align16(C::kSide0 * blocks_of(n)) + align16(C::kSide1 * blocks_of(n));
}

// ---- Block-wide steps ----------------------------------------------------------------------

// codec::scan: finiteness, and the first element of largest magnitude (0.0 for a zero block).
struct Scan {
  bool finite;
  float m, amax;
};
// kCheckFinite = false skips the finiteness probe for blocks known finite (the adaptive
// encoder's Hadamard candidate, which only counts where x was finite and in range).
template <int kN, bool kCheckFinite = true>
AR_DEVICE Scan scan_quad(const float (&x)[kN], int q) {
  // The lane's first element of largest magnitude: one compare (|.| is an operand modifier)
  // and one select per element. m starts at +0.0 and only an |x| > 0 replaces it, so a zero
  // block keeps the reference's +0.0.
  float m = 0.0f;
  // NaN once any element is Inf or NaN (Inf * 0 is NaN), else 0: one FMA per element where a
  // bit test per element would be three instructions. Not folded: no fast-math.
  float probe = 0.0f;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    if (kCheckFinite) probe = x[j] * 0.0f + probe;
    if (abs_f(x[j]) > abs_f(m)) m = x[j];  // strict: the first of equal magnitudes wins
  }
  // "Not finite" rides in m as a NaN, which the merges below keep. Across lanes the lower
  // lane wins a tie (all its elements come first in the block), and which lane is lower is
  // known from q alone, so m is the only value shuffled.
  if (probe != 0.0f) m = as_float(0x7FC00000u);
  auto merge = [&](float pm, bool partner_lower) {
    const float a = abs_f(m), pa = abs_f(pm);
    if (pm != pm || pa > a || (pa == a && partner_lower)) m = pm;  // NaN m: all false
  };
  if constexpr (kN <= 16) merge(quad_xor<1>(m), (q & 1) != 0);
  if constexpr (kN <= 8) merge(quad_xor<2>(m), (q & 2) != 0);
  const bool finite = m == m;
  return Scan{finite, finite ? m : 0.0f, finite ? abs_f(m) : 0.0f};
}

// The scan for codecs that use only the block's largest magnitude and finiteness (FP8): with
// a NaN-propagating max, one instruction per element (Inf is the largest magnitude, a NaN
// wins over everything). m is not the reference's signed m here (it is amax); nothing of FP8
// reads it.
template <int kN>
AR_DEVICE Scan scan_amax_quad(const float (&x)[kN], int q) {
#if AR_MAX_NAN
  float a = abs_f(x[0]);
#pragma unroll
  for (int j = 1; j < kN; ++j) a = max_nan(a, abs_f(x[j]));
  if constexpr (kN <= 16) a = max_nan(a, quad_xor<1>(a));
  if constexpr (kN <= 8) a = max_nan(a, quad_xor<2>(a));
  const bool finite = a < as_float(0x7f800000u);  // false for Inf and NaN
  const float amax = finite ? a : 0.0f;
  return Scan{finite, amax, amax};
#else
  return scan_quad(x, q);
#endif
}

// codec::abs_sum of this lane group's block: per group of 8 the |x| in index order, then the
// four group sums as (g0 + g1) + (g2 + g3): inside the lane where it holds them, across lanes
// (xor-1, then xor-2) where not. f32 addition is commutative, so the lane holding g1
// computing g1 + g0 gets the same bits. Every lane ends with the block's value. (Sums and
// scans by trees instead of chains were measured: 2% slower on the H200.)
template <int kN>
AR_DEVICE float abs_sum(const float (&x)[kN]) {
  constexpr int kGroups = kN / 8;
  float g[kGroups];
#pragma unroll
  for (int gi = 0; gi < kGroups; ++gi) {
    float e = abs_f(x[8 * gi]);
#pragma unroll
    for (int j = 1; j < 8; ++j) e = add_rn(e, abs_f(x[8 * gi + j]));
    g[gi] = e;
  }
  if constexpr (kN == 8) {
    const float t = add_rn(g[0], quad_xor<1>(g[0]));
    return add_rn(t, quad_xor<2>(t));
  } else if constexpr (kN == 16) {
    const float t = add_rn(g[0], g[1]);
    return add_rn(t, quad_xor<1>(t));
  } else {
    static_assert(kN == 32, "8, 16 or 32 elements per lane");
    return add_rn(add_rn(g[0], g[1]), add_rn(g[2], g[3]));
  }
}

// codec::encode_plain for C's codes (the adaptive codecs' chosen candidate included): N biased
// codes per lane; returns the field (flag clear), the same in every lane of the group.
template <typename C, int kN>
AR_DEVICE uint16_t encode_plain(const float (&x)[kN], const Scan& sc, uint32_t (&u)[kN]) {
  // The scale's f32 bits (field << 16); the value rounded is finite here, so round_scale's
  // NaN case cannot arise.
  uint32_t sbits = 0;
  // div_rn(amax, 256) (codec::FP8_BLOCK_MAX) and div_rn(-m, H): both divisors are powers of
  // two, so the product by 2^-k is the same correctly rounded value of the same exact quotient
  // (subnormal results included).
  if (C::kFp8) {
    if (sc.finite && sc.amax != 0.0f) sbits = round_scale_bits(mul_rn(sc.amax, 1.0f / 256.0f));
  } else {
    if (sc.finite && sc.amax != 0.0f) sbits = round_scale_bits(mul_rn(-sc.m, 1.0f / float(C::kH)));
  }
  const uint16_t field = static_cast<uint16_t>(sbits >> 16);
  // One correctly rounded division per element, as the format says: three FMA-unit operations
  // per element after one reciprocal per block (quotients_by_scale). (A reciprocal multiply
  // with a division only next to rounding boundaries was tried: exact, but 12% slower on
  // sm_90 than per-element div.rn.)
  const float s = as_float(sbits);  // scale_value(field)
  float qt[kN];
  if (fast_scale(s)) {  // every finite block of ordinary data; quad-uniform
    quotients_by_scale(x, s, qt);
  } else {
    // Zero, poisoned (s == 0 here) and extreme blocks: the compiler's division per element;
    // zero quotients give the zero codes.
    // Clamped here to the code range [-H, H-1] (integer bounds: clamping commutes with the
    // rounding below), since a subnormal scale has fewer significant bits than the bound the
    // integer path relies on.
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float v = s == 0.0f ? 0.0f : div_rn(x[j], s);
      if (!C::kFp8) {  // never NaN here (s != 0, x finite); no libm on HIP RTC
        const float lo = -float(C::kH), hi = float(C::kH - 1);
        v = v < lo ? lo : (v > hi ? hi : v);
      }
      qt[j] = v;
    }
  }
  if (C::kFp8) {
#if AR_HW_E4M3
#pragma unroll
    for (int h = 0; h < kN; h += 4) {
      const uint32_t w = f32x4_to_e4m3x4(qt[h], qt[h + 1], qt[h + 2], qt[h + 3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) u[h + j] = (w >> (8 * j)) & 0xFFu;
    }
#else
#pragma unroll
    for (int j = 0; j < kN; ++j) u[j] = f32_to_e4m3(qt[j]);
#endif
  } else if constexpr (kPackSatN<C, kN>) {
    // The biased code RNE(q) + H as the bits of a subnormal: (q + H) * 2^-149 rounded once
    // onto the subnormal grid (spacing 2^-149) is RNE(q + H) * 2^-149, and RNE(q + H) =
    // RNE(q) + H for even H. One FMA, no subtraction; pack_codes clamps as it packs (a code
    // of -1 or -0.0 reads as a negative s32, 2H as 2H: both saturate onto the range; q6's
    // 2H = 64 is lowered to 63 after its byte pack). Needs f32 subnormals (the kernels are
    // built without -ftz).
    constexpr float kUnit = 0x1p-149f;
#pragma unroll
    for (int j = 0; j < kN; ++j) u[j] = as_uint(fma_rn(qt[j], kUnit, float(C::kH) * kUnit));
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      // rne_small's sum already holds the integer in its low mantissa bits: read it there
      // instead of subtracting and converting (a quarter-rate F2I per element). Adding H to
      // the magic number gives the biased code RNE(q) + H directly (H is an integer and the
      // sum stays in [2^23, 2^24), where the f32 step is 1).
      const float kMagic = 12582912.0f;  // 1.5 * 2^23, as in rne_small
      int32_t b = static_cast<int32_t>(as_uint(add_rn(qt[j], kMagic + float(C::kH))) -
                                       as_uint(kMagic));
      // Range of b. The fast path's scale is |s| = RN7(|m| / H) (7 significant bits, normal),
      // so |s| >= (1 - 2^-7) |m| / H and every |q| <= |m| / |s| <= H / (1 - 2^-7): at most
      // 8.07 (q4) or 32.26 (q6), which round to at most H, so b is in [0, 2H] and only the
      // top needs the clamp. q8's 129.02 can round to -129 or 129: both sides. The slow path
      // clamped its quotients above.
      if (C::kH >= 128) b = b < 0 ? 0 : b;
      b = b > 2 * C::kH - 1 ? 2 * C::kH - 1 : b;
      u[j] = static_cast<uint32_t>(b);
    }
  }
  // A scale that rounded to (signed) zero leaves a zero block: field 0, zero codes.
  if (!sc.finite) return kPoisonScale;
  return s == 0.0f ? uint16_t(0) : field;
}

// codec::decode_int / the FP8 decode: one exact product per element.
template <typename C, int kN>
AR_DEVICE void decode_plain(const uint32_t (&u)[kN], float s, float (&out)[kN]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    if constexpr (C::kFp8) {
#if AR_HW_E4M3
      // Pairs of codes to f16x2 in one conversion (exact), then f16 -> f32 (exact). A NaN
      // code decodes to a NaN (its payload is not part of the format).
      if (j % 2 == 0) {
        const uint32_t h2 = cvt_e4m3x2_to_f16x2(u[j] | (u[j + 1] << 8));
        out[j] = f16_to_f32(static_cast<uint16_t>(h2)) * s;
        out[j + 1] = f16_to_f32(static_cast<uint16_t>(h2 >> 16)) * s;
      }
#else
      out[j] = e4m3_to_f32(u[j]) * s;
#endif
    } else {
      // float(code - H) without a conversion: u[j] holds the bits of 2^23 + code (unpack_codes
      // put the code in the low mantissa bits), and subtracting 2^23 + H is exact (both
      // integers below 2^24; a zero difference is +0.0, as the conversion gives). One FADD.
      const float kBase = 8388608.0f + float(C::kH);
      out[j] = sub_rn(as_float(u[j]), kBase) * s;
    }
  }
}

// codec::wht32 over the lane group: stages h < N inside the lane, h = N and 2N across lanes
// (xor-1, xor-2). Pair (a, b) -> (a + b, a - b); the lane holding the upper element computes
// partner - own.
template <int kN>
AR_DEVICE void wht_quad(float (&v)[kN], int q) {
#pragma unroll
  for (int h = 1; h < kN; h *= 2) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      if ((j & h) == 0) {
        const float a = v[j], b = v[j + h];
        v[j] = add_rn(a, b);
        v[j + h] = sub_rn(a, b);
      }
    }
  }
  // Across lanes: fma(v, -+1, p) is p -+ v rounded once, i.e. the lower lane's a + b (as
  // v + p, commutative) and the upper lane's a - b, with one FMA and no per-lane select.
  if constexpr (kN <= 16) {
    const float sg = (q & 1) ? -1.0f : 1.0f;
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j] = fma_rn(v[j], sg, quad_xor<1>(v[j]));
  }
  if constexpr (kN <= 8) {
    const float sg = (q & 2) ? -1.0f : 1.0f;
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j] = fma_rn(v[j], sg, quad_xor<2>(v[j]));
  }
}

template <int kN>
AR_DEVICE float sign_of(int q, int j, float v) {
  return ((kHadamardSigns >> (q * kN + j)) & 1u) ? -v : v;
}

// codec::hadamard_forward.
template <int kN>
AR_DEVICE void hadamard_forward(float (&v)[kN], int q) {
#pragma unroll
  for (int j = 0; j < kN; ++j) v[j] = sign_of<kN>(q, j, v[j]);
  wht_quad(v, q);
}

// codec::hadamard_inverse (exact on decoded blocks, so the order is free; it is kept anyway).
template <int kN>
AR_DEVICE void hadamard_inverse(float (&v)[kN], int q) {
  wht_quad(v, q);
#pragma unroll
  for (int j = 0; j < kN; ++j) v[j] = sign_of<kN>(q, j, mul_rn(v[j], 0.03125f));
}

// ---- Packing: this lane's N codes of a block, as stored ---------------------------------

// codec::pack: element j of the block at code j. q8/fp8: byte j. q4: nibble j (byte j / 2, low
// nibble first). q6: the low nibbles as q4 at 0, the high 2-bit pairs from byte 16 (four
// elements a byte). Lane q's N codes are therefore N bytes at Nq (q8/fp8), N / 2 bytes at
// Nq / 2 (q4), or N / 2 bytes at Nq / 2 and N / 4 bytes at 16 + Nq / 4 (q6).
// Codes<C, N> holds them as the words stored: the adaptive encoder selects between two
// packed candidates (a few words) instead of two arrays of N codes.
template <typename C, int kN>
struct Codes {
  static constexpr int kWords = C::kCodeBytes == 32 ? kN / 4
                                : C::kCodeBytes == 16 ? kN / 8
                                                      : kN / 8 + (kN + 15) / 16;
  uint32_t w[kWords];
};

// q6 codes, 16 at a time (kN a multiple of 16): bytes first, then both fields from the bytes.
// B_k holds codes k, k + 4, k + 8, k + 12 of the 16 (one per byte); shifted and masked, the
// four give every code's top two bits at bit 2e of one word, and byte permutes of them give
// the even and odd codes of each half, whose low nibbles interleave with one select. About
// 1.7 instructions per code where one field at a time took 4.5 (each code a shift, a mask
// and an OR per field).
// kUnclamped (kPackSat): codes in [0, 64] or negative; saturating packs give the bytes (0 for
// a negative code) and a code of 64, the only one above 63, loses its bit 6 into bit 0.
template <bool kUnclamped, int kN>
AR_DEVICE void pack_q6_by_bytes(const uint32_t (&u)[kN], uint32_t* lo, uint32_t* hi) {
  static_assert(kN % 16 == 0, "16 codes at a time");
#pragma unroll
  for (int g = 0; g < kN / 16; ++g) {
    const uint32_t* v = u + 16 * g;
    uint32_t b[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kUnclamped) {
        const uint32_t w =
            pack_sat_u8(int32_t(v[k + 4]), int32_t(v[k]), pack_sat_u8(int32_t(v[k + 12]), int32_t(v[k + 8]), 0u));
        b[k] = w - ((w >> 6) & 0x01010101u);
      } else {
        b[k] = byte_perm(byte_perm(v[k], v[k + 4], 0x0040u), byte_perm(v[k + 8], v[k + 12], 0x0040u), 0x5410u);
      }
    }
    // Codes are below 64: bits 6-7 of every byte are zero.
    hi[g] = (b[2] & 0x30303030u) | ((b[0] >> 4) & 0x03030303u) | ((b[1] >> 2) & 0x0C0C0C0Cu) |
            ((b[3] << 2) & 0xC0C0C0C0u);
    // Codes 0, 2, 4, 6 (of the group's first 8) and 1, 3, 5, 7; then 8.. 14 and 9.. 15.
    const uint32_t e0 = byte_perm(b[0], b[2], 0x5140u), o0 = byte_perm(b[1], b[3], 0x5140u);
    const uint32_t e1 = byte_perm(b[0], b[2], 0x7362u), o1 = byte_perm(b[1], b[3], 0x7362u);
    lo[2 * g] = (e0 & 0x0F0F0F0Fu) | ((o0 << 4) & 0xF0F0F0F0u);
    lo[2 * g + 1] = (e1 & 0x0F0F0F0Fu) | ((o1 << 4) & 0xF0F0F0F0u);
  }
}

template <typename C, int kN>
AR_DEVICE void pack_codes(const uint32_t (&u)[kN], Codes<C, kN>& c) {
  if constexpr (kPackSatN<C, kN> && C::kCodeBytes == 32) {
    // Unclamped codes (encode_plain); each instruction clamps two and shifts the word up.
#pragma unroll
    for (int i = 0; i < kN / 4; ++i)
      c.w[i] = pack_sat_u8(int32_t(u[4 * i + 1]), int32_t(u[4 * i]),
                           pack_sat_u8(int32_t(u[4 * i + 3]), int32_t(u[4 * i + 2]), 0u));
  } else if constexpr (kPackSatN<C, kN> && C::kCodeBytes == 16) {
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      uint32_t w = 0;
#pragma unroll
      for (int e = 6; e >= 0; e -= 2) w = pack_sat_u4(int32_t(u[8 * i + e + 1]), int32_t(u[8 * i + e]), w);
      c.w[i] = w;
    }
  } else if constexpr (C::kCodeBytes == 32) {
#pragma unroll
    for (int i = 0; i < kN / 4; ++i)
      c.w[i] = u[4 * i] | (u[4 * i + 1] << 8) | (u[4 * i + 2] << 16) | (u[4 * i + 3] << 24);
  } else if constexpr (C::kCodeBytes == 24 && kN % 16 == 0) {
    pack_q6_by_bytes<kPackSatN<C, kN>>(u, c.w, c.w + kN / 8);
  } else {
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      uint32_t w = 0;
      // Every code is below 2H (encode_plain's clamps), so a 4-bit code needs no mask and the
      // nibbles do not overlap: a sum, one multiply-add per code.
#pragma unroll
      for (int e = 0; e < 8; ++e)
        w += (C::kCodeBytes == 16 ? u[8 * i + e] : (u[8 * i + e] & 0xFu)) << (4 * e);
      c.w[i] = w;
    }
    if constexpr (C::kCodeBytes == 24) {
#pragma unroll
      for (int i = 0; i < (kN + 15) / 16; ++i) {
        uint32_t w = 0;
#pragma unroll
        for (int e = 0; e < 16 && 16 * i + e < kN; ++e) w |= (u[16 * i + e] >> 4) << (2 * e);
        c.w[kN / 8 + i] = w;
      }
    }
  }
}

// A block starts at a multiple of kCodeBytes (only 8-byte aligned for q6); every store is
// aligned to its width.
template <typename C, int kN>
AR_DEVICE void store_codes(char* block, int q, const Codes<C, kN>& c) {
  if constexpr (C::kCodeBytes == 32) {
    char* p = block + kN * q;
    if constexpr (kN == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(c.w[0], c.w[1]);
    } else {
#pragma unroll
      for (int i = 0; i < kN / 4; i += 4)
        *reinterpret_cast<uint4*>(p + 4 * i) = make_uint4(c.w[i], c.w[i + 1], c.w[i + 2], c.w[i + 3]);
    }
  } else {
    char* p = block + (kN / 2) * q;
    if constexpr (kN == 8) {
      *reinterpret_cast<uint32_t*>(p) = c.w[0];
    } else if constexpr (kN == 16 || C::kCodeBytes == 24) {
#pragma unroll
      for (int i = 0; i < kN / 8; i += 2) *reinterpret_cast<uint2*>(p + 4 * i) = make_uint2(c.w[i], c.w[i + 1]);
    } else {
      *reinterpret_cast<uint4*>(p) = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
    }
    if constexpr (C::kCodeBytes == 24) {
      char* t = block + 16 + (kN / 4) * q;
      constexpr int o = kN / 8;
      if constexpr (kN == 8) {
        *reinterpret_cast<uint16_t*>(t) = static_cast<uint16_t>(c.w[o]);
      } else if constexpr (kN == 16) {
        *reinterpret_cast<uint32_t*>(t) = c.w[o];
      } else {
        *reinterpret_cast<uint2*>(t) = make_uint2(c.w[o], c.w[o + 1]);
      }
    }
  }
}

// The smallest nonzero |x| of the block over the lane group, in every lane (0 for a block of
// zeros): minima of |x|'s bits minus 1, two elements an instruction, where a zero wraps to the
// largest pattern and never wins (non-negative f32 order as their bits do).
template <int kN>
AR_DEVICE float group_min_nonzero_abs(const float (&x)[kN]) {
  auto nz_bits = [](float v) { return as_uint(abs_f(v)) - 1u; };
  uint32_t b = nz_bits(x[0]);
#pragma unroll
  for (int j = 1; j + 1 < kN; j += 2) b = min3_u32(b, nz_bits(x[j]), nz_bits(x[j + 1]));
  b = min3_u32(b, nz_bits(x[kN - 1]), b);
  if constexpr (kN <= 16) {
    const uint32_t p = quad_xor<1>(b);
    b = p < b ? p : b;
  }
  if constexpr (kN <= 8) {
    const uint32_t p = quad_xor<2>(b);
    b = p < b ? p : b;
  }
  return as_float(b + 1u);
}

// codec::encode_block (v1 codecs): the block's N codes of this lane, packed, and its field.
template <typename C, int kN>
AR_DEVICE uint16_t encode_v1(const float (&x)[kN], int q, Codes<C, kN>& out) {
  uint32_t u[kN];
  if constexpr (!C::kAdaptiveCodec) {
    const Scan sc = C::kFp8 ? scan_amax_quad(x, q) : scan_quad(x, q);
    const uint16_t field = encode_plain<C>(x, sc, u);
    pack_codes(u, out);
    return field;
  } else {
    // codec::choose_adaptive: the candidate whose scale predicts the smaller error, decided
    // from the two blocks' largest magnitudes and x's absolute sum, and only that one coded
    // (coding both and measuring their errors took 35-40 instructions per element against
    // about 20 here; docs/history/benchmarks-2026-12.md). The choice needs no
    // signed maximum, so both scans are one max per element (NaN-propagating: x's also says
    // whether the block is finite); the chosen block's signed maximum, which its scale's sign
    // needs, is a third scan. The transform runs for every block (the group functions may
    // shuffle) and the choice is a select per element: lanes that choose differently do not
    // diverge.
    const Scan ax = scan_amax_quad(x, q);
    float y[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) y[j] = x[j];
    hadamard_forward(y, q);
    const float ay = scan_amax_quad(y, q).amax;  // y is finite wherever it can be chosen
    constexpr float kInvH = 1.0f / float(C::kH);
    const float sp = as_float(round_scale_bits(mul_rn(ax.amax, kInvH)));  // |s_p|
    const float sh = as_float(round_scale_bits(mul_rn(ay, kInvH)));       // |s_h|
    const bool tried = ax.finite && ax.amax >= 0x1p-48f && ax.amax <= 0x1p48f;
    // Both products are exact (7-bit scales): s_h^2 < 32 s_p^2 is s_h < sqrt(32) s_p. And the
    // transform must beat the rest of the block (a spike far above it is better plain).
    const float rest = mul_rn(kAdaptiveRestWeight, sub_rn(abs_sum(x), ax.amax));
    // A block of one nonzero magnitude stays plain (exact for constants).
    const bool one_magnitude = group_min_nonzero_abs(x) == ax.amax;
    const bool hadamard = tried && !one_magnitude && mul_rn(sh, sh) < mul_rn(mul_rn(sp, sp), 32.0f) && sh < rest;
    float v[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j] = hadamard ? y[j] : x[j];
    Scan sv = scan_quad<kN, false>(v, q);
    // A block with an Inf or NaN is poisoned (x's scan says so; the signed scan skips NaNs).
    if (!ax.finite) sv = Scan{false, 0.0f, 0.0f};
    const uint16_t field = encode_plain<C>(v, sv, u);
    pack_codes(u, out);
    return hadamard ? uint16_t(field | kFlagBit) : field;
  }
}

// codec::decode_block (without the unpacking). Adaptive codecs: the inverse transform of a
// flagged block, D H (c S) / 32 with c the code integers, is exact in any order (docs/codecs.md),
// so it runs on the integers c (|H c| <= 4096) before the scale: the plain and the Hadamard
// result share the conversion, and the 1/32 and the signs of D fold into one multiplier per
// element that depends only on the lane (hoisted out of the caller's loop).
template <typename C, int kN>
AR_DEVICE void decode_v1(const uint32_t (&u)[kN], uint16_t field, int q, float (&out)[kN]) {
  const float s = scale_value(field);
  if constexpr (!C::kAdaptiveCodec) {
    decode_plain<C>(u, s, out);
  } else {
    const float kBase = 8388608.0f + float(C::kH);
    float c[kN], t[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      c[j] = sub_rn(as_float(u[j]), kBase);  // code - H, exact (decode_plain)
      t[j] = c[j];
    }
    wht_quad(t, q);  // every lane shuffles; only flagged blocks keep the result
    // A flagged block is d_i t_i (S / 32): the sign of D flips t's sign bit, and one
    // multiplier per block serves both cases (t S / 32 and c S are exact products).
    const bool flagged = (field & kFlagBit) != 0;
    const uint32_t lane_signs = kHadamardSigns >> (q * kN);
    const float m = flagged ? s * 0.03125f : s;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const uint32_t sign = (lane_signs << (31 - j)) & 0x80000000u;
      out[j] = (flagged ? as_float(as_uint(t[j]) ^ sign) : c[j]) * m;
    }
  }
}

// codec::unpack. Loads through L2 only (.cg on CUDA): the bytes may come from a peer. Decoders
// work in quads (N = 8) or, the adaptive segment decoders, pairs (N = 16; quantized.h,
// DecodeShape).
template <typename C, int kN>
AR_DEVICE void load_codes(const char* block, int q, Codes<C, kN>& c) {
  static_assert(kN == 8 || kN == 16, "decoders work in quads or pairs");
  if constexpr (C::kCodeBytes == 32 && kN == 16) {
    const uint4 w = load_peer(reinterpret_cast<const uint4*>(block + 16 * q));
    c.w[0] = w.x;
    c.w[1] = w.y;
    c.w[2] = w.z;
    c.w[3] = w.w;
  } else if constexpr (C::kCodeBytes == 32 || kN == 16) {
    // q8 quads; q4 / q6 pairs (a q6 block is 8-byte aligned, its high bits 4-byte aligned).
    const uint2 w = load_peer(reinterpret_cast<const uint2*>(block + 8 * q));
    c.w[0] = w.x;
    c.w[1] = w.y;
    if constexpr (C::kCodeBytes == 24) c.w[2] = load_peer(reinterpret_cast<const uint32_t*>(block + 16 + 4 * q));
  } else {
    c.w[0] = load_peer(reinterpret_cast<const uint32_t*>(block + 4 * q));
    if constexpr (C::kCodeBytes == 24) c.w[1] = load_peer(reinterpret_cast<const uint16_t*>(block + 16 + 2 * q));
  }
}

// u[j]: FP8 codes as bytes; integer codes as the f32 bits of 2^23 + code (decode_plain), so the
// conversion's OR comes with the extraction. On CUDA a byte permute moves a code byte under
// 0x4B (one PRMT per code); q4 / q6 first gather the even and the odd codes of 8 into the bytes
// of two words (q6: its 2-bit fields spread under the nibbles): about 2.3 instructions per q6
// code where field-by-field extraction took 4-5.
template <typename C, int kN>
AR_DEVICE void unpack_codes(const Codes<C, kN>& c, uint32_t (&u)[kN]) {
  constexpr uint32_t kHi = 0x4B000000u;
  if constexpr (C::kFp8) {
#pragma unroll
    for (int j = 0; j < kN; ++j) u[j] = (c.w[j / 4] >> (8 * (j % 4))) & 0xFFu;
  } else if constexpr (AR_HIP) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      uint32_t v = C::kCodeBytes == 32 ? (c.w[j / 4] >> (8 * (j % 4))) & 0xFFu : (c.w[j / 8] >> (4 * (j % 8))) & 0xFu;
      if constexpr (C::kCodeBytes == 24) v |= ((c.w[kN / 8 + j / 16] >> (2 * (j % 16))) & 3u) << 4;
      u[j] = kHi | v;
    }
  } else if constexpr (C::kCodeBytes == 32) {
    // Selector: code byte k, two zero bytes and 0x4B from kHi.
#pragma unroll
    for (int j = 0; j < kN; ++j) u[j] = byte_perm(c.w[j / 4], kHi, 0x7440u | (j % 4));
  } else {
#pragma unroll
    for (int g = 0; g < kN / 8; ++g) {
      const uint32_t w = c.w[g];
      uint32_t even = w & 0x0F0F0F0Fu, odd = (w >> 4) & 0x0F0F0F0Fu;  // codes 2k, 2k + 1 at byte k
      if constexpr (C::kCodeBytes == 24) {
        // The group's 16 bits of 2-bit fields, nibble k (codes 2k, 2k + 1) to bits 8k + 4..7:
        // t holds nibbles 0-1 at bits 0-7 and 2-3 at 16-23; nibbles 0 and 2 move up by 4,
        // 1 and 3 by 8. The second shift also leaves copies of nibbles 0 and 2 in the low
        // nibbles of bytes 1 and 3, which both masks below drop.
        const uint32_t hw = c.w[kN / 8 + g / 2];
        const uint32_t t = byte_perm(hw, 0u, (g % 2) ? 0x4342u : 0x4140u);
        const uint32_t hs = ((t << 4) & 0x00F000F0u) | ((t << 8) & 0xFF0FFF0Fu);
        even |= hs & 0x30303030u;
        odd |= (hs >> 2) & 0x30303030u;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        u[8 * g + 2 * k] = byte_perm(even, kHi, 0x7440u | k);
        u[8 * g + 2 * k + 1] = byte_perm(odd, kHi, 0x7440u | k);
      }
    }
  }
}

}  // namespace ar
