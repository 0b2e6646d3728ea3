//! Group creation and the per-rank communicator, for any [`GpuRuntime`].
//!
//! Both GPU backends run on it: `Cuda = GpuBackend<CudaRuntime>`, `Rocm = GpuBackend<Hip>`.
//!
//! A group is built over a list of device ordinals, one per rank; ordinals may repeat
//! ("virtual ranks": several ranks on one GPU, each with its own workspace and a grid small
//! enough that all ranks' grids co-reside, since they spin on each other's flags). Distinct
//! devices get peer access. Every rank's workspace base is written into every rank's launch
//! arguments once, at creation, so nothing per call comes from the host but the caller's
//! buffers.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::abi::{
    self, Args, Control, Desc, Desc2, RegisteredArgs, MAX_BLOCKS, MAX_WORLD, THREADS,
};
use crate::kernels::{self, Kernel};
use crate::push::{self, PushKernels, PushMemory};
use crate::GpuRuntime;
use allreduce_core::{
    Backend, BackendComm, Bootstrap, Call, CallDesc, Codec, DType, Deregister, Error, GroupConfig,
    InputPath, Limits, Precision, RegisteredInput, RegisteredMemory, RegisteredRange,
    RegistrationId, Registry, Result, SelectionTable, Strategy, Stream,
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
                graph_registration: AtomicBool::new(false),
            })
            .collect())
    }

    fn create_rank(config: &GroupConfig, bootstrap: &mut dyn Bootstrap) -> Result<GpuComm<R>> {
        config.validate_for_rank()?;
        let (rank, world) = (bootstrap.rank(), config.world_size);
        if world > MAX_WORLD || bootstrap.world_size() != world || rank >= world {
            return Err(Error::InvalidConfig(format!(
                "rank {rank} of a bootstrap of {} for a group of {world} (at most {MAX_WORLD})",
                bootstrap.world_size()
            )));
        }
        let ordinal = match config.devices.len() {
            0 => 0,
            1 => config.devices[0],
            n if n == world => config.devices[rank],
            n => {
                return Err(Error::InvalidConfig(format!(
                    "devices lists {n} GPUs: give this process's one, or one per rank ({world})"
                )))
            }
        };
        let group = Arc::new(Group::<R>::new_rank(rank, ordinal, config, bootstrap)?);
        let table = config
            .selection
            .clone()
            .unwrap_or_else(|| R::default_selection(config));
        Ok(GpuComm {
            rank,
            group,
            table,
            calls: AtomicU64::new(0),
            graph_registration: AtomicBool::new(false),
        })
    }
}

/// Length-prefixed fields in one bootstrap message.
fn pack(fields: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in fields {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

fn unpack(msg: &[u8], fields: usize, from: usize) -> Result<Vec<&[u8]>> {
    let bad = || Error::Bootstrap {
        detail: format!(
            "rank {from} sent a malformed group message (does it run another allreduce release?)"
        ),
    };
    let mut out = Vec::with_capacity(fields);
    let mut rest = msg;
    for _ in 0..fields {
        let len = u32::from_le_bytes(rest.get(..4).ok_or_else(bad)?.try_into().unwrap()) as usize;
        out.push(rest.get(4..4 + len).ok_or_else(bad)?);
        rest = &rest[4 + len..];
    }
    if !rest.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// The kernels the group launches, by dtype (f32, f16, bf16).
struct Kernels<R: GpuRuntime> {
    oneshot: [R::Function; 3],
    twoshot: [R::Function; 3],
    /// The same two reading registered inputs in place ([`RegisteredArgs`]).
    oneshot_registered: [R::Function; 3],
    twoshot_registered: [R::Function; 3],
    /// `[f16, bf16][codec index in Codec::ALL]`; `None` where the runtime has no codec
    /// kernels ([`GpuRuntime::quantized_unavailable`]).
    quantized: Option<[[R::Function; Codec::ALL.len()]; 2]>,
    /// The hierarchical kernels, indexed and present like `quantized`.
    hierarchical: Option<[[R::Function; Codec::ALL.len()]; 2]>,
    _module: R::Module,
}

/// Bytes of each staging buffer (and of `reduced`): `max_bytes` plus room for the quantized
/// path's per-slot padding, so every call within `max_bytes` fits whatever the codec
/// ([`quantized_fits`], tested).
pub(crate) fn stage_bytes(max_bytes: usize) -> usize {
    abi::round_max_bytes(max_bytes + QUANT_SLACK)
}

/// "v1, v2" for the formats of a `kernels::CODEC_FORMATS` mask.
fn format_list(mask: u32) -> String {
    let list: Vec<String> = (0..32)
        .filter(|v| mask & (1 << v) != 0)
        .map(|v| format!("v{v}"))
        .collect();
    if list.is_empty() {
        "no format".into()
    } else {
        list.join(", ")
    }
}

/// This build's release, told to the other processes of a group when the versions differ.
const RELEASE: &str = env!("CARGO_PKG_VERSION");

/// Fields of the first message of `Group::new_rank`: device id, compute units, max_bytes,
/// timeout, layout version, codec formats, release.
const SHAPE_FIELDS: usize = 7;

const QUANT_SLACK: usize = 64 * MAX_WORLD + 256;

/// Whether the quantized kernel's slots for `n` elements fit a staging buffer:
/// `world * encoded_len(shard)` bytes (kernels-common quantized.h).
pub(crate) fn quantized_fits(codec: Codec, n: usize, world: usize, stage: usize) -> bool {
    let shard = allreduce_core::layout::shard_len(n, world, allreduce_core::layout::QUANT_GRANULE);
    world * codec.encoded_len(shard) <= stage
}

impl<R: GpuRuntime> Kernels<R> {
    fn load(dev: &R::Device) -> Result<Self> {
        let module = R::load_module(dev)?;
        let per_dtype = |kernel: fn(DType) -> Kernel| {
            kernels::functions::<R, 3>(&module, DType::ALL.map(kernel))
        };
        // [f16, bf16][codec], as `Kernels::quantized` is indexed.
        let per_codec = |kernel: fn(DType, Codec) -> Kernel| -> Result<_> {
            let codecs = |d| {
                kernels::functions::<R, { Codec::ALL.len() }>(
                    &module,
                    Codec::ALL.map(|c| kernel(d, c)),
                )
            };
            Ok([codecs(DType::F16)?, codecs(DType::BF16)?])
        };
        Ok(Kernels {
            oneshot: per_dtype(Kernel::OneShot)?,
            twoshot: per_dtype(Kernel::TwoShot)?,
            oneshot_registered: per_dtype(Kernel::OneShotRegistered)?,
            twoshot_registered: per_dtype(Kernel::TwoShotRegistered)?,
            quantized: match R::quantized_unavailable() {
                Some(_) => None,
                None => Some(per_codec(Kernel::Quantized)?),
            },
            // Built from the same source as the quantized kernels, so present with them.
            hierarchical: match R::quantized_unavailable() {
                Some(_) => None,
                None => Some(per_codec(Kernel::Hierarchical)?),
            },
            _module: module,
        })
    }
}

/// Everything the ranks of a group share. Freed when the last rank is dropped.
struct Group<R: GpuRuntime> {
    world: usize,
    /// Index into `devices` of each rank.
    rank_device: Vec<usize>,
    topology: allreduce_core::Topology,
    /// The ranks this process drives: all of them in an in-process group, one in a group of
    /// one process per rank ([`GpuBackend::create_rank`]).
    local: Vec<usize>,
    /// Peer workspaces mapped from other processes (IPC), unmapped on drop.
    imported: Vec<u64>,
    devices: Vec<R::Device>,
    kernels: Vec<Option<Kernels<R>>>,
    workspaces: Vec<Option<R::Memory>>,
    controls: Vec<Option<R::HostMapped>>,
    peers: [u64; MAX_WORLD],
    /// The codec formats each rank's kernels encode (`kernels::CODEC_FORMATS` of its build).
    formats: [u32; MAX_WORLD],
    /// One vendor communicator per local rank (in `local`'s order), or why there is none.
    vendor: std::result::Result<Vec<R::Vendor>, String>,
    /// The local ranks' symmetric windows of `max_bytes` (`Strategy::VendorSymmetric`), or
    /// why there are none.
    windows: std::result::Result<R::VendorWindows, String>,
    grid: u32,
    max_bytes: usize,
    /// Size of each staging buffer, the stride the kernels see as `Args::max_bytes`.
    stage_bytes: usize,
    timeout: Duration,
    cast_bf16_to_f16: bool,
    /// Registered calls smaller than this take the staged path
    /// ([`GroupConfig::registered_min_bytes`]).
    registered_min_bytes: usize,
    /// Memory every rank registered ([`BackendComm::register_group`]); shared with the
    /// allocations that deregister themselves on drop.
    registry: Arc<Mutex<Registry>>,
    /// Each local rank's graph slot table ([`abi::GRAPH_SLOTS`] rows, zeroed), for calls
    /// captured on unregistered inputs and registered after capture.
    slot_tables: Vec<Option<R::Memory>>,
    slots: Mutex<GraphSlots>,
    /// Peers' allocations mapped for registrations in a group of processes.
    mapped: exchange::Mapped,
    /// Why a caller aborted the group ([`BackendComm::abort`]), if one did.
    caller_abort: Mutex<Option<String>>,
    /// The push one-shot's kernels and receive buffers (`Strategy::PushOneShot`), or why
    /// there are none.
    push: std::result::Result<Push<R>, String>,
    /// Per rank, why it last refused its own arguments (plain or fused): the kernels carry
    /// only that a rank refused, so peers of this process read the reason here when they
    /// report `PeerRejected`. A peer in another process reports a generic reason.
    refusals: Mutex<Vec<Option<String>>>,
    /// Per rank, the fused workspace its last fused call ran on: this rank's Lamport buffers'
    /// address and the size of one of the three (0, 0: none). Where a fused poll timed out,
    /// the call tags there say which ranks never arrived.
    last_fused: Vec<[AtomicU64; 2]>,
}

/// The push one-shot's part of a group (crate::push): in-process groups only, whose ranks
/// address every peer's receive buffers directly.
struct Push<R: GpuRuntime> {
    /// Per device, as `Group::kernels`.
    kernels: Vec<PushKernels<R>>,
    /// Per rank.
    memory: Vec<Option<PushMemory<R>>>,
    /// Launch with programmatic dependent launch ([`push::PDL_ENV`]).
    pdl: bool,
}

/// The graph slots every local rank took, in capture order. Ranks capture the same calls in
/// the same order, so slot k of every rank is one call; `register_graph_buffers` checks that.
#[derive(Default)]
struct GraphSlots {
    /// Per rank: slots taken so far (the next one's index).
    next: Vec<usize>,
    /// Per rank: slots taken since the last registration, waiting for their rows.
    pending: Vec<Vec<PendingSlot>>,
}

#[derive(Clone, Copy, Debug)]
struct PendingSlot {
    slot: usize,
    addr: usize,
    bytes: usize,
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
        // How the ranks reach each other: probed, or forced by the caller. Peer access is
        // enabled wherever there is some; without it the custom kernels are unavailable (they
        // read and write peers' memory) and only the vendor library runs: the group still
        // builds.
        let mut device_links =
            vec![vec![allreduce_core::Link::SameDevice; devices.len()]; devices.len()];
        for (i, a) in devices.iter().enumerate() {
            for (j, b) in devices.iter().enumerate() {
                if i != j {
                    device_links[i][j] = R::link(a, b)?;
                    if device_links[i][j].has_peer_access() {
                        R::enable_peer(a, b)?;
                    }
                }
            }
        }
        let topology = match &config.topology {
            Some(t) => t.clone(),
            None => allreduce_core::Topology {
                links: rank_device
                    .iter()
                    .map(|&a| rank_device.iter().map(|&b| device_links[a][b]).collect())
                    .collect(),
                numa: rank_device
                    .iter()
                    .map(|&d| R::numa_node(&devices[d]))
                    .collect(),
                forced: false,
            },
        };
        let grid = grid_for(
            R::BLOCKS_PER_RANK,
            &devices.iter().map(R::compute_units).collect::<Vec<_>>(),
            &rank_device,
        );

        let mut group = Group::assemble(
            ordinals.len(),
            devices,
            rank_device,
            (0..ordinals.len()).collect(),
            topology,
            grid,
            config,
        )?;
        tracing::debug!(
            backend = R::NAME,
            ranks = ordinals.len(),
            devices = group.devices.len(),
            grid,
            max_bytes = group.max_bytes,
            "gpu group"
        );
        group.vendor = match R::vendor_unavailable(ordinals) {
            Some(why) => Err(why),
            None => {
                let per_rank: Vec<&R::Device> = (group.rank_device.iter())
                    .map(|&d| &group.devices[d])
                    .collect();
                R::vendor_init(&per_rank)
                    .map_err(|e| format!("vendor library initialisation failed: {e}"))
            }
        };
        if let Err(why) = &group.vendor {
            tracing::debug!(reason = %why, "no vendor library for this group");
        }
        group.windows = group.make_windows(|_| Ok(true));
        group.push = group.make_push();
        if let Err(why) = &group.push {
            tracing::debug!(reason = %why, "no push one-shot for this group");
        }
        group.warm_up()?;
        Ok(group)
    }

    /// The push one-shot's kernels on every device and receive buffers for every rank (an
    /// in-process group: all ranks are local), or why not: a runtime without the fused
    /// module, or a failed allocation, leaves the strategy unavailable, not the group.
    fn make_push(&self) -> std::result::Result<Push<R>, String> {
        let why = |e: Error| format!("the push one-shot's kernels or buffers: {e}");
        let mut kernels = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            R::bind(d).map_err(why)?;
            kernels.push(PushKernels::load(d, self.world).map_err(why)?);
        }
        let mut memory = Vec::with_capacity(self.world);
        for &d in &self.rank_device {
            let dev = &self.devices[d];
            R::bind(dev).map_err(why)?;
            memory.push(Some(PushMemory::alloc(dev, self.world).map_err(why)?));
        }
        let pdl = push::pdl_setting().map_err(why)? && self.devices.iter().all(|d| R::has_pdl(d));
        Ok(Push {
            kernels,
            memory,
            pdl,
        })
    }

    /// The push one-shot's launch parameters for `rank`, fixed for the life of the group.
    fn push_launch(&self, rank: usize, push: &Push<R>) -> push::Launch {
        let mut buffers = [0u64; MAX_WORLD];
        for (b, m) in buffers.iter_mut().zip(&push.memory) {
            *b = m.as_ref().map_or(0, |m| R::memory_addr(&m.buffers));
        }
        push::Launch {
            rank,
            world: self.world,
            buffers,
            workspaces: self.peers,
            state: push.memory[rank]
                .as_ref()
                .map_or(0, |m| R::memory_addr(&m.state)),
            control: R::host_mapped_ptrs(self.control(rank)).1,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
        }
    }

    /// This process's rank of a group with one process per rank. Three exchanges over the
    /// bootstrap: (device id, compute units, max_bytes, timeout, layout version, codec formats,
    /// release) so every rank derives the same grid and checks the others' limits and
    /// builds; workspace IPC handles, which each rank maps; the vendor
    /// library's id from rank 0. Then every rank warms its kernels and a last exchange makes
    /// sure no rank launches before every peer has mapped its workspace.
    fn new_rank(
        rank: usize,
        ordinal: u32,
        config: &GroupConfig,
        boot: &mut dyn Bootstrap,
    ) -> Result<Self> {
        let world = config.world_size;
        R::prepare_group(&[ordinal])?;
        let dev = R::open(ordinal)?;
        let max_bytes = abi::round_max_bytes(config.max_bytes);
        let units = R::compute_units(&dev);
        let id = R::device_id(&dev);
        let shape = boot.all_gather(&pack(&[
            &id,
            &units.to_le_bytes(),
            &(max_bytes as u64).to_le_bytes(),
            &config
                .timeout
                .as_nanos()
                .min(u64::MAX as u128)
                .to_le_bytes()[..8],
            &abi::LAYOUT_VERSION.to_le_bytes(),
            &kernels::CODEC_FORMATS.to_le_bytes(),
            RELEASE.as_bytes(),
        ]))?;
        let mut ids: Vec<&[u8]> = Vec::new();
        let mut unit_list = Vec::new();
        let mut rank_device = Vec::with_capacity(world);
        let mut formats = [0u32; MAX_WORLD];
        for (r, msg) in shape.iter().enumerate() {
            let f = unpack(msg, SHAPE_FIELDS, r)?;
            let word = |i: usize| u32::from_le_bytes(f[i].try_into().unwrap_or([0; 4]));
            if word(4) != abi::LAYOUT_VERSION {
                // Their kernels would read our workspace with another layout.
                return Err(Error::RankMismatch {
                    what: "workspace layout",
                    call: 0,
                    detail: format!(
                        "rank {r} runs allreduce {} (layout version {}), rank {rank} runs {RELEASE} \
                         (layout version {}): every process of a group needs the same release",
                        String::from_utf8_lossy(f[6]),
                        word(4),
                        abi::LAYOUT_VERSION
                    ),
                });
            }
            formats[r] = word(5);
            if f[2] != (max_bytes as u64).to_le_bytes() {
                return Err(Error::RankMismatch {
                    what: "max_bytes",
                    call: 0,
                    detail: format!(
                        "rank {rank} has {max_bytes}, rank {r} has {}",
                        u64::from_le_bytes(f[2].try_into().unwrap_or([0; 8]))
                    ),
                });
            }
            let d = match ids.iter().position(|x| *x == f[0]) {
                Some(d) => d,
                None => {
                    ids.push(f[0]);
                    unit_list.push(u32::from_le_bytes(f[1].try_into().unwrap_or([0; 4])));
                    ids.len() - 1
                }
            };
            rank_device.push(d);
        }
        let grid = grid_for(R::BLOCKS_PER_RANK, &unit_list, &rank_device);
        let shares_gpu = ids.len() < world;
        let rank_device_all = rank_device;

        // Across processes the links are not probed (a process sees only its own GPU): equal
        // device ids share a GPU, the others are taken to have peer access, which the IPC
        // mappings below prove.
        let topology = match &config.topology {
            Some(t) => t.clone(),
            None => allreduce_core::Topology {
                links: (0..world)
                    .map(|a| {
                        (0..world)
                            .map(|b| {
                                if rank_device_all[a] == rank_device_all[b] {
                                    allreduce_core::Link::SameDevice
                                } else {
                                    allreduce_core::Link::Pcie
                                }
                            })
                            .collect()
                    })
                    .collect(),
                numa: vec![None; world],
                forced: false,
            },
        };
        let mut group = Group::assemble(
            world,
            vec![dev],
            vec![0; world],
            vec![rank],
            topology,
            grid,
            config,
        )?;
        group.formats = formats;
        let dev = &group.devices[0];
        let handle = R::export_memory(group.workspaces[rank].as_ref().expect("ours"))?;
        let handles = boot.all_gather(&handle)?;
        let mut failed = None;
        for (r, h) in handles.iter().enumerate() {
            if r == rank {
                continue;
            }
            // SAFETY: a handle of rank r's live workspace, exported above by that rank.
            match unsafe { R::import_memory(dev, h) } {
                Ok(addr) => {
                    group.peers[r] = addr;
                    group.imported.push(addr);
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }

        // The vendor library: rank 0 makes the id; an empty message means "none", so every
        // rank takes the same decision.
        let unavailable = if shares_gpu {
            Some(format!(
                "{} ranks share a GPU: the vendor library needs one GPU per rank",
                world - ids.len() + 1
            ))
        } else {
            R::vendor_unavailable(&[ordinal])
        };
        // Every rank must be able to join before any does: a rank that cannot (no library)
        // would leave the others inside the vendor's collective init for good.
        let able = boot.all_gather(&[u8::from(unavailable.is_none())])?;
        let unable = able.iter().position(|m| m.first() != Some(&1));
        let vendor_id = match (rank, unable) {
            (0, None) => R::vendor_unique_id().unwrap_or_default(),
            _ => Vec::new(),
        };
        let vendor_id = boot.broadcast(0, &vendor_id)?;
        group.vendor = if vendor_id.is_empty() {
            Err(unavailable.unwrap_or_else(|| match unable {
                Some(r) => format!("rank {r} cannot load the vendor library"),
                None => "rank 0 could not create a vendor group id".into(),
            }))
        } else {
            let dev = &group.devices[0];
            R::bind(dev)?;
            R::vendor_init_rank(dev, &vendor_id, rank, world)
                .map(|c| vec![c])
                .map_err(|e| format!("vendor library initialisation failed: {e}"))
        };
        // The windows' registration is collective: every rank allocates first and says
        // whether it could, and only a group where all could enters it.
        group.windows = group.make_windows(|ready| {
            let all = boot.all_gather(&[u8::from(ready)])?;
            Ok(all.iter().all(|m| m.first() == Some(&1)))
        });

        let warm = match failed {
            Some(e) => Err(e),
            None => group.warm_up(),
        };
        // Everyone has mapped every workspace (or failed: then everyone learns it here).
        let ok = boot.all_gather(&[u8::from(warm.is_ok())])?;
        warm?;
        if let Some(r) = ok.iter().position(|m| m.first() != Some(&1)) {
            return Err(Error::PeerRejected {
                rank: r,
                call: 0,
                reason: "it could not join the group (see its own error)".into(),
            });
        }
        tracing::debug!(
            backend = R::NAME,
            rank,
            world,
            grid,
            shares_gpu,
            "gpu rank ready"
        );
        Ok(group)
    }

    /// Whether this build's kernels and every rank's encode `codec`'s format: a process of
    /// an older release may lack a newer format, and would misread its bytes.
    fn codec_spoken(&self, codec: Codec) -> std::result::Result<(), String> {
        let bit = 1u32 << codec.format();
        if kernels::CODEC_FORMATS & bit == 0 {
            return Err(format!(
                "{codec} is codec format v{}, which this build's kernels do not encode",
                codec.format()
            ));
        }
        match (0..self.world).find(|&r| self.formats[r] & bit == 0) {
            Some(r) => Err(format!(
                "{codec} is codec format v{}, which rank {r}'s allreduce release does not \
                 encode (its kernels speak {}): every process of the group needs a release \
                 with it",
                codec.format(),
                format_list(self.formats[r])
            )),
            None => Ok(()),
        }
    }

    /// The construction both constructors share once they know where every rank runs: the
    /// kernels loaded on each device this process drives, a workspace and a Control for each
    /// of its ranks (their addresses in `peers`), and the group's fixed launch parameters.
    /// Peers of other processes, the vendor library and the warm-up are the caller's. A
    /// failure part way frees what was made (Drop copes with a partial group).
    fn assemble(
        world: usize,
        devices: Vec<R::Device>,
        rank_device: Vec<usize>,
        local: Vec<usize>,
        topology: allreduce_core::Topology,
        grid: u32,
        config: &GroupConfig,
    ) -> Result<Self> {
        let max_bytes = abi::round_max_bytes(config.max_bytes);
        let stage = stage_bytes(max_bytes);
        let registered_min_bytes = config.resolved_registered_min_bytes()?;
        let mut group = Group {
            world,
            rank_device,
            topology,
            local,
            imported: Vec::new(),
            devices,
            kernels: Vec::new(),
            workspaces: (0..world).map(|_| None).collect(),
            controls: (0..world).map(|_| None).collect(),
            peers: [0; MAX_WORLD],
            formats: [kernels::CODEC_FORMATS; MAX_WORLD],
            vendor: Err("the vendor library is not initialised yet".into()),
            windows: Err("the vendor library is not initialised yet".into()),
            caller_abort: Mutex::new(None),
            refusals: Mutex::new(vec![None; world]),
            last_fused: (0..world).map(|_| Default::default()).collect(),
            grid,
            max_bytes,
            stage_bytes: stage,
            timeout: config.timeout,
            cast_bf16_to_f16: config.cast_bf16_to_f16,
            registered_min_bytes,
            registry: Arc::new(Mutex::new(Registry::new())),
            slot_tables: (0..world).map(|_| None).collect(),
            slots: Mutex::new(GraphSlots {
                next: vec![0; world],
                pending: vec![Vec::new(); world],
            }),
            mapped: Default::default(),
            push: Err("the push one-shot runs in in-process groups only".into()),
        };
        for d in &group.devices {
            R::bind(d)?;
            group.kernels.push(Some(Kernels::load(d)?));
        }
        for &rank in &group.local {
            let dev = &group.devices[group.rank_device[rank]];
            R::bind(dev)?;
            let ws = R::alloc_workspace(dev, abi::workspace_bytes(stage))?;
            group.peers[rank] = R::memory_addr(&ws);
            group.workspaces[rank] = Some(ws);
            group.controls[rank] = Some(R::alloc_host_mapped(dev, size_of::<Control>())?);
            group.slot_tables[rank] = Some(R::alloc_workspace(
                dev,
                abi::GRAPH_SLOTS * abi::GRAPH_SLOT_BYTES,
            )?);
        }
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
            max_bytes: self.stage_bytes as u64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            rank: rank as u32,
            world: self.world as u32,
            desc: desc.0,
        }
    }

    /// Where `call`'s input lies in memory every rank registered, when the call may read the
    /// peers' inputs in place there: out of place, exact, one-shot or two-shot. Every other
    /// call takes the staged path.
    fn registered_input(&self, rank: usize, call: &Call) -> Option<RegisteredInput> {
        if !self.reads_in_place(call) {
            return None;
        }
        let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.find(rank, call.input.addr, call.input.bytes())
    }

    /// Whether `call` may read the peers' inputs where they are, given memory to read:
    /// out of place, exact, one-shot or two-shot, and not below the registered threshold.
    fn reads_in_place(&self, call: &Call) -> bool {
        allreduce_core::registration::reads_in_place(call, self.registered_min_bytes)
    }

    /// The next graph slot of `rank` for `call`, recorded for `register_graph_buffers`; `None`
    /// once every slot is taken (the call is then staged).
    fn take_slot(&self, rank: usize, call: &Call) -> Option<usize> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = s.next[rank];
        if slot >= abi::GRAPH_SLOTS {
            tracing::warn!(
                rank,
                slots = abi::GRAPH_SLOTS,
                "every graph slot is taken: this captured call stages its input"
            );
            return None;
        }
        s.next[rank] += 1;
        s.pending[rank].push(PendingSlot {
            slot,
            addr: call.input.addr,
            bytes: call.input.bytes(),
        });
        Some(slot)
    }

    /// Device address of `rank`'s row for `slot`.
    fn slot_row(&self, rank: usize, slot: usize) -> u64 {
        let table = self.slot_tables[rank].as_ref().expect("a local rank's");
        R::memory_addr(table) + (slot * abi::GRAPH_SLOT_BYTES) as u64
    }

    /// Whether every rank's pending slots match rank 0's: the same slots, of the same lengths.
    fn same_slots(pending: &[Vec<PendingSlot>]) -> Result<()> {
        let first = &pending[0];
        for (r, mine) in pending.iter().enumerate() {
            if mine.len() != first.len() {
                return Err(Error::RankMismatch {
                    what: "graph buffers",
                    call: 0,
                    detail: format!(
                        "rank 0 captured {} calls to register, rank {r} {}",
                        first.len(),
                        mine.len()
                    ),
                });
            }
            for (a, b) in first.iter().zip(mine) {
                if a.slot != b.slot || a.bytes != b.bytes {
                    return Err(Error::RankMismatch {
                        what: "graph buffers",
                        call: 0,
                        detail: format!(
                            "rank 0 captured slot {} of {} bytes where rank {r} captured slot \
                             {} of {} bytes",
                            a.slot, a.bytes, b.slot, b.bytes
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Fill the rows of the slots every local rank of an in-process group took since the last
    /// registration: row k of every rank holds every rank's input of call k. The ranks must
    /// have taken the same slots for inputs of the same lengths; if not, nothing is filled, the
    /// pending slots are dropped (their graphs' calls keep skipping with an error) and every
    /// rank's next slot is the same again.
    fn register_graph_slots(&self) -> Result<usize> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let pending = std::mem::replace(&mut s.pending, vec![Vec::new(); self.world]);
        let agreed = Self::same_slots(&pending);
        if agreed.is_err() {
            let next = s.next.iter().copied().max().unwrap_or(0);
            s.next.fill(next);
        }
        drop(s);
        agreed?;
        let first = &pending[0];
        let Some(lo) = first.first().map(|p| p.slot) else {
            return Ok(0);
        };
        // Slots are taken one after another, so the pending rows are one range of the table.
        debug_assert!(first.iter().enumerate().all(|(i, p)| p.slot == lo + i));
        let rows = self.slot_rows(first.len(), |k, i| pending[k][i].addr as u64);
        for &rank in &self.local {
            self.write_rows(rank, lo, &rows)?;
        }
        Ok(first.len())
    }

    /// `count` slot rows: word `k` of row `i` is `addr(k, i)`, rank k's input of the i-th call.
    fn slot_rows(&self, count: usize, addr: impl Fn(usize, usize) -> u64) -> Vec<u8> {
        let mut rows = vec![0u8; count * abi::GRAPH_SLOT_BYTES];
        for (i, row) in rows.chunks_exact_mut(abi::GRAPH_SLOT_BYTES).enumerate() {
            for (k, word) in row.chunks_exact_mut(8).take(self.world).enumerate() {
                word.copy_from_slice(&addr(k, i).to_le_bytes());
            }
        }
        rows
    }

    /// Write `rows` into `rank`'s slot table from slot `lo` on, complete on return.
    fn write_rows(&self, rank: usize, lo: usize, rows: &[u8]) -> Result<()> {
        let dev = &self.devices[self.rank_device[rank]];
        R::bind(dev)?;
        let table = self.slot_tables[rank].as_ref().expect("a local rank's");
        let stream = R::create_stream(dev)?;
        // SAFETY: the rows are of slots taken (< GRAPH_SLOTS), inside the table, which lives
        // with the group; waited for below. No kernel reads these rows yet: a replay before
        // this returns read zeros and skipped.
        unsafe { R::upload(table, lo * abi::GRAPH_SLOT_BYTES, rows, &stream)? };
        R::stream_synchronize(&stream)
    }

    /// Run every kernel once per rank, alone (world 1, nothing to move), before any rank waits
    /// on another. A device's first launches may do lazy work that waits for the whole device
    /// (loading code, growing the scratch reservation); done while a peer's kernel spins
    /// waiting for this rank's launch, that wait never ends. Every rank advances its epochs
    /// and call parities by the same amount, so they stay in step.
    /// The symmetric windows of this process's ranks: allocated, agreed on (`agree` is told
    /// whether this process could allocate and answers whether every rank could), then
    /// registered. Why not, where any step says no; the group builds either way.
    fn make_windows(
        &self,
        agree: impl FnOnce(bool) -> Result<bool>,
    ) -> std::result::Result<R::VendorWindows, String> {
        let comms = self.vendor.as_ref().map_err(Clone::clone)?;
        let devices: Vec<&R::Device> = (self.local.iter())
            .map(|&r| &self.devices[self.rank_device[r]])
            .collect();
        let mine = if std::env::var_os("ALLREDUCE_DISABLE_VENDOR_SYMMETRIC").is_some() {
            Err("disabled by ALLREDUCE_DISABLE_VENDOR_SYMMETRIC".to_string())
        } else if let Some(why) = R::vendor_symmetric_unavailable() {
            Err(why)
        } else {
            R::vendor_windows_alloc(&devices, self.max_bytes)
                .map_err(|e| format!("the symmetric windows could not be allocated: {e}"))
        };
        match agree(mine.is_ok()) {
            Err(e) => {
                return Err(format!(
                    "the ranks could not agree on symmetric windows: {e}"
                ))
            }
            Ok(false) if mine.is_ok() => {
                return Err("another rank cannot make symmetric windows (see its log)".into())
            }
            _ => {}
        }
        let mut windows = mine?;
        R::vendor_windows_register(&mut windows, comms, &devices)
            .map_err(|e| format!("symmetric window registration failed: {e}"))?;
        tracing::debug!(bytes = self.max_bytes, "symmetric windows registered");
        Ok(windows)
    }

    fn warm_up(&self) -> Result<()> {
        for &rank in &self.local {
            let d = self.rank_device[rank];
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
            let quantized = k.quantized.iter().flatten().flatten();
            let hierarchical = k.hierarchical.iter().flatten().flatten();
            for &f in k
                .oneshot
                .iter()
                .chain(&k.twoshot)
                .chain(quantized)
                .chain(hierarchical)
            {
                // SAFETY: n = 0 and world = 1: the kernel touches only this rank's workspace.
                unsafe { R::launch(f, self.grid, THREADS, Stream::NULL, &args)? };
            }
            let registered = RegisteredArgs {
                a: args,
                inputs: [0; MAX_WORLD],
                desc2: 0,
                slot: 0,
            };
            for &f in k.oneshot_registered.iter().chain(&k.twoshot_registered) {
                // SAFETY: as above; no input is read for n = 0.
                unsafe { R::launch(f, self.grid, THREADS, Stream::NULL, &registered)? };
            }
            if let Ok(p) = &self.push {
                // World 1, no data: each launch touches only this rank's buffers and state,
                // and every rank's call count advances by the same three.
                let mut l = self.push_launch(rank, p);
                l.buffers = [0; MAX_WORLD];
                l.buffers[0] = self.push_launch(rank, p).buffers[rank];
                l.workspaces = [0; MAX_WORLD];
                l.workspaces[0] = self.peers[rank];
                l.rank = 0;
                l.world = 1;
                for (i, &f) in p.kernels[d].functions.iter().enumerate() {
                    let args = push::args(&l, DType::ALL[i], 0, 0, 0, false);
                    // SAFETY: no elements and world 1: only this rank's memory is touched.
                    unsafe { push::launch::<R>(f, self.grid, Stream::NULL, &args, false)? };
                }
            }
        }
        for d in &self.devices {
            R::bind(d)?;
            R::synchronize_device(d)?;
        }
        Ok(())
    }

    /// Elements per piece of a call larger than the workspace: `max_bytes` worth, rounded down
    /// to whole 32-element codec blocks (also 16-byte aligned for every dtype).
    fn piece_len(&self, dtype: DType) -> usize {
        allreduce_core::layout::piece_len(self.max_bytes, dtype)
    }

    fn control(&self, rank: usize) -> &R::HostMapped {
        self.controls[rank]
            .as_ref()
            .expect("alive while the group is")
    }

    /// Why the group is out of step for good: a kernel of a rank of this process timed out, or
    /// left a call because a peer (perhaps in another process) did.
    /// Read before every call, so it borrows the group rather than cloning a handle.
    fn aborted(&self) -> Option<String> {
        let by_caller = self.caller_abort.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reason) = by_caller.as_ref() {
            return Some(reason.clone());
        }
        drop(by_caller);
        // A timeout names the rank that waited: the better report when a local rank has one.
        let find = |error: u32| {
            self.local
                .iter()
                .map(|&r| Self::read_control(self.control(r)))
                .find(|c| c.error == error)
        };
        find(abi::ERROR_TIMEOUT)
            .or_else(|| find(abi::ERROR_ABORTED))
            .map(|c| aborted_reason(&c))
    }

    /// `bytes` of device memory at `addr` (on `rank`'s device), read through a stream of
    /// its own: the caller's may be blocked. For reports after a failure, not for calls.
    fn read_device(&self, rank: usize, addr: u64, bytes: usize) -> Result<Vec<u8>> {
        let dev = &self.devices[self.rank_device[rank]];
        R::bind(dev)?;
        let stream = R::create_stream(dev)?;
        // SAFETY: the stream outlives the copy (synchronised by the download).
        let mem = unsafe { R::alloc(&stream, bytes)? };
        let mut out = vec![0u8; bytes];
        // SAFETY: `addr` holds `bytes` readable device bytes (the caller's promise), `mem`
        // as many.
        unsafe {
            R::copy_async(R::memory_addr(&mem), addr, bytes, R::stream_handle(&stream))?;
            R::download(&mem, 0, &mut out, &stream)?;
        }
        R::stream_synchronize(&stream)?;
        Ok(out)
    }

    /// The ranks whose arrival `rank`'s kernel waited for in vain, by what it recorded in
    /// `c` (a timeout): the peers whose barrier flag in our workspace is behind the epoch
    /// waited for, or, for a fused poll, whose call tag of that call is missing from our
    /// Lamport buffer. Empty where they cannot be read.
    fn missing_ranks(&self, rank: usize, c: &Control) -> Vec<usize> {
        let world = self.world;
        let word = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4"));
        let others = (0..world).filter(|&p| p != rank);
        if c.theirs == abi::TIMEOUT_IN_FUSED {
            let [base, comm] = self.last_fused[rank]
                .each_ref()
                .map(|a| a.load(Ordering::Relaxed));
            if base == 0 {
                return Vec::new();
            }
            let buffer = u64::from(c.epoch % 3);
            let tags = base + (buffer + 1) * comm - allreduce_core::fused::TAG_BYTES as u64;
            let Ok(b) = self.read_device(rank, tags, 16 * world) else {
                return Vec::new();
            };
            // A tag holds the call count + 1 of the call its rank sent it in.
            let want = c.epoch.wrapping_add(1);
            return others.filter(|&p| word(&b, 16 * p) != want).collect();
        }
        let flags =
            self.peers[rank] + (abi::FLAGS_OFFSET + c.block as usize * MAX_WORLD * 4) as u64;
        let Ok(b) = self.read_device(rank, flags, 4 * world) else {
            return Vec::new();
        };
        // Epochs only grow (and wrap): a peer arrived once its flag reached the one awaited.
        others
            .filter(|&p| (word(&b, 4 * p).wrapping_sub(c.epoch) as i32) < 0)
            .collect()
    }

    /// The peers whose barrier flag for block `block` in `rank`'s workspace is behind the
    /// most advanced peer's: after an abort (the epoch waited for is not recorded then), the
    /// ranks that never reached the barrier the others were waiting at. A dead or stuck rank's
    /// flags stop where it stopped, while every live peer stores its flag before it waits.
    /// Empty where the flags cannot be read, or where every peer is level (an abort between
    /// barriers names nobody rather than the wrong rank).
    fn ranks_behind(&self, rank: usize, block: u32) -> Vec<usize> {
        let world = self.world;
        let flags = self.peers[rank] + (abi::FLAGS_OFFSET + block as usize * MAX_WORLD * 4) as u64;
        let Ok(b) = self.read_device(rank, flags, 4 * world) else {
            return Vec::new();
        };
        let word = |p: usize| u32::from_ne_bytes(b[4 * p..4 * p + 4].try_into().expect("4"));
        let others: Vec<usize> = (0..world).filter(|&p| p != rank).collect();
        // Epochs only grow (and wrap): compare by signed difference.
        let Some(&lead) = others
            .iter()
            .max_by(|&&a, &&b| (word(a).wrapping_sub(word(b)) as i32).cmp(&0))
        else {
            return Vec::new();
        };
        let top = word(lead);
        others
            .into_iter()
            .filter(|&p| (word(p).wrapping_sub(top) as i32) < 0)
            .collect()
    }

    /// Why a caller aborted the group ([`GpuComm::abort`]), if one did.
    fn caller_abort_reason(&self) -> Option<String> {
        self.caller_abort
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Remember why `rank` refused its arguments, for the peers' `PeerRejected`.
    fn record_refusal(&self, rank: usize, reason: &Error) {
        let mut r = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        r[rank] = Some(reason.to_string());
    }

    /// Whether `rank`'s last call on the fused protocol was a push one-shot (its call tags
    /// are in the push receive buffers, not a fused workspace).
    fn last_call_was_push(&self, rank: usize) -> bool {
        let base = self.last_fused[rank][0].load(Ordering::Relaxed);
        match &self.push {
            Ok(p) => p.memory[rank]
                .as_ref()
                .is_some_and(|m| base != 0 && R::memory_addr(&m.buffers) == base),
            Err(_) => false,
        }
    }

    /// Why `rank` refused its arguments, as [`Error::PeerRejected`] carries it.
    fn refusal(&self, rank: usize) -> String {
        let r = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        r.get(rank)
            .cloned()
            .flatten()
            .unwrap_or_else(|| "its arguments were refused (see that rank's own error)".into())
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
        // The vendor library first: its communicators may hold references into the devices;
        // the windows before the communicators they are registered with.
        self.windows = Err("dropped".into());
        if let Ok(comms) = &mut self.vendor {
            comms.clear();
        }
        // Unmap peers' workspaces before ours go (a peer may still map ours; it must drop its
        // communicator first, as with ncclCommDestroy).
        let mapped = self.mapped.get_mut().unwrap_or_else(|e| e.into_inner());
        for &addr in self.imported.iter().chain(mapped.values()) {
            // SAFETY: mapped by import_memory on our (single) device; no kernel of ours runs
            // any more (dropping a communicator with calls in flight is the caller's error).
            unsafe { R::close_import(&self.devices[0], addr) };
        }
        // Free each allocation with its own device current.
        if let Ok(p) = &mut self.push {
            for (rank, m) in p.memory.iter_mut().enumerate() {
                let _ = R::bind(&self.devices[self.rank_device[rank]]);
                m.take();
            }
            for (d, k) in std::mem::take(&mut p.kernels).into_iter().enumerate() {
                let _ = R::bind(&self.devices[d]);
                drop(k);
            }
        }
        for &rank in &self.local {
            let d = self.rank_device[rank];
            let _ = R::bind(&self.devices[d]);
            self.workspaces[rank].take();
            self.controls[rank].take();
            self.slot_tables[rank].take();
        }
        for (d, k) in self.kernels.iter_mut().enumerate() {
            let _ = R::bind(&self.devices[d]);
            k.take();
        }
    }
}

/// What the fused all-reduce (`gpu::fused`, over any runtime) needs of a group: its shape,
/// every rank's workspace (whose header holds the abort word) and Control, and the devices.
/// Keeps the group alive. In-process groups only: every rank's Control and device are here.
pub struct GroupView<R: GpuRuntime>(Arc<Group<R>>);

impl<R: GpuRuntime> GroupView<R> {
    pub fn world(&self) -> usize {
        self.0.world
    }
    /// Blocks per launch, the same on every rank (all ranks' grids must be co-resident).
    pub fn grid(&self) -> u32 {
        self.0.grid
    }
    pub fn timeout_ns(&self) -> u64 {
        self.0.timeout.as_nanos().min(u64::MAX as u128) as u64
    }
    /// Every rank's workspace base, rank order.
    pub fn workspaces(&self) -> [u64; MAX_WORLD] {
        self.0.peers
    }
    /// Whether this process drives every rank (not a group of one process per rank).
    pub fn in_process(&self) -> bool {
        self.0.local.len() == self.0.world
    }
    /// The device address of `rank`'s Control (a rank of this process).
    pub fn control(&self, rank: usize) -> u64 {
        R::host_mapped_ptrs(self.0.control(rank)).1
    }
    /// `rank`'s device (a rank of this process).
    pub fn device(&self, rank: usize) -> &R::Device {
        &self.0.devices[self.0.rank_device[rank]]
    }
    /// Why the group is out of step for good (a kernel timed out), if it is.
    pub fn aborted(&self) -> Option<String> {
        self.0.aborted()
    }
    /// Remember why `rank` refused its arguments, for the peers' `PeerRejected`.
    pub fn record_refusal(&self, rank: usize, reason: &Error) {
        self.0.record_refusal(rank, reason)
    }
    /// `rank`'s fused calls now run on the workspace whose Lamport buffers (for this rank)
    /// start at `lamport`, `comm_bytes` each: where a fused timeout's report looks.
    pub fn note_fused(&self, rank: usize, lamport: u64, comm_bytes: u64) {
        let [base, comm] = &self.0.last_fused[rank];
        base.store(lamport, Ordering::Relaxed);
        comm.store(comm_bytes, Ordering::Relaxed);
    }
    /// The workspace at `lamport` is gone: forget it wherever a rank last ran on it.
    pub fn forget_fused(&self, lamport: u64) {
        for [base, _] in &self.0.last_fused {
            let _ = base.compare_exchange(lamport, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// One rank of a GPU group.
pub struct GpuComm<R: GpuRuntime> {
    rank: usize,
    group: Arc<Group<R>>,
    table: SelectionTable,
    calls: AtomicU64,
    /// [`BackendComm::set_graph_registration`]: captured calls on unregistered inputs take
    /// graph slots.
    graph_registration: AtomicBool,
}

/// Where a call that reads its peers' inputs in place finds them.
enum InPlace<'a> {
    /// Memory every rank registered.
    Registered(&'a RegisteredInput),
    /// A graph slot, filled after capture.
    Slot(usize),
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

// Descriptor codes; 0 is never used so a zeroed slot matches nothing.
const STRATEGIES: [Strategy; 6] = [
    Strategy::OneShot,
    Strategy::TwoShot,
    Strategy::QuantizedTwoShot,
    Strategy::Vendor,
    Strategy::HierarchicalQuantized,
    Strategy::VendorSymmetric,
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

/// A descriptor word as core's [`CallDesc`], with `input` for where it reads its input
/// (the word itself says only staged or registered), or `None` for codes no call of this
/// build makes.
fn call_desc_of(d: Desc, input: InputPath) -> Option<CallDesc> {
    let code = |c: u64| (c as usize).checked_sub(1);
    Some(CallDesc {
        len: d.len() as usize,
        dtype: *DType::ALL.get(code(d.dtype())?)?,
        strategy: *STRATEGIES.get(code(d.strategy())?)?,
        precision: match code(d.precision()) {
            None => Precision::Exact,
            Some(c) => Precision::Lossy(*Codec::ALL.get(c)?),
        },
        input,
        fused: None,
    })
}

/// Where a registered call's second word says its input is.
fn input_of(d: Desc2) -> InputPath {
    if d.id() & Desc2::GRAPH_SLOT != 0 {
        InputPath::GraphSlot((d.id() & !Desc2::GRAPH_SLOT) as usize)
    } else {
        InputPath::Registered {
            id: RegistrationId(d.id()),
            offset: d.offset() as usize,
        }
    }
}

/// Turn two differing descriptors into the error the host backend gives for the same calls:
/// both are decoded into core's [`CallDesc`] and compared there ([`CallDesc::mismatch`]).
/// A peer's refusal ([`Desc::REJECTED`]) is the caller's to report, with its reason.
fn mismatch_error(me: usize, peer: usize, call: u64, mine: Desc, theirs: Desc) -> Error {
    let staged_or_registered = |d: Desc| {
        if d.registered() {
            // Which registration is the second word's to say (compared separately).
            InputPath::Registered {
                id: RegistrationId(0),
                offset: 0,
            }
        } else {
            InputPath::Staged
        }
    };
    let pair = if mine.is_desc2() {
        let (m, t) = (Desc2(mine.0), Desc2(theirs.0));
        if m == Desc2::UNREGISTERED || t == Desc2::UNREGISTERED {
            let who = if m == Desc2::UNREGISTERED { me } else { peer };
            return Error::InvalidArgument(format!(
                "a graph captured with graph registration on was replayed before \
                 register_graph_buffers filled rank {who}'s part: every rank skipped the call; \
                 register the graph's buffers after capture and before its first replay"
            ));
        }
        // The first words agreed: only the input's place differs.
        let base = Desc::new(0, 1, 1, 0);
        call_desc_of(base, input_of(m)).zip(call_desc_of(base, input_of(t)))
    } else {
        call_desc_of(mine, staged_or_registered(mine))
            .zip(call_desc_of(theirs, staged_or_registered(theirs)))
    };
    let found = pair.and_then(|(m, t)| m.mismatch(me, peer, call, &t));
    found.unwrap_or_else(|| Error::RankMismatch {
        what: "call descriptor",
        call,
        detail: format!(
            "rank {me} sent {:#x}, rank {peer} {:#x} (a build that numbers calls differently?)",
            mine.0, theirs.0
        ),
    })
}

impl<R: GpuRuntime> GpuComm<R> {
    /// Refuses the registrations that exchange over a bootstrap in an in-process group, whose
    /// ranks register together instead (`register_group`).
    fn one_process_per_rank(&self) -> Result<()> {
        if self.group.local.len() == self.group.world {
            return Err(Error::InvalidArgument(
                "an in-process group registers all its ranks at once (register_group, \
                 register_graph_buffers); these calls are for groups of one process per rank"
                    .into(),
            ));
        }
        Ok(())
    }

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

    /// How the group's GPUs are connected (probed at creation, or forced by the config).
    pub fn topology(&self) -> &allreduce_core::Topology {
        &self.group.topology
    }

    /// Whether bf16 codec calls run through the f16 kernels ([`GroupConfig::cast_bf16_to_f16`]).
    pub fn casts_bf16_to_f16(&self) -> bool {
        self.group.cast_bf16_to_f16
    }

    /// Whether any rank's kernel has timed out: then the group is out of step for good.
    fn aborted(&self) -> Option<String> {
        self.group.aborted()
    }

    /// `Strategy::VendorSymmetric`: the vendor library on this rank's symmetric window. A
    /// call whose input and output both lie in the window runs there as given (the caller
    /// keeps every rank's offsets equal, as NCCL asks of symmetric buffers); any other is
    /// copied in, reduced in place in the window and copied out, in pieces of the window's
    /// size, all on the call's stream (so graph capture records the copies with the call).
    fn vendor_symmetric(&self, call: &Call) -> Result<()> {
        let g = &*self.group;
        let unavailable = |reason: &String| Error::StrategyUnavailable {
            strategy: Strategy::VendorSymmetric,
            reason: reason.clone(),
        };
        let comms = g.vendor.as_ref().map_err(unavailable)?;
        let windows = g.windows.as_ref().map_err(unavailable)?;
        let i = g.local.iter().position(|&r| r == self.rank).expect("local");
        let (comm, dev) = (&comms[i], self.device());
        let base = R::vendor_window_addr(windows, i) as usize;
        let (input, output, bytes) = (call.input.addr, call.output.addr, call.bytes());
        let inside = |a: usize| a >= base && a + bytes <= base + g.max_bytes;
        R::bind(dev)?;
        let (n, dtype, stream) = (call.len(), call.dtype(), call.stream);
        if inside(input) && inside(output) {
            // SAFETY: `prepare` validated the buffers; the window is alive with the group.
            return unsafe { R::vendor_all_reduce(comm, dev, input, output, n, dtype, stream) };
        }
        let elem = dtype.size();
        let piece = g.max_bytes / elem;
        let mut start = 0;
        while start < n {
            let len = piece.min(n - start);
            let at = start * elem;
            // SAFETY: the pieces lie in the caller's validated buffers and in the window
            // (len * elem <= max_bytes); both outlive the stream's pass over them.
            unsafe {
                R::copy_async(base as u64, (input + at) as u64, len * elem, stream)?;
                R::vendor_all_reduce(comm, dev, base, base, len, dtype, stream)?;
                R::copy_async((output + at) as u64, base as u64, len * elem, stream)?;
            }
            start += len;
        }
        Ok(())
    }

    /// `Strategy::PushOneShot`: one launch of the push kernel (crate::push), at most
    /// `Strategy::PUSH_MAX_BYTES` (prepare refuses larger calls), whatever the world.
    fn push_one_shot(&self, call: &Call) -> Result<()> {
        let g = &*self.group;
        let p = g
            .push
            .as_ref()
            .map_err(|reason| Error::StrategyUnavailable {
                strategy: Strategy::PushOneShot,
                reason: reason.clone(),
            })?;
        if call.bytes() > push::SLOT_BYTES || call.precision != Precision::Exact {
            // prepare() and strategy_available refuse these; checked again rather than
            // write past a slot, and the peers told.
            let e = Error::TooLarge {
                bytes: call.bytes(),
                max: push::SLOT_BYTES,
            };
            self.push_reject(&e, call.stream);
            return Err(e);
        }
        let args = push::args(
            &g.push_launch(self.rank, p),
            call.dtype(),
            call.input.addr as u64,
            call.output.addr as u64,
            call.len(),
            false,
        );
        let f = p.kernels[g.rank_device[self.rank]].functions[dtype_index(call.dtype())];
        R::bind(self.device())?;
        // Where a timeout of this call reads the call tags (`missing_ranks`): the push
        // protocol's buffers, laid out as a fused workspace's.
        let [base, comm] = &g.last_fused[self.rank];
        base.store(args.lamport[self.rank], Ordering::Relaxed);
        comm.store(args.comm_bytes, Ordering::Relaxed);
        // SAFETY: FusedKernelArgs mirrors the kernel's parameter; the buffers and state live
        // as long as the group; `prepare` validated the caller's buffers (device, size,
        // alignment, overlap) and the size fits a slot (checked above).
        unsafe { push::launch::<R>(f, g.grid, call.stream, &args, p.pdl) }
    }

    /// A push launch with no data and a "refused" descriptor, so that the peers' push calls
    /// skip this call and report `PeerRejected` rather than wait out the deadline; `reason`
    /// is kept for the peers of this process to report.
    fn push_reject(&self, reason: &Error, stream: Stream) {
        let g = &*self.group;
        g.record_refusal(self.rank, reason);
        let Ok(p) = &g.push else { return };
        let args = push::args(&g.push_launch(self.rank, p), DType::F32, 0, 0, 0, true);
        let f = p.kernels[g.rank_device[self.rank]].functions[0];
        if R::bind(self.device()).is_ok() {
            // SAFETY: no elements, so no buffer is touched but the group's own.
            let _ = unsafe { push::launch::<R>(f, g.grid, stream, &args, p.pdl) };
        }
    }

    /// An exact one-shot or two-shot call whose input lies in registered memory: the peers'
    /// inputs are at their bases + the same offset, read in place by the registered kernels.
    /// The descriptor says so (`Desc::REGISTERED`) and the second word names the registration
    /// and offset, so ranks that did not all take this path, or not on the same memory, skip
    /// the call together and report a mismatch.
    fn all_reduce_registered(&self, call: &Call, input: InPlace) -> Result<()> {
        let g = &*self.group;
        let kernels = g.kernels[g.rank_device[self.rank]].as_ref().expect("alive");
        let d = dtype_index(call.dtype());
        let oneshot = call.strategy == Strategy::OneShot;
        let f = if oneshot {
            kernels.oneshot_registered[d]
        } else {
            kernels.twoshot_registered[d]
        };
        R::bind(self.device())?;
        let desc = Desc(describe(call).0 | Desc::REGISTERED);
        let (desc2, slot) = match input {
            InPlace::Registered(r) => (Desc2::new(r.id.0, r.offset), 0),
            InPlace::Slot(k) => (Desc2::graph_slot(k), g.slot_row(self.rank, k)),
        };
        let total = call.len();
        let elem = call.dtype().size();
        // One-shot touches no staging, so it runs whole whatever the size. Two-shot's shards
        // pass through `reduced`, which holds one piece: split as the staged path does.
        let piece = if oneshot {
            total
        } else {
            g.piece_len(call.dtype())
        };
        let mut start = 0;
        loop {
            let n = piece.min(total - start);
            let d = if start == 0 {
                desc
            } else {
                Desc(desc.0 | Desc::CONTINUED)
            };
            let mut inputs = [0u64; MAX_WORLD];
            if let InPlace::Registered(r) = input {
                for (word, &base) in inputs.iter_mut().zip(&r.bases) {
                    *word = (base + r.offset + start * elem) as u64;
                }
            }
            let args = RegisteredArgs {
                a: g.args(
                    self.rank,
                    (call.input.addr + start * elem) as *const c_void,
                    (call.output.addr + start * elem) as *mut c_void,
                    n,
                    d,
                ),
                inputs,
                desc2: desc2.0,
                slot,
            };
            // SAFETY: RegisteredArgs mirrors the kernel's parameter. Every rank registered its
            // range (live until deregistered: the caller keeps it alive while calls on it run,
            // as it does any buffer), the input lies in ours at `offset`, so each peer's piece
            // lies in its range at the same offset; the rest as in all_reduce.
            unsafe { R::launch(f, g.grid, THREADS, call.stream, &args)? };
            start += n;
            if start >= total {
                return Ok(());
            }
        }
    }
}

impl<R: GpuRuntime> BackendComm for GpuComm<R> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn group_key(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.group) as *const () as usize)
    }

    fn register_group(&self, ranges: &[RegisteredRange]) -> Result<RegistrationId> {
        let g = &*self.group;
        if g.local.len() != g.world {
            return Err(registration_across_processes());
        }
        let mut reg = g.registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.register(g.world, ranges)
    }

    fn set_graph_registration(&self, on: bool) -> Result<()> {
        self.graph_registration.store(on, Ordering::Relaxed);
        Ok(())
    }

    fn register_graph_buffers_group(&self) -> Result<usize> {
        let g = &*self.group;
        if g.local.len() != g.world {
            return Err(registration_across_processes());
        }
        g.register_graph_slots()
    }

    fn register_rank(
        &self,
        range: RegisteredRange,
        bootstrap: &mut dyn Bootstrap,
    ) -> Result<RegistrationId> {
        self.one_process_per_rank()?;
        self.group.register_rank(self.rank, range, bootstrap)
    }

    fn alloc_registered_rank(
        &self,
        bytes: usize,
        bootstrap: &mut dyn Bootstrap,
    ) -> Result<RegisteredMemory> {
        self.one_process_per_rank()?;
        let g = &*self.group;
        // Refused before the exchange would be refused by every rank alike: the lengths are
        // compared there, and an empty allocation fails everywhere.
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "a registered allocation must be non-empty".into(),
            ));
        }
        let dev = self.device();
        R::bind(dev)?;
        // Plain device memory, which IPC can share (a stream-ordered pool's cannot).
        let mem = R::alloc_workspace(dev, bytes);
        // Every rank enters the exchange, so a rank whose allocation failed fails it for all
        // (address 0 cannot be exported); it reports its allocation's error.
        let addr = mem.as_ref().map_or(0, |m| R::memory_addr(m) as usize);
        let id = g.register_rank(self.rank, RegisteredRange { addr, bytes }, bootstrap);
        let mem = mem?;
        Ok(GpuRegistered::memory(
            &self.group,
            self.rank,
            mem,
            bytes,
            id?,
        ))
    }

    fn register_graph_buffers_rank(&self, bootstrap: &mut dyn Bootstrap) -> Result<usize> {
        self.one_process_per_rank()?;
        self.group.register_graph_slots_rank(self.rank, bootstrap)
    }

    fn deregister_group(&self, id: RegistrationId) -> Result<()> {
        let mut reg = self
            .group
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        reg.deregister(id)
    }

    fn alloc_registered_group(&self, bytes: usize) -> Result<Vec<RegisteredMemory>> {
        let g = &*self.group;
        if g.local.len() != g.world {
            return Err(registration_across_processes());
        }
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "a registered allocation must be non-empty".into(),
            ));
        }
        // Workspace memory: plain device memory that peers' kernels read (peer access is
        // enabled between the group's GPUs), complete on return.
        let mut mems = Vec::with_capacity(g.world);
        for rank in 0..g.world {
            let dev = &g.devices[g.rank_device[rank]];
            R::bind(dev)?;
            mems.push(R::alloc_workspace(dev, bytes)?);
        }
        let ranges: Vec<RegisteredRange> = mems
            .iter()
            .map(|m| RegisteredRange {
                addr: R::memory_addr(m) as usize,
                bytes,
            })
            .collect();
        let id = self.register_group(&ranges)?;
        Ok(mems
            .into_iter()
            .enumerate()
            .map(|(rank, mem)| GpuRegistered::memory(&self.group, rank, mem, bytes, id))
            .collect())
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn limits(&self) -> Limits {
        Limits {
            chunks: true,
            device: R::device_tag(self.ordinal()),
            max_bytes: self.group.max_bytes,
            align: allreduce_core::BUFFER_ALIGN,
            topology: self.group.topology.class(),
        }
    }

    fn selection(&self) -> &SelectionTable {
        &self.table
    }

    fn strategy_available(
        &self,
        strategy: Strategy,
        dtype: DType,
        precision: Precision,
    ) -> Result<(), String> {
        let no_peers = |s: Strategy| -> Result<(), String> {
            match self.group.topology.missing_peer_access() {
                Some((a, b)) => Err(format!(
                    "{s} needs peer access, and rank {a}'s GPU cannot reach rank {b}'s"
                )),
                None => Ok(()),
            }
        };
        let codec_kernels = || match (R::quantized_unavailable(), dtype, precision) {
            (Some(why), _, _) => Err(why),
            (None, _, Precision::Exact) => Err("it needs Precision::Lossy(codec)".into()),
            (None, DType::F16 | DType::BF16, Precision::Lossy(c)) => self.group.codec_spoken(c),
            (None, d, _) => Err(format!("the codecs carry f16 and bf16, not {d}")),
        };
        match strategy {
            Strategy::OneShot | Strategy::TwoShot => no_peers(strategy),
            Strategy::QuantizedTwoShot => no_peers(strategy).and_then(|_| codec_kernels()),
            Strategy::HierarchicalQuantized => no_peers(strategy)
                .and_then(|_| codec_kernels())
                .and_then(|_| {
                    allreduce_core::hierarchical::group_size(
                        Some(&self.group.topology),
                        self.group.world,
                    )
                    .map(|_| ())
                }),
            Strategy::PushOneShot => match precision {
                Precision::Exact => no_peers(strategy)
                    .and_then(|_| self.group.push.as_ref().map(|_| ()).map_err(Clone::clone)),
                Precision::Lossy(_) => Err("it is exact (Precision::Exact)".into()),
            },
            Strategy::Vendor => self.group.vendor.as_ref().map(|_| ()).map_err(Clone::clone),
            Strategy::VendorSymmetric => self
                .group
                .windows
                .as_ref()
                .map(|_| ())
                .map_err(Clone::clone),
            Strategy::Auto => Err("Auto is resolved before the backend is called".into()),
        }
    }

    fn all_reduce(&self, call: &Call) -> Result<()> {
        if let Some(reason) = self.aborted() {
            return Err(Error::Aborted { reason });
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let g = &*self.group;
        // A group of one has nothing to reduce: the exact sum is the input, a device copy
        // (at 64 MiB a third of the time the staged one-shot takes; docs/benchmarks.md).
        if g.world == 1
            && call.precision == Precision::Exact
            && matches!(call.strategy, Strategy::OneShot | Strategy::TwoShot)
        {
            if call.in_place() || call.is_empty() {
                return Ok(());
            }
            R::bind(self.device())?;
            // SAFETY: `prepare` validated both buffers on this device; they do not overlap
            // (prepare refuses partial overlap, and equal addresses returned above).
            return unsafe {
                R::copy_async(
                    call.output.addr as u64,
                    call.input.addr as u64,
                    call.bytes(),
                    call.stream,
                )
            };
        }
        if call.strategy == Strategy::PushOneShot {
            return self.push_one_shot(call);
        }
        if let Some(input) = g.registered_input(self.rank, call) {
            return self.all_reduce_registered(call, InPlace::Registered(&input));
        }
        if self.graph_registration.load(Ordering::Relaxed) && g.reads_in_place(call) {
            R::bind(self.device())?;
            if R::stream_capturing(self.device(), call.stream)? {
                if let Some(k) = g.take_slot(self.rank, call) {
                    return self.all_reduce_registered(call, InPlace::Slot(k));
                }
            }
        }
        let kernels = g.kernels[g.rank_device[self.rank]].as_ref().expect("alive");
        let f = match call.strategy {
            Strategy::OneShot => kernels.oneshot[dtype_index(call.dtype())],
            Strategy::TwoShot => kernels.twoshot[dtype_index(call.dtype())],
            s @ (Strategy::QuantizedTwoShot | Strategy::HierarchicalQuantized) => {
                let (table, owners) = if s == Strategy::QuantizedTwoShot {
                    (kernels.quantized.as_ref(), Ok(g.world))
                } else {
                    (
                        kernels.hierarchical.as_ref(),
                        allreduce_core::hierarchical::group_size(Some(&g.topology), g.world),
                    )
                };
                let (Some(table), Precision::Lossy(codec), Some(d), Ok(owners)) = (
                    table,
                    call.precision,
                    dtype_index(call.dtype()).checked_sub(1),
                    owners,
                ) else {
                    return Err(Error::StrategyUnavailable {
                        strategy: s,
                        reason: "needs the codec kernels, a lossy precision, f16 or bf16, and \
                                 (hierarchical) two NUMA groups"
                            .into(),
                    });
                };
                // Cannot fail for pieces within max_bytes (stage_bytes has the room); checked
                // anyway, and the peers told, rather than trust arithmetic with memory safety.
                // The hierarchical kernel's slots are its `owners` = world/2 in-group shards.
                if !quantized_fits(
                    codec,
                    call.len().min(g.piece_len(call.dtype())),
                    owners,
                    g.stage_bytes,
                ) {
                    let e = Error::TooLarge {
                        bytes: call.output.bytes(),
                        max: g.max_bytes,
                    };
                    self.calls.fetch_sub(1, Ordering::Relaxed);
                    self.reject(&e, call.stream);
                    return Err(e);
                }
                // `strategy_available` refused these before the call got here; checked again
                // rather than index out of the table or send a format a peer cannot decode.
                let c = self.group.codec_spoken(codec).map(|()| {
                    (Codec::ALL.iter().position(|&x| x == codec)).expect("every codec is listed")
                });
                let c = match c {
                    Ok(c) => c,
                    Err(reason) => {
                        let e = Error::StrategyUnavailable {
                            strategy: s,
                            reason,
                        };
                        self.calls.fetch_sub(1, Ordering::Relaxed);
                        self.reject(&e, call.stream);
                        return Err(e);
                    }
                };
                table[d][c]
            }
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
                let i = g.local.iter().position(|&r| r == self.rank).expect("local");
                return unsafe {
                    R::vendor_all_reduce(
                        &comms[i],
                        self.device(),
                        call.input.addr,
                        call.output.addr,
                        call.len(),
                        call.dtype(),
                        call.stream,
                    )
                };
            }
            Strategy::VendorSymmetric => return self.vendor_symmetric(call),
            s => {
                return Err(Error::StrategyUnavailable {
                    strategy: s,
                    reason: format!("not in the {} backend", R::NAME),
                })
            }
        };
        R::bind(self.device())?;
        // A call larger than the workspace runs as consecutive pieces of at most max_bytes, each
        // a whole all-reduce of its range. Pieces are whole 32-element codec blocks, so codec
        // blocks stay the buffer's global blocks; a lossy result is still defined per piece,
        // since shard owners (who add their own part unencoded) are chosen within the piece.
        // Every piece carries the whole call's descriptor, so ranks that disagree on the length
        // all skip the first piece, and the later ones are skipped by the kernels (abi.h).
        let desc = describe(call);
        let total = call.len();
        let piece = g.piece_len(call.dtype());
        let elem = call.dtype().size();
        let mut start = 0;
        loop {
            let n = piece.min(total - start);
            let d = if start == 0 {
                desc
            } else {
                Desc(desc.0 | Desc::CONTINUED)
            };
            let args = g.args(
                self.rank,
                (call.input.addr + start * elem) as *const c_void,
                (call.output.addr + start * elem) as *mut c_void,
                n,
                d,
            );
            // SAFETY: Args mirrors the kernel's parameter; the workspaces and controls live as
            // long as the group, and `prepare` validated the caller's buffers (device, size,
            // alignment); the piece lies inside them and starts 16-byte aligned.
            unsafe { R::launch(f, g.grid, THREADS, call.stream, &args)? };
            start += n;
            if start >= total {
                return Ok(());
            }
        }
    }

    fn reject(&self, reason: &Error, stream: Stream) {
        // Join the call's first barrier with a "rejected" descriptor and nothing to move, so
        // the peers skip the call and report PeerRejected instead of waiting out the deadline.
        if self.aborted().is_some() {
            return;
        }
        self.group.record_refusal(self.rank, reason);
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

    fn reject_call(&self, reason: &Error, stream: Stream, strategy: Strategy) {
        if strategy == Strategy::PushOneShot {
            if self.aborted().is_none() {
                self.calls.fetch_add(1, Ordering::Relaxed);
                self.push_reject(reason, stream);
            }
        } else {
            self.reject(reason, stream);
        }
    }

    fn topology(&self) -> Option<&allreduce_core::Topology> {
        Some(&self.group.topology)
    }

    /// Raise the abort word in every rank's workspace header (the peers' too: their
    /// workspaces are mapped here, in process or by IPC), which every spinning kernel polls,
    /// through a copy on a stream of its own: the caller's streams may be blocked behind
    /// those kernels. Calls of the vendor library in flight are not interrupted.
    fn abort(&self, reason: &str) -> Result<()> {
        let g = &*self.group;
        g.caller_abort
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(|| reason.to_string());
        let dev = self.device();
        R::bind(dev)?;
        let stream = R::create_stream(dev)?;
        // SAFETY: the stream outlives the word (synchronised below before both drop).
        let one = unsafe { R::alloc(&stream, 4)? };
        // SAFETY: 4 bytes at offset 0 of a 4-byte allocation; every peer address is a live
        // workspace of the group (its header's abort word at ABORT_OFFSET).
        unsafe {
            R::upload(&one, 0, &1u32.to_le_bytes(), &stream)?;
            for &base in g.peers.iter().take(g.world) {
                let at = base + abi::ABORT_OFFSET as u64;
                R::copy_async(at, R::memory_addr(&one), 4, R::stream_handle(&stream))?;
            }
        }
        R::stream_synchronize(&stream)
    }

    fn vendor_window(&self) -> Option<(u64, usize)> {
        let g = &*self.group;
        let windows = g.windows.as_ref().ok()?;
        let i = g.local.iter().position(|&r| r == self.rank)?;
        Some((R::vendor_window_addr(windows, i), g.max_bytes))
    }

    fn create_fused_group(
        &self,
        config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        let view = GroupView(self.group.clone());
        if !view.in_process() {
            return Err(Error::InvalidConfig(
                "fused workspaces are built for in-process groups; a group of one process per \
                 rank does not have them yet"
                    .into(),
            ));
        }
        R::create_fused_group(view, config)
    }

    fn synchronize(&self, stream: Stream) -> Result<()> {
        R::bind(self.device())?;
        R::synchronize_stream(self.device(), stream)?;
        let control = self.group.control(self.rank);
        let c = Group::<R>::read_control(control);
        if c.error == abi::ERROR_MISMATCH || c.error == abi::ERROR_FUSED_MISMATCH {
            // Not fatal: clear it once reported. No kernel of ours runs now (the stream is
            // idle) and peers never write our control.
            // SAFETY: a live, aligned, host-mapped Control.
            unsafe {
                std::ptr::write_volatile(
                    R::host_mapped_ptrs(control).0 as *mut u32,
                    abi::ERROR_NONE,
                )
            };
            if c.error == abi::ERROR_FUSED_MISMATCH && push::is_push_desc(c.mine) {
                return Err(push::mismatch_error(
                    self.rank,
                    c.rank as usize,
                    c.epoch as u64,
                    c.mine,
                    c.theirs,
                    |r| self.group.refusal(r),
                ));
            }
            if c.error == abi::ERROR_FUSED_MISMATCH {
                return match fused_mismatch_error(self.rank, &c, |r| self.group.refusal(r)) {
                    Some(e) => Err(e),
                    None => self
                        .aborted()
                        .map_or(Ok(()), |reason| Err(Error::Aborted { reason })),
                };
            }
            let call = self.calls.load(Ordering::Relaxed).saturating_sub(1);
            if Desc(c.theirs) == Desc::REJECTED {
                return Err(Error::PeerRejected {
                    rank: c.rank as usize,
                    call,
                    reason: self.group.refusal(c.rank as usize),
                });
            }
            return Err(mismatch_error(
                self.rank,
                c.rank as usize,
                call,
                Desc(c.mine),
                Desc(c.theirs),
            ));
        }
        if c.error == abi::ERROR_TIMEOUT {
            let waiting_for = if c.theirs == abi::TIMEOUT_IN_FUSED {
                // The push one-shot polls on the fused protocol, in its own buffers.
                let kind = if self.group.last_call_was_push(self.rank) {
                    "push"
                } else {
                    "fused"
                };
                format!(
                    "the peers' call tags of {kind} call {} at block {}",
                    c.epoch, c.block
                )
            } else {
                format!("the peers' flags at block {}, epoch {}", c.block, c.epoch)
            };
            return Err(Error::timeout(
                c.rank as usize,
                self.calls.load(Ordering::Relaxed).saturating_sub(1),
                Duration::from_nanos(c.waited_ns),
                &waiting_for,
                &self.group.missing_ranks(self.rank, &c),
            ));
        }
        if c.error == abi::ERROR_ABORTED {
            // The caller's reason where a caller aborted the group (`abort`); else the
            // kernel's: a peer timed out.
            let mut reason = self.aborted().unwrap_or_else(|| aborted_reason(&c));
            if self.group.caller_abort_reason().is_none() {
                // The rank that timed out may be in another process, with the names of the
                // ranks it missed: say who this rank's own flags show behind.
                let behind = self.group.ranks_behind(self.rank, c.block);
                if !behind.is_empty() {
                    reason.push_str(&format!(
                        "; {} had not arrived at block {} where the other ranks had",
                        allreduce_core::error::rank_list(&behind),
                        c.block
                    ));
                }
            }
            return Err(Error::Aborted { reason });
        }
        match self.aborted() {
            Some(reason) => Err(Error::Aborted { reason }),
            None => Ok(()),
        }
    }
}

/// A registered allocation of one rank: deregistered first, then freed with its device
/// current. Holds the group, whose devices (contexts) must outlive the memory.
struct GpuRegistered<R: GpuRuntime> {
    deregister: Option<Deregister>,
    mem: Option<R::Memory>,
    rank: usize,
    group: Arc<Group<R>>,
}

impl<R: GpuRuntime> GpuRegistered<R> {
    /// `mem`, rank `rank`'s part of registration `id`, owned so that dropping it deregisters
    /// the registration and then frees the memory.
    fn memory(
        group: &Arc<Group<R>>,
        rank: usize,
        mem: R::Memory,
        bytes: usize,
        id: RegistrationId,
    ) -> RegisteredMemory {
        RegisteredMemory {
            addr: R::memory_addr(&mem) as usize,
            bytes,
            device: R::device_tag(R::ordinal(&group.devices[group.rank_device[rank]])),
            id,
            owner: Box::new(GpuRegistered::<R> {
                deregister: Some(Deregister {
                    registry: group.registry.clone(),
                    id,
                }),
                mem: Some(mem),
                rank,
                group: group.clone(),
            }),
        }
    }
}

impl<R: GpuRuntime> allreduce_core::MemoryOwner for GpuRegistered<R> {
    /// On a stream of its own, synchronized before return: a convenience for filling and
    /// reading buffers, not a hot path (no process-wide setting is touched).
    fn apply(&self, _mem: &RegisteredMemory, op: allreduce_core::MemoryOp<'_>) -> Result<()> {
        use allreduce_core::MemoryOp;
        let dev = &self.group.devices[self.group.rank_device[self.rank]];
        R::bind(dev)?;
        let s = R::create_stream(dev)?;
        let m = self.mem.as_ref().expect("alive until dropped");
        // SAFETY: ranges checked by RegisteredMemory::apply; every memory involved outlives
        // the stream synchronization below.
        unsafe {
            match op {
                MemoryOp::Upload { offset, src } => R::upload(m, offset, src, &s)?,
                MemoryOp::Download { offset, dst } => R::download(m, offset, dst, &s)?,
                MemoryOp::Fill {
                    offset,
                    bytes,
                    value,
                } => R::fill(m, offset, bytes, crate::Fill::U8(value), &s)?,
                MemoryOp::Copy {
                    offset,
                    src,
                    src_offset,
                    bytes,
                } => {
                    let Some(from) = src.owner.as_any().downcast_ref::<GpuRegistered<R>>() else {
                        return Err(Error::InvalidArgument(format!(
                            "copy source is not memory of the {} backend",
                            R::NAME
                        )));
                    };
                    let sm = from.mem.as_ref().expect("alive until dropped");
                    R::copy(m, offset, sm, src_offset, bytes, &s)?
                }
            }
        }
        R::stream_synchronize(&s)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl<R: GpuRuntime> Drop for GpuRegistered<R> {
    fn drop(&mut self) {
        self.deregister.take();
        let _ = R::bind(&self.group.devices[self.group.rank_device[self.rank]]);
        self.mem.take();
    }
}

/// Copy `src` into `mem` (an allocation of a group of runtime `R`, from
/// `alloc_registered_group`) at byte `offset`, ordered on `stream`: how tests and the bench
/// fill registered inputs. Memory of another runtime, or a range outside it, is an error.
pub fn upload_registered<R: GpuRuntime>(
    mem: &RegisteredMemory,
    offset: usize,
    src: &[u8],
    stream: &crate::device::GpuStream<R>,
) -> Result<()> {
    let Some(owned) = mem.owner.as_any().downcast_ref::<GpuRegistered<R>>() else {
        return Err(Error::InvalidArgument(format!(
            "not a registered allocation of the {} backend",
            R::NAME
        )));
    };
    mem.check_range(offset, src.len(), "upload")?;
    let m = owned.mem.as_ref().expect("alive until dropped");
    // SAFETY: the range lies inside `m`, which lives as long as `mem`; the caller keeps `mem`
    // until its stream has passed the copy, as with any buffer it enqueues work on.
    unsafe { R::upload(m, offset, src, stream.raw()) }
}

/// Registration in a group of one process per rank: peers would have to map the memory from
/// another process, and exporting a caller's allocation needs its allocation base (an IPC
/// handle names a whole allocation), which the caller's address alone does not give.
fn registration_across_processes() -> Error {
    Error::Unsupported {
        what: "memory registration in a group of one process per rank (in-process groups \
               only: exporting a caller's allocation to the peers needs its allocation base)"
            .into(),
    }
}

/// What a rank whose fused call the ranks skipped reports (`ERROR_FUSED_MISMATCH`): the
/// peer's refusal (`refusal` gives its reason) as `PeerRejected`, nothing where this rank was
/// the one that refused (its caller had the error at the call), else the shapes' difference
/// as core compares them. Every rank skipped the call; the group is usable.
fn fused_mismatch_error(
    me: usize,
    c: &Control,
    refusal: impl Fn(usize) -> String,
) -> Option<Error> {
    use allreduce_core::fused::{call_desc_of, desc_is_rejection, describe_desc};
    let (peer, call) = (c.rank as usize, c.epoch as u64);
    if desc_is_rejection(c.mine) {
        return None;
    }
    if desc_is_rejection(c.theirs) {
        return Some(Error::PeerRejected {
            rank: peer,
            call,
            reason: refusal(peer),
        });
    }
    match (call_desc_of(c.mine), call_desc_of(c.theirs)) {
        (Some(mine), Some(theirs)) => mine.mismatch(me, peer, call, &theirs),
        _ => Some(Error::RankMismatch {
            what: "a fused call's shape",
            call,
            detail: format!(
                "rank {me} called with {}, rank {peer} with {}; every rank skipped the call",
                describe_desc(c.mine),
                describe_desc(c.theirs)
            ),
        }),
    }
}

/// Why a group is out of step for good, from a Control holding a timeout or an abort.
fn aborted_reason(c: &Control) -> String {
    if c.error == abi::ERROR_TIMEOUT {
        format!(
            "rank {} timed out at block {} waiting for epoch {}",
            c.rank, c.block, c.epoch
        )
    } else {
        format!(
            "rank {} left a call at block {}: a peer timed out or aborted the group, and set \
             its abort word",
            c.rank, c.block
        )
    }
}

mod exchange;

#[cfg(test)]
pub(crate) mod tests;
