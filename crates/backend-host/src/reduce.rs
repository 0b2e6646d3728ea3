//! The arithmetic every backend must reproduce: f32 accumulation in rank order, starting
//! from rank 0's value (so a sum of -0.0s stays -0.0, as in exact arithmetic), and one
//! rounding into the output dtype. Any backend that follows it gives bit-identical results.

use allreduce_core::Element;

/// Elements per inner chunk: keeps the f32 accumulator in L1 while ranks stream past it.
pub const CHUNK: usize = 2048;

/// `out[i] = round(sum over s of inputs[s][i])`, accumulated in f32 in rank order.
pub fn sum_into<T: Element>(inputs: &[&[T]], out: &mut [T]) {
    sum_mapped_into(inputs, out, |x| x)
}

/// [`sum_into`] with every input -0.0 taken as +0.0, as the push one-shot sends them (its
/// "not written yet" marker is -0.0). `x + 0.0` is `x` for every other value, NaN included
/// as a NaN, and +0.0 for -0.0 (round to nearest). The only results that differ from
/// [`sum_into`]'s: +0.0 where every rank's input is -0.0.
pub fn sum_pushed_into<T: Element>(inputs: &[&[T]], out: &mut [T]) {
    sum_mapped_into(inputs, out, |x| x + 0.0)
}

fn sum_mapped_into<T: Element>(inputs: &[&[T]], out: &mut [T], map: impl Fn(f32) -> f32) {
    let mut acc = [0f32; CHUNK];
    let n = out.len();
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        let acc = &mut acc[..len];
        for (a, x) in acc.iter_mut().zip(&inputs[0][start..start + len]) {
            *a = map(x.to_f32());
        }
        for input in &inputs[1..] {
            for (a, x) in acc.iter_mut().zip(&input[start..start + len]) {
                *a += map(x.to_f32());
            }
        }
        for (o, a) in out[start..start + len].iter_mut().zip(acc.iter()) {
            *o = T::from_f32(*a);
        }
        start += len;
    }
}

/// `acc = x` for the first rank, `acc += x` for the others: the f32 form the quantized
/// path uses between decode and re-encode.
pub fn accumulate(acc: &mut [f32], x: &[f32], first: bool) {
    if first {
        acc.copy_from_slice(x);
    } else {
        for (a, v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

pub fn widen<T: Element>(src: &[T], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

pub fn narrow<T: Element>(src: &[f32], dst: &mut [T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(*s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// The push rule changes exactly one case: every input -0.0.
    #[test]
    fn pushed_sums_differ_only_where_every_input_is_minus_zero() {
        let a = [-0.0f32, -0.0, 1.5, -0.0, f32::NAN];
        let b = [-0.0f32, 0.0, -0.0, -2.0, 1.0];
        let (mut plain, mut pushed) = ([0f32; 5], [0f32; 5]);
        sum_into(&[&a, &b], &mut plain);
        sum_pushed_into(&[&a, &b], &mut pushed);
        assert_eq!(plain[0].to_bits(), (-0.0f32).to_bits());
        assert_eq!(pushed[0].to_bits(), 0.0f32.to_bits());
        for i in 1..4 {
            assert_eq!(plain[i].to_bits(), pushed[i].to_bits(), "element {i}");
        }
        assert!(pushed[4].is_nan());
        // A negative sum too small for bf16 still rounds to -0.0: only inputs are mapped.
        let tiny = [bf16::from_bits(0x0001), bf16::from_f32(0.0)];
        let neg = [bf16::from_bits(0x8002), bf16::from_f32(-0.0)];
        let mut out = [bf16::ZERO; 2];
        sum_pushed_into(&[&tiny, &neg], &mut out);
        assert_eq!(out[0].to_bits(), 0x8001);
        assert_eq!(out[1].to_bits(), 0x0000);
    }
}
