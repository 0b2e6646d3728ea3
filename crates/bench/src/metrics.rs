//! Bandwidths, and the correctness/accuracy check of a row's outputs.

use std::ops::Range;

use allreduce::DType;

use crate::data::{Inputs, CHUNK};

/// nccl-tests' all-reduce bus bandwidth factor: a ring all-reduce moves `2*(n-1)/n` times the
/// buffer through each rank's link. 0 for a single rank (nothing moves).
pub fn bus_factor(world: usize) -> f64 {
    if world == 0 {
        return 0.0;
    }
    2.0 * (world as f64 - 1.0) / world as f64
}

/// Algorithm bandwidth in GB/s (10^9 bytes per second) of `bytes` per rank in `seconds`.
pub fn algbw_gbps(bytes: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// Error of an output against its reference, accumulated element by element.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ErrorStats {
    pub elements: u64,
    pub sum_ref2: f64,
    pub sum_err2: f64,
    pub max_abs_err: f64,
    /// Outputs that are NaN or infinite (where the reference is finite).
    pub non_finite: u64,
    /// Per hidden channel (element `i` is channel `i % hidden`): sum ref^2 and sum err^2 of
    /// the elements added with [`ErrorStats::add_in_channel`]. Empty when none were.
    pub channel_ref2: Vec<f64>,
    pub channel_err2: Vec<f64>,
    /// The same sums over the elements of plain rows only (rows without the data set's
    /// massive values: `Inputs::plain_row`), added with [`ErrorStats::add_plain`].
    pub plain_elements: u64,
    pub plain_ref2: f64,
    pub plain_err2: f64,
}

impl ErrorStats {
    #[inline]
    pub fn add(&mut self, reference: f64, got: f64) {
        self.elements += 1;
        self.sum_ref2 += reference * reference;
        let err = (got - reference).abs();
        if err.is_finite() {
            self.sum_err2 += err * err;
            self.max_abs_err = self.max_abs_err.max(err);
        } else {
            self.non_finite += 1;
            self.sum_err2 = f64::INFINITY;
            self.max_abs_err = f64::INFINITY;
        }
    }

    /// [`ErrorStats::add`], and the same element into channel `channel`'s sums.
    #[inline]
    pub fn add_in_channel(&mut self, channel: usize, reference: f64, got: f64) {
        self.add(reference, got);
        if channel >= self.channel_ref2.len() {
            self.channel_ref2.resize(channel + 1, 0.0);
            self.channel_err2.resize(channel + 1, 0.0);
        }
        let err = got - reference;
        self.channel_ref2[channel] += reference * reference;
        // A NaN error counts as infinite, as in `add`.
        self.channel_err2[channel] += if err.is_finite() {
            err * err
        } else {
            f64::INFINITY
        };
    }

    /// Count an element (already added) into the plain rows' sums too.
    #[inline]
    pub fn add_plain(&mut self, reference: f64, got: f64) {
        self.plain_elements += 1;
        self.plain_ref2 += reference * reference;
        let err = got - reference;
        self.plain_err2 += if err.is_finite() {
            err * err
        } else {
            f64::INFINITY
        };
    }

    pub fn merge(&mut self, other: &ErrorStats) {
        self.elements += other.elements;
        self.plain_elements += other.plain_elements;
        self.plain_ref2 += other.plain_ref2;
        self.plain_err2 += other.plain_err2;
        self.sum_ref2 += other.sum_ref2;
        self.sum_err2 += other.sum_err2;
        self.max_abs_err = self.max_abs_err.max(other.max_abs_err);
        self.non_finite += other.non_finite;
        if self.channel_ref2.len() < other.channel_ref2.len() {
            self.channel_ref2.resize(other.channel_ref2.len(), 0.0);
            self.channel_err2.resize(other.channel_err2.len(), 0.0);
        }
        for (a, b) in self.channel_ref2.iter_mut().zip(&other.channel_ref2) {
            *a += b;
        }
        for (a, b) in self.channel_err2.iter_mut().zip(&other.channel_err2) {
            *a += b;
        }
    }

    /// Signal-to-noise ratio in dB: `10 log10(sum ref^2 / sum err^2)`; +inf when the output is
    /// exact, NaN when there are no elements.
    pub fn snr_db(&self) -> f64 {
        snr_db(self.sum_ref2, self.sum_err2, self.elements)
    }

    /// Channel-equalized SNR in dB: `-10 log10(mean over channels of err^2 / ref^2)`, each
    /// channel's energies summed over its rows. Every channel weighs the same, so a few
    /// massive channels (whose large values the codecs keep well) cannot hide the error the
    /// rest of their blocks take. Channels with no signal and no error are left out; one
    /// with error but no signal makes it -inf. +inf when exact, NaN with no channels.
    pub fn channel_snr_db(&self) -> f64 {
        let (mut sum, mut channels) = (0.0f64, 0u64);
        for (&r, &e) in self.channel_ref2.iter().zip(&self.channel_err2) {
            if r > 0.0 {
                sum += e / r;
                channels += 1;
            } else if e > 0.0 {
                return f64::NEG_INFINITY;
            }
        }
        snr_db(channels as f64, sum, channels)
    }
}

impl ErrorStats {
    /// The worst channel's SNR in dB (each channel's energies summed over its rows): the
    /// channel a codec serves worst, which an average hides. -inf if a channel with no signal
    /// has error; NaN with no channels.
    pub fn worst_channel_snr_db(&self) -> f64 {
        let mut worst = f64::NAN;
        for (&r, &e) in self.channel_ref2.iter().zip(&self.channel_err2) {
            let snr = if r > 0.0 {
                snr_db(r, e, 1)
            } else if e > 0.0 {
                f64::NEG_INFINITY
            } else {
                continue;
            };
            if worst.is_nan() || snr < worst {
                worst = snr;
            }
        }
        worst
    }

    /// SNR in dB over the plain rows only (see [`ErrorStats::add_plain`]): what the rows that
    /// carry no massive value get, NaN when no row was plain.
    pub fn plain_snr_db(&self) -> f64 {
        snr_db(self.plain_ref2, self.plain_err2, self.plain_elements)
    }
}

/// `10 log10(signal / noise)` (energies); +inf for zero noise, NaN for no elements.
pub fn snr_db(signal: f64, noise: f64, elements: u64) -> f64 {
    if elements == 0 {
        f64::NAN
    } else if noise == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (signal / noise).log10()
    }
}

/// The check of one shard of a row (or, merged, of the whole row).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Check {
    /// Output elements, over all ranks, not bitwise equal to the expected value (exact rows).
    pub wrong_elements: u64,
    /// Per rank: whether its output differs bitwise from rank 0's anywhere.
    pub differs_from_rank0: Vec<bool>,
    /// Rank 0's output against the f64 reference.
    pub stats: ErrorStats,
}

impl Check {
    pub fn merge(&mut self, other: &Check) {
        self.wrong_elements += other.wrong_elements;
        if self.differs_from_rank0.len() < other.differs_from_rank0.len() {
            self.differs_from_rank0
                .resize(other.differs_from_rank0.len(), false);
        }
        for (a, &b) in self
            .differs_from_rank0
            .iter_mut()
            .zip(&other.differs_from_rank0)
        {
            *a |= b;
        }
        self.stats.merge(&other.stats);
    }

    pub fn ranks_differing(&self) -> usize {
        self.differs_from_rank0.iter().filter(|&&d| d).count()
    }
}

/// The bits of element `i` of a little-endian `dtype` byte slice.
#[inline]
fn bits(dtype: DType, bytes: &[u8], i: usize) -> u32 {
    match dtype.size() {
        2 => u32::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        _ => u32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ]),
    }
}

/// The bits of `v` rounded to `dtype`.
#[inline]
fn encode_bits(dtype: DType, v: f32) -> u32 {
    let mut b = [0u8; 4];
    dtype.store_f32(&mut b, 0, v);
    bits(dtype, &b, 0)
}

/// Check elements `range` of every rank's output (`outputs[r]`, little-endian `dtype` bytes)
/// against the sum of `inputs` over `outputs.len()` ranks.
///
/// Exact rows (`exact`) expect every element to be the exact sum rounded once to the dtype,
/// bit for bit; every row compares each rank's bytes with rank 0's and measures rank 0's
/// error against the f64 reference.
pub fn check_range(inputs: &Inputs, exact: bool, outputs: &[&[u8]], range: Range<usize>) -> Check {
    let world = outputs.len();
    let dtype = inputs.dtype;
    let size = dtype.size();
    let mut check = Check {
        differs_from_rank0: vec![false; world],
        ..Check::default()
    };
    let (Some(&out0), true) = (outputs.first(), !range.is_empty()) else {
        return check;
    };
    let byte_range = range.start * size..range.end * size;
    for (r, out) in outputs.iter().enumerate().skip(1) {
        check.differs_from_rank0[r] = out[byte_range.clone()] != out0[byte_range.clone()];
    }
    let mut reference = vec![0f64; CHUNK.min(range.len())];
    let mut scratch = Vec::new();
    let mut start = range.start;
    while start < range.end {
        let len = CHUNK.min(range.end - start);
        let reference = &mut reference[..len];
        inputs.reference(world, start, reference, &mut scratch);
        for (j, &want) in reference.iter().enumerate() {
            let i = start + j;
            let got = f64::from(dtype.load_f32(out0, i));
            check.stats.add_in_channel(i % inputs.hidden, want, got);
            if inputs.plain_row(i / inputs.hidden) {
                check.stats.add_plain(want, got);
            }
        }
        if exact {
            for (j, &want) in reference.iter().enumerate() {
                let i = start + j;
                let want = encode_bits(dtype, want as f32);
                check.wrong_elements += outputs
                    .iter()
                    .filter(|out| bits(dtype, out, i) != want)
                    .count() as u64;
            }
        }
        start += len;
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{int_pattern, DataSet};

    #[test]
    fn bus_factor_matches_nccl_tests() {
        assert_eq!(bus_factor(1), 0.0);
        assert_eq!(bus_factor(2), 1.0);
        assert_eq!(bus_factor(4), 1.5);
        assert_eq!(bus_factor(8), 1.75);
        assert!((algbw_gbps(1 << 30, 1.0) - 1.073741824).abs() < 1e-12);
    }

    #[test]
    fn snr_of_a_known_case() {
        // Reference all ones, errors of +-0.1: signal 4, noise 0.04, SNR = 10 log10(100) = 20 dB.
        let mut s = ErrorStats::default();
        for (r, g) in [(1.0, 1.1), (1.0, 0.9), (1.0, 1.1), (1.0, 0.9)] {
            s.add(r, g);
        }
        assert!((s.snr_db() - 20.0).abs() < 1e-9, "{}", s.snr_db());
        assert!((s.max_abs_err - 0.1).abs() < 1e-12);
        // Merging halves gives the same answer.
        let (mut a, mut b) = (ErrorStats::default(), ErrorStats::default());
        a.add(1.0, 1.1);
        a.add(1.0, 0.9);
        b.add(1.0, 1.1);
        b.add(1.0, 0.9);
        a.merge(&b);
        assert!((a.snr_db() - 20.0).abs() < 1e-9);
        assert_eq!(snr_db(1.0, 0.0, 3), f64::INFINITY);
        assert!(snr_db(1.0, 0.0, 0).is_nan());
        let mut nan = ErrorStats::default();
        nan.add(1.0, f64::NAN);
        assert_eq!(nan.snr_db(), f64::NEG_INFINITY);
        assert_eq!(nan.non_finite, 1);
    }

    #[test]
    fn channel_equalized_snr() {
        // Two channels: channel 0 has signal 100 and error 1 (ratio 0.01), channel 1 signal
        // 1 and error 0.1 (ratio 0.1). Plain SNR: 101 / 1.1 = 19.6 dB; equalized: the mean
        // ratio is 0.055: 12.6 dB.
        let mut s = ErrorStats::default();
        s.add_in_channel(0, 10.0, 11.0);
        s.add_in_channel(1, 1.0, 1.0 + 0.1f64.sqrt());
        assert!((s.snr_db() - 10.0 * (101.0f64 / 1.1).log10()).abs() < 1e-9);
        assert!((s.channel_snr_db() + 10.0 * 0.055f64.log10()).abs() < 1e-9);
        // Merging per-rank shards adds the channels' sums.
        let (mut a, mut b) = (ErrorStats::default(), ErrorStats::default());
        a.add_in_channel(0, 10.0, 11.0);
        b.add_in_channel(1, 1.0, 1.0 + 0.1f64.sqrt());
        a.merge(&b);
        assert_eq!(a, s);
        // Exact: +inf; nothing: NaN; error without signal: -inf.
        let mut e = ErrorStats::default();
        assert!(e.channel_snr_db().is_nan());
        e.add_in_channel(3, 2.0, 2.0);
        e.add_in_channel(5, 0.0, 0.0);
        assert_eq!(e.channel_snr_db(), f64::INFINITY);
        e.add_in_channel(5, 0.0, 1.0);
        assert_eq!(e.channel_snr_db(), f64::NEG_INFINITY);
    }

    fn encoded(dtype: DType, vals: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; vals.len() * dtype.size()];
        for (i, &v) in vals.iter().enumerate() {
            dtype.store_f32(&mut b, i, v);
        }
        b
    }

    #[test]
    fn check_counts_wrong_elements_and_diverging_ranks() {
        let (world, n, dtype) = (3usize, 10usize, DType::BF16);
        let inputs = Inputs::new(DataSet::Ints, dtype, n * dtype.size());
        let sum: Vec<f32> = (0..n)
            .map(|i| (0..world).map(|r| int_pattern(r, i)).sum())
            .collect();
        let good = encoded(dtype, &sum);
        let mut bad = sum.clone();
        bad[4] += 1.0;
        bad[7] += 2.0;
        let bad = encoded(dtype, &bad);
        let outs: Vec<&[u8]> = vec![&good, &good, &good];
        let c = check_range(&inputs, true, &outs, 0..n);
        assert_eq!((c.wrong_elements, c.ranks_differing()), (0, 0));
        assert_eq!(c.stats.snr_db(), f64::INFINITY);
        let outs: Vec<&[u8]> = vec![&good, &bad, &good];
        let c = check_range(&inputs, true, &outs, 0..n);
        assert_eq!((c.wrong_elements, c.ranks_differing()), (2, 1));
        assert_eq!(c.differs_from_rank0, vec![false, true, false]);
        // Split into two shards and merged: the same.
        let mut m = check_range(&inputs, true, &outs, 0..5);
        m.merge(&check_range(&inputs, true, &outs, 5..n));
        assert_eq!(m, c);
    }

    #[test]
    fn worst_channel_and_plain_rows() {
        let mut s = ErrorStats::default();
        // Channel 0: signal 4, noise 0.04 (20 dB); channel 1: signal 4, noise 0.4 (10 dB).
        s.add_in_channel(0, 2.0, 2.2);
        s.add_in_channel(1, 2.0, 2.0 + 0.4f64.sqrt());
        let worst = s.worst_channel_snr_db();
        let ch1 = 10.0 * (4.0 / s.channel_err2[1]).log10();
        assert!((worst - ch1).abs() < 1e-9 && worst < 20.0 - 1e-6, "{worst}");
        assert!(ErrorStats::default().worst_channel_snr_db().is_nan());
        // Only what was added as plain counts there.
        assert!(s.plain_snr_db().is_nan());
        s.add_plain(2.0, 2.2);
        assert!((s.plain_snr_db() - 20.0).abs() < 1e-9);
        let mut m = ErrorStats::default();
        m.merge(&s);
        assert_eq!((m.plain_elements, m.plain_ref2), (1, 4.0));
        // A spike row is not plain; a channels row 8k is not; gauss rows all are.
        let spikes = Inputs::new(crate::data::DataSet::Spikes, DType::F32, 4096 * 64);
        let row = (0..1000).find(|&r| crate::data::spike_row(r)).unwrap();
        assert!(
            !spikes.plain_row(row) && spikes.plain_row(row + 1) != crate::data::spike_row(row + 1)
        );
        let channels = Inputs::new(crate::data::DataSet::Channels, DType::F32, 4096 * 64);
        assert!(!channels.plain_row(8) && channels.plain_row(9));
        assert!(Inputs::new(DataSet::Gauss, DType::F32, 64).plain_row(0));
    }
}
