//! The integer-coded arguments: C passes each enum as a plain `int`, and every value is
//! decoded here by match. A Rust enum parameter would make an out-of-range value from C
//! undefined behaviour before any check could run, so the enums below exist only to name the
//! values in the header.

use std::ffi::c_int;
use std::time::Duration;

use allreduce::{BackendKind, Codec, DType, Error, GroupConfig, Precision, Strategy};

use crate::call::Failure;

/// Element types (the `dtype` argument). The values are NCCL's `ncclDataType_t` values for
/// the same types, so a caller holding an `ncclDataType_t` can pass it as it is.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ar_dtype_t {
    AR_FLOAT16 = 6,
    AR_FLOAT32 = 7,
    AR_BFLOAT16 = 9,
}

/// Reductions (the `op` argument): only the sum, whose value is NCCL's `ncclSum`. Any other
/// value is `AR_INVALID_ARGUMENT`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ar_red_op_t {
    AR_SUM = 0,
}

/// How exact the result must be (the `precision` argument): exact (f32 accumulation, one
/// rounding), or a lossy wire codec for 16-bit data, whose format and error bounds are in
/// docs/codecs.md. With a codec, `AR_STRATEGY_AUTO` may still pick an exact path.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ar_precision_t {
    AR_EXACT = 0,
    /// FP8 E4M3 with one scale per 32-element block.
    AR_FP8 = 1,
    AR_Q8 = 2,
    AR_Q6 = 3,
    AR_Q4 = 4,
    /// Q8 with a per-block choice of a Hadamard rotation.
    AR_Q8A = 5,
    AR_Q6A = 6,
    AR_Q4A = 7,
    /// Format v2: a 16-bit-precision scale, the block's largest element carried beside the
    /// codes, plain or Hadamard predicted from the L1 norm (docs/codecs.md, "Format v2").
    AR_Q8V2 = 8,
    AR_Q6V2 = 9,
    AR_Q4V2 = 10,
    /// FP4 E2M1 with E4M3 scales per 16 elements under a power of two per 32.
    AR_FP4 = 11,
}

/// Which algorithm runs a call (the `strategy` argument).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ar_strategy_t {
    /// Chosen per call by size, world size, dtype and precision.
    AR_STRATEGY_AUTO = 0,
    AR_STRATEGY_ONESHOT = 1,
    AR_STRATEGY_TWOSHOT = 2,
    /// Two-shot over the precision's codec (needs a lossy precision).
    AR_STRATEGY_QUANTIZED = 3,
    /// Quantized over two NUMA groups of GPUs (needs a lossy precision and such a topology).
    AR_STRATEGY_HIERARCHICAL = 4,
    /// The vendor library: NCCL on CUDA, RCCL on ROCm.
    AR_STRATEGY_VENDOR = 5,
    /// The vendor library on symmetric windows (NCCL 2.27+): NCCL's low-latency symmetric
    /// kernels; buffers outside the window (`ar_comm_vendor_window`) are copied in and out.
    AR_STRATEGY_VENDOR_SYMMETRIC = 6,
    /// One-shot by push (Lamport): no barrier, for small calls (at most 512 KiB); exact, with
    /// +0.0 where every rank's input is -0.0.
    AR_STRATEGY_PUSH_ONESHOT = 7,
}

/// Which implementation runs the ranks (the `backend` argument of the init functions).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ar_backend_t {
    /// CPU threads as ranks: buffers are host memory. Always compiled in.
    AR_BACKEND_HOST = 0,
    /// NVIDIA GPUs: buffers are CUDA device pointers, streams are `cudaStream_t`.
    AR_BACKEND_CUDA = 1,
    /// AMD GPUs: buffers are HIP device pointers, streams are `hipStream_t`.
    AR_BACKEND_ROCM = 2,
}

/// The deadline of every wait for a peer, in milliseconds, where `ar_config_t.timeout_ms` is
/// 0 or no config is given: the library's one default (Rust's `allreduce::DEFAULT_TIMEOUT`,
/// Python's `timeout=None`, the bench's and the bootstrap's). A rank that never calls makes
/// its peers fail with `AR_TIMEOUT`, naming it, this long after they called.
pub const AR_DEFAULT_TIMEOUT_MS: u32 = 60_000;
const _: () = assert!(AR_DEFAULT_TIMEOUT_MS as u128 == allreduce::DEFAULT_TIMEOUT.as_millis());

/// Group options for the init functions. Zero-initialise it, set `size` to
/// `sizeof(ar_config_t)` and change only the fields you need: a zero field keeps the
/// library's default. Passing NULL instead of a config means every default.
#[repr(C)]
pub struct ar_config_t {
    /// `sizeof(ar_config_t)` as the caller's header declares it; a library built from
    /// another header refuses the call with `AR_INVALID_USAGE`.
    pub size: usize,
    /// Largest call in bytes per rank; sizes each rank's workspace. 0: 64 MiB.
    pub max_bytes: usize,
    /// Deadline of every wait for a peer, in milliseconds. 0: `AR_DEFAULT_TIMEOUT_MS` (60 s).
    pub timeout_ms: u32,
}

fn invalid(what: &str, value: c_int, expected: &str) -> Error {
    Error::InvalidArgument(format!("{what} {value} is not one of {expected}"))
}

pub fn dtype(code: c_int) -> Result<DType, Error> {
    match code {
        6 => Ok(DType::F16),
        7 => Ok(DType::F32),
        9 => Ok(DType::BF16),
        _ => Err(invalid(
            "dtype",
            code,
            "AR_FLOAT16 (6), AR_FLOAT32 (7), AR_BFLOAT16 (9)",
        )),
    }
}

#[cfg(test)]
pub fn dtype_code(dtype: DType) -> c_int {
    match dtype {
        DType::F16 => 6,
        DType::F32 => 7,
        DType::BF16 => 9,
    }
}

pub fn op(code: c_int) -> Result<(), Error> {
    match code {
        0 => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "reduction {code} is not supported: AR_SUM (0) is the only one"
        ))),
    }
}

pub fn precision(code: c_int) -> Result<Precision, Error> {
    let codec = |c| Ok(Precision::Lossy(c));
    match code {
        0 => Ok(Precision::Exact),
        1 => codec(Codec::Fp8E4M3),
        2 => codec(Codec::Int8),
        3 => codec(Codec::Int6),
        4 => codec(Codec::Int4),
        5 => codec(Codec::Int8Adaptive),
        6 => codec(Codec::Int6Adaptive),
        7 => codec(Codec::Int4Adaptive),
        8 => codec(Codec::Int8V2),
        9 => codec(Codec::Int6V2),
        10 => codec(Codec::Int4V2),
        11 => codec(Codec::Fp4E2M1),
        _ => Err(invalid(
            "precision",
            code,
            "the ar_precision_t values 0 to 11",
        )),
    }
}

/// The inverse of [`precision`]; exhaustive, so a new codec cannot go without a code.
#[cfg(test)]
pub fn precision_code(precision: Precision) -> c_int {
    match precision {
        Precision::Exact => 0,
        Precision::Lossy(codec) => match codec {
            Codec::Fp8E4M3 => 1,
            Codec::Int8 => 2,
            Codec::Int6 => 3,
            Codec::Int4 => 4,
            Codec::Int8Adaptive => 5,
            Codec::Int6Adaptive => 6,
            Codec::Int4Adaptive => 7,
            Codec::Int8V2 => 8,
            Codec::Int6V2 => 9,
            Codec::Int4V2 => 10,
            Codec::Fp4E2M1 => 11,
        },
    }
}

pub fn strategy(code: c_int) -> Result<Strategy, Error> {
    match code {
        0 => Ok(Strategy::Auto),
        1 => Ok(Strategy::OneShot),
        2 => Ok(Strategy::TwoShot),
        3 => Ok(Strategy::QuantizedTwoShot),
        4 => Ok(Strategy::HierarchicalQuantized),
        5 => Ok(Strategy::Vendor),
        6 => Ok(Strategy::VendorSymmetric),
        7 => Ok(Strategy::PushOneShot),
        _ => Err(invalid("strategy", code, "the ar_strategy_t values 0 to 6")),
    }
}

/// The inverse of [`strategy`]; exhaustive, so a new strategy cannot go without a code.
pub fn strategy_code(strategy: Strategy) -> c_int {
    match strategy {
        Strategy::Auto => 0,
        Strategy::OneShot => 1,
        Strategy::TwoShot => 2,
        Strategy::QuantizedTwoShot => 3,
        Strategy::HierarchicalQuantized => 4,
        Strategy::Vendor => 5,
        Strategy::VendorSymmetric => 6,
        Strategy::PushOneShot => 7,
    }
}

pub fn backend(code: c_int) -> Result<BackendKind, Error> {
    match code {
        0 => Ok(BackendKind::Host),
        1 => Ok(BackendKind::Cuda),
        2 => Ok(BackendKind::Rocm),
        _ => Err(invalid(
            "backend",
            code,
            "AR_BACKEND_HOST (0), AR_BACKEND_CUDA (1), AR_BACKEND_ROCM (2)",
        )),
    }
}

pub fn backend_code(backend: BackendKind) -> c_int {
    match backend {
        BackendKind::Host => 0,
        BackendKind::Cuda => 1,
        BackendKind::Rocm => 2,
    }
}

/// The byte size of `count` elements of `dtype`, if it fits the address space (Rust
/// allocations and slices are limited to `isize::MAX` bytes).
pub fn byte_len(count: usize, dtype: DType) -> Result<usize, Error> {
    count
        .checked_mul(dtype.size())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "count {count} of {dtype} is more bytes than an address space holds"
            ))
        })
}

/// A rank count, rank or device ordinal: C's `int`, which may be negative.
pub fn index(what: &str, value: c_int) -> Result<usize, Error> {
    usize::try_from(value)
        .map_err(|_| Error::InvalidArgument(format!("{what} {value} is negative")))
}

/// `GroupConfig` for `world` ranks with the caller's options applied.
///
/// # Safety
/// `config` is null or points to a readable `ar_config_t`-sized object whose first field is
/// its size.
pub unsafe fn group_config(
    world: usize,
    config: *const ar_config_t,
) -> Result<GroupConfig, Failure> {
    let mut group = GroupConfig::new(world);
    if config.is_null() {
        return Ok(group);
    }
    // Read the size alone first: a caller built against another header may have passed a
    // smaller struct, whose other fields must not be read.
    // SAFETY: the caller promises at least the leading `size` field is readable.
    let size = unsafe { std::ptr::addr_of!((*config).size).read_unaligned() };
    if size != std::mem::size_of::<ar_config_t>() {
        return Err(Failure::usage(format!(
            "ar_config_t.size is {size}, this library's sizeof(ar_config_t) is {}: set it to \
             sizeof(ar_config_t) and rebuild against this library's header",
            std::mem::size_of::<ar_config_t>()
        )));
    }
    // SAFETY: the caller's struct has this library's size and layout.
    let config = unsafe { config.read_unaligned() };
    if config.max_bytes != 0 {
        group = group.max_bytes(config.max_bytes);
    }
    if config.timeout_ms != 0 {
        group = group.timeout(Duration::from_millis(config.timeout_ms.into()));
    }
    Ok(group)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_to_what_it_names_and_back() {
        for d in DType::ALL {
            assert_eq!(dtype(dtype_code(d)).unwrap(), d);
        }
        assert_eq!(dtype(ar_dtype_t::AR_FLOAT32 as c_int).unwrap(), DType::F32);
        assert_eq!(dtype(ar_dtype_t::AR_FLOAT16 as c_int).unwrap(), DType::F16);
        assert_eq!(
            dtype(ar_dtype_t::AR_BFLOAT16 as c_int).unwrap(),
            DType::BF16
        );
        for p in std::iter::once(Precision::Exact).chain(Codec::ALL.map(Precision::Lossy)) {
            assert_eq!(precision(precision_code(p)).unwrap(), p);
        }
        assert_eq!(
            precision(ar_precision_t::AR_Q4A as c_int).unwrap(),
            Precision::Lossy(Codec::Int4Adaptive)
        );
        for s in std::iter::once(Strategy::Auto).chain(Strategy::CONCRETE) {
            assert_eq!(strategy(strategy_code(s)).unwrap(), s);
        }
        assert_eq!(
            strategy(ar_strategy_t::AR_STRATEGY_VENDOR as c_int).unwrap(),
            Strategy::Vendor
        );
        for b in [BackendKind::Host, BackendKind::Cuda, BackendKind::Rocm] {
            assert_eq!(backend(backend_code(b)).unwrap(), b);
        }
        assert!(op(ar_red_op_t::AR_SUM as c_int).is_ok());
    }

    #[test]
    fn values_that_name_nothing_are_invalid_arguments() {
        use crate::ar_result_t::AR_INVALID_ARGUMENT;
        let code = |e: Error| crate::ar_result_t::of(&e);
        for bad in [-1, 0, 8, 10, c_int::MIN, c_int::MAX] {
            let e = dtype(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("dtype {bad}")), "{e}");
            assert_eq!(code(e), AR_INVALID_ARGUMENT);
        }
        for bad in [-1, 12, c_int::MAX] {
            assert_eq!(code(precision(bad).unwrap_err()), AR_INVALID_ARGUMENT);
        }
        for bad in [-1, 8, c_int::MIN] {
            assert_eq!(code(strategy(bad).unwrap_err()), AR_INVALID_ARGUMENT);
        }
        for bad in [-1, 3] {
            assert_eq!(code(backend(bad).unwrap_err()), AR_INVALID_ARGUMENT);
        }
        // NCCL's prod, max, min and avg: not run here.
        for bad in [1, 2, 3, 4, -1] {
            assert_eq!(code(op(bad).unwrap_err()), AR_INVALID_ARGUMENT);
        }
        assert_eq!(code(index("rank", -1).unwrap_err()), AR_INVALID_ARGUMENT);
    }

    #[test]
    fn config_zero_fields_keep_defaults_and_a_wrong_size_is_refused() {
        let defaults = GroupConfig::new(2);
        let g = unsafe { group_config(2, std::ptr::null()) }.unwrap();
        assert_eq!(
            (g.max_bytes, g.timeout),
            (defaults.max_bytes, defaults.timeout)
        );
        let mut c = ar_config_t {
            size: std::mem::size_of::<ar_config_t>(),
            max_bytes: 0,
            timeout_ms: 0,
        };
        let g = unsafe { group_config(2, &c) }.unwrap();
        assert_eq!(
            (g.max_bytes, g.timeout),
            (defaults.max_bytes, defaults.timeout)
        );
        c.max_bytes = 4096;
        c.timeout_ms = 1500;
        let g = unsafe { group_config(2, &c) }.unwrap();
        assert_eq!(
            (g.max_bytes, g.timeout),
            (4096, Duration::from_millis(1500))
        );
        c.size = 8;
        let e = unsafe { group_config(2, &c) }.unwrap_err();
        assert_eq!(e.code, crate::ar_result_t::AR_INVALID_USAGE);
        assert!(e.message.contains("ar_config_t.size is 8"), "{}", e.message);
    }
}
