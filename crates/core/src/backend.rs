//! The contract between the facade and a backend.
//!
//! The facade validates arguments and resolves `Strategy::Auto` (both generic, here), then
//! hands a backend a [`Call`] in which nothing is left to interpret. A backend enqueues the
//! call on the caller's stream and returns; GPU backends do no host synchronisation per call
//! and report device-side failures (spin-wait timeouts) through [`BackendComm::synchronize`]
//! or the next call, the way `ncclCommGetAsyncError` does.

use std::time::Duration;

use crate::{
    BufMut, BufRef, Codec, DType, Device, Error, Precision, RawBuffer, ReduceOp, Result,
    SelectionTable, Strategy, Stream, Topology,
};

/// The deadline of every wait for a peer when the caller names none: the one default of the
/// Rust API ([`GroupConfig::new`]), the C ABI (`ar_config_t::timeout_ms` = 0), Python
/// (`timeout=None`), the bench and the multi-process bootstrap's rendezvous. Long enough that
/// a rank held up by start-up, a JIT compilation or a graph capture between two calls is not
/// taken for dead; short enough that a rank that will never call turns into an error (naming
/// it) within a minute rather than a hang.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// `ALLREDUCE_REGISTERED_MIN_BYTES`: the default of [`GroupConfig::registered_min_bytes`].
pub const REGISTERED_MIN_BYTES_ENV: &str = "ALLREDUCE_REGISTERED_MIN_BYTES";

/// Largest world size any backend accepts. GPU kernels are instantiated for 2..=8 ranks.
pub const MAX_WORLD: usize = 64;

/// How to build a group of ranks.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    pub world_size: usize,
    /// Device ordinal of each rank for GPU backends; an ordinal may repeat ("virtual ranks",
    /// several ranks on one GPU). Empty means every rank on device 0. Ignored by the host.
    pub devices: Vec<u32>,
    /// Largest call in bytes (per rank); sizes the workspace.
    pub max_bytes: usize,
    /// Deadline of every wait for a peer; [`DEFAULT_TIMEOUT`] unless set. Past it the waiting
    /// rank reports `Error::Timeout` naming the ranks that had not arrived, and the group is
    /// aborted: every later call of every rank is `Error::Aborted` until it is rebuilt.
    pub timeout: Duration,
    /// Table behind `Strategy::Auto`; `None` uses the backend's default.
    pub selection: Option<SelectionTable>,
    /// Codec path only: run bf16 calls with a lossy codec through the f16 kernels, converting
    /// on load and back on store (QuickReduce's `CAST_BF16_TO_FP16`: MI300 has packed f16 but
    /// no packed bf16 arithmetic). Values beyond f16's range (65504) saturate, so it is off by
    /// default. The ROCm backend's default table then uses the f16 thresholds for bf16. The
    /// host and CUDA backends ignore it.
    pub cast_bf16_to_f16: bool,
    /// Use this topology instead of probing the GPUs (tests, or a platform whose probe is
    /// wrong); also `ALLREDUCE_TOPOLOGY=pcie:2x4` ([`Topology::parse`]).
    pub topology: Option<Topology>,
    /// GPU backends: calls on registered inputs smaller than this many bytes per rank take the
    /// staged path. The default is 0: since the registered kernels enter without a release,
    /// they are as fast as the staged ones or faster at every size measured (H100, virtual
    /// ranks, 16 B to 64 MiB at 2, 4 and 8 ranks; docs/benchmarks.md). A knob for machines
    /// where that is not so. `None`: `ALLREDUCE_REGISTERED_MIN_BYTES`, else
    /// [`GroupConfig::DEFAULT_REGISTERED_MIN_BYTES`].
    /// Every rank must use the same value (a rank that differs is reported as a mismatch).
    pub registered_min_bytes: Option<usize>,
}

impl GroupConfig {
    pub const DEFAULT_REGISTERED_MIN_BYTES: usize = 0;
    pub const DEFAULT_MAX_BYTES: usize = 64 << 20;
    pub const DEFAULT_TIMEOUT: Duration = DEFAULT_TIMEOUT;

    pub fn new(world_size: usize) -> Self {
        GroupConfig {
            world_size,
            devices: Vec::new(),
            max_bytes: Self::DEFAULT_MAX_BYTES,
            timeout: Self::DEFAULT_TIMEOUT,
            selection: None,
            cast_bf16_to_f16: false,
            topology: None,
            registered_min_bytes: None,
        }
    }

    /// [`GroupConfig::registered_min_bytes`] as the group uses it: the config's, else
    /// [`REGISTERED_MIN_BYTES_ENV`]'s, else the default.
    pub fn resolved_registered_min_bytes(&self) -> Result<usize> {
        if let Some(n) = self.registered_min_bytes {
            return Ok(n);
        }
        match std::env::var(REGISTERED_MIN_BYTES_ENV) {
            Err(_) => Ok(Self::DEFAULT_REGISTERED_MIN_BYTES),
            Ok(v) => v.trim().parse().map_err(|_| {
                Error::InvalidConfig(format!(
                    "{REGISTERED_MIN_BYTES_ENV}={v:?}: want a byte count"
                ))
            }),
        }
    }

    /// See [`GroupConfig::registered_min_bytes`].
    pub fn registered_min_bytes(mut self, bytes: usize) -> Self {
        self.registered_min_bytes = Some(bytes);
        self
    }

    /// See [`GroupConfig::topology`].
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = Some(topology);
        self
    }

    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn devices(mut self, devices: Vec<u32>) -> Self {
        self.devices = devices;
        self
    }

    pub fn selection(mut self, table: SelectionTable) -> Self {
        self.selection = Some(table);
        self
    }

    /// See [`GroupConfig::cast_bf16_to_f16`].
    pub fn cast_bf16_to_f16(mut self, on: bool) -> Self {
        self.cast_bf16_to_f16 = on;
        self
    }

    /// Checks that hold for every backend, for an in-process group (`devices` empty or one
    /// ordinal per rank).
    pub fn validate(&self) -> Result<()> {
        self.validate_for_rank()?;
        if !self.devices.is_empty() && self.devices.len() != self.world_size {
            return Err(Error::InvalidConfig(format!(
                "{} device ordinals given for {} ranks",
                self.devices.len(),
                self.world_size
            )));
        }
        Ok(())
    }

    /// The same checks for one rank of a group of one process per rank
    /// (`Communicator::new_rank`): `devices` may also name just this process's GPU.
    pub fn validate_for_rank(&self) -> Result<()> {
        if self.world_size == 0 || self.world_size > MAX_WORLD {
            return Err(Error::InvalidConfig(format!(
                "world size {} is outside 1..={MAX_WORLD}",
                self.world_size
            )));
        }
        if self.devices.len() > 1 && self.devices.len() != self.world_size {
            return Err(Error::InvalidConfig(format!(
                "{} device ordinals given for {} ranks",
                self.devices.len(),
                self.world_size
            )));
        }
        if let Some(t) = &self.topology {
            if t.world() != self.world_size {
                return Err(Error::InvalidConfig(format!(
                    "a forced topology of {} ranks for a group of {}",
                    t.world(),
                    self.world_size
                )));
            }
        }
        if self.max_bytes == 0 {
            return Err(Error::InvalidConfig("max_bytes must be positive".into()));
        }
        if self.timeout.is_zero() {
            return Err(Error::InvalidConfig("timeout must be positive".into()));
        }
        Ok(())
    }
}

/// Per-call options. `Default` is an exact sum chosen by `Auto` on the null stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllReduceOptions {
    pub op: ReduceOp,
    pub precision: Precision,
    pub strategy: Strategy,
    pub stream: Stream,
}

impl AllReduceOptions {
    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = p;
        self
    }
    pub fn strategy(mut self, s: Strategy) -> Self {
        self.strategy = s;
        self
    }
    pub fn stream(mut self, s: Stream) -> Self {
        self.stream = s;
        self
    }
}

/// A validated call with a concrete strategy. For in-place calls `input == output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub input: RawBuffer,
    pub output: RawBuffer,
    pub op: ReduceOp,
    pub precision: Precision,
    pub strategy: Strategy,
    pub stream: Stream,
}

impl Call {
    pub fn len(&self) -> usize {
        self.output.len
    }
    pub fn is_empty(&self) -> bool {
        self.output.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.output.dtype
    }
    pub fn bytes(&self) -> usize {
        self.output.bytes()
    }
    pub fn in_place(&self) -> bool {
        self.input.addr == self.output.addr
    }
    /// The codec the call runs with, if its strategy quantizes.
    pub fn codec(&self) -> Option<Codec> {
        match (self.strategy, self.precision) {
            (s, Precision::Lossy(c)) if s.quantizes() => Some(c),
            _ => None,
        }
    }
}

/// The alignment every backend requires of a call's buffer addresses, in bytes: the GPU
/// kernels move 16-byte vectors, and the host backend enforces the same rule so that code
/// tested on the host behaves the same on a GPU. `Communicator::alignment` reports it.
pub const BUFFER_ALIGN: usize = 16;

/// What a backend tells the generic validation about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub device: Device,
    /// Largest call the backend's workspace takes in one piece.
    pub max_bytes: usize,
    /// Required alignment of buffer addresses, in bytes (at least the element size):
    /// [`BUFFER_ALIGN`] on every backend today.
    pub align: usize,
    /// The backend runs larger calls in pieces of at most `max_bytes` (GPU backends), so
    /// `prepare` does not refuse them.
    pub chunks: bool,
    /// The class of the group's topology, for selection rules that name one
    /// ([`crate::select::Rule::topology`]); `None` when the backend knows none.
    pub topology: Option<crate::TopologyClass>,
}

/// Validate buffers and options against `limits`; resolve `Auto` through `table`.
/// `available` says whether the backend can run a concrete strategy for this call.
pub fn prepare(
    input: Option<BufRef<'_>>,
    output: &BufMut<'_>,
    options: &AllReduceOptions,
    limits: &Limits,
    world: usize,
    table: &SelectionTable,
    available: impl Fn(Strategy, DType, Precision) -> Result<(), String>,
) -> Result<Call> {
    let out = output.raw();
    let inp = input.map(|b| b.raw()).unwrap_or(out);
    if inp.dtype != out.dtype {
        return Err(Error::DTypeMismatch {
            input: inp.dtype,
            output: out.dtype,
        });
    }
    if inp.len != out.len {
        return Err(Error::LengthMismatch {
            input: inp.len,
            output: out.len,
        });
    }
    for b in [inp, out] {
        if b.device != limits.device {
            return Err(Error::WrongDevice {
                buffer: b.device,
                comm: limits.device,
            });
        }
        let align = limits.align.max(b.dtype.size());
        if b.len > 0 && b.addr % align != 0 {
            return Err(Error::Misaligned {
                addr: b.addr,
                align,
            });
        }
    }
    let bytes = out.bytes();
    if bytes > limits.max_bytes && !limits.chunks {
        return Err(Error::TooLarge {
            bytes,
            max: limits.max_bytes,
        });
    }
    if input.is_some() && inp.addr != out.addr && inp.overlaps(&out) {
        return Err(Error::InvalidArgument(
            "input and output overlap without being the same buffer".into(),
        ));
    }
    if let Precision::Lossy(codec) = options.precision {
        if !codec.supports(out.dtype) {
            return Err(Error::UnsupportedCodec {
                codec,
                dtype: out.dtype,
            });
        }
    }
    let dtype = out.dtype;
    let strategy = match options.strategy {
        Strategy::Auto => table.choose_on(
            limits.topology,
            bytes,
            world,
            dtype,
            options.precision,
            |s| available(s, dtype, options.precision).is_ok(),
        ),
        s if s.quantizes() && options.precision == Precision::Exact => {
            return Err(Error::StrategyUnavailable {
                strategy: s,
                reason: "it needs Precision::Lossy(codec)".into(),
            })
        }
        s => {
            available(s, dtype, options.precision).map_err(|reason| {
                Error::StrategyUnavailable {
                    strategy: s,
                    reason,
                }
            })?;
            s
        }
    };
    // Refused here, for every backend alike, so that ranks of any backend agree on which
    // calls run: the push strategy's receive buffers are sized for small calls.
    if strategy == Strategy::PushOneShot && bytes > Strategy::PUSH_MAX_BYTES {
        return Err(Error::TooLarge {
            bytes,
            max: Strategy::PUSH_MAX_BYTES,
        });
    }
    Ok(Call {
        input: inp,
        output: out,
        op: options.op,
        precision: options.precision,
        strategy,
        stream: options.stream,
    })
}

/// A backend: a family of communicators.
pub trait Backend: 'static {
    const NAME: &'static str;
    type Comm: BackendComm;

    /// Build all ranks of an in-process group; element `r` is rank `r`.
    fn create_group(config: &GroupConfig) -> Result<Vec<Self::Comm>>;

    /// Build this process's rank of a group spanning processes (one rank per process, like
    /// `ncclCommInitRank`): `bootstrap` carries the bytes the ranks exchange (device ids,
    /// memory handles, the vendor library's id). Every rank calls it at the same time.
    fn create_rank(_config: &GroupConfig, _bootstrap: &mut dyn Bootstrap) -> Result<Self::Comm> {
        Err(Error::InvalidConfig(format!(
            "the {} backend runs in-process groups only",
            Self::NAME
        )))
    }
}

/// One rank of a group. Each rank is driven from its own thread.
pub trait BackendComm: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    fn limits(&self) -> Limits;
    fn selection(&self) -> &SelectionTable;

    /// `Ok` if this backend can run `strategy` for the dtype and precision, else why not.
    fn strategy_available(
        &self,
        strategy: Strategy,
        dtype: DType,
        precision: Precision,
    ) -> Result<(), String>;

    /// Enqueue a validated call on `call.stream`.
    fn all_reduce(&self, call: &Call) -> Result<()>;

    /// This rank's arguments were invalid. Backends tell the peers, so they fail at once with
    /// `Error::PeerRejected` instead of timing out: the host backend at its per-call agreement
    /// step, GPU backends by launching the call's first barrier with a "rejected" descriptor.
    /// `stream` is the caller's: GPU backends enqueue their part of the agreement there.
    fn reject(&self, _reason: &Error, _stream: Stream) {}

    /// [`BackendComm::reject`] for a call that asked for `strategy`. A GPU group's push
    /// one-shot agrees through its own protocol (the call tags of its receive buffers), not
    /// the flag barrier every other kernel meets, so its peers learn of a refusal only there.
    fn reject_call(&self, reason: &Error, stream: Stream, strategy: Strategy) {
        let _ = strategy;
        self.reject(reason, stream)
    }

    /// Wait until everything enqueued on `stream` has finished and report any device-side
    /// error (such as a spin-wait timeout) recorded since the last check.
    fn synchronize(&self, stream: Stream) -> Result<()>;

    /// How the group's GPUs are connected, for backends that know (GPU backends).
    fn topology(&self) -> Option<&Topology> {
        None
    }

    /// Abort the group (NCCL's `ncclCommAbort`, from any thread, also while a call of this
    /// or another rank waits for a peer that will never come): every call in flight on any
    /// rank leaves its wait now rather than at its deadline, and every later call of every
    /// rank fails with `Error::Aborted` naming `reason`. The group is out of step for good;
    /// drop it. Ranks of other processes learn it through their kernels (GPU backends).
    fn abort(&self, _reason: &str) -> Result<()> {
        Err(Error::Unsupported {
            what: "abort on this backend".into(),
        })
    }

    /// This rank's symmetric window of the vendor library (`Strategy::VendorSymmetric`):
    /// its device address and bytes, or `None` where the group has none. A call whose input
    /// and output lie in it, at the same offset on every rank, runs in place with no copy;
    /// other calls are copied in and out of it. Calls are ordered on their streams: a
    /// caller that fills the window on one stream and calls on another synchronises them.
    fn vendor_window(&self) -> Option<(u64, usize)> {
        None
    }

    /// Register memory with every rank of this rank's in-process group: `ranges[r]` is rank
    /// r's (see [`crate::registration`]). Out-of-place exact calls whose input lies in a
    /// registration may then read the peers' inputs in place. Backends without it refuse.
    fn register_group(&self, _ranges: &[crate::RegisteredRange]) -> Result<crate::RegistrationId> {
        Err(Error::Unsupported {
            what: "memory registration on this backend".into(),
        })
    }

    /// Forget a registration of this rank's group. Calls already enqueued that read it must
    /// have completed (as with freeing their buffers).
    fn deregister_group(&self, _id: crate::RegistrationId) -> Result<()> {
        Err(Error::Unsupported {
            what: "memory registration on this backend".into(),
        })
    }

    /// One allocation of `bytes` per rank of this rank's in-process group, on each rank's
    /// device, registered with every rank (element r is rank r's).
    fn alloc_registered_group(&self, _bytes: usize) -> Result<Vec<crate::RegisteredMemory>> {
        Err(Error::Unsupported {
            what: "registered allocations on this backend".into(),
        })
    }

    /// While `on`, out-of-place exact one-shot and two-shot calls that this rank enqueues on
    /// a stream being captured into a graph, on inputs outside registered memory, take a
    /// graph slot instead of staging: the captured kernel reads every rank's input in place
    /// from addresses that [`BackendComm::register_graph_buffers_group`] fills after capture
    /// (vLLM's `capture()` and `register_graph_buffers`). A replay before that skips the call
    /// on every rank and reports `Error::InvalidArgument`. Eager calls are unchanged.
    /// Backends without graphs accept it and never capture a call.
    fn set_graph_registration(&self, _on: bool) -> Result<()> {
        Err(Error::Unsupported {
            what: "graph buffer registration on this backend".into(),
        })
    }

    /// Fill the graph slots every rank of this rank's in-process group took since the last
    /// call (see [`BackendComm::set_graph_registration`]); returns how many calls of each rank
    /// were registered. Ranks that captured different calls get `Error::RankMismatch`, and
    /// those calls keep skipping on replay.
    fn register_graph_buffers_group(&self) -> Result<usize> {
        Err(Error::Unsupported {
            what: "graph buffer registration on this backend".into(),
        })
    }

    /// This rank's part of a registration in a group of one process per rank: `range` is this
    /// rank's memory, and the peers' reach every rank over `bootstrap` (the one the group was
    /// built with, or any other over the same ranks). Collective: every rank calls it, in the
    /// same order as its other registrations.
    fn register_rank(
        &self,
        _range: crate::RegisteredRange,
        _bootstrap: &mut dyn Bootstrap,
    ) -> Result<crate::RegistrationId> {
        Err(Error::Unsupported {
            what: "memory registration across processes on this backend".into(),
        })
    }

    /// `bytes` on this rank's device, registered as [`BackendComm::register_rank`] does.
    fn alloc_registered_rank(
        &self,
        _bytes: usize,
        _bootstrap: &mut dyn Bootstrap,
    ) -> Result<crate::RegisteredMemory> {
        Err(Error::Unsupported {
            what: "registered allocations across processes on this backend".into(),
        })
    }

    /// [`BackendComm::register_graph_buffers_group`] for a group of one process per rank:
    /// the captured inputs reach every rank over `bootstrap`. Collective.
    fn register_graph_buffers_rank(&self, _bootstrap: &mut dyn Bootstrap) -> Result<usize> {
        Err(Error::Unsupported {
            what: "graph buffer registration on this backend".into(),
        })
    }

    /// Identifies this rank's group among the groups of this process: equal for the ranks
    /// of one in-process group (the facade checks collective calls with it).
    /// `None` where the backend has no collective registration.
    fn group_key(&self) -> Option<usize> {
        None
    }

    /// Fused all-reduce workspaces for every rank of this rank's group (element r is rank
    /// r's), or `None` when the backend has no fused op: the facade then refuses fused calls.
    /// A backend without fused kernels may compose the op from its all-reduce and the
    /// epilogue (the host backend does).
    fn create_fused_group(
        &self,
        _config: &crate::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn crate::FusedComm>>>> {
        Ok(None)
    }
}

/// Exchanges small byte messages among the ranks of a multi-process group (like NCCL's
/// bootstrap): users plug in MPI, torch.distributed or a store; a TCP rendezvous is built in
/// (`allreduce-bootstrap`'s `TcpBootstrap`). NCCL unique ids travel over it with
/// [`Bootstrap::broadcast`].
///
/// Both methods are collectives: every rank calls them, in the same order, with the same
/// `root`. An implementation fails (rather than hanging past its deadline or returning another
/// call's bytes) when the ranks do not.
pub trait Bootstrap: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Every rank contributes `data`; all receive every rank's bytes, in rank order.
    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Rank `root`'s `data` reaches every rank; other ranks' `data` is ignored. The default
    /// runs an all-gather in which only the root contributes bytes; implementations may do
    /// better.
    fn broadcast(&mut self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if root >= self.world_size() {
            return Err(Error::InvalidConfig(format!(
                "broadcast root {root} is outside the group of {} ranks",
                self.world_size()
            )));
        }
        let mine = if self.rank() == root { data } else { &[] };
        let mut all = self.all_gather(mine)?;
        if all.len() != self.world_size() {
            return Err(Error::Bootstrap {
                detail: format!(
                    "all_gather returned {} messages for {} ranks",
                    all.len(),
                    self.world_size()
                ),
            });
        }
        Ok(std::mem::take(&mut all[root]))
    }
}
