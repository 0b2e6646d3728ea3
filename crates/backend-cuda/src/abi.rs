//! The host side of kernels-cuda's ABI. Every struct and offset here mirrors one in
//! `kernels-cuda/allreduce.cu` (which `static_assert`s the same sizes); change both or neither.

use std::ffi::c_void;

pub const MAX_WORLD: usize = 8;
pub const MAX_BLOCKS: usize = 64;
pub const THREADS: u32 = 512;

/// Byte offsets inside one rank's workspace allocation.
pub const HEADER_BYTES: usize = 4096;
pub const FLAGS_OFFSET: usize = 4096;
pub const STAGING_OFFSET: usize = 8192;

const _: () = assert!(FLAGS_OFFSET + MAX_BLOCKS * MAX_WORLD * 4 <= STAGING_OFFSET);
const _: () = assert!(2 * MAX_BLOCKS * 4 <= HEADER_BYTES);

/// Workspace bytes for calls of up to `max_bytes` (rounded up to 256): header, flags,
/// two staging buffers (one-shot alternates them by call parity) and the reduced shards.
pub fn workspace_bytes(max_bytes: usize) -> usize {
    STAGING_OFFSET + 3 * round_max_bytes(max_bytes)
}

pub fn round_max_bytes(max_bytes: usize) -> usize {
    max_bytes.div_ceil(256).max(1) * 256
}

/// Where kernels report a failed wait (host-mapped, read by the host without a copy).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Control {
    pub error: u32,
    pub rank: u32,
    pub block: u32,
    pub epoch: u32,
    pub waited_ns: u64,
}

const _: () = assert!(size_of::<Control>() == 24);

pub const ERROR_NONE: u32 = 0;
pub const ERROR_TIMEOUT: u32 = 1;

/// The kernels' one by-value parameter. Only `input`, `output` and `n` change from call to
/// call, and those are what a CUDA graph captures anyway: epochs and parities live in device
/// memory and are advanced by the kernels themselves.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Args {
    pub input: *const c_void,
    pub output: *mut c_void,
    pub n: u64,
    pub peers: [u64; MAX_WORLD],
    pub control: u64,
    pub abort: u64,
    pub max_bytes: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub world: u32,
}

const _: () = assert!(size_of::<Args>() == 8 * 3 + 8 * MAX_WORLD + 8 * 4 + 8);
