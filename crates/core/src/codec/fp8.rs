//! OCP FP8 E4M3, the "fn" variant: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits,
//! subnormals down to 2^-9, max finite 448, no infinities, NaN = `S.1111.111` (0x7F / 0xFF).

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Smallest normal E4M3 value, 2^-6.
const E4M3_MIN_NORMAL: f32 = 0.015_625;

/// Rounds `x` to E4M3: round-to-nearest-even (subnormals included), saturating to ±448.
///
/// * NaN gives 0x7F.
/// * ±Inf and every |x| >= 448 give ±448 (0x7E / 0xFE).
/// * Every result that is zero, -0.0 and negative values that round to zero included, is
///   0x00: this function never returns 0x80. (A GPU kernel that uses the hardware
///   conversion, e.g. `cvt.rn.satfinite.e4m3x2.f32`, must map 0x80 to 0x00 to match.)
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = x.abs();
    let mag = if a >= E4M3_MAX {
        0x7E
    } else if a < E4M3_MIN_NORMAL {
        // Subnormal range: the codes are k * 2^-9, k = 0..=8; k = 8 is 0x08, the smallest
        // normal, so the integer is the code. `a * 512` is exact.
        (a * 512.0).round_ties_even() as u8
    } else {
        // Normal: keep 3 of the 23 mantissa bits, round-to-nearest-even on the 20 dropped
        // ones; a carry moves into the exponent, which is the correct result. Rebias the
        // exponent from 127 to 7 (120 << 3 in the shifted code). a < 448 cannot reach 0x7F.
        let b = a.to_bits();
        let r = b + 0x7_FFFF + ((b >> 20) & 1);
        ((r >> 20) - (120 << 3)) as u8
    };
    if mag == 0 {
        0
    } else {
        sign | mag
    }
}

/// The f32 bit pattern of E4M3 code `b` (exact: every E4M3 value is an f32).
const fn e4m3_bits(b: u8) -> u32 {
    let sign = ((b as u32) & 0x80) << 24;
    let e = ((b >> 3) & 0xF) as u32;
    let m = (b & 7) as u32;
    if e == 15 && m == 7 {
        return sign | 0x7FC0_0000;
    }
    if e != 0 {
        return sign | ((e + 120) << 23) | (m << 20);
    }
    if m == 0 {
        return sign;
    }
    // Subnormal m * 2^-9: with p the index of m's leading one, m * 2^-9 = 2^(p-9) * (m / 2^p).
    let p = 31 - m.leading_zeros();
    let frac = (m << (23 - p)) & 0x7F_FFFF;
    sign | ((127 - 9 + p) << 23) | frac
}

static E4M3_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_bits(i as u8);
        i += 1;
    }
    t
};

/// The value of E4M3 code `b` (exact). 0x7F and 0xFF are NaN; 0x80 is -0.0.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    f32::from_bits(E4M3_TABLE[b as usize])
}
