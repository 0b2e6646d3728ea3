//! Deterministic test data and the f64 reference.

use allreduce::{DType, HostBytes};

/// splitmix64: tiny, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// `n` elements of N(0, 1) in `dtype`, seeded by (seed, rank).
pub fn gauss(n: usize, dtype: DType, seed: u64, rank: usize) -> HostBytes {
    let mut rng = Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(rank as u64));
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        dtype.store_f32(b.as_mut_slice(), i, rng.normal() as f32);
    }
    b
}

/// Small integers, exact in every dtype and summing exactly (mk1's test pattern).
pub fn ints(n: usize, dtype: DType, rank: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let v = ((rank * 7 + i * 3) % 23) as f32 - 11.0;
        dtype.store_f32(b.as_mut_slice(), i, v);
    }
    b
}

pub fn to_f64(b: &HostBytes, dtype: DType) -> Vec<f64> {
    (0..b.len() / dtype.size())
        .map(|i| dtype.load_f32(b.as_slice(), i) as f64)
        .collect()
}

/// Exact sum over ranks (f64 is exact for up to 8 summands of these magnitudes in practice;
/// what matters is that it is far more accurate than any path under test).
pub fn reference(inputs: &[HostBytes], dtype: DType) -> Vec<f64> {
    let mut acc = to_f64(&inputs[0], dtype);
    for b in &inputs[1..] {
        for (a, v) in acc.iter_mut().zip(to_f64(b, dtype)) {
            *a += v;
        }
    }
    acc
}
