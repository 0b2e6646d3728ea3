//! The shared group logic over a mock runtime: host memory for device memory, and launches
//! recorded instead of run. What a GPU backend does with no GPU: which kernels it launches,
//! with which arguments, and how the words kernels write become errors.

use std::cell::RefCell;
use std::ffi::CStr;

use super::*;
use crate::kernels::Vendor;
use crate::{Fill, GpuRuntime};
use allreduce_core::{AllReduceOptions, BufMut, BufRef, Device, FusedPattern};

#[derive(Clone, Debug)]
pub(crate) struct Launch {
    pub(crate) kernel: &'static str,
    pub(crate) grid: u32,
    /// Blocks per cluster (`launch_cluster`), 0 for a plain launch.
    cluster: u32,
    /// Launched as a programmatic dependent launch (`launch_dependent`).
    pdl: bool,
    block: u32,
    stream: usize,
    /// The argument block when it is an `Args`, or the `Args` of a `RegisteredArgs` (zeroed
    /// for other kernels' blocks).
    args: Args,
    /// The argument block's bytes, whatever its type.
    pub(crate) raw: Vec<u8>,
}

impl Launch {
    /// The argument block as the registered kernels' `RegisteredArgs`.
    fn registered(&self) -> abi::RegisteredArgs {
        assert_eq!(
            self.raw.len(),
            size_of::<abi::RegisteredArgs>(),
            "{}",
            self.kernel
        );
        // SAFETY: as many bytes as a RegisteredArgs, plain data (the pointers only compared).
        unsafe { std::ptr::read_unaligned(self.raw.as_ptr() as *const abi::RegisteredArgs) }
    }

    /// The argument block as the fused kernels' `FusedKernelArgs`.
    fn fused(&self) -> abi::FusedKernelArgs {
        assert_eq!(
            self.raw.len(),
            size_of::<abi::FusedKernelArgs>(),
            "{}",
            self.kernel
        );
        // SAFETY: as many bytes as a FusedKernelArgs, which is plain data (any bits are valid).
        unsafe { std::ptr::read_unaligned(self.raw.as_ptr() as *const abi::FusedKernelArgs) }
    }
}

thread_local! {
    static LAUNCHES: RefCell<Vec<Launch>> = const { RefCell::new(Vec::new()) };
    static PEERS_ENABLED: RefCell<Vec<(u32, u32)>> = const { RefCell::new(Vec::new()) };
    static SYNCS: RefCell<usize> = const { RefCell::new(0) };
    static PREPARED: RefCell<Vec<Vec<u32>>> = const { RefCell::new(Vec::new()) };
}

pub(crate) fn take_launches() -> Vec<Launch> {
    LAUNCHES.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

/// `kernels`' names, for the mock's `&'static str` functions.
fn leak_names(kernels: impl Iterator<Item = Kernel>) -> Vec<&'static str> {
    kernels.map(|k| &*k.name().leak()).collect()
}

/// The all-reduce kernels the engine looks up, in the order it warms them: exact one-shot and
/// two-shot by dtype, then the quantized and the hierarchical kernels by dtype and codec.
fn engine_kernels() -> &'static [&'static str] {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        let codec_kernels = |k: fn(DType, Codec) -> Kernel| {
            [DType::F16, DType::BF16]
                .into_iter()
                .flat_map(move |d| Codec::ALL.map(|c| k(d, c)))
        };
        let all = (DType::ALL.map(Kernel::OneShot).into_iter())
            .chain(DType::ALL.map(Kernel::TwoShot))
            .chain(codec_kernels(Kernel::Quantized))
            .chain(codec_kernels(Kernel::Hierarchical))
            .chain(DType::ALL.map(Kernel::OneShotRegistered))
            .chain(DType::ALL.map(Kernel::TwoShotRegistered));
        leak_names(all)
    })
}

/// What the mock's modules hold: everything the CUDA build compiles (the mock's
/// `FUSED_WORLDS` are CUDA's, and it may run clusters).
fn compiled_kernels() -> &'static [&'static str] {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| leak_names(kernels::all(Vendor::Cuda).into_iter()))
}

thread_local! {
    /// Whether the mock's devices run thread-block clusters (`has_clusters`).
    static CLUSTERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static PDL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// What `stream_capturing` answers for every stream.
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Fills asked of `alloc_filled`, with their sizes.
    static FILLS: RefCell<Vec<(usize, Fill)>> = const { RefCell::new(Vec::new()) };
    /// Every name `function` was asked for.
    static LOOKED_UP: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    /// The mock's vendor library: `None` has none; `Some(why)` has one whose symmetric
    /// windows are unavailable for `why` (empty: available).
    static VENDOR: RefCell<Option<String>> = const { RefCell::new(None) };
    /// What the vendor library and the device copies did, in order.
    static VENDOR_LOG: RefCell<Vec<VendorOp>> = const { RefCell::new(Vec::new()) };
}

/// One operation of the mock's vendor library or its device copies.
#[derive(Clone, Debug, PartialEq)]
enum VendorOp {
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    AllReduce {
        comm: usize,
        input: usize,
        output: usize,
        n: usize,
    },
    Register {
        windows: usize,
    },
}

fn vendor_log() -> Vec<VendorOp> {
    VENDOR_LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

pub(crate) struct Mock;

pub(crate) struct MockDevice {
    ordinal: u32,
}

impl GpuRuntime for Mock {
    const NAME: &'static str = "mock";
    type Device = MockDevice;
    type Memory = Box<[u64]>;
    type HostMapped = Box<[u64]>;
    type Module = ();
    type Function = &'static str;
    /// The rank index.
    type Vendor = usize;
    type VendorWindows = Vec<Box<[u64]>>;
    type Stream = ();
    type Graph = ();

    fn prepare_group(ordinals: &[u32]) -> Result<()> {
        if ordinals.len() > 6 {
            return Err(Error::InvalidConfig(
                "the mock refuses more than 6 ranks".into(),
            ));
        }
        PREPARED.with(|p| p.borrow_mut().push(ordinals.to_vec()));
        Ok(())
    }
    fn device_tag(ordinal: u32) -> Device {
        Device::Rocm(ordinal)
    }
    fn open(ordinal: u32) -> Result<MockDevice> {
        if ordinal >= 8 {
            return Err(Error::InvalidConfig(format!("no mock device {ordinal}")));
        }
        Ok(MockDevice { ordinal })
    }
    fn ordinal(dev: &MockDevice) -> u32 {
        dev.ordinal
    }
    /// 20 compute units: four ranks on one device get 5 blocks each.
    fn compute_units(_dev: &MockDevice) -> u32 {
        20
    }
    fn bind(_dev: &MockDevice) -> Result<()> {
        Ok(())
    }
    fn can_access_peer(_dev: &MockDevice, _peer: &MockDevice) -> Result<bool> {
        Ok(true)
    }
    fn enable_peer(dev: &MockDevice, peer: &MockDevice) -> Result<()> {
        PEERS_ENABLED.with(|p| p.borrow_mut().push((dev.ordinal, peer.ordinal)));
        Ok(())
    }
    fn alloc_workspace(_dev: &MockDevice, bytes: usize) -> Result<Box<[u64]>> {
        Ok(vec![0u64; bytes.div_ceil(8)].into_boxed_slice())
    }
    fn memory_addr(mem: &Box<[u64]>) -> u64 {
        mem.as_ptr() as u64
    }
    fn alloc_host_mapped(_dev: &MockDevice, bytes: usize) -> Result<Box<[u64]>> {
        Ok(vec![0u64; bytes.div_ceil(8)].into_boxed_slice())
    }
    fn host_mapped_ptrs(mem: &Box<[u64]>) -> (*mut u8, u64) {
        // The mock's "device address" of host-mapped memory is its host address + 1, so a
        // test can tell which one went into the launch arguments.
        (mem.as_ptr() as *mut u8, mem.as_ptr() as u64 + 1)
    }
    fn load_module(_dev: &MockDevice) -> Result<()> {
        Ok(())
    }
    fn function(_module: &(), name: &CStr) -> Result<&'static str> {
        LOOKED_UP.with(|l| l.borrow_mut().push(name.to_string_lossy().into_owned()));
        compiled_kernels()
            .iter()
            .find(|k| k.as_bytes() == name.to_bytes())
            .copied()
            .ok_or_else(|| Error::InvalidConfig(format!("no kernel {name:?}")))
    }
    unsafe fn launch<A>(
        f: &'static str,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        let raw = std::slice::from_raw_parts(args as *const A as *const u8, size_of::<A>());
        let args = if size_of::<A>() == size_of::<Args>()
            || size_of::<A>() == size_of::<abi::RegisteredArgs>()
        {
            // RegisteredArgs starts with its Args.
            *(args as *const A as *const Args)
        } else {
            // Plain data: null pointers and zeros.
            std::mem::zeroed()
        };
        LAUNCHES.with(|l| {
            l.borrow_mut().push(Launch {
                kernel: f,
                grid,
                cluster: 0,
                pdl: false,
                block,
                stream: stream.as_raw() as usize,
                args,
                raw: raw.to_vec(),
            })
        });
        Ok(())
    }
    fn has_clusters(_dev: &MockDevice) -> bool {
        CLUSTERS.with(|c| c.get())
    }
    unsafe fn launch_cluster<A>(
        f: &'static str,
        grid: u32,
        cluster: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        assert_eq!(grid % cluster, 0, "clusters must tile the grid");
        Self::launch(f, grid, block, stream, args)?;
        LAUNCHES.with(|l| l.borrow_mut().last_mut().unwrap().cluster = cluster);
        Ok(())
    }
    fn has_pdl(_dev: &MockDevice) -> bool {
        PDL.with(|c| c.get())
    }
    unsafe fn launch_dependent<A>(
        f: &'static str,
        grid: u32,
        cluster: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        if cluster > 1 {
            Self::launch_cluster(f, grid, cluster, block, stream, args)?;
        } else {
            Self::launch(f, grid, block, stream, args)?;
        }
        LAUNCHES.with(|l| l.borrow_mut().last_mut().unwrap().pdl = true);
        Ok(())
    }
    fn synchronize_device(_dev: &MockDevice) -> Result<()> {
        SYNCS.with(|s| *s.borrow_mut() += 1);
        Ok(())
    }
    fn synchronize_stream(_dev: &MockDevice, _stream: Stream) -> Result<()> {
        Ok(())
    }
    /// The "handle" is the address itself; importing maps it at address + 1, so a test can
    /// tell imported peers from local ones.
    fn export_memory(mem: &Box<[u64]>) -> Result<Vec<u8>> {
        Ok((mem.as_ptr() as u64).to_le_bytes().to_vec())
    }
    unsafe fn import_memory(_dev: &MockDevice, handle: &[u8]) -> Result<u64> {
        Ok(u64::from_le_bytes(handle.try_into().unwrap()) + 1)
    }
    fn create_fused_group(
        group: GroupView<Mock>,
        config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        crate::fused::create_group(group, config).map(Some)
    }
    const FUSED_WORLDS: &'static [usize] = Vendor::Cuda.fused_worlds();
    fn load_fused_module(_dev: &MockDevice) -> Result<()> {
        Ok(())
    }
    fn alloc_filled(_dev: &MockDevice, bytes: usize, fill: Fill) -> Result<Box<[u64]>> {
        FILLS.with(|f| f.borrow_mut().push((bytes, fill)));
        let word = match fill {
            Fill::U32(v) => u64::from(v) * 0x1_0000_0001,
            Fill::U16(v) => u64::from(v) * 0x0001_0001_0001_0001,
            Fill::U8(v) => u64::from(v) * 0x0101_0101_0101_0101,
        };
        Ok(vec![word; bytes.div_ceil(8)].into_boxed_slice())
    }
    fn vendor_unavailable(_ordinals: &[u32]) -> Option<String> {
        VENDOR
            .with(|v| v.borrow().is_none())
            .then(|| "the mock has no vendor library".into())
    }
    fn vendor_init(devices: &[&MockDevice]) -> Result<Vec<usize>> {
        Ok((0..devices.len()).collect())
    }
    /// A group of one rank's sum: the input, copied (host memory stands for device memory).
    unsafe fn vendor_all_reduce(
        comm: &usize,
        _dev: &MockDevice,
        input: usize,
        output: usize,
        n: usize,
        dtype: DType,
        _stream: Stream,
    ) -> Result<()> {
        VENDOR_LOG.with(|l| {
            l.borrow_mut().push(VendorOp::AllReduce {
                comm: *comm,
                input,
                output,
                n,
            })
        });
        std::ptr::copy(input as *const u8, output as *mut u8, n * dtype.size());
        Ok(())
    }
    fn vendor_symmetric_unavailable() -> Option<String> {
        VENDOR.with(|v| v.borrow().clone().filter(|why| !why.is_empty()))
    }
    fn vendor_windows_alloc(devices: &[&MockDevice], bytes: usize) -> Result<Vec<Box<[u64]>>> {
        Ok((devices.iter())
            .map(|_| vec![0u64; bytes.div_ceil(8)].into_boxed_slice())
            .collect())
    }
    fn vendor_windows_register(
        windows: &mut Vec<Box<[u64]>>,
        comms: &[usize],
        _devices: &[&MockDevice],
    ) -> Result<()> {
        assert_eq!(windows.len(), comms.len());
        let windows = windows.len();
        VENDOR_LOG.with(|l| l.borrow_mut().push(VendorOp::Register { windows }));
        Ok(())
    }
    fn vendor_window_addr(windows: &Vec<Box<[u64]>>, i: usize) -> u64 {
        windows[i].as_ptr() as u64
    }
    unsafe fn copy_async(dst: u64, src: u64, bytes: usize, _stream: Stream) -> Result<()> {
        VENDOR_LOG.with(|l| l.borrow_mut().push(VendorOp::Copy { dst, src, bytes }));
        std::ptr::copy(src as *const u8, dst as *mut u8, bytes);
        Ok(())
    }
    // The device API over host memory: the mock's "device memory" is a host allocation, so
    // copies and fills are plain memory operations.
    fn create_stream(_dev: &MockDevice) -> Result<()> {
        Ok(())
    }
    fn stream_handle(_s: &()) -> Stream {
        Stream::NULL
    }
    fn stream_synchronize(_s: &()) -> Result<()> {
        Ok(())
    }
    fn warm_stream(_dev: &MockDevice, _s: &()) -> Result<()> {
        Ok(())
    }
    unsafe fn alloc(_s: &(), bytes: usize) -> Result<Box<[u64]>> {
        Ok(vec![0xdead_beef_dead_beef_u64; bytes.div_ceil(8)].into_boxed_slice())
    }
    fn memory_len(mem: &Box<[u64]>) -> usize {
        mem.len() * 8
    }
    unsafe fn upload(mem: &Box<[u64]>, offset: usize, src: &[u8], _s: &()) -> Result<()> {
        let dst = (mem.as_ptr() as *mut u8).add(offset);
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
        Ok(())
    }
    unsafe fn download(mem: &Box<[u64]>, offset: usize, dst: &mut [u8], _s: &()) -> Result<()> {
        let src = (mem.as_ptr() as *const u8).add(offset);
        std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
        Ok(())
    }
    unsafe fn fill(
        mem: &Box<[u64]>,
        offset: usize,
        bytes: usize,
        fill: Fill,
        _s: &(),
    ) -> Result<()> {
        let word: Vec<u8> = match fill {
            Fill::U32(v) => v.to_le_bytes().to_vec(),
            Fill::U16(v) => v.to_le_bytes().to_vec(),
            Fill::U8(v) => vec![v],
        };
        let dst = std::slice::from_raw_parts_mut((mem.as_ptr() as *mut u8).add(offset), bytes);
        for chunk in dst.chunks_mut(word.len()) {
            chunk.copy_from_slice(&word);
        }
        Ok(())
    }
    unsafe fn copy(
        dst: &Box<[u64]>,
        dst_offset: usize,
        src: &Box<[u64]>,
        src_offset: usize,
        bytes: usize,
        _s: &(),
    ) -> Result<()> {
        std::ptr::copy(
            (src.as_ptr() as *const u8).add(src_offset),
            (dst.as_ptr() as *mut u8).add(dst_offset),
            bytes,
        );
        Ok(())
    }
    fn stream_capturing(_dev: &MockDevice, _stream: Stream) -> Result<bool> {
        Ok(CAPTURING.with(|c| c.get()))
    }
    fn begin_capture(_s: &()) -> Result<()> {
        Ok(())
    }
    fn end_capture(_s: &()) -> Result<()> {
        Ok(())
    }
    fn launch_graph(_g: &(), _s: &()) -> Result<()> {
        Ok(())
    }
    unsafe fn launch_words(
        f: &'static str,
        grid: u32,
        block: u32,
        stream: Stream,
        words: &[u64],
    ) -> Result<()> {
        let raw: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        Self::launch(f, grid, block, stream, &())?;
        LAUNCHES.with(|l| l.borrow_mut().last_mut().unwrap().raw = raw);
        Ok(())
    }
}

fn group(devices: Vec<u32>) -> Vec<GpuComm<Mock>> {
    // Registered calls of any size take the registered path, so small test calls reach it.
    let config = GroupConfig::new(devices.len())
        .devices(devices)
        .max_bytes(1 << 20)
        .registered_min_bytes(0);
    GpuBackend::<Mock>::create_group(&config).expect("mock group")
}

/// Write a Control the way a kernel would.
fn write_control(comm: &GpuComm<Mock>, rank: usize, c: Control) {
    let (host, _) = Mock::host_mapped_ptrs(comm.group.control(rank));
    // SAFETY: a live Control-sized, 8-aligned mock allocation.
    unsafe { std::ptr::write_volatile(host as *mut Control, c) };
}

#[test]
fn grid_splits_compute_units_between_ranks_sharing_a_gpu() {
    assert_eq!(grid_for(36, &[304], &[0]), 36);
    assert_eq!(grid_for(36, &[304, 304], &[0, 1]), 36);
    assert_eq!(grid_for(36, &[304], &[0; 8]), 36);
    assert_eq!(grid_for(36, &[104], &[0; 4]), 26);
    assert_eq!(grid_for(36, &[20, 304], &[0, 1]), 20);
    assert_eq!(grid_for(36, &[2], &[0; 8]), 1);
    assert_eq!(grid_for(100, &[304], &[0]), MAX_BLOCKS as u32);
}

#[test]
fn creation_enables_peers_and_warms_every_kernel_alone() {
    take_launches();
    let comms = group(vec![0, 1, 2, 3]);
    assert_eq!(comms[0].grid(), 20);
    let peers = PEERS_ENABLED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    assert_eq!(
        peers.len(),
        12,
        "every ordered pair of distinct GPUs: {peers:?}"
    );
    let warm = take_launches();
    let kernels = engine_kernels();
    // Per rank: the exact kernels, then the push one-shot's three.
    let push = crate::push::kernel_set::<Mock>(4).map(Kernel::name);
    let per_rank = kernels.len() + push.len();
    assert_eq!(warm.len(), 4 * per_rank);
    for (i, l) in warm.iter().enumerate() {
        let (rank, k) = (i / per_rank, i % per_rank);
        assert_eq!((l.grid, l.block, l.stream), (20, THREADS, 0));
        if k >= kernels.len() {
            assert_eq!(l.kernel, push[k - kernels.len()]);
            // Alone too: world 1, its own buffers and workspace as rank 0, no data.
            let a = l.fused();
            assert_eq!((a.world, a.rank, a.tokens), (1, 0, 0));
            let g = &comms[rank].group;
            let own = Mock::memory_addr(
                &g.push.as_ref().unwrap().memory[rank]
                    .as_ref()
                    .unwrap()
                    .buffers,
            );
            assert_eq!((a.lamport[0], a.ws[0]), (own, g.peers[rank]));
            assert!(a.lamport[1..].iter().chain(&a.ws[1..]).all(|&p| p == 0));
            continue;
        }
        assert_eq!(l.kernel, kernels[k]);
        // Alone: world 1, its own workspace as rank 0, nothing to move.
        assert_eq!((l.args.world, l.args.rank, l.args.n), (1, 0, 0));
        assert_eq!(l.args.peers[0], comms[rank].group.peers[rank]);
        assert!(l.args.peers[1..].iter().all(|&p| p == 0));
    }
    assert!(SYNCS.with(|s| *s.borrow()) >= 4);
}

#[test]
fn the_runtime_sees_the_group_first_and_options_reach_the_ranks() {
    PREPARED.with(|p| p.borrow_mut().clear());
    let comms = group(vec![0, 0, 1]);
    assert_eq!(PREPARED.with(|p| p.borrow().clone()), vec![vec![0, 0, 1]]);
    assert!(!comms[0].casts_bf16_to_f16());
    let config = GroupConfig::new(2).cast_bf16_to_f16(true);
    let comms = GpuBackend::<Mock>::create_group(&config).expect("mock group");
    assert!(comms[1].casts_bf16_to_f16());
    assert_eq!(
        PREPARED.with(|p| p.borrow().last().cloned()),
        Some(vec![0, 0])
    );
    // A refusal from the runtime is the group's error, before anything is allocated.
    take_launches();
    let Err(e) = GpuBackend::<Mock>::create_group(&GroupConfig::new(7)) else {
        panic!("refused");
    };
    assert!(e.to_string().contains("more than 6"), "{e}");
    assert!(take_launches().is_empty());
}

#[test]
fn virtual_ranks_share_a_device_and_split_its_units() {
    let comms = group(vec![0, 0, 0, 0]);
    assert_eq!(comms[0].grid(), 5);
    assert_eq!(comms[3].ordinal(), 0);
    assert_eq!(comms[3].limits().device, Device::Rocm(0));
}

#[test]
fn a_call_launches_its_kernel_with_every_workspace_and_a_descriptor() {
    let comms = group(vec![0, 1, 2, 3]);
    take_launches();
    let c = &comms[2];
    let input = vec![0u16; 4096];
    let mut output = vec![0u16; 4096];
    let dev = Device::Rocm(2);
    // SAFETY: only addresses are used; the mock never touches the buffers.
    let (i, o) = unsafe {
        (
            BufRef::from_raw(input.as_ptr() as usize, 4096, DType::BF16, dev),
            BufMut::from_raw(output.as_mut_ptr() as usize, 4096, DType::BF16, dev),
        )
    };
    let stream = Stream::from_raw(0x5000 as *mut c_void);
    let opts = AllReduceOptions::default()
        .strategy(Strategy::TwoShot)
        .stream(stream);
    let call = allreduce_core::prepare(
        Some(i),
        &o,
        &opts,
        &c.limits(),
        c.world_size(),
        c.selection(),
        |s, d, p| c.strategy_available(s, d, p),
    )
    .unwrap();
    c.all_reduce(&call).unwrap();
    let l = take_launches().pop().expect("one launch");
    assert_eq!(l.kernel, "ar_twoshot_bf16");
    assert_eq!((l.grid, l.block, l.stream), (20, THREADS, 0x5000));
    assert_eq!((l.args.rank, l.args.world, l.args.n), (2, 4, 4096));
    assert_eq!(l.args.input as usize, input.as_ptr() as usize);
    assert_eq!(l.args.output as usize, output.as_ptr() as usize);
    assert_eq!(&l.args.peers[..4], &c.group.peers[..4]);
    assert!(l.args.peers[..4].iter().all(|&p| p != 0));
    assert_eq!(l.args.control, Mock::host_mapped_ptrs(c.group.control(2)).1);
    // The staging stride: max_bytes plus the quantized slots' padding.
    assert_eq!(l.args.max_bytes as usize, stage_bytes(1 << 20));
    let d = Desc(l.args.desc);
    assert_eq!(
        (d.len(), d.dtype(), d.strategy(), d.precision()),
        (4096, 3, 2, 0)
    );
}

#[test]
fn quantized_takes_16_bit_lossy_calls_and_vendor_says_why_it_is_unavailable() {
    let comms = group(vec![0, 1]);
    let q = |d, p| comms[0].strategy_available(Strategy::QuantizedTwoShot, d, p);
    assert_eq!(q(DType::F16, Precision::Lossy(Codec::Int4)), Ok(()));
    assert_eq!(
        q(DType::BF16, Precision::Lossy(Codec::Int8Adaptive)),
        Ok(())
    );
    assert!(q(DType::F32, Precision::Lossy(Codec::Int4))
        .unwrap_err()
        .contains("f16 and bf16"));
    // Format v2 runs like v1, the hierarchical path too.
    for c in Codec::V2 {
        assert_eq!(q(DType::BF16, Precision::Lossy(c)), Ok(()));
    }
    assert!(q(DType::F16, Precision::Exact)
        .unwrap_err()
        .contains("Lossy"));
    let v = comms[0].strategy_available(Strategy::Vendor, DType::F16, Precision::Exact);
    assert_eq!(v.unwrap_err(), "the mock has no vendor library");
    // Auto never picks what is unavailable: asked for with exact precision, a large call
    // goes to two-shot.
    let s =
        comms[0]
            .selection()
            .choose(1 << 30, 2, DType::F16, Precision::Lossy(Codec::Int4), |s| {
                comms[0]
                    .strategy_available(s, DType::F16, Precision::Exact)
                    .is_ok()
            });
    assert_eq!(s, Strategy::TwoShot);
}

#[test]
fn a_rejecting_rank_joins_with_the_rejected_descriptor() {
    let comms = group(vec![0, 1]);
    take_launches();
    comms[1].reject(&Error::InvalidConfig("test".into()), Stream::NULL);
    let l = take_launches().pop().expect("one launch");
    assert_eq!(l.kernel, "ar_oneshot_f32");
    assert_eq!((l.args.n, Desc(l.args.desc)), (0, Desc::REJECTED));
}

#[test]
fn kernel_reports_become_errors() {
    let comms = group(vec![0, 1, 2]);
    let mine = Desc::new(100, 2, 1, 0);
    let theirs = Desc::new(200, 2, 1, 0);
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_MISMATCH,
            rank: 1,
            mine: mine.0,
            theirs: theirs.0,
            ..Default::default()
        },
    );
    match comms[0].synchronize(Stream::NULL) {
        Err(Error::RankMismatch { what, detail, .. }) => {
            assert_eq!(what, "length");
            assert_eq!(detail, "rank 0 has 100, rank 1 has 200");
        }
        other => panic!("{other:?}"),
    }
    // Reported once, then cleared: the group is intact.
    comms[0].synchronize(Stream::NULL).unwrap();

    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_MISMATCH,
            rank: 2,
            mine: mine.0,
            theirs: Desc::REJECTED.0,
            ..Default::default()
        },
    );
    assert!(matches!(
        comms[0].synchronize(Stream::NULL),
        Err(Error::PeerRejected { rank: 2, .. })
    ));

    write_control(
        &comms[0],
        2,
        Control {
            error: abi::ERROR_TIMEOUT,
            rank: 2,
            block: 3,
            epoch: 7,
            waited_ns: 5_000,
            ..Default::default()
        },
    );
    assert!(matches!(
        comms[2].synchronize(Stream::NULL),
        Err(Error::Timeout { rank: 2, .. })
    ));
    // Every other rank sees the group aborted, at synchronize and at the next call.
    match comms[1].synchronize(Stream::NULL) {
        Err(Error::Aborted { reason }) => assert!(reason.contains("block 3"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_kernel_that_left_on_the_abort_word_fails_the_call() {
    // What a rank of a multi-process group sees when a peer in another process timed out:
    // only its own Control, saying its kernel left. A clean stream is not a result.
    let comms = group(vec![0, 1]);
    write_control(
        &comms[0],
        1,
        Control {
            error: abi::ERROR_ABORTED,
            rank: 1,
            block: 5,
            ..Default::default()
        },
    );
    match comms[1].synchronize(Stream::NULL) {
        Err(Error::Aborted { reason }) => assert!(reason.contains("block 5"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // In one process the other ranks read it too (the check before every call is the same).
    match comms[0].synchronize(Stream::NULL) {
        Err(Error::Aborted { reason }) => assert!(reason.contains("abort word"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_fused_mismatch_is_reported_once_and_leaves_the_group_usable() {
    let comms = group(vec![0, 1]);
    let desc = |tokens: u64| tokens << 32 | 2048 << 8 | 3 << 1 | 1;
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_FUSED_MISMATCH,
            rank: 1,
            epoch: 4,
            mine: desc(1),
            theirs: desc(2),
            ..Default::default()
        },
    );
    let e = comms[0].synchronize(Stream::NULL).unwrap_err();
    assert_eq!(e.aftermath(), allreduce_core::Aftermath::Intact);
    match e {
        Error::RankMismatch {
            call: 4, detail, ..
        } => {
            assert!(detail.contains("1 tokens x 2048 bf16"), "{detail}");
            assert!(detail.contains("rank 1 with 2 tokens"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    // Reported once, then cleared; the peer holds nothing and is not aborted by it.
    comms[0].synchronize(Stream::NULL).unwrap();
    comms[1].synchronize(Stream::NULL).unwrap();
}

#[test]
fn precision_names_follow_codec_order() {
    // The descriptor numbers codecs by their position in Codec::ALL; the mismatch message
    // must name them the same way.
    for (i, c) in Codec::ALL.iter().enumerate() {
        assert_eq!(precision_code(Precision::Lossy(*c)), 1 + i as u64);
        let e = mismatch_error(
            0,
            1,
            0,
            Desc::new(1, 2, 3, 0),
            Desc::new(1, 2, 3, 1 + i as u64),
        );
        match e {
            Error::RankMismatch { detail, .. } => assert!(detail.ends_with(c.name()), "{detail}"),
            other => panic!("{other:?}"),
        }
    }
}

/// Every call the limits admit fits the quantized slots, for every codec and world size.
#[test]
fn quantized_slots_fit_every_admitted_call() {
    for max_bytes in [0usize, 1, 2, 16, 100, 256, 1000, 4096, 65536, 1 << 20] {
        let max = abi::round_max_bytes(max_bytes);
        let stage = stage_bytes(max);
        for world in 1..=MAX_WORLD {
            for codec in Codec::ALL {
                // 16-bit elements: the codecs carry f16/bf16 only.
                for n in (0..=max / 2).rev().take(200).chain(0..200.min(max / 2 + 1)) {
                    assert!(
                        quantized_fits(codec, n, world, stage),
                        "{codec} n={n} world={world} max={max}"
                    );
                }
            }
        }
    }
}

/// Run `f` with the mock's vendor library present (`symmetric`: why its windows are
/// unavailable, empty when they are available), then without it again.
fn with_vendor<T>(symmetric: &str, f: impl FnOnce() -> T) -> T {
    VENDOR.with(|v| *v.borrow_mut() = Some(symmetric.into()));
    vendor_log();
    let out = f();
    VENDOR.with(|v| *v.borrow_mut() = None);
    out
}

fn prepare_on(
    c: &GpuComm<Mock>,
    input: &[f32],
    output: &mut [f32],
    strategy: Strategy,
) -> allreduce_core::Result<Call> {
    let n = output.len();
    prepare_raw(
        c,
        input.as_ptr() as usize,
        output.as_mut_ptr() as usize,
        n,
        strategy,
    )
}

/// As [`prepare_on`] on `n` f32 at raw addresses of the mock's host memory.
fn prepare_raw(
    c: &GpuComm<Mock>,
    input: usize,
    output: usize,
    n: usize,
    strategy: Strategy,
) -> allreduce_core::Result<Call> {
    let dev = Device::Rocm(c.rank() as u32);
    // SAFETY: host memory stands for device memory in the mock; both outlive the call.
    let (i, o) = unsafe {
        (
            BufRef::from_raw(input, n, DType::F32, dev),
            BufMut::from_raw(output, n, DType::F32, dev),
        )
    };
    allreduce_core::prepare(
        Some(i),
        &o,
        &AllReduceOptions::default().strategy(strategy),
        &c.limits(),
        c.world_size(),
        c.selection(),
        |s, d, p| c.strategy_available(s, d, p),
    )
}

/// `Strategy::VendorSymmetric` registers one window of the group's `max_bytes` per rank in
/// one collective step; a call outside the window is copied in, reduced in place in the
/// window and copied out, piece by piece on the call's stream; a call inside the window runs
/// there with no copy.
#[test]
fn vendor_symmetric_stages_through_the_window_or_runs_in_it() {
    with_vendor("", || {
        let config = GroupConfig::new(2).devices(vec![0, 1]).max_bytes(1000); // 1024 bytes
        let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
        assert_eq!(vendor_log(), vec![VendorOp::Register { windows: 2 }]);
        let c = &comms[1];
        assert_eq!(
            c.strategy_available(Strategy::VendorSymmetric, DType::BF16, Precision::Exact),
            Ok(())
        );
        let (base, bytes) = c.vendor_window().expect("a window");
        assert_eq!(bytes, 1024);
        assert_ne!(Some(base), comms[0].vendor_window().map(|w| w.0));

        // 700 f32 = 2800 bytes: pieces of 256, 256 and 188 elements.
        let input: Vec<f32> = (0..700).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut output = vec![0f32; 700];
        let call = prepare_on(c, &input, &mut output, Strategy::VendorSymmetric).unwrap();
        c.all_reduce(&call).unwrap();
        let (inp, out) = (input.as_ptr() as u64, output.as_ptr() as u64);
        let mut want = Vec::new();
        for (start, len) in [(0u64, 256usize), (256, 256), (512, 188)] {
            let b = len * 4;
            want.push(VendorOp::Copy {
                dst: base,
                src: inp + 4 * start,
                bytes: b,
            });
            want.push(VendorOp::AllReduce {
                comm: 1,
                input: base as usize,
                output: base as usize,
                n: len,
            });
            want.push(VendorOp::Copy {
                dst: out + 4 * start,
                src: base,
                bytes: b,
            });
        }
        assert_eq!(vendor_log(), want);
        assert_eq!(output, input, "the mock's one-rank sum is the input");

        // In the window (in place at an offset): the library runs on it directly.
        let at = base as usize + 64;
        let call = prepare_raw(c, at, at, 100, Strategy::VendorSymmetric).unwrap();
        c.all_reduce(&call).unwrap();
        assert_eq!(
            vendor_log(),
            vec![VendorOp::AllReduce {
                comm: 1,
                input: base as usize + 64,
                output: base as usize + 64,
                n: 100,
            }]
        );
        // The plain vendor strategy takes the caller's buffers as they are.
        let call = prepare_on(c, &input, &mut output, Strategy::Vendor).unwrap();
        c.all_reduce(&call).unwrap();
        assert_eq!(
            vendor_log(),
            vec![VendorOp::AllReduce {
                comm: 1,
                input: inp as usize,
                output: out as usize,
                n: 700,
            }]
        );
    });
}

/// `abort` raises the abort word in every rank's workspace (what spinning kernels poll), and
/// every later call of every rank fails with the caller's reason.
#[test]
fn abort_raises_every_ranks_abort_word_and_fails_later_calls() {
    let config = GroupConfig::new(3).devices(vec![0, 1, 2]);
    let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
    let word = |r: usize| {
        let at = comms[0].group.peers[r] as usize + abi::ABORT_OFFSET;
        // SAFETY: the mock's workspaces are host memory, alive with the group.
        unsafe { (at as *const u32).read_volatile() }
    };
    assert!((0..3).all(|r| word(r) == 0));
    comms[1].abort("rank 1 aborted the group").unwrap();
    assert!((0..3).all(|r| word(r) == 1));
    let input = vec![1f32; 64];
    let mut output = vec![0f32; 64];
    for c in &comms {
        let call = prepare_on(c, &input, &mut output, Strategy::OneShot).unwrap();
        match c.all_reduce(&call) {
            Err(Error::Aborted { reason }) => assert_eq!(reason, "rank 1 aborted the group"),
            other => panic!("{other:?}"),
        }
    }
}

/// A group of one copies an exact call's input to its output (nothing to reduce) and
/// launches no kernel; in place it does nothing at all.
#[test]
fn a_group_of_one_copies_exact_calls() {
    let comms = GpuBackend::<Mock>::create_group(&GroupConfig::new(1).devices(vec![0])).unwrap();
    let c = &comms[0];
    take_launches();
    vendor_log();
    let input: Vec<f32> = (0..100).map(|i| i as f32 - 7.5).collect();
    let mut output = vec![0f32; 100];
    for s in [Strategy::Auto, Strategy::OneShot, Strategy::TwoShot] {
        output.fill(0.0);
        let call = prepare_on(c, &input, &mut output, s).unwrap();
        c.all_reduce(&call).unwrap();
        assert_eq!(output, input, "{s}");
        let (i, o) = (input.as_ptr() as u64, output.as_ptr() as u64);
        assert_eq!(
            vendor_log(),
            vec![VendorOp::Copy {
                dst: o,
                src: i,
                bytes: 400
            }]
        );
    }
    let at = output.as_mut_ptr() as usize;
    let call = prepare_raw(c, at, at, 100, Strategy::OneShot).unwrap();
    c.all_reduce(&call).unwrap();
    assert_eq!(vendor_log(), vec![]);
    assert!(take_launches().is_empty(), "no kernel for a group of one");
}

/// A vendor library without symmetric windows (too old, a missing symbol) leaves the plain
/// vendor strategy, says why for the symmetric one, and registers nothing.
#[test]
fn vendor_symmetric_says_why_it_is_unavailable() {
    let why = "NCCL 2.26.2 has no symmetric windows (2.27 or later)";
    with_vendor(why, || {
        let config = GroupConfig::new(2).devices(vec![0, 1]);
        let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
        assert_eq!(vendor_log(), vec![]);
        let c = &comms[0];
        let avail = |s| c.strategy_available(s, DType::F16, Precision::Exact);
        assert_eq!(avail(Strategy::Vendor), Ok(()));
        assert_eq!(avail(Strategy::VendorSymmetric), Err(why.to_string()));
        assert_eq!(c.vendor_window(), None);
        let input = vec![1f32; 64];
        let mut output = vec![0f32; 64];
        match prepare_on(c, &input, &mut output, Strategy::VendorSymmetric) {
            Err(Error::StrategyUnavailable { strategy, reason }) => {
                assert_eq!(strategy, Strategy::VendorSymmetric);
                assert_eq!(reason, why);
            }
            other => panic!("{other:?}"),
        }
    });
}

/// A group whose GPUs cannot reach each other (several hosts, or no P2P) builds, offers only
/// the vendor strategies, and `Auto` takes the vendor library at every size.
#[test]
fn without_peer_access_auto_takes_the_vendor_library() {
    with_vendor("", || {
        let config = GroupConfig::new(2)
            .devices(vec![0, 1])
            .topology(allreduce_core::Topology::parse("none", 2).unwrap());
        let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
        let c = &comms[0];
        for s in Strategy::CONCRETE {
            let ok = c
                .strategy_available(s, DType::BF16, Precision::Lossy(Codec::Fp8E4M3))
                .is_ok();
            assert_eq!(ok, s.is_vendor(), "{s}");
        }
        for n in [4usize, 1 << 16] {
            let input = vec![2f32; n];
            let mut output = vec![0f32; n];
            let call = prepare_on(c, &input, &mut output, Strategy::Auto).unwrap();
            assert_eq!(call.strategy, Strategy::Vendor, "{n} elements");
            c.all_reduce(&call).unwrap();
            assert_eq!(output, input);
        }
    });
}

/// Without peer access the group still builds, the custom kernels say why they cannot run,
/// and `Auto` never picks them; a forced topology is what the ranks report.
#[test]
fn no_peer_access_leaves_only_the_vendor_library() {
    let config = GroupConfig::new(2)
        .devices(vec![0, 1])
        .topology(allreduce_core::Topology::parse("none", 2).unwrap());
    let comms = GpuBackend::<Mock>::create_group(&config).expect("builds without peer access");
    for s in [Strategy::OneShot, Strategy::TwoShot] {
        let why = comms[0]
            .strategy_available(s, DType::BF16, Precision::Exact)
            .unwrap_err();
        assert!(why.contains("peer access"), "{why}");
    }
    let why = comms[1]
        .strategy_available(
            Strategy::QuantizedTwoShot,
            DType::BF16,
            Precision::Lossy(Codec::Fp8E4M3),
        )
        .unwrap_err();
    assert!(why.contains("peer access"), "{why}");
    assert!(comms[0].topology().forced);
    assert_eq!(comms[0].topology().missing_peer_access(), Some((0, 1)));

    let pcie = GroupConfig::new(4)
        .devices(vec![0, 1, 2, 3])
        .topology(allreduce_core::Topology::parse("pcie:2x2", 4).unwrap());
    let comms = GpuBackend::<Mock>::create_group(&pcie).unwrap();
    assert!(comms[2].topology().pcie_only());
    assert_eq!(
        comms[2].topology().numa_groups(),
        vec![vec![0, 1], vec![2, 3]]
    );
    assert_eq!(
        comms[2].strategy_available(Strategy::TwoShot, DType::F16, Precision::Exact),
        Ok(())
    );
}

/// A call larger than the workspace is launched as pieces of whole codec blocks, each with
/// the whole call's descriptor, the later ones marked as continuations.
#[test]
fn a_call_larger_than_the_workspace_runs_in_pieces() {
    let config = GroupConfig::new(2).devices(vec![0, 1]).max_bytes(1000); // rounded to 1024
    let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
    take_launches();
    let c = &comms[1];
    let n = 5 * 512 + 7; // bf16: 512 elements a piece (1024 bytes), 6 pieces
    let input = vec![0u16; n];
    let mut output = vec![0u16; n];
    let dev = Device::Rocm(1);
    // SAFETY: only addresses are used; the mock never touches the buffers.
    let (i, o) = unsafe {
        (
            BufRef::from_raw(input.as_ptr() as usize, n, DType::BF16, dev),
            BufMut::from_raw(output.as_mut_ptr() as usize, n, DType::BF16, dev),
        )
    };
    let opts = AllReduceOptions::default()
        .strategy(Strategy::QuantizedTwoShot)
        .precision(Precision::Lossy(Codec::Int4));
    let call = allreduce_core::prepare(
        Some(i),
        &o,
        &opts,
        &c.limits(),
        c.world_size(),
        c.selection(),
        |s, d, p| c.strategy_available(s, d, p),
    )
    .expect("GPU backends take calls larger than max_bytes");
    c.all_reduce(&call).unwrap();
    let l = take_launches();
    assert_eq!(l.len(), 6);
    let whole = describe(&call).0;
    for (k, p) in l.iter().enumerate() {
        assert_eq!(p.kernel, "ar_quantized_bf16_q4");
        assert_eq!(p.args.input as usize, input.as_ptr() as usize + k * 1024);
        assert_eq!(p.args.output as usize, output.as_ptr() as usize + k * 1024);
        assert_eq!(p.args.n, if k < 5 { 512 } else { 7 });
        let want = if k == 0 {
            whole
        } else {
            whole | Desc::CONTINUED
        };
        assert_eq!(p.args.desc, want, "piece {k}");
        assert_eq!(Desc(p.args.desc).len() as usize, n);
    }
}

/// Every round's messages, by rank, and the barrier the ranks meet at.
type Rounds = std::sync::Arc<(std::sync::Mutex<Vec<Vec<Vec<u8>>>>, std::sync::Barrier)>;

/// An in-process bootstrap: ranks are threads, all_gather meets at a barrier.
struct ThreadBootstrap {
    rank: usize,
    world: usize,
    shared: Rounds,
    round: usize,
    /// Rewrites this rank's message of a round (rank, round, message) before it is sent:
    /// a process of another build.
    tamper: Option<fn(usize, usize, &mut Vec<u8>)>,
}

impl Bootstrap for ThreadBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (store, barrier) = &*self.shared;
        {
            let mut s = store.lock().unwrap();
            if s.len() <= self.round {
                s.push(vec![Vec::new(); self.world]);
            }
            let mut data = data.to_vec();
            if let Some(tamper) = self.tamper {
                tamper(self.rank, self.round, &mut data);
            }
            s[self.round][self.rank] = data;
        }
        barrier.wait();
        let out = store.lock().unwrap()[self.round].clone();
        barrier.wait();
        self.round += 1;
        Ok(out)
    }
}

/// One process per rank (here: one thread per rank over an in-process bootstrap): every rank
/// maps every peer's exported workspace, derives the same grid from the gathered device ids,
/// warms only its own kernels, and reports the vendor library unavailable on every rank.
#[test]
fn ranks_built_one_per_process_map_each_other() {
    // Ranks 0 and 1 share device 0; rank 2 has device 1.
    let comms: Vec<GpuComm<Mock>> = form_processes(&[0, 0, 1], None)
        .into_iter()
        .map(|(comm, warm)| {
            let comm = comm.unwrap();
            // Only this rank's kernels, alone (world 1).
            assert_eq!(warm.len(), engine_kernels().len());
            assert!(warm.iter().all(|&w| w == 1));
            comm
        })
        .collect();
    // Two ranks on device 0 split its 20 units: 10 blocks on every rank.
    assert!(comms.iter().all(|c| c.grid() == 10));
    for (r, c) in comms.iter().enumerate() {
        let own = c.group.peers[r];
        for (p, other) in comms.iter().enumerate() {
            let theirs = other.group.peers[p];
            if p == r {
                continue;
            }
            // Our view of peer p is its exported base, mapped (+1 in the mock).
            assert_eq!(c.group.peers[p], theirs + 1, "rank {r}'s view of {p}");
        }
        assert_ne!(own, 0);
        let t = c.topology();
        assert_eq!(t.links[0][1], allreduce_core::Link::SameDevice);
        assert_eq!(t.links[0][2], allreduce_core::Link::Pcie);
        let v = c
            .strategy_available(Strategy::Vendor, DType::F16, Precision::Exact)
            .unwrap_err();
        assert!(v.contains("share a GPU"), "{v}");
        assert_eq!(
            c.strategy_available(Strategy::TwoShot, DType::F16, Precision::Exact),
            Ok(())
        );
    }
}

/// Forms a group of one process per rank (threads over an in-process bootstrap), rank `r` on
/// device `devices[r]`, where `tamper` rewrites messages as a process of another build would
/// send them: each rank's result and the world size of each launch its construction made.
fn form_processes(
    devices: &[u32],
    tamper: Option<fn(usize, usize, &mut Vec<u8>)>,
) -> Vec<(Result<GpuComm<Mock>>, Vec<u32>)> {
    let world = devices.len();
    let shared: Rounds = std::sync::Arc::new((
        std::sync::Mutex::new(Vec::new()),
        std::sync::Barrier::new(world),
    ));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let shared = shared.clone();
                s.spawn(move || {
                    let mut boot = ThreadBootstrap {
                        rank,
                        world,
                        shared,
                        round: 0,
                        tamper,
                    };
                    let config = GroupConfig::new(world).devices(vec![devices[rank]]);
                    let comm = GpuBackend::<Mock>::create_rank(&config, &mut boot);
                    let worlds = take_launches().iter().map(|l| l.args.world).collect();
                    (comm, worlds)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rewrites field `field` of a rank's first (shape) message to `value`.
fn set_shape_field(msg: &mut Vec<u8>, field: usize, value: &[u8]) {
    let mut fields: Vec<Vec<u8>> = unpack(msg, SHAPE_FIELDS, 0)
        .expect("the shape message")
        .iter()
        .map(|f| f.to_vec())
        .collect();
    fields[field] = value.to_vec();
    let refs: Vec<&[u8]> = fields.iter().map(|f| f.as_slice()).collect();
    *msg = pack(&refs);
}

/// A process whose workspace layout differs (another release) is refused by every rank,
/// itself included, before anything is mapped, with both releases named; no rank hangs.
#[test]
fn a_process_of_another_layout_is_refused_by_every_rank() {
    let results = form_processes(
        &[0, 1, 2],
        Some(|rank, round, msg| {
            if rank == 1 && round == 0 {
                set_shape_field(msg, 4, &(abi::LAYOUT_VERSION + 1).to_le_bytes());
                set_shape_field(msg, 6, b"9.9.9");
            }
        }),
    );
    for (r, (res, _)) in results.into_iter().enumerate() {
        match res {
            Err(Error::RankMismatch { what, detail, .. }) => {
                assert_eq!(what, "workspace layout", "rank {r}");
                assert!(detail.contains("rank 1 runs allreduce 9.9.9"), "{detail}");
                assert!(detail.contains(RELEASE), "{detail}");
            }
            Err(e) => panic!("rank {r}: {e}"),
            Ok(_) => panic!("rank {r} formed a group with a process of another layout"),
        }
    }
}

/// A message of an older release's shape (fewer fields) is a clear error, not a misread.
#[test]
fn a_group_message_of_another_shape_is_refused() {
    let results = form_processes(
        &[0, 1],
        Some(|rank, round, msg| {
            if rank == 0 && round == 0 {
                let fields = unpack(msg, SHAPE_FIELDS, 0).expect("the shape message");
                *msg = pack(&fields[..4]);
            }
        }),
    );
    for (r, (res, _)) in results.into_iter().enumerate() {
        let e = res
            .err()
            .unwrap_or_else(|| panic!("rank {r} formed a group"));
        assert!(
            e.to_string().contains("another allreduce release"),
            "rank {r}: {e}"
        );
    }
}

/// A rank whose kernels lack a codec format (a release without it) joins the group, and
/// every rank refuses, on every path, the codecs of that format, naming the rank; the other
/// formats and the exact strategies stay available, and no launch is made for the refusal.
#[test]
fn codecs_of_a_format_a_peer_lacks_are_refused_by_every_rank() {
    // Rank 2 speaks every format of this build but v1.
    let results = form_processes(
        &[0, 1, 2],
        Some(|rank, round, msg| {
            if rank == 2 && round == 0 {
                let mask = kernels::CODEC_FORMATS & !(1 << 1);
                set_shape_field(msg, 5, &mask.to_le_bytes());
            }
        }),
    );
    let comms: Vec<GpuComm<Mock>> = results.into_iter().map(|(r, _)| r.unwrap()).collect();
    for (r, comm) in comms.iter().enumerate() {
        for codec in Codec::ALL {
            let got = comm.strategy_available(
                Strategy::QuantizedTwoShot,
                DType::BF16,
                Precision::Lossy(codec),
            );
            let spoken = kernels::CODEC_FORMATS & (1 << codec.format()) != 0;
            match (codec.format(), got) {
                (1, Err(why)) => {
                    assert!(
                        why.contains("rank 2's allreduce release"),
                        "rank {r}: {why}"
                    )
                }
                (1, Ok(())) => panic!("rank {r}: {codec} allowed with rank 2 lacking v1"),
                (_, got) => assert_eq!(got.is_ok(), spoken, "rank {r}: {codec}: {got:?}"),
            }
        }
        assert_eq!(
            comm.strategy_available(Strategy::TwoShot, DType::BF16, Precision::Exact),
            Ok(())
        );
    }
    // A call prepared past that check (as a caller of the backend directly might) is refused
    // by the backend itself, before any launch.
    let c = &comms[0];
    let mut buf = vec![0u16; 1024];
    let dev = c.limits().device;
    // SAFETY: only addresses are used; the refused call never reaches the mock's kernels.
    let out = unsafe { BufMut::from_raw(buf.as_mut_ptr() as usize, 1024, DType::BF16, dev) };
    let opts = AllReduceOptions::default()
        .strategy(Strategy::QuantizedTwoShot)
        .precision(Precision::Lossy(Codec::Int8));
    let call = allreduce_core::prepare(
        None,
        &out,
        &opts,
        &c.limits(),
        c.world_size(),
        c.selection(),
        |_, _, _| Ok(()),
    )
    .unwrap();
    take_launches();
    match c.all_reduce(&call) {
        Err(Error::StrategyUnavailable { reason, .. }) => {
            assert!(reason.contains("rank 2's allreduce release"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(take_launches()
        .iter()
        .all(|l| !l.kernel.starts_with("ar_quant")));
}

// ---- The fused all-reduce + RMSNorm through the generic host side (gpu/fused.rs) ----------

fn fused_group(
    devices: Vec<u32>,
    config: &allreduce_core::FusedConfig,
) -> (Vec<GpuComm<Mock>>, Vec<Box<dyn allreduce_core::FusedComm>>) {
    let comms = group(devices);
    // Only the fused group's own launches from here on.
    take_launches();
    let fused = comms[0]
        .create_fused_group(config)
        .expect("fused group")
        .expect("the mock has fused kernels");
    (comms, fused)
}

#[test]
fn fused_workspaces_are_sized_filled_and_warmed_per_rank() {
    take_launches();
    FILLS.with(|f| f.borrow_mut().clear());
    let config = allreduce_core::FusedConfig::new(16, 1024, DType::BF16);
    let (comms, fused) = fused_group(vec![0, 1, 2, 3], &config);
    assert_eq!(fused.len(), 4);
    // (world + 1) slots of 16 x 1024 bf16, and the 128 bytes of call tags.
    let comm_bytes = 5 * 16 * 1024 * 2 + 128;
    for (r, f) in fused.iter().enumerate() {
        let m = f.metadata();
        assert_eq!((m.rank, m.world), (r, 4));
        assert_eq!(m.lamport_comm_size, comm_bytes);
        assert_eq!(m.buffer_size, 3 * comm_bytes + 1024);
        assert_eq!(m.blocks, 16);
    }
    // The group's push buffers first (f32 sentinel words for every dtype), then the fused
    // workspace's: bf16 Lamport buffers hold bf16, -0.0 is 0x8000 in every 16-bit word.
    let fills = FILLS.with(|f| std::mem::take(&mut *f.borrow_mut()));
    let push = (3 * crate::push::buffer_bytes(4), Fill::U32(0x8000_0000));
    assert_eq!(fills[..4], vec![push; 4]);
    assert_eq!(fills[4..], vec![(3 * comm_bytes, Fill::U16(0x8000)); 4]);
    let warm = take_launches();
    assert_eq!(warm.len(), 4 * 3);
    for (i, l) in warm.iter().enumerate() {
        let rank = i / 3;
        let want = [
            "ar_fused_oneshot_bf16_w4",
            "ar_fused_twoshot_bf16_w4",
            "ar_rmsnorm_bf16",
        ];
        assert_eq!(l.kernel, want[i % 3]);
        // One block per compute unit (20 in the mock), one rank per device, rounded down to
        // a multiple of 8 (clusters of up to 8 tile it).
        assert_eq!((l.grid, l.block, l.stream), (16, THREADS, 0));
        let a = l.fused();
        // Alone and empty: world 1, rank 0, no rows, only its own buffers.
        assert_eq!((a.world, a.rank, a.tokens, a.hidden), (1, 0, 0, 1024));
        assert_ne!(a.lamport[0], 0);
        assert!(a.lamport[1..].iter().all(|&p| p == 0));
        assert_eq!(a.ws[0], comms[rank].group.peers[rank]);
        assert!(a.ws[1..].iter().all(|&p| p == 0));
        assert_eq!(
            a.control,
            Mock::host_mapped_ptrs(comms[rank].group.control(rank)).1
        );
        assert_eq!(a.comm_bytes, comm_bytes as u64);
        assert_eq!(a.max_elems, 16 * 1024);
    }
}

#[test]
fn fused_calls_launch_the_chosen_kernel_with_every_ranks_buffers() {
    let config = allreduce_core::FusedConfig::new(16, 1024, DType::BF16);
    let (comms, fused) = fused_group(vec![0, 1, 2, 3], &config);
    let warm = take_launches();
    let lamports: Vec<u64> = warm
        .iter()
        .step_by(3)
        .map(|l| l.fused().lamport[0])
        .collect();
    let states: Vec<u64> = warm.iter().step_by(3).map(|l| l.fused().state).collect();
    let n = 8 * 1024;
    let (input, res_in) = (vec![0u16; n], vec![0u16; n]);
    let (mut res_out, mut norm_out, gamma) = (vec![0u16; n], vec![0u16; n], vec![0u16; 1024]);
    let dev = Device::Rocm(2);
    let view =
        |v: &[u16]| unsafe { BufRef::from_raw(v.as_ptr() as usize, v.len(), DType::BF16, dev) };
    let view_mut = |v: &mut [u16]| unsafe {
        BufMut::from_raw(v.as_mut_ptr() as usize, v.len(), DType::BF16, dev)
    };
    let args = allreduce_core::FusedArgs::new(FusedPattern::ResidualRmsNorm, 8, view(&input))
        .residual(view(&res_in), Some(view_mut(&mut res_out)))
        .rms_norm(view(&gamma), 1e-5, Some(view_mut(&mut norm_out)))
        .strategy(Strategy::TwoShot)
        .stream(Stream::from_raw(0x77 as *mut c_void));
    let table = allreduce_core::fused::default_table();
    let call =
        allreduce_core::fused::prepare_fused(&args, fused[2].metadata(), &table, dev, 16).unwrap();
    fused[2].run(&call).unwrap();
    let l = take_launches().pop().expect("one launch");
    assert_eq!(
        (l.kernel, l.grid, l.block, l.stream),
        ("ar_fused_twoshot_bf16_w4", 16, THREADS, 0x77)
    );
    let a = l.fused();
    assert_eq!((a.rank, a.world, a.tokens, a.hidden), (2, 4, 8, 1024));
    assert_eq!(
        (a.pattern, a.eps),
        (FusedPattern::ResidualRmsNorm.code(), 1e-5)
    );
    assert_eq!(a.input, input.as_ptr() as u64);
    assert_eq!(a.residual_in, res_in.as_ptr() as u64);
    assert_eq!(a.residual_out, res_out.as_ptr() as u64);
    assert_eq!(a.norm_out, norm_out.as_ptr() as u64);
    assert_eq!(a.gamma, gamma.as_ptr() as u64);
    assert_eq!((a.allreduce_out, a.quant_out, a.scale), (0, 0, 0));
    // Every rank's Lamport buffer in rank order, this rank's state and Control.
    assert_eq!(&a.lamport[..4], &lamports[..]);
    assert!(a.lamport[4..].iter().all(|&p| p == 0));
    assert_eq!(a.ws, comms[2].group.peers);
    assert_eq!(a.state, states[2]);
    assert_eq!(
        a.control,
        Mock::host_mapped_ptrs(comms[2].group.control(2)).1
    );
    assert_eq!(a.timeout_ns, comms[2].group.timeout.as_nanos() as u64);

    // Beyond the workspace: refused on the host, nothing launched.
    let (big, mut big_out) = (vec![0u16; 17 * 1024], vec![0u16; 17 * 1024]);
    let args = allreduce_core::FusedArgs::new(FusedPattern::AllReduce, 17, view(&big))
        .allreduce_out(view_mut(&mut big_out));
    let e = allreduce_core::fused::prepare_fused(&args, fused[2].metadata(), &table, dev, 16)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::WorkspaceExceeded {
                what: "tokens",
                requested: 17,
                max: 16
            }
        ),
        "{e}"
    );
    // A strategy the fused kernels do not have, even past validation.
    let mut odd = call;
    odd.strategy = Strategy::QuantizedTwoShot;
    assert!(matches!(
        fused[2].run(&odd),
        Err(Error::StrategyUnavailable { .. })
    ));
    assert!(take_launches().is_empty());
}

#[test]
fn fused_worlds_without_an_instance_use_the_generic_kernels_and_f32_lamport_words() {
    take_launches();
    FILLS.with(|f| f.borrow_mut().clear());
    // Three ranks, two on device 0: the generic instance, and 20 units split two ways.
    let config = allreduce_core::FusedConfig::new(4, 256, DType::F32);
    let (_comms, fused) = fused_group(vec![0, 0, 1], &config);
    let comm_bytes = 4 * 4 * 256 * 4 + 128;
    let fills = FILLS.with(|f| std::mem::take(&mut *f.borrow_mut()));
    // After the group's push buffers.
    assert_eq!(
        fills[3..],
        vec![(3 * comm_bytes, Fill::U32(0x8000_0000)); 3]
    );
    let warm = take_launches();
    let kernels: Vec<&str> = warm.iter().map(|l| l.kernel).collect();
    assert_eq!(
        &kernels[..3],
        [
            "ar_fused_oneshot_f32_w0",
            "ar_fused_twoshot_f32_w0",
            "ar_rmsnorm_f32"
        ]
    );
    // Two ranks share device 0: 10 blocks each, rounded down to 8.
    assert!(warm.iter().all(|l| l.grid == 8));
    // The mock's device memory is host memory: every word reads -0.0 until a kernel writes.
    let lamport = warm[0].fused().lamport[0] as *const u32;
    // SAFETY: the rank's Lamport allocation, alive while `fused` is.
    let words = unsafe { std::slice::from_raw_parts(lamport, 3 * comm_bytes / 4) };
    assert!(words.iter().all(|&w| w == 0x8000_0000));
    assert_eq!(f32::from_bits(words[0]), -0.0);
    drop(fused);
    assert_eq!(
        super::super::fused::kernel_names::<Mock>(8)[1],
        [
            "ar_fused_twoshot_f32_w8",
            "ar_fused_twoshot_f16_w8",
            "ar_fused_twoshot_bf16_w8"
        ]
    );
}

#[test]
fn the_unfused_norm_kernel_checks_rows_and_clamps_its_grid() {
    use crate::fused::{NormBuffers, RmsNormKernel};
    take_launches();
    let k = RmsNormKernel::<Mock>::from_module(()).unwrap();
    let bufs = NormBuffers {
        input: 0x1000,
        gamma: 0x2000,
        ..Default::default()
    };
    // SAFETY: the mock records launches and touches nothing.
    unsafe {
        k.launch(
            DType::F16,
            FusedPattern::ResidualRmsNorm,
            &bufs,
            100,
            4096,
            1e-6,
            36,
            Stream::NULL,
        )
        .unwrap();
        k.launch(
            DType::F16,
            FusedPattern::AllReduce,
            &bufs,
            0,
            4096,
            1e-6,
            36,
            Stream::NULL,
        )
        .unwrap();
        let e = k
            .launch(
                DType::F16,
                FusedPattern::ResidualRmsNorm,
                &bufs,
                1,
                4100,
                1e-6,
                36,
                Stream::NULL,
            )
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    let l = take_launches();
    assert_eq!(l.len(), 2);
    assert_eq!(
        (l[0].kernel, l[0].grid, l[1].grid),
        ("ar_rmsnorm_f16", 36, 1)
    );
    let a = l[0].fused();
    assert_eq!(
        (a.input, a.gamma, a.tokens, a.hidden, a.world),
        (0x1000, 0x2000, 100, 4096, 1)
    );
}

#[test]
fn small_one_shot_calls_take_the_cluster_kernel_where_the_device_has_clusters() {
    CLUSTERS.with(|c| c.set(true));
    let hidden = 8192;
    let config = allreduce_core::FusedConfig::new(64, hidden, DType::BF16);
    // Two ranks on two devices of 20 compute units: 16 blocks per launch.
    let (_comms, fused) = fused_group(vec![0, 1], &config);
    let warm = take_launches();
    // Warm-up runs the split kernel too (no rows, clusters of 2), so call counts stay equal.
    let split: Vec<&Launch> = warm.iter().filter(|l| l.cluster != 0).collect();
    assert_eq!(split.len(), 2);
    assert!(split
        .iter()
        .all(|l| l.kernel == "ar_fused_oneshot_split_bf16_w2" && l.cluster == 2 && l.grid == 16));
    let n = 64 * hidden;
    let (input, res_in) = (vec![0u16; n], vec![0u16; n]);
    let (mut res_out, mut norm_out, gamma) = (vec![0u16; n], vec![0u16; n], vec![0u16; hidden]);
    let dev = Device::Rocm(0);
    let table = allreduce_core::fused::default_table();
    // Hidden 8192 bf16 is two 512-vector slots: clusters of 8 up to 2 rows (2 x 8 <= 16),
    // 4 for 3-4 rows, 2 for 5-8, then the one-block one-shot; two-shot never splits.
    for (tokens, strategy, want) in [
        (1, Strategy::OneShot, Some(8)),
        (2, Strategy::OneShot, Some(8)),
        (3, Strategy::OneShot, Some(4)),
        (8, Strategy::OneShot, Some(2)),
        (9, Strategy::OneShot, None),
        (4, Strategy::TwoShot, None),
    ] {
        let m = tokens * hidden;
        // SAFETY (views): prefixes of live vectors, used only by the mock's records.
        let view = |v: &[u16]| unsafe {
            BufRef::from_raw(v.as_ptr() as usize, m.min(v.len()), DType::BF16, dev)
        };
        let view_mut = |v: &mut [u16]| unsafe {
            BufMut::from_raw(v.as_mut_ptr() as usize, m, DType::BF16, dev)
        };
        let args =
            allreduce_core::FusedArgs::new(FusedPattern::ResidualRmsNorm, tokens, view(&input))
                .residual(view(&res_in), Some(view_mut(&mut res_out)))
                .rms_norm(view(&gamma), 1e-6, Some(view_mut(&mut norm_out)))
                .strategy(strategy);
        let call =
            allreduce_core::fused::prepare_fused(&args, fused[0].metadata(), &table, dev, 16)
                .unwrap();
        fused[0].run(&call).unwrap();
        let l = take_launches().pop().expect("one launch");
        let got = (l.cluster != 0).then_some(l.cluster);
        assert_eq!(got, want, "{tokens} tokens, {strategy:?}");
        assert_eq!(l.grid, 16);
        let split = l.kernel.contains("split");
        assert_eq!(split, want.is_some(), "{}", l.kernel);
        assert_eq!(l.fused().tokens, tokens as u32);
    }
    // Auto's default table takes the one-shot as far as the cluster kernel goes: 8 rows of
    // 8192 bf16 here (clusters of 2 over 16 blocks), then the byte rules.
    let t = fused[0]
        .default_table()
        .expect("a table of the workspace's own");
    let r = &t.rules[0];
    assert_eq!(
        (r.world, r.max_bytes, r.strategy),
        ((2, 2), 8 * hidden * 2, Strategy::OneShot)
    );
    assert_eq!(
        &t.rules[1..],
        &allreduce_core::fused::default_table().rules[..]
    );
    CLUSTERS.with(|c| c.set(false));
    let (_comms, fused) = fused_group(vec![0, 1], &config);
    assert!(
        fused[0].default_table().is_none(),
        "no clusters, no rule of its own"
    );
}

#[test]
fn fused_calls_launch_dependent_where_every_device_has_pdl() {
    let hidden = 1024;
    let tokens = 4;
    let m = tokens * hidden;
    let input = vec![0u16; m];
    let mut out = vec![0u16; m];
    let dev = Device::Rocm(0);
    // One call on rank 0; (the workspace's pdl, the call's launch was dependent, any warm-up
    // launch was).
    let mut run = |config: allreduce_core::FusedConfig| {
        let (_comms, fused) = fused_group(vec![0, 1], &config);
        let warm = take_launches();
        // SAFETY (views): live vectors, used only by the mock's records.
        let args = allreduce_core::FusedArgs::new(FusedPattern::AllReduce, tokens, unsafe {
            BufRef::from_raw(input.as_ptr() as usize, m, DType::BF16, dev)
        })
        .allreduce_out(unsafe { BufMut::from_raw(out.as_mut_ptr() as usize, m, DType::BF16, dev) })
        .strategy(Strategy::OneShot);
        let table = allreduce_core::fused::default_table();
        let call =
            allreduce_core::fused::prepare_fused(&args, fused[0].metadata(), &table, dev, 16)
                .unwrap();
        fused[0].run(&call).unwrap();
        let l = take_launches().pop().expect("one launch");
        (fused[0].metadata().pdl, l.pdl, warm.iter().any(|l| l.pdl))
    };
    PDL.with(|c| c.set(true));
    let config = allreduce_core::FusedConfig::new(16, hidden, DType::BF16);
    // The warm-up launches alone on the device: ordinary launches.
    assert_eq!(run(config.clone()), (true, true, false));
    assert_eq!(run(config.clone().pdl(false)), (false, false, false));
    PDL.with(|c| c.set(false));
    assert_eq!(run(config.clone()), (false, false, false));
    assert_eq!(
        run(config.pdl(true)),
        (false, false, false),
        "asked, but no device has it"
    );
}

#[test]
fn the_fused_grid_is_refused_past_co_residency() {
    use crate::fused::blocks_setting;
    // 8 ranks on 132 SMs: one block per SM for them together is 16 per rank.
    let env = "ALLREDUCE_FUSED_BLOCKS";
    assert_eq!(blocks_setting("16", env, 8, 132).unwrap(), 16);
    assert_eq!(blocks_setting(" 12 ", env, 8, 132).unwrap(), 12);
    for bad in ["17", "32", "0", "-1", "x", ""] {
        let e = blocks_setting(bad, env, 8, 132).unwrap_err().to_string();
        assert!(e.contains(env) && e.contains("1 to 16"), "{bad}: {e}");
    }
    // More ranks than SMs still leave one block each.
    assert_eq!(blocks_setting("1", env, 8, 4).unwrap(), 1);
    // One rank per GPU: the per-block state caps it.
    assert_eq!(blocks_setting("64", env, 1, 132).unwrap(), 64);
    assert!(blocks_setting("65", env, 1, 132).is_err());
}

#[test]
fn a_workspace_launches_the_grid_its_config_names() {
    take_launches();
    // Four ranks on four mock devices of 20 units: 20 blocks at most.
    let config = allreduce_core::FusedConfig::new(16, 1024, DType::BF16).blocks(12);
    let (_comms, fused) = fused_group(vec![0, 1, 2, 3], &config);
    assert!(fused.iter().all(|f| f.metadata().blocks == 12));
    let warm = take_launches();
    assert_eq!(warm.len(), 4 * 3);
    // The two fused kernels take the grid; the unfused norm kernel's warm-up keeps its own.
    for l in warm.iter().filter(|l| l.kernel.starts_with("ar_fused")) {
        assert_eq!(l.grid, 12, "{}", l.kernel);
    }
    let comms = group(vec![0, 1, 2, 3]);
    let too_many = allreduce_core::FusedConfig::new(16, 1024, DType::BF16).blocks(21);
    let Err(e) = comms[0].create_fused_group(&too_many) else {
        panic!("21 blocks on 20 units");
    };
    let e = e.to_string();
    assert!(e.contains("blocks=\"21\"") && e.contains("1 to 20"), "{e}");
    // The config's own bounds hold on every backend.
    assert!(allreduce_core::FusedConfig::new(16, 1024, DType::BF16)
        .blocks(65)
        .validate()
        .is_err());
}

/// The kernels the engine looks up are exactly the table's engine kernels: so every one is
/// compiled (the compile tests check that the table's are exported), and the table lists none
/// the engine has stopped using.
#[test]
fn the_engine_looks_up_exactly_the_tables_engine_kernels() {
    LOOKED_UP.with(|l| l.borrow_mut().clear());
    CLUSTERS.with(|c| c.set(true));
    // Worlds 2 and 4 have their own fused instances, 3 the generic one.
    for devices in [vec![0, 1], vec![0, 1, 2, 3], vec![0, 1, 2]] {
        let config = allreduce_core::FusedConfig::new(16, 1024, DType::BF16);
        drop(fused_group(devices, &config));
    }
    CLUSTERS.with(|c| c.set(false));
    crate::fused::RmsNormKernel::<Mock>::from_module(()).unwrap();
    let mut looked_up: Vec<String> = LOOKED_UP.with(|l| std::mem::take(&mut *l.borrow_mut()));
    // The mock refuses more than 6 ranks: world 8's names, from what the fused group asks.
    looked_up.extend(crate::fused::kernel_names::<Mock>(8).into_iter().flatten());
    looked_up.extend(crate::fused::split_kernel_names::<Mock>(8));
    looked_up.extend(crate::push::kernel_set::<Mock>(8).map(Kernel::name));
    looked_up.sort();
    looked_up.dedup();
    let mut engine: Vec<String> = kernels::all(Vendor::Cuda)
        .into_iter()
        .filter(|k| k.engine())
        .map(|k| k.name())
        .collect();
    engine.sort();
    assert_eq!(looked_up, engine);
}

// ---- Registered inputs ------------------------------------------------------------------

/// `n` elements of `dtype` from `input` to `output` on `c`, prepared as the facade would.
fn prepared(
    c: &GpuComm<Mock>,
    input: usize,
    output: usize,
    n: usize,
    dtype: DType,
    opts: AllReduceOptions,
) -> Call {
    let dev = c.limits().device;
    // SAFETY: only addresses are used; the mock never touches the buffers.
    let (i, o) = unsafe {
        (
            BufRef::from_raw(input, n, dtype, dev),
            BufMut::from_raw(output, n, dtype, dev),
        )
    };
    let input = (input != output).then_some(i);
    allreduce_core::prepare(
        input,
        &o,
        &opts,
        &c.limits(),
        c.world_size(),
        c.selection(),
        |s, d, p| c.strategy_available(s, d, p),
    )
    .unwrap()
}

/// One 16-byte aligned host range per rank, standing in for device memory.
fn ranges(world: usize, bytes: usize) -> (Vec<Vec<u128>>, Vec<RegisteredRange>) {
    let mems: Vec<Vec<u128>> = (0..world).map(|_| vec![0u128; bytes / 16]).collect();
    let ranges = mems
        .iter()
        .map(|m| RegisteredRange {
            addr: m.as_ptr() as usize,
            bytes,
        })
        .collect();
    (mems, ranges)
}

#[test]
fn a_registered_input_takes_the_registered_kernels_with_every_ranks_input() {
    let comms = group(vec![0, 1, 2, 3]);
    let (_mems, ranges) = ranges(4, 1 << 16);
    let id = comms[0].register_group(&ranges).unwrap();
    take_launches();
    let c = &comms[2];
    let out = vec![0u128; 1 << 12];
    let n = 1000;
    for (strategy, kernel) in [
        (Strategy::OneShot, "ar_oneshot_registered_bf16"),
        (Strategy::TwoShot, "ar_twoshot_registered_bf16"),
    ] {
        for offset in [0usize, 4096 + 32] {
            let opts = AllReduceOptions::default().strategy(strategy);
            let call = prepared(
                c,
                ranges[2].addr + offset,
                out.as_ptr() as usize,
                n,
                DType::BF16,
                opts,
            );
            c.all_reduce(&call).unwrap();
            let l = take_launches().pop().expect("one launch");
            assert_eq!(l.kernel, kernel);
            let r = l.registered();
            assert_eq!(r.a.input as usize, ranges[2].addr + offset);
            assert_eq!(r.a.output as usize, out.as_ptr() as usize);
            assert_eq!((r.a.rank, r.a.world, r.a.n), (2, 4, n as u64));
            for (k, range) in ranges.iter().enumerate() {
                assert_eq!(r.inputs[k] as usize, range.addr + offset, "rank {k}");
            }
            assert!(r.inputs[4..].iter().all(|&p| p == 0));
            let d = Desc(r.a.desc);
            assert!(d.registered());
            assert_eq!(d.0, describe(&call).0 | Desc::REGISTERED);
            assert_eq!(Desc2(r.desc2), Desc2::new(id.0, offset));
            assert_eq!(
                (Desc2(r.desc2).id(), Desc2(r.desc2).offset()),
                (id.0, offset as u64)
            );
            assert!(Desc(r.desc2).is_desc2() && !d.is_desc2());
        }
    }
}

#[test]
fn registered_calls_of_any_size_take_the_registered_path_by_default() {
    assert_eq!(GroupConfig::DEFAULT_REGISTERED_MIN_BYTES, 0);
    let comms = GpuBackend::<Mock>::create_group(&GroupConfig::new(2).devices(vec![0, 1])).unwrap();
    let (_mems, ranges) = ranges(2, 4096);
    comms[0].register_group(&ranges).unwrap();
    take_launches();
    let out = [0u128; 1];
    let opts = AllReduceOptions::default().strategy(Strategy::OneShot);
    let call = prepared(
        &comms[1],
        ranges[1].addr,
        out.as_ptr() as usize,
        4,
        DType::F32,
        opts,
    );
    comms[1].all_reduce(&call).unwrap();
    assert_eq!(take_launches()[0].kernel, "ar_oneshot_registered_f32");
}

#[test]
fn registered_calls_below_the_threshold_stay_staged() {
    // Thresholds set in the config: the bytes of the call decide, the same on every rank.
    for (config, min) in [
        (
            GroupConfig::new(2)
                .devices(vec![0, 1])
                .registered_min_bytes(1 << 20),
            1 << 20,
        ),
        (
            GroupConfig::new(2)
                .devices(vec![0, 1])
                .registered_min_bytes(4096),
            4096,
        ),
    ] {
        let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
        let (_mems, ranges) = ranges(2, 2 << 20);
        comms[0].register_group(&ranges).unwrap();
        take_launches();
        let c = &comms[1];
        let out = vec![0u128; (2 << 20) / 16];
        for (bytes, kernel) in [
            (min - 4, "ar_oneshot_f32"),
            (min, "ar_oneshot_registered_f32"),
        ] {
            let opts = AllReduceOptions::default().strategy(Strategy::OneShot);
            let n = bytes / 4;
            let call = prepared(
                c,
                ranges[1].addr,
                out.as_ptr() as usize,
                n,
                DType::F32,
                opts,
            );
            c.all_reduce(&call).unwrap();
            assert_eq!(
                take_launches()[0].kernel,
                kernel,
                "{bytes} bytes, min {min}"
            );
        }
    }
}

#[test]
fn in_place_lossy_and_unregistered_calls_stay_staged() {
    let comms = group(vec![0, 1]);
    let (_mems, mut ranges) = ranges(2, 1 << 16);
    // Only the first half registered: the second is this rank's memory, but not registered.
    for r in &mut ranges {
        r.bytes = 1 << 15;
    }
    comms[0].register_group(&ranges).unwrap();
    take_launches();
    let c = &comms[1];
    let out = vec![0u128; 1 << 12];
    let other = vec![0u128; 1 << 12];
    let exact = |s| AllReduceOptions::default().strategy(s);
    let cases = [
        // In place on registered memory.
        (
            ranges[1].addr,
            ranges[1].addr,
            exact(Strategy::OneShot),
            "ar_oneshot_f16",
        ),
        // Not registered.
        (
            other.as_ptr() as usize,
            out.as_ptr() as usize,
            exact(Strategy::TwoShot),
            "ar_twoshot_f16",
        ),
        // Lossy.
        (
            ranges[1].addr,
            out.as_ptr() as usize,
            exact(Strategy::QuantizedTwoShot).precision(Precision::Lossy(Codec::Int8)),
            "ar_quantized_f16_q8",
        ),
        // Registered on rank 0's range, not this rank's.
        (
            ranges[0].addr,
            out.as_ptr() as usize,
            exact(Strategy::OneShot),
            "ar_oneshot_f16",
        ),
        // Running past the end of the range.
        (
            ranges[1].addr + (1 << 15) - 64,
            out.as_ptr() as usize,
            exact(Strategy::OneShot),
            "ar_oneshot_f16",
        ),
    ];
    for (input, output, opts, kernel) in cases {
        let call = prepared(c, input, output, 1024, DType::F16, opts);
        c.all_reduce(&call).unwrap();
        let l = take_launches().pop().expect("one launch");
        assert_eq!(l.kernel, kernel);
        assert_eq!(l.raw.len(), size_of::<Args>());
        assert!(!Desc(l.args.desc).registered());
    }
}

#[test]
fn registrations_of_the_wrong_count_or_size_are_refused_and_deregistration_restages() {
    let comms = group(vec![0, 1, 2]);
    let (_mems, good) = ranges(3, 4096);
    assert!(comms[0].register_group(&good[..2]).is_err());
    let mut uneven = good.clone();
    uneven[1].bytes = 2048;
    assert!(comms[1].register_group(&uneven).is_err());
    let mut misaligned = good.clone();
    misaligned[2].addr += 8;
    assert!(matches!(
        comms[2].register_group(&misaligned),
        Err(Error::Misaligned { .. })
    ));

    // Registered through any rank, for the whole group.
    let id = comms[1].register_group(&good).unwrap();
    let out = vec![0u128; 256];
    let opts = AllReduceOptions::default().strategy(Strategy::OneShot);
    let call = prepared(
        &comms[0],
        good[0].addr,
        out.as_ptr() as usize,
        512,
        DType::F32,
        opts,
    );
    take_launches();
    comms[0].all_reduce(&call).unwrap();
    assert_eq!(take_launches()[0].kernel, "ar_oneshot_registered_f32");
    comms[2].deregister_group(id).unwrap();
    assert!(comms[0].deregister_group(id).is_err(), "already gone");
    comms[0].all_reduce(&call).unwrap();
    assert_eq!(take_launches()[0].kernel, "ar_oneshot_f32");
}

#[test]
fn registered_one_shot_runs_whole_and_two_shot_in_pieces_past_the_workspace() {
    let config = GroupConfig::new(2)
        .registered_min_bytes(0)
        .devices(vec![0, 1])
        .max_bytes(1000); // rounded to 1024
    let comms = GpuBackend::<Mock>::create_group(&config).unwrap();
    let (_mems, ranges) = ranges(2, 1 << 14);
    let id = comms[0].register_group(&ranges).unwrap();
    take_launches();
    let c = &comms[1];
    let n = 5 * 512 + 7; // bf16: 512 elements a piece (1024 bytes), 6 pieces
    let out = vec![0u128; 1 << 10];
    let offset = 64;
    let one = AllReduceOptions::default().strategy(Strategy::OneShot);
    let call = prepared(
        c,
        ranges[1].addr + offset,
        out.as_ptr() as usize,
        n,
        DType::BF16,
        one,
    );
    c.all_reduce(&call).unwrap();
    let l = take_launches();
    assert_eq!(l.len(), 1, "no staging, no pieces");
    assert_eq!(l[0].registered().a.n, n as u64);

    let two = AllReduceOptions::default().strategy(Strategy::TwoShot);
    let call = prepared(
        c,
        ranges[1].addr + offset,
        out.as_ptr() as usize,
        n,
        DType::BF16,
        two,
    );
    c.all_reduce(&call).unwrap();
    let l = take_launches();
    assert_eq!(l.len(), 6);
    let whole = describe(&call).0 | Desc::REGISTERED;
    for (k, p) in l.iter().enumerate() {
        assert_eq!(p.kernel, "ar_twoshot_registered_bf16");
        let r = p.registered();
        assert_eq!(r.a.n, if k < 5 { 512 } else { 7 });
        assert_eq!(r.a.output as usize, out.as_ptr() as usize + k * 1024);
        for (rank, range) in ranges.iter().enumerate() {
            assert_eq!(r.inputs[rank] as usize, range.addr + offset + k * 1024);
        }
        let want = if k == 0 {
            whole
        } else {
            whole | Desc::CONTINUED
        };
        assert_eq!(r.a.desc, want, "piece {k}");
        // The whole call's registration and offset on every piece.
        assert_eq!(Desc2(r.desc2), Desc2::new(id.0, offset));
    }
}

#[test]
fn collective_allocations_are_registered_per_device_and_deregister_on_drop() {
    let comms = group(vec![0, 1, 1]);
    assert!(comms[0].alloc_registered_group(0).is_err());
    let mems = comms[0].alloc_registered_group(4096).unwrap();
    assert_eq!(mems.len(), 3);
    let devices: Vec<Device> = mems.iter().map(|m| m.device).collect();
    assert_eq!(devices, [Device::Rocm(0), Device::Rocm(1), Device::Rocm(1)]);
    assert!(mems.iter().all(|m| m.bytes == 4096 && m.id == mems[0].id));
    let out = vec![0u128; 256];
    let opts = AllReduceOptions::default().strategy(Strategy::TwoShot);
    let call = prepared(
        &comms[2],
        mems[2].addr + 16,
        out.as_ptr() as usize,
        100,
        DType::F32,
        opts,
    );
    take_launches();
    comms[2].all_reduce(&call).unwrap();
    let l = take_launches().pop().unwrap();
    assert_eq!(l.kernel, "ar_twoshot_registered_f32");
    assert_eq!(l.registered().inputs[0] as usize, mems[0].addr + 16);
    // Dropping any rank's buffer deregisters the allocation for all.
    let id = mems[0].id;
    let mut mems = mems;
    mems.remove(0);
    assert!(comms[0].deregister_group(id).is_err());
    comms[2].all_reduce(&call).unwrap();
    assert_eq!(take_launches().pop().unwrap().kernel, "ar_twoshot_f32");
}

#[test]
fn registered_mismatches_name_the_path_or_the_registration() {
    let comms = group(vec![0, 1]);
    let staged = Desc::new(100, 2, 1, 0);
    let registered = Desc(staged.0 | Desc::REGISTERED);
    let report = |mine: u64, theirs: u64| {
        write_control(
            &comms[0],
            0,
            Control {
                error: abi::ERROR_MISMATCH,
                rank: 1,
                mine,
                theirs,
                ..Default::default()
            },
        );
        match comms[0].synchronize(Stream::NULL) {
            Err(Error::RankMismatch { what, detail, .. }) => (what, detail),
            other => panic!("{other:?}"),
        }
    };
    let (what, detail) = report(registered.0, staged.0);
    assert_eq!(what, "path");
    assert_eq!(
        detail,
        "rank 0 has a registered input, rank 1 has a staged input"
    );
    let (what, detail) = report(Desc2::new(3, 64).0, Desc2::new(3, 128).0);
    assert_eq!(what, "registered input");
    assert_eq!(
        detail,
        "rank 0 reads registration 3 at offset 64, rank 1 registration 3 at offset 128"
    );
    // Reported, cleared: the group is intact.
    comms[0].synchronize(Stream::NULL).unwrap();
}

/// Rank `rank`'s row `slot` of its graph slot table, as the kernels would read it.
fn slot_row(c: &GpuComm<Mock>, slot: usize) -> Vec<u64> {
    let table = c.group.slot_tables[c.rank].as_ref().expect("local");
    table[slot * MAX_WORLD..(slot + 1) * MAX_WORLD].to_vec()
}

#[test]
fn captured_calls_on_unregistered_inputs_take_graph_slots_filled_by_registration() {
    let comms = group(vec![0, 1, 2]);
    let ins: Vec<Vec<u128>> = (0..3).map(|_| vec![0u128; 256]).collect();
    let out = vec![0u128; 256];
    let call = |c: &GpuComm<Mock>, strategy, n| {
        let opts = AllReduceOptions::default().strategy(strategy);
        let input = ins[c.rank].as_ptr() as usize;
        prepared(c, input, out.as_ptr() as usize, n, DType::F16, opts)
    };
    take_launches();
    // Off, or on but not capturing: staged, as before.
    CAPTURING.with(|c| c.set(true));
    comms[0]
        .all_reduce(&call(&comms[0], Strategy::OneShot, 64))
        .unwrap();
    assert_eq!(take_launches()[0].kernel, "ar_oneshot_f16");
    for c in &comms {
        c.set_graph_registration(true).unwrap();
    }
    CAPTURING.with(|c| c.set(false));
    comms[0]
        .all_reduce(&call(&comms[0], Strategy::OneShot, 64))
        .unwrap();
    assert_eq!(take_launches()[0].kernel, "ar_oneshot_f16");

    // Captured: two calls per rank, each on the next slot, with no inputs yet.
    CAPTURING.with(|c| c.set(true));
    for c in &comms {
        for (k, (strategy, kernel)) in [
            (Strategy::OneShot, "ar_oneshot_registered_f16"),
            (Strategy::TwoShot, "ar_twoshot_registered_f16"),
        ]
        .into_iter()
        .enumerate()
        {
            c.all_reduce(&call(c, strategy, 64 + k)).unwrap();
            let l = take_launches().pop().expect("one launch");
            assert_eq!(l.kernel, kernel);
            let r = l.registered();
            assert!(r.inputs.iter().all(|&p| p == 0));
            assert_eq!(r.slot, c.group.slot_row(c.rank, k));
            assert_eq!(Desc2(r.desc2), Desc2::graph_slot(k));
            assert!(Desc(r.a.desc).registered());
        }
        // In place or lossy: never a slot.
        let inplace = prepared(
            c,
            out.as_ptr() as usize,
            out.as_ptr() as usize,
            64,
            DType::F16,
            AllReduceOptions::default().strategy(Strategy::OneShot),
        );
        c.all_reduce(&inplace).unwrap();
        assert_eq!(take_launches()[0].kernel, "ar_oneshot_f16");
    }
    CAPTURING.with(|c| c.set(false));
    assert!(
        slot_row(&comms[1], 0).iter().all(|&w| w == 0),
        "zero until registered"
    );

    assert_eq!(comms[0].register_graph_buffers_group().unwrap(), 2);
    for c in &comms {
        for k in 0..2 {
            let row = slot_row(c, k);
            for (r, input) in ins.iter().enumerate() {
                assert_eq!(row[r], input.as_ptr() as u64, "rank {}'s row {k}", c.rank);
            }
            assert!(row[3..].iter().all(|&w| w == 0));
        }
    }
    // Nothing pending any more; the next capture takes the next slots.
    assert_eq!(comms[2].register_graph_buffers_group().unwrap(), 0);
    CAPTURING.with(|c| c.set(true));
    comms[1]
        .all_reduce(&call(&comms[1], Strategy::OneShot, 8))
        .unwrap();
    CAPTURING.with(|c| c.set(false));
    assert_eq!(
        take_launches()[0].registered().slot,
        comms[1].group.slot_row(1, 2)
    );
}

#[test]
fn ranks_that_captured_different_calls_cannot_register_them() {
    let comms = group(vec![0, 1]);
    let ins: Vec<Vec<u128>> = (0..2).map(|_| vec![0u128; 64]).collect();
    let out = vec![0u128; 64];
    for c in &comms {
        c.set_graph_registration(true).unwrap();
    }
    CAPTURING.with(|c| c.set(true));
    let opts = || AllReduceOptions::default().strategy(Strategy::OneShot);
    for (rank, n) in [(0, 16), (1, 16), (0, 16)] {
        let c = &comms[rank];
        let call = prepared(
            c,
            ins[rank].as_ptr() as usize,
            out.as_ptr() as usize,
            n,
            DType::F32,
            opts(),
        );
        c.all_reduce(&call).unwrap();
    }
    CAPTURING.with(|c| c.set(false));
    match comms[0].register_graph_buffers_group() {
        Err(Error::RankMismatch { what, detail, .. }) => {
            assert_eq!(what, "graph buffers");
            assert_eq!(detail, "rank 0 captured 2 calls to register, rank 1 1");
        }
        other => panic!("{other:?}"),
    }
    for c in &comms {
        assert!(slot_row(c, 0).iter().all(|&w| w == 0), "nothing filled");
    }
    // The mismatched calls are dropped and the ranks' next slots realigned: a later, agreeing
    // capture registers alone.
    CAPTURING.with(|c| c.set(true));
    for c in &comms {
        let call = prepared(
            c,
            ins[c.rank].as_ptr() as usize,
            out.as_ptr() as usize,
            8,
            DType::F32,
            opts(),
        );
        c.all_reduce(&call).unwrap();
        assert_eq!(
            take_launches().pop().unwrap().registered().slot,
            c.group.slot_row(c.rank, 2)
        );
    }
    CAPTURING.with(|c| c.set(false));
    assert_eq!(comms[1].register_graph_buffers_group().unwrap(), 1);
    assert_eq!(slot_row(&comms[0], 2)[1], ins[1].as_ptr() as u64);
}

#[test]
fn a_replay_before_registration_is_reported_and_the_group_goes_on() {
    let comms = group(vec![0, 1]);
    write_control(
        &comms[1],
        1,
        Control {
            error: abi::ERROR_MISMATCH,
            rank: 1,
            mine: Desc2::UNREGISTERED.0,
            theirs: Desc2::graph_slot(4).0,
            ..Default::default()
        },
    );
    match comms[1].synchronize(Stream::NULL) {
        Err(Error::InvalidArgument(m)) => {
            assert!(
                m.contains("before register_graph_buffers filled rank 1's part"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    comms[1].synchronize(Stream::NULL).unwrap();
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_MISMATCH,
            rank: 1,
            mine: Desc2::graph_slot(4).0,
            theirs: Desc2::graph_slot(5).0,
            ..Default::default()
        },
    );
    match comms[0].synchronize(Stream::NULL) {
        Err(Error::RankMismatch { detail, .. }) => {
            assert_eq!(detail, "rank 0 reads graph slot 4, rank 1 graph slot 5")
        }
        other => panic!("{other:?}"),
    }
}

// ---- The push one-shot ------------------------------------------------------------------

/// A push call is one launch of the push kernel for its dtype and world, on the group's grid,
/// with every rank's receive buffers and workspaces and the call's vectors and tail; a
/// mismatch it reports reads as the exact paths' errors; a refused push call still launches,
/// with no data and a "refused" descriptor, so the peers skip it with it.
#[test]
fn push_calls_launch_the_push_kernel_with_every_ranks_buffers() {
    let comms = group(vec![0, 1, 2, 3]);
    take_launches();
    let c = &comms[2];
    let (inp, out) = (0x10000usize, 0x1_000_000usize);
    let push = AllReduceOptions::default().strategy(Strategy::PushOneShot);
    let call = prepared(c, inp, out, 1001, DType::BF16, push);
    assert_eq!(call.strategy, Strategy::PushOneShot);
    c.all_reduce(&call).unwrap();
    let launches = take_launches();
    assert_eq!(launches.len(), 1);
    let l = &launches[0];
    assert_eq!(l.kernel, "ar_push_oneshot_bf16_w4");
    assert_eq!((l.grid, l.block, l.cluster), (20, THREADS, 0));
    let a = l.fused();
    let g = &c.group;
    let p = g.push.as_ref().unwrap();
    for r in 0..4 {
        let m = p.memory[r].as_ref().unwrap();
        assert_eq!(a.lamport[r], Mock::memory_addr(&m.buffers));
        assert_eq!(a.ws[r], g.peers[r]);
    }
    assert_eq!(
        a.state,
        Mock::memory_addr(&p.memory[2].as_ref().unwrap().state)
    );
    assert_eq!((a.input, a.allreduce_out), (inp as u64, out as u64));
    // 1001 bf16: 125 whole vectors and one of a single element.
    assert_eq!(
        (a.tokens, a.tail, a.hidden, a.rank, a.world),
        (126, 1, 4, 2, 4)
    );
    assert_eq!(a.pattern, crate::push::PATTERN_PUSH);

    // Too large for the strategy: refused before launch, and the refusal is launched.
    let big = Strategy::PUSH_MAX_BYTES / 2 + 8;
    let dev = c.limits().device;
    // SAFETY: only addresses are used; the mock never touches the buffers.
    let (i, o) = unsafe {
        (
            BufRef::from_raw(inp, big, DType::BF16, dev),
            BufMut::from_raw(out, big, DType::BF16, dev),
        )
    };
    let e = allreduce_core::prepare(
        Some(i),
        &o,
        &push,
        &c.limits(),
        c.world_size(),
        c.selection(),
        |s, d, p| c.strategy_available(s, d, p),
    )
    .unwrap_err();
    assert!(matches!(e, Error::TooLarge { max, .. } if max == Strategy::PUSH_MAX_BYTES));
    c.reject_call(&e, Stream::NULL, Strategy::PushOneShot);
    let launches = take_launches();
    assert_eq!(launches.len(), 1);
    let a = launches[0].fused();
    assert_eq!(launches[0].kernel, "ar_push_oneshot_f32_w4");
    assert_eq!(
        (a.tokens, a.pattern),
        (0, crate::push::PATTERN_PUSH_REJECTED)
    );
    // A peer in this process that the kernels tell of the refusal reports its reason.
    let refused = |tokens: u64| tokens << 32 | 5 << 4 | 1 << 1 | 1;
    let bf16 = |tokens: u64, tail: u64| tokens << 32 | tail << 8 | 4 << 4 | 3 << 1 | 1;
    write_control(
        &comms[1],
        1,
        Control {
            error: abi::ERROR_FUSED_MISMATCH,
            rank: 2,
            epoch: 1,
            mine: bf16(126, 1),
            theirs: refused(0),
            ..Default::default()
        },
    );
    match comms[1].synchronize(Stream::NULL) {
        Err(Error::PeerRejected {
            rank: 2, reason, ..
        }) => {
            assert_eq!(reason, e.to_string())
        }
        other => panic!("{other:?}"),
    }

    // Lossy: not this strategy.
    assert!(c
        .strategy_available(
            Strategy::PushOneShot,
            DType::BF16,
            Precision::Lossy(Codec::Int8)
        )
        .is_err());

    // A reported disagreement on a push call is a RankMismatch, and is cleared.
    let desc = |tokens: u64, tail: u64| tokens << 32 | tail << 8 | 4 << 4 | 3 << 1 | 1;
    write_control(
        c,
        2,
        Control {
            error: abi::ERROR_FUSED_MISMATCH,
            rank: 1,
            epoch: 9,
            mine: desc(126, 1),
            theirs: desc(126, 2),
            ..Default::default()
        },
    );
    match c.synchronize(Stream::NULL) {
        Err(Error::RankMismatch {
            what: "length",
            detail,
            ..
        }) => assert!(
            detail.contains("rank 2 has 1001, rank 1 has 1002"),
            "{detail}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(c.synchronize(Stream::NULL).is_ok());
}

#[test]
fn a_fused_refusal_joins_with_the_refusal_pattern_and_reaches_the_peers_with_its_reason() {
    let config = allreduce_core::FusedConfig::new(16, 1024, DType::BF16);
    let (comms, fused) = fused_group(vec![0, 1, 2], &config);
    take_launches();
    let why = Error::WorkspaceExceeded {
        what: "tokens",
        requested: 17,
        max: 16,
    };
    fused[2].reject(&why, Stream::NULL);
    let l = take_launches().pop().expect("one launch");
    assert_eq!(l.kernel, "ar_fused_oneshot_bf16_w0");
    let a = l.fused();
    assert_eq!((a.rank, a.tokens, a.hidden), (2, 0, 1024));
    assert_eq!(
        u64::from(a.pattern),
        allreduce_core::fused::REJECTED_PATTERN_CODE
    );
    // What the kernels record on a peer whose tags showed the refusal.
    let mine = 2u64 << 32 | 1024 << 8 | 1 << 4 | 3 << 1 | 1;
    let refusal = 1024 << 8 | allreduce_core::fused::REJECTED_PATTERN_CODE << 4 | 3 << 1 | 1;
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_FUSED_MISMATCH,
            rank: 2,
            epoch: 9,
            mine,
            theirs: refusal,
            ..Default::default()
        },
    );
    match comms[0].synchronize(Stream::NULL) {
        Err(Error::PeerRejected {
            rank: 2, reason, ..
        }) => assert_eq!(reason, why.to_string()),
        other => panic!("{other:?}"),
    }
    // Reported once; the group is intact.
    comms[0].synchronize(Stream::NULL).unwrap();
    // A plain refusal carries its reason to the peers as well.
    let plain = Error::InvalidArgument("input and output overlap".into());
    comms[1].reject(&plain, Stream::NULL);
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_MISMATCH,
            rank: 1,
            mine: Desc::new(100, 2, 1, 0).0,
            theirs: Desc::REJECTED.0,
            ..Default::default()
        },
    );
    match comms[0].synchronize(Stream::NULL) {
        Err(Error::PeerRejected {
            rank: 1, reason, ..
        }) => assert_eq!(reason, plain.to_string()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_fused_shape_mismatch_is_core_s_comparison() {
    let comms = group(vec![0, 1]);
    let desc = |pattern: u64| 2u64 << 32 | 1024 << 8 | pattern << 4 | 3 << 1 | 1;
    write_control(
        &comms[1],
        1,
        Control {
            error: abi::ERROR_FUSED_MISMATCH,
            rank: 0,
            epoch: 4,
            mine: desc(0),
            theirs: desc(1),
            ..Default::default()
        },
    );
    let want = allreduce_core::fused::call_desc_of(desc(0))
        .unwrap()
        .mismatch(
            1,
            0,
            4,
            &allreduce_core::fused::call_desc_of(desc(1)).unwrap(),
        );
    assert_eq!(comms[1].synchronize(Stream::NULL).err(), want);
    assert!(want.is_some());
}

#[test]
fn a_timeout_names_the_ranks_whose_flags_never_came() {
    let comms = group(vec![0, 1, 2, 3]);
    // Rank 0's block 5 waited for epoch 7: ranks 1 and 3 never raised their flags in its
    // workspace (rank 3's is one barrier behind), rank 2 did.
    let flags = comms[0].group.peers[0] + (abi::FLAGS_OFFSET + 5 * MAX_WORLD * 4) as u64;
    for (p, epoch) in [(0u64, 7u32), (1, 0), (2, 7), (3, 6)] {
        // SAFETY: inside rank 0's mock workspace (host memory).
        unsafe { std::ptr::write((flags + 4 * p) as *mut u32, epoch) };
    }
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_TIMEOUT,
            rank: 0,
            block: 5,
            epoch: 7,
            waited_ns: 2_000_000_000,
            ..Default::default()
        },
    );
    let text = comms[0].synchronize(Stream::NULL).unwrap_err().to_string();
    assert!(text.contains("after 2.0 s"), "{text}");
    assert!(text.contains("(ranks 1, 3 never arrived)"), "{text}");
}

#[test]
fn a_fused_timeout_names_the_ranks_whose_call_tags_never_came() {
    let config = allreduce_core::FusedConfig::new(16, 1024, DType::BF16);
    let (comms, fused) = fused_group(vec![0, 1, 2], &config);
    // A refusal is a fused call like any other: it says which workspace rank 1 runs on.
    fused[1].reject(&Error::InvalidArgument("x".into()), Stream::NULL);
    let a = take_launches().pop().expect("the refusal's launch").fused();
    // Fused call 4 (buffer 1): only rank 0's tag arrived in rank 1's buffer.
    let tags = a.lamport[1] + 2 * a.comm_bytes - allreduce_core::fused::TAG_BYTES as u64;
    for (p, tag) in [(0u64, 5u32), (1, 5), (2, 4)] {
        // SAFETY: inside rank 1's mock Lamport buffers (host memory).
        unsafe { std::ptr::write((tags + 16 * p) as *mut u32, tag) };
    }
    write_control(
        &comms[0],
        1,
        Control {
            error: abi::ERROR_TIMEOUT,
            rank: 1,
            epoch: 4,
            waited_ns: 300_000_000,
            theirs: abi::TIMEOUT_IN_FUSED,
            ..Default::default()
        },
    );
    let text = comms[1].synchronize(Stream::NULL).unwrap_err().to_string();
    assert!(text.contains("300.0 ms"), "{text}");
    assert!(text.contains("fused call 4"), "{text}");
    assert!(text.contains("(rank 2 never arrived)"), "{text}");
}

#[test]
fn a_push_timeout_names_the_ranks_whose_call_tags_never_came() {
    let comms = group(vec![0, 1, 2]);
    take_launches();
    let push = AllReduceOptions::default().strategy(Strategy::PushOneShot);
    let call = prepared(&comms[1], 0x10000, 0x1_000_000, 64, DType::BF16, push);
    comms[1].all_reduce(&call).unwrap();
    let a = take_launches().pop().expect("the push launch").fused();
    // Push call 4 (buffer 1): only rank 0's tag arrived in rank 1's receive buffer.
    let tags = a.lamport[1] + 2 * a.comm_bytes - allreduce_core::fused::TAG_BYTES as u64;
    for (p, tag) in [(0u64, 5u32), (1, 5), (2, 4)] {
        // SAFETY: inside rank 1's mock receive buffers (host memory).
        unsafe { std::ptr::write((tags + 16 * p) as *mut u32, tag) };
    }
    write_control(
        &comms[0],
        1,
        Control {
            error: abi::ERROR_TIMEOUT,
            rank: 1,
            epoch: 4,
            waited_ns: 300_000_000,
            theirs: abi::TIMEOUT_IN_FUSED,
            ..Default::default()
        },
    );
    let text = comms[1].synchronize(Stream::NULL).unwrap_err().to_string();
    assert!(text.contains("push call 4"), "{text}");
    assert!(text.contains("(rank 2 never arrived)"), "{text}");
}

#[test]
fn an_aborted_rank_names_the_peers_its_flags_show_behind() {
    // A rank of a multi-process group whose kernel left on the abort word (a peer in another
    // process timed out): its own workspace's flags at that block show who never came. Here
    // ranks 0 and 3 reached epoch 9, rank 2 stopped at 8 (killed), rank 1 is the reader.
    let comms = group(vec![0, 1, 2, 3]);
    let flags = comms[1].group.peers[1] + (abi::FLAGS_OFFSET + 4 * MAX_WORLD * 4) as u64;
    for (p, epoch) in [(0u64, 9u32), (1, 9), (2, 8), (3, 9)] {
        // SAFETY: inside rank 1's mock workspace (host memory).
        unsafe { std::ptr::write((flags + 4 * p) as *mut u32, epoch) };
    }
    write_control(
        &comms[1],
        1,
        Control {
            error: abi::ERROR_ABORTED,
            rank: 1,
            block: 4,
            ..Default::default()
        },
    );
    match comms[1].synchronize(Stream::NULL) {
        Err(Error::Aborted { reason }) => assert!(
            reason.contains("rank 2 had not arrived at block 4"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    // Level flags (an abort between barriers) name nobody rather than the wrong rank.
    let comms = group(vec![0, 1]);
    write_control(
        &comms[0],
        0,
        Control {
            error: abi::ERROR_ABORTED,
            rank: 0,
            block: 2,
            ..Default::default()
        },
    );
    match comms[0].synchronize(Stream::NULL) {
        Err(Error::Aborted { reason }) => assert!(!reason.contains("had not arrived"), "{reason}"),
        other => panic!("{other:?}"),
    }
}
