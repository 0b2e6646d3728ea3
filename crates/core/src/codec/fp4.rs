//! OCP FP4 E2M1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit. The magnitudes are
//! 0, 0.5, 1, 1.5, 2, 3, 4 and 6 (codes 0..7); bit 3 is the sign. No infinities, no NaN.

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Rounds `x` to E2M1: round-to-nearest, ties to the even code (the one whose mantissa bit is
/// 0), saturating to ±6. Every zero result is code 0 (never 8, the negative zero), as for
/// E4M3. NaN gives 0: the encoder never passes one (NaN blocks are poisoned first).
///
/// The thresholds are the midpoints between neighbouring magnitudes; at a midpoint the
/// even code wins: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
#[inline]
pub fn f32_to_e2m1(x: f32) -> u8 {
    let a = x.abs();
    let mag = if a <= 0.25 || a.is_nan() {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if mag != 0 && x.is_sign_negative() {
        mag | 8
    } else {
        mag
    }
}

/// The value of E2M1 code `c` (the low 4 bits; exact). Code 8 is -0.0.
#[inline]
pub fn e2m1_to_f32(c: u8) -> f32 {
    let v = E2M1_VALUES[usize::from(c & 7)];
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}
