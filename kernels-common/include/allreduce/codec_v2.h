// The format v2 codecs on the GPU: q8v2, q6v2, q4v2 and fp4 (docs/codecs.md, "Format v2").
// The specification is crates/core/src/codec/v2.rs; every function here says which reference
// function it matches bit for bit. Work shape, lane groups and the shuffle rule as in codec.h:
// a group of 32 / N lanes codes one block, lane q holding elements Nq..Nq+N-1, N = 8, 16 or 32.
//
// The integer encoder codes every block plain, with the carried largest element, and keeps
// that unless it is inexact and the Hadamard transform's scale is below kRotateScaleRatio times
// the plain one (v2.rs, encode_int): a prediction, so the rotated codes are computed only by
// the lane groups that keep them, and the plain codes are overwritten there before packing.
#pragma once

#include "allreduce/codec.h"

namespace ar {

// A v2 block's side fields, one value per side-field array: array 0's (`a`) and array 1's
// (`b`), each stored little-endian in kSide0 / kSide1 bytes.
struct Side2 {
  uint32_t a, b;
};

// Integer v2 codec of kBits bits: codes in [-H, H-1] biased by H; the carried element's
// integer K has kSpikeBits bits (v2.rs, spike_bits), its low kBits in its own code slot.
template <int kBits>
struct IntV2Codec {
  using Side = Side2;
  static constexpr bool kV2 = true;
  static constexpr bool kFp8 = false;
  static constexpr bool kFp4 = false;
  static constexpr bool kAdaptiveCodec = false;
  static constexpr int kH = 1 << (kBits - 1);
  static constexpr int kCodeBits = kBits;
  static constexpr int kCodeBytes = kBits * kBlock / 8;
  static constexpr int kSpikeBits = kBits == 4 ? 7 : kBits + 8;
  // q8v2/q6v2: a 24-bit scale word plus index and flag; q4v2: v1's 16-bit field.
  static constexpr bool kScale24 = kBits != 4;
  static constexpr int kSide0 = kScale24 ? 4 : 2, kSide1 = 1;
};
// OCP E2M1 codes (unbiased, bit 3 the sign), a power-of-two group exponent byte and two E4M3
// half scales.
struct Fp4Codec {
  using Side = Side2;
  static constexpr bool kV2 = true;
  static constexpr bool kFp8 = false;
  static constexpr bool kFp4 = true;
  static constexpr bool kAdaptiveCodec = false;
  static constexpr int kH = 0;
  static constexpr int kCodeBits = 4;
  static constexpr int kCodeBytes = 16;
  static constexpr int kSide0 = 1, kSide1 = 2;
};
using CodecQ8v2 = IntV2Codec<8>;
using CodecQ6v2 = IntV2Codec<6>;
using CodecQ4v2 = IntV2Codec<4>;
using CodecFp4 = Fp4Codec;

constexpr uint32_t kPoisonScale24 = 0x7FC00000u;  // v2::POISON_SCALE24
constexpr uint32_t kFp4Poison = 0xFFu;            // v2::FP4_POISON
constexpr float kRotateScaleRatio = 4.75f;        // v2::ROTATE_SCALE_RATIO

// max of two non-NaN values (which of two equal zeros is returned never matters here), as
// the target's one max instruction rather than a compare and a select. (Where an operand is a
// NaN, the block is poisoned or empty and the value is discarded.)
AR_DEVICE float max_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  float d;
  asm("max.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#elif AR_HIP
  return __builtin_fmaxf(a, b);
#else
  return a > b ? a : b;
#endif
}
AR_DEVICE float min_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  float d;
  asm("min.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#elif AR_HIP
  return __builtin_fminf(a, b);
#else
  return a < b ? a : b;
#endif
}

// The maximum over the lane group, in every lane: max is exact in any order.
template <int kN>
AR_DEVICE float group_max(float v) {
  if constexpr (kN <= 16) v = max_f(v, quad_xor<1>(v));
  if constexpr (kN <= 8) v = max_f(v, quad_xor<2>(v));
  return v;
}

// v2::round_scale24 of a value known not to be NaN, as an f32 bit pattern, low byte clear.
AR_DEVICE uint32_t round_scale24_bits(float s) {
  const uint32_t b = as_uint(s);
  return (b + 0x7Fu + ((b >> 8) & 1u)) & 0xFFFFFF00u;
}

// v2::round_to_scale.
template <typename C>
AR_DEVICE float round_to_scale(float s) {
  return as_float(C::kScale24 ? round_scale24_bits(s) : round_scale_bits(s));
}

// v2::first_max (no exclusion) and the finiteness test of v2::encode_int: the first element
// of largest magnitude, its block index, and whether every element is finite.
struct ScanK {
  bool finite;
  float m;
  int k;
};
template <int kN>
AR_DEVICE ScanK scan_k(const float (&x)[kN], int q) {
  float m = 0.0f, probe = 0.0f;
  int k = 0;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    probe = x[j] * 0.0f + probe;  // NaN once any element is Inf or NaN
    if (abs_f(x[j]) > abs_f(m)) {  // strict: the first of equal magnitudes wins
      m = x[j];
      k = q * kN + j;
    }
  }
  if (probe != 0.0f) m = as_float(0x7FC00000u);
  // As scan_quad: a NaN m wins every merge; otherwise the larger magnitude, and on a tie the
  // lower lane (its elements come first). A lane of zeros offers k = 0, which only an
  // all-zero block keeps, where the reference's index is 0 too.
  auto merge = [&](float pm, int pk, bool partner_lower) {
    const float a = abs_f(m), pa = abs_f(pm);
    if (pm != pm || pa > a || (pa == a && partner_lower)) {
      m = pm;
      k = pk;
    }
  };
  if constexpr (kN <= 16) {
    const float pm = quad_xor<1>(m);
    const int pk = int(quad_xor<1>(uint32_t(k)));
    merge(pm, pk, (q & 1) != 0);
  }
  if constexpr (kN <= 8) {
    const float pm = quad_xor<2>(m);
    const int pk = int(quad_xor<2>(uint32_t(k)));
    merge(pm, pk, (q & 2) != 0);
  }
  const bool finite = m == m;
  return ScanK{finite, finite ? m : 0.0f, finite ? k : 0};
}

// v2::balanced_scale over the elements given (the plain candidate passes its block with the
// carried element zeroed: a zero never raises p or n, so that is the reference's exclusion).
// The quotients by H are products by 2^-(b-1), exact and equal to the reference's correctly
// rounded divisions; those by H - 1 are divisions.
template <int kH, int kN>
AR_DEVICE float balanced_scale(const float (&x)[kN]) {
  constexpr float h = float(kH), inv_h = 1.0f / float(kH);
  float p = 0.0f, n = 0.0f;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    p = max_f(p, x[j]);
    n = max_f(n, -x[j]);
  }
  p = group_max<kN>(p);
  n = group_max<kN>(n);
  const float s_neg = max_f(mul_rn(p, inv_h), div_rn(n, h - 1.0f));
  const float s_pos = max_f(mul_rn(n, inv_h), div_rn(p, h - 1.0f));
  return s_neg <= s_pos ? -s_neg : s_pos;
}

// clamp(RNE(v), lo, hi) for |v| <= 2^22 (rne_small) and integer bounds: an integer, kept as a
// float (the carried element's K).
AR_DEVICE float code_of(float v, float lo, float hi) {
  return min_f(max_f(rne_small(v), lo), hi);
}

// The code of quotient v as 2^23 + H + clamp(RNE(v), -H, H-1): clamping first and rounding
// after is the same integer (the bounds are integers), and the sum lies in [2^23, 2^24), where
// f32 addition rounds to an integer, ties to even, like RNE (2^23 + H is even). Its
// significand's low bits are the biased code word (biased_bits), and minus 2^23 + H it is the
// code as an exact float. No conversion instruction: F2I and I2F issue at a quarter of the FMA
// rate.
template <typename C>
AR_DEVICE float biased_code(float v) {
  constexpr float h = float(C::kH);
  return add_rn(min_f(max_f(v, -h), h - 1.0f), 8388608.0f + h);
}
template <typename C>
AR_DEVICE uint32_t biased_bits(float t) {
  return as_uint(t) & ((1u << C::kCodeBits) - 1u);
}

// q[j] = div_rn(x[j], s) for every j: by codec.h's quotients_by_scale (one reciprocal a block,
// three operations an element) where the scale allows it, else by the division. Markstein's
// sequence is the correctly rounded quotient for every scale of at most 16 significant bits
// (v1's 7, v2's 24-bit scale words, fp4's E4M3 times a power of two): checked for every
// scale and dividend significand (crates/core/src/codec/tests.rs, `markstein_check24`). The
// branch is uniform over a lane group and holds no shuffle.
template <int kN>
AR_DEVICE void quotients(const float (&x)[kN], float s, float (&q)[kN]) {
  if (fast_scale(s)) {
    quotients_by_scale(x, s, q);
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) q[j] = div_rn(x[j], s);
  }
}

// ---- Integer v2 codecs -------------------------------------------------------------------

// The side fields of an integer block (v2::int_side) from its rounded scale, carried index
// and integer, and flag.
template <typename C>
AR_DEVICE Side2 int_side(float s, int k, int32_t kq, bool hadamard) {
  const uint32_t k_hi = uint32_t(kq >> C::kCodeBits) & ((1u << (C::kSpikeBits - C::kCodeBits)) - 1u);
  if constexpr (C::kScale24) {
    return Side2{as_uint(s) | (uint32_t(k) << 3) | uint32_t(hadamard), k_hi};
  } else {
    return Side2{(as_uint(s) >> 16) | uint32_t(hadamard ? kFlagBit : 0), uint32_t(k) | (k_hi << 5)};
  }
}

// v2::plain_candidate, coded: this lane's biased codes (the carried element's slot holding
// K's low bits) in `u`, and in `exact` whether it decodes to x exactly over the lane group
// (v2::encode_int's test). `empty` (a block of zeros or a poisoned one), or a scale that
// rounded to zero, gives v2's empty block (IntBlock::empty: codes H, K = 0 in slot 0, side
// fields zero), which counts as exact (such blocks are never rotated).
//
// The carried element is zeroed first (x0), which is the reference's exclusion in the scale,
// gives its slot code 0 and residual 0, and leaves one select per element for K's bits. For
// the others `code * S` is exact (at most 8 + 16 significant bits, normal wherever the choice
// is made), so `fma(-code, S, x) == 0` is the reference's `x == code * S`; the carried one is
// compared as the reference does, once.
template <typename C, int kN>
AR_DEVICE Side2 plain_v2(const float (&x)[kN], int q, const ScanK& sc, bool empty,
                         uint32_t (&u)[kN], float& s_out, bool& exact) {
  constexpr float kh = float(1 << (C::kSpikeBits - 1)), inv_kh = 1.0f / kh;
  constexpr float bias = 8388608.0f + float(C::kH);
  // A poisoned block is zeroed whole (its codes must be H; an Inf or NaN quotient would clamp
  // to a bound). A scale that rounds to zero leaves quotients by 1 of values below 2^-126,
  // which code as 0 too.
  float x0[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) x0[j] = q * kN + j == sc.k || !sc.finite ? 0.0f : x[j];
  const float rest = balanced_scale<C::kH>(x0);
  // m / KH: a product by 2^-(w-1), the reference's division exactly.
  const float s0 = mul_rn(abs_f(sc.m), inv_kh) <= abs_f(rest) ? rest : mul_rn(-sc.m, inv_kh);
  const float s = round_to_scale<C>(s0);
  empty = empty || s == 0.0f;
  const float kqf = empty ? 0.0f : code_of(div_rn(sc.m, s), -kh, kh - 1.0f);
  const int32_t kq = static_cast<int32_t>(kqf);
  const uint32_t k_low = uint32_t(kq) & ((1u << C::kCodeBits) - 1u);  // its slot's code word
  const int k = empty ? 0 : sc.k;
  float qt[kN];
  quotients(x0, empty ? 1.0f : s, qt);
  float off = 0.0f;  // the largest |x - code * S| of the others
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float t = biased_code<C>(qt[j]);
    off = max_f(off, abs_f(fma_rn(-sub_rn(t, bias), s, x0[j])));
    u[j] = q * kN + j == k ? k_low : biased_bits<C>(t);
  }
  // Every lane of the warp shuffles (group_max): the blocks of one warp differ in `empty`.
  off = group_max<kN>(off);
  exact = empty || (off == 0.0f && sc.m == mul_rn(kqf, s));
  s_out = s;
  return int_side<C>(empty ? 0.0f : s, k, kq, false);
}

// v2::hadamard_candidate's scale: the transform of x in `y`, and the rounded balanced scale.
template <typename C, int kN>
AR_DEVICE float hadamard_scale_v2(const float (&x)[kN], int q, float (&y)[kN]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) y[j] = x[j];
  hadamard_forward(y, q);
  return round_to_scale<C>(balanced_scale<C::kH>(y));
}

// v2::hadamard_candidate's codes from the transform and its scale.
template <typename C, int kN>
AR_DEVICE void hadamard_codes_v2(const float (&y)[kN], float s, uint32_t (&u)[kN]) {
  float qt[kN];
  quotients(y, s, qt);
#pragma unroll
  for (int j = 0; j < kN; ++j) u[j] = biased_bits<C>(biased_code<C>(qt[j]));
}

// v2::encode_int, packed: this lane's code words and the block's side fields. The plain
// candidate is always coded (its exactness is part of the choice); the transform and its scale
// are computed by every lane (they shuffle inside the lane group, and every lane of a warp
// must shuffle together); the rotated codes only where the group keeps them (`rotate` is
// uniform over the lane group, and the coding holds no shuffle).
template <typename C, int kN>
AR_DEVICE Side2 encode_int_v2(const float (&x)[kN], int q, Codes<C, kN>& out) {
  const ScanK sc = scan_k(x, q);
  const bool empty = !sc.finite || sc.m == 0.0f;
  uint32_t u[kN];
  float s_p;
  bool exact;
  Side2 side = plain_v2<C>(x, q, sc, empty, u, s_p, exact);
  float y[kN];
  const float s_h = hadamard_scale_v2<C>(x, q, y);
  const float amax = abs_f(sc.m);
  const bool tried = !exact && amax >= 0x1p-48f && amax <= 0x1p48f;
  if (tried && abs_f(s_h) < mul_rn(kRotateScaleRatio, abs_f(s_p))) {
    hadamard_codes_v2<C>(y, s_h, u);
    side = int_side<C>(s_h, 0, 0, true);
  }
  pack_codes(u, out);
  if (!sc.finite) side.a = C::kScale24 ? kPoisonScale24 : uint32_t(kPoisonScale);
  return side;
}

// v2 IntBlock::decode after int_read: codes as unpack_codes gives them (the f32 bits of
// 2^23 + code).
template <typename C, int kN>
AR_DEVICE void decode_int_v2(const uint32_t (&u)[kN], Side2 side, int q, float (&out)[kN]) {
  float s;
  bool flagged;
  int k;
  uint32_t k_hi;
  if constexpr (C::kScale24) {
    s = as_float(side.a & 0xFFFFFF00u);
    flagged = (side.a & 1u) != 0;
    k = int((side.a >> 3) & 31u);
    k_hi = side.b & 0xFFu;
  } else {
    s = scale_value(uint16_t(side.a));
    flagged = (side.a & kFlagBit) != 0;
    k = int(side.b & 31u);
    k_hi = (side.b >> 5) & 7u;
  }
  const float kBase = 8388608.0f + float(C::kH);
  // The carried K (plain blocks): its slot's low bits under k_hi, sign-extended from
  // kSpikeBits; picked out with a select per element (a run-time register index would go
  // through local memory), converted once.
  uint32_t low = 0;
#pragma unroll
  for (int j = 0; j < kN; ++j) low = q * kN + j == k ? u[j] : low;
  const uint32_t raw = (k_hi << C::kCodeBits) | (low & ((1u << C::kCodeBits) - 1u));
  const float kv = float(int32_t(raw << (32 - C::kSpikeBits)) >> (32 - C::kSpikeBits));
  float t[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) t[j] = sub_rn(as_float(u[j]), kBase);  // code - H, exact
  float c[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) c[j] = !flagged && q * kN + j == k ? kv : t[j];
  wht_quad(t, q);  // every lane shuffles; only flagged blocks keep the result
  const uint32_t lane_signs = kHadamardSigns >> (q * kN);
  const float m = flagged ? mul_rn(s, 0.03125f) : s;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const uint32_t sign = (lane_signs << (31 - j)) & 0x80000000u;
    out[j] = mul_rn(flagged ? as_float(as_uint(t[j]) ^ sign) : c[j], m);
  }
}

// ---- fp4 ---------------------------------------------------------------------------------

// fp4::f32_to_e2m1 of a finite value (the encoder's quotients always are; a NaN would give 7,
// where the reference gives 0): nearest, ties to the even code, saturating at 6, zero -> 0.
// E2M1's steps are 0.5 below 2, 1 below 4 and 2 above, so the code is an offset plus the
// nearest-even integer of a times 2, 1 or 1/2 (an exact product): the ties (0.25, 0.75, ...,
// 5) land on even integers as E2M1's ties land on even codes. The offset (0, 2 or 4) rides in
// the rounding constant 1.5 * 2^23, whose low bits are clear. The sign bit goes with every
// magnitude above 0.25, the ones that round above zero. Equal to the reference's seven threshold
// comparisons for all finite inputs (an offset-and-round form was checked against them over
// all 2^32 inputs; this one differs from it only in where the offset is added and in NaN).
AR_DEVICE uint32_t f32_to_e2m1(float x) {
  const float a = min_f(abs_f(x), 6.0f);
  const bool lo = a < 2.0f, mid = a < 4.0f;
  const float t = mul_rn(a, lo ? 2.0f : (mid ? 1.0f : 0.5f));
  const float round = lo ? 12582912.0f : (mid ? 12582914.0f : 12582916.0f);
  const uint32_t mag = as_uint(add_rn(t, round)) & 7u;
  return x < -0.25f ? (mag | 8u) : mag;
}

// fp4::e2m1_to_f32 (exact): the three magnitude bits at f32 bits 22..24 are the value times
// 2^-126 (an f32 subnormal for exponent 0, like E2M1's 0.5), so one exact product rescales.
AR_DEVICE float e2m1_to_f32(uint32_t c) {
  return as_float(as_uint(as_float((c & 7u) << 22) * 0x1p126f) | ((c & 8u) << 28));
}

// v2::fp4_exponent.
AR_DEVICE int fp4_exponent(float a) {
  const uint32_t b = as_uint(div_rn(a, 2688.0f));
  const int biased = int(b >> 23);
  if (biased == 0) return -126;
  const int e = biased - 127 + int((b & 0x7FFFFFu) != 0);
  return e < -126 ? -126 : (e > 127 ? 127 : e);
}

// v2::encode_fp4, packed.
template <typename C, int kN>
AR_DEVICE Side2 encode_fp4(const float (&x)[kN], int q, Codes<C, kN>& out) {
  const Scan sc = scan_amax_quad(x, q);
  // The halves' largest magnitudes, in every lane: ah[0] of elements 0..15, ah[1] of 16..31.
  float ah[2];
  if constexpr (kN == 32) {
    ah[0] = ah[1] = 0.0f;
#pragma unroll
    for (int j = 0; j < kN; ++j) ah[j / 16] = max_f(ah[j / 16], abs_f(x[j]));
  } else {
    float own = 0.0f;
#pragma unroll
    for (int j = 0; j < kN; ++j) own = max_f(own, abs_f(x[j]));
    if constexpr (kN == 8) own = max_f(own, quad_xor<1>(own));
    const float other = kN == 8 ? quad_xor<2>(own) : quad_xor<1>(own);
    const bool low = q * kN < 16;
    ah[0] = low ? own : other;
    ah[1] = low ? other : own;
  }
  uint32_t u[kN];
  const bool live = sc.finite && sc.amax != 0.0f;
  const int e = live ? fp4_exponent(sc.amax) : 0;
  const float g = as_float(uint32_t(e + 127) << 23);
  uint32_t sc8[2];
  float s[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sc8[i] = live ? f32_to_e4m3(div_rn(div_rn(ah[i], 6.0f), g)) : 0u;
    // v2::encode_fp4: a half scale whose code 6 would overflow takes the next lower E4M3.
    sc8[i] -= mul_rn(mul_rn(e4m3_to_f32(sc8[i]), g), 6.0f) > 3.40282347e38f ? 1u : 0u;
    s[i] = mul_rn(e4m3_to_f32(sc8[i]), g);
  }
  // Each half's quotients by its own scale (kN <= 16: a lane's elements share one half).
  float qt[kN];
  if constexpr (kN == 32) {
    float xs[16], qs[16];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
      for (int j = 0; j < 16; ++j) xs[j] = x[16 * hh + j];
      quotients(xs, s[hh] != 0.0f ? s[hh] : 1.0f, qs);
#pragma unroll
      for (int j = 0; j < 16; ++j) qt[16 * hh + j] = qs[j];
    }
  } else {
    const float sl = q * kN < 16 ? s[0] : s[1];  // a select: an index would go through local memory
    quotients(x, sl != 0.0f ? sl : 1.0f, qt);
  }
  // Codes of a dead block (zero or poisoned) or of a half whose scale rounded to zero are 0:
  // a mask per half, not a condition per element (nvcc branched around each conversion).
  const uint32_t mask0 = live && s[0] != 0.0f ? 15u : 0u, mask1 = live && s[1] != 0.0f ? 15u : 0u;
#pragma unroll
  for (int j = 0; j < kN; ++j) u[j] = f32_to_e2m1(qt[j]) & (q * kN + j < 16 ? mask0 : mask1);
  pack_codes(u, out);
  if (!sc.finite) return Side2{kFp4Poison, 0u};
  if (!live) return Side2{0u, 0u};
  return Side2{uint32_t(e + 127), sc8[0] | (sc8[1] << 8)};
}

// v2::decode_fp4 after unpack_codes (each code in the low 4 bits of its word).
template <int kN>
AR_DEVICE void decode_fp4(const uint32_t (&u)[kN], Side2 side, int q, float (&out)[kN]) {
  const uint32_t gb = side.a & 0xFFu;
  const float g = gb == kFp4Poison ? as_float(0x7FC00000u) : as_float(gb << 23);
  const float s0 = mul_rn(e4m3_to_f32(side.b & 0xFFu), g);
  const float s1 = mul_rn(e4m3_to_f32((side.b >> 8) & 0xFFu), g);
#pragma unroll
  for (int j = 0; j < kN; ++j) out[j] = mul_rn(e2m1_to_f32(u[j]), (q * kN + j) < 16 ? s0 : s1);
}

// v2::encode_block / v2::decode_block.
template <typename C, int kN>
AR_DEVICE Side2 encode_v2(const float (&x)[kN], int q, Codes<C, kN>& out) {
  if constexpr (C::kFp4)
    return encode_fp4<C>(x, q, out);
  else
    return encode_int_v2<C>(x, q, out);
}
template <typename C, int kN>
AR_DEVICE void decode_v2(const uint32_t (&u)[kN], Side2 side, int q, float (&out)[kN]) {
  if constexpr (C::kFp4)
    decode_fp4(u, side, q, out);
  else
    decode_int_v2<C>(u, side, q, out);
}

}  // namespace ar
