//! Rank inputs and the reference sum they are checked against.
//!
//! Every value is a pure function of (data set, rank, size, element index), so a rank fills its
//! own input and any thread can regenerate any rank's element for the check without the inputs
//! being kept or shipped around.

use allreduce::DType;
use half::{bf16, f16};

/// What the ranks' inputs hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum DataSet {
    /// N(0,1) per element, from splitmix64 + Box-Muller seeded by (rank, size)
    Gauss,
    /// The integer pattern ((rank*7 + i*3) % 23) - 11: exact in every dtype
    Ints,
    /// gauss with 0.1% of the elements (picked by a hash of rank, size and index) x30:
    /// heavy-tailed partial sums
    Outliers,
    /// gauss in rows of --hidden elements where 4 fixed channels (611, 1415, 2533, 3701 for
    /// 4096; c*hidden/4096 otherwise) are x50 on every 8th row (rows 0, 8, 16, ...), on every
    /// rank: LLMs' massive activations
    Channels,
    /// gauss in rows of --hidden elements where one fixed channel (1415 for 4096) is 100-300x
    /// on about 5% of the rows (the same rows on every rank: the tokens that carry a massive
    /// activation), and three fixed channels are heavy-tailed (N(0,1) / sqrt(u), u uniform in
    /// [0.01, 1]): what real FFN-output partial sums look like
    Spikes,
}

impl DataSet {
    pub const fn name(self) -> &'static str {
        match self {
            DataSet::Gauss => "gauss",
            DataSet::Ints => "ints",
            DataSet::Outliers => "outliers",
            DataSet::Channels => "channels",
            DataSet::Spikes => "spikes",
        }
    }
}

/// Default hidden size: the row length of `channels` and of the channel-equalized SNR.
pub const DEFAULT_HIDDEN: usize = 4096;

/// `outliers`: one element in this many is multiplied by [`OUTLIER_FACTOR`].
pub const OUTLIER_EVERY: u64 = 1000;
pub const OUTLIER_FACTOR: f64 = 30.0;
/// `channels`: the massive channels for a hidden size of 4096 (LLaMA-2-7B's massive
/// activations sit in 1415 and 2533), scaled as `c * hidden / 4096` for other sizes.
pub const MASSIVE_CHANNELS_4096: [usize; 4] = [611, 1415, 2533, 3701];
/// `channels`: rows `0, k, 2k, ...` carry the massive values.
pub const MASSIVE_ROW_EVERY: usize = 8;
pub const MASSIVE_FACTOR: f64 = 50.0;

/// `spikes`: the spike channel for a hidden size of 4096, scaled as the massive channels are.
pub const SPIKE_CHANNEL_4096: usize = 1415;
/// `spikes`: one row in this many (picked by a hash of the row) carries the spike.
pub const SPIKE_ROW_EVERY: u64 = 20;
/// `spikes`: the spike's factor is `SPIKE_MIN + (hash % (SPIKE_SPAN + 1))`, per rank and row.
pub const SPIKE_MIN: u64 = 100;
pub const SPIKE_SPAN: u64 = 200;
/// `spikes`: the heavy-tailed channels for 4096, scaled as the massive channels are.
pub const HEAVY_CHANNELS_4096: [usize; 3] = [611, 2533, 3701];

/// Whether row `row` of `spikes` carries the spike: the same rows for every rank and size.
pub fn spike_row(row: usize) -> bool {
    splitmix64_at(0x0005_914E, row as u64) % SPIKE_ROW_EVERY == 0
}

/// The spike channel of `spikes` for a hidden size.
pub fn spike_channel(hidden: usize) -> usize {
    SPIKE_CHANNEL_4096 * hidden / 4096
}

/// The massive channels of `channels` for a hidden size.
pub fn massive_channels(hidden: usize) -> [usize; 4] {
    MASSIVE_CHANNELS_4096.map(|c| c * hidden / 4096)
}

/// The exact rows' pattern: integers in -11..=11, so any f32 sum of up to 64 ranks is exact.
#[inline]
pub fn int_pattern(rank: usize, i: usize) -> f32 {
    (((rank % 23) * 7 + (i % 23) * 3) % 23) as f32 - 11.0
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `n`-th output (from 0) of a splitmix64 generator seeded with `seed`.
#[inline]
pub fn splitmix64_at(seed: u64, n: u64) -> u64 {
    mix64(seed.wrapping_add(GOLDEN.wrapping_mul(n.wrapping_add(1))))
}

/// The seed of one rank's data for one size.
pub fn seed(rank: usize, bytes: usize) -> u64 {
    mix64(mix64(0xA11_EDCE ^ rank as u64) ^ bytes as u64)
}

/// Elements `2k` and `2k+1` of a Gaussian stream: Box-Muller on outputs `2k`, `2k+1`.
#[inline]
pub fn gauss_pair(seed: u64, k: u64) -> (f64, f64) {
    const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
    let a = splitmix64_at(seed, 2 * k);
    let b = splitmix64_at(seed, 2 * k + 1);
    let u1 = ((a >> 11) + 1) as f64 * SCALE; // (0, 1]: ln is finite
    let u2 = (b >> 11) as f64 * SCALE;
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    (r * c, r * s)
}

/// `v` rounded (to nearest even) to `dtype`, back in f32.
#[inline]
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F32 => v,
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
    }
}

/// The inputs of one row: the data set, dtype and size every rank's values derive from.
#[derive(Clone, Copy, Debug)]
pub struct Inputs {
    pub set: DataSet,
    pub dtype: DType,
    /// Bytes per rank (part of the seed, so each size sees fresh data).
    pub bytes: usize,
    /// Row length: element `i` is channel `i % hidden` of row `i / hidden`.
    pub hidden: usize,
}

impl Inputs {
    pub fn new(set: DataSet, dtype: DType, bytes: usize) -> Self {
        Inputs {
            set,
            dtype,
            bytes,
            hidden: DEFAULT_HIDDEN,
        }
    }

    /// The same inputs with another hidden size (at least 1).
    pub fn hidden(mut self, hidden: usize) -> Self {
        self.hidden = hidden.max(1);
        self
    }

    /// The factor element `i` of the stream `seed` gets on top of its N(0,1) value.
    #[inline]
    fn factor(&self, seed: u64, massive: &[usize; 4], i: usize) -> f64 {
        match self.set {
            // A stream of its own (the seed with its bits flipped), so the outliers do not
            // depend on the Gaussian values.
            DataSet::Outliers if splitmix64_at(!seed, i as u64) % OUTLIER_EVERY == 0 => {
                OUTLIER_FACTOR
            }
            DataSet::Channels
                if (i / self.hidden) % MASSIVE_ROW_EVERY == 0
                    && massive.contains(&(i % self.hidden)) =>
            {
                MASSIVE_FACTOR
            }
            DataSet::Spikes => {
                let (row, channel) = (i / self.hidden, i % self.hidden);
                if channel == spike_channel(self.hidden) && spike_row(row) {
                    (SPIKE_MIN + splitmix64_at(seed ^ 0x0005_914E, row as u64) % (SPIKE_SPAN + 1))
                        as f64
                } else if HEAVY_CHANNELS_4096
                    .iter()
                    .any(|&c| c * self.hidden / 4096 == channel)
                {
                    // u in [0.01, 1]: the factor reaches 10, a Student-t-like tail.
                    let u = (splitmix64_at(!seed, i as u64) >> 11) as f64 / (1u64 << 53) as f64;
                    1.0 / (0.01 + 0.99 * u).sqrt()
                } else {
                    1.0
                }
            }
            _ => 1.0,
        }
    }

    /// Whether row `row` carries none of the data set's massive values (`channels`' every
    /// 8th row, `spikes`' spike rows); every row of the other sets.
    pub fn plain_row(&self, row: usize) -> bool {
        match self.set {
            DataSet::Channels => row % MASSIVE_ROW_EVERY != 0,
            DataSet::Spikes => !spike_row(row),
            _ => true,
        }
    }

    pub fn count(&self) -> usize {
        self.bytes / self.dtype.size()
    }

    /// Rank `rank`'s elements `start..start + out.len()`, already rounded to the dtype.
    pub fn values(&self, rank: usize, start: usize, out: &mut [f32]) {
        match self.set {
            DataSet::Ints => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = int_pattern(rank, start + j);
                }
            }
            DataSet::Gauss | DataSet::Outliers | DataSet::Channels | DataSet::Spikes => {
                let seed = seed(rank, self.bytes);
                let massive = massive_channels(self.hidden);
                let value = |i: usize, g: f64| {
                    round_to(self.dtype, (g * self.factor(seed, &massive, i)) as f32)
                };
                let end = start + out.len();
                let mut i = start;
                while i < end {
                    let (even, odd) = gauss_pair(seed, (i / 2) as u64);
                    if i % 2 == 0 {
                        out[i - start] = value(i, even);
                        if i + 1 < end {
                            out[i + 1 - start] = value(i + 1, odd);
                        }
                        i += 2;
                    } else {
                        out[i - start] = value(i, odd);
                        i += 1;
                    }
                }
            }
        }
    }

    /// Rank `rank`'s whole input, encoded as little-endian `dtype` bytes.
    pub fn fill(&self, rank: usize) -> Vec<u8> {
        let n = self.count();
        let mut bytes = vec![0u8; n * self.dtype.size()];
        let mut vals = vec![0f32; CHUNK.min(n)];
        let mut start = 0;
        while start < n {
            let len = CHUNK.min(n - start);
            self.values(rank, start, &mut vals[..len]);
            for (j, &v) in vals[..len].iter().enumerate() {
                self.dtype.store_f32(&mut bytes, start + j, v);
            }
            start += len;
        }
        bytes
    }

    /// The exact sum over `world` ranks of elements `start..start + out.len()`, in f64 (of the
    /// dtype-rounded inputs; exact for up to 2^29 ranks of f16/bf16 values).
    pub fn reference(&self, world: usize, start: usize, out: &mut [f64], scratch: &mut Vec<f32>) {
        scratch.resize(out.len(), 0.0);
        out.fill(0.0);
        for rank in 0..world {
            self.values(rank, start, scratch);
            for (o, &v) in out.iter_mut().zip(scratch.iter()) {
                *o += f64::from(v);
            }
        }
    }
}

/// Elements generated or checked at a time.
pub const CHUNK: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_pattern_is_in_range_and_exact() {
        for rank in 0..64 {
            for i in 0..100 {
                let v = int_pattern(rank, i);
                assert!((-11.0..=11.0).contains(&v));
                for d in DType::ALL {
                    assert_eq!(round_to(d, v), v);
                }
            }
        }
        assert_eq!(int_pattern(0, 0), -11.0);
        assert_eq!(int_pattern(1, 2), (7 + 6) as f32 - 11.0);
    }

    #[test]
    fn values_do_not_depend_on_the_chunking() {
        let inp = Inputs::new(DataSet::Gauss, DType::BF16, 2 * 1001);
        let mut all = vec![0f32; 1001];
        inp.values(3, 0, &mut all);
        for start in [0usize, 1, 2, 7, 500, 999] {
            let mut part = vec![0f32; 1001 - start];
            inp.values(3, start, &mut part);
            assert_eq!(&all[start..], &part[..], "start {start}");
        }
        // Different ranks and sizes see different streams.
        let mut other = vec![0f32; 1001];
        inp.values(4, 0, &mut other);
        assert_ne!(all, other);
    }

    #[test]
    fn gauss_looks_standard_normal() {
        let inp = Inputs::new(DataSet::Gauss, DType::F32, 4 * 200_000);
        let mut v = vec![0f32; 200_000];
        inp.values(0, 0, &mut v);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn outliers_and_channels_scale_gauss() {
        let n = 1 << 16;
        let gauss = Inputs::new(DataSet::Gauss, DType::F32, 4 * n);
        let mut g = vec![0f32; n];
        gauss.values(2, 0, &mut g);
        // Outliers: about 0.1% of the elements are x30, the rest unchanged.
        let mut o = vec![0f32; n];
        Inputs::new(DataSet::Outliers, DType::F32, 4 * n).values(2, 0, &mut o);
        let mut big = 0;
        for (a, b) in g.iter().zip(&o) {
            if a != b {
                // (g * 30) rounded once to f32, `a` is g rounded: equal up to two roundings.
                assert!((f64::from(*b) / f64::from(*a) - 30.0).abs() < 1e-5);
                big += 1;
            }
        }
        assert!((40..100).contains(&big), "{big} outliers in {n}");
        // Channels (hidden 1024: channels 152, 353, 633, 925): x50 on rows 0, 8, ...
        let ch = Inputs::new(DataSet::Channels, DType::F32, 4 * n).hidden(1024);
        assert_eq!(massive_channels(1024), [152, 353, 633, 925]);
        assert_eq!(massive_channels(4096), MASSIVE_CHANNELS_4096);
        let mut c = vec![0f32; n];
        ch.values(2, 0, &mut c);
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            let massive = (i / 1024) % 8 == 0 && [152, 353, 633, 925].contains(&(i % 1024));
            if massive {
                assert!((f64::from(*b) / f64::from(*a) - 50.0).abs() < 1e-5, "{i}");
            } else {
                assert_eq!(a, b, "element {i}");
            }
        }
        // Chunking does not matter for the new sets either.
        let mut part = vec![0f32; n - 4097];
        ch.values(2, 4097, &mut part);
        assert_eq!(&c[4097..], &part[..]);
        Inputs::new(DataSet::Outliers, DType::F32, 4 * n).values(2, 4097, &mut part);
        assert_eq!(&o[4097..], &part[..]);
    }

    #[test]
    fn fill_encodes_the_values() {
        let inp = Inputs::new(DataSet::Ints, DType::F16, 2 * 50);
        let bytes = inp.fill(2);
        for i in 0..50 {
            assert_eq!(DType::F16.load_f32(&bytes, i), int_pattern(2, i));
        }
    }
}

#[cfg(test)]
mod spike_tests {
    use super::*;

    /// `spikes` is what it says: the spike rows are about 5% and the same on every rank, the
    /// spike 100-300x, the heavy channels heavier-tailed than the rest.
    #[test]
    fn spikes_have_their_shape() {
        let hidden = 1024;
        let rows = 2000;
        let inputs = Inputs::new(DataSet::Spikes, DType::F32, rows * hidden * 4).hidden(hidden);
        let spike_rows = (0..rows).filter(|&r| spike_row(r)).count();
        assert!((60..=140).contains(&spike_rows), "{spike_rows} of {rows}");
        let c = spike_channel(hidden);
        let gauss = Inputs::new(DataSet::Gauss, DType::F32, rows * hidden * 4).hidden(hidden);
        for rank in 0..2 {
            let (mut v, mut g) = (vec![0f32; rows * hidden], vec![0f32; rows * hidden]);
            inputs.values(rank, 0, &mut v);
            gauss.values(rank, 0, &mut g);
            for r in 0..rows {
                let k = r * hidden + c;
                let f = f64::from(v[k]) / f64::from(g[k]);
                if spike_row(r) {
                    assert!((99.9..=300.1).contains(&f), "row {r}: x{f}");
                } else {
                    assert_eq!(v[k], g[k]);
                }
            }
            let heavy = HEAVY_CHANNELS_4096[0] * hidden / 4096;
            let peak = |ch: usize| {
                (0..rows)
                    .map(|r| v[r * hidden + ch].abs())
                    .fold(0f32, f32::max)
            };
            assert!(
                peak(heavy) > 2.0 * peak(heavy + 1),
                "heavy tail {}",
                peak(heavy)
            );
        }
    }
}
