// The block codecs of the quantized all-reduce on the GPU: FP8 E4M3, Q8, Q6, Q4 and the adaptive
// Q8a/Q6a/Q4a, written once for nvcc and HIP clang. The format is docs/codecs.md; the
// specification is the Rust reference (crates/core/src/codec), and every function here says
// which reference function it must match bit for bit.
//
// Work shape: a "quad" of 4 consecutive lanes codes one 32-element block, 8 elements per lane
// (one 16-byte vector of f16/bf16). Block-wide steps (the max, the Hadamard stages h = 8 and
// 16, the squared-error tree) cross lanes with xor-1 / xor-2 shuffles, which stay inside the
// quad on 32- and 64-lane warps alike. Lane q of a quad holds block elements 8q..8q+7.
//
// Every lane of a warp must call the quad functions together (they shuffle), so nothing here
// branches around a shuffle: the adaptive candidate is always computed and then selected.
#pragma once

#include "allreduce/shim.h"

namespace ar {

constexpr int kBlock = 32;
constexpr int kQuad = 4;
constexpr int kPerLane = kBlock / kQuad;  // 8
constexpr uint16_t kFlagBit = 1;
constexpr uint16_t kPoisonScale = 0x7FC0;
constexpr uint32_t kHadamardSigns = 0x6A09E667u;

// ---- Arithmetic the format pins down (docs/codecs.md, "Arithmetic rules") -------------------

// One correctly rounded f32 operation each, never fused with a neighbour into an FMA: the
// adaptive encoder's squared error and forward transform round in a specified order.
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

// max(a, b) that returns NaN when either is NaN (the FP8 block scan). AR_MAX_NAN: the target
// has it as one instruction (PTX max.NaN.f32, sm_80+).
#if !AR_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define AR_MAX_NAN 1
AR_DEVICE float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
#else
#define AR_MAX_NAN 0
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
AR_DEVICE void quotients_by_scale(const float (&x)[kPerLane], float s, float (&q)[kPerLane]) {
  const float y = rcp_rn(s);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
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
  static constexpr bool kFp8 = false;
  static constexpr bool kAdaptiveCodec = kAdaptive;
  static constexpr int kH = 1 << (kBits - 1);
  static constexpr int kCodeBytes = kBits * kBlock / 8;  // 32, 24, 16
};
struct Fp8Codec {
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

// Segment layout (codec::encode): codes of every block from 0, then the u16 scales from
// align16(nb * kCodeBytes); each region padded to 16 bytes.
AR_DEVICE u64 align16(u64 x) { return (x + 15) & ~u64(15); }
AR_DEVICE u64 blocks_of(u64 n) { return (n + kBlock - 1) / kBlock; }
template <typename C>
AR_DEVICE u64 scales_offset(u64 n) {
  return align16(blocks_of(n) * C::kCodeBytes);
}
template <typename C>
AR_DEVICE u64 encoded_len(u64 n) {
  return scales_offset<C>(n) + align16(2 * blocks_of(n));
}

// ---- Block-wide steps ----------------------------------------------------------------------

// codec::scan: finiteness, and the first element of largest magnitude (0.0 for a zero block).
struct Scan {
  bool finite;
  float m, amax;
};
AR_DEVICE Scan scan_quad(const float (&x)[kPerLane], int q) {
  // The lane's first element of largest magnitude: one compare (|.| is an operand modifier)
  // and one select per element. m starts at +0.0 and only an |x| > 0 replaces it, so a zero
  // block keeps the reference's +0.0.
  float m = 0.0f;
  // NaN once any element is Inf or NaN (Inf * 0 is NaN), else 0: one FMA per element where a
  // bit test per element would be three instructions. Not folded: no fast-math.
  float probe = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    probe = x[j] * 0.0f + probe;
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
  merge(quad_xor<1>(m), (q & 1) != 0);
  merge(quad_xor<2>(m), (q & 2) != 0);
  const bool finite = m == m;
  return Scan{finite, finite ? m : 0.0f, finite ? abs_f(m) : 0.0f};
}

// The scan for codecs that use only the block's largest magnitude and finiteness (FP8): with
// a NaN-propagating max, one instruction per element (Inf is the largest magnitude, a NaN
// wins over everything). m is not the reference's signed m here (it is amax); nothing of FP8
// reads it.
AR_DEVICE Scan scan_amax_quad(const float (&x)[kPerLane], int q) {
#if AR_MAX_NAN
  float a = abs_f(x[0]);
#pragma unroll
  for (int j = 1; j < kPerLane; ++j) a = max_nan(a, abs_f(x[j]));
  a = max_nan(a, quad_xor<1>(a));
  a = max_nan(a, quad_xor<2>(a));
  const bool finite = a < as_float(0x7f800000u);  // false for Inf and NaN
  const float amax = finite ? a : 0.0f;
  return Scan{finite, amax, amax};
#else
  return scan_quad(x, q);
#endif
}

// codec::encode_plain for C's codes (the adaptive codecs' plain candidate included): 8 biased
// codes per lane; returns the field (flag clear), the same in all four lanes.
template <typename C>
AR_DEVICE uint16_t encode_plain(const float (&x)[kPerLane], const Scan& sc,
                                uint32_t (&u)[kPerLane]) {
  // The scale's f32 bits (field << 16); the value rounded is finite here, so round_scale's
  // NaN case cannot arise.
  uint32_t sbits = 0;
  if (C::kFp8) {
    if (sc.finite && sc.amax != 0.0f) sbits = round_scale_bits(div_rn(sc.amax, 448.0f));
  } else {
    // div_rn(-m, H): H is a power of two, so the product by 2^-k is the same correctly
    // rounded value of the same exact quotient (subnormal results included).
    if (sc.finite && sc.amax != 0.0f) sbits = round_scale_bits(mul_rn(-sc.m, 1.0f / float(C::kH)));
  }
  const uint16_t field = static_cast<uint16_t>(sbits >> 16);
  // One correctly rounded division per element, as the format says: three FMA-unit operations
  // per element after one reciprocal per block (quotients_by_scale). (A reciprocal multiply
  // with a division only next to rounding boundaries was tried: exact, but 12% slower on
  // sm_90 than per-element div.rn.)
  const float s = as_float(sbits);  // scale_value(field)
  float qt[kPerLane];
  if (fast_scale(s)) {  // every finite block of ordinary data; quad-uniform
    quotients_by_scale(x, s, qt);
  } else {
    // Zero, poisoned (s == 0 here) and extreme blocks: the compiler's division per element;
    // zero quotients give the zero codes.
    // Clamped here to the code range [-H, H-1] (integer bounds: clamping commutes with the
    // rounding below), since a subnormal scale has fewer significant bits than the bound the
    // integer path relies on.
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
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
    for (int h = 0; h < kPerLane; h += 4) {
      const uint32_t w = f32x4_to_e4m3x4(qt[h], qt[h + 1], qt[h + 2], qt[h + 3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) u[h + j] = (w >> (8 * j)) & 0xFFu;
    }
#else
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) u[j] = f32_to_e4m3(qt[j]);
#endif
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
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
template <typename C>
AR_DEVICE void decode_plain(const uint32_t (&u)[kPerLane], float s, float (&out)[kPerLane]) {
#if AR_HW_E4M3
  if (C::kFp8) {
    // Pairs of codes to f16x2 in one conversion (exact), then f16 -> f32 (exact). A NaN code
    // decodes to a NaN (its payload is not part of the format).
#pragma unroll
    for (int j = 0; j < kPerLane; j += 2) {
      const uint32_t h2 = cvt_e4m3x2_to_f16x2(u[j] | (u[j + 1] << 8));
      out[j] = f16_to_f32(static_cast<uint16_t>(h2)) * s;
      out[j + 1] = f16_to_f32(static_cast<uint16_t>(h2 >> 16)) * s;
    }
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if (C::kFp8) {
      out[j] = e4m3_to_f32(u[j]) * s;
    } else {
      // float(u - H) without a conversion: the code in the low mantissa bits of 2^23 is
      // 2^23 + u exactly, and subtracting 2^23 + H is exact (both integers below 2^24; a zero
      // difference is +0.0, as the conversion gives). One byte permute or LOP3 and one FADD.
      const float kBase = 8388608.0f + float(C::kH);
      out[j] = sub_rn(as_float(0x4B000000u | u[j]), kBase) * s;
    }
  }
}

// codec::wht32 over the quad: stages h = 1, 2, 4 inside the lane, 8 and 16 across lanes.
// Pair (a, b) -> (a + b, a - b); the lane holding the upper element computes partner - own.
AR_DEVICE void wht_quad(float (&v)[kPerLane], int q) {
#pragma unroll
  for (int h = 1; h < kPerLane; h *= 2) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if ((j & h) == 0) {
        const float a = v[j], b = v[j + h];
        v[j] = add_rn(a, b);
        v[j + h] = sub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float p = quad_xor<1>(v[j]);
    v[j] = (q & 1) ? sub_rn(p, v[j]) : add_rn(v[j], p);
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float p = quad_xor<2>(v[j]);
    v[j] = (q & 2) ? sub_rn(p, v[j]) : add_rn(v[j], p);
  }
}

AR_DEVICE float sign_of(int q, int j, float v) {
  return ((kHadamardSigns >> (q * kPerLane + j)) & 1u) ? -v : v;
}

// codec::hadamard_forward.
AR_DEVICE void hadamard_forward(float (&v)[kPerLane], int q) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = sign_of(q, j, v[j]);
  wht_quad(v, q);
}

// codec::hadamard_inverse (exact on decoded blocks, so the order is free; it is kept anyway).
AR_DEVICE void hadamard_inverse(float (&v)[kPerLane], int q) {
  wht_quad(v, q);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = sign_of(q, j, mul_rn(v[j], 0.03125f));
}

// codec::squared_error: per-element (a - b)^2, then the tree h = 4, 2, 1 inside each group of
// 8 (one lane's), then the four group sums as (g0 + g1) + (g2 + g3) across lanes. Every lane
// ends with the block's value.
AR_DEVICE float squared_error(const float (&a)[kPerLane], const float (&b)[kPerLane]) {
  float e[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float d = sub_rn(a[j], b[j]);
    e[j] = mul_rn(d, d);
  }
#pragma unroll
  for (int h = kPerLane / 2; h > 0; h /= 2)
#pragma unroll
    for (int j = 0; j < h; ++j) e[j] = add_rn(e[j], e[j + h]);
  float t = add_rn(e[0], quad_xor<1>(e[0]));
  return add_rn(t, quad_xor<2>(t));
}

// codec::encode_block (without the packing): the block's 8 codes of this lane and its field.
template <typename C>
AR_DEVICE uint16_t encode_quad(const float (&x)[kPerLane], int q, uint32_t (&u)[kPerLane]) {
  const Scan sc = C::kFp8 ? scan_amax_quad(x, q) : scan_quad(x, q);
  uint16_t field = encode_plain<C>(x, sc, u);
  if (C::kAdaptiveCodec) {
    // codec::choose_adaptive, computed for every block (the quad functions shuffle) and kept
    // only where the reference would try it and the Hadamard candidate is strictly better.
    float dec[kPerLane];
    decode_plain<C>(u, scale_value(field), dec);
    const float err_plain = squared_error(dec, x);
    float y[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) y[j] = x[j];
    hadamard_forward(y, q);
    uint32_t uh[kPerLane];
    const uint16_t fh = encode_plain<C>(y, scan_quad(y, q), uh);
    decode_plain<C>(uh, scale_value(fh), dec);
    hadamard_inverse(dec, q);
    const float err_h = squared_error(dec, x);
    const bool tried = sc.finite && sc.amax >= 0x1p-48f && sc.amax <= 0x1p48f;
    if (tried && err_plain != 0.0f && err_h < err_plain) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) u[j] = uh[j];
      field = fh | kFlagBit;
    }
  }
  return field;
}

// codec::decode_block (without the unpacking).
template <typename C>
AR_DEVICE void decode_quad(const uint32_t (&u)[kPerLane], uint16_t field, int q,
                           float (&out)[kPerLane]) {
  decode_plain<C>(u, scale_value(field), out);
  if (C::kAdaptiveCodec) {
    float t[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) t[j] = out[j];
    hadamard_inverse(t, q);  // every lane shuffles; only flagged blocks keep the result
    if (field & kFlagBit) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) out[j] = t[j];
    }
  }
}

// ---- Packing: this lane's 8 codes of block `k` in a segment's code region -------------------

// codec::pack. q8/fp8: 8 bytes at 8q. q4: bytes 4q..4q+3, element pairs in nibbles. q6: the
// low nibbles as q4 at 4q, the high 2-bit pairs at 16 + 2q (four elements a byte).
template <typename C>
AR_DEVICE void store_codes(char* block, int q, const uint32_t (&u)[kPerLane]) {
  if (C::kCodeBytes == 32) {
    const uint32_t lo = u[0] | (u[1] << 8) | (u[2] << 16) | (u[3] << 24);
    const uint32_t hi = u[4] | (u[5] << 8) | (u[6] << 16) | (u[7] << 24);
    *reinterpret_cast<uint2*>(block + 8 * q) = make_uint2(lo, hi);
  } else {
    uint32_t nib = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) nib |= (u[j] & 0xFu) << (4 * j);
    *reinterpret_cast<uint32_t*>(block + 4 * q) = nib;
    if (C::kCodeBytes == 24) {
      uint32_t top = 0;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) top |= (u[j] >> 4) << (2 * j);
      *reinterpret_cast<uint16_t*>(block + 16 + 2 * q) = static_cast<uint16_t>(top);
    }
  }
}

// codec::unpack. Loads through L2 only (.cg on CUDA): the bytes may come from a peer.
template <typename C>
AR_DEVICE void load_codes(const char* block, int q, uint32_t (&u)[kPerLane]) {
  if (C::kCodeBytes == 32) {
    const uint2 w = load_peer(reinterpret_cast<const uint2*>(block + 8 * q));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u[j] = (w.x >> (8 * j)) & 0xFFu;
      u[j + 4] = (w.y >> (8 * j)) & 0xFFu;
    }
  } else {
    const uint32_t nib = load_peer(reinterpret_cast<const uint32_t*>(block + 4 * q));
    uint32_t top = 0;
    if (C::kCodeBytes == 24) top = load_peer(reinterpret_cast<const uint16_t*>(block + 16 + 2 * q));
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) u[j] = ((nib >> (4 * j)) & 0xFu) | (((top >> (2 * j)) & 3u) << 4);
  }
}

}  // namespace ar
