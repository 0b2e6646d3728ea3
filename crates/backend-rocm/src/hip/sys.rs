//! The slice of the HIP runtime API (`libamdhip64`) this crate calls, loaded at run time.
//!
//! Hand-written, not generated: 50 functions, 48 of them checked present with the same
//! parameter and return types in the bindgen output of HIP 5.4 (`hip-runtime-sys` 0.1.2) and of ROCm 6.2,
//! 7.2 and 7.14 (`cubecl-hip-sys` 7.14.6085001's binding sets), checked 2026-12-03. Calls whose structs
//! changed across versions (`hipGetDeviceProperties` → `hipGetDevicePropertiesR0600`) are
//! avoided: attributes come from `hipDeviceGetAttribute` (same values in all four), the
//! architecture from which embedded code object loads. Two values differ by version and are
//! handled where used: `hipDeviceMallocUncached` is absent before ROCm 6 (the workspace falls
//! back to fine-grained memory), `hipIpcMemLazyEnablePeerAccess` was 0 in HIP 5.4.
//!
//! (`hipMemsetD16`/`hipMemsetD32`, the fused workspace's -0.0 fill, were added later from
//! `hip_runtime_api.h`'s declarations, the same since HIP 3.x; not re-checked against those
//! four binding sets.)
//!
//! [`lib`] opens the library once per process and resolves every symbol; a machine without
//! ROCm gets an error naming the files tried, never a panic.

#![allow(non_camel_case_types, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use crate::loader;

pub type hipError_t = c_int;
pub type hipDevice_t = c_int;
pub type hipDeviceAttribute_t = c_int;
pub type hipStream_t = *mut c_void;
pub type hipEvent_t = *mut c_void;
pub type hipModule_t = *mut c_void;
pub type hipFunction_t = *mut c_void;
pub type hipMemcpyKind = c_int;
pub type hipGraph_t = *mut c_void;
pub type hipGraphExec_t = *mut c_void;
pub type hipGraphNode_t = *mut c_void;
pub type hipStreamCaptureMode = c_int;
/// hipStreamCaptureStatusNone is 0; active and invalidated are not.
pub type hipStreamCaptureStatus = c_int;

pub const hipSuccess: hipError_t = 0;
pub const hipErrorInvalidValue: hipError_t = 1;
pub const hipErrorNoDevice: hipError_t = 100;
pub const hipErrorInvalidDevice: hipError_t = 101;
pub const hipErrorNoBinaryForGpu: hipError_t = 209;
pub const hipErrorNotReady: hipError_t = 600;
pub const hipErrorPeerAccessAlreadyEnabled: hipError_t = 704;

pub const hipDeviceAttributeComputeCapabilityMajor: hipDeviceAttribute_t = 23;
pub const hipDeviceAttributeComputeCapabilityMinor: hipDeviceAttribute_t = 61;
pub const hipDeviceAttributeMultiprocessorCount: hipDeviceAttribute_t = 63;
pub const hipDeviceAttributeWarpSize: hipDeviceAttribute_t = 87;

/// `hipExtMallocWithFlags`: uncached device memory (what QuickReduce allocates its flags and
/// buffers with on MI300: peers' stores are seen without cache maintenance). `Uncached` first
/// appears in the ROCm 6 headers; fine-grained is the fallback.
pub const hipDeviceMallocDefault: c_uint = 0x0;
pub const hipDeviceMallocFinegrained: c_uint = 0x1;
pub const hipDeviceMallocUncached: c_uint = 0x3;

pub const hipHostMallocPortable: c_uint = 0x1;
pub const hipHostMallocMapped: c_uint = 0x2;
/// Fine-grained host memory: a kernel's store reaches the host while the kernel still runs.
pub const hipHostMallocCoherent: c_uint = 0x4000_0000;

pub const hipMemcpyHostToDevice: hipMemcpyKind = 1;
pub const hipMemcpyDeviceToHost: hipMemcpyKind = 2;
pub const hipMemcpyDeviceToDevice: hipMemcpyKind = 3;

pub const hipStreamNonBlocking: c_uint = 0x1;
pub const hipEventDefault: c_uint = 0x0;

/// Capture only this thread's work on the stream: other ranks' threads keep enqueueing.
pub const hipStreamCaptureModeThreadLocal: hipStreamCaptureMode = 1;

/// 1 in the ROCm 6.2+ headers, 0 in HIP 5.4's: `result::ipc::open_handle` picks by version.
pub const hipIpcMemLazyEnablePeerAccess: c_uint = 0x1;
pub const HIP_IPC_HANDLE_SIZE: usize = 64;

/// `hipModuleLaunchKernel`'s `extra`: the argument block as one buffer, the form HIP has
/// documented for module launches since its first releases (`kernelParams` would be one
/// pointer per parameter; for our single by-value struct the two are the same). Tags, not
/// addresses.
pub const HIP_LAUNCH_PARAM_BUFFER_POINTER: *mut c_void = std::ptr::without_provenance_mut(0x01);
pub const HIP_LAUNCH_PARAM_BUFFER_SIZE: *mut c_void = std::ptr::without_provenance_mut(0x02);
pub const HIP_LAUNCH_PARAM_END: *mut c_void = std::ptr::without_provenance_mut(0x03);

/// `hipFuncGetAttribute`: the largest block the compiled kernel accepts.
pub const HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: c_int = 0;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct hipIpcMemHandle_t {
    pub reserved: [c_char; HIP_IPC_HANDLE_SIZE],
}

const _: () = assert!(size_of::<hipIpcMemHandle_t>() == 64);

loader::function_table! {
    fn hipInit(flags: c_uint) -> hipError_t;
    fn hipDriverGetVersion(version: *mut c_int) -> hipError_t;
    fn hipRuntimeGetVersion(version: *mut c_int) -> hipError_t;
    fn hipGetErrorName(error: hipError_t) -> *const c_char;
    fn hipGetErrorString(error: hipError_t) -> *const c_char;
    fn hipGetLastError() -> hipError_t;

    fn hipGetDeviceCount(count: *mut c_int) -> hipError_t;
    fn hipSetDevice(device: hipDevice_t) -> hipError_t;
    fn hipGetDevice(device: *mut hipDevice_t) -> hipError_t;
    fn hipDeviceGetAttribute(value: *mut c_int, attr: hipDeviceAttribute_t, device: hipDevice_t)
        -> hipError_t;
    fn hipDeviceGetName(name: *mut c_char, len: c_int, device: hipDevice_t) -> hipError_t;
    fn hipDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, device: hipDevice_t) -> hipError_t;
    fn hipDeviceSynchronize() -> hipError_t;
    fn hipDeviceCanAccessPeer(can: *mut c_int, device: hipDevice_t, peer: hipDevice_t)
        -> hipError_t;
    fn hipDeviceEnablePeerAccess(peer: hipDevice_t, flags: c_uint) -> hipError_t;

    fn hipMalloc(ptr: *mut *mut c_void, size: usize) -> hipError_t;
    fn hipExtMallocWithFlags(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> hipError_t;
    fn hipFree(ptr: *mut c_void) -> hipError_t;
    fn hipHostMalloc(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> hipError_t;
    fn hipHostFree(ptr: *mut c_void) -> hipError_t;
    fn hipHostGetDevicePointer(dev: *mut *mut c_void, host: *mut c_void, flags: c_uint)
        -> hipError_t;
    fn hipMemset(dst: *mut c_void, value: c_int, size: usize) -> hipError_t;
    fn hipMemsetAsync(dst: *mut c_void, value: c_int, size: usize, stream: hipStream_t)
        -> hipError_t;
    fn hipMemsetD32(dst: *mut c_void, value: c_int, count: usize) -> hipError_t;
    fn hipMemsetD16(dst: *mut c_void, value: u16, count: usize) -> hipError_t;
    fn hipMemsetD32Async(dst: *mut c_void, value: c_int, count: usize, stream: hipStream_t)
        -> hipError_t;
    fn hipMemsetD16Async(dst: *mut c_void, value: u16, count: usize, stream: hipStream_t)
        -> hipError_t;
    fn hipMemcpy(dst: *mut c_void, src: *const c_void, size: usize, kind: hipMemcpyKind)
        -> hipError_t;
    fn hipMemcpyAsync(
        dst: *mut c_void,
        src: *const c_void,
        size: usize,
        kind: hipMemcpyKind,
        stream: hipStream_t,
    ) -> hipError_t;

    fn hipIpcGetMemHandle(handle: *mut hipIpcMemHandle_t, ptr: *mut c_void) -> hipError_t;
    fn hipMemGetAddressRange(base: *mut *mut c_void, size: *mut usize, ptr: *mut c_void)
        -> hipError_t;
    fn hipIpcOpenMemHandle(ptr: *mut *mut c_void, handle: hipIpcMemHandle_t, flags: c_uint)
        -> hipError_t;
    fn hipIpcCloseMemHandle(ptr: *mut c_void) -> hipError_t;

    fn hipStreamCreateWithFlags(stream: *mut hipStream_t, flags: c_uint) -> hipError_t;
    fn hipStreamDestroy(stream: hipStream_t) -> hipError_t;
    fn hipStreamSynchronize(stream: hipStream_t) -> hipError_t;
    fn hipStreamQuery(stream: hipStream_t) -> hipError_t;

    fn hipEventCreateWithFlags(event: *mut hipEvent_t, flags: c_uint) -> hipError_t;
    fn hipEventRecord(event: hipEvent_t, stream: hipStream_t) -> hipError_t;
    fn hipEventSynchronize(event: hipEvent_t) -> hipError_t;
    fn hipEventElapsedTime(ms: *mut f32, start: hipEvent_t, stop: hipEvent_t) -> hipError_t;
    fn hipEventDestroy(event: hipEvent_t) -> hipError_t;

    fn hipStreamBeginCapture(stream: hipStream_t, mode: hipStreamCaptureMode) -> hipError_t;
    fn hipStreamEndCapture(stream: hipStream_t, graph: *mut hipGraph_t) -> hipError_t;
    fn hipStreamIsCapturing(stream: hipStream_t, status: *mut hipStreamCaptureStatus)
        -> hipError_t;
    fn hipGraphInstantiate(
        exec: *mut hipGraphExec_t,
        graph: hipGraph_t,
        error_node: *mut hipGraphNode_t,
        log: *mut c_char,
        log_bytes: usize,
    ) -> hipError_t;
    fn hipGraphLaunch(exec: hipGraphExec_t, stream: hipStream_t) -> hipError_t;
    fn hipGraphExecDestroy(exec: hipGraphExec_t) -> hipError_t;
    fn hipGraphDestroy(graph: hipGraph_t) -> hipError_t;

    fn hipModuleLoadData(module: *mut hipModule_t, image: *const c_void) -> hipError_t;
    fn hipModuleUnload(module: hipModule_t) -> hipError_t;
    fn hipModuleGetFunction(f: *mut hipFunction_t, module: hipModule_t, name: *const c_char)
        -> hipError_t;
    fn hipFuncGetAttribute(value: *mut c_int, attr: c_int, f: hipFunction_t) -> hipError_t;
    fn hipModuleLaunchKernel(
        f: hipFunction_t,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: hipStream_t,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> hipError_t;
}

/// The sonames probed, newest-agnostic first: the development symlink, then ROCm 7, 6, 5.
pub const SONAMES: &[&str] = &[
    "libamdhip64.so",
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

/// Set to a full path to load that file and nothing else (a stub in tests, or one of several
/// ROCm installs).
pub const PATH_ENV: &str = "ALLREDUCE_LIBAMDHIP64";

/// The HIP runtime, opened on first use. `Err` says which files were tried and why they
/// failed, or which symbol was missing.
pub fn lib() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let candidates = loader::candidates(PATH_ENV, SONAMES);
        match loader::open_first(&candidates) {
            // SAFETY: a library found under libamdhip64's names is the HIP runtime.
            Ok((library, path)) => unsafe { Lib::from_library(library, path) },
            Err(tried) => Err(format!(
                "the HIP runtime could not be loaded (no ROCm installed?): {}; install ROCm \
                 6.0 or newer, or set {PATH_ENV} to the library's path",
                loader::describe_tried(&tried)
            )),
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}
