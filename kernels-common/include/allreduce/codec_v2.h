// The format v2 codecs on the GPU: q8v2, q6v2, q4v2 and fp4 (docs/codecs.md, "Format v2").
// The specification is crates/core/src/codec/v2.rs; every function here says which reference
// function it matches bit for bit. Work shape, lane groups and the shuffle rule as in codec.h:
// a group of 32 / N lanes codes one block, lane q holding elements Nq..Nq+N-1, N = 8, 16 or 32.
//
// The integer encoder codes every block plain, with the carried largest element, and keeps
// that unless it is inexact and the block's L1 norm is below kRotateL1Ratio H |S_p| (v2.rs,
// encode_int): a prediction from the plain candidate alone, so the transform is computed only
// by the lanes that keep it (a lane per block; quads shuffle inside it, so there every lane of
// the warp computes it), and the plain codes are overwritten there before packing.
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
constexpr float kRotateL1Ratio = 8.0f;            // v2::ROTATE_L1_RATIO

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
//
// p and n are maxima of bit patterns, two elements an instruction (max3_s32 / max3_u32):
// non-negative f32 order as their bits do as signed integers, where every negative one is
// below the starting 0; negative ones order by magnitude as unsigned integers, all above every
// non-negative one and the starting -0.0 (0x80000000). The elements are never NaN where the
// result is used (a poisoned block is zeroed; the quads' transform of one is discarded).
template <int kH, int kN>
AR_DEVICE float balanced_scale(const float (&x)[kN]) {
  static_assert(kN % 2 == 0, "pairs of elements");
  constexpr float h = float(kH), inv_h = 1.0f / float(kH);
  int32_t pb = 0;
  uint32_t nb = 0x80000000u;
#pragma unroll
  for (int j = 0; j < kN; j += 2) {
    pb = max3_s32(pb, int32_t(as_uint(x[j])), int32_t(as_uint(x[j + 1])));
    nb = max3_u32(nb, as_uint(x[j]), as_uint(x[j + 1]));
  }
  const float p = group_max<kN>(as_float(uint32_t(pb)));
  const float n = group_max<kN>(as_float(nb ^ 0x80000000u));
  const float s_neg = max_f(mul_rn(p, inv_h), div_rn(n, h - 1.0f));
  const float s_pos = max_f(mul_rn(n, inv_h), div_rn(p, h - 1.0f));
  return s_neg <= s_pos ? -s_neg : s_pos;
}

// clamp(RNE(v), lo, hi) for |v| <= 2^22 (rne_small) and integer bounds: an integer, kept as a
// float (the carried element's K).
AR_DEVICE float code_of(float v, float lo, float hi) {
  return min_f(max_f(rne_small(v), lo), hi);
}

// v2::finite_code: a code c (an integer, |c| >= 1 wherever it matters) whose decoded value
// c * S rounds to +-Inf, one toward zero.
AR_DEVICE float finite_code(float c, float s) {
  return abs_f(mul_rn(c, s)) > 3.40282347e38f ? sub_rn(c, c > 0.0f ? 1.0f : -1.0f) : c;
}

// A quotient's code clamp(RNE(v), -H, H-1), for a quotient by a balanced scale (below): as
// its biased code word H + code (code_bits: the f32 subnormal (v + H) 2^-149 rounded onto the
// subnormal grid of step 2^-149 is RNE(v + H) = RNE(v) + H, H even; nothing above the word's
// bits but a sign, one FMA), and as an exact float (rne_small). No conversion instruction (F2I
// and I2F issue at a quarter of the FMA rate) and one clamp, not two: a balanced scale
// (v2::balanced_scale) is at least p / H and n / (H - 1) on one sign and the other, and
// rounded to a scale word it loses at most 2^-8 of itself (16 significant bits, or q4v2's 7),
// so every quotient lies in [-H (1 + 2^-7), H (1 + 2^-7)] and rounds to [-H, H]: only H
// needs the clamp. (Where the plain candidate's scale comes from the carried element instead,
// it is larger than the balanced one, which only shrinks the others' quotients.) That holds
// where quotients() divides by a normal scale of that many bits; its other path clamps.
template <typename C>
AR_DEVICE float clamp_top(float v) {
  return min_f(v, float(C::kH) - 1.0f);
}
// A quotient just below -H gives code 0 as -0.0: its sign bit reads as a negative s32, which
// the saturating packs take to 0 (kPackSatN); the other packs need it cleared.
template <typename C, int kN>
AR_DEVICE uint32_t code_bits(float v_clamped) {
  constexpr float unit = 0x1p-149f;
  const uint32_t b = as_uint(fma_rn(v_clamped, unit, float(C::kH) * unit));
  return kPackSatN<C, kN> ? b : b & 0x7FFFFFFFu;
}

// q[j] = div_rn(x[j], s) for every j: by codec.h's quotients_by_scale (one reciprocal a block,
// three operations an element) where the scale allows it, else by the division. Markstein's
// sequence is the correctly rounded quotient for every scale of at most 16 significant bits
// (v1's 7, v2's 24-bit scale words, fp4's E4M3 times a power of two): checked for every
// scale and dividend significand (crates/core/src/codec/tests.rs, `markstein_check24`). The
// branch is uniform over a lane group and holds no shuffle. The division path serves zero,
// subnormal and extreme scales, where a subnormal one has fewer significant bits than the
// integer codes' one-sided clamp relies on (clamp_top), so for integer codes (kH > 0) it
// clamps to their bounds [-kH, kH - 1] here (fp4's conversion saturates by itself).
template <int kN, int kH = 0>
AR_DEVICE void quotients(const float (&x)[kN], float s, float (&q)[kN]) {
  if (fast_scale(s)) {
    quotients_by_scale(x, s, q);
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float v = div_rn(x[j], s);
      q[j] = kH > 0 ? min_f(max_f(v, -float(kH)), float(kH) - 1.0f) : v;
    }
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

// v2::plain_candidate, coded: this lane's biased codes in `u`, the carried element's slot
// holding code H (patch_carried puts K's low bits there after packing), its index in `k` and
// K's low bits in `k_low`, and in `exact` whether the block decodes to x exactly over the
// lane group (v2::encode_int's test). `empty` (a block of zeros or a poisoned one), or a scale that
// rounded to zero, gives v2's empty block (IntBlock::empty: codes H, K = 0 in slot 0, side
// fields zero), which counts as exact (such blocks are never rotated).
//
// The carried element is zeroed first (x0), which is the reference's exclusion in the scale
// and gives its slot code H and residual 0. For the others `code * S` is exact (at most
// 8 + 16 significant bits, normal wherever the choice is made), so `fma(-code, S, x) == 0` is
// the reference's `x == code * S`; the residuals' magnitudes are summed (FMA pipe; a sum of
// non-negative values is zero only if every one is), and the carried one is compared as the
// reference does, once.
template <typename C, int kN>
AR_DEVICE Side2 plain_v2(const float (&x)[kN], int q, const ScanK& sc, bool empty,
                         uint32_t (&u)[kN], int& k, uint32_t& k_low, float& s_out,
                         bool& exact) {
  constexpr float kh = float(1 << (C::kSpikeBits - 1)), inv_kh = 1.0f / kh;
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
  const float kqf = empty ? 0.0f : finite_code(code_of(div_rn(sc.m, s), -kh, kh - 1.0f), s);
  const int32_t kq = static_cast<int32_t>(kqf);
  k_low = uint32_t(kq) & ((1u << C::kCodeBits) - 1u);  // its slot's code word
  k = empty ? 0 : sc.k;
  float qt[kN];
  quotients<kN, C::kH>(x0, empty ? 1.0f : s, qt);
  // Below H |S| = 2^127 no code can decode past f32's maximum (group-uniform, almost never
  // taken): the reference's finite_code on every code only where it can change one.
  if (abs_f(s) >= 0x1p127f / float(C::kH)) {
#pragma unroll
    for (int j = 0; j < kN; ++j) qt[j] = finite_code(rne_small(clamp_top<C>(qt[j])), s);
  }
  float off = 0.0f;  // the sum of |x - code * S| over the others
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float v = clamp_top<C>(qt[j]);
    off = add_rn(off, abs_f(fma_rn(-rne_small(v), s, x0[j])));
    u[j] = code_bits<C, kN>(v);
  }
  // Every lane of the warp shuffles (group_max): the blocks of one warp differ in `empty`.
  off = group_max<kN>(off);
  exact = empty || (off == 0.0f && sc.m == mul_rn(kqf, s));
  s_out = s;
  return int_side<C>(empty ? 0.0f : s, k, kq, false);
}

// Puts `bits` into code slot k (a block index) of the packed codes, where slot k holds code
// H: an XOR of (H ^ bits) at the slot's place in the word that holds it, a select per word
// rather than per code (codec::pack's layout: q8 byte j; q4 nibble j; q6 its low nibble as
// q4's and its top two bits at pair j of the words after them).
template <typename C, int kN>
AR_DEVICE void patch_carried(Codes<C, kN>& c, int q, int k, uint32_t bits) {
  const int j = k - q * kN;  // this lane's slot, or out of [0, kN)
  const uint32_t d = (bits ^ uint32_t(C::kH)) & ((1u << C::kCodeBits) - 1u);
  if constexpr (C::kCodeBytes == 32) {
#pragma unroll
    for (int i = 0; i < kN / 4; ++i) c.w[i] ^= j >> 2 == i ? d << (8 * (j & 3)) : 0u;
  } else {
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) c.w[i] ^= j >> 3 == i ? (d & 15u) << (4 * (j & 7)) : 0u;
    if constexpr (C::kCodeBytes == 24) {
#pragma unroll
      for (int i = 0; i < (kN + 15) / 16; ++i)
        c.w[kN / 8 + i] ^= j >> 4 == i ? (d >> 4) << (2 * (j & 15)) : 0u;
    }
  }
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
  quotients<kN, C::kH>(y, s, qt);
#pragma unroll
  for (int j = 0; j < kN; ++j) u[j] = code_bits<C, kN>(clamp_top<C>(qt[j]));
}

// v2::encode_int, packed: this lane's code words and the block's side fields. The plain
// candidate is always coded (its exactness is part of the choice); the transform, its scale
// and its codes only where the block keeps them (`rotate` is uniform over the lane group). A
// lane per block makes no shuffle there, so only the rotating lanes work (a few blocks in a
// hundred on Gaussian data); quads shuffle inside the transform and the scale, which every
// lane of the warp must make together, so there all compute them and only the coding is
// conditional.
template <typename C, int kN>
AR_DEVICE Side2 encode_int_v2(const float (&x)[kN], int q, Codes<C, kN>& out) {
  const ScanK sc = scan_k(x, q);
  const float l1 = abs_sum(x);  // beside the scan, while x is in registers; quads shuffle
  const bool empty = !sc.finite || sc.m == 0.0f;
  uint32_t u[kN], k_low;
  int k;
  float s_p;
  bool exact;
  Side2 side = plain_v2<C>(x, q, sc, empty, u, k, k_low, s_p, exact);
  const float amax = abs_f(sc.m);
  // v2::rotate_threshold: 8 H is a power of two, so the product is exact.
  const bool rotate = !exact && amax >= 0x1p-48f && amax <= 0x1p48f &&
                      l1 < mul_rn(kRotateL1Ratio * float(C::kH), abs_f(s_p));
  if (kN == 32 ? rotate : true) {
    float y[kN];
    const float s_h = hadamard_scale_v2<C>(x, q, y);
    if (rotate) {
      hadamard_codes_v2<C>(y, s_h, u);
      side = int_side<C>(s_h, 0, 0, true);
    }
  }
  pack_codes(u, out);
  if (!rotate) patch_carried(out, q, k, k_low);
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

// fp4::f32_to_e2m1 of a finite value (the encoder's quotients always are; a NaN would not
// give the reference's 0): nearest, ties to the even code, saturating at 6, zero -> 0.
// E2M1's magnitude code is the nearest-even integer of min(2a, a + 2, a / 2 + 4), a = |x|
// clamped to 6: the three lines are its steps of 0.5 below 2, 1 up to 4 and 2 above (each
// meets the next where the steps change), and their ties (0.25, 0.75, ..., 5) land on even
// integers as E2M1's ties land on even codes; rounding is monotone, so it may go inside the
// minimum. Each line is rounded exactly by one FMA onto the f32 subnormal grid (step 2^-149,
// ties to even; 2 and 4 are even, so RNE(a + 2) = RNE(a) + 2), whose bits are then the code
// itself, and the three codes' minimum is one integer instruction (non-negative f32 bits
// order as the values). The sign goes with every magnitude above 0.25, the ones that round
// above zero. Equal to the reference's seven threshold comparisons for every finite f32
// (checked over all 2^32 patterns).
AR_DEVICE uint32_t f32_to_e2m1(float x) {
  constexpr float unit = 0x1p-149f;
  const float a = min_f(abs_f(x), 6.0f);
  const uint32_t c1 = as_uint(mul_rn(a, 2.0f * unit));
  const uint32_t c2 = as_uint(fma_rn(a, unit, 2.0f * unit));
  const uint32_t c3 = as_uint(fma_rn(mul_rn(a, 0.5f), unit, 4.0f * unit));  // 2^-150 is 0 in f32
  const uint32_t mag = min3_u32(c1, c2, c3);
  return x < -0.25f ? (mag | 8u) : mag;
}

// fp4::e2m1_to_f32 (exact): the three magnitude bits at f32 bits 22..24 are the value times
// 2^-126 (an f32 subnormal for exponent 0, like E2M1's 0.5), so one exact product rescales.
AR_DEVICE float e2m1_to_f32(uint32_t c) {
  return as_float(as_uint(as_float((c & 7u) << 22) * 0x1p126f) | ((c & 8u) << 28));
}

// v2::fp4_exponent.
AR_DEVICE int fp4_exponent(float a) {
  const uint32_t b = as_uint(div_rn(a, 1792.0f));
  const int biased = int(b >> 23);
  if (biased == 0) return -126;
  const int e = biased - 127 + int((b & 0x7FFFFFu) != 0);
  return e < -126 ? -126 : (e > 127 ? 127 : e);
}

// v2::encode_fp4, packed.
template <typename C, int kN>
AR_DEVICE Side2 encode_fp4(const float (&x)[kN], int q, Codes<C, kN>& out) {
  // The halves' largest magnitudes, in every lane: ah[0] of elements 0..15, ah[1] of 16..31.
  // With a NaN-propagating max they also give the block's amax and finiteness (Inf is the
  // largest magnitude, a NaN wins over everything), one instruction per element in all.
  // The halves' smallest nonzero magnitudes likewise (al; a NaN's effect on them is discarded
  // with the poisoned block): a half whose two are equal maps to 4 (v2::FP4_CONSTANT_TOP).
  // Minima of |x|'s bits minus 1, two elements an instruction: a zero wraps to the largest
  // pattern and never wins; a half of zeros gives 0 back, the same scale 0 as the reference.
  float ah[2], al[2];
  auto amax_of = [](float a, float b) {
#if AR_MAX_NAN
    return max_nan(a, b);
#else
    return max_f(a, b);
#endif
  };
  auto nz_bits = [](float v) { return as_uint(abs_f(v)) - 1u; };
  if constexpr (kN == 32) {
    ah[0] = abs_f(x[0]);
    ah[1] = abs_f(x[16]);
    uint32_t lb[2] = {nz_bits(x[0]), nz_bits(x[16])};
#pragma unroll
    for (int j = 1; j < 16; ++j) {
      ah[0] = amax_of(ah[0], abs_f(x[j]));
      ah[1] = amax_of(ah[1], abs_f(x[16 + j]));
    }
#pragma unroll
    for (int j = 1; j < 15; j += 2) {
      lb[0] = min3_u32(lb[0], nz_bits(x[j]), nz_bits(x[j + 1]));
      lb[1] = min3_u32(lb[1], nz_bits(x[16 + j]), nz_bits(x[17 + j]));
    }
    lb[0] = min3_u32(lb[0], nz_bits(x[15]), lb[0]);
    lb[1] = min3_u32(lb[1], nz_bits(x[31]), lb[1]);
    al[0] = as_float(lb[0] + 1u);
    al[1] = as_float(lb[1] + 1u);
  } else {
    float own = abs_f(x[0]);
    uint32_t own_lb = nz_bits(x[0]);
#pragma unroll
    for (int j = 1; j < kN; ++j) own = amax_of(own, abs_f(x[j]));
#pragma unroll
    for (int j = 1; j + 1 < kN; j += 2) own_lb = min3_u32(own_lb, nz_bits(x[j]), nz_bits(x[j + 1]));
    own_lb = min3_u32(own_lb, nz_bits(x[kN - 1]), own_lb);
    if constexpr (kN == 8) {
      own = amax_of(own, quad_xor<1>(own));
      const uint32_t p = quad_xor<1>(own_lb);
      own_lb = p < own_lb ? p : own_lb;
    }
    const float other = kN == 8 ? quad_xor<2>(own) : quad_xor<1>(own);
    const uint32_t other_lb = kN == 8 ? quad_xor<2>(own_lb) : quad_xor<1>(own_lb);
    const bool low = q * kN < 16;
    ah[0] = low ? own : other;
    ah[1] = low ? other : own;
    al[0] = as_float((low ? own_lb : other_lb) + 1u);
    al[1] = as_float((low ? other_lb : own_lb) + 1u);
  }
#if AR_MAX_NAN
  const float a = max_nan(ah[0], ah[1]);
  const bool finite = a < as_float(0x7f800000u);  // false for Inf and NaN
  const Scan sc{finite, finite ? a : 0.0f, finite ? a : 0.0f};
#else
  const Scan sc = scan_amax_quad(x, q);
#endif
  uint32_t u[kN];
  const bool live = sc.finite && sc.amax != 0.0f;
  const int e = live ? fp4_exponent(sc.amax) : 0;
  const float g = as_float(uint32_t(e + 127) << 23);
  uint32_t sc8[2];
  float s[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sc8[i] = live ? f32_to_e4m3(div_rn(div_rn(ah[i], al[i] == ah[i] ? 4.0f : 6.0f), g)) : 0u;
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
#pragma unroll
  for (int j = 0; j < kN; ++j) u[j] = f32_to_e2m1(qt[j]);
  pack_codes(u, out);
  // Codes of a dead block (zero or poisoned) or of a half whose scale rounded to zero are 0:
  // a mask per packed word of 8 codes, not a condition per code.
  const uint32_t mask0 = live && s[0] != 0.0f ? ~0u : 0u, mask1 = live && s[1] != 0.0f ? ~0u : 0u;
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) out.w[i] &= q * kN + 8 * i < 16 ? mask0 : mask1;
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
