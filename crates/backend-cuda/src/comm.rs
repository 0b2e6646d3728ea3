//! Group creation and the per-rank communicator.
//!
//! A group is built over a list of device ordinals, one per rank; ordinals may repeat
//! ("virtual ranks": several ranks on one GPU, each with its own workspace and a grid small
//! enough that all ranks' grids co-reside, since they spin on each other's flags). Distinct
//! devices get peer access. Every rank's workspace base is written into every rank's launch
//! arguments once, at creation, so nothing per call comes from the host but the caller's
//! buffers.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allreduce_core::{
    Backend, BackendComm, Call, DType, Device, Error, GroupConfig, Limits, Precision, Result,
    SelectionTable, Strategy, Stream,
};

use crate::abi::{self, Args, Control, Desc, MAX_BLOCKS, MAX_WORLD, THREADS};
use crate::driver::{self, CUfunction, DeviceMem, HostMapped, Module};
use crate::nccl;

pub(crate) static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/allreduce.fatbin"));

/// vLLM's grid-searched block count for its one-shot/two-shot kernels on one GPU per rank.
const BLOCKS_PER_RANK: u32 = 36;

/// The CUDA backend.
pub struct Cuda;

impl Backend for Cuda {
    const NAME: &'static str = "cuda";
    type Comm = CudaComm;

    fn create_group(config: &GroupConfig) -> Result<Vec<CudaComm>> {
        config.validate()?;
        let world = config.world_size;
        if world > MAX_WORLD {
            return Err(Error::InvalidConfig(format!(
                "the CUDA kernels run up to {MAX_WORLD} ranks, {world} requested"
            )));
        }
        let ordinals: Vec<u32> = if config.devices.is_empty() {
            vec![0; world]
        } else {
            config.devices.clone()
        };
        let group = Arc::new(Group::new(&ordinals, config)?);
        let table = config.selection.clone().unwrap_or_default();
        Ok((0..world)
            .map(|rank| CudaComm {
                rank,
                group: group.clone(),
                table: table.clone(),
                calls: AtomicU64::new(0),
            })
            .collect())
    }
}

struct Kernels {
    oneshot: [CUfunction; 3],
    twoshot: [CUfunction; 3],
    _module: Module,
}

// SAFETY: CUfunction handles may be used from any thread.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    fn load() -> Result<Self> {
        let module = Module::load(FATBIN)?;
        let f = |name: &CStr| module.function(name);
        Ok(Kernels {
            oneshot: [
                f(c"ar_oneshot_f32")?,
                f(c"ar_oneshot_f16")?,
                f(c"ar_oneshot_bf16")?,
            ],
            twoshot: [
                f(c"ar_twoshot_f32")?,
                f(c"ar_twoshot_f16")?,
                f(c"ar_twoshot_bf16")?,
            ],
            _module: module,
        })
    }
}

/// Everything the ranks of a group share. Freed when the last rank is dropped.
struct Group {
    world: usize,
    /// Index into `devices` of each rank.
    rank_device: Vec<usize>,
    devices: Vec<driver::Device>,
    kernels: Vec<Option<Kernels>>,
    workspaces: Vec<Option<DeviceMem>>,
    controls: Vec<Option<HostMapped>>,
    peers: [u64; MAX_WORLD],
    /// One NCCL communicator per rank, or why there is none.
    nccl: std::result::Result<Vec<nccl::Comm>, String>,
    grid: u32,
    max_bytes: usize,
    timeout: Duration,
}

impl Group {
    fn new(ordinals: &[u32], config: &GroupConfig) -> Result<Self> {
        let mut distinct: Vec<u32> = Vec::new();
        for &o in ordinals {
            if !distinct.contains(&o) {
                distinct.push(o);
            }
        }
        let devices = distinct
            .iter()
            .map(|&o| driver::Device::open(o))
            .collect::<Result<Vec<_>>>()?;
        let rank_device: Vec<usize> = ordinals
            .iter()
            .map(|o| distinct.iter().position(|d| d == o).expect("listed"))
            .collect();
        for a in &devices {
            for b in &devices {
                if a.ordinal != b.ordinal {
                    if !a.can_access_peer(b)? {
                        return Err(Error::StrategyUnavailable {
                            strategy: Strategy::OneShot,
                            reason: format!(
                                "GPU {} cannot access GPU {} as a peer",
                                a.ordinal, b.ordinal
                            ),
                        });
                    }
                    a.enable_peer(b)?;
                }
            }
        }
        // Ranks sharing a GPU spin on each other's flags, so all their blocks must be resident
        // at once: split the SMs between them. The grid must be the same on every rank.
        let busiest = (0..devices.len())
            .map(|d| rank_device.iter().filter(|&&x| x == d).count())
            .max()
            .unwrap_or(1);
        let min_sms = devices.iter().map(|d| d.sm_count).min().unwrap_or(1);
        let grid = BLOCKS_PER_RANK
            .min(min_sms / busiest as u32)
            .clamp(1, MAX_BLOCKS as u32);

        let max_bytes = abi::round_max_bytes(config.max_bytes);
        let mut kernels = Vec::new();
        for d in &devices {
            d.bind()?;
            kernels.push(Some(Kernels::load()?));
        }
        let mut workspaces = Vec::new();
        let mut controls = Vec::new();
        let mut peers = [0u64; MAX_WORLD];
        for (rank, &d) in rank_device.iter().enumerate() {
            devices[d].bind()?;
            let ws = DeviceMem::zeroed(abi::workspace_bytes(max_bytes))?;
            peers[rank] = ws.ptr;
            workspaces.push(Some(ws));
            controls.push(Some(HostMapped::zeroed(size_of::<Control>())?));
        }
        tracing::debug!(
            ranks = ordinals.len(),
            devices = devices.len(),
            grid,
            max_bytes,
            "cuda group"
        );
        let nccl = match nccl::unavailable(ordinals) {
            Some(why) => Err(why),
            None => {
                let per_rank: Vec<&driver::Device> =
                    rank_device.iter().map(|&d| &devices[d]).collect();
                nccl::init(&per_rank).map_err(|e| format!("NCCL initialisation failed: {e}"))
            }
        };
        if let Err(why) = &nccl {
            tracing::debug!(reason = %why, "no NCCL for this group");
        }
        let group = Group {
            world: ordinals.len(),
            rank_device,
            devices,
            kernels,
            workspaces,
            controls,
            peers,
            nccl,
            grid,
            max_bytes,
            timeout: config.timeout,
        };
        group.warm_up()?;
        Ok(group)
    }

    /// Launch arguments for `rank`: everything but the call's buffers and descriptor is fixed
    /// for the life of the group.
    fn args(
        &self,
        rank: usize,
        input: *const c_void,
        output: *mut c_void,
        n: usize,
        desc: Desc,
    ) -> Args {
        Args {
            input,
            output,
            n: n as u64,
            peers: self.peers,
            control: self.control(rank).dev,
            max_bytes: self.max_bytes as u64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: rank as u32,
            world: self.world as u32,
            desc: desc.0,
        }
    }

    /// Run every kernel once per rank, alone (world 1, nothing to move), before any rank waits
    /// on another. A context's first launches may do lazy work that waits for the whole device
    /// (loading code, growing the local-memory reservation for a kernel with a stack); done
    /// while a peer's kernel spins waiting for this rank's launch, that wait never ends. Every
    /// rank advances its epochs and call parities by the same amount, so they stay in step.
    fn warm_up(&self) -> Result<()> {
        for (rank, &d) in self.rank_device.iter().enumerate() {
            self.devices[d].bind()?;
            let k = self.kernels[d].as_ref().expect("loaded");
            let mut args = self.args(
                rank,
                std::ptr::null(),
                std::ptr::null_mut(),
                0,
                Desc::new(0, 0, 0, 0),
            );
            args.peers = [0; MAX_WORLD];
            args.peers[0] = self.peers[rank];
            args.rank = 0;
            args.world = 1;
            for &f in k.oneshot.iter().chain(&k.twoshot) {
                // SAFETY: n = 0 and world = 1: the kernel touches only this rank's workspace.
                unsafe { driver::launch(f, self.grid, THREADS, std::ptr::null_mut(), &args)? };
            }
        }
        for d in &self.devices {
            d.bind()?;
            driver::context_synchronize()?;
        }
        Ok(())
    }

    fn control(&self, rank: usize) -> &HostMapped {
        self.controls[rank]
            .as_ref()
            .expect("alive while the group is")
    }

    /// Read a Control written by kernels. Volatile: the device writes it behind our back.
    fn read_control(m: &HostMapped) -> Control {
        // SAFETY: a live, aligned, host-mapped Control.
        unsafe { std::ptr::read_volatile(m.host as *const Control) }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // NCCL first: its communicators may hold references into the contexts below.
        if let Ok(comms) = &mut self.nccl {
            comms.clear();
        }
        // Free each allocation with its own device's context current.
        for (rank, &d) in self.rank_device.iter().enumerate() {
            let _ = self.devices[d].bind();
            self.workspaces[rank].take();
            self.controls[rank].take();
        }
        for (d, k) in self.kernels.iter_mut().enumerate() {
            let _ = self.devices[d].bind();
            k.take();
        }
    }
}

/// One rank of a CUDA group.
pub struct CudaComm {
    rank: usize,
    group: Arc<Group>,
    table: SelectionTable,
    calls: AtomicU64,
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

// Descriptor codes; 0 is never used so a zeroed slot matches nothing.
const STRATEGIES: [Strategy; 4] = [
    Strategy::OneShot,
    Strategy::TwoShot,
    Strategy::QuantizedTwoShot,
    Strategy::Vendor,
];

fn precision_code(p: Precision) -> u64 {
    match p {
        Precision::Exact => 0,
        Precision::Lossy(c) => {
            1 + allreduce_core::Codec::ALL
                .iter()
                .position(|&x| x == c)
                .unwrap_or(0) as u64
        }
    }
}

fn describe(call: &Call) -> Desc {
    Desc::new(
        call.len(),
        1 + dtype_index(call.dtype()) as u64,
        1 + STRATEGIES
            .iter()
            .position(|&s| s == call.strategy)
            .unwrap_or(0) as u64,
        precision_code(call.precision),
    )
}

/// Turn two differing descriptors into the error the host backend would give.
fn mismatch_error(me: usize, peer: usize, call: u64, mine: Desc, theirs: Desc) -> Error {
    if theirs == Desc::REJECTED {
        return Error::PeerRejected {
            rank: peer,
            call,
            reason: "its arguments were refused".into(),
        };
    }
    let name =
        |table: &[&str], code: u64| table.get(code as usize).copied().unwrap_or("?").to_string();
    let dtypes = ["?", "f32", "f16", "bf16"];
    let strategies = ["?", "oneshot", "twoshot", "quantized", "vendor"];
    let precisions = ["exact", "fp8", "q8", "q6", "q4"];
    let (what, a, b) = if mine.len() != theirs.len() {
        ("length", mine.len().to_string(), theirs.len().to_string())
    } else if mine.dtype() != theirs.dtype() {
        (
            "dtype",
            name(&dtypes, mine.dtype()),
            name(&dtypes, theirs.dtype()),
        )
    } else if mine.strategy() != theirs.strategy() {
        (
            "strategy",
            name(&strategies, mine.strategy()),
            name(&strategies, theirs.strategy()),
        )
    } else {
        (
            "precision",
            name(&precisions, mine.precision()),
            name(&precisions, theirs.precision()),
        )
    };
    Error::RankMismatch {
        what,
        call,
        detail: format!("rank {me} has {a}, rank {peer} has {b}"),
    }
}

impl CudaComm {
    fn device(&self) -> &driver::Device {
        &self.group.devices[self.group.rank_device[self.rank]]
    }

    /// The device ordinal this rank runs on.
    pub fn ordinal(&self) -> u32 {
        self.device().ordinal
    }

    /// Blocks per kernel launch (the same on every rank).
    pub fn grid(&self) -> u32 {
        self.group.grid
    }

    /// Whether any rank's kernel has timed out: then the group is out of step for good.
    fn aborted(&self) -> Option<String> {
        self.group.aborted()
    }
}

impl Group {
    fn aborted(&self) -> Option<String> {
        (0..self.world).find_map(|r| {
            let c = Group::read_control(self.control(r));
            (c.error == abi::ERROR_TIMEOUT).then(|| {
                format!(
                    "rank {} timed out at block {} waiting for epoch {}",
                    c.rank, c.block, c.epoch
                )
            })
        })
    }
}

impl BackendComm for CudaComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn limits(&self) -> Limits {
        Limits {
            device: Device::Cuda(self.ordinal()),
            max_bytes: self.group.max_bytes,
            align: 16,
        }
    }

    fn selection(&self) -> &SelectionTable {
        &self.table
    }

    fn strategy_available(
        &self,
        strategy: Strategy,
        _dtype: DType,
        _precision: Precision,
    ) -> Result<(), String> {
        match strategy {
            Strategy::OneShot | Strategy::TwoShot => Ok(()),
            Strategy::QuantizedTwoShot => Err("the quantized GPU kernels are not built yet".into()),
            Strategy::Vendor => self.group.nccl.as_ref().map(|_| ()).map_err(Clone::clone),
            Strategy::Auto => Err("Auto is resolved before the backend is called".into()),
        }
    }

    fn all_reduce(&self, call: &Call) -> Result<()> {
        if let Some(reason) = self.aborted() {
            return Err(Error::Aborted { reason });
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let g = &*self.group;
        let kernels = g.kernels[g.rank_device[self.rank]].as_ref().expect("alive");
        let f = match call.strategy {
            Strategy::OneShot => kernels.oneshot[dtype_index(call.dtype())],
            Strategy::TwoShot => kernels.twoshot[dtype_index(call.dtype())],
            Strategy::Vendor => {
                let comms = g
                    .nccl
                    .as_ref()
                    .map_err(|reason| Error::StrategyUnavailable {
                        strategy: Strategy::Vendor,
                        reason: reason.clone(),
                    })?;
                self.device().bind()?;
                // SAFETY: `prepare` validated the buffers (device, size, alignment).
                return unsafe {
                    nccl::all_reduce(
                        &comms[self.rank],
                        call.input.addr,
                        call.output.addr,
                        call.len(),
                        call.dtype(),
                        call.stream,
                    )
                };
            }
            s => {
                return Err(Error::StrategyUnavailable {
                    strategy: s,
                    reason: "not in the CUDA backend".into(),
                })
            }
        };
        let args = g.args(
            self.rank,
            call.input.addr as *const c_void,
            call.output.addr as *mut c_void,
            call.len(),
            describe(call),
        );
        self.device().bind()?;
        // SAFETY: Args mirrors the kernel's parameter; the workspaces and controls live as long
        // as the group, and `prepare` validated the caller's buffers (device, size, alignment).
        unsafe { driver::launch(f, g.grid, THREADS, call.stream.as_raw() as _, &args) }
    }

    fn reject(&self, _reason: &Error, stream: Stream) {
        // Join the call's first barrier with a "rejected" descriptor and nothing to move, so
        // the peers skip the call and report PeerRejected instead of waiting out the deadline.
        if self.aborted().is_some() {
            return;
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let g = &*self.group;
        let kernels = g.kernels[g.rank_device[self.rank]].as_ref().expect("alive");
        let args = g.args(
            self.rank,
            std::ptr::null(),
            std::ptr::null_mut(),
            0,
            Desc::REJECTED,
        );
        // The caller already has its own error; a failed launch here surfaces to the peers as
        // a timeout.
        if self.device().bind().is_ok() {
            // SAFETY: as in all_reduce; n = 0, so the null buffers are never touched.
            let _ = unsafe {
                driver::launch(
                    kernels.oneshot[0],
                    g.grid,
                    THREADS,
                    stream.as_raw() as _,
                    &args,
                )
            };
        }
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        self.device().bind()?;
        driver::stream_synchronize(stream)?;
        let control = self.group.control(self.rank);
        let c = Group::read_control(control);
        if c.error == abi::ERROR_MISMATCH {
            // Not fatal: clear it once reported. No kernel of ours runs now (the stream is
            // idle) and peers never write our control.
            // SAFETY: a live, aligned, host-mapped Control.
            unsafe { std::ptr::write_volatile(control.host as *mut u32, abi::ERROR_NONE) };
            let call = self.calls.load(Ordering::Relaxed).saturating_sub(1);
            return Err(mismatch_error(
                self.rank,
                c.rank as usize,
                call,
                Desc(c.mine),
                Desc(c.theirs),
            ));
        }
        if c.error == abi::ERROR_TIMEOUT {
            return Err(Error::Timeout {
                rank: c.rank as usize,
                call: self.calls.load(Ordering::Relaxed).saturating_sub(1),
                waited: Duration::from_nanos(c.waited_ns),
                waiting_for: format!("peers' flags at block {}, epoch {}", c.block, c.epoch),
            });
        }
        match self.aborted() {
            Some(reason) => Err(Error::Aborted { reason }),
            None => Ok(()),
        }
    }

    fn create_fused_group(
        &self,
        config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        crate::fused::create_group(GroupHandle(self.group.clone()), config).map(Some)
    }
}

/// What the fused kernels (fused.rs) need of a group; keeps the group alive.
pub(crate) struct GroupHandle(Arc<Group>);

impl GroupHandle {
    pub(crate) fn world(&self) -> usize {
        self.0.world
    }
    pub(crate) fn grid(&self) -> u32 {
        self.0.grid
    }
    pub(crate) fn timeout_ns(&self) -> u64 {
        self.0.timeout.as_nanos().min(u64::MAX as u128) as u64
    }
    /// Every rank's exact-kernel workspace base (their headers hold the abort word).
    pub(crate) fn workspaces(&self) -> [u64; MAX_WORLD] {
        self.0.peers
    }
    /// The device address of `rank`'s Control.
    pub(crate) fn control(&self, rank: usize) -> u64 {
        self.0.control(rank).dev
    }
    pub(crate) fn device(&self, rank: usize) -> &driver::Device {
        &self.0.devices[self.0.rank_device[rank]]
    }
    pub(crate) fn aborted(&self) -> Option<String> {
        self.0.aborted()
    }
}
