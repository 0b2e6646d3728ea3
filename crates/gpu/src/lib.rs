//! What a GPU backend is made of, so that every vendor runs the same group logic.
//!
//! A GPU backend is two things: a [`GpuRuntime`] (the dozen device operations the group logic
//! needs, over the vendor's runtime: allocate, map host memory, load the kernels, launch with
//! one by-value [`abi::Args`] block, synchronise, enable peers, and the vendor collective
//! library), and the group logic itself, [`GpuBackend`]/[`GpuComm`], which is written once
//! against the trait: the workspace layout ([`abi`]), the flag protocol's launch arguments,
//! the warm-up, strategy choice, the call descriptors ranks compare in the kernel, and how a
//! device-side timeout or mismatch becomes an [`Error`](allreduce_core::Error).
//!
//! Both GPU backends are built this way: `Cuda = GpuBackend<CudaRuntime>` (allreduce-backend-cuda)
//! and `Rocm = GpuBackend<Hip>` (allreduce-backend-rocm). The fused all-reduce + RMSNorm's
//! host side is [`fused`], over the same trait.
//!
//! Methods are associated functions (`R::bind(&dev)`): a runtime is a type, not a value,
//! because the vendor library behind it is process-global and loaded once.

use std::ffi::CStr;

use allreduce_core::{DType, Device, Error, GroupConfig, Result, SelectionTable, Stream};

pub mod abi;
pub mod device;
pub mod fused;
mod group;
pub mod kernels;
pub mod push;

pub use group::{upload_registered, GpuBackend, GpuComm, GroupView};

/// A pattern repeated over device memory ([`GpuRuntime::alloc_filled`], [`GpuRuntime::fill`]):
/// one word of the width of the elements the memory will hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    U32(u32),
    U16(u16),
    U8(u8),
}

impl Fill {
    /// The word's width in bytes: a filled range must be a whole number of words.
    pub fn width(self) -> usize {
        match self {
            Fill::U32(_) => 4,
            Fill::U16(_) => 2,
            Fill::U8(_) => 1,
        }
    }
}

/// What a runtime without an optional capability returns: [`Error::Unsupported`] naming the
/// backend and the capability.
/// More ranks on one device than it has hardware queues, if so: `(ordinal, ranks, queues)`.
/// Ranks sharing a queue run their kernels in order, so one spinning for a peer's can hold the
/// peer's behind it until the deadline (HIP's `GPU_MAX_HW_QUEUES`, CUDA's
/// `CUDA_DEVICE_MAX_CONNECTIONS`).
pub fn queue_shortfall(ordinals: &[u32], queues: usize) -> Option<(u32, usize, usize)> {
    let mut worst: Option<(u32, usize)> = None;
    for &o in ordinals {
        let n = ordinals.iter().filter(|&&x| x == o).count();
        if worst.is_none_or(|(_, w)| n > w) {
            worst = Some((o, n));
        }
    }
    worst.and_then(|(o, n)| (n > queues).then_some((o, n, queues)))
}

pub fn unsupported<R: GpuRuntime>(what: &str) -> Error {
    Error::Unsupported {
        what: format!("the {} backend has no {what}", R::NAME),
    }
}

/// The device operations the shared group logic needs from a vendor runtime.
///
/// Every method that allocates, loads or launches runs with `dev` (or the device the caller
/// bound last, for [`GpuRuntime::launch`]) current on the calling thread; implementations
/// whose runtime has a per-thread current device bind it themselves where a device is passed.
pub trait GpuRuntime: Sized + Send + Sync + 'static {
    /// The backend's name (`"cuda"`, `"rocm"`): `Backend::NAME`, and in error messages.
    const NAME: &'static str;
    /// Blocks per launch with one rank per GPU (fewer when ranks share a GPU, see
    /// [`GpuRuntime::compute_units`]). vLLM's grid-searched 36 for its one-/two-shot kernels.
    const BLOCKS_PER_RANK: u32 = 36;

    /// An open device (a context retained, attributes read).
    type Device: Send + Sync;
    /// Device memory, freed on drop.
    type Memory: Send + Sync;
    /// Pinned host memory mapped into the device's address space, freed on drop.
    type HostMapped: Send + Sync;
    /// The loaded kernels, unloaded on drop.
    type Module: Send + Sync;
    /// A kernel handle (valid while its module lives).
    type Function: Copy + Send + Sync;
    /// One rank's communicator of the vendor library (NCCL, RCCL), destroyed on drop.
    type Vendor: Send + Sync;
    /// The symmetric windows of this process's ranks (`Strategy::VendorSymmetric`): memory
    /// the vendor library allocated, registered with the group once
    /// [`GpuRuntime::vendor_windows_register`] ran; deregistered together and freed on drop,
    /// which the group does before it destroys the communicators.
    type VendorWindows: Send + Sync;
    /// A stream of one device that does not synchronise with the legacy/null stream,
    /// destroyed on drop.
    type Stream: Send + Sync;
    /// A captured graph, instantiated and replayable; destroyed on drop.
    type Graph: Send + Sync;

    /// Called first when a group over these device ordinals (one per rank) is built: a
    /// runtime's own checks or warnings about the group's shape.
    fn prepare_group(_ordinals: &[u32]) -> Result<()> {
        Ok(())
    }

    /// How buffers on device `ordinal` are tagged (`Device::Rocm(ordinal)`).
    fn device_tag(ordinal: u32) -> Device;
    /// Open device `ordinal`. A missing runtime library or device is an error value.
    fn open(ordinal: u32) -> Result<Self::Device>;
    fn ordinal(dev: &Self::Device) -> u32;
    /// Streaming multiprocessors (CUDA) or compute units (ROCm): ranks sharing a GPU split
    /// them, since all their blocks must be resident at once.
    fn compute_units(dev: &Self::Device) -> u32;
    /// Make `dev` current on the calling thread.
    fn bind(dev: &Self::Device) -> Result<()>;
    fn can_access_peer(dev: &Self::Device, peer: &Self::Device) -> Result<bool>;
    /// Let `dev` read and write `peer`'s memory (already enabled is not an error).
    fn enable_peer(dev: &Self::Device, peer: &Self::Device) -> Result<()>;

    /// A rank's workspace: zeroed, and visible to peers' kernels without stale caches (on
    /// ROCm: uncached device memory, as QuickReduce allocates it). Complete on return.
    fn alloc_workspace(dev: &Self::Device, bytes: usize) -> Result<Self::Memory>;
    fn memory_addr(mem: &Self::Memory) -> u64;
    /// Zeroed, coherent host memory the device can write (where kernels report errors).
    fn alloc_host_mapped(dev: &Self::Device, bytes: usize) -> Result<Self::HostMapped>;
    /// The host pointer and the device address of the same bytes.
    fn host_mapped_ptrs(mem: &Self::HostMapped) -> (*mut u8, u64);

    /// Load the backend's embedded kernels for `dev`'s architecture.
    fn load_module(dev: &Self::Device) -> Result<Self::Module>;
    /// Look up a kernel by name, loaded eagerly (no lazy first-launch work later).
    fn function(module: &Self::Module, name: &CStr) -> Result<Self::Function>;

    /// Launch `f` on the current device with one by-value argument block.
    ///
    /// # Safety
    /// `A` must match the kernel's parameter layout, and every pointer in it must stay valid
    /// until the kernel has run.
    unsafe fn launch<A>(
        f: Self::Function,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()>;
    /// Wait for all work on `dev`.
    fn synchronize_device(dev: &Self::Device) -> Result<()>;
    /// Wait for the work on `stream` (a stream of `dev`).
    fn synchronize_stream(dev: &Self::Device, stream: Stream) -> Result<()>;

    /// Why the vendor library cannot serve a group over these device ordinals, or `None`.
    fn vendor_unavailable(ordinals: &[u32]) -> Option<String>;
    /// One vendor communicator per rank, `devices[r]` being rank r's (all distinct).
    fn vendor_init(devices: &[&Self::Device]) -> Result<Vec<Self::Vendor>>;
    /// Enqueue a sum of `n` elements from `input` into `output` (equal: in place) on the
    /// vendor library, on `stream`.
    ///
    /// # Safety
    /// Both ranges must be valid device memory of `dev` until `stream` passes the call.
    unsafe fn vendor_all_reduce(
        comm: &Self::Vendor,
        dev: &Self::Device,
        input: usize,
        output: usize,
        n: usize,
        dtype: DType,
        stream: Stream,
    ) -> Result<()>;

    /// Why the vendor library cannot make symmetric windows (a version without them, a
    /// missing symbol), or `None`. Asked only where [`GpuRuntime::vendor_unavailable`] said
    /// the library serves the group.
    fn vendor_symmetric_unavailable() -> Option<String> {
        Some(format!(
            "the {} backend has no symmetric windows",
            Self::NAME
        ))
    }

    /// A window of `bytes` on each of `devices` (this process's ranks, in order), from the
    /// vendor's allocator (memory its symmetric kernels can map), not yet registered. Local:
    /// a failure here is exchanged before anyone enters the collective registration.
    fn vendor_windows_alloc(
        _devices: &[&Self::Device],
        _bytes: usize,
    ) -> Result<Self::VendorWindows> {
        Err(unsupported::<Self>("symmetric windows"))
    }

    /// Register every window with its communicator (`comms[i]` for window i) as a symmetric
    /// window. Collective over the whole group: in-process, this thread registers every
    /// rank's in one vendor group call; across processes, every process calls it at the same
    /// point.
    fn vendor_windows_register(
        _windows: &mut Self::VendorWindows,
        _comms: &[Self::Vendor],
        _devices: &[&Self::Device],
    ) -> Result<()> {
        Err(unsupported::<Self>("symmetric windows"))
    }

    /// The device address of window `i`.
    fn vendor_window_addr(windows: &Self::VendorWindows, i: usize) -> u64;

    /// Copy `bytes` between two device addresses of the current device, ordered on `stream`
    /// (in and out of a symmetric window).
    ///
    /// # Safety
    /// Both ranges are device memory that stays valid until `stream` passes the copy.
    unsafe fn copy_async(dst: u64, src: u64, bytes: usize, stream: Stream) -> Result<()>;

    /// The table behind `Strategy::Auto` when the caller gives none.
    fn default_selection(_config: &GroupConfig) -> SelectionTable {
        SelectionTable::default_table()
    }

    /// Why `Strategy::QuantizedTwoShot` cannot run, or `None` when the module holds the codec
    /// kernels (`ar_quantized_{f16,bf16}_{codec}`, kernels-common quantized.h).
    fn quantized_unavailable() -> Option<String> {
        None
    }

    /// How `dev` reaches `peer`'s memory (two distinct devices). The default knows only
    /// whether there is peer access at all, and calls it PCIe.
    fn link(dev: &Self::Device, peer: &Self::Device) -> Result<allreduce_core::Link> {
        Ok(if Self::can_access_peer(dev, peer)? {
            allreduce_core::Link::Pcie
        } else {
            allreduce_core::Link::None
        })
    }

    /// The NUMA node of `dev`, where the platform says (Linux sysfs by PCI bus id).
    fn numa_node(_dev: &Self::Device) -> Option<u32> {
        None
    }

    /// Bytes that name the physical device the same way in every process (a UUID): ranks of
    /// a multi-process group with equal ids share one GPU. The default, the ordinal, is only
    /// right when every process sees the same device numbering.
    fn device_id(dev: &Self::Device) -> Vec<u8> {
        Self::ordinal(dev).to_le_bytes().to_vec()
    }

    /// Unmap an address [`GpuRuntime::import_memory`] returned.
    ///
    /// # Safety
    /// `addr` came from `import_memory` on `dev` and is not used afterwards.
    unsafe fn close_import(_dev: &Self::Device, _addr: u64) {}

    /// A vendor-library group id (`ncclGetUniqueId`), made by rank 0 of a multi-process group
    /// and sent to the others over the bootstrap.
    fn vendor_unique_id() -> Result<Vec<u8>> {
        Err(unsupported::<Self>("multi-process vendor library"))
    }

    /// This process's communicator of a vendor group spanning processes.
    fn vendor_init_rank(
        _dev: &Self::Device,
        _id: &[u8],
        _rank: usize,
        _world: usize,
    ) -> Result<Self::Vendor> {
        Err(unsupported::<Self>("multi-process vendor library"))
    }

    /// Fused all-reduce workspaces for every rank of `group`, or `None` where the runtime has
    /// none: the facade then refuses fused calls. A runtime with
    /// the fused module ([`GpuRuntime::load_fused_module`], [`GpuRuntime::alloc_filled`])
    /// returns [`fused::create_group`]'s.
    fn create_fused_group(
        _group: GroupView<Self>,
        _config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        Ok(None)
    }

    /// World sizes the fused module has specialised instances for (`ar_fused_*_w2`); other
    /// worlds use the generic `_w0` instance.
    const FUSED_WORLDS: &'static [usize] = &[];

    /// Whether `dev` runs thread-block clusters (CUDA sm_90 and later), which the fused
    /// one-shot's split kernel needs ([`GpuRuntime::launch_cluster`]).
    fn has_clusters(_dev: &Self::Device) -> bool {
        false
    }

    /// As [`GpuRuntime::launch`], in clusters of `cluster` blocks (`grid` a multiple of it).
    ///
    /// # Safety
    /// As [`GpuRuntime::launch`].
    unsafe fn launch_cluster<A>(
        _f: Self::Function,
        _grid: u32,
        _cluster: u32,
        _block: u32,
        _stream: Stream,
        _args: &A,
    ) -> Result<()> {
        Err(unsupported::<Self>("thread-block clusters"))
    }

    /// Whether `dev` runs programmatic dependent launches ([`GpuRuntime::launch_dependent`]:
    /// CUDA sm_90 and later).
    fn has_pdl(_dev: &Self::Device) -> bool {
        false
    }

    /// As [`GpuRuntime::launch`] (in clusters of `cluster` blocks where `cluster` > 1, as
    /// [`GpuRuntime::launch_cluster`]), and the kernel may be scheduled before the stream's
    /// previous kernel has completed (programmatic dependent launch), once that kernel lets
    /// it: the kernel must wait for it (`pdl_wait` in shim.h) before its first memory access.
    /// Where [`GpuRuntime::has_pdl`] is false, an ordinary launch.
    ///
    /// # Safety
    /// As [`GpuRuntime::launch`].
    unsafe fn launch_dependent<A>(
        f: Self::Function,
        grid: u32,
        cluster: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        if cluster > 1 {
            Self::launch_cluster(f, grid, cluster, block, stream, args)
        } else {
            Self::launch(f, grid, block, stream, args)
        }
    }

    /// Load the fused all-reduce + RMSNorm kernels (a second module, `fused.h`'s) for `dev`,
    /// which the caller has made current.
    fn load_fused_module(_dev: &Self::Device) -> Result<Self::Module> {
        Err(unsupported::<Self>("fused kernels"))
    }

    /// Device memory of `bytes` that peers' kernels read and write (as
    /// [`GpuRuntime::alloc_workspace`]'s), every word set to `fill` rather than zero: the
    /// fused kernels' Lamport buffers, whose "not written yet" is -0.0. Runs with `dev`
    /// current (the caller bound it); complete on return.
    fn alloc_filled(_dev: &Self::Device, _bytes: usize, _fill: Fill) -> Result<Self::Memory> {
        Err(unsupported::<Self>("fused kernels"))
    }

    /// A handle another process can open to map `mem` (CUDA/HIP IPC handles), for groups
    /// that span processes. Not needed by in-process groups, which share one address space.
    fn export_memory(_mem: &Self::Memory) -> Result<Vec<u8>> {
        Err(unsupported::<Self>("memory export to other processes"))
    }

    /// A handle another process can open to map the allocation that holds `addr` (any
    /// address in memory this process allocated), and `addr`'s offset in that allocation: how
    /// a caller's buffer is registered with a group of processes. Memory the vendor cannot
    /// share this way (a stream-ordered pool's) is an error.
    fn export_address(_dev: &Self::Device, _addr: u64) -> Result<(Vec<u8>, u64)> {
        Err(unsupported::<Self>("memory export to other processes"))
    }

    /// Map a peer process's memory from its [`GpuRuntime::export_memory`] handle; returns
    /// the device address in this process.
    ///
    /// # Safety
    /// `handle` must come from a live allocation of another process of the same group.
    unsafe fn import_memory(_dev: &Self::Device, _handle: &[u8]) -> Result<u64> {
        Err(unsupported::<Self>("memory import from other processes"))
    }

    // ---- The device API: streams, data memory, graphs ([`device`] wraps it safely) ------
    //
    // One contract for every backend. Everything is ordered on the stream passed, never on
    // the legacy/null stream, and nothing waits for the whole device: ranks sharing a GPU
    // spin on each other's flags, so a device-wide wait (a synchronous free, memset or copy)
    // made by one rank's thread while a peer's kernel waits for that rank's next launch is a
    // cycle only the deadline breaks. `upload` returns once the host bytes are consumed (the
    // caller may reuse the slice at once; the device copy may still be in flight);
    // `download` returns once the bytes are in the host slice. Memory from [`GpuRuntime::alloc`]
    // is usable by work enqueued on its stream after the call, and is freed on drop in that
    // stream's order where the vendor allocates in stream order. Every call runs with the
    // stream's device current on the calling thread (the caller bound it).

    /// Process-wide settings of `dev` that virtual ranks (several ranks of one group on one
    /// device) need before their data memory is allocated with [`GpuRuntime::alloc`]. Called
    /// explicitly (`device::GpuDevice::prepare_virtual_ranks`), never as a side effect. The
    /// default: none needed.
    fn prepare_virtual_ranks(_dev: &Self::Device) -> Result<()> {
        Ok(())
    }

    /// A new stream on `dev` (bound by this call).
    fn create_stream(dev: &Self::Device) -> Result<Self::Stream>;
    /// The raw handle calls take (`AllReduceOptions::stream`).
    fn stream_handle(s: &Self::Stream) -> Stream;
    /// Wait for the work enqueued on `s` so far.
    fn stream_synchronize(s: &Self::Stream) -> Result<()>;
    /// Do the stream's first-use work (a first kernel launch's lazy setup, a hardware queue's
    /// creation) now, and wait for it: made later, while peers wait for this rank's launches,
    /// it may wait for the device.
    fn warm_stream(dev: &Self::Device, s: &Self::Stream) -> Result<()>;

    /// `bytes` of uninitialised device memory for data, usable by work on `s` from now on.
    ///
    /// # Safety
    /// `s` outlives the memory (it may be freed in `s`'s order).
    unsafe fn alloc(s: &Self::Stream, bytes: usize) -> Result<Self::Memory>;
    /// Bytes of `mem` (as allocated; at least what was asked for).
    fn memory_len(mem: &Self::Memory) -> usize;
    /// Copy `src` to `mem` at byte `offset`, ordered on `s`; returns once `src` is consumed.
    ///
    /// # Safety
    /// The range lies inside `mem`, which stays alive until `s` passes the copy.
    unsafe fn upload(mem: &Self::Memory, offset: usize, src: &[u8], s: &Self::Stream)
        -> Result<()>;
    /// Copy `mem` at byte `offset` into `dst`, after the work enqueued on `s` so far; returns
    /// once the bytes are in `dst`.
    ///
    /// # Safety
    /// The range lies inside `mem`.
    unsafe fn download(
        mem: &Self::Memory,
        offset: usize,
        dst: &mut [u8],
        s: &Self::Stream,
    ) -> Result<()>;
    /// Repeat `fill` over `bytes` (a multiple of its width) of `mem` from byte `offset`
    /// (a multiple of its width), ordered on `s`.
    ///
    /// # Safety
    /// The range lies inside `mem`, which stays alive until `s` passes the fill.
    unsafe fn fill(
        mem: &Self::Memory,
        offset: usize,
        bytes: usize,
        fill: Fill,
        s: &Self::Stream,
    ) -> Result<()>;
    /// Copy `bytes` from `src` at `src_offset` to `dst` at `dst_offset`, ordered on `s`.
    ///
    /// # Safety
    /// Both ranges lie inside their memory, which stays alive until `s` passes the copy.
    unsafe fn copy(
        dst: &Self::Memory,
        dst_offset: usize,
        src: &Self::Memory,
        src_offset: usize,
        bytes: usize,
        s: &Self::Stream,
    ) -> Result<()>;

    /// Whether `stream` (any stream of `dev`, bound by the caller) is being captured into a
    /// graph: calls captured with graph registration on take graph slots
    /// (`BackendComm::set_graph_registration`). The default, for runtimes without graphs:
    /// never.
    fn stream_capturing(_dev: &Self::Device, _stream: Stream) -> Result<bool> {
        Ok(false)
    }

    /// Start capturing what this thread enqueues on `s` into a graph (thread-local capture
    /// mode: other ranks' threads keep enqueueing eagerly or capture their own).
    fn begin_capture(s: &Self::Stream) -> Result<()>;
    /// End the capture [`GpuRuntime::begin_capture`] started and instantiate the graph.
    fn end_capture(s: &Self::Stream) -> Result<Self::Graph>;
    /// Replay `graph` on `s`.
    fn launch_graph(graph: &Self::Graph, s: &Self::Stream) -> Result<()>;

    /// Launch `f` (on the current device) with one 8-byte parameter per word of `words`,
    /// for kernels that take separate parameters rather than one argument block (the copy
    /// kernel).
    ///
    /// # Safety
    /// The kernel takes `words.len()` parameters of 8 bytes, and every pointer among them
    /// stays valid until the kernel has run.
    unsafe fn launch_words(
        f: Self::Function,
        grid: u32,
        block: u32,
        stream: Stream,
        words: &[u64],
    ) -> Result<()>;
}
