//! Properties of the format v2 codecs (q8v2, q6v2, q4v2, fp4).

use super::abs_sum;
use super::v2::{hadamard_candidate, plain_candidate, rotate_threshold};
use super::*;
use proptest::prelude::*;

const INTS: [Codec; 3] = [Codec::Int8V2, Codec::Int6V2, Codec::Int4V2];

fn roundtrip(codec: Codec, x: &[f32; BLOCK]) -> (Vec<u8>, Vec<u8>, [f32; BLOCK]) {
    let mut codes = vec![0xA5u8; codec.code_bytes()];
    let mut side = vec![0xA5u8; codec.side_bytes()];
    encode_block_with_side(codec, x, &mut codes, &mut side);
    let mut out = [f32::NAN; BLOCK];
    decode_block_with_side(codec, &codes, &side, &mut out);
    (codes, side, out)
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

fn first_max_index(x: &[f32; BLOCK]) -> usize {
    let a = amax(x);
    x.iter().position(|v| v.abs() == a).unwrap()
}

fn assert_within_bound(codec: Codec, x: &[f32; BLOCK]) -> [f32; BLOCK] {
    let (_, side, y) = roundtrip(codec, x);
    let bound = f64::from(codec.step_bound(amax(x)));
    for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
        let err = (f64::from(a) - f64::from(b)).abs();
        assert!(
            err <= bound,
            "{codec}: x[{i}] = {a:e} decoded {b:e}, err {err:e} > bound {bound:e} (side {side:02x?}, x = {x:?})"
        );
    }
    y
}

/// A deterministic stream of N(0,1)-ish values (splitmix64, sum of 4 uniforms: cheap and
/// bounded, enough for properties).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| self.uniform()).sum();
        ((s - 2.0) * 3f64.sqrt()) as f32
    }
    fn block(&mut self, scale: f32) -> [f32; BLOCK] {
        std::array::from_fn(|_| self.gauss() * scale)
    }
}

#[test]
fn layout_sizes() {
    for (codec, bits, sides) in [
        (Codec::Int8V2, 9.25, &[4usize, 1][..]),
        (Codec::Int6V2, 7.25, &[4, 1]),
        (Codec::Int4V2, 4.75, &[2, 1]),
        (Codec::Fp4E2M1, 4.75, &[1, 2]),
    ] {
        assert_eq!(codec.bits_per_element(), bits, "{codec}");
        assert_eq!(codec.side_widths(), sides, "{codec}");
        for n in [0usize, 1, 31, 32, 33, 100, 4097] {
            let nb = n.div_ceil(BLOCK);
            let want = align16(nb * codec.code_bytes())
                + sides.iter().map(|w| align16(nb * w)).sum::<usize>();
            assert_eq!(codec.encoded_len(n), want, "{codec} n {n}");
        }
    }
    // v1 keeps its layout.
    for codec in Codec::V1 {
        assert_eq!(codec.side_widths(), &[2]);
        let nb = 5;
        assert_eq!(
            codec.encoded_len(nb * BLOCK),
            align16(nb * codec.code_bytes()) + align16(2 * nb)
        );
    }
}

/// A segment's side arrays hold each block's fields where the layout says, and the padding
/// is zero.
#[test]
fn segment_layout_matches_blocks() {
    let mut rng = Rng(11);
    for codec in Codec::V2 {
        let n = 3 * BLOCK + 5;
        let src: Vec<f32> = (0..n).map(|_| rng.gauss()).collect();
        let mut dst = vec![0xEEu8; codec.encoded_len(n)];
        encode(codec, &src, &mut dst);
        let nb = n.div_ceil(BLOCK);
        let cb = codec.code_bytes();
        let mut offsets = vec![codec.scales_offset(n)];
        for w in codec.side_widths() {
            offsets.push(offsets.last().unwrap() + align16(nb * w));
        }
        assert_eq!(*offsets.last().unwrap(), dst.len());
        for b in 0..nb {
            let mut x = [0.0f32; BLOCK];
            let end = ((b + 1) * BLOCK).min(n);
            x[..end - b * BLOCK].copy_from_slice(&src[b * BLOCK..end]);
            let (codes, side, _) = roundtrip(codec, &x);
            assert_eq!(&dst[b * cb..(b + 1) * cb], &codes[..], "{codec} block {b}");
            let mut at = 0;
            for (j, &w) in codec.side_widths().iter().enumerate() {
                let o = offsets[j] + b * w;
                assert_eq!(
                    &dst[o..o + w],
                    &side[at..at + w],
                    "{codec} block {b} field {j}"
                );
                at += w;
            }
        }
        assert!(dst[nb * cb..codec.scales_offset(n)].iter().all(|&b| b == 0));
        for (j, &w) in codec.side_widths().iter().enumerate() {
            assert!(dst[offsets[j] + nb * w..offsets[j + 1]]
                .iter()
                .all(|&b| b == 0));
        }
        let mut back = vec![0.0f32; n];
        decode(codec, &dst, &mut back);
        for b in 0..nb {
            let mut x = [0.0f32; BLOCK];
            let end = ((b + 1) * BLOCK).min(n);
            x[..end - b * BLOCK].copy_from_slice(&src[b * BLOCK..end]);
            let (_, _, y) = roundtrip(codec, &x);
            for i in b * BLOCK..end {
                assert_eq!(back[i].to_bits(), y[i - b * BLOCK].to_bits());
            }
        }
    }
}

#[test]
fn scale24_rounds_to_nearest_even() {
    assert_eq!(round_scale24(1.0), 1.0f32.to_bits());
    // 1 + 2^-16 is a tie between 1 and 1 + 2^-15: to even (1).
    assert_eq!(scale24_value(round_scale24(1.0 + 2f32.powi(-16))), 1.0);
    assert_eq!(
        scale24_value(round_scale24(1.0 + 3.0 * 2f32.powi(-16))),
        1.0 + 2.0 * 2f32.powi(-15)
    );
    // A carry moves into the exponent.
    assert_eq!(scale24_value(round_scale24(2.0 - 2f32.powi(-20))), 2.0);
    // Negative values round symmetrically; NaN poisons.
    assert_eq!(scale24_value(round_scale24(-1.5)), -1.5);
    assert_eq!(round_scale24(f32::NAN), POISON_SCALE24);
    // 16 significant bits over the whole range, subnormals included.
    for e in [-140i32, -126, -60, 0, 60, 120] {
        let s = 2f64.powi(e) * (1.0 + 12345.0 / 32768.0);
        let r = f64::from(scale24_value(round_scale24(s as f32)));
        let rel = ((r - s) / s).abs();
        assert!(e < -126 || rel <= 2f64.powi(-16), "{e}: {rel:e}");
    }
}

#[test]
fn e2m1_rounds_to_nearest_even_and_saturates() {
    let values = [0.0f64, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for c in 0..16u8 {
        let v = e2m1_to_f32(c);
        let want = values[usize::from(c & 7)] * if c & 8 != 0 { -1.0 } else { 1.0 };
        assert_eq!(f64::from(v), want);
    }
    // Brute force against the definition on a fine grid, both signs.
    for k in 0..=4000 {
        let x = k as f32 / 500.0; // 0 ..= 8
        for x in [x, -x] {
            let c = f32_to_e2m1(x);
            let a = f64::from(x.abs());
            let (mut best, mut best_err) = (0usize, f64::INFINITY);
            for (i, &v) in values.iter().enumerate() {
                let err = (a - v).abs();
                // Nearest; on a tie the even code (even index).
                if err < best_err || (err == best_err && i % 2 == 0) {
                    (best, best_err) = (i, err);
                }
            }
            assert_eq!(usize::from(c & 7), best, "x = {x}");
            assert!(
                best == 0 && c == 0 || (c & 8 != 0) == (x < 0.0),
                "x = {x}: {c}"
            );
        }
    }
    assert_eq!(f32_to_e2m1(-0.0), 0);
    assert_eq!(f32_to_e2m1(1e30), 7);
    assert_eq!(f32_to_e2m1(-1e30), 15);
}

/// Constants the format can represent come back exactly: f16/bf16-representable values fit
/// the 16-bit (and, for values with at most 7 significant bits, q4v2's 7-bit) scale, and the
/// block maps them to code -H exactly. So do the all-reduce's partial sums of them.
#[test]
fn constants_are_exact() {
    for codec in INTS {
        for c in [
            1.0f32,
            -1.0,
            8.0,
            0.5,
            3.0,
            -0.375,
            0.001_220_703_1,
            65504.0,
            2f32.powi(-24),
        ] {
            if codec == Codec::Int4V2 && c.to_bits() & 0xFFFF != 0 {
                continue; // more significant bits than q4v2's 7-bit scale
            }
            let x = [c; BLOCK];
            let (_, _, y) = roundtrip(codec, &x);
            assert_eq!(y, x, "{codec} constant {c}");
        }
        let x: [f32; BLOCK] = std::array::from_fn(|i| [1.0, -1.0, 2.0, 0.0][i % 4]);
        assert_eq!(roundtrip(codec, &x).2, x, "{codec}");
    }
}

#[test]
fn zero_and_poisoned_blocks() {
    for codec in Codec::V2 {
        let (_, _, y) = roundtrip(codec, &[0.0; BLOCK]);
        assert!(y.iter().all(|&v| v == 0.0), "{codec}");
        let (_, _, y) = roundtrip(codec, &[-0.0; BLOCK]);
        assert!(y.iter().all(|&v| v == 0.0), "{codec}");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = Rng(3).block(1.0);
            x[17] = bad;
            let (_, _, y) = roundtrip(codec, &x);
            assert!(y.iter().all(|v| v.is_nan()), "{codec} {bad}");
        }
    }
}

/// The kept candidate is the rotated one exactly when the plain one is inexact and the
/// block's L1 norm is below `ROTATE_L1_RATIO H |S_p|` (plain on ties), and the bytes decode
/// to exactly that candidate.
#[test]
fn choice_is_predicted_from_the_l1_norm() {
    let mut rng = Rng(5);
    for codec in INTS {
        let (mut flagged, mut plain_kept) = (0, 0);
        for t in 0..4000 {
            let mut x = rng.block(1.0);
            if t % 3 == 0 {
                x[t % BLOCK] *= 10f32.powi((t % 5) as i32);
            }
            if t % 3 == 1 {
                // two outliers: the carried one takes one, the rotation spreads the other
                x[t % BLOCK] *= 10.0;
                x[(t * 7 + 3) % BLOCK] *= -10.0;
            }
            if t % 7 == 0 {
                // on a grid the plain scale codes exactly
                x = x.map(|v| (v * 4.0).round());
            }
            let k = first_max_index(&x);
            let (mut xp, mut xh) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
            let p = plain_candidate(codec, &x, k, x[k]);
            p.decode(codec, &mut xp);
            let h = hadamard_candidate(codec, &x);
            h.decode(codec, &mut xh);
            let exact = xp == x;
            let rotate = !exact && abs_sum(&x) < rotate_threshold(codec, p.s);
            let (_, _, y) = roundtrip(codec, &x);
            let want = if rotate { &xh } else { &xp };
            assert_eq!(
                y.map(f32::to_bits),
                want.map(f32::to_bits),
                "{codec} block {t}"
            );
            if rotate {
                flagged += 1;
            } else {
                plain_kept += 1;
            }
        }
        // Both codings occur on this mix.
        assert!(
            flagged > 200 && plain_kept > 200,
            "{codec}: {flagged} {plain_kept}"
        );
    }
}

/// Where the plain grid holds a block exactly, the block stays plain whatever its norm
/// says: constants and blocks of a few levels whose L1 norm is small enough to rotate.
#[test]
fn exact_blocks_stay_plain() {
    let mut rng = Rng(23);
    for codec in INTS {
        let mut found = 0;
        for t in 0..4000 {
            let c = [1.0f32, -0.75, 3.0, 0.5][t % 4];
            // A few equal (or halved) values among zeros: exact on the plain grid (the largest
            // carried, the next at code -H), while the rotation spreads them thin.
            let levels: &[f32] = if t % 2 == 0 { &[1.0] } else { &[1.0, 0.5] };
            let x: [f32; BLOCK] = std::array::from_fn(|_| match rng.next() % 8 {
                0 => c * levels[(rng.next() % levels.len() as u64) as usize],
                _ => 0.0,
            });
            let k = first_max_index(&x);
            let p = plain_candidate(codec, &x, k, x[k]);
            let mut xp = [0.0f32; BLOCK];
            p.decode(codec, &mut xp);
            if xp != x || abs_sum(&x) >= rotate_threshold(codec, p.s) {
                continue;
            }
            found += 1;
            let (_, side, y) = roundtrip(codec, &x);
            assert_eq!(y, x, "{codec} block {t} (side {side:02x?})");
        }
        assert!(
            found > 20,
            "{codec}: {found} exact blocks with the smaller rotated scale"
        );
    }
}

/// A spike far above the rest of its block: the spike comes back within its grid step and
/// the others keep most of their precision (v1 rounds them to zero from 2H times the rest).
#[test]
fn spike_keeps_the_rest_of_its_block() {
    let mut rng = Rng(9);
    for codec in INTS {
        let h = codec.half_range().unwrap() as f64;
        for &factor in &[10.0f32, 100.0, 1000.0, 1e5] {
            let (mut sig, mut noise) = (0.0f64, 0.0f64);
            for t in 0..200 {
                let mut x = rng.block(1.0);
                let k = t % BLOCK;
                x[k] = factor * if t % 2 == 0 { 1.0 } else { -1.0 };
                let (_, _, y) = roundtrip(codec, &x);
                assert!(
                    (f64::from(y[k]) - f64::from(x[k])).abs() <= f64::from(factor) / h * 0.51,
                    "{codec}: spike {} decoded {}",
                    x[k],
                    y[k]
                );
                for i in (0..BLOCK).filter(|&i| i != k) {
                    sig += f64::from(x[i]).powi(2);
                    noise += f64::from(x[i] - y[i]).powi(2);
                }
            }
            let snr = 10.0 * (sig / noise).log10();
            // The rest's scale comes from the second-largest element while the spike fits
            // K (up to 256x, 256x, 8x the rest's largest), then from the spike.
            let want = match (codec, factor) {
                (Codec::Int8V2, f) if f <= 100.0 => 35.0,
                (Codec::Int6V2, f) if f <= 100.0 => 23.0,
                (Codec::Int4V2, f) if f <= 10.0 => 10.0,
                (Codec::Int8V2, 1000.0) => 25.0,
                (Codec::Int6V2, 1000.0) => 20.0,
                _ => f64::NEG_INFINITY,
            };
            assert!(
                snr >= want,
                "{codec} spike x{factor}: rest SNR {snr:.2} dB < {want}"
            );
        }
    }
}

#[test]
fn error_within_step_bound_on_gaussian_and_spiky_blocks() {
    let mut rng = Rng(17);
    for codec in Codec::V2 {
        for e in (-40..=32).step_by(4) {
            for t in 0..300 {
                let mut x = rng.block(10f32.powi(e));
                if t % 4 == 0 {
                    x[t % BLOCK] *= 1000.0;
                }
                assert_within_bound(codec, &x);
            }
        }
    }
}

proptest! {
    #![proptest_config(super::prop_config::config(2000))]

    #[test]
    fn prop_v2_error_within_step_bound(
        v in prop::array::uniform32(-1.0f32..1.0),
        e in -45i32..37,
        spike in 0usize..40,
        spike_factor in 1.0f32..1e6,
    ) {
        let mut x = v.map(|a| a * 10f32.powi(e));
        if spike < BLOCK {
            x[spike] *= spike_factor;
        }
        if x.iter().all(|a| a.is_finite()) {
            for codec in Codec::V2 {
                assert_within_bound(codec, &x);
            }
        }
    }

    /// Same input, same bytes (no hidden state), and the decode is a pure function.
    #[test]
    fn prop_v2_deterministic(v in prop::array::uniform32(-100.0f32..100.0)) {
        for codec in Codec::V2 {
            let a = roundtrip(codec, &v);
            let b = roundtrip(codec, &v);
            prop_assert_eq!(&a.0, &b.0);
            prop_assert_eq!(&a.1, &b.1);
            prop_assert_eq!(a.2.map(f32::to_bits), b.2.map(f32::to_bits));
        }
    }
}

/// A block whose largest element is near f32's maximum: rounded to nearest, its half scale
/// times 6 would overflow and code 6 decode to Inf; the encoder takes the next lower scale.
#[test]
fn fp4_near_the_largest_f32_stays_finite() {
    let mut x = [0.0f32; BLOCK];
    for (i, v) in x.iter_mut().enumerate() {
        *v = (i as f32 - 15.5) * 6e31;
    }
    x[16] = -3.399_020_3e38;
    let y = assert_within_bound(Codec::Fp4E2M1, &x);
    assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
    for a in [f32::MAX, -f32::MAX, 3.0e38, 2.9e38] {
        let mut x = [1.0f32; BLOCK];
        x[3] = a;
        x[20] = a;
        let y = assert_within_bound(Codec::Fp4E2M1, &x);
        assert!(y.iter().all(|v| v.is_finite()), "{a}: {y:?}");
    }
}

/// Blocks whose largest element lies within a rounding of f32's maximum: a code or `K` that
/// rounds away from zero past it would decode to Inf; it is taken one toward zero.
#[test]
fn int_v2_near_the_largest_f32_stays_finite() {
    // Found by `prop_v2_error_within_step_bound`: one element, q4v2's 7-bit scale rounds
    // `m / 64` up, and `K = -64` decoded `64 S` past f32::MAX.
    let mut v = [0.0f32; BLOCK];
    v[14] = 0.960_623_8;
    let mut x = v.map(|a| a * 10f32.powi(33));
    x[14] *= 353_633.94;
    let mut blocks = vec![x];
    for a in [
        f32::MAX,
        -f32::MAX,
        3.4e38,
        -3.39e38,
        2.0f32.powi(127) * 1.999,
    ] {
        let mut x = [0.0f32; BLOCK];
        x[5] = a;
        blocks.push(x);
        // The rest sets the scale and rounds it up: a code `-H` or `H-1` past the maximum.
        blocks.push(std::array::from_fn(|i| if i % 3 == 0 { a } else { -a }));
        blocks.push(std::array::from_fn(
            |i| if i == 9 { a } else { -a / 1.0001 },
        ));
        // The rest's scale carries `m` and `rne(m / S)` rounds `K` up past the maximum.
        for d in [7.5f32, 100.5, 2000.5, 30000.5] {
            blocks.push(std::array::from_fn(|i| match i {
                0 => a,
                1 => -a / d,
                _ => a / (2.0 * d),
            }));
        }
    }
    let mut rng = Rng(41);
    for _ in 0..3000 {
        let mut x = rng.block(3e37);
        let k = (rng.next() % 32) as usize;
        x[k] = f32::MAX * (1.0 - (rng.next() % 1000) as f32 * 1e-6);
        x[k] = if rng.next() % 2 == 0 { x[k] } else { -x[k] };
        blocks.push(x);
    }
    for x in &blocks {
        for codec in INTS {
            let y = assert_within_bound(codec, x);
            assert!(y.iter().all(|v| v.is_finite()), "{codec}: {x:?} -> {y:?}");
        }
    }
}

/// Side fields a decoder must agree on: the q8v2 word's low byte holds index and flag, the
/// carried element's K is two's complement across its slot and the high byte.
#[test]
fn side_fields_say_what_the_spec_says() {
    let mut x = [0.25f32; BLOCK];
    x[9] = -300.0;
    for codec in INTS {
        let (codes, side, y) = roundtrip(codec, &x);
        assert_eq!(y[9], -300.0, "{codec}");
        let (k, flag, kq_hi) = match codec {
            Codec::Int4V2 => (
                usize::from(side[2] & 31),
                side[0] & 1,
                u32::from(side[2] >> 5),
            ),
            _ => (
                usize::from(side[0] >> 3 & 31),
                side[0] & 1,
                u32::from(side[4]),
            ),
        };
        assert_eq!((k, flag), (9, 0), "{codec}");
        let cb = codec.code_bits();
        let mut u = [0u8; BLOCK];
        unpack(codec, &codes, &mut u);
        let w = cb + if codec == Codec::Int4V2 { 3 } else { 8 };
        let raw = (kq_hi << cb) | u32::from(u[9]);
        let kq = ((raw << (32 - w)) as i32) >> (32 - w);
        let s = match codec {
            Codec::Int4V2 => scale_value(u16::from_le_bytes([side[0], side[1]])),
            _ => scale24_value(u32::from_le_bytes([side[0], side[1], side[2], side[3]])),
        };
        assert_eq!(kq as f32 * s, -300.0, "{codec}: K {kq} S {s}");
    }
}
