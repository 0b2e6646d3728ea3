//! Element types the all-reduce understands, and their conversions through f32.
//!
//! Every path accumulates in f32 and rounds once into the output dtype, so the only
//! conversions that matter are `to_f32` (exact for all three types) and `from_f32`
//! (round-to-nearest-even, the same rounding `__float2half_rn` / `__float2bfloat16_rn`
//! perform on the GPU).

use std::fmt;

use half::{bf16, f16};

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Unit roundoff of the type (half an ulp at 1.0): the relative error of one rounding.
    pub const fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 5.960_464_477_539_063e-8, // 2^-24
            DType::F16 => 4.882_812_5e-4,           // 2^-11
            DType::BF16 => 3.906_25e-3,             // 2^-8
        }
    }

    /// Smallest positive subnormal: the absolute error floor of one rounding near zero.
    pub const fn min_subnormal(self) -> f64 {
        match self {
            DType::F32 => 1.401_298_464_324_817e-45,
            DType::F16 => 5.960_464_477_539_063e-8,
            DType::BF16 => 9.183_549_615_799_121e-41,
        }
    }

    /// Decode element `i` of a little-endian byte slice of this dtype.
    #[inline]
    pub fn load_f32(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
            DType::F16 => {
                f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
            }
            DType::BF16 => {
                bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
            }
        }
    }

    /// Round `v` to this dtype (nearest-even) and store it as element `i`.
    #[inline]
    pub fn store_f32(self, bytes: &mut [u8], i: usize, v: f32) {
        match self {
            DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
            DType::F16 => {
                bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
            }
            DType::BF16 => {
                bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())
            }
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => Ok(DType::F32),
            "f16" | "half" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => Err(format!("unknown dtype `{s}` (expected f32, f16 or bf16)")),
        }
    }
}

/// A Rust element type that maps to a [`DType`].
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_rounds_to_nearest_even() {
        // 1 + 2^-11 lies exactly between two f16 values; the even one is 1.0.
        let mut b = [0u8; 2];
        DType::F16.store_f32(&mut b, 0, 1.0 + 2f32.powi(-11));
        assert_eq!(DType::F16.load_f32(&b, 0), 1.0);
        DType::F16.store_f32(&mut b, 0, 1.0 + 3.0 * 2f32.powi(-11));
        assert_eq!(DType::F16.load_f32(&b, 0), 1.0 + 2.0 * 2f32.powi(-10));
        let mut b = [0u8; 2];
        DType::BF16.store_f32(&mut b, 0, 1.0 + 2f32.powi(-8));
        assert_eq!(DType::BF16.load_f32(&b, 0), 1.0);
    }

    #[test]
    fn parse_names() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f64".parse::<DType>().is_err());
    }
}
