//! Accuracy of the two-stage quantized all-reduce, modelled with the public codec API.
//!
//! Eight ranks each hold `N` values ~ N(0, 1) rounded to the input dtype. The buffer is cut
//! into eight 32-aligned shards. Stage 1 (reduce-scatter): every other rank encodes its part
//! of shard j; owner j decodes the seven pieces, adds its own piece unquantized, sums in f32
//! in rank order 0..7 and re-encodes the sum (as the host backend and the GPU kernels do). Stage 2 (all-gather): every rank decodes the owner's bytes and rounds
//! to the output dtype. The result is compared with the exact (f64) sum of the inputs.
//!
//! Run `cargo test -p allreduce-core --test codec_quality -- --nocapture` for the table that
//! docs/codecs.md quotes.

use allreduce_core::codec::{decode, encode, BLOCK};
use allreduce_core::Codec;
use half::{bf16, f16};

const RANKS: usize = 8;
/// Elements per rank. With 2^20 other seeds move the figures by about ±0.015 dB.
const N: usize = 1 << 20;

/// The accuracy QuickReduce reports for its formats (dB); our floors for f16.
///
/// As specified (6-bit-mantissa scales) the format measures q8 42.25, q6 30.40 (30.399),
/// q4 18.31, fp8 29.38 dB here: q8, fp8 and (by 0.001 dB) q6 miss these floors. They are
/// QuickReduce's ideal-scale figures rounded to 0.1 dB; docs/codecs.md, "Measured accuracy",
/// has the analysis. The floors are kept as given: this test fails until the format or the
/// floors are changed by a deliberate decision.
fn floor_db(codec: Codec) -> f64 {
    match codec {
        Codec::Int8 => 42.5,
        Codec::Int6 => 30.4,
        Codec::Int4 => 18.3,
        Codec::Fp8E4M3 => 29.4,
    }
}

/// bf16 floors (not QuickReduce figures): what this test measured, minus 0.2 dB of margin
/// (fp8 29.38, q8 42.06, q6 30.38, q4 18.31; the data are deterministic). bf16 output
/// rounding (2^-9 relative) is felt by Q8 only.
fn bf16_floor_db(codec: Codec) -> f64 {
    match codec {
        Codec::Int8 => 41.8,
        Codec::Int6 => 30.1,
        Codec::Int4 => 18.1,
        Codec::Fp8E4M3 => 29.1,
    }
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal deviates, Box-Muller.
    fn gaussians(&mut self, n: usize) -> Vec<f64> {
        let mut v = Vec::with_capacity(n + 1);
        while v.len() < n {
            let r = (-2.0 * self.uniform().ln()).sqrt();
            let t = std::f64::consts::TAU * self.uniform();
            v.push(r * t.cos());
            v.push(r * t.sin());
        }
        v.truncate(n);
        v
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Dt {
    F16,
    BF16,
}

impl Dt {
    fn round(self, v: f32) -> f32 {
        match self {
            Dt::F16 => f16::from_f32(v).to_f32(),
            Dt::BF16 => bf16::from_f32(v).to_f32(),
        }
    }
    fn round_f64(self, v: f64) -> f32 {
        match self {
            Dt::F16 => f16::from_f64(v).to_f32(),
            Dt::BF16 => bf16::from_f64(v).to_f32(),
        }
    }
    /// Unit roundoff and half the smallest subnormal.
    fn rounding(self) -> (f64, f64) {
        match self {
            Dt::F16 => (2f64.powi(-11), 2f64.powi(-25)),
            Dt::BF16 => (2f64.powi(-8), 2f64.powi(-134)),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Dt::F16 => "f16",
            Dt::BF16 => "bf16",
        }
    }
}

/// Each rank's input, already rounded to the dtype (as f32), and the exact f64 sum.
fn inputs(dt: Dt) -> (Vec<Vec<f32>>, Vec<f64>) {
    let mut rng = SplitMix64(0x5EED_0000_0000_0001);
    let ranks: Vec<Vec<f32>> = (0..RANKS)
        .map(|_| {
            rng.gaussians(N)
                .into_iter()
                .map(|g| dt.round_f64(g))
                .collect()
        })
        .collect();
    let mut exact = vec![0.0f64; N];
    for r in &ranks {
        for (e, &v) in exact.iter_mut().zip(r) {
            *e += f64::from(v);
        }
    }
    (ranks, exact)
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// The two-stage quantized all-reduce. Returns the stage-2 decoded f32 result and, per
/// element, the composed error bound of docs/codecs.md (before output rounding):
/// `sum_r step_bound(amax_r) + 8 u32 sum_r |x̂_r| + step_bound(amax(partial sum))`.
fn quantized_allreduce(codec: Codec, ranks: &[Vec<f32>]) -> (Vec<f32>, Vec<f64>) {
    let shard = N.div_ceil(BLOCK).div_ceil(RANKS) * BLOCK;
    let mut out = vec![0.0f32; N];
    let mut bound = vec![0.0f64; N];
    let mut wire = Vec::new();
    let mut piece = Vec::new();
    let mut abs_sum = Vec::new();
    for j in 0..RANKS {
        let range = (j * shard).min(N)..((j + 1) * shard).min(N);
        let len = range.len();
        wire.resize(codec.encoded_len(len), 0u8);
        piece.resize(len, 0.0f32);
        abs_sum.clear();
        abs_sum.resize(len, 0.0f64);
        // Stage 1: rank r sends its encoded part of shard j; the owner decodes and sums.
        let acc = &mut out[range.clone()];
        let bnd = &mut bound[range.clone()];
        for (r, data) in ranks.iter().enumerate() {
            let x = &data[range.clone()];
            // The owner's own piece never travels, so it is not quantized.
            let own = r == j;
            if own {
                piece.copy_from_slice(x);
            } else {
                encode(codec, x, &mut wire);
                decode(codec, &wire, &mut piece);
            }
            for (k, (blk, dec)) in x.chunks(BLOCK).zip(piece.chunks(BLOCK)).enumerate() {
                let sb = if own {
                    0.0
                } else {
                    f64::from(codec.step_bound(amax(blk)))
                };
                let at = k * BLOCK;
                let acc = &mut acc[at..at + dec.len()];
                for (((a, &d), b), s) in acc
                    .iter_mut()
                    .zip(dec)
                    .zip(&mut bnd[at..])
                    .zip(&mut abs_sum[at..])
                {
                    *a = if r == 0 { d } else { *a + d };
                    *b += sb;
                    *s += f64::from(d.abs());
                }
            }
        }
        // Stage 2: the owner re-encodes the f32 partial sums; every rank decodes them.
        let gamma = 8.0 * 2f64.powi(-24); // f32 summation of 8 terms: gamma_7 < 8 u
        for ((blk, b), s) in acc
            .chunks(BLOCK)
            .zip(bnd.chunks_mut(BLOCK))
            .zip(abs_sum.chunks(BLOCK))
        {
            let sb = f64::from(codec.step_bound(amax(blk)));
            for (b, s) in b.iter_mut().zip(s) {
                *b += sb + gamma * s;
            }
        }
        encode(codec, acc, &mut wire);
        decode(codec, &wire, acc);
    }
    (out, bound)
}

/// SNR in dB of `out` against `exact`.
fn snr_db(out: &[f32], exact: &[f64]) -> f64 {
    let (mut sig, mut noise) = (0.0f64, 0.0f64);
    for (&o, &e) in out.iter().zip(exact) {
        sig += e * e;
        noise += (f64::from(o) - e).powi(2);
    }
    10.0 * (sig / noise).log10()
}

struct Row {
    codec: Codec,
    snr: f64,
    snr_f32: f64,
    worst_bound_use: f64,
}

fn measure(dt: Dt) -> (f64, Vec<Row>) {
    let (ranks, exact) = inputs(dt);
    // The exact path for reference: f32 sum in rank order, one rounding into the dtype.
    let exact_path: Vec<f32> = (0..N)
        .map(|i| dt.round(ranks.iter().skip(1).fold(ranks[0][i], |a, r| a + r[i])))
        .collect();
    let exact_snr = snr_db(&exact_path, &exact);
    let (u, tiny) = dt.rounding();
    let rows = std::thread::scope(|s| {
        let handles: Vec<_> = Codec::ALL
            .into_iter()
            .map(|codec| {
                let (ranks, exact) = (&ranks, &exact);
                s.spawn(move || {
                    let (out_f32, bound) = quantized_allreduce(codec, ranks);
                    let out: Vec<f32> = out_f32.iter().map(|&v| dt.round(v)).collect();
                    // The composed bound holds for every element, before and after rounding.
                    let mut worst = 0.0f64;
                    for i in 0..N {
                        let err = (f64::from(out_f32[i]) - exact[i]).abs();
                        assert!(
                            err <= bound[i],
                            "{codec} {}: element {i}: error {err:e} exceeds the composed bound {:e}",
                            dt.name(),
                            bound[i]
                        );
                        worst = worst.max(err / bound[i]);
                        let b = bound[i] + u * f64::from(out_f32[i].abs()) + tiny;
                        assert!((f64::from(out[i]) - exact[i]).abs() <= b);
                    }
                    Row { codec, snr: snr_db(&out, exact), snr_f32: snr_db(&out_f32, exact), worst_bound_use: worst }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    (exact_snr, rows)
}

fn print_table(dt: Dt, exact_snr: f64, rows: &[Row], floors: fn(Codec) -> f64) {
    println!();
    println!(
        "two-stage quantized all-reduce, {RANKS} ranks x {N} {} values ~ N(0,1)",
        dt.name()
    );
    println!(
        "| codec | bits/elem | SNR {} out (dB) | SNR f32 out (dB) | floor (dB) | max err / bound |",
        dt.name()
    );
    println!(
        "|-------|-----------|-----------------|------------------|------------|-----------------|"
    );
    for r in rows {
        println!(
            "| {:<5} | {:>9} | {:>15.3} | {:>16.3} | {:>10.1} | {:>15.3} |",
            r.codec.name(),
            r.codec.bits_per_element(),
            r.snr,
            r.snr_f32,
            floors(r.codec),
            r.worst_bound_use
        );
    }
    println!("| exact |        16 | {exact_snr:>15.3} |                  |            |                 |");
}

#[test]
fn two_stage_snr() {
    let (exact_f16, rows_f16) = measure(Dt::F16);
    print_table(Dt::F16, exact_f16, &rows_f16, floor_db);
    let (exact_bf16, rows_bf16) = measure(Dt::BF16);
    print_table(Dt::BF16, exact_bf16, &rows_bf16, bf16_floor_db);
    let mut misses = Vec::new();
    for (dt, rows, floors) in [
        ("f16", &rows_f16, floor_db as fn(Codec) -> f64),
        ("bf16", &rows_bf16, bf16_floor_db),
    ] {
        for r in rows.iter().filter(|r| r.snr < floors(r.codec)) {
            misses.push(format!(
                "{} {dt}: {:.3} dB < {} dB",
                r.codec,
                r.snr,
                floors(r.codec)
            ));
        }
    }
    assert!(
        misses.is_empty(),
        "quality floors missed (docs/codecs.md, \"Measured accuracy\"): {misses:?}"
    );
}
