//! Group creation and the per-rank communicator, for any [`GpuRuntime`].
//!
//! This is `crates/backend-cuda/src/comm.rs` with the CUDA driver calls replaced by the
//! trait's; keep the two in step until the CUDA backend runs on it (docs/decisions.md).
//!
//! A group is built over a list of device ordinals, one per rank; ordinals may repeat
//! ("virtual ranks": several ranks on one GPU, each with its own workspace and a grid small
//! enough that all ranks' grids co-reside, since they spin on each other's flags). Distinct
//! devices get peer access. Every rank's workspace base is written into every rank's launch
//! arguments once, at creation, so nothing per call comes from the host but the caller's
//! buffers.

use std::ffi::{c_void, CStr};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::abi::{self, Args, Control, Desc, MAX_BLOCKS, MAX_WORLD, THREADS};
use super::GpuRuntime;
use crate::{
    Backend, BackendComm, Call, Codec, DType, Error, GroupConfig, Limits, Precision, Result,
    SelectionTable, Strategy, Stream,
};

/// A GPU backend: the shared group logic over runtime `R`.
pub struct GpuBackend<R>(PhantomData<R>);

impl<R: GpuRuntime> Backend for GpuBackend<R> {
    const NAME: &'static str = R::NAME;
    type Comm = GpuComm<R>;

    fn create_group(config: &GroupConfig) -> Result<Vec<GpuComm<R>>> {
        config.validate()?;
        let world = config.world_size;
        if world > MAX_WORLD {
            return Err(Error::InvalidConfig(format!(
                "the {} kernels run up to {MAX_WORLD} ranks, {world} requested",
                R::NAME
            )));
        }
        let ordinals: Vec<u32> = if config.devices.is_empty() {
            vec![0; world]
        } else {
            config.devices.clone()
        };
        let group = Arc::new(Group::<R>::new(&ordinals, config)?);
        let table = config
            .selection
            .clone()
            .unwrap_or_else(|| R::default_selection(config));
        Ok((0..world)
            .map(|rank| GpuComm {
                rank,
                group: group.clone(),
                table: table.clone(),
                calls: AtomicU64::new(0),
            })
            .collect())
    }
}

/// The kernels the group launches, by dtype (f32, f16, bf16).
struct Kernels<R: GpuRuntime> {
    oneshot: [R::Function; 3],
    twoshot: [R::Function; 3],
    _module: R::Module,
}

impl<R: GpuRuntime> Kernels<R> {
    fn load(dev: &R::Device) -> Result<Self> {
        let module = R::load_module(dev)?;
        let f = |name: &CStr| R::function(&module, name);
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
struct Group<R: GpuRuntime> {
    world: usize,
    /// Index into `devices` of each rank.
    rank_device: Vec<usize>,
    devices: Vec<R::Device>,
    kernels: Vec<Option<Kernels<R>>>,
    workspaces: Vec<Option<R::Memory>>,
    controls: Vec<Option<R::HostMapped>>,
    peers: [u64; MAX_WORLD],
    /// One vendor communicator per rank, or why there is none.
    vendor: std::result::Result<Vec<R::Vendor>, String>,
    grid: u32,
    max_bytes: usize,
    timeout: Duration,
    cast_bf16_to_f16: bool,
}

impl<R: GpuRuntime> Group<R> {
    fn new(ordinals: &[u32], config: &GroupConfig) -> Result<Self> {
        R::prepare_group(ordinals)?;
        let mut distinct: Vec<u32> = Vec::new();
        for &o in ordinals {
            if !distinct.contains(&o) {
                distinct.push(o);
            }
        }
        let devices = distinct
            .iter()
            .map(|&o| R::open(o))
            .collect::<Result<Vec<_>>>()?;
        let rank_device: Vec<usize> = ordinals
            .iter()
            .map(|o| distinct.iter().position(|d| d == o).expect("listed"))
            .collect();
        for a in &devices {
            for b in &devices {
                if R::ordinal(a) != R::ordinal(b) {
                    if !R::can_access_peer(a, b)? {
                        return Err(Error::StrategyUnavailable {
                            strategy: Strategy::OneShot,
                            reason: format!(
                                "GPU {} cannot access GPU {} as a peer",
                                R::ordinal(a),
                                R::ordinal(b)
                            ),
                        });
                    }
                    R::enable_peer(a, b)?;
                }
            }
        }
        let grid = grid_for(
            R::BLOCKS_PER_RANK,
            &devices.iter().map(R::compute_units).collect::<Vec<_>>(),
            &rank_device,
        );

        let max_bytes = abi::round_max_bytes(config.max_bytes);
        let mut kernels = Vec::new();
        for d in &devices {
            R::bind(d)?;
            kernels.push(Some(Kernels::load(d)?));
        }
        let mut workspaces = Vec::new();
        let mut controls = Vec::new();
        let mut peers = [0u64; MAX_WORLD];
        for (rank, &d) in rank_device.iter().enumerate() {
            let dev = &devices[d];
            R::bind(dev)?;
            let ws = R::alloc_workspace(dev, abi::workspace_bytes(max_bytes))?;
            peers[rank] = R::memory_addr(&ws);
            workspaces.push(Some(ws));
            controls.push(Some(R::alloc_host_mapped(dev, size_of::<Control>())?));
        }
        tracing::debug!(
            backend = R::NAME,
            ranks = ordinals.len(),
            devices = devices.len(),
            grid,
            max_bytes,
            "gpu group"
        );
        let vendor = match R::vendor_unavailable(ordinals) {
            Some(why) => Err(why),
            None => {
                let per_rank: Vec<&R::Device> = rank_device.iter().map(|&d| &devices[d]).collect();
                R::vendor_init(&per_rank)
                    .map_err(|e| format!("vendor library initialisation failed: {e}"))
            }
        };
        if let Err(why) = &vendor {
            tracing::debug!(reason = %why, "no vendor library for this group");
        }
        let group = Group {
            world: ordinals.len(),
            rank_device,
            devices,
            kernels,
            workspaces,
            controls,
            peers,
            vendor,
            grid,
            max_bytes,
            timeout: config.timeout,
            cast_bf16_to_f16: config.cast_bf16_to_f16,
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
            control: R::host_mapped_ptrs(self.control(rank)).1,
            max_bytes: self.max_bytes as u64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: rank as u32,
            world: self.world as u32,
            desc: desc.0,
        }
    }

    /// Run every kernel once per rank, alone (world 1, nothing to move), before any rank waits
    /// on another. A device's first launches may do lazy work that waits for the whole device
    /// (loading code, growing the scratch reservation); done while a peer's kernel spins
    /// waiting for this rank's launch, that wait never ends. Every rank advances its epochs
    /// and call parities by the same amount, so they stay in step.
    fn warm_up(&self) -> Result<()> {
        for (rank, &d) in self.rank_device.iter().enumerate() {
            R::bind(&self.devices[d])?;
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
                unsafe { R::launch(f, self.grid, THREADS, Stream::NULL, &args)? };
            }
        }
        for d in &self.devices {
            R::bind(d)?;
            R::synchronize_device(d)?;
        }
        Ok(())
    }

    fn control(&self, rank: usize) -> &R::HostMapped {
        self.controls[rank]
            .as_ref()
            .expect("alive while the group is")
    }

    /// Read a Control written by kernels. Volatile: the device writes it behind our back.
    fn read_control(m: &R::HostMapped) -> Control {
        // SAFETY: a live, aligned, host-mapped Control.
        unsafe { std::ptr::read_volatile(R::host_mapped_ptrs(m).0 as *const Control) }
    }
}

/// Blocks per launch: ranks sharing a GPU spin on each other's flags, so all their blocks
/// must be resident at once; split the compute units between them. The same on every rank.
fn grid_for(blocks_per_rank: u32, compute_units: &[u32], rank_device: &[usize]) -> u32 {
    let busiest = (0..compute_units.len())
        .map(|d| rank_device.iter().filter(|&&x| x == d).count())
        .max()
        .unwrap_or(1)
        .max(1);
    let min_units = compute_units.iter().copied().min().unwrap_or(1);
    blocks_per_rank
        .min(min_units / busiest as u32)
        .clamp(1, MAX_BLOCKS as u32)
}

impl<R: GpuRuntime> Drop for Group<R> {
    fn drop(&mut self) {
        // The vendor library first: its communicators may hold references into the devices.
        if let Ok(comms) = &mut self.vendor {
            comms.clear();
        }
        // Free each allocation with its own device current.
        for (rank, &d) in self.rank_device.iter().enumerate() {
            let _ = R::bind(&self.devices[d]);
            self.workspaces[rank].take();
            self.controls[rank].take();
        }
        for (d, k) in self.kernels.iter_mut().enumerate() {
            let _ = R::bind(&self.devices[d]);
            k.take();
        }
    }
}

/// One rank of a GPU group.
pub struct GpuComm<R: GpuRuntime> {
    rank: usize,
    group: Arc<Group<R>>,
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
        Precision::Lossy(c) => 1 + Codec::ALL.iter().position(|&x| x == c).unwrap_or(0) as u64,
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
    let mut precisions = vec!["exact"];
    precisions.extend(Codec::ALL.iter().map(|c| c.name()));
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

impl<R: GpuRuntime> GpuComm<R> {
    fn device(&self) -> &R::Device {
        &self.group.devices[self.group.rank_device[self.rank]]
    }

    /// The device ordinal this rank runs on.
    pub fn ordinal(&self) -> u32 {
        R::ordinal(self.device())
    }

    /// Blocks per kernel launch (the same on every rank).
    pub fn grid(&self) -> u32 {
        self.group.grid
    }

    /// Whether bf16 codec calls run through the f16 kernels ([`GroupConfig::cast_bf16_to_f16`]).
    pub fn casts_bf16_to_f16(&self) -> bool {
        self.group.cast_bf16_to_f16
    }

    /// Whether any rank's kernel has timed out: then the group is out of step for good.
    fn aborted(&self) -> Option<String> {
        (0..self.group.world).find_map(|r| {
            let c = Group::<R>::read_control(self.group.control(r));
            (c.error == abi::ERROR_TIMEOUT).then(|| {
                format!(
                    "rank {} timed out at block {} waiting for epoch {}",
                    c.rank, c.block, c.epoch
                )
            })
        })
    }
}

impl<R: GpuRuntime> BackendComm for GpuComm<R> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn limits(&self) -> Limits {
        Limits {
            device: R::device_tag(self.ordinal()),
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
            Strategy::QuantizedTwoShot => match R::quantized_unavailable() {
                Some(why) => Err(why),
                None => Ok(()),
            },
            Strategy::Vendor => self.group.vendor.as_ref().map(|_| ()).map_err(Clone::clone),
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
                    .vendor
                    .as_ref()
                    .map_err(|reason| Error::StrategyUnavailable {
                        strategy: Strategy::Vendor,
                        reason: reason.clone(),
                    })?;
                R::bind(self.device())?;
                // SAFETY: `prepare` validated the buffers (device, size, alignment).
                return unsafe { R::vendor_all_reduce(&comms[self.rank], self.device(), call) };
            }
            s => {
                return Err(Error::StrategyUnavailable {
                    strategy: s,
                    reason: format!("not in the {} backend", R::NAME),
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
        R::bind(self.device())?;
        // SAFETY: Args mirrors the kernel's parameter; the workspaces and controls live as long
        // as the group, and `prepare` validated the caller's buffers (device, size, alignment).
        unsafe { R::launch(f, g.grid, THREADS, call.stream, &args) }
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
        if R::bind(self.device()).is_ok() {
            // SAFETY: as in all_reduce; n = 0, so the null buffers are never touched.
            let _ = unsafe { R::launch(kernels.oneshot[0], g.grid, THREADS, stream, &args) };
        }
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        R::bind(self.device())?;
        R::synchronize_stream(self.device(), stream)?;
        let control = self.group.control(self.rank);
        let c = Group::<R>::read_control(control);
        if c.error == abi::ERROR_MISMATCH {
            // Not fatal: clear it once reported. No kernel of ours runs now (the stream is
            // idle) and peers never write our control.
            // SAFETY: a live, aligned, host-mapped Control.
            unsafe {
                std::ptr::write_volatile(
                    R::host_mapped_ptrs(control).0 as *mut u32,
                    abi::ERROR_NONE,
                )
            };
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
}

#[cfg(test)]
mod tests;
