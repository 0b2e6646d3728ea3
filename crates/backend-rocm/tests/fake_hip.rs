//! The HIP layers against a stub libamdhip64 built here from C (skipped, with the reason
//! printed, when no C compiler is found): loading through `ALLREDUCE_LIBAMDHIP64`, a
//! missing symbol, the runtime's error strings, device checks, and a group that stops with a
//! clear error where the stub (or the build) runs out.
//!
//! One test function: the stub is chosen through a process-wide environment variable and
//! the library is opened once per process.

use std::path::{Path, PathBuf};
use std::process::Command;

use std::ffi::{c_char, c_void, CStr};

use allreduce_backend_rocm::{hip, kernels, select, Hip, IpcMapping, Rocm};
use allreduce_core::{
    prepare, AllReduceOptions, Backend, BackendComm, BufMut, BufRef, DType, Device, Error,
    FusedConfig, FusedPattern, GroupConfig, Precision, Strategy, Stream,
};
use allreduce_gpu::abi::{Args, Desc, FusedKernelArgs};
use allreduce_gpu::device::{GpuDevice, GpuGraph, GpuStream};
use allreduce_gpu::GpuRuntime;

/// Launches of a group of two warming its kernels, once per rank: one-shot and two-shot x 3
/// dtypes, staged and registered, quantized and hierarchical x 2 dtypes x every codec, and the
/// push one-shot x 3 dtypes.
const WARM_LAUNCHES: u32 = 2 * (6 + 6 + 2 * 2 * allreduce_core::Codec::ALL.len() as u32 + 3);

/// The stub's record of what the backend did (its `stub_*` functions).
struct Probe(libloading::Library);

impl Probe {
    fn open(path: &Path) -> Self {
        // SAFETY: the stub is already loaded; this only takes another reference to it.
        Probe(unsafe { libloading::Library::new(path) }.unwrap())
    }
    fn u32(&self, name: &str) -> u32 {
        // SAFETY: the stub's getters take nothing and return an int.
        unsafe { (self.0.get::<unsafe extern "C" fn() -> u32>(name).unwrap())() }
    }
    fn string(&self, name: &str) -> String {
        // SAFETY: the getter returns a NUL-terminated static buffer.
        unsafe {
            let f = self
                .0
                .get::<unsafe extern "C" fn() -> *const c_char>(name)
                .unwrap();
            CStr::from_ptr(f()).to_string_lossy().into_owned()
        }
    }
    fn stream(&self) -> usize {
        self.ptr("stub_last_stream")
    }
    fn ptr(&self, name: &str) -> usize {
        // SAFETY: the getter takes nothing and returns a pointer.
        unsafe {
            (self
                .0
                .get::<unsafe extern "C" fn() -> *mut c_void>(name)
                .unwrap())() as usize
        }
    }
    fn args(&self) -> Args {
        self.block()
    }
    fn fused_args(&self) -> FusedKernelArgs {
        self.block()
    }
    /// The last launch's argument block, which must be a `T`.
    fn block<T: Copy>(&self) -> T {
        let mut n = 0usize;
        // SAFETY: the getter returns the recorded block and its size.
        unsafe {
            let f = self
                .0
                .get::<unsafe extern "C" fn(*mut usize) -> *const c_void>("stub_last_args")
                .unwrap();
            let p = f(&mut n);
            assert_eq!(n, size_of::<T>(), "the launch's argument block size");
            std::ptr::read_unaligned(p as *const T)
        }
    }
}

/// `prepare` as the facade calls it, on `c`'s limits, table and strategies.
fn prepare_on(
    c: &impl BackendComm,
    input: Option<BufRef<'_>>,
    output: &BufMut<'_>,
    options: &AllReduceOptions,
) -> allreduce_core::Result<allreduce_core::Call> {
    prepare(
        input,
        output,
        options,
        &c.limits(),
        c.world_size(),
        c.selection(),
        |s, d, p| c.strategy_available(s, d, p),
    )
}

/// The stub's hand-written part; every other symbol of the function table is generated as
/// `int name() { return 1; }` (hipErrorInvalidValue).
const STUB: &str = include_str!("stub/hip_stub.c");
/// The same for librccl.
const RCCL_STUB: &str = include_str!("stub/rccl_stub.c");

fn c_compiler() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    Command::new(&cc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| cc)
}

fn build_stub(cc: &str, dir: &Path, name: &str, skip: &[&str]) -> PathBuf {
    build_c_stub(cc, dir, name, STUB, hip::sys::SYMBOLS, skip)
}

fn build_c_stub(
    cc: &str,
    dir: &Path,
    name: &str,
    hand_written: &str,
    symbols: &[&str],
    skip: &[&str],
) -> PathBuf {
    let mut src = String::from(hand_written);
    for s in symbols {
        if !hand_written.contains(&format!(" {s}(")) && !skip.contains(s) {
            src.push_str(&format!("int {s}() {{ return 1; }}\n"));
        }
    }
    let c = dir.join(format!("{name}.c"));
    let so = dir.join(format!("{name}.so"));
    std::fs::write(&c, src).unwrap();
    let out = Command::new(cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

#[test]
fn hip_layers_against_a_stub_runtime() {
    let Some(cc) = c_compiler() else {
        println!("skipped: no C compiler (cc or $CC) to build the stub libamdhip64");
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake-hip");
    std::fs::create_dir_all(&dir).unwrap();

    // A library lacking a symbol is refused by name.
    let partial = build_stub(&cc, &dir, "libamdhip64_partial", &["hipEventElapsedTime"]);
    // SAFETY: the stub has no initialisers.
    let library = unsafe { libloading::Library::new(&partial) }.unwrap();
    // SAFETY: the stub's signatures match where it matters (tests/stub/hip_stub.c).
    let err = unsafe { hip::sys::Lib::from_library(library, partial.display().to_string()) }
        .err()
        .expect("a symbol is missing");
    assert!(err.contains("lacks hipEventElapsedTime"), "{err}");
    // An RCCL without the window API (any library lacking it) serves no symmetric windows
    // and says which symbol is missing; its plain collectives are resolved apart.
    // SAFETY: as above; only symbol lookups.
    let library = unsafe { libloading::Library::new(&partial) }.unwrap();
    // SAFETY: nothing is called.
    let err = unsafe {
        allreduce_backend_rocm::rccl::sys::window::Lib::from_library(
            library,
            partial.display().to_string(),
        )
    }
    .err()
    .expect("no window API");
    assert!(err.contains("lacks ncclMemAlloc"), "{err}");

    let full = build_stub(&cc, &dir, "libamdhip64_stub", &[]);
    std::env::set_var(hip::sys::PATH_ENV, &full);
    std::env::set_var("STUB_HIP_DEVICES", "0");
    let lib = hip::sys::lib().expect("the stub loads");
    assert_eq!(lib.path, full.display().to_string());
    assert_eq!(hip::result::init().unwrap(), 60342134);

    // A runtime with no device: zero devices, and a group says so.
    assert_eq!(allreduce_backend_rocm::device_count().unwrap(), 0);
    match Rocm::create_group(&GroupConfig::new(2)) {
        Err(Error::InvalidConfig(m)) => assert!(m.contains("0 present"), "{m}"),
        other => panic!("{:?}", other.err()),
    }

    // The runtime's own name and message for a failed call.
    std::env::set_var("STUB_HIP_DEVICES", "1");
    let e = hip::result::memory::malloc(64).expect_err("the stub refuses");
    assert_eq!(e.code(), Some(1));
    let core: Error = e.into();
    assert_eq!(
        core.to_string(),
        "hipMalloc failed: stub runtime refuses (hipErrorInvalidValue, 1)"
    );

    // A wave32 (RDNA) device is refused at open with the reason.
    std::env::set_var("STUB_HIP_WAVE", "32");
    match Rocm::create_group(&GroupConfig::new(1)) {
        Err(Error::InvalidConfig(m)) => assert!(m.contains("wave64"), "{m}"),
        other => panic!("{:?}", other.err()),
    }

    // A CDNA device: the group gets as far as the kernels. Without a HIP compiler at build
    // time there are none, and the error says how to get them; with them, the stub refuses
    // to load them and the error names every target tried.
    std::env::set_var("STUB_HIP_WAVE", "64");
    let err = Rocm::create_group(&GroupConfig::new(1))
        .err()
        .expect("the stub cannot run kernels");
    if kernels::code_objects().is_empty() {
        match &err {
            Error::LibraryUnavailable { library, detail } => {
                assert_eq!(*library, "allreduce's HIP kernels");
                assert!(detail.contains("scripts/setup-hip.sh"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    } else {
        let text = err.to_string();
        assert!(text.contains("hipModuleLoadData"), "{text}");
        for arch in kernels::targets() {
            assert!(text.contains(arch), "{text}");
        }
    }
    println!("{err}");

    if kernels::code_objects().is_empty() {
        println!(
            "launch path not checked: no kernels in this build (ALLREDUCE_REQUIRE_HIP=1 after \
             scripts/setup-hip.sh builds them)"
        );
        return;
    }

    // A stub that works: two GPUs, host memory as device memory, launches recorded. The
    // group is built as on hardware: peers enabled, uncached workspaces, coherent controls,
    // the gfx942 code object chosen by trying each, every kernel warmed once per rank.
    std::env::set_var("STUB_HIP_WORKS", "1");
    std::env::set_var("STUB_HIP_DEVICES", "2");
    let rccl_symbols: Vec<&str> = (allreduce_backend_rocm::rccl::sys::SYMBOLS.iter())
        .chain(allreduce_backend_rocm::rccl::sys::window::SYMBOLS)
        .copied()
        .collect();
    let rccl_stub = build_c_stub(&cc, &dir, "librccl_stub", RCCL_STUB, &rccl_symbols, &[]);
    std::env::set_var(allreduce_backend_rocm::rccl::sys::PATH_ENV, &rccl_stub);
    let probe = Probe::open(&full);
    let rccl = Probe::open(&rccl_stub);
    let config = GroupConfig::new(2)
        .devices(vec![0, 1])
        .max_bytes(9 << 20)
        .cast_bf16_to_f16(true);
    let comms = match Rocm::create_group(&config) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(probe.string("stub_loaded_arch"), "gfx942");
    assert_eq!(
        probe.u32("stub_last_malloc_flags"),
        hip::sys::hipDeviceMallocUncached
    );
    assert_eq!(
        probe.u32("stub_last_host_flags"),
        hip::sys::hipHostMallocMapped
            | hip::sys::hipHostMallocPortable
            | hip::sys::hipHostMallocCoherent
    );
    assert_eq!(probe.u32("stub_peer_enables"), 2);
    assert_eq!(
        probe.u32("stub_launches"),
        WARM_LAUNCHES,
        "every kernel once per rank: one-shot and two-shot x 3 dtypes, staged and \
         registered, quantized and hierarchical x 2 dtypes x every codec, push one-shot x 3"
    );
    assert_eq!(
        (probe.u32("stub_last_grid"), probe.u32("stub_last_block")),
        (36, 512)
    );
    assert_eq!(comms[1].selection(), &select::default_table(true));

    // One call on rank 1: Auto picks one-shot for 8 KiB at world 2; the kernel gets the
    // group's workspaces, its control, and the call's descriptor.
    let c = &comms[1];
    let dev = Device::Rocm(1);
    // SAFETY: fake device addresses; the stub never dereferences them.
    let (input, output) = unsafe {
        (
            BufRef::from_raw(0x10_0000, 4096, DType::BF16, dev),
            BufMut::from_raw(0x20_0000, 4096, DType::BF16, dev),
        )
    };
    let stream = Stream::from_raw(0x5000 as *mut c_void);
    let call = prepare_on(
        c,
        Some(input),
        &output,
        &AllReduceOptions::default().stream(stream),
    )
    .unwrap();
    assert_eq!(call.strategy, Strategy::OneShot);
    c.all_reduce(&call).unwrap();
    assert_eq!(probe.string("stub_last_kernel"), "ar_oneshot_bf16");
    assert_eq!(probe.stream(), 0x5000);
    let a = probe.args();
    assert_eq!((a.rank, a.world, a.n), (1, 2, 4096));
    assert_eq!(
        (a.input as usize, a.output as usize),
        (0x10_0000, 0x20_0000)
    );
    assert!(a.peers[0] != 0 && a.peers[1] != 0 && a.peers[0] != a.peers[1]);
    assert!(a.peers[2..].iter().all(|&p| p == 0));
    assert_ne!(a.control, 0);
    // The staging stride: max_bytes plus the quantized slots' padding (a few hundred bytes).
    assert!(a.max_bytes >= 9 << 20 && a.max_bytes < (9 << 20) + 4096);
    let d = Desc(a.desc);
    assert_eq!(
        (d.len(), d.dtype(), d.strategy(), d.precision()),
        (4096, 3, 1, 0)
    );
    c.synchronize(stream).unwrap();

    // The quantized kernels are embedded: 16-bit lossy calls can take them, f32 cannot.
    let q = |d| {
        c.strategy_available(
            Strategy::QuantizedTwoShot,
            d,
            Precision::Lossy(allreduce_core::Codec::Int4),
        )
    };
    assert_eq!(q(DType::F16), Ok(()));
    assert!(q(DType::F32).unwrap_err().contains("f16 and bf16"));
    // 8 MiB exact at world 2 is past the custom kernels' 8 MiB: RCCL, on rank 1's
    // communicator, with RCCL's f32 code and ncclSum.
    // SAFETY: fake device addresses, as above.
    let (input, output) = unsafe {
        (
            BufRef::from_raw(0x10_0000, 2 << 20, DType::F32, dev),
            BufMut::from_raw(0x100_0000, 2 << 20, DType::F32, dev),
        )
    };
    let call = prepare_on(
        c,
        Some(input),
        &output,
        &AllReduceOptions::default().stream(stream),
    )
    .unwrap();
    assert_eq!(call.strategy, Strategy::Vendor);
    c.all_reduce(&call).unwrap();
    assert_eq!(rccl.u32("stub_rccl_calls"), 1);
    assert_eq!(rccl.u32("stub_rccl_last_count"), 2 << 20);
    assert_eq!(rccl.u32("stub_rccl_last_dtype"), 7);
    assert_eq!(rccl.u32("stub_rccl_last_op"), 0);
    assert_eq!(rccl.u32("stub_rccl_last_comm"), 0x101);
    assert_eq!(
        probe.u32("stub_launches"),
        WARM_LAUNCHES + 1,
        "no kernel for the RCCL call"
    );

    // Symmetric windows: one per rank from ncclMemAlloc, of the group's max_bytes, registered
    // in one RCCL group (the stub refuses a registration outside one) with the symmetric
    // flag.
    assert_eq!(rccl.u32("stub_rccl_window_registers"), 2);
    assert_eq!(rccl.u32("stub_rccl_last_win_flags"), 1);
    let (win, win_bytes) = c.vendor_window().expect("RCCL's windows");
    assert_eq!(win_bytes as u32, rccl.u32("stub_rccl_last_win_bytes"));
    assert!(win_bytes >= 9 << 20, "{win_bytes}");
    assert_ne!(comms[0].vendor_window().unwrap().0, win);
    // A call outside the window: copied in, reduced in place in the window, copied out, all
    // on the call's stream.
    let call = prepare_on(
        c,
        Some(input),
        &output,
        &AllReduceOptions::default()
            .strategy(Strategy::VendorSymmetric)
            .stream(stream),
    )
    .unwrap();
    c.all_reduce(&call).unwrap();
    assert_eq!(probe.u32("stub_copies"), 2);
    assert_eq!(
        (
            probe.ptr("stub_last_copy_dst"),
            probe.ptr("stub_last_copy_src")
        ),
        (0x100_0000, win as usize)
    );
    assert_eq!(probe.u32("stub_last_copy_bytes"), 8 << 20);
    assert_eq!(rccl.u32("stub_rccl_calls"), 2);
    assert_eq!(
        (
            rccl.ptr("stub_rccl_last_send"),
            rccl.ptr("stub_rccl_last_recv")
        ),
        (win as usize, win as usize)
    );
    // In the window: RCCL runs on the caller's buffer with no copy.
    // SAFETY: an address inside rank 1's live window.
    let in_window = unsafe { BufMut::from_raw(win as usize + 4096, 1024, DType::BF16, dev) };
    let call = prepare_on(
        c,
        None,
        &in_window,
        &AllReduceOptions::default()
            .strategy(Strategy::VendorSymmetric)
            .stream(stream),
    )
    .unwrap();
    c.all_reduce(&call).unwrap();
    assert_eq!(
        probe.u32("stub_copies"),
        2,
        "no copy for a buffer in the window"
    );
    assert_eq!(rccl.ptr("stub_rccl_last_send"), win as usize + 4096);
    assert_eq!(rccl.u32("stub_rccl_last_count"), 1024);

    // Graph capture (GpuGraph, what the graph-replay test uses): the call launched on a
    // capturing stream is recorded, not run, and the graph replays it.
    let gpu = GpuDevice::<Hip>::open(0).unwrap();
    let s = GpuStream::new(&gpu).unwrap();
    // SAFETY: fake device addresses, as above.
    let (input, output) = unsafe {
        (
            BufRef::from_raw(0x10_0000, 4096, DType::F16, dev),
            BufMut::from_raw(0x20_0000, 4096, DType::F16, dev),
        )
    };
    let call = prepare_on(
        c,
        Some(input),
        &output,
        &AllReduceOptions::default()
            .strategy(Strategy::TwoShot)
            .stream(s.handle()),
    )
    .unwrap();
    let graph = GpuGraph::capture(&s, || c.all_reduce(&call)).unwrap();
    assert_eq!(probe.u32("stub_captured"), 1);
    assert_eq!(
        probe.u32("stub_launches"),
        WARM_LAUNCHES + 1,
        "nothing ran during capture"
    );
    assert_eq!(probe.string("stub_last_kernel"), "ar_twoshot_f16");
    for _ in 0..3 {
        graph.launch(&s).unwrap();
    }
    assert_eq!(probe.u32("stub_replays"), 3);
    drop(graph);
    drop(s);

    // The fused all-reduce + RMSNorm through the generic host side: Lamport buffers of
    // uncached memory filled with bf16 -0.0 by hipMemsetD16, the fused code object loaded,
    // its three kernels warmed per rank, and a call launching the generic (w0) one-shot.
    let warmed = probe.u32("stub_launches");
    // After the group's own fills (the push one-shot's receive buffers, one per rank).
    let filled = probe.u32("stub_fills");
    let fused = c
        .create_fused_group(&FusedConfig::new(8, 1024, DType::BF16))
        .unwrap()
        .expect("the ROCm backend has fused kernels");
    assert_eq!(fused.len(), 2);
    assert_eq!(probe.u32("stub_fills"), filled + 2);
    assert_eq!(probe.u32("stub_launches"), warmed + 2 * 3);
    assert_eq!(probe.string("stub_last_kernel"), "ar_rmsnorm_bf16");
    // The stub's 304 compute units, one rank per GPU: the per-block state's 64 blocks.
    assert_eq!(
        (probe.u32("stub_last_grid"), probe.u32("stub_last_block")),
        (64, 512)
    );
    let comm_bytes = 3 * 8 * 1024 * 2 + 128;
    assert_eq!(fused[1].metadata().lamport_buffer_size, 3 * comm_bytes);
    let warm = probe.fused_args();
    assert_eq!((warm.world, warm.rank, warm.tokens), (1, 0, 0));
    // The stub's device memory is host memory: every bf16 word is -0.0 until a kernel writes.
    // SAFETY: rank 1's live Lamport allocation of 3 * comm_bytes.
    let words =
        unsafe { std::slice::from_raw_parts(warm.lamport[0] as *const u16, 3 * comm_bytes / 2) };
    assert!(words.iter().all(|&w| w == 0x8000));
    // SAFETY: fake device addresses, as above.
    let (input, output) = unsafe {
        (
            BufRef::from_raw(0x10_0000, 4 * 1024, DType::BF16, dev),
            BufMut::from_raw(0x20_0000, 4 * 1024, DType::BF16, dev),
        )
    };
    let args = allreduce_core::FusedArgs::new(FusedPattern::AllReduce, 4, input)
        .allreduce_out(output)
        .stream(stream);
    let call = allreduce_core::fused::prepare_fused(
        &args,
        fused[1].metadata(),
        &allreduce_core::fused::default_table(),
        dev,
        16,
    )
    .unwrap();
    assert_eq!(call.strategy, Strategy::OneShot);
    fused[1].run(&call).unwrap();
    assert_eq!(probe.string("stub_last_kernel"), "ar_fused_oneshot_bf16_w0");
    assert_eq!(probe.stream(), 0x5000);
    let a = probe.fused_args();
    assert_eq!((a.rank, a.world, a.tokens, a.hidden), (1, 2, 4, 1024));
    assert_eq!((a.input, a.allreduce_out), (0x10_0000, 0x20_0000));
    assert_eq!(a.lamport[1], warm.lamport[0]);
    assert!(a.lamport[0] != 0 && a.lamport[2..].iter().all(|&p| p == 0));
    assert_eq!(a.comm_bytes, comm_bytes as u64);
    drop(fused);
    drop(comms);
    // The windows went with the group: deregistered in one RCCL group, then freed.
    assert_eq!(rccl.u32("stub_rccl_window_deregisters"), 2);
    assert_eq!(rccl.u32("stub_rccl_window_frees"), 2);

    // IPC (groups across processes): the handle of an uncached allocation opens, with lazy
    // peer access, to a mapping that is closed on drop.
    let d = Hip::open(0).unwrap();
    let mem = Hip::alloc_workspace(&d, 4096).unwrap();
    let handle = mem.ipc_handle().unwrap();
    // SAFETY: the stub's handle encodes a live allocation of this process.
    let mapping = unsafe { IpcMapping::open(&handle) }.unwrap();
    assert_eq!(mapping.ptr, mem.ptr);
    assert_eq!(
        probe.u32("stub_last_ipc_flags"),
        hip::sys::hipIpcMemLazyEnablePeerAccess
    );
    drop(mapping);
    assert_eq!(probe.u32("stub_ipc_closes"), 1);

    // A runtime without uncached memory (before ROCm 6): fine-grained instead.
    std::env::set_var("STUB_HIP_NO_UNCACHED", "1");
    let fine = Hip::alloc_workspace(&d, 4096).unwrap();
    assert_eq!(
        probe.u32("stub_last_malloc_flags"),
        hip::sys::hipDeviceMallocFinegrained
    );
    drop((fine, mem));
}
