//! Group creation and the per-rank communicator.
//!
//! A group is built over a list of device ordinals, one per rank; ordinals may repeat
//! ("virtual ranks": several ranks on one GPU, each with its own workspace and a grid small
//! enough that all ranks' grids co-reside, since they spin on each other's flags). Distinct
//! devices get peer access. Every rank's workspace base is written into every rank's launch
//! arguments once, at creation, so nothing per call comes from the host but the caller's
//! buffers.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use allreduce_core::{
    Backend, BackendComm, Call, DType, Device, Error, GroupConfig, Limits, Precision, Result,
    SelectionTable, Strategy, Stream,
};

use crate::abi::{self, Args, Control, MAX_BLOCKS, MAX_WORLD, THREADS};
use crate::driver::{self, CUfunction, DeviceMem, HostMapped, Module};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/allreduce.fatbin"));

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
    abort: Option<HostMapped>,
    peers: [u64; MAX_WORLD],
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
        devices[0].bind()?;
        let abort = HostMapped::zeroed(size_of::<Control>())?;
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
        Ok(Group {
            world: ordinals.len(),
            rank_device,
            devices,
            kernels,
            workspaces,
            controls,
            abort: Some(abort),
            peers,
            grid,
            max_bytes,
            timeout: config.timeout,
        })
    }

    fn control(&self, rank: usize) -> &HostMapped {
        self.controls[rank]
            .as_ref()
            .expect("alive while the group is")
    }

    fn abort(&self) -> &HostMapped {
        self.abort.as_ref().expect("alive while the group is")
    }

    /// Read a Control written by kernels. Volatile: the device writes it behind our back.
    fn read_control(m: &HostMapped) -> Control {
        // SAFETY: a live, aligned, host-mapped Control.
        unsafe { std::ptr::read_volatile(m.host as *const Control) }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
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
        let _ = self.devices[0].bind();
        self.abort.take();
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

    fn aborted(&self) -> Option<String> {
        let c = Group::read_control(self.group.abort());
        (c.error != abi::ERROR_NONE).then(|| {
            format!(
                "rank {} timed out at block {} waiting for epoch {}",
                c.rank, c.block, c.epoch
            )
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
            Strategy::Vendor => Err("NCCL is not wired into the CUDA backend yet".into()),
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
            s => {
                return Err(Error::StrategyUnavailable {
                    strategy: s,
                    reason: "not in the CUDA backend".into(),
                })
            }
        };
        let args = Args {
            input: call.input.addr as *const _,
            output: call.output.addr as *mut _,
            n: call.len() as u64,
            peers: g.peers,
            control: g.control(self.rank).dev,
            abort: g.abort().dev,
            max_bytes: g.max_bytes as u64,
            timeout_ns: g.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: self.rank as u32,
            world: g.world as u32,
        };
        self.device().bind()?;
        // SAFETY: Args mirrors the kernel's parameter; the workspaces and controls live as long
        // as the group, and `prepare` validated the caller's buffers (device, size, alignment).
        unsafe { driver::launch(f, g.grid, THREADS, call.stream.as_raw() as _, &args) }
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        self.device().bind()?;
        driver::stream_synchronize(stream)?;
        let c = Group::read_control(self.group.control(self.rank));
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
