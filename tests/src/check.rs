//! Result checks: exact bounds, codec bounds, bitwise agreement across ranks.

use allreduce::{Codec, DType, HostBytes};

use crate::data::to_f64;
use crate::harness::Outcome;

/// All ranks succeeded and hold identical bytes; returns rank 0's output.
pub fn bitwise_equal<'a>(outcomes: &'a [Outcome], what: &str) -> Result<&'a HostBytes, String> {
    // On failure, every rank's outcome: the rank whose error caused the others' is often not
    // rank 0 (a peer's timeout is a consequence).
    let all = || {
        outcomes
            .iter()
            .enumerate()
            .map(|(r, o)| match o {
                Ok(_) => format!("rank {r}: ok"),
                Err(e) => format!("rank {r}: {e}"),
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let mut first: Option<&HostBytes> = None;
    for (r, o) in outcomes.iter().enumerate() {
        let out = o
            .as_ref()
            .map_err(|_| format!("{what}: rank {r} failed [{}]", all()))?;
        match first {
            None => first = Some(out),
            Some(f) if f.as_slice() != out.as_slice() => {
                let i = f
                    .as_slice()
                    .iter()
                    .zip(out.as_slice())
                    .position(|(a, b)| a != b);
                return Err(format!(
                    "{what}: rank {r} differs from rank 0 (first byte {i:?})"
                ));
            }
            Some(_) => {}
        }
    }
    first.ok_or_else(|| format!("{what}: no ranks"))
}

/// The f64 view of a call's inputs, computed once and checked against many outputs.
pub struct Reference {
    pub dtype: DType,
    pub ranks: Vec<Vec<f64>>,
    /// Exact sum per element.
    pub sum: Vec<f64>,
    /// Sum of |x| per element.
    pub abs: Vec<f64>,
}

impl Reference {
    pub fn new(inputs: &[HostBytes], dtype: DType) -> Self {
        let ranks: Vec<Vec<f64>> = inputs.iter().map(|b| to_f64(b, dtype)).collect();
        let n = ranks.first().map_or(0, |r| r.len());
        let mut sum = ranks[0].clone();
        let mut abs: Vec<f64> = ranks[0].iter().map(|v| v.abs()).collect();
        for r in &ranks[1..] {
            for i in 0..n {
                sum[i] += r[i];
                abs[i] += r[i].abs();
            }
        }
        Reference {
            dtype,
            ranks,
            sum,
            abs,
        }
    }
}

/// Exact path: f32 accumulation (error at most (world-1) * 2^-24 * sum|x|) and one rounding
/// into the output dtype (half an ulp, or half the smallest subnormal near zero).
pub fn exact(out: &HostBytes, r: &Reference, what: &str) -> Result<(), String> {
    let (want, abs, dtype) = (&r.sum, &r.abs, r.dtype);
    let got = to_f64(out, dtype);
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements out, {} expected",
            got.len(),
            want.len()
        ));
    }
    let acc_err = (r.ranks.len().saturating_sub(1)) as f64 * 2f64.powi(-24);
    for (i, ((g, w), a)) in got.iter().zip(want).zip(abs).enumerate() {
        let bound =
            acc_err * a + dtype.unit_roundoff() * (w.abs() + acc_err * a) + dtype.min_subnormal();
        if (g - w).abs() > bound || g.is_nan() != w.is_nan() {
            return Err(format!(
                "{what}: element {i} is {g}, expected {w} (bound {bound:e})"
            ));
        }
    }
    Ok(())
}

/// Quantized path: per 32-element block, stage 1 adds at most sum_r step_bound(amax_r), the
/// owner's f32 sum is re-encoded (step_bound of its magnitude, itself at most sum_r amax_r
/// plus the stage-1 error), and the output is rounded once more.
pub fn lossy(out: &HostBytes, r: &Reference, codec: Codec, what: &str) -> Result<(), String> {
    let (want, rank_vals, dtype) = (&r.sum, &r.ranks, r.dtype);
    let got = to_f64(out, dtype);
    let n = want.len();
    let world = rank_vals.len();
    for start in (0..n).step_by(32) {
        let end = (start + 32).min(n);
        let amax = |v: &[f64]| v[start..end].iter().fold(0f64, |m, x| m.max(x.abs()));
        let stage1: f64 = rank_vals
            .iter()
            .map(|v| codec.step_bound(amax(v) as f32) as f64)
            .sum();
        let sum_amax: f64 = rank_vals.iter().map(|v| amax(v)).sum::<f64>() + stage1;
        let stage2 = codec.step_bound(sum_amax as f32) as f64;
        let acc = (world.saturating_sub(1)) as f64 * 2f64.powi(-24) * sum_amax;
        for i in start..end {
            let bound = stage1
                + stage2
                + acc
                + dtype.unit_roundoff() * (want[i].abs() + stage1 + stage2)
                + dtype.min_subnormal();
            if (got[i] - want[i]).abs() > bound || got[i].is_nan() {
                return Err(format!(
                    "{what}: element {i} is {}, expected {} (codec bound {bound:e})",
                    got[i], want[i]
                ));
            }
        }
    }
    Ok(())
}

/// The quantized two-shot's result computed in one place from the format's definition
/// (docs/codecs.md, "Composition in the all-reduce"): shards of whole 32-element blocks; each
/// owner sums, in rank order from rank 0, every peer's encoded-then-decoded piece and its own
/// piece unquantized, in f32; encodes the sum once; every rank decodes those bytes and rounds
/// once into the dtype. Every backend's output must equal this bit for bit.
pub fn quantized_expected(inputs: &[HostBytes], dtype: DType, codec: Codec) -> HostBytes {
    let n = inputs[0].len() / dtype.size();
    quantized_expected_in_pieces(inputs, dtype, codec, n.max(1))
}

/// [`quantized_expected`] of a call that a backend ran as consecutive pieces of `piece`
/// elements (`layout::piece_len`), each a whole quantized all-reduce of its range.
pub fn quantized_expected_in_pieces(
    inputs: &[HostBytes],
    dtype: DType,
    codec: Codec,
    piece: usize,
) -> HostBytes {
    let n = inputs[0].len() / dtype.size();
    let mut out = HostBytes::zeroed(n * dtype.size());
    let mut start = 0;
    while start < n {
        let end = (start + piece).min(n);
        let bytes = start * dtype.size()..end * dtype.size();
        let parts: Vec<HostBytes> = inputs
            .iter()
            .map(|b| HostBytes::from_bytes(&b.as_slice()[bytes.clone()]))
            .collect();
        let got = quantized_expected_whole(&parts, dtype, codec);
        out.as_mut_slice()[bytes].copy_from_slice(got.as_slice());
        start = end;
    }
    out
}

fn quantized_expected_whole(inputs: &[HostBytes], dtype: DType, codec: Codec) -> HostBytes {
    use allreduce::{codec as c, layout};
    let world = inputs.len();
    let n = inputs[0].len() / dtype.size();
    let f32s: Vec<Vec<f32>> = inputs
        .iter()
        .map(|b| (0..n).map(|i| dtype.load_f32(b.as_slice(), i)).collect())
        .collect();
    let mut out = HostBytes::zeroed(n * dtype.size());
    for owner in 0..world {
        let range = layout::shard_range(n, world, owner, layout::QUANT_GRANULE);
        let len = range.len();
        if len == 0 {
            continue;
        }
        let mut acc = vec![0f32; len];
        let mut piece = vec![0f32; len];
        let mut bytes = vec![0u8; codec.encoded_len(len)];
        for (r, x) in f32s.iter().enumerate() {
            if r == owner {
                piece.copy_from_slice(&x[range.clone()]);
            } else {
                c::encode(codec, &x[range.clone()], &mut bytes);
                c::decode(codec, &bytes, &mut piece);
            }
            for (a, p) in acc.iter_mut().zip(&piece) {
                *a = if r == 0 { *p } else { *a + *p };
            }
        }
        c::encode(codec, &acc, &mut bytes);
        c::decode(codec, &bytes, &mut piece);
        for (i, v) in range.zip(&piece) {
            dtype.store_f32(out.as_mut_slice(), i, *v);
        }
    }
    out
}

/// The hierarchical quantized all-reduce's result (`allreduce::hierarchical::reference`, two
/// groups of `inputs.len() / 2` consecutive ranks), rounded into the dtype, for a call run as
/// pieces of `piece` elements (`n` for an unsplit call). Every backend's output must equal it
/// bit for bit.
pub fn hierarchical_expected_in_pieces(
    inputs: &[HostBytes],
    dtype: DType,
    codec: Codec,
    piece: usize,
) -> HostBytes {
    let n = inputs[0].len() / dtype.size();
    let g = inputs.len() / 2;
    let mut out = HostBytes::zeroed(n * dtype.size());
    let mut start = 0;
    while start < n {
        let end = (start + piece.max(1)).min(n);
        let f32s: Vec<Vec<f32>> = inputs
            .iter()
            .map(|b| {
                (start..end)
                    .map(|i| dtype.load_f32(b.as_slice(), i))
                    .collect()
            })
            .collect();
        let got = allreduce::hierarchical::reference(&f32s, g, codec);
        for (i, v) in (start..end).zip(got) {
            dtype.store_f32(out.as_mut_slice(), i, v);
        }
        start = end;
    }
    out
}

/// [`hierarchical_expected_in_pieces`] of an unsplit call.
pub fn hierarchical_expected(inputs: &[HostBytes], dtype: DType, codec: Codec) -> HostBytes {
    let n = inputs[0].len() / dtype.size();
    hierarchical_expected_in_pieces(inputs, dtype, codec, n)
}

/// `out` equals `want` bit for bit, NaNs comparing by being NaN.
pub fn same_values(
    out: &HostBytes,
    want: &HostBytes,
    dtype: DType,
    what: &str,
) -> Result<(), String> {
    let n = want.len() / dtype.size();
    if out.len() != want.len() {
        return Err(format!(
            "{what}: {} bytes out, {} expected",
            out.len(),
            want.len()
        ));
    }
    for i in 0..n {
        let (g, w) = (
            dtype.load_f32(out.as_slice(), i),
            dtype.load_f32(want.as_slice(), i),
        );
        if g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()) {
            return Err(format!(
                "{what}: element {i} is {g:e} ({:#x}), the reference gives {w:e} ({:#x})",
                g.to_bits(),
                w.to_bits()
            ));
        }
    }
    Ok(())
}

/// `out` equals [`quantized_expected`] bit for bit (NaNs compare by being NaN: a GPU's f32
/// arithmetic returns its own canonical NaN).
pub fn quantized_bitwise(
    out: &HostBytes,
    inputs: &[HostBytes],
    dtype: DType,
    codec: Codec,
    what: &str,
) -> Result<(), String> {
    let n = inputs[0].len() / dtype.size();
    quantized_bitwise_in_pieces(out, inputs, dtype, codec, n.max(1), what)
}

/// [`quantized_bitwise`] for a call run as pieces of `piece` elements.
pub fn quantized_bitwise_in_pieces(
    out: &HostBytes,
    inputs: &[HostBytes],
    dtype: DType,
    codec: Codec,
    piece: usize,
    what: &str,
) -> Result<(), String> {
    let want = quantized_expected_in_pieces(inputs, dtype, codec, piece);
    same_values(
        out,
        &want,
        dtype,
        &format!("{what} (against the format's definition)"),
    )
}

/// SNR in dB of `out` against the exact sum.
pub fn snr_db(out: &HostBytes, r: &Reference) -> f64 {
    let got = to_f64(out, r.dtype);
    let sig: f64 = r.sum.iter().map(|w| w * w).sum();
    let noise: f64 = got.iter().zip(&r.sum).map(|(g, w)| (g - w) * (g - w)).sum();
    10.0 * (sig / noise).log10()
}
