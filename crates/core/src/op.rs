//! What one call asks for: the reduction, how exact it must be, and which algorithm runs it.

use std::fmt;
use std::str::FromStr;

use crate::DType;

/// Reduction operator. Only `Sum` exists: it is the one tensor parallelism needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    #[default]
    Sum,
}

/// A lossy wire format for the quantized all-reduce (docs/codecs.md has the bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    /// OCP FP8 E4M3 (max 448) with one scale per 32-element block: 8.5 bits per element.
    Fp8E4M3,
    /// Symmetric 8-bit integers, one scale per block: 8.5 bits per element.
    Int8,
    /// Symmetric 6-bit integers, one scale per block: 6.5 bits per element.
    Int6,
    /// Symmetric 4-bit integers, one scale per block: 4.5 bits per element.
    Int4,
    /// Q8 with a per-block choice between plain coding and coding after a fixed randomized
    /// Hadamard transform, flagged in the scale's spare bit: 8.5 bits per element.
    Int8Adaptive,
    /// Adaptive Q6 (see `Int8Adaptive`): 6.5 bits per element.
    Int6Adaptive,
    /// Adaptive Q4 (see `Int8Adaptive`): 4.5 bits per element.
    Int4Adaptive,
    /// Format v2, 8-bit codes: a scale with 16 significant bits, the block's largest element
    /// carried beside the codes on the scale's grid, plain or Hadamard predicted from the
    /// block's L1 norm: 9.25 bits per element (docs/codecs.md, "Format v2").
    Int8V2,
    /// Format v2, 6-bit codes (see `Int8V2`): 7.25 bits per element.
    Int6V2,
    /// Format v2, 4-bit codes (see `Int8V2`; a 7-bit scale, the largest element on a 7-bit
    /// grid): 4.75 bits per element.
    Int4V2,
    /// OCP FP4 E2M1 codes with an E4M3 scale per 16 elements under a power-of-two scale per
    /// 32 (NVFP4's layout with the tensor scale made per block): 4.75 bits per element.
    Fp4E2M1,
}

impl Codec {
    /// Every codec. The plain ones come first, in their original order: the CUDA backend's
    /// call descriptor numbers codecs by their position here.
    /// The format v2 codecs come last, so that the v1 positions never move.
    pub const ALL: [Codec; 11] = [
        Codec::Fp8E4M3,
        Codec::Int8,
        Codec::Int6,
        Codec::Int4,
        Codec::Int8Adaptive,
        Codec::Int6Adaptive,
        Codec::Int4Adaptive,
        Codec::Int8V2,
        Codec::Int6V2,
        Codec::Int4V2,
        Codec::Fp4E2M1,
    ];

    /// The format v1 codecs (the GPU kernels implement these).
    pub const V1: [Codec; 7] = [
        Codec::Fp8E4M3,
        Codec::Int8,
        Codec::Int6,
        Codec::Int4,
        Codec::Int8Adaptive,
        Codec::Int6Adaptive,
        Codec::Int4Adaptive,
    ];

    /// The format v2 codecs (host reference only so far).
    pub const V2: [Codec; 4] = [Codec::Int8V2, Codec::Int6V2, Codec::Int4V2, Codec::Fp4E2M1];

    /// Whether the codec belongs to format v2 (docs/codecs.md, "Format v2").
    pub const fn is_v2(self) -> bool {
        matches!(
            self,
            Codec::Int8V2 | Codec::Int6V2 | Codec::Int4V2 | Codec::Fp4E2M1
        )
    }

    /// The format version the codec belongs to: 1 or 2. Processes of one group exchange the
    /// formats their builds encode, and a call whose format some rank lacks is refused.
    pub const fn format(self) -> u8 {
        if self.is_v2() {
            2
        } else {
            1
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Codec::Fp8E4M3 => "fp8",
            Codec::Int8 => "q8",
            Codec::Int6 => "q6",
            Codec::Int4 => "q4",
            Codec::Int8Adaptive => "q8a",
            Codec::Int6Adaptive => "q6a",
            Codec::Int4Adaptive => "q4a",
            Codec::Int8V2 => "q8v2",
            Codec::Int6V2 => "q6v2",
            Codec::Int4V2 => "q4v2",
            Codec::Fp4E2M1 => "fp4",
        }
    }

    /// Input dtypes a codec accepts. Codecs exist to cut 16-bit traffic (as QuickReduce and
    /// TensorRT-LLM's low-precision all-reduce do); f32 callers use `Exact` or cast first.
    pub const fn supports(self, dtype: DType) -> bool {
        matches!(dtype, DType::F16 | DType::BF16)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Codec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "fp8" | "fp8e4m3" | "e4m3" => Ok(Codec::Fp8E4M3),
            "q8" | "int8" => Ok(Codec::Int8),
            "q6" | "int6" => Ok(Codec::Int6),
            "q4" | "int4" => Ok(Codec::Int4),
            "q8a" | "int8a" => Ok(Codec::Int8Adaptive),
            "q6a" | "int6a" => Ok(Codec::Int6Adaptive),
            "q4a" | "int4a" => Ok(Codec::Int4Adaptive),
            "q8v2" | "int8v2" => Ok(Codec::Int8V2),
            "q6v2" | "int6v2" => Ok(Codec::Int6V2),
            "q4v2" | "int4v2" => Ok(Codec::Int4V2),
            "fp4" | "fp4e2m1" | "e2m1" | "nvfp4" => Ok(Codec::Fp4E2M1),
            _ => Err(format!(
                "unknown codec `{s}` (expected fp8, q8, q6, q4, q8a, q6a, q4a, q8v2, q6v2, q4v2 \
                 or fp4)"
            )),
        }
    }
}

/// How exact the result must be.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 accumulation, one rounding into the output dtype.
    #[default]
    Exact,
    /// The caller accepts this codec's error bound. `Auto` may still pick an exact path
    /// (for small messages it is faster); a forced `QuantizedTwoShot` always uses the codec.
    Lossy(Codec),
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Precision::Exact => f.write_str("exact"),
            Precision::Lossy(c) => c.fmt(f),
        }
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("exact") {
            Ok(Precision::Exact)
        } else {
            s.parse().map(Precision::Lossy)
        }
    }
}

/// Which algorithm runs the call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Chosen per call from the selection table (size, world size, dtype, precision).
    #[default]
    Auto,
    /// Every rank reads every peer's data and reduces all of it: latency-optimal.
    OneShot,
    /// Reduce-scatter then all-gather: each rank reduces 1/world of the data.
    TwoShot,
    /// Two-shot over a lossy codec (needs `Precision::Lossy`).
    QuantizedTwoShot,
    /// TensorRT-LLM's low-precision PCIe all-reduce for two NUMA groups (8 = 2x4 GPUs):
    /// reduce-scatter inside each group over the codec, exchange of the encoded partial shards
    /// with the matching rank of the other group, all-gather inside the group. Needs
    /// `Precision::Lossy` and a topology of two equal NUMA groups of consecutive ranks
    /// ([`crate::hierarchical`]).
    HierarchicalQuantized,
    /// The vendor library: NCCL on CUDA, RCCL on ROCm.
    Vendor,
    /// The vendor library on symmetric windows (NCCL 2.27+ `ncclCommWindowRegister` with
    /// `NCCL_WIN_COLL_SYMMETRIC`, RCCL where it exports the API): the group registers one
    /// window per rank, and the call runs in it, which selects NCCL's low-latency symmetric
    /// kernels (f32 accumulation). Buffers outside the window are copied in and out; buffers
    /// inside it ([`crate::BackendComm::vendor_window`]) run in place with no copy.
    VendorSymmetric,
    /// One-shot by push (Lamport, as TensorRT-LLM's and FlashInfer's one-shot): every rank
    /// writes its input straight into every peer's receive buffer, whose "not written yet"
    /// marker is -0.0 itself, so the data is its own flag and no barrier remains. The exact
    /// one-shot's arithmetic (f32, rank order) on inputs whose -0.0 travel as +0.0: the one
    /// difference from `OneShot` is that an element whose every input is -0.0 sums to +0.0.
    /// For small calls (a GPU group carries at most [`Strategy::PUSH_MAX_BYTES`] per call).
    PushOneShot,
}

impl Strategy {
    /// The largest call [`Strategy::PushOneShot`] carries on a GPU (each rank keeps three
    /// receive buffers of `world` slots of this size): it is the latency path.
    pub const PUSH_MAX_BYTES: usize = 512 << 10;

    pub const CONCRETE: [Strategy; 7] = [
        Strategy::OneShot,
        Strategy::TwoShot,
        Strategy::QuantizedTwoShot,
        Strategy::Vendor,
        Strategy::HierarchicalQuantized,
        Strategy::VendorSymmetric,
        Strategy::PushOneShot,
    ];

    /// Whether the vendor library runs the call (the strategies a group without peer access
    /// still offers).
    pub const fn is_vendor(self) -> bool {
        matches!(self, Strategy::Vendor | Strategy::VendorSymmetric)
    }

    /// Whether the strategy moves data through a codec (and so needs `Precision::Lossy`).
    pub const fn quantizes(self) -> bool {
        matches!(
            self,
            Strategy::QuantizedTwoShot | Strategy::HierarchicalQuantized
        )
    }

    pub const fn name(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::OneShot => "oneshot",
            Strategy::TwoShot => "twoshot",
            Strategy::QuantizedTwoShot => "quantized",
            Strategy::Vendor => "vendor",
            Strategy::VendorSymmetric => "vendor-symmetric",
            Strategy::HierarchicalQuantized => "hierarchical",
            Strategy::PushOneShot => "push-oneshot",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().replace(['-', '_'], "").as_str() {
            "auto" => Ok(Strategy::Auto),
            "oneshot" => Ok(Strategy::OneShot),
            "twoshot" => Ok(Strategy::TwoShot),
            "quantized" | "quantizedtwoshot" | "qtwoshot" => Ok(Strategy::QuantizedTwoShot),
            "vendor" | "nccl" | "rccl" => Ok(Strategy::Vendor),
            "vendorsymmetric" | "ncclsymmetric" | "rcclsymmetric" | "symmetric" | "ncclsymm" => {
                Ok(Strategy::VendorSymmetric)
            }
            "hierarchical" | "hierarchicalquantized" | "hier" => {
                Ok(Strategy::HierarchicalQuantized)
            }
            "pushoneshot" | "push" | "lamport" => Ok(Strategy::PushOneShot),
            _ => Err(format!(
                "unknown strategy `{s}` (expected auto, oneshot, twoshot, quantized, hierarchical, \
                 vendor, vendor-symmetric or push-oneshot)"
            )),
        }
    }
}
