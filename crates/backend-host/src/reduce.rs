//! The arithmetic every backend must reproduce: f32 accumulation in rank order, starting
//! from rank 0's value (so a sum of -0.0s stays -0.0, as in exact arithmetic), and one
//! rounding into the output dtype. Any backend that follows it gives bit-identical results.

use allreduce_core::Element;

/// Elements per inner chunk: keeps the f32 accumulator in L1 while ranks stream past it.
pub const CHUNK: usize = 2048;

/// `out[i] = round(sum over s of inputs[s][i])`, accumulated in f32 in rank order.
pub fn sum_into<T: Element>(inputs: &[&[T]], out: &mut [T]) {
    let mut acc = [0f32; CHUNK];
    let n = out.len();
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        let acc = &mut acc[..len];
        for (a, x) in acc.iter_mut().zip(&inputs[0][start..start + len]) {
            *a = x.to_f32();
        }
        for input in &inputs[1..] {
            for (a, x) in acc.iter_mut().zip(&input[start..start + len]) {
                *a += x.to_f32();
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
