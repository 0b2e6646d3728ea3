//! Blocks that exercise every branch of the codec format, for tests that compare a codec
//! implementation with the Rust reference (`allreduce::codec`) bit for bit.
//!
//! [`adversarial_blocks`] are chosen by hand (zeros, -0.0, Inf/NaN, f32 extremes, subnormals,
//! spikes, rounding and first-maximum ties, the adaptive range's edges, fp4's half scales);
//! [`random_blocks`] are normal blocks over the whole f32 range of scales, at the scale of
//! activations, and rounded to bf16 (what the kernels see from bf16 input). [`elements`] is
//! all of them plus a ragged tail.

use allreduce::codec::BLOCK;

use crate::data::Rng;

/// The hand-chosen blocks, `BLOCK` elements each, concatenated.
pub fn adversarial_blocks() -> Vec<f32> {
    let mut v: Vec<f32> = Vec::new();
    let mut block = |f: &dyn Fn(usize) -> f32| v.extend((0..BLOCK).map(f));
    block(&|_| 0.0);
    block(&|_| -0.0);
    block(&|i| if i % 3 == 0 { -0.0 } else { 0.0 });
    block(&|i| if i == 7 { 1e30 } else { 1.0 });
    block(&|i| if i == 31 { f32::MAX } else { -1.0 });
    block(&|i| if i == 0 { -f32::MAX } else { f32::MIN_POSITIVE });
    block(&|i| (i as f32 - 16.0) * 1e-45); // f32 subnormals
    block(&|i| f32::from_bits(i as u32 + 1)); // the smallest subnormals
    block(&|i| if i == 13 { -f32::from_bits(1) } else { 0.0 }); // one tiny negative
                                                                // Inf and NaN in every lane of a quad.
    block(&|i| if i == 3 { f32::INFINITY } else { i as f32 });
    block(&|i| if i == 30 { f32::NEG_INFINITY } else { 1.0 });
    block(&|i| if i == 12 { f32::NAN } else { 2.0 });
    block(&|i| if i == 20 { -f32::NAN } else { 1e30 });
    block(&|i| if i == 9 { f32::NAN } else { f32::INFINITY });
    block(&|_| f32::NAN);
    // First-maximum ties: equal magnitudes, both signs, in different lanes and in one lane.
    block(&|i| if i % 2 == 0 { 3.0 } else { -3.0 });
    block(&|i| if i % 2 == 0 { -3.0 } else { 3.0 });
    for (a, b) in [(5, 21), (21, 5), (8, 16), (0, 31), (9, 10)] {
        block(&|i| {
            if i == a {
                -7.0
            } else if i == b {
                7.0
            } else {
                (i as f32) * 0.01
            }
        });
    }
    block(&|i| if i == 11 || i == 27 { 6.5 } else { 0.25 }); // equal maxima, same sign
    block(&|i| (i as f32 - 15.5) * 0.5); // halves: rounding ties
    block(&|i| i as f32 * 8.0 - 128.0); // the integer grid of q4/q8
    block(&|_| 5.0); // constant
    block(&|_| -5.0);
    // One nonzero magnitude beside zeros (the adaptive codecs keep it plain), zeros first
    // and last, and a sign pattern of it.
    block(&|i| if i < 19 { 0.0 } else { 15.0 });
    block(&|i| if i < 13 { -0.75 } else { 0.0 });
    block(&|i| match i % 3 {
        0 => 6.0,
        1 => -6.0,
        _ => 0.0,
    });
    block(&|i| if i == 9 { 100.0 } else { 0.01 * i as f32 }); // spike
    block(&|i| (i as f32 * 0.7).sin()); // smooth
    block(&|i| if i % 2 == 0 { 1.0 } else { -1.0 }); // alternating
                                                     // v2's carried element: a negative spike, a spike beside a runner-up, and spikes so far
                                                     // above the rest that K clamps (q4v2's 7 bits first).
    block(&|i| {
        if i == 20 {
            -300.0
        } else {
            (i as f32 * 0.3).cos()
        }
    });
    block(&|i| match i {
        4 => 250.0,
        5 => -249.0,
        _ => (i as f32) * 0.1 - 1.0,
    });
    for big in [70.0f32, 5e3, 3e6] {
        block(&|i| {
            if i == 17 {
                big
            } else {
                1.0 - (i % 5) as f32 * 0.5
            }
        });
    }
    // Spikes 10^2 .. 10^6 times the rest, both signs, at each lane's edges.
    let mut rng = Rng::new(0x5B1C_E5ED);
    for ratio in [1e2f32, 1e3, 1e4, 1e5, 1e6] {
        for sign in [1.0f32, -1.0] {
            for at in [0usize, 7, 8, 15, 16, 31] {
                let rest: Vec<f32> = (0..BLOCK).map(|_| rng.normal() as f32).collect();
                block(&|i| if i == at { sign * ratio } else { rest[i] });
            }
        }
    }
    block(&|i| if i == 5 { 448.0 * 3.0 } else { 1.0 / 64.0 }); // fp8 subnormal codes
    block(&|i| if i == 0 { 2f32.powi(-48) } else { 0.0 }); // adaptive range's lower edge
    block(&|i| {
        if i == 0 {
            2f32.powi(-48) * 0.999
        } else {
            1e-20
        }
    });
    block(&|i| if i == 1 { 2f32.powi(48) } else { 3.0 }); // upper edge
    block(&|i| if i == 1 { 2f32.powi(48) * 1.001 } else { 3.0 });
    block(&|i| {
        if i == 2 {
            65504.0
        } else {
            -65504.0 * (i as f32 / 40.0)
        }
    });
    // Scales of exactly -1 (m = H) and 1 (fp8, amax = 448): quotients on and next to
    // the codes' rounding boundaries, where the kernels fall back to a true division.
    for h in [128.0f32, 32.0, 8.0] {
        let ulp = f32::EPSILON * 16.0;
        block(&|i| match i {
            0 => h,
            _ if i % 3 == 0 => (i % 8) as f32 - 4.5,
            _ if i % 3 == 1 => (i % 8) as f32 - 4.5 + ulp,
            _ => -((i % 8) as f32) + 2.5 - ulp,
        });
    }
    block(&|i| match i {
        0 => 448.0,
        _ if i % 4 == 0 => 1.0625, // midpoint of 1 and 1.125
        _ if i % 4 == 1 => f32::from_bits(1.0625f32.to_bits() + 1),
        _ if i % 4 == 2 => -f32::from_bits(1.0625f32.to_bits() - 1),
        _ => 3.0 / 1024.0 + (i as f32) / 512.0, // E4M3 subnormal halves
    });
    // fp4: E2M1's midpoints (0.25, 0.75, ..., 5) times a half scale of 1 (amax 6), one half
    // empty, and halves far apart (the small half's E4M3 scale subnormal or zero).
    let e2m1_ties = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0];
    block(&|i| {
        let t = e2m1_ties[i % 8];
        if i % 3 == 0 {
            -t
        } else {
            t
        }
    });
    block(&|i| if i < 16 { 0.0 } else { (i as f32 - 20.0) * 0.3 });
    // Halves of one magnitude (scale a quarter of it) beside halves that are not.
    block(&|i| if i < 16 { 3.0 } else { (i as f32 - 20.0) * 0.3 });
    block(&|i| match i {
        _ if i < 16 => i as f32 * 0.1,
        _ if i % 2 == 0 => -0.75,
        _ => 0.75,
    });
    block(&|i| if i >= 16 { 0.0 } else { (i as f32 - 4.0) * 0.3 });
    for ratio in [1e3f32, 1e5, 1e7, 1e9] {
        block(&|i| {
            let x = ((i * 7 % 11) as f32 - 5.0) * 0.2;
            if i < 16 {
                x * ratio
            } else {
                x
            }
        });
        block(&|i| {
            let x = ((i * 5 % 13) as f32 - 6.0) * 0.2;
            if i >= 16 {
                x * ratio
            } else {
                x
            }
        });
    }
    // f32 extremes without Inf: the largest finite block scales.
    block(&|i| (i as f32 - 15.0) * 1e37);
    block(&|i| if i == 6 { f32::MAX } else { -f32::MAX / 3.0 });
    // Within a rounding of f32's maximum, where a rounded-up scale or quotient would decode a
    // code (or v2's K) to Inf: the codes there are one toward zero.
    block(&|i| if i == 5 { f32::MAX } else { 0.0 });
    block(&|i| if i % 3 == 0 { -f32::MAX } else { f32::MAX });
    for a in [f32::MAX, -3.4e38] {
        block(&|i| match i {
            0 => a,
            1 => -a / 2000.5,
            _ => a / 4001.0,
        });
    }
    v
}

/// `count` random blocks: normal blocks scaled by 2^-140 .. 2^120 in turn (every tenth with
/// outliers), then blocks of N(0, 1) as they come, then N(0, 1) rounded to bf16.
pub fn random_blocks(count: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut v = Vec::with_capacity(count * BLOCK);
    let (sweep, plain) = (count / 2, count / 3);
    for b in 0..count {
        for i in 0..BLOCK {
            let x = rng.normal();
            let x = if b < sweep {
                let scale = 2f64.powi((b % 261) as i32 - 140);
                let outlier = if b % 10 == 0 && i % 11 == 3 {
                    30.0
                } else {
                    1.0
                };
                (x * scale * outlier) as f32
            } else if b < sweep + plain {
                x as f32
            } else {
                half::bf16::from_f64(x).to_f32()
            };
            v.push(x);
        }
    }
    v
}

/// Every test block ([`adversarial_blocks`], then 3000 [`random_blocks`]) and a ragged tail
/// of 19 elements: `n` is not a multiple of [`BLOCK`].
pub fn elements() -> Vec<f32> {
    let mut v = adversarial_blocks();
    v.extend(random_blocks(3000, 20261203));
    v.extend((0..19).map(|i| i as f32 - 9.0));
    v
}
