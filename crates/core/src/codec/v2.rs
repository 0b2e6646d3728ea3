//! Format v2: q8v2, q6v2, q4v2 and fp4 (docs/codecs.md, "Format v2").
//!
//! The v1 integer codecs lose the rest of a block to its largest element (a massive
//! activation sets the step of all 32), round the scale to 7 significant bits (which costs
//! q8 0.23 dB), and their plain/Hadamard prediction rotates spike blocks that plain coding
//! keeps better. The v2 integer codecs fix all three:
//!
//! * the block's largest element `m` (first in index order) is carried beside the codes, on
//!   the scale's grid with a wider integer `K`, so the other 31 set the scale, which fits both
//!   signs into `[-H, H-1]` without clamping (`balanced_scale`);
//! * q8v2 and q6v2 round the scale to 16 significant bits over the whole f32 range
//!   ([`round_scale24`]); q4v2 keeps v1's 7-bit scale, which costs a 4-bit code 0.01 dB;
//! * a block is coded plain (with the carried element) unless that is inexact and v1's
//!   the block's L1 norm is below [`ROTATE_L1_RATIO`] times `H` times the plain scale; then
//!   it is coded in v1's randomized Hadamard domain (whole block, no carried element). A
//!   prediction from the plain candidate alone, which sees exact blocks (constants) and keeps
//!   them plain.
//!
//! fp4 is OCP E2M1 with an E4M3 scale per 16 elements under a power-of-two scale per
//! block, NVFP4's two-level scale with the tensor scale made per block.

use super::fp4::{e2m1_to_f32, f32_to_e2m1, E2M1_MAX};
use super::fp8::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use super::{
    abs_sum, hadamard_forward, pack, rne_small, round_scale, scale_value, unpack, wht32,
    ADAPTIVE_MAX_AMAX, ADAPTIVE_MIN_AMAX, BLOCK, F32_TINY, FLAG_BIT, HADAMARD_SIGNS, POISON_SCALE,
};
use crate::Codec;

/// The q8v2/q6v2 scale word of a block that held an Inf or a NaN: an f32 quiet NaN with the
/// low byte (index, flag) clear.
pub const POISON_SCALE24: u32 = 0x7FC0_0000;

/// fp4: the group exponent byte of a poisoned block.
const FP4_POISON: u8 = 0xFF;

/// Rounds a scale to 24 bits, returned in place in an f32 bit pattern whose low 8 bits are
/// clear: sign, 8 exponent bits, 15 explicit mantissa bits (16 significant bits over the
/// whole f32 range, subnormals on a grid of 2^-141), round-to-nearest-even at bit 8; a
/// mantissa carry moves into the exponent. NaN gives [`POISON_SCALE24`].
#[inline]
pub fn round_scale24(s: f32) -> u32 {
    if s.is_nan() {
        return POISON_SCALE24;
    }
    let b = s.to_bits();
    // No overflow: the largest non-NaN pattern is 0xFF80_0000.
    (b + 0x7F + ((b >> 8) & 1)) & 0xFFFF_FF00
}

/// The value of a q8v2/q6v2 scale word (its low byte masked off).
#[inline]
pub fn scale24_value(word: u32) -> f32 {
    f32::from_bits(word & 0xFFFF_FF00)
}

/// Bits of the carried element's integer `K` (two's complement): its low `code_bits` ride in
/// the element's own code slot, the rest in a side byte.
const fn spike_bits(codec: Codec) -> u32 {
    match codec {
        Codec::Int4V2 => 7,
        c => c.code_bits() + 8,
    }
}

/// `codec`'s scale rounding, as the rounded value.
#[inline]
fn round_to_scale(codec: Codec, s: f32) -> f32 {
    match codec {
        Codec::Int4V2 => scale_value(round_scale(s)),
        _ => scale24_value(round_scale24(s)),
    }
}

/// `ROTATE_L1_RATIO H |S_p|`, exact: the first product is a power of two.
#[inline]
pub(super) fn rotate_threshold(codec: Codec, s_p: f32) -> f32 {
    let h = codec.half_range().expect("integer codec") as f32;
    (ROTATE_L1_RATIO * h) * s_p.abs()
}

/// The Hadamard candidate is kept only where the plain one is inexact and the block's L1 norm
/// (`abs_sum`) is below this many times `H |S_p|`, the plain candidate's half range in value
/// terms: a block whose mass is spread over many elements near its largest ones (a Gaussian
/// block: `sum |x|` is about 13 times the largest of the other 31) stays plain, one whose
/// energy sits in a few elements beside the carried one (two outliers) is rotated, which
/// spreads them over all 32 codes. Predicted from the plain candidate alone, so the transform
/// is computed only for the blocks that keep it. Measured on the host against choosing by
/// squared error and against the two scales' ratio (docs/codecs.md, "Quality"): within 0.24
/// dB of the measured choice on `gauss`, `outliers`, `channels` and `spikes`; 9 or more lets
/// q4v2's worst channel of `spikes` fall below 10 dB. Q4v2 on N(0,1) then rotates almost no
/// block and measures plain coding's 20.00 dB.
pub const ROTATE_L1_RATIO: f32 = 8.0;

/// The first element of largest magnitude among those not excluded, and its index
/// (0 and 0.0 when there is none, or all are zero).
#[inline]
fn first_max(x: &[f32; BLOCK], skip: Option<usize>) -> (usize, f32) {
    let (mut k, mut m, mut a) = (0, 0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        if Some(i) != skip && v.abs() > a {
            (k, m, a) = (i, v, v.abs());
        }
    }
    (k, m)
}

/// The signed scale that fits every element (but `skip`) into the codes `[-H, H-1]` without
/// clamping: with `p` the largest positive element and `n` the largest magnitude of a
/// negative one, a negative scale maps the positives onto `[-H, 0]` and needs
/// `max(p / H, n / (H-1))`, a positive one `max(n / H, p / (H-1))`; the smaller wins, the
/// negative one on ties. (v1's sign trick maps the largest magnitude to `-H` and clamps the
/// other side at `H-1`, up to a whole step off; with identical inputs on every rank those
/// errors add up coherently, and q6 missed QuickReduce's tolerance by 40%.) Exact for
/// one-sided blocks and for the side that maps to `-H` (a division by a power of two); the
/// `H-1` side's quotient is correctly rounded. `-0.0` for a block of zeros.
#[inline]
fn balanced_scale(x: &[f32; BLOCK], skip: Option<usize>, h: f32) -> f32 {
    let (mut p, mut n) = (0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        if Some(i) != skip {
            p = p.max(v);
            n = n.max(-v);
        }
    }
    let s_neg = (p / h).max(n / (h - 1.0));
    let s_pos = (n / h).max(p / (h - 1.0));
    if s_neg <= s_pos {
        -s_neg
    } else {
        s_pos
    }
}

/// One coded integer block: biased codes (the carried element's slot holds `K`'s low bits),
/// the scale value, and the carried element (`k`, `K`) or the Hadamard flag.
pub(super) struct IntBlock {
    u: [u8; BLOCK],
    pub(super) s: f32,
    k: usize,
    kq: i32,
    pub(super) hadamard: bool,
}

impl IntBlock {
    /// A zero block (`s == 0`) or a poisoned one (`s` NaN): codes `H`, `K = 0` at slot 0.
    fn empty(codec: Codec, s: f32) -> Self {
        let h = codec.half_range().expect("integer codec") as u8;
        let mut u = [h; BLOCK];
        u[0] = 0;
        IntBlock {
            u,
            s,
            k: 0,
            kq: 0,
            hadamard: false,
        }
    }

    pub(super) fn decode(&self, codec: Codec, out: &mut [f32; BLOCK]) {
        let h = codec.half_range().expect("integer codec") as i32;
        if self.hadamard {
            let mut w: [f32; BLOCK] = std::array::from_fn(|i| (i32::from(self.u[i]) - h) as f32);
            wht32(&mut w);
            let g = self.s * 0.031_25;
            for (i, (o, &w)) in out.iter_mut().zip(&w).enumerate() {
                *o = if (HADAMARD_SIGNS >> i) & 1 != 0 {
                    -w
                } else {
                    w
                } * g;
            }
        } else {
            for (o, &c) in out.iter_mut().zip(&self.u) {
                *o = (i32::from(c) - h) as f32 * self.s;
            }
            out[self.k] = self.kq as f32 * self.s;
        }
    }
}

/// A plain code (or `K`) whose decoded value `c * S` would round to ±Inf, one toward zero.
///
/// Only an element within half a step of f32's maximum can round past it: a rounded-up scale
/// puts `-H S` (or `-KH S`) above the largest element, or `rne` rounds its quotient up. One code
/// toward zero decodes below the element itself (`|c S| - |S| < |x|`), finite, within one step
/// `|S|` of it instead of half a step. Unclamped codes are integers of magnitude >= 1 there.
#[inline]
fn finite_code(c: f32, s: f32) -> f32 {
    if (c * s).is_infinite() {
        c - c.signum()
    } else {
        c
    }
}

/// The plain candidate: the largest element `m = x[k]` on the scale's grid as `K`, the rest
/// with the second-largest `m2` at code `-H`, unless `m` would not fit `K`'s range, in which
/// case `m` takes `K = -2^(w-1)` and sets the scale. Codes and `K` that would decode to ±Inf
/// are one toward zero ([`finite_code`]).
pub(super) fn plain_candidate(codec: Codec, x: &[f32; BLOCK], k: usize, m: f32) -> IntBlock {
    let h = codec.half_range().expect("integer codec") as f32;
    let kh = (1u32 << (spike_bits(codec) - 1)) as f32;
    let rest = balanced_scale(x, Some(k), h);
    // `m / KH` is exact unless subnormal (then correctly rounded).
    let s0 = if m.abs() / kh <= rest.abs() {
        rest
    } else {
        -m / kh
    };
    let s = round_to_scale(codec, s0);
    if s == 0.0 {
        return IntBlock::empty(codec, 0.0);
    }
    let mut u = [0u8; BLOCK];
    for (c, &v) in u.iter_mut().zip(x) {
        *c = (finite_code(rne_small(v / s).clamp(-h, h - 1.0), s) + h) as u8;
    }
    let kq = finite_code(rne_small(m / s).clamp(-kh, kh - 1.0), s) as i32;
    u[k] = (kq & ((1 << codec.code_bits()) - 1)) as u8;
    IntBlock {
        u,
        s,
        k,
        kq,
        hadamard: false,
    }
}

/// The Hadamard candidate: v1's transform of the whole block, coded like a v1 plain block
/// (largest magnitude of `y` at code `-H`) with `codec`'s scale rounding.
pub(super) fn hadamard_candidate(codec: Codec, x: &[f32; BLOCK]) -> IntBlock {
    let h = codec.half_range().expect("integer codec") as f32;
    let mut y = *x;
    hadamard_forward(&mut y);
    // In the adaptive range |y|max >= amax >= 2^-48: the scale is normal, never zero.
    let s = round_to_scale(codec, balanced_scale(&y, None, h));
    let mut u = [0u8; BLOCK];
    for (c, &v) in u.iter_mut().zip(&y) {
        *c = (rne_small(v / s).clamp(-h, h - 1.0) + h) as u8;
    }
    IntBlock {
        u,
        s,
        k: 0,
        kq: 0,
        hadamard: true,
    }
}

fn encode_int(codec: Codec, x: &[f32; BLOCK]) -> IntBlock {
    if x.iter().any(|v| !v.is_finite()) {
        return IntBlock::empty(codec, f32::NAN);
    }
    let (k, m) = first_max(x, None);
    let amax = m.abs();
    if amax == 0.0 {
        return IntBlock::empty(codec, 0.0);
    }
    let plain = plain_candidate(codec, x, k, m);
    if !(ADAPTIVE_MIN_AMAX..=ADAPTIVE_MAX_AMAX).contains(&amax) {
        return plain;
    }
    let mut xp = [0.0f32; BLOCK];
    plain.decode(codec, &mut xp);
    if xp == *x {
        return plain; // exact (f32 ==): constants, and the sums of exact blocks
    }
    if abs_sum(x) < rotate_threshold(codec, plain.s) {
        hadamard_candidate(codec, x)
    } else {
        plain
    }
}

/// Writes an integer block's side fields: q8v2/q6v2 `[scale word (4, LE), K high byte]`,
/// q4v2 `[scale field (2, LE), index | K high bits << 5]`.
fn int_side(codec: Codec, b: &IntBlock, side: &mut [u8]) {
    let cb = codec.code_bits();
    let k_hi = ((b.kq >> cb) as u32 & ((1u32 << (spike_bits(codec) - cb)) - 1)) as u8;
    let flag = u32::from(b.hadamard);
    match codec {
        Codec::Int4V2 => {
            let field = if b.s.is_nan() {
                POISON_SCALE
            } else {
                (b.s.to_bits() >> 16) as u16 | if b.hadamard { FLAG_BIT } else { 0 }
            };
            side[..2].copy_from_slice(&field.to_le_bytes());
            side[2] = b.k as u8 | (k_hi << 5);
        }
        _ => {
            let word = if b.s.is_nan() {
                POISON_SCALE24
            } else {
                b.s.to_bits() | ((b.k as u32) << 3) | flag
            };
            side[..4].copy_from_slice(&word.to_le_bytes());
            side[4] = k_hi;
        }
    }
}

/// Reads an integer block's side fields and codes back.
fn int_read(codec: Codec, codes: &[u8], side: &[u8]) -> IntBlock {
    let cb = codec.code_bits();
    let w = spike_bits(codec);
    let (s, hadamard, k, k_hi) = match codec {
        Codec::Int4V2 => {
            let field = u16::from_le_bytes([side[0], side[1]]);
            (
                scale_value(field),
                field & FLAG_BIT != 0,
                usize::from(side[2] & 31),
                u32::from(side[2] >> 5),
            )
        }
        _ => {
            let word = u32::from_le_bytes([side[0], side[1], side[2], side[3]]);
            (
                scale24_value(word),
                word & 1 != 0,
                ((word >> 3) & 31) as usize,
                u32::from(side[4]),
            )
        }
    };
    let mut u = [0u8; BLOCK];
    unpack(codec, codes, &mut u);
    // Sign-extend the w-bit two's complement K.
    let raw = (k_hi << cb) | u32::from(u[k]);
    let kq = ((raw << (32 - w)) as i32) >> (32 - w);
    IntBlock {
        u,
        s,
        k,
        kq,
        hadamard,
    }
}

/// fp4: the E2M1 value a half whose nonzero elements share one magnitude (a constant, also
/// beside the zero padding of a ragged tensor's last block, or its sign pattern) maps them
/// to: 4, a power of two, so the half scale `amax_h / 4` is exact for every magnitude of at
/// most 4 significant bits and the half comes back exactly. Every other half maps its largest
/// magnitude to 6 (E2M1's largest), whose third in the scale makes no constant exact (1.0
/// came back as 1.03125); for a half of one magnitude the two cost the same precision.
const FP4_CONSTANT_TOP: f32 = 4.0;

/// fp4: the group exponent `e` of a block whose largest magnitude is `a > 0`: the smallest
/// power of two `G = 2^e >= a / 1792` (`1792 = 4 * 448`, so every half's scale
/// `amax_h / 6 / G` or `amax_h / 4 / G` is at most 448), clamped to `[-126, 127]` so that
/// `G` is an f32 normal.
fn fp4_exponent(a: f32) -> i32 {
    let t = a / (FP4_CONSTANT_TOP * E4M3_MAX);
    let b = t.to_bits();
    let biased = (b >> 23) as i32;
    if biased == 0 {
        return -126; // t < 2^-126 (subnormal or zero)
    }
    let e = biased - 127 + i32::from(b & 0x7F_FFFF != 0);
    e.clamp(-126, 127)
}

/// `2^e` for `e` in [-126, 127].
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

fn encode_fp4(x: &[f32; BLOCK], codes: &mut [u8], side: &mut [u8]) {
    let mut c = [0u8; BLOCK];
    if x.iter().any(|v| !v.is_finite()) {
        side.copy_from_slice(&[FP4_POISON, 0, 0]);
        pack(Codec::Fp4E2M1, &c, codes);
        return;
    }
    let a = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if a == 0.0 {
        side.copy_from_slice(&[0, 0, 0]);
        pack(Codec::Fp4E2M1, &c, codes);
        return;
    }
    let e = fp4_exponent(a);
    let g = pow2(e);
    side[0] = (e + 127) as u8;
    for (half, (xs, cs)) in x.chunks_exact(16).zip(c.chunks_exact_mut(16)).enumerate() {
        let ah = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // The smallest nonzero magnitude (+Inf for a half of zeros, whose scale is 0 anyway).
        let al = xs
            .iter()
            .filter(|v| **v != 0.0)
            .fold(f32::INFINITY, |m, v| m.min(v.abs()));
        let top = if al == ah { FP4_CONSTANT_TOP } else { E2M1_MAX };
        let mut sc = f32_to_e4m3((ah / top) / g);
        // Near f32's maximum the rounded-up half scale times E2M1's 6 can overflow, and the
        // largest code would decode to Inf: the next lower scale then (one E4M3 step, at
        // most 1/8, under the half's maximum: its codes saturate at 6 within the bound).
        if e4m3_to_f32(sc) * g * E2M1_MAX > f32::MAX {
            sc -= 1;
        }
        side[1 + half] = sc;
        let s = e4m3_to_f32(sc) * g;
        if s != 0.0 {
            for (q, &v) in cs.iter_mut().zip(xs) {
                *q = f32_to_e2m1(v / s);
            }
        }
    }
    pack(Codec::Fp4E2M1, &c, codes);
}

fn decode_fp4(codes: &[u8], side: &[u8], out: &mut [f32; BLOCK]) {
    let mut c = [0u8; BLOCK];
    unpack(Codec::Fp4E2M1, codes, &mut c);
    let g = if side[0] == FP4_POISON {
        f32::NAN
    } else {
        f32::from_bits(u32::from(side[0]) << 23)
    };
    for (half, (os, cs)) in out.chunks_exact_mut(16).zip(c.chunks_exact(16)).enumerate() {
        let s = e4m3_to_f32(side[1 + half]) * g;
        for (o, &q) in os.iter_mut().zip(cs) {
            *o = e2m1_to_f32(q) * s;
        }
    }
}

/// Encodes one v2 block: codes and the concatenated side fields.
pub(super) fn encode_block(codec: Codec, x: &[f32; BLOCK], codes: &mut [u8], side: &mut [u8]) {
    assert_eq!(
        codes.len(),
        codec.code_bytes(),
        "codes must hold one {codec} block"
    );
    if codec == Codec::Fp4E2M1 {
        return encode_fp4(x, codes, side);
    }
    let b = encode_int(codec, x);
    pack(codec, &b.u, codes);
    int_side(codec, &b, side);
}

/// Decodes one v2 block.
pub(super) fn decode_block(codec: Codec, codes: &[u8], side: &[u8], out: &mut [f32; BLOCK]) {
    assert_eq!(
        codes.len(),
        codec.code_bytes(),
        "codes must hold one {codec} block"
    );
    if codec == Codec::Fp4E2M1 {
        return decode_fp4(codes, side, out);
    }
    int_read(codec, codes, side).decode(codec, out);
}

/// `Codec::step_bound` of the v2 codecs (docs/codecs.md, "Format v2", "Error bound").
///
/// Integer codecs, plain coding, with `s0 = amax / H` and `r` the scale's rounding error
/// (`2^-16 s0` for the 24-bit scale, `2^-7 s0` for q4v2's, plus half the subnormal grid): the
/// 31 others are within v1's `max(s0 + (H-1) r, H r)` (their step is at most `s0`); the
/// carried element is within `S / 2` unless `K` clamps, and then within `s0 + KH r <= 1.5 s0`.
/// A Hadamard block's scale `S_h` is at most its largest transform value over `H-1`, rounded
/// up, and no transform value exceeds the block's L1 norm, below [`ROTATE_L1_RATIO`] `H`
/// times the plain scale, which is at most `amax / (H-1)` rounded up; each transform code is
/// within `S_h / 2` of its value, plus `H r_h` where the rounded scale clamps one, and each
/// decoded element is a signed mean of 32 such errors: within `S_h (1/2 + H rel)` (plus the
/// transforms' roundings, covered by 2^-10, and an absolute 2^-60).
///
/// fp4: a half's scale `S = e4m3(amax_h / 6 / G) G` is within 2^-4 of `amax_h / 6` (E4M3's
/// 3 mantissa bits) plus `2^-10 G` (its subnormals), `G < amax / 896`; E2M1's coarsest
/// rounding is `S` (half the spacing 2 of [4, 6]) and saturation at 6 costs less. A half of
/// one magnitude (scale `amax_h / 4`) codes every element as ±4 within 2^-4 of itself plus
/// `4 * 2^-10 G`, or to zero where its scale is. So `amax / 6 * 17/16 + 4 * 2^-10 amax /
/// 896`, plus 2^-130 for blocks at the bottom of the range.
pub(super) fn step_bound(codec: Codec, amax: f32) -> f32 {
    let a = f64::from(amax.abs());
    let b = if codec == Codec::Fp4E2M1 {
        a / 6.0 * (17.0 / 16.0) + 4.0 * a / 896.0 / 1024.0 + 2f64.powi(-130)
    } else {
        let h = f64::from(codec.half_range().expect("integer codec"));
        let kh = f64::from(1u32 << (spike_bits(codec) - 1));
        let (rel, half_grid) = match codec {
            Codec::Int4V2 => (2f64.powi(-7), 2f64.powi(-133)),
            _ => (2f64.powi(-16), 2f64.powi(-142)),
        };
        let s0 = a / h;
        let r = (s0 * rel).max(half_grid) + F32_TINY;
        let rest = (s0 + (h - 1.0) * r).max(h * r);
        let spike = s0 + r + kh * r;
        let s_p = a / (h - 1.0) * (1.0 + rel) + half_grid;
        let s_h = f64::from(ROTATE_L1_RATIO) * h / (h - 1.0) * s_p * (1.0 + rel) * (1.0 + 1e-5)
            + half_grid;
        let rotated = s_h * (0.5 + h * rel) * (1.0 + 1.0 / 1024.0) + 2f64.powi(-60);
        rest.max(spike).max(rotated)
    };
    (b * (1.0 + 1.0 / 65536.0) + F32_TINY) as f32
}
