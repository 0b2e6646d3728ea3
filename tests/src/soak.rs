//! Soak and fault tests, written once for every backend (a [`Target`]: the host, or virtual
//! ranks on one GPU):
//!
//! - [`create_destroy`]: groups created and dropped over and over, each with a fused
//!   workspace, registered memory and (where the vendor library is present) a call through
//!   its window, and a checked call on each; the process's resident memory, the device memory
//!   in use and the open IPC mappings must come back to where they were after a warm-up.
//! - [`mixed_calls`]: one group of 8 ranks, calls of random sizes, dtypes, strategies,
//!   codecs and placements (in place, out of place, registered input, fused), with one rank's
//!   bad argument every ~1,000 calls. Nothing hangs; every result is checked against the host
//!   reference and is bitwise the same on every rank; every bad call is reported on every rank
//!   (the bad rank gets its validation error, the peers `PeerRejected` naming it and its
//!   reason) and the group works on after it.
//!
//! Every call is waited for before the next (`synchronize`), so that each error belongs to
//! its own call. Buffers are allocated once per group, before any rank calls, and freed after
//! every rank is done: on virtual ranks, an allocation or free while a peer's kernel waits for
//! this rank's next launch is a cycle that only the deadline breaks.

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use allreduce::fused::{self as f, FusedOutputs};
use allreduce::{
    AllReduceOptions, BufMut, BufRef, Codec, Communicator, DType, Device, Error, FusedArgs,
    FusedConfig, FusedPattern, FusedWorkspace, GroupConfig, HostBytes, Precision, RegisteredBuffer,
    Result, Strategy, Stream,
};

use crate::check::{self, Reference};
use crate::data::Rng;
use crate::harness::Harness;

/// Whether the mixed soak makes fused calls with one rank's bad argument (more tokens than
/// the workspace takes, no gamma for a norm). The peers must get `PeerRejected` with the
/// reason, as for the plain call; off only to bisect a backend that times them out instead.
pub const FUSED_BAD_ARGUMENTS: bool = true;

/// `ALLREDUCE_SOAK_FULL=1`: the full counts (1,000 cycles, 100,000 calls) instead of CI's.
pub const FULL_ENV: &str = "ALLREDUCE_SOAK_FULL";
/// Explicit counts, over either default.
pub const CYCLES_ENV: &str = "ALLREDUCE_SOAK_CYCLES";
pub const CALLS_ENV: &str = "ALLREDUCE_SOAK_CALLS";

/// `env` if set, else `full` under [`FULL_ENV`], else `ci`.
pub fn count(env: &str, ci: usize, full: usize) -> usize {
    if let Some(n) = std::env::var(env).ok().and_then(|v| v.trim().parse().ok()) {
        return n;
    }
    match std::env::var(FULL_ENV) {
        Ok(v) if v != "0" && !v.is_empty() => full,
        _ => ci,
    }
}

// ------------------------------------------------------------------------------------------
// Resources.

/// Bytes of a memory page, from the kernel's auxiliary vector (AT_PAGESZ), which is what
/// /proc/self/statm counts in; 4096 where it cannot be read.
fn page_size() -> usize {
    const AT_PAGESZ: u64 = 6;
    let Ok(aux) = std::fs::read("/proc/self/auxv") else {
        return 4096;
    };
    aux.chunks_exact(16)
        .map(|p| {
            let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8 bytes"));
            (word(&p[..8]), word(&p[8..]))
        })
        .find(|&(key, _)| key == AT_PAGESZ)
        .map_or(4096, |(_, v)| v as usize)
}

/// The process's resident set in bytes (/proc/self/statm's second field), or 0 off Linux.
pub fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * page_size())
}

/// What a leak would grow: where a backend cannot say, `None`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Resources {
    pub rss: usize,
    /// Device memory in use (total - free, cuMemGetInfo).
    pub device_used: Option<usize>,
    /// Peers' memory this process has mapped by IPC handle.
    pub ipc_mappings: Option<usize>,
}

impl std::fmt::Display for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RSS {:.1} MiB", self.rss as f64 / MIB)?;
        if let Some(d) = self.device_used {
            write!(f, ", device in use {:.1} MiB", d as f64 / MIB)?;
        }
        if let Some(i) = self.ipc_mappings {
            write!(f, ", IPC mappings {i}")?;
        }
        Ok(())
    }
}

const MIB: f64 = (1 << 20) as f64;

/// How far resources may be above the baseline after the cycles. A group leaked per cycle
/// is a workspace of `max_bytes` (several buffers of it) per rank, megabytes a cycle; these
/// allow for allocator and driver bookkeeping that settles at its own pace.
pub const RSS_TOLERANCE: usize = 4 << 20;
pub const DEVICE_TOLERANCE: usize = 8 << 20;

/// Whether `now` is within the tolerances of `base` (IPC mappings: exactly).
pub fn within(base: &Resources, now: &Resources) -> Result<(), String> {
    if now.rss > base.rss + RSS_TOLERANCE {
        return Err(format!(
            "RSS grew from {:.1} to {:.1} MiB (tolerance {} MiB)",
            base.rss as f64 / MIB,
            now.rss as f64 / MIB,
            RSS_TOLERANCE >> 20
        ));
    }
    if let (Some(b), Some(n)) = (base.device_used, now.device_used) {
        if n > b + DEVICE_TOLERANCE {
            return Err(format!(
                "device memory in use grew from {:.1} to {:.1} MiB (tolerance {} MiB)",
                b as f64 / MIB,
                n as f64 / MIB,
                DEVICE_TOLERANCE >> 20
            ));
        }
    }
    if let (Some(b), Some(n)) = (base.ipc_mappings, now.ipc_mappings) {
        if n != b {
            return Err(format!("open IPC mappings went from {b} to {n}"));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Targets: where the ranks' buffers live.

/// Buffers of one rank, each of the arena's size: where inputs are written and outputs read.
pub trait RankIo {
    fn device(&self) -> Device;
    fn stream(&self) -> Stream;
    fn addr(&self, buf: usize) -> usize;
    fn write(&mut self, buf: usize, offset: usize, bytes: &[u8]) -> Result<()>;
    fn read(&mut self, buf: usize, out: &mut [u8]) -> Result<()>;
    /// Write into this rank's registered allocation.
    fn write_registered(
        &mut self,
        reg: &mut RegisteredBuffer,
        at: usize,
        bytes: &[u8],
    ) -> Result<()>;
}

/// A backend the soak runs on.
pub trait Target: Sync {
    fn harness(&self) -> &dyn Harness;
    /// `bufs` buffers of `bytes` each for `comm`'s rank, made on the rank's own thread.
    fn rank_io(&self, comm: &Communicator, bufs: usize, bytes: usize) -> Result<Box<dyn RankIo>>;
    fn resources(&self) -> Resources {
        Resources {
            rss: rss_bytes(),
            ..Default::default()
        }
    }
}

/// The host backend: ranks are threads, buffers host memory.
pub struct HostTarget(pub crate::HostHarness);

struct HostIo {
    bufs: Vec<HostBytes>,
}

impl RankIo for HostIo {
    fn device(&self) -> Device {
        Device::Host
    }
    fn stream(&self) -> Stream {
        Stream::NULL
    }
    fn addr(&self, buf: usize) -> usize {
        self.bufs[buf].as_slice().as_ptr() as usize
    }
    fn write(&mut self, buf: usize, offset: usize, bytes: &[u8]) -> Result<()> {
        self.bufs[buf].as_mut_slice()[offset..][..bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
    fn read(&mut self, buf: usize, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&self.bufs[buf].as_slice()[..out.len()]);
        Ok(())
    }
    fn write_registered(
        &mut self,
        reg: &mut RegisteredBuffer,
        at: usize,
        bytes: &[u8],
    ) -> Result<()> {
        reg.upload(at, bytes)
    }
}

impl Target for HostTarget {
    fn harness(&self) -> &dyn Harness {
        &self.0
    }
    fn rank_io(&self, _: &Communicator, bufs: usize, bytes: usize) -> Result<Box<dyn RankIo>> {
        Ok(Box::new(HostIo {
            bufs: (0..bufs).map(|_| HostBytes::zeroed(bytes)).collect(),
        }))
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
pub use gpu::GpuTarget;

#[cfg(any(feature = "cuda", feature = "rocm"))]
mod gpu {
    use super::*;
    use crate::{open_rank, GpuHarness, GpuTestRuntime};
    use allreduce_gpu::device::{DeviceBuffer, GpuDevice, GpuStream};

    /// Virtual ranks of runtime `R` (every rank on device 0 unless `ALLREDUCE_TEST_DEVICES`
    /// says otherwise).
    pub struct GpuTarget<R: GpuTestRuntime>(pub GpuHarness<R>);

    struct GpuIo<R: GpuTestRuntime> {
        // Dropped last: the buffers and stream need the device's context.
        bufs: Vec<DeviceBuffer<R>>,
        stream: GpuStream<R>,
        _dev: GpuDevice<R>,
        device: Device,
    }

    impl<R: GpuTestRuntime> RankIo for GpuIo<R> {
        fn device(&self) -> Device {
            self.device
        }
        fn stream(&self) -> Stream {
            self.stream.handle()
        }
        fn addr(&self, buf: usize) -> usize {
            self.bufs[buf].addr()
        }
        fn write(&mut self, buf: usize, offset: usize, bytes: &[u8]) -> Result<()> {
            self.bufs[buf].upload_at(offset, bytes, &self.stream)
        }
        fn read(&mut self, buf: usize, out: &mut [u8]) -> Result<()> {
            self.bufs[buf].download(out, &self.stream)
        }
        fn write_registered(
            &mut self,
            reg: &mut RegisteredBuffer,
            at: usize,
            bytes: &[u8],
        ) -> Result<()> {
            // On the rank's stream: a registered buffer's own upload makes a stream of its
            // own, which may wait for the whole device.
            allreduce_gpu::upload_registered::<R>(reg.memory(), at, bytes, &self.stream)
        }
    }

    impl<R: GpuTestRuntime> Target for GpuTarget<R> {
        fn harness(&self) -> &dyn Harness {
            &self.0
        }
        fn rank_io(
            &self,
            comm: &Communicator,
            bufs: usize,
            bytes: usize,
        ) -> Result<Box<dyn RankIo>> {
            let (dev, stream) = open_rank::<R>(comm)?;
            stream.warm(&dev)?;
            let bufs = (0..bufs)
                .map(|_| DeviceBuffer::zeroed(bytes, &stream))
                .collect::<Result<Vec<_>>>()?;
            stream.synchronize()?;
            Ok(Box::new(GpuIo::<R> {
                bufs,
                stream,
                _dev: dev,
                device: comm.device(),
            }))
        }
        fn resources(&self) -> Resources {
            Resources {
                rss: rss_bytes(),
                device_used: R::device_memory_used(self.0.devices[0]),
                ipc_mappings: R::open_ipc_mappings(),
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Calls.

/// The shape every group of a soak is built with.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub world: usize,
    pub max_bytes: usize,
    pub max_tokens: usize,
    pub hidden: usize,
    pub registered_bytes: usize,
}

/// The fused workspaces' dtype.
const FUSED_DTYPE: DType = DType::BF16;
const EPS: f32 = 1e-5;

impl Shape {
    fn max_elems(&self, dtype: DType) -> usize {
        self.max_bytes / dtype.size()
    }
    /// Arena bytes: room for a call one element past the maximum (a refused call's view
    /// must still lie in memory the rank owns) and a misaligned view.
    fn arena(&self) -> usize {
        2 * self.max_bytes + 256
    }
    fn group(&self, t: &dyn Target) -> Result<Vec<Communicator>, String> {
        t.harness()
            .group(
                GroupConfig::new(self.world)
                    .max_bytes(self.max_bytes)
                    .timeout(Duration::from_secs(20)),
            )
            .map_err(|e| format!("group of {}: {e}", self.world))
    }
    fn fused(&self, comms: &[Communicator]) -> Result<Vec<FusedWorkspace>, String> {
        FusedWorkspace::create_group(
            comms,
            FusedConfig::new(self.max_tokens, self.hidden, FUSED_DTYPE),
        )
        .map_err(|e| format!("fused workspace: {e}"))
    }
}

/// Buffers of a rank's arena.
const INPUT: usize = 0;
const OUTPUT: usize = 1;
const RESIDUAL: usize = 2;
const GAMMA: usize = 3;
const RES_OUT: usize = 4;
const NORM_OUT: usize = 5;
const BUFS: usize = 6;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Plain {
        n: usize,
        dtype: DType,
        strategy: Strategy,
        precision: Precision,
        in_place: bool,
        /// The input in registered memory at this byte offset (out of place, exact).
        registered: Option<usize>,
    },
    Fused {
        tokens: usize,
        pattern: FusedPattern,
        strategy: Strategy,
        residual: bool,
    },
}

/// One rank's bad argument, and the error it must get.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bad {
    /// An output one element short: `LengthMismatch`.
    OutputLength,
    /// An output of another dtype: `DTypeMismatch`.
    OutputDType,
    /// An input 8 bytes past an aligned address: `Misaligned`.
    Misaligned,
    /// A codec on f32 input: `UnsupportedCodec`.
    CodecOnF32,
    /// The quantized strategy with an exact precision: `StrategyUnavailable`.
    QuantizedExact,
    /// One element more than the workspace holds (backends that do not split): `TooLarge`.
    TooLarge,
    /// A fused call of more tokens than the workspace's maximum: `WorkspaceExceeded`.
    FusedTokens,
    /// A norm pattern without gamma: `InvalidArgument`.
    FusedNoGamma,
}

impl Bad {
    fn fused(self) -> bool {
        matches!(self, Bad::FusedTokens | Bad::FusedNoGamma)
    }
    fn expected(self, e: &Error) -> bool {
        match self {
            Bad::OutputLength => matches!(e, Error::LengthMismatch { .. }),
            Bad::OutputDType => matches!(e, Error::DTypeMismatch { .. }),
            Bad::Misaligned => matches!(e, Error::Misaligned { .. }),
            Bad::CodecOnF32 => matches!(e, Error::UnsupportedCodec { .. }),
            Bad::QuantizedExact => matches!(e, Error::StrategyUnavailable { .. }),
            Bad::TooLarge => matches!(e, Error::TooLarge { .. }),
            Bad::FusedTokens => matches!(e, Error::WorkspaceExceeded { .. }),
            Bad::FusedNoGamma => matches!(e, Error::InvalidArgument(_)),
        }
    }
}

/// One call of the sequence, the same on every rank (ranks derive it from its number).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    pub k: usize,
    pub kind: Kind,
    /// (rank, what) of a call in which one rank's argument is bad.
    pub bad: Option<(usize, Bad)>,
}

/// What the group can run, read once from rank 0.
#[derive(Clone, Debug)]
pub struct Caps {
    codecs: Vec<Codec>,
    splits: bool,
    vendor: Vec<Strategy>,
}

impl Caps {
    pub fn of(comms: &[Communicator]) -> Caps {
        let c = &comms[0];
        let quantized = |codec| {
            c.strategy_available(
                Strategy::QuantizedTwoShot,
                DType::BF16,
                Precision::Lossy(codec),
            )
            .is_ok()
        };
        Caps {
            codecs: Codec::ALL.into_iter().filter(|&x| quantized(x)).collect(),
            splits: c.splits_large_calls(),
            vendor: [Strategy::Vendor, Strategy::VendorSymmetric]
                .into_iter()
                .filter(|&s| {
                    c.strategy_available(s, DType::F32, Precision::Exact)
                        .is_ok()
                })
                .collect(),
        }
    }

    fn bad_kinds(&self) -> Vec<Bad> {
        let mut v = vec![
            Bad::OutputLength,
            Bad::OutputDType,
            Bad::Misaligned,
            Bad::CodecOnF32,
            Bad::QuantizedExact,
        ];
        if !self.splits {
            v.push(Bad::TooLarge);
        }
        if FUSED_BAD_ARGUMENTS {
            v.extend([Bad::FusedTokens, Bad::FusedNoGamma]);
        }
        v
    }
}

const SEED: u64 = 0x50a4_2026;
/// One bad call in each window of this many calls.
pub const BAD_EVERY: usize = 1000;

/// Call `k` of the mixed sequence.
pub fn mixed_plan(k: usize, shape: &Shape, caps: &Caps) -> Plan {
    let mut rng = Rng::new(SEED ^ (k as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let window = k / BAD_EVERY;
    let mut wrng = Rng::new(SEED.wrapping_add(window as u64));
    let bad = if k % BAD_EVERY == (wrng.next_u64() % BAD_EVERY as u64) as usize {
        let kinds = caps.bad_kinds();
        Some((
            (wrng.next_u64() % shape.world as u64) as usize,
            kinds[window % kinds.len()],
        ))
    } else {
        None
    };
    let r = |rng: &mut Rng, n: usize| (rng.next_u64() % n as u64) as usize;
    let fused = match bad {
        Some((_, b)) => b.fused(),
        None => r(&mut rng, 8) == 0,
    };
    if fused {
        let pattern = [FusedPattern::AllReduce, FusedPattern::ResidualRmsNorm][r(&mut rng, 2)];
        return Plan {
            k,
            kind: Kind::Fused {
                tokens: 1 + r(&mut rng, shape.max_tokens),
                pattern: if bad.is_some() {
                    FusedPattern::ResidualRmsNorm
                } else {
                    pattern
                },
                strategy: [Strategy::OneShot, Strategy::TwoShot, Strategy::Auto][r(&mut rng, 3)],
                residual: r(&mut rng, 3) != 0,
            },
            bad,
        };
    }
    let dtype = DType::ALL[r(&mut rng, 3)];
    let max = shape.max_elems(dtype);
    // Mostly small calls (what decode steps make), some medium, a few up to the maximum.
    let n = match r(&mut rng, 25) {
        0 => 1 + r(&mut rng, max),
        1..=5 => 1 + r(&mut rng, max.min(4096)),
        _ => 1 + r(&mut rng, 1024),
    }
    .max(if bad.is_some() { 2 } else { 1 });
    let lossy = dtype != DType::F32 && !caps.codecs.is_empty() && r(&mut rng, 4) == 0;
    let (strategy, precision) = if lossy {
        (
            Strategy::QuantizedTwoShot,
            Precision::Lossy(caps.codecs[r(&mut rng, caps.codecs.len())]),
        )
    } else {
        let mut exact = vec![Strategy::OneShot, Strategy::TwoShot, Strategy::Auto];
        exact.extend(&caps.vendor);
        (exact[r(&mut rng, exact.len())], Precision::Exact)
    };
    let in_place = r(&mut rng, 3) == 0;
    let registered =
        (!in_place && !lossy && bad.is_none() && !strategy.is_vendor() && r(&mut rng, 4) == 0)
            .then(|| {
                let room = shape.registered_bytes - n * dtype.size();
                16 * r(&mut rng, room / 16 + 1)
            });
    Plan {
        k,
        kind: Kind::Plain {
            n,
            dtype,
            strategy,
            precision,
            in_place: in_place && bad.is_none(),
            registered,
        },
        bad,
    }
}

/// Rank `rank`'s value at `i` for call `k` (rank usize::MAX: the residual, MAX - 1: gamma):
/// multiples of 1/64 in [-4, 4) from a hash (cheap: the checking rank makes every rank's),
/// -0.0 at some positions on every rank.
fn value(k: usize, rank: usize, i: usize) -> f32 {
    if rank < 64 && i % 53 == 7 {
        return -0.0;
    }
    let mut h = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((k as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add((rank as u64).wrapping_mul(0x1656_67B1_9E37_79F9));
    h ^= h >> 31;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 29;
    let v = ((h >> 40) & 511) as f32 / 64.0 - 4.0;
    if rank == usize::MAX - 1 {
        0.5 + v.abs() / 4.0
    } else {
        v
    }
}

fn data(k: usize, rank: usize, n: usize, dtype: DType) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        dtype.store_f32(b.as_mut_slice(), i, value(k, rank, i));
    }
    b
}

fn hash(parts: &[&[u8]]) -> u64 {
    // SipHash with fixed keys: the same on every rank and every run.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    for p in parts {
        h.write(p);
        h.write_u8(0xff);
    }
    h.finish() | 1 // 0 marks "no output" in the table
}

/// What one rank's call came to: the outputs' hash, or the error.
type Outcome = std::result::Result<u64, Error>;

/// One rank's part of `plan`: writes its inputs, calls, waits, and, when `check`, compares
/// its outputs with the host reference. `Ok(outcome)`: the call's result for the
/// cross-rank comparison; `Err(text)`: a wrong result.
#[allow(clippy::too_many_arguments)]
fn run_call(
    comm: &Communicator,
    io: &mut dyn RankIo,
    ws: Option<&FusedWorkspace>,
    reg: Option<&mut RegisteredBuffer>,
    plan: &Plan,
    shape: &Shape,
    check: bool,
) -> std::result::Result<Outcome, String> {
    let rank = comm.rank();
    let world = comm.world_size();
    let mine = plan.bad.filter(|&(r, _)| r == rank).map(|(_, b)| b);
    let dev = io.device();
    let stream = io.stream();
    let k = plan.k;
    let err = |e: Error| format!("call {k} {plan:?}: rank {rank}: {e}");
    match plan.kind {
        Kind::Plain {
            n,
            dtype,
            strategy,
            precision,
            in_place,
            registered,
        } => {
            let (mut n, mut dtype, mut strategy, mut precision) = (n, dtype, strategy, precision);
            let (mut out_len, mut out_dtype, mut misalign) = (n, dtype, 0);
            match mine {
                Some(Bad::OutputLength) => out_len = n - 1,
                Some(Bad::OutputDType) => {
                    out_dtype = if dtype == DType::F16 {
                        DType::BF16
                    } else {
                        DType::F16
                    }
                }
                Some(Bad::Misaligned) => misalign = 8,
                Some(Bad::CodecOnF32) => {
                    // Within the workspace as f32 too, so that the codec is what is refused.
                    n = n.min(shape.max_elems(DType::F32));
                    out_len = n;
                    dtype = DType::F32;
                    out_dtype = dtype;
                    strategy = Strategy::QuantizedTwoShot;
                    precision = Precision::Lossy(Codec::Int4);
                }
                Some(Bad::QuantizedExact) => {
                    strategy = Strategy::QuantizedTwoShot;
                    precision = Precision::Exact;
                }
                Some(Bad::TooLarge) => {
                    n = shape.max_elems(dtype) + 1;
                    out_len = n;
                }
                _ => {}
            }
            let input = data(k, rank, n, dtype);
            let options = AllReduceOptions::default()
                .strategy(strategy)
                .precision(precision)
                .stream(stream);
            let result = if in_place {
                io.write(OUTPUT, 0, input.as_slice()).map_err(err)?;
                // SAFETY: the arena's buffer holds the call's n elements and outlives it.
                let buf = unsafe { BufMut::from_raw(io.addr(OUTPUT), n, dtype, dev) };
                comm.all_reduce_in_place(buf, &options)
            } else {
                let in_view = match (registered, reg) {
                    (Some(at), Some(reg)) => {
                        io.write_registered(reg, at, input.as_slice())
                            .map_err(err)?;
                        reg.view(at, n, dtype).map_err(err)?
                    }
                    _ => {
                        io.write(INPUT, misalign, input.as_slice()).map_err(err)?;
                        // SAFETY: as above, `misalign` bytes in (the arena has room).
                        unsafe { BufRef::from_raw(io.addr(INPUT) + misalign, n, dtype, dev) }
                    }
                };
                // SAFETY: as above.
                let out = unsafe { BufMut::from_raw(io.addr(OUTPUT), out_len, out_dtype, dev) };
                comm.all_reduce(in_view, out, &options)
            };
            let result = result.and_then(|_| comm.synchronize(stream));
            if let Err(e) = result {
                return Ok(Err(e));
            }
            let mut got = HostBytes::zeroed(n * dtype.size());
            io.read(OUTPUT, got.as_mut_slice()).map_err(err)?;
            if check {
                let inputs: Vec<HostBytes> = (0..world).map(|r| data(k, r, n, dtype)).collect();
                let what = format!("call {k} {plan:?}");
                match precision {
                    Precision::Exact => check::exact(&got, &Reference::new(&inputs, dtype), &what)?,
                    Precision::Lossy(codec) => {
                        check::quantized_bitwise(&got, &inputs, dtype, codec, &what)?
                    }
                }
            }
            Ok(Ok(hash(&[got.as_slice()])))
        }
        Kind::Fused {
            tokens,
            pattern,
            strategy,
            residual,
        } => {
            let ws = ws.ok_or_else(|| format!("call {k}: a fused call without a workspace"))?;
            let hidden = shape.hidden;
            let dtype = FUSED_DTYPE;
            let tokens = if mine == Some(Bad::FusedTokens) {
                shape.max_tokens + 1
            } else {
                tokens
            };
            let elems = tokens * hidden;
            let input = data(k, rank, elems, dtype);
            let res = data(k, usize::MAX, elems, dtype);
            let gamma = data(k, usize::MAX - 1, hidden, dtype);
            io.write(INPUT, 0, input.as_slice()).map_err(err)?;
            io.write(RESIDUAL, 0, res.as_slice()).map_err(err)?;
            io.write(GAMMA, 0, gamma.as_slice()).map_err(err)?;
            // SAFETY: every view lies in its arena buffer (sized for max_bytes twice over,
            // more than max_tokens + 1 rows) and outlives the call.
            let view =
                |b: usize, len: usize| unsafe { BufRef::from_raw(io.addr(b), len, dtype, dev) };
            // SAFETY: as above; each output its own buffer.
            let view_mut =
                |b: usize, len: usize| unsafe { BufMut::from_raw(io.addr(b), len, dtype, dev) };
            let mut args = FusedArgs::new(pattern, tokens, view(INPUT, elems))
                .allreduce_out(view_mut(OUTPUT, elems))
                .strategy(strategy)
                .stream(stream);
            let norm = pattern.has_norm();
            if norm && residual {
                args = args.residual(view(RESIDUAL, elems), Some(view_mut(RES_OUT, elems)));
            }
            if norm && mine != Some(Bad::FusedNoGamma) {
                args = args.rms_norm(view(GAMMA, hidden), EPS, Some(view_mut(NORM_OUT, elems)));
            }
            let result = comm
                .all_reduce_fused(ws, args)
                .and_then(|_| comm.synchronize(stream));
            if let Err(e) = result {
                return Ok(Err(e));
            }
            let bytes = elems * dtype.size();
            let mut got = FusedOutputs {
                allreduce: vec![0; bytes],
                residual: vec![0; if norm && residual { bytes } else { 0 }],
                norm: vec![0; if norm { bytes } else { 0 }],
                quant: vec![],
                scale: vec![],
            };
            io.read(OUTPUT, &mut got.allreduce).map_err(err)?;
            io.read(RES_OUT, &mut got.residual).map_err(err)?;
            io.read(NORM_OUT, &mut got.norm).map_err(err)?;
            if check {
                let inputs: Vec<HostBytes> = (0..world).map(|r| data(k, r, elems, dtype)).collect();
                let refs: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
                let want = f::reference(
                    &refs,
                    dtype,
                    tokens,
                    hidden,
                    (norm && residual).then_some(res.as_slice()),
                    norm.then_some(gamma.as_slice()),
                    EPS,
                    pattern,
                    None,
                    0.0,
                );
                let what = format!("call {k} {plan:?}");
                if got.allreduce != want.allreduce || got.residual != want.residual {
                    return Err(format!(
                        "{what}: the all-reduce or residual output differs from the reference"
                    ));
                }
                for i in 0..got.norm.len() / dtype.size() {
                    let (g, w) = (dtype.load_f32(&got.norm, i), dtype.load_f32(&want.norm, i));
                    if (g - w).abs() > f::norm_tolerance(dtype, w) || g.is_nan() {
                        return Err(format!("{what}: norm element {i} is {g}, expected {w}"));
                    }
                }
            }
            Ok(Ok(hash(&[&got.allreduce, &got.residual, &got.norm])))
        }
    }
}

/// Whether `outcome` is what a rank of `plan` must get; `Err(why not)`.
fn judge(plan: &Plan, rank: usize, outcome: &Outcome) -> std::result::Result<(), String> {
    let k = plan.k;
    match (plan.bad, outcome) {
        (None, Ok(_)) => Ok(()),
        (None, Err(e)) => Err(format!("call {k} {plan:?}: rank {rank} failed: {e}")),
        (Some((bad, what)), Err(e)) if bad == rank => {
            if what.expected(e) && e.aftermath() == allreduce::Aftermath::Intact {
                Ok(())
            } else {
                Err(format!(
                    "call {k}: rank {rank}'s bad argument ({what:?}) got the wrong error: {e:?}"
                ))
            }
        }
        (Some((bad, _)), Err(Error::PeerRejected { rank: r, .. })) if *r == bad => Ok(()),
        (Some((bad, what)), other) => Err(format!(
            "call {k}: rank {bad}'s bad argument ({what:?}): rank {rank} got {other:?}, not \
             PeerRejected naming rank {bad}"
        )),
    }
}

/// The peers' `PeerRejected` must carry the bad rank's own error text. Backends that cannot
/// carry text between ranks say only that the arguments were refused, and are checked for
/// the rank alone (see [`Report::reasons_carried`]).
fn reason_of(outcome: &Outcome) -> Option<&str> {
    match outcome {
        Err(Error::PeerRejected { reason, .. }) => Some(reason),
        _ => None,
    }
}

/// What a run of calls came to.
#[derive(Debug, Default)]
pub struct Report {
    pub calls: usize,
    pub bad_calls: usize,
    pub checked: usize,
    /// Peers' rejections that carried the bad rank's error text, of all peers' rejections.
    pub reasons_carried: (usize, usize),
    pub elapsed: Duration,
}

/// Runs calls `0..calls` of `plans` on `comms` (every rank on its own thread) and checks
/// everything the module's documentation lists. Rank `k % world` checks call k's result
/// against the host reference; every rank's outputs are compared by hash.
#[allow(clippy::too_many_arguments)]
pub fn drive(
    t: &dyn Target,
    comms: &[Communicator],
    ws: Option<&[FusedWorkspace]>,
    reg: Option<&mut [RegisteredBuffer]>,
    shape: &Shape,
    calls: usize,
    plans: &(dyn Fn(usize) -> Plan + Sync),
) -> std::result::Result<Report, String> {
    let world = comms.len();
    let table: Vec<AtomicU64> = (0..calls * world).map(|_| AtomicU64::new(0)).collect();
    // Errors only come from bad calls (any other is a failure): few, so a map.
    let errors = Mutex::new(std::collections::HashMap::<usize, Error>::new());
    let failures = Mutex::new(Vec::<String>::new());
    let barrier = Barrier::new(world);
    let start = Instant::now();
    let mut regs: Vec<Option<&mut RegisteredBuffer>> = match reg {
        Some(r) => r.iter_mut().map(Some).collect(),
        None => (0..world).map(|_| None).collect(),
    };
    std::thread::scope(|s| {
        for (rank, (comm, mut reg)) in comms.iter().zip(regs.drain(..)).enumerate() {
            let (table, errors, failures, barrier) = (&table, &errors, &failures, &barrier);
            let ws = ws.map(|w| &w[rank]);
            s.spawn(move || {
                let fail = |why: String| {
                    failures.lock().unwrap_or_else(|e| e.into_inner()).push(why);
                    // The others leave at once instead of at their deadline.
                    let _ = comm.abort();
                };
                let io = t.rank_io(comm, BUFS, shape.arena());
                // Everyone's buffers exist before anyone calls.
                barrier.wait();
                let mut io = match io {
                    Ok(io) => io,
                    Err(e) => {
                        fail(format!("rank {rank}: buffers: {e}"));
                        barrier.wait();
                        return;
                    }
                };
                for k in 0..calls {
                    let plan = plans(k);
                    let check = k % world == rank;
                    let outcome = match run_call(
                        comm,
                        io.as_mut(),
                        ws,
                        reg.as_deref_mut(),
                        &plan,
                        shape,
                        check,
                    ) {
                        Ok(o) => o,
                        Err(why) => {
                            fail(why);
                            break;
                        }
                    };
                    if let Err(why) = judge(&plan, rank, &outcome) {
                        fail(why);
                        break;
                    }
                    match outcome {
                        Ok(h) => table[k * world + rank].store(h, Ordering::Relaxed),
                        Err(e) => {
                            errors
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert(k * world + rank, e);
                        }
                    }
                }
                // Nobody frees while a peer may still be calling.
                barrier.wait();
                drop(io);
            });
        }
    });
    let elapsed = start.elapsed();
    let failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
    let errors = errors.into_inner().unwrap_or_else(|e| e.into_inner());
    if !failures.is_empty() {
        return Err(failures[..failures.len().min(4)].join("\n    "));
    }
    let mut report = Report {
        calls,
        elapsed,
        ..Default::default()
    };
    for k in 0..calls {
        let plan = plans(k);
        let row = &table[k * world..][..world];
        if let Some((bad, _)) = plan.bad {
            report.bad_calls += 1;
            let text = errors
                .get(&(k * world + bad))
                .map(|e| e.to_string())
                .unwrap_or_default();
            for r in (0..world).filter(|&r| r != bad) {
                let o: Outcome = Err(errors[&(k * world + r)].clone());
                report.reasons_carried.1 += 1;
                if reason_of(&o) == Some(text.as_str()) {
                    report.reasons_carried.0 += 1;
                }
            }
            continue;
        }
        report.checked += 1;
        let first = row[0].load(Ordering::Relaxed);
        if let Some(r) = row.iter().position(|h| h.load(Ordering::Relaxed) != first) {
            return Err(format!(
                "call {k} {plan:?}: rank {r}'s output differs from rank 0's"
            ));
        }
    }
    Ok(report)
}

// ------------------------------------------------------------------------------------------
// The tests.

/// The mixed soak's group: 8 ranks (fewer if the target has fewer).
pub fn mixed_shape(t: &dyn Target) -> Shape {
    Shape {
        world: 8.min(t.harness().max_world()),
        max_bytes: 64 << 10,
        max_tokens: 8,
        hidden: 512,
        registered_bytes: 64 << 10,
    }
}

/// `calls` mixed calls on one group (see the module's documentation).
pub fn mixed_calls(t: &dyn Target, calls: usize) -> std::result::Result<Report, String> {
    let shape = mixed_shape(t);
    let comms = shape.group(t)?;
    let ws = shape.fused(&comms)?;
    let mut reg = Communicator::alloc_registered_group(&comms, shape.registered_bytes)
        .map_err(|e| format!("alloc_registered_group: {e}"))?;
    let caps = Caps::of(&comms);
    let report = drive(t, &comms, Some(&ws), Some(&mut reg), &shape, calls, &|k| {
        mixed_plan(k, &shape, &caps)
    })?;
    let (carried, of) = report.reasons_carried;
    if comms[0].backend() == allreduce::BackendKind::Host && carried != of {
        return Err(format!(
            "only {carried} of {of} peers' rejections carried the bad rank's reason"
        ));
    }
    Ok(report)
}

/// The calls of one create/destroy cycle: registered, fused, and through the vendor library
/// where there is one (its window with `VendorSymmetric`).
fn cycle_plans(caps: &Caps) -> Vec<Plan> {
    let mut kinds = vec![
        Kind::Plain {
            n: 4097,
            dtype: DType::BF16,
            strategy: Strategy::OneShot,
            precision: Precision::Exact,
            in_place: false,
            registered: Some(32),
        },
        Kind::Fused {
            tokens: 3,
            pattern: FusedPattern::ResidualRmsNorm,
            strategy: Strategy::Auto,
            residual: true,
        },
    ];
    for &s in &caps.vendor {
        kinds.push(Kind::Plain {
            n: 1000,
            dtype: DType::F32,
            strategy: s,
            precision: Precision::Exact,
            in_place: false,
            registered: None,
        });
    }
    kinds
        .into_iter()
        .enumerate()
        .map(|(k, kind)| Plan { k, kind, bad: None })
        .collect()
}

/// What [`create_destroy`] measured.
#[derive(Debug)]
pub struct CycleReport {
    pub cycles: usize,
    pub baseline: Resources,
    pub end: Resources,
    pub elapsed: Duration,
    /// Whether the cycles made calls through the vendor library (and its window).
    pub vendor: bool,
}

/// Cycles before the baseline is taken: allocators, the driver and thread-local caches reach
/// their steady state.
pub const WARM_UP_CYCLES: usize = 20;

/// `cycles` times, a group of `world` ranks and a group of one created and dropped, after a
/// warm-up (see the module's documentation); resources must be back within the tolerances,
/// at the end and halfway.
pub fn create_destroy(
    t: &dyn Target,
    world: usize,
    cycles: usize,
) -> std::result::Result<CycleReport, String> {
    let shape = Shape {
        world: world.min(t.harness().max_world()),
        max_bytes: 64 << 10,
        max_tokens: 8,
        hidden: 256,
        registered_bytes: 64 << 10,
    };
    let vendor = std::sync::atomic::AtomicBool::new(false);
    // A group of `world` ranks, then one of a single rank: on one GPU that is the group the
    // vendor library accepts (it wants a GPU per rank), so its window is made and dropped too.
    let one = |c: usize| -> std::result::Result<(), String> {
        for world in [shape.world, 1] {
            let shape = Shape { world, ..shape };
            let comms = shape.group(t)?;
            let ws = shape.fused(&comms)?;
            let mut reg = Communicator::alloc_registered_group(&comms, shape.registered_bytes)
                .map_err(|e| format!("alloc_registered_group: {e}"))?;
            let caps = Caps::of(&comms);
            if !caps.vendor.is_empty() {
                vendor.store(true, Ordering::Relaxed);
            }
            let plans = cycle_plans(&caps);
            drive(
                t,
                &comms,
                Some(&ws),
                Some(&mut reg),
                &shape,
                plans.len(),
                &|k| plans[k],
            )
            .map_err(|e| format!("cycle {c}, {world} ranks: {e}"))?;
            // Registered memory and workspaces first, then the group, as an application
            // drops them.
            drop(reg);
            drop(ws);
            drop(comms);
        }
        Ok(())
    };
    for c in 0..WARM_UP_CYCLES {
        one(c)?;
    }
    let baseline = t.resources();
    let start = Instant::now();
    for c in 0..cycles {
        one(WARM_UP_CYCLES + c)?;
        if c + 1 == cycles / 2 {
            within(&baseline, &t.resources())
                .map_err(|e| format!("after {} of {cycles} cycles: {e}", c + 1))?;
        }
    }
    let elapsed = start.elapsed();
    let end = t.resources();
    within(&baseline, &end).map_err(|e| format!("after {cycles} cycles: {e}"))?;
    Ok(CycleReport {
        cycles,
        baseline,
        end,
        elapsed,
        vendor: vendor.into_inner(),
    })
}
