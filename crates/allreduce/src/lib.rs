//! `allreduce`: one all-reduce call for tensor-parallel inference, whatever the GPU.
//!
//! A group of ranks is built in-process with [`Communicator::new_group`] (one communicator per
//! rank, each driven from its own thread). A call names its input and output buffers (or one
//! buffer, in place), and [`AllReduceOptions`] carry the precision (`Exact` by default, or a
//! lossy [`Codec`]), the [`Strategy`] (`Auto` by default) and the caller's stream.
//!
//! ```
//! use allreduce::{AllReduceOptions, BackendKind, BufMut, BufRef, Communicator, GroupConfig};
//!
//! let comms = Communicator::new_group(BackendKind::Host, GroupConfig::new(4)).unwrap();
//! std::thread::scope(|s| {
//!     for comm in &comms {
//!         s.spawn(move || {
//!             let input = vec![comm.rank() as f32 + 1.0; 1000];
//!             let mut output = vec![0f32; 1000];
//!             comm.all_reduce(
//!                 BufRef::from_slice(&input),
//!                 BufMut::from_slice(&mut output),
//!                 &AllReduceOptions::default(),
//!             )
//!             .unwrap();
//!             assert!(output.iter().all(|&v| v == 10.0)); // 1 + 2 + 3 + 4
//!         });
//!     }
//! });
//! ```
//!
//! Backends are chosen at run time by [`BackendKind`] among those compiled in: the host
//! backend (CPU threads as ranks, the reference) is always there.

use std::fmt;
use std::str::FromStr;

pub use allreduce_core::{
    codec, hierarchical, layout, Aftermath, AllReduceOptions, Bootstrap, BufMut, BufRef, Codec,
    DType, Device, Element, Error, GroupConfig, HostBytes, Link, Precision, RawBuffer, ReduceOp,
    Result, Rule, SelectionTable, Strategy, Stream, Topology, TopologyClass, BUFFER_ALIGN,
    DEFAULT_TIMEOUT,
};
pub use allreduce_core::{Fp8BufMut, FusedArgs, FusedConfig, FusedMetadata, FusedPattern};
pub use allreduce_core::{RegisteredRange, RegistrationId};

/// Memory every rank of a group registered, which peers read in place.
pub mod registered;
pub use registered::RegisteredBuffer;

/// The fused all-reduce + residual + RMSNorm (+ FP8): core's specification and reference, and
/// the facade's workspace.
pub mod fused;
use allreduce_core::{prepare, Backend, BackendComm};
pub use fused::FusedWorkspace;

/// The CUDA backend's own API: device memory, streams and graphs for tests and the bench.
#[cfg(feature = "cuda")]
pub use allreduce_backend_cuda as cuda;

/// Calls on cudarc's buffers and streams (`CudaSlice`, `CudaView`, `Arc<CudaStream>`) and
/// groups on given `CudaContext`s.
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;
#[cfg(feature = "cudarc")]
pub use cudarc_interop::CudarcElement;

/// The ROCm backend's own API: device memory and streams for tests and the bench, the HIP and
/// RCCL layers, its default selection table.
#[cfg(feature = "rocm")]
pub use allreduce_backend_rocm as rocm;

/// Which implementation runs the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// CPU threads as ranks; always compiled.
    Host,
    /// NVIDIA GPUs (cargo feature `cuda`).
    Cuda,
    /// AMD GPUs (cargo feature `rocm`).
    Rocm,
}

impl BackendKind {
    pub const fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
            BackendKind::Rocm => "rocm",
        }
    }

    /// Whether this build contains the backend.
    pub const fn is_compiled(self) -> bool {
        match self {
            BackendKind::Host => true,
            BackendKind::Cuda => cfg!(feature = "cuda"),
            BackendKind::Rocm => cfg!(feature = "rocm"),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "host" | "cpu" => Ok(BackendKind::Host),
            "cuda" | "nvidia" => Ok(BackendKind::Cuda),
            "rocm" | "hip" | "amd" => Ok(BackendKind::Rocm),
            _ => Err(format!(
                "unknown backend `{s}` (expected host, cuda or rocm)"
            )),
        }
    }
}

/// One rank of a group.
pub struct Communicator {
    backend: BackendKind,
    comm: Box<dyn BackendComm>,
}

fn boxed_rank<B: Backend>(
    config: &GroupConfig,
    bootstrap: &mut dyn Bootstrap,
) -> Result<Box<dyn BackendComm>> {
    Ok(Box::new(B::create_rank(config, bootstrap)?))
}

/// The selection table from `ALLREDUCE_SELECTION_TABLE` when the config names none.
fn with_env_table(config: GroupConfig) -> Result<GroupConfig> {
    let mut config = config;
    if config.selection.is_none() {
        if let Some(path) = std::env::var_os("ALLREDUCE_SELECTION_TABLE") {
            // A tuned table (allreduce-bench --tune) without a code change.
            config.selection = Some(SelectionTable::load(std::path::Path::new(&path))?);
            tracing::debug!(path = ?path, "selection table from ALLREDUCE_SELECTION_TABLE");
        }
    }
    if config.topology.is_none() {
        if let Ok(spec) = std::env::var("ALLREDUCE_TOPOLOGY") {
            // A forced topology (tests, or a platform whose probe is wrong).
            config.topology = Some(Topology::parse(&spec, config.world_size)?);
        }
    }
    Ok(config)
}

fn boxed<B: Backend>(config: &GroupConfig) -> Result<Vec<Box<dyn BackendComm>>> {
    Ok(B::create_group(config)?
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn BackendComm>)
        .collect())
}

impl Communicator {
    /// Build every rank of an in-process group; element `r` is rank `r`.
    pub fn new_group(backend: BackendKind, config: GroupConfig) -> Result<Vec<Communicator>> {
        let _span = tracing::debug_span!(
            "new_group",
            backend = backend.name(),
            world = config.world_size,
            max_bytes = config.max_bytes
        )
        .entered();
        config.validate()?;
        let config = with_env_table(config)?;
        let comms = match backend {
            BackendKind::Host => boxed::<allreduce_backend_host::Host>(&config)?,
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => boxed::<allreduce_backend_cuda::Cuda>(&config)?,
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => boxed::<allreduce_backend_rocm::Rocm>(&config)?,
            #[allow(unreachable_patterns)] // every backend compiled in
            _ => return Err(Error::BackendNotBuilt(backend.name())),
        };
        tracing::debug!(ranks = comms.len(), "group ready");
        Ok(comms
            .into_iter()
            .map(|comm| Communicator { backend, comm })
            .collect())
    }

    /// Build this process's rank of a group with one rank per process, as
    /// `ncclCommInitRank` does: every rank calls it at the same time, with the same
    /// `config.world_size`, and `bootstrap` (the built-in `allreduce_bootstrap::TcpBootstrap`,
    /// or the user's MPI / torch.distributed / store) carries the handles they exchange.
    /// `config.devices` names this process's GPU (one ordinal, or one per rank to pick
    /// `devices[rank]`). GPU backends only: the host backend's ranks are threads.
    pub fn new_rank(
        backend: BackendKind,
        config: GroupConfig,
        bootstrap: &mut dyn Bootstrap,
    ) -> Result<Communicator> {
        let _span = tracing::debug_span!(
            "new_rank",
            backend = backend.name(),
            rank = bootstrap.rank(),
            world = config.world_size
        )
        .entered();
        config.validate_for_rank()?;
        if bootstrap.world_size() != config.world_size || bootstrap.rank() >= config.world_size {
            return Err(Error::InvalidConfig(format!(
                "the bootstrap has rank {} of {}, the config a world of {}",
                bootstrap.rank(),
                bootstrap.world_size(),
                config.world_size
            )));
        }
        let config = with_env_table(config)?;
        let comm = match backend {
            BackendKind::Host => boxed_rank::<allreduce_backend_host::Host>(&config, bootstrap)?,
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => boxed_rank::<allreduce_backend_cuda::Cuda>(&config, bootstrap)?,
            #[cfg(feature = "rocm")]
            BackendKind::Rocm => boxed_rank::<allreduce_backend_rocm::Rocm>(&config, bootstrap)?,
            #[allow(unreachable_patterns)] // every backend compiled in
            _ => return Err(Error::BackendNotBuilt(backend.name())),
        };
        Ok(Communicator { backend, comm })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How the group's GPUs are connected (GPU backends; `None` on the host backend).
    pub fn topology(&self) -> Option<&Topology> {
        self.comm.topology()
    }

    /// This rank's symmetric window of the vendor library (`Strategy::VendorSymmetric`,
    /// NCCL 2.27+): its device address and size in bytes, or `None` where the group has
    /// none. Tensors that live in the window (at the same offset on every rank) are reduced
    /// by NCCL's symmetric kernels with no copy; calls on other buffers are copied in and
    /// out of it. The window is the group's: it lives as long as the communicator.
    pub fn vendor_window(&self) -> Option<(u64, usize)> {
        self.comm.vendor_window()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    pub fn device(&self) -> Device {
        self.comm.limits().device
    }

    /// The alignment, in bytes, that every buffer address given to this communicator's calls
    /// must have (at least the element size): [`BUFFER_ALIGN`], the same on every backend, so
    /// a view that works on the host works on a GPU. A view at another offset is refused with
    /// `Error::Misaligned` before anything runs.
    pub fn alignment(&self) -> usize {
        self.comm.limits().align
    }

    /// The largest call this communicator runs in one piece (the workspace size), in bytes.
    pub fn max_bytes(&self) -> usize {
        self.comm.limits().max_bytes
    }

    /// Whether calls larger than [`Communicator::max_bytes`] run, in pieces (GPU backends), or
    /// are refused with `Error::TooLarge` (the host backend).
    pub fn splits_large_calls(&self) -> bool {
        self.comm.limits().chunks
    }

    /// `Ok` if this communicator can run `strategy` for calls of this dtype and precision,
    /// else the reason it cannot (the same text `Error::StrategyUnavailable` would carry).
    pub fn strategy_available(
        &self,
        strategy: Strategy,
        dtype: DType,
        precision: Precision,
    ) -> Result<()> {
        if let Precision::Lossy(codec) = precision {
            if !codec.supports(dtype) {
                return Err(Error::UnsupportedCodec { codec, dtype });
            }
        }
        match strategy {
            Strategy::Auto => Ok(()),
            s => self
                .comm
                .strategy_available(s, dtype, precision)
                .map_err(|reason| Error::StrategyUnavailable {
                    strategy: s,
                    reason,
                }),
        }
    }

    /// What `Strategy::Auto` picks for a call of this shape.
    pub fn select(&self, len: usize, dtype: DType, precision: Precision) -> Strategy {
        let comm = &*self.comm;
        comm.selection().choose_on(
            comm.limits().topology,
            len * dtype.size(),
            comm.world_size(),
            dtype,
            precision,
            |s| comm.strategy_available(s, dtype, precision).is_ok(),
        )
    }

    /// Sum `input` over all ranks into `output`. Returns the strategy that ran.
    pub fn all_reduce(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        options: &AllReduceOptions,
    ) -> Result<Strategy> {
        self.call(Some(input), output, options)
    }

    /// Sum `buf` over all ranks, in place. Returns the strategy that ran.
    pub fn all_reduce_in_place(
        &self,
        buf: BufMut<'_>,
        options: &AllReduceOptions,
    ) -> Result<Strategy> {
        self.call(None, buf, options)
    }

    fn call(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        options: &AllReduceOptions,
    ) -> Result<Strategy> {
        let comm = &*self.comm;
        let _span = tracing::debug_span!(
            "all_reduce",
            rank = comm.rank(),
            len = output.len(),
            dtype = %output.dtype(),
            precision = %options.precision,
            requested = %options.strategy,
        )
        .entered();
        let prepared = prepare(
            input,
            &output,
            options,
            &comm.limits(),
            comm.world_size(),
            comm.selection(),
            |s, d, p| comm.strategy_available(s, d, p),
        );
        let call = match prepared {
            Ok(call) => call,
            Err(e) => {
                tracing::debug!(error = %e, "rejected");
                comm.reject_call(&e, options.stream, options.strategy);
                return Err(e);
            }
        };
        tracing::debug!(strategy = %call.strategy, "enqueue");
        comm.all_reduce(&call)?;
        Ok(call.strategy)
    }

    /// Refuse this rank's part of the group's next call for a reason found before the call
    /// could be built (a language binding's own checks: an enum code that names nothing, a
    /// null pointer), the way [`Communicator::all_reduce`] refuses arguments it checks
    /// itself: the peers' matching call returns `Error::PeerRejected` carrying `reason` at
    /// once instead of waiting for its deadline, and the group stays usable. Call it where
    /// this rank would have called `all_reduce`, with that call's stream.
    pub fn reject(&self, reason: &Error, stream: Stream) {
        tracing::debug!(rank = self.comm.rank(), error = %reason, "rejected by the caller");
        self.comm.reject(reason, stream);
    }

    /// [`Communicator::reject`] for a call that would have asked for `strategy`: a GPU
    /// group's push one-shot (`Strategy::PushOneShot`) agrees through its own protocol, so
    /// its peers learn of the refusal only when it is made there.
    pub fn reject_call(&self, reason: &Error, stream: Stream, strategy: Strategy) {
        tracing::debug!(rank = self.comm.rank(), error = %reason, %strategy, "rejected by the caller");
        self.comm.reject_call(reason, stream, strategy);
    }

    /// Register memory the caller already has with every rank of an in-process group:
    /// `ranges[r]` is rank r's device address and length (one length for all; 16-byte aligned
    /// starts). Out-of-place exact one-shot and two-shot calls (as `Auto` or the caller
    /// picks them) whose input lies in this rank's range then read every peer's input in place
    /// at the peer's base + the same offset, instead of staging a copy: every rank must then
    /// call with its input at the same offset of the same registration (ranks that do not get
    /// `Error::RankMismatch`, and the group stays usable). In-place, lossy and other calls are
    /// unchanged.
    ///
    /// `comms` is the whole group in rank order (what [`Communicator::new_group`] returned).
    /// Memory from a stream-ordered pool on one GPU is reachable from another only if the
    /// pool grants it; plain allocations are, as peer access is enabled between the group's
    /// GPUs. Groups of one process per rank refuse it with `Error::Unsupported`: a peer
    /// process would have to map the caller's memory, and exporting an allocation needs its
    /// base, which an address alone does not give. The memory must stay allocated until
    /// [`Communicator::deregister_group`] and until every call that read it has completed; a
    /// captured graph keeps the peers' addresses it was captured with.
    pub fn register_group(
        comms: &[Communicator],
        ranges: &[RegisteredRange],
    ) -> Result<RegistrationId> {
        Self::whole_group(comms)?.comm.register_group(ranges)
    }

    /// Graph buffers registered after capture, as vLLM registers them: while `on`, every
    /// out-of-place exact one-shot or two-shot call this rank enqueues on a stream being
    /// captured into a CUDA/HIP graph, on an input outside registered memory, is captured to
    /// read every rank's input in place, at addresses that
    /// [`Communicator::register_graph_buffers`] supplies after capture; eager calls are
    /// unchanged. Turn it on for the capture (on every rank), capture, then register before
    /// the first replay: a replay before registration skips the call on every rank and
    /// returns `Error::InvalidArgument` at synchronize (the group stays usable). The captured
    /// inputs must stay allocated while the graph may replay.
    pub fn set_graph_registration(&self, on: bool) -> Result<()> {
        self.comm.set_graph_registration(on)
    }

    /// Register the inputs of the calls every rank of an in-process group captured with
    /// graph registration on since the last registration (see
    /// [`Communicator::set_graph_registration`]); returns how many calls each rank captured.
    /// Ranks that captured different calls (counts or lengths) get `Error::RankMismatch` and
    /// their graphs keep failing on replay. `comms` is the whole group in rank order; no
    /// graph of the group may be running.
    pub fn register_graph_buffers(comms: &[Communicator]) -> Result<usize> {
        Self::whole_group(comms)?
            .comm
            .register_graph_buffers_group()
    }

    /// This rank's part of a registration in a group of one process per rank (made by
    /// [`Communicator::new_rank`]): `range` is this rank's memory (from cudaMalloc /
    /// cuMemAlloc or hipMalloc, such as a PyTorch caching-allocator tensor; not from a
    /// stream-ordered pool), shared with every peer as an IPC handle over `bootstrap`, with
    /// the same effect as [`Communicator::register_group`] in-process. Collective: every rank
    /// calls it with a range of the same length, in the same order as its other
    /// registrations; a rank that cannot share its memory fails it for all. The memory must
    /// stay allocated while registered; the peers keep its mapping until the group is dropped.
    pub fn register(
        &self,
        range: RegisteredRange,
        bootstrap: &mut dyn Bootstrap,
    ) -> Result<RegistrationId> {
        self.comm.register_rank(range, bootstrap)
    }

    /// `bytes` of device memory for this rank of a group of one process per rank, registered
    /// with every rank as [`Communicator::register`] does. Collective. Dropping it deregisters
    /// it on this rank (later calls on it are staged; drop it on every rank alike).
    pub fn alloc_registered(
        &self,
        bytes: usize,
        bootstrap: &mut dyn Bootstrap,
    ) -> Result<RegisteredBuffer> {
        Ok(RegisteredBuffer::new(
            self.comm.alloc_registered_rank(bytes, bootstrap)?,
        ))
    }

    /// [`Communicator::register_graph_buffers`] for a group of one process per rank: this
    /// rank's captured inputs are shared with every peer over `bootstrap`. Collective.
    pub fn register_graph_buffers_rank(&self, bootstrap: &mut dyn Bootstrap) -> Result<usize> {
        self.comm.register_graph_buffers_rank(bootstrap)
    }

    /// Forget this rank's part of a registration of a group of one process per rank
    /// ([`Communicator::register`]); every rank must do it before its next call on that memory
    /// (a rank still registered and one not would disagree on the call's path).
    pub fn deregister(&self, id: RegistrationId) -> Result<()> {
        self.comm.deregister_group(id)
    }

    /// Forget a registration made by [`Communicator::register_group`] (calls that read it
    /// must have completed). Later calls on that memory take the staged path.
    pub fn deregister_group(comms: &[Communicator], id: RegistrationId) -> Result<()> {
        Self::whole_group(comms)?.comm.deregister_group(id)
    }

    /// Allocate `bytes` on every rank's device and register them with the group (see
    /// [`Communicator::register_group`]); element r is rank r's. Dropping any of them
    /// deregisters all (later calls on the others are staged); each frees its own memory.
    pub fn alloc_registered_group(
        comms: &[Communicator],
        bytes: usize,
    ) -> Result<Vec<RegisteredBuffer>> {
        let first = Self::whole_group(comms)?;
        Ok(first
            .comm
            .alloc_registered_group(bytes)?
            .into_iter()
            .map(RegisteredBuffer::new)
            .collect())
    }

    /// `comms[0]`, once `comms` is checked to be one whole in-process group in rank order.
    fn whole_group(comms: &[Communicator]) -> Result<&Communicator> {
        let first = comms
            .first()
            .ok_or_else(|| Error::InvalidArgument("no communicators given".into()))?;
        let Some(key) = first.comm.group_key() else {
            return Err(Error::Unsupported {
                what: format!("memory registration on the {} backend", first.backend),
            });
        };
        if comms.len() != first.world_size() {
            return Err(Error::InvalidArgument(format!(
                "registration takes every rank of the group: {} communicators for {} ranks",
                comms.len(),
                first.world_size()
            )));
        }
        for (r, c) in comms.iter().enumerate() {
            if c.rank() != r || c.comm.group_key() != Some(key) {
                return Err(Error::InvalidArgument(format!(
                    "communicator {r} is not rank {r} of the same group as communicator 0"
                )));
            }
        }
        Ok(first)
    }

    /// Abort the group (NCCL's `ncclCommAbort`): callable from any thread, also while a call
    /// of this or another rank waits for a peer that will never come. Every call in flight
    /// leaves its wait now instead of at the deadline and reports `Error::Aborted`, as does
    /// every later call of every rank; drop the group and build a new one. In a group of one
    /// process per rank the peers' calls learn it from the device (GPU backends), so every
    /// process should still abort or drop its own rank.
    pub fn abort(&self) -> Result<()> {
        let reason = format!(
            "rank {} aborted the group (Communicator::abort)",
            self.rank()
        );
        self.comm.abort(&reason)
    }

    /// Wait for the work enqueued on `stream` and report any asynchronous error (a device-side
    /// timeout, an aborted group).
    pub fn synchronize(&self, stream: Stream) -> Result<()> {
        self.comm.synchronize(stream)
    }
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("backend", &self.backend)
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .finish()
    }
}

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
