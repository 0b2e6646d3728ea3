//! Reference block codecs of the quantized all-reduce.
//!
//! This is the specification GPU kernels must match bit for bit; `docs/codecs.md` describes
//! the same format in prose, with a worked example.
//!
//! * Blocks of [`BLOCK`] = 32 elements, one 16-bit scale per block, symmetric.
//! * Encoder input is f32, decoder output is f32.
//! * Scale field: a bf16 bit pattern whose mantissa LSB (bit 0, [`FLAG_BIT`]) is not part of
//!   the value. Plain codecs write it 0 and ignore it; the adaptive codecs (Q8a/Q6a/Q4a) set
//!   it on blocks coded in the Hadamard domain ([`hadamard_forward`], [`hadamard_inverse`]).
//! * Integer codecs (Q8/Q6/Q4, `H = 2^(b-1)`): the element of largest magnitude `m` maps to
//!   code `-H` (scale `s = round_scale(-m / H)`), codes are `clamp(rne(x / s), -H, H-1) + H`.
//! * FP8: `s = round_scale(amax / 256)` ([`FP8_BLOCK_MAX`]), codes are `f32_to_e4m3(x / s)`.
//! * A block with any Inf or NaN is poisoned: scale [`POISON_SCALE`], zero codes; it decodes
//!   to 32 NaNs.
//! * Adaptive integer codecs: each block is also transformed, `y = H32 * (D * x)`
//!   (unnormalized; the inverse divides by 32), and coded as `y` when its scale predicts the
//!   smaller error: `s_y^2 < 32 s_x^2` with `s_x`, `s_y` the two blocks' scale values (plain on
//!   ties), the choice recorded in [`FLAG_BIT`]. Only blocks with `amax` in
//!   [[`ADAPTIVE_MIN_AMAX`], [`ADAPTIVE_MAX_AMAX`]] and more than one nonzero magnitude can
//!   be transformed.
//!
//! * Format v2 (q8v2, q6v2, q4v2, fp4; `v2.rs`, `fp4.rs`): more than one side field per
//!   block, each in its own array of the segment ([`Codec::side_widths`]); blocks go through
//!   [`encode_block_with_side`] / [`decode_block_with_side`].
//!
//! Every division is the IEEE correctly rounded f32 division (`div.rn.f32` / `__fdiv_rn`,
//! never a reciprocal multiply or fast-math division) and every product a single correctly
//! rounded f32 multiply; subnormals are not flushed.

mod fp4;
mod fp8;
#[cfg(test)]
mod prop_config;
#[cfg(test)]
mod tests;
pub(crate) mod v2;
#[cfg(test)]
mod v2_tests;

pub use fp4::{e2m1_to_f32, f32_to_e2m1, E2M1_MAX};
pub use fp8::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
pub use v2::{round_scale24, scale24_value, POISON_SCALE24};

use crate::Codec;

/// Elements per block.
pub const BLOCK: usize = 32;

/// Bit 0 of the scale field: the "adaptive" flag. The plain codecs write 0 and ignore it;
/// the adaptive codecs set it on a block coded in the Hadamard domain. [`scale_value`]
/// masks it off.
pub const FLAG_BIT: u16 = 1;

/// The diagonal `D` of the adaptive codecs' transform: element `i` of a block is negated
/// before the Walsh-Hadamard transform (and after the inverse) when bit `i` is set.
/// 0x6A09E667 (the first 32 fraction bits of sqrt(2), SHA-256's first IV word): 16 of the
/// 32 bits set. The signs keep structured blocks (constant, smooth, alternating) from
/// collapsing onto one Hadamard row, which would turn them into a spike.
pub const HADAMARD_SIGNS: u32 = 0x6A09_E667;

/// 2^-48: below this block maximum the adaptive codecs code the block plain.
pub const ADAPTIVE_MIN_AMAX: f32 = f32::from_bits((127 - 48) << 23);
/// 2^48: above this block maximum the adaptive codecs code the block plain.
///
/// Why a range: inside it, every step of the Hadamard candidate stays in the f32 normal range
/// with room to spare (the transformed block is at most 32 x larger, its decode at most
/// 32 x 129/128 x larger again), so the inverse transform is exact and no scale is
/// subnormal.
/// Outside it (f32 extremes no f16/bf16 activation reaches in practice) plain coding keeps
/// the plain codec's documented behaviour.
pub const ADAPTIVE_MAX_AMAX: f32 = f32::from_bits((127 + 48) << 23);

/// The E4M3 value fp8 maps a block's largest magnitude to: 2^8, the bottom of E4M3's top
/// binade, rather than its largest value 448. A power of two keeps the scale `amax / 256` on
/// the same grid as `amax`, so a constant block (any value of at most 7 significant bits) and
/// the all-reduce's sums of constants code exactly; `448 = 7 * 2^6` puts a factor 7 into the
/// scale, and all-ones came back as 0.998. It also measures 0.25 dB better on N(0,1): a block
/// then ends at a binade's top instead of at 1.75 * 2^8, where E4M3's steps are coarsest.
pub const FP8_BLOCK_MAX: f32 = 256.0;

/// Scale field of a block that held an Inf or a NaN: a bf16 quiet NaN, flag bit clear.
pub const POISON_SCALE: u16 = 0x7FC0;

/// 2^-133: half the spacing of scale values below 2^-125 (the grid there is 2^-132).
const SCALE_HALF_GRID_MIN: f64 = 1.0 / (1u128 << 100) as f64 / (1u64 << 33) as f64;
/// 2^-149: the smallest f32 subnormal, an upper bound on any single f32 rounding error that
/// happens in the subnormal range.
pub(crate) const F32_TINY: f64 = 1.0 / (1u128 << 100) as f64 / (1u64 << 49) as f64;

#[inline]
const fn align16(n: usize) -> usize {
    (n + 15) & !15
}

impl Codec {
    /// The plain codec whose codes and scales an adaptive codec uses (itself for a plain one).
    pub const fn plain(self) -> Codec {
        match self {
            Codec::Int8Adaptive => Codec::Int8,
            Codec::Int6Adaptive => Codec::Int6,
            Codec::Int4Adaptive => Codec::Int4,
            c => c,
        }
    }

    /// Whether blocks may be coded in the Hadamard domain (flagged by [`FLAG_BIT`]).
    pub const fn is_adaptive(self) -> bool {
        matches!(
            self,
            Codec::Int8Adaptive | Codec::Int6Adaptive | Codec::Int4Adaptive
        )
    }

    /// Bits of one element's code: 8, 6 or 4.
    pub const fn code_bits(self) -> u32 {
        match self {
            Codec::Fp8E4M3 | Codec::Int8 | Codec::Int8Adaptive | Codec::Int8V2 => 8,
            Codec::Int6 | Codec::Int6Adaptive | Codec::Int6V2 => 6,
            Codec::Int4 | Codec::Int4Adaptive | Codec::Int4V2 | Codec::Fp4E2M1 => 4,
        }
    }

    /// Bytes of codes per 32-element block (the side fields travel separately).
    pub const fn code_bytes(self) -> usize {
        self.code_bits() as usize * BLOCK / 8
    }

    /// Bytes of each of a block's side fields, one array per field in the segment after the
    /// codes (docs/codecs.md, "Segment layout"): v1 codecs have one, the 16-bit scale.
    pub const fn side_widths(self) -> &'static [usize] {
        match self {
            Codec::Int8V2 | Codec::Int6V2 => &[4, 1],
            Codec::Int4V2 => &[2, 1],
            Codec::Fp4E2M1 => &[1, 2],
            _ => &[2],
        }
    }

    /// Bytes of side fields per block (the sum of [`Codec::side_widths`]).
    pub const fn side_bytes(self) -> usize {
        let w = self.side_widths();
        let mut i = 0;
        let mut sum = 0;
        while i < w.len() {
            sum += w[i];
            i += 1;
        }
        sum
    }

    /// Wire bits per element, codes and side fields, without the segment's alignment
    /// padding.
    pub const fn bits_per_element(self) -> f64 {
        ((self.code_bytes() + self.side_bytes()) * 8) as f64 / BLOCK as f64
    }

    /// `H = 2^(bits-1)` of an integer codec: codes span `[-H, H-1]`, stored biased by `H`.
    /// `None` for FP8 and FP4.
    pub const fn half_range(self) -> Option<u32> {
        match self {
            Codec::Fp8E4M3 | Codec::Fp4E2M1 => None,
            c => Some(1 << (c.code_bits() - 1)),
        }
    }

    /// Byte offset of the first side-field array (v1: the scales) in an encoded segment of
    /// `n` elements: `align16(ceil(n / 32) * code_bytes)`.
    pub fn scales_offset(self, n: usize) -> usize {
        align16(n.div_ceil(BLOCK) * self.code_bytes())
    }

    /// Bytes of an encoded segment of `n` elements: `align16(nb * code_bytes)` plus
    /// `align16(nb * w)` for each side-field width `w`, with `nb = ceil(n / 32)` (v1:
    /// `align16(nb * code_bytes) + align16(2 * nb)`).
    pub fn encoded_len(self, n: usize) -> usize {
        let nb = n.div_ceil(BLOCK);
        self.scales_offset(n)
            + self
                .side_widths()
                .iter()
                .map(|w| align16(nb * w))
                .sum::<usize>()
    }

    /// Bound on the error of one encode/decode round trip: `|x̂ - x| <= step_bound(amax)`
    /// for every element `x` of a finite block whose largest magnitude is `amax`.
    ///
    /// With `s0 = amax / H` (ints) or `amax / 256` (FP8) and `r` the scale rounding error,
    /// `r = max(2^-7 * s0, 2^-133)` (6 explicit mantissa bits; the grid is 2^-132 below 2^-125):
    ///
    /// * ints: `max(s0 + (H-1) * r, H * r)`. Unclamped elements are within `S/2` of their
    ///   value (`S` the rounded scale); the max-magnitude side, clamped at `-H`, is off by at
    ///   most `H * r`; the opposite side, clamped at `H-1`, by at most `s0 + (H-1) * r` (the
    ///   one-level asymmetry of `[-H, H-1]` plus the scale rounding). For normal scales:
    ///   `amax/H * (1 + (H-1)/128)`: Q8 `amax * 255/16384`, Q6 `amax * 159/4096`,
    ///   Q4 `amax * 135/1024`.
    /// * FP8: `max(8 * (s0 + r), 256 * r)`. `amax / S <= 256 / (1 - 2^-7) < 258.1`, which
    ///   rounds to 256 (the next E4M3 value is 288), an error of at most 2.1 in units of `S`;
    ///   below 256 the largest rounding error is half the ulp of [128, 256], 8; subnormal
    ///   codes err by at most 2^-10. For normal scales: `amax / 32 * (1 + 2^-7)`.
    ///
    /// The last terms (`H * r`, `256 * r`) only matter for subnormal scales, where they also
    /// cover blocks whose scale rounds to zero and that decode to all zeros. A relative slack
    /// of 2^-16 and an absolute 2^-149 cover the f32 division and (FP8) the decode multiply.
    ///
    /// Adaptive codecs: `sqrt(32) * 129 / 127` times the plain codec's bound, plus
    /// `2^-16 amax`. A block coded plain is within the plain bound. A block coded in the
    /// Hadamard domain decodes to `D H32 y' / 32` with `y'` the decoded transformed block, so
    /// one element's error is an average of 32 errors of `y'` (exact arithmetic: the inverse
    /// is exact), at most the largest, which the plain bound of `y`'s maximum `a_y` covers.
    /// The block was chosen because `s_y < sqrt(32) s_x`, and a 7-bit scale is within 2^-7 of
    /// `a / H`, so `a_y < sqrt(32) * 129 / 127 * amax`. The rounded forward transform is
    /// within `5 * 32 * 2^-24 amax < 2^-16.6 amax` of the exact one per element: the additive
    /// term. For normal scales: Q8a `amax / 11.2`, Q6a `amax / 4.48`, Q4a `amax / 1.32`. Random
    /// blocks use a small part of it: an adaptive codec's largest error can exceed the plain
    /// codec's (it is chosen for the smaller expected error).
    ///
    /// Valid for `amax <= 2^127`; above that the decode (`-H * S` or `256 * S`) may overflow
    /// to ±Inf. Returns NaN/Inf for a NaN/Inf `amax`.
    pub fn step_bound(self, amax: f32) -> f32 {
        if self.is_v2() {
            return v2::step_bound(self, amax);
        }
        let a = f64::from(amax.abs());
        // Bound on |S - s0|; F32_TINY also covers an inexact (subnormal) `amax / levels`.
        let scale_err = |s0: f64| (s0 / 128.0).max(SCALE_HALF_GRID_MIN) + F32_TINY;
        let mut b = match self.half_range() {
            Some(h) => {
                let h = f64::from(h);
                let s0 = a / h;
                let r = scale_err(s0);
                (s0 + (h - 1.0) * r).max(h * r)
            }
            None => {
                let s0 = a / f64::from(FP8_BLOCK_MAX);
                let r = scale_err(s0);
                (8.0 * (s0 + r)).max(256.0 * r)
            }
        };
        if self.is_adaptive() {
            // sqrt(E_h) <= sqrt(E_p) <= sqrt(32 * b^2). f64's sqrt(32) is within 2^-53.
            b = b * 32f64.sqrt() * (129.0 / 127.0) + a / 65536.0;
        }
        (b * (1.0 + 1.0 / 65536.0) + F32_TINY) as f32
    }
}

/// Rounds a scale to the 16-bit scale field: round-to-nearest-even at f32 bit 17 (a bf16 with
/// 6 explicit mantissa bits), top 16 bits, flag bit 0 clear. A mantissa carry correctly
/// moves into the exponent. NaN gives [`POISON_SCALE`].
#[inline]
pub fn round_scale(s: f32) -> u16 {
    if s.is_nan() {
        return POISON_SCALE;
    }
    let bits = s.to_bits();
    // Cannot overflow u32: the largest non-NaN pattern is 0xFF80_0000.
    let r = (bits + 0xFFFF + ((bits >> 17) & 1)) & 0xFFFE_0000;
    (r >> 16) as u16
}

/// The value of a scale field, the flag bit masked off.
#[inline]
pub fn scale_value(field: u16) -> f32 {
    f32::from_bits(u32::from(field & !FLAG_BIT) << 16)
}

/// Round-to-nearest-even to an integer, for |y| <= 2^22: adding 1.5 * 2^23 lands in a binade
/// whose ulp is 1, so the f32 addition rounds (ties to even; the constant is even) and the
/// subtraction is exact. Equal to `y.round_ties_even()` up to the sign of a zero result, and
/// a single add/sub pair on targets without a rounding instruction. Integer-codec quotients
/// stay far below 2^22: |x / s| <= |m| / S, at most about 1.5 * H (S is within 2^-7 of
/// |m| / H, or 2^-133 absolute with S >= 2^-132 for subnormal scales).
#[inline]
fn rne_small(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (y + MAGIC) - MAGIC
}

/// Packs 32 biased integer codes (each `< 2^bits`) into `codes`.
#[inline]
fn pack(codec: Codec, u: &[u8; BLOCK], codes: &mut [u8]) {
    match codec.code_bits() {
        4 => {
            for (c, p) in codes.iter_mut().zip(u.chunks_exact(2)) {
                *c = p[0] | (p[1] << 4);
            }
        }
        6 => {
            let (lo, hi) = codes.split_at_mut(16);
            for (c, p) in lo.iter_mut().zip(u.chunks_exact(2)) {
                *c = (p[0] & 0xF) | ((p[1] & 0xF) << 4);
            }
            for (c, p) in hi.iter_mut().zip(u.chunks_exact(4)) {
                *c = (p[0] >> 4) | ((p[1] >> 4) << 2) | ((p[2] >> 4) << 4) | ((p[3] >> 4) << 6);
            }
        }
        _ => codes.copy_from_slice(u), // fp8, q8: one byte per code
    }
}

/// Inverse of [`pack`].
#[inline]
fn unpack(codec: Codec, codes: &[u8], u: &mut [u8; BLOCK]) {
    match codec.code_bits() {
        4 => {
            for (c, p) in codes.iter().zip(u.chunks_exact_mut(2)) {
                p[0] = c & 0xF;
                p[1] = c >> 4;
            }
        }
        6 => {
            let (lo, hi) = codes.split_at(16);
            for (c, p) in lo.iter().zip(u.chunks_exact_mut(2)) {
                p[0] = c & 0xF;
                p[1] = c >> 4;
            }
            for (c, p) in hi.iter().zip(u.chunks_exact_mut(4)) {
                for (k, v) in p.iter_mut().enumerate() {
                    *v |= ((c >> (2 * k)) & 3) << 4;
                }
            }
        }
        _ => u.copy_from_slice(codes), // fp8, q8
    }
}

/// What the encoder needs to know about a block before choosing its scale.
struct Scan {
    /// No Inf or NaN.
    finite: bool,
    /// The first element of largest magnitude, signed (0.0 for an all-zero block).
    m: f32,
    /// `|m|`.
    amax: f32,
}

/// One pass: finiteness, and the first element of largest magnitude. NaN compares false, so
/// it never becomes `m`; `finite` catches it.
#[inline]
fn scan(x: &[f32; BLOCK]) -> Scan {
    let mut sc = Scan {
        finite: true,
        m: 0.0,
        amax: 0.0,
    };
    for &v in x {
        sc.finite &= v.is_finite();
        if v.abs() > sc.amax {
            sc.amax = v.abs();
            sc.m = v;
        }
    }
    sc
}

/// Plain coding of one block by `codec.plain()` into 32 biased codes; returns the scale
/// field (flag clear). Poisoned and zero blocks included.
#[inline]
fn encode_plain(codec: Codec, x: &[f32; BLOCK], sc: &Scan, u: &mut [u8; BLOCK]) -> u16 {
    let Scan { finite, m, amax } = *sc;
    let field = match codec.half_range() {
        Some(h) => {
            let hf = h as f32;
            let field = if finite && amax != 0.0 {
                round_scale(-m / hf)
            } else {
                0
            };
            let s = scale_value(field);
            if s == 0.0 {
                *u = [h as u8; BLOCK];
            } else {
                for (c, &v) in u.iter_mut().zip(x) {
                    *c = (rne_small(v / s).clamp(-hf, hf - 1.0) + hf) as u8;
                }
            }
            field
        }
        None => {
            let field = if finite && amax != 0.0 {
                round_scale(amax / FP8_BLOCK_MAX)
            } else {
                0
            };
            let s = scale_value(field);
            if s == 0.0 {
                *u = [0; BLOCK];
            } else {
                for (c, &v) in u.iter_mut().zip(x) {
                    *c = f32_to_e4m3(v / s);
                }
            }
            field
        }
    };
    // A scale that rounded to (signed) zero leaves a zero block: field 0, zero codes.
    if !finite {
        POISON_SCALE
    } else if scale_value(field) == 0.0 {
        0
    } else {
        field
    }
}

/// Decodes 32 biased integer codes with scale `s`: `(u - H) * s`, exact for finite results.
#[inline]
fn decode_int(h: u32, u: &[u8; BLOCK], s: f32, out: &mut [f32; BLOCK]) {
    let h = h as i32;
    for (o, &c) in out.iter_mut().zip(u) {
        *o = (i32::from(c) - h) as f32 * s;
    }
}

/// The in-place, unnormalized fast Walsh-Hadamard transform of one block, Sylvester
/// (natural) order: `v <- H32 v` with `H32[i][j] = (-1)^popcount(i & j)`.
///
/// Stages `h = 1, 2, 4, 8, 16`; in each, every pair `(i, i + h)` with `i & h == 0` becomes
/// `(a + b, a - b)` with `a = v[i]`, `b = v[i + h]`: correctly rounded f32 additions and
/// subtractions, no other operation. The pairs of one stage are independent (a GPU lane `i`
/// computes `v + partner` when bit `h` of `i` is clear and `partner - v` when it is set); the
/// order of the stages is part of the format, because the encoder's forward transform
/// rounds.
#[inline]
fn wht32(v: &mut [f32; BLOCK]) {
    let mut h = 1;
    while h < BLOCK {
        for i in 0..BLOCK {
            if i & h == 0 {
                let (a, b) = (v[i], v[i + h]);
                v[i] = a + b;
                v[i + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// The adaptive codecs' forward transform: `v_i <- -v_i` where bit `i` of
/// [`HADAMARD_SIGNS`] is set (exact), then the in-place Walsh-Hadamard transform `wht32`
/// (stages `h = 1, 2, 4, 8, 16`, pairs `(a + b, a - b)`). Unnormalized: `|y| <= 32 amax`, and
/// `||y||_2 = sqrt(32) ||x||_2`. Leaving out the `1/sqrt(32)` costs nothing (the block scale
/// absorbs any factor) and keeps the only rounding in the additions.
#[inline]
pub fn hadamard_forward(v: &mut [f32; BLOCK]) {
    for (i, x) in v.iter_mut().enumerate() {
        if (HADAMARD_SIGNS >> i) & 1 != 0 {
            *x = -*x;
        }
    }
    wht32(v);
}

/// The inverse of [`hadamard_forward`]: the same `wht32`, then `v_i <- v_i * 0.03125`
/// (2^-5, one f32 multiply), then the signs of [`HADAMARD_SIGNS`].
///
/// On a decoded block (`v_j = q_j * S`, `|q_j| <= 128`, `S` a scale with 7 significant
/// bits) every operation is exact: each intermediate is `S` times an integer of magnitude at
/// most 32 * 128 = 2^12, which needs at most 19 significant bits, and the final product by
/// 2^-5 stays on the scale's grid (a multiple of 2^-137). So a decoder may evaluate it in any
/// order, with or without FMA, or in integers, and still match bit for bit (no overflow for
/// blocks in the adaptive range).
#[inline]
pub fn hadamard_inverse(v: &mut [f32; BLOCK]) {
    wht32(v);
    for (i, x) in v.iter_mut().enumerate() {
        let y = *x * 0.031_25;
        *x = if (HADAMARD_SIGNS >> i) & 1 != 0 {
            -y
        } else {
            y
        };
    }
}

/// Decodes a block coded in the Hadamard domain: `x_i = (d_i w_i) * (S * 2^-5)` with
/// `w = wht32(u - H)` on the code integers, `d_i` the sign of [`HADAMARD_SIGNS`] applied as a
/// negation, and `S * 2^-5` one f32 multiply. The same values as [`hadamard_inverse`] of the
/// decoded codes (every step is exact in the adaptive range), and this order also fixes the
/// sign of a zero: `w` has no -0.0 (integers in, and `a - a` rounds to +0.0), so a zero
/// element is `+0.0 * S` or, where `d_i` negates, `-0.0 * S`. (Transforming the scaled
/// values instead gives other zero signs; a GPU transforms the integers, before the scale,
/// so that the plain and the flagged decode share the conversion.)
#[inline]
fn decode_hadamard(h: u32, u: &[u8; BLOCK], s: f32, out: &mut [f32; BLOCK]) {
    let h = h as i32;
    let mut w: [f32; BLOCK] = std::array::from_fn(|i| (i32::from(u[i]) - h) as f32);
    wht32(&mut w);
    let m = s * 0.031_25;
    for (i, (o, &w)) in out.iter_mut().zip(&w).enumerate() {
        *o = if (HADAMARD_SIGNS >> i) & 1 != 0 {
            -w
        } else {
            w
        } * m;
    }
}

/// Weight of the rest of a block (its absolute sum without the largest magnitude) in the
/// adaptive choice: the transformed candidate is kept only when its scale is below
/// `ADAPTIVE_REST_WEIGHT * (sum |x| - amax)` as well (`choose_adaptive`).
pub const ADAPTIVE_REST_WEIGHT: f32 = 0.75;

/// `sum |x_i|` of a block in f32 in a fixed order: inside each group of 8 consecutive elements
/// in index order, then the four group sums as `(g0 + g1) + (g2 + g3)` (a GPU lane's order:
/// 8 elements per lane in quads, or a whole block per lane).
#[inline]
pub fn abs_sum(x: &[f32; BLOCK]) -> f32 {
    let mut g = [0.0f32; 4];
    for (g, x) in g.iter_mut().zip(x.chunks_exact(8)) {
        *g = x[1..].iter().fold(x[0].abs(), |a, v| a + v.abs());
    }
    (g[0] + g[1]) + (g[2] + g[3])
}

/// The adaptive choice for a finite block with `amax` in the adaptive range, already coded
/// plain in `u`/`field`: code it in the Hadamard domain instead when that block's scale
/// predicts the smaller squared error.
///
/// The prediction: quantizing with step `s` errs by about `s^2 / 12` per element, and the
/// unnormalized transform multiplies squared norms by exactly 32 (Parseval), so the Hadamard
/// candidate's squared error in the original domain is about `32 s_y^2 / 12 / 32` against
/// `32 s_x^2 / 12` for the plain one: the transform is kept when `s_y^2 < 32 s_x^2` (both
/// sides exact in f32: a scale has 7 significant bits). That model fails for a spike far above
/// the rest of its block (a massive activation): coded plain, the rest rounds to zero and errs
/// by its own size, far below `s_x^2 / 12`, while the transform spreads the spike's step over
/// every element. So the transform must also beat the rest of the block, `s_y <
/// ADAPTIVE_REST_WEIGHT * (sum |x| - amax)` (0.75: about the plain error of a Gaussian rest
/// coded to zero, `(pi / 2) (sum')^2 / 31`, against `s_y^2 / 12`). Where f32 loses the rest to
/// cancellation (a spike 2^24 times the rest), the difference is below `2^-18 amax` while
/// `s_y` is at least `amax / 128`: plain, as it should be.
///
/// It depends only on the blocks' largest magnitudes and absolute sum (and whether `x` has a
/// single nonzero magnitude, which keeps it plain), so an encoder codes one candidate, not
/// both. Against keeping the candidate whose measured squared error is
/// smaller, it costs 0.1-0.15 dB of SNR in the two-stage all-reduce (docs/codecs.md,
/// "Measured accuracy").
fn choose_adaptive(
    codec: Codec,
    x: &[f32; BLOCK],
    amax: f32,
    u: &mut [u8; BLOCK],
    field: &mut u16,
) {
    // A block whose nonzero elements share one magnitude (a constant, also beside the zero
    // padding of a ragged tensor's last block) stays plain: plain coding holds a constant of
    // at most 7 significant bits exactly, and the all-reduce's sums of constants, which the
    // transform would spread over 32 rounded codes.
    if x.iter().all(|v| *v == 0.0 || v.abs() == amax) {
        return;
    }
    let sx = scale_value(*field);
    let mut y = *x;
    hadamard_forward(&mut y);
    let mut uh = [0u8; BLOCK];
    // In the adaptive range `y` is finite and its scale normal (|y|_max >= ||x||_2 >= amax),
    // so this is an ordinary block: never poisoned, never a zero block.
    let fh = encode_plain(codec, &y, &scan(&y), &mut uh);
    debug_assert!(fh != 0 && fh != POISON_SCALE && fh & FLAG_BIT == 0);
    let sy = scale_value(fh);
    let rest = ADAPTIVE_REST_WEIGHT * (abs_sum(x) - amax);
    if sy * sy < (sx * sx) * 32.0 && sy.abs() < rest {
        *u = uh;
        *field = fh | FLAG_BIT;
    }
}

/// Encodes one block. `codes.len()` must be `codec.code_bytes()`.
///
/// Adaptive codecs: a block whose largest magnitude lies in
/// [[`ADAPTIVE_MIN_AMAX`], [`ADAPTIVE_MAX_AMAX`]] (finite, hence neither poisoned nor zero)
/// is coded in the Hadamard domain, with [`FLAG_BIT`] set, when the transformed block's scale
/// predicts the smaller error (`choose_adaptive`; docs/codecs.md). Every other block is coded
/// plain.
pub fn encode_block(codec: Codec, x: &[f32; BLOCK], codes: &mut [u8], scale: &mut u16) {
    assert!(
        !codec.is_v2(),
        "{codec} has side fields: use encode_block_with_side"
    );
    assert_eq!(
        codes.len(),
        codec.code_bytes(),
        "codes must hold one {codec} block"
    );
    let sc = scan(x);
    let mut u = [0u8; BLOCK];
    let mut field = encode_plain(codec, x, &sc, &mut u);
    if codec.is_adaptive()
        && sc.finite
        && (ADAPTIVE_MIN_AMAX..=ADAPTIVE_MAX_AMAX).contains(&sc.amax)
    {
        choose_adaptive(codec, x, sc.amax, &mut u, &mut field);
    }
    pack(codec, &u, codes);
    *scale = field;
}

/// Decodes one block. `codes.len()` must be `codec.code_bytes()`. A NaN scale (a poisoned
/// block) decodes to 32 NaNs. Adaptive codecs decode a block whose scale has [`FLAG_BIT`]
/// set with the inverse transform (`decode_hadamard`); plain codecs ignore the bit.
pub fn decode_block(codec: Codec, codes: &[u8], scale: u16, out: &mut [f32; BLOCK]) {
    assert!(
        !codec.is_v2(),
        "{codec} has side fields: use decode_block_with_side"
    );
    assert_eq!(
        codes.len(),
        codec.code_bytes(),
        "codes must hold one {codec} block"
    );
    let s = scale_value(scale);
    match codec.half_range() {
        Some(h) => {
            let mut u = [0u8; BLOCK];
            unpack(codec, codes, &mut u);
            if codec.is_adaptive() && scale & FLAG_BIT != 0 {
                decode_hadamard(h, &u, s, out);
            } else {
                decode_int(h, &u, s, out);
            }
        }
        None => {
            for (o, &c) in out.iter_mut().zip(codes) {
                *o = e4m3_to_f32(c) * s;
            }
        }
    }
}

/// Encodes one block of any codec: its codes, and its side fields concatenated in the order
/// of [`Codec::side_widths`], each little-endian (`side.len()` must be `codec.side_bytes()`;
/// for a v1 codec the two bytes of its scale).
pub fn encode_block_with_side(codec: Codec, x: &[f32; BLOCK], codes: &mut [u8], side: &mut [u8]) {
    assert_eq!(
        side.len(),
        codec.side_bytes(),
        "side must hold one {codec} block's fields"
    );
    if codec.is_v2() {
        v2::encode_block(codec, x, codes, side);
    } else {
        let mut field = 0;
        encode_block(codec, x, codes, &mut field);
        side.copy_from_slice(&field.to_le_bytes());
    }
}

/// Decodes one block of any codec from its codes and side fields (as
/// [`encode_block_with_side`] writes them).
pub fn decode_block_with_side(codec: Codec, codes: &[u8], side: &[u8], out: &mut [f32; BLOCK]) {
    assert_eq!(
        side.len(),
        codec.side_bytes(),
        "side must hold one {codec} block's fields"
    );
    if codec.is_v2() {
        v2::decode_block(codec, codes, side, out);
    } else {
        decode_block(codec, codes, u16::from_le_bytes([side[0], side[1]]), out);
    }
}

/// The side-field arrays of a segment of `nb` blocks, in order, each without its padding;
/// the padding is zeroed when `zero_padding`.
fn side_arrays(codec: Codec, nb: usize, mut rest: &mut [u8], zero_padding: bool) -> Vec<&mut [u8]> {
    let mut arrays = Vec::with_capacity(codec.side_widths().len());
    for &w in codec.side_widths() {
        let (region, tail) = rest.split_at_mut(align16(nb * w));
        let (array, pad) = region.split_at_mut(nb * w);
        if zero_padding {
            pad.fill(0);
        }
        arrays.push(array);
        rest = tail;
    }
    arrays
}

/// Encodes a segment of `src.len()` elements into `dst` (`codec.encoded_len(src.len())`
/// bytes): the codes of all blocks from offset 0, then one array per side field (v1: the
/// little-endian scales) from `codec.scales_offset(n)`, each 16-aligned. The last block is
/// padded with zeros; alignment padding bytes are written as zero.
pub fn encode(codec: Codec, src: &[f32], dst: &mut [u8]) {
    let n = src.len();
    assert_eq!(
        dst.len(),
        codec.encoded_len(n),
        "dst must be encoded_len({n}) bytes"
    );
    let cb = codec.code_bytes();
    let nb = n.div_ceil(BLOCK);
    let (codes, sides) = dst.split_at_mut(codec.scales_offset(n));
    let (codes, codes_pad) = codes.split_at_mut(nb * cb);
    codes_pad.fill(0);
    let mut arrays = side_arrays(codec, nb, sides, true);
    let widths = codec.side_widths();
    let mut side = [0u8; 8];
    let side = &mut side[..codec.side_bytes()];
    let mut tail = [0.0f32; BLOCK];
    for (b, (x, c)) in src
        .chunks(BLOCK)
        .zip(codes.chunks_exact_mut(cb))
        .enumerate()
    {
        let block: &[f32; BLOCK] = match x.try_into() {
            Ok(full) => full,
            Err(_) => {
                tail[..x.len()].copy_from_slice(x);
                &tail
            }
        };
        encode_block_with_side(codec, block, c, side);
        let mut at = 0;
        for (array, &w) in arrays.iter_mut().zip(widths) {
            array[b * w..(b + 1) * w].copy_from_slice(&side[at..at + w]);
            at += w;
        }
    }
}

/// Decodes a segment of `dst.len()` elements from `src` (`codec.encoded_len(dst.len())`
/// bytes). The padding of the last block is decoded and dropped.
pub fn decode(codec: Codec, src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    assert_eq!(
        src.len(),
        codec.encoded_len(n),
        "src must be encoded_len({n}) bytes"
    );
    let cb = codec.code_bytes();
    let nb = n.div_ceil(BLOCK);
    let (codes, mut rest) = src.split_at(codec.scales_offset(n));
    let widths = codec.side_widths();
    let mut arrays = Vec::with_capacity(widths.len());
    for &w in widths {
        let (region, tail) = rest.split_at(align16(nb * w));
        arrays.push(&region[..nb * w]);
        rest = tail;
    }
    let mut side = [0u8; 8];
    let side = &mut side[..codec.side_bytes()];
    let mut block = [0.0f32; BLOCK];
    for (b, (y, c)) in dst
        .chunks_mut(BLOCK)
        .zip(codes.chunks_exact(cb))
        .enumerate()
    {
        let mut at = 0;
        for (array, &w) in arrays.iter().zip(widths) {
            side[at..at + w].copy_from_slice(&array[b * w..(b + 1) * w]);
            at += w;
        }
        match <&mut [f32; BLOCK]>::try_from(&mut *y) {
            Ok(full) => decode_block_with_side(codec, c, side, full),
            Err(_) => {
                decode_block_with_side(codec, c, side, &mut block);
                y.copy_from_slice(&block[..y.len()]);
            }
        }
    }
}
