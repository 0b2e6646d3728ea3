//! A thin `Result` layer over [`super::sys`]: one function per HIP call, grouped the way
//! cudarc's `result` modules are, each returning [`HipError`] (the code and the runtime's own
//! name and message) instead of a status code. Nothing is owned here; RAII types live in
//! `runtime`.
//!
//! Every function is `unsafe` where the HIP call can touch memory through a pointer argument;
//! the rest only need the library, which each call loads (once) and reports if absent.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;

use super::sys::{self, hipError_t, Lib};

/// A failed HIP call, or a HIP runtime that could not be loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HipError {
    /// libamdhip64 is absent (or lacks a symbol): the message names what was tried.
    Unavailable(String),
    /// A call returned an error code.
    Call {
        api: &'static str,
        code: hipError_t,
        name: String,
        message: String,
    },
}

impl HipError {
    /// The error code, if a call failed.
    pub fn code(&self) -> Option<hipError_t> {
        match self {
            HipError::Call { code, .. } => Some(*code),
            HipError::Unavailable(_) => None,
        }
    }
}

impl fmt::Display for HipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HipError::Unavailable(why) => f.write_str(why),
            HipError::Call {
                api,
                code,
                name,
                message,
            } => write!(f, "{api} failed: {message} ({name}, {code})"),
        }
    }
}

impl std::error::Error for HipError {}

impl From<HipError> for allreduce_core::Error {
    fn from(e: HipError) -> Self {
        match e {
            HipError::Unavailable(detail) => allreduce_core::Error::LibraryUnavailable {
                library: "libamdhip64",
                detail,
            },
            HipError::Call {
                api,
                code,
                name,
                message,
            } => allreduce_core::Error::Device {
                api,
                detail: format!("{message} ({name}, {code})"),
            },
        }
    }
}

/// The loaded library, or why there is none.
pub fn lib() -> Result<&'static Lib, HipError> {
    sys::lib().map_err(HipError::Unavailable)
}

fn string(p: *const c_char) -> Option<String> {
    // SAFETY: HIP returns pointers to static NUL-terminated strings (or null).
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Turn a status into a `Result`, with the runtime's name and message for the code.
pub fn check(lib: &Lib, code: hipError_t, api: &'static str) -> Result<(), HipError> {
    if code == sys::hipSuccess {
        return Ok(());
    }
    // SAFETY: both take any code and return a static string.
    let (name, message) = unsafe { ((lib.hipGetErrorName)(code), (lib.hipGetErrorString)(code)) };
    Err(HipError::Call {
        api,
        code,
        name: string(name).unwrap_or_else(|| "?".into()),
        message: string(message).unwrap_or_else(|| "unknown error".into()),
    })
}

/// `hipInit(0)`, and the runtime's version as `major * 10_000_000 + minor * 100_000 + patch`
/// (HIP's encoding, e.g. 60_342_134 for 6.3).
pub fn init() -> Result<i32, HipError> {
    let lib = lib()?;
    // SAFETY: plain call into a loaded library.
    unsafe { check(lib, (lib.hipInit)(0), "hipInit")? };
    runtime_version()
}

/// The runtime's version (see [`init`]), read once.
pub fn runtime_version() -> Result<i32, HipError> {
    static VERSION: std::sync::OnceLock<Result<i32, HipError>> = std::sync::OnceLock::new();
    VERSION
        .get_or_init(|| {
            let lib = lib()?;
            let mut v: c_int = 0;
            // SAFETY: writes one int.
            check(
                lib,
                unsafe { (lib.hipRuntimeGetVersion)(&mut v) },
                "hipRuntimeGetVersion",
            )?;
            Ok(v)
        })
        .clone()
}

/// Clear the thread's last error (after a failure that was handled).
pub fn clear_last_error() {
    if let Ok(lib) = lib() {
        // SAFETY: no arguments.
        unsafe {
            let _ = (lib.hipGetLastError)();
        }
    }
}

pub mod device {
    use super::*;

    /// Devices present; `hipErrorNoDevice` counts as none.
    pub fn count() -> Result<usize, HipError> {
        let lib = lib()?;
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { (lib.hipGetDeviceCount)(&mut n) };
        if r == sys::hipErrorNoDevice {
            return Ok(0);
        }
        check(lib, r, "hipGetDeviceCount")?;
        Ok(n.max(0) as usize)
    }

    pub fn set(device: i32) -> Result<(), HipError> {
        let lib = lib()?;
        // SAFETY: the runtime validates the ordinal.
        check(lib, unsafe { (lib.hipSetDevice)(device) }, "hipSetDevice")
    }

    pub fn current() -> Result<i32, HipError> {
        let lib = lib()?;
        let mut d = 0;
        // SAFETY: writes one int.
        check(lib, unsafe { (lib.hipGetDevice)(&mut d) }, "hipGetDevice")?;
        Ok(d)
    }

    pub fn attribute(device: i32, attr: sys::hipDeviceAttribute_t) -> Result<i32, HipError> {
        let lib = lib()?;
        let mut v = 0;
        // SAFETY: writes one int.
        check(
            lib,
            unsafe { (lib.hipDeviceGetAttribute)(&mut v, attr, device) },
            "hipDeviceGetAttribute",
        )?;
        Ok(v)
    }

    pub fn name(device: i32) -> Result<String, HipError> {
        let lib = lib()?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the runtime writes at most `len` bytes, NUL-terminated.
        check(
            lib,
            unsafe { (lib.hipDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, device) },
            "hipDeviceGetName",
        )?;
        Ok(string(buf.as_ptr()).unwrap_or_default())
    }

    pub fn pci_bus_id(device: i32) -> Result<String, HipError> {
        let lib = lib()?;
        let mut buf = [0 as c_char; 64];
        // SAFETY: as in `name`.
        check(
            lib,
            unsafe { (lib.hipDeviceGetPCIBusId)(buf.as_mut_ptr(), buf.len() as c_int, device) },
            "hipDeviceGetPCIBusId",
        )?;
        Ok(string(buf.as_ptr()).unwrap_or_default())
    }

    /// Wait for all work on the current device.
    pub fn synchronize() -> Result<(), HipError> {
        let lib = lib()?;
        // SAFETY: no arguments.
        check(
            lib,
            unsafe { (lib.hipDeviceSynchronize)() },
            "hipDeviceSynchronize",
        )
    }

    pub fn can_access_peer(device: i32, peer: i32) -> Result<bool, HipError> {
        let lib = lib()?;
        let mut ok = 0;
        // SAFETY: writes one int.
        check(
            lib,
            unsafe { (lib.hipDeviceCanAccessPeer)(&mut ok, device, peer) },
            "hipDeviceCanAccessPeer",
        )?;
        Ok(ok != 0)
    }

    /// Let the current device access `peer`'s memory; already enabled is success.
    pub fn enable_peer_access(peer: i32) -> Result<(), HipError> {
        let lib = lib()?;
        // SAFETY: flags must be 0.
        let r = unsafe { (lib.hipDeviceEnablePeerAccess)(peer, 0) };
        if r == sys::hipErrorPeerAccessAlreadyEnabled {
            clear_last_error();
            return Ok(());
        }
        check(lib, r, "hipDeviceEnablePeerAccess")
    }
}

pub mod memory {
    use super::*;

    /// `hipExtMallocWithFlags` on the current device (`sys::hipDeviceMalloc*`).
    pub fn malloc_with_flags(bytes: usize, flags: u32) -> Result<*mut c_void, HipError> {
        let lib = lib()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check(
            lib,
            unsafe { (lib.hipExtMallocWithFlags)(&mut p, bytes.max(1), flags) },
            "hipExtMallocWithFlags",
        )?;
        Ok(p)
    }

    pub fn malloc(bytes: usize) -> Result<*mut c_void, HipError> {
        let lib = lib()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check(
            lib,
            unsafe { (lib.hipMalloc)(&mut p, bytes.max(1)) },
            "hipMalloc",
        )?;
        Ok(p)
    }

    /// # Safety
    /// `p` came from `malloc`/`malloc_with_flags` and is not used afterwards.
    pub unsafe fn free(p: *mut c_void) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipFree)(p), "hipFree")
    }

    /// Pinned host memory (`sys::hipHostMalloc*` flags).
    pub fn host_malloc(bytes: usize, flags: u32) -> Result<*mut c_void, HipError> {
        let lib = lib()?;
        let mut p = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check(
            lib,
            unsafe { (lib.hipHostMalloc)(&mut p, bytes.max(1), flags) },
            "hipHostMalloc",
        )?;
        Ok(p)
    }

    /// # Safety
    /// `p` came from `host_malloc` and is not used afterwards.
    pub unsafe fn host_free(p: *mut c_void) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipHostFree)(p), "hipHostFree")
    }

    /// # Safety
    /// `host` came from `host_malloc` with `hipHostMallocMapped`.
    pub unsafe fn host_device_pointer(host: *mut c_void) -> Result<*mut c_void, HipError> {
        let lib = lib()?;
        let mut d = std::ptr::null_mut();
        check(
            lib,
            (lib.hipHostGetDevicePointer)(&mut d, host, 0),
            "hipHostGetDevicePointer",
        )?;
        Ok(d)
    }

    /// Synchronous memset.
    ///
    /// # Safety
    /// `dst` holds `bytes` of device memory.
    pub unsafe fn memset(dst: *mut c_void, value: u8, bytes: usize) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipMemset)(dst, value as c_int, bytes),
            "hipMemset",
        )
    }

    /// Synchronous fill of `count` 32-bit words with `value`.
    ///
    /// # Safety
    /// `dst` holds `4 * count` bytes of device memory.
    pub unsafe fn memset_d32(dst: *mut c_void, value: u32, count: usize) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipMemsetD32)(dst, value as c_int, count),
            "hipMemsetD32",
        )
    }

    /// Synchronous fill of `count` 16-bit words with `value`.
    ///
    /// # Safety
    /// `dst` holds `2 * count` bytes of device memory.
    pub unsafe fn memset_d16(dst: *mut c_void, value: u16, count: usize) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipMemsetD16)(dst, value, count), "hipMemsetD16")
    }

    /// Fill `count` 32-bit words with `value`, ordered on `stream`.
    ///
    /// # Safety
    /// `dst` holds `4 * count` bytes of device memory, alive until the stream passes the fill.
    pub unsafe fn memset_d32_async(
        dst: *mut c_void,
        value: u32,
        count: usize,
        stream: sys::hipStream_t,
    ) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipMemsetD32Async)(dst, value as c_int, count, stream),
            "hipMemsetD32Async",
        )
    }

    /// Fill `count` 16-bit words with `value`, ordered on `stream`.
    ///
    /// # Safety
    /// `dst` holds `2 * count` bytes of device memory, alive until the stream passes the fill.
    pub unsafe fn memset_d16_async(
        dst: *mut c_void,
        value: u16,
        count: usize,
        stream: sys::hipStream_t,
    ) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipMemsetD16Async)(dst, value, count, stream),
            "hipMemsetD16Async",
        )
    }

    /// # Safety
    /// `dst` holds `bytes` of device memory, alive until the stream passes the memset.
    pub unsafe fn memset_async(
        dst: *mut c_void,
        value: u8,
        bytes: usize,
        stream: sys::hipStream_t,
    ) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipMemsetAsync)(dst, value as c_int, bytes, stream),
            "hipMemsetAsync",
        )
    }

    /// # Safety
    /// Both ranges are valid for `bytes` until the stream passes the copy.
    pub unsafe fn copy_async(
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        kind: sys::hipMemcpyKind,
        stream: sys::hipStream_t,
    ) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipMemcpyAsync)(dst, src, bytes, kind, stream),
            "hipMemcpyAsync",
        )
    }
}

/// Sharing device memory with another process: the handle travels over the bootstrap, the
/// peer opens it into its own address space.
pub mod ipc {
    use super::*;

    /// # Safety
    /// `p` is the base of a live device allocation.
    pub unsafe fn get_handle(p: *mut c_void) -> Result<sys::hipIpcMemHandle_t, HipError> {
        let lib = lib()?;
        let mut h = sys::hipIpcMemHandle_t {
            reserved: [0; sys::HIP_IPC_HANDLE_SIZE],
        };
        check(
            lib,
            (lib.hipIpcGetMemHandle)(&mut h, p),
            "hipIpcGetMemHandle",
        )?;
        Ok(h)
    }

    /// The base of the allocation holding `p`.
    ///
    /// # Safety
    /// None beyond a live library: an address no allocation holds is an error return.
    pub unsafe fn allocation_base(p: *mut c_void) -> Result<*mut c_void, HipError> {
        let lib = lib()?;
        let (mut base, mut size) = (std::ptr::null_mut(), 0);
        check(
            lib,
            (lib.hipMemGetAddressRange)(&mut base, &mut size, p),
            "hipMemGetAddressRange",
        )?;
        Ok(base)
    }

    /// Map a peer's allocation (lazily enabling peer access).
    ///
    /// # Safety
    /// `h` comes from `get_handle` in another process whose allocation is still alive.
    pub unsafe fn open_handle(h: sys::hipIpcMemHandle_t) -> Result<*mut c_void, HipError> {
        let lib = lib()?;
        let mut p = std::ptr::null_mut();
        // The flag the header of the running version defines (it was 0 up to ROCm 5.x, 1 in
        // the ROCm 6.2+ headers; see sys).
        let flags = if runtime_version()? >= 60_000_000 {
            sys::hipIpcMemLazyEnablePeerAccess
        } else {
            0
        };
        check(
            lib,
            (lib.hipIpcOpenMemHandle)(&mut p, h, flags),
            "hipIpcOpenMemHandle",
        )?;
        Ok(p)
    }

    /// # Safety
    /// `p` came from `open_handle` and is not used afterwards.
    pub unsafe fn close_handle(p: *mut c_void) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipIpcCloseMemHandle)(p), "hipIpcCloseMemHandle")
    }
}

pub mod stream {
    use super::*;

    /// A stream that does not synchronise with the null stream.
    pub fn create_non_blocking() -> Result<sys::hipStream_t, HipError> {
        let lib = lib()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(
            lib,
            unsafe { (lib.hipStreamCreateWithFlags)(&mut s, sys::hipStreamNonBlocking) },
            "hipStreamCreateWithFlags",
        )?;
        Ok(s)
    }

    /// # Safety
    /// `s` came from `create_non_blocking` and is not used afterwards.
    pub unsafe fn destroy(s: sys::hipStream_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipStreamDestroy)(s), "hipStreamDestroy")
    }

    /// Wait for `s` (null: the null stream).
    ///
    /// # Safety
    /// `s` is null or a live stream.
    pub unsafe fn synchronize(s: sys::hipStream_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipStreamSynchronize)(s), "hipStreamSynchronize")
    }

    /// Whether everything on `s` has finished.
    ///
    /// # Safety
    /// `s` is null or a live stream.
    pub unsafe fn is_idle(s: sys::hipStream_t) -> Result<bool, HipError> {
        let lib = lib()?;
        let r = (lib.hipStreamQuery)(s);
        if r == sys::hipErrorNotReady {
            return Ok(false);
        }
        check(lib, r, "hipStreamQuery")?;
        Ok(true)
    }
}

pub mod event {
    use super::*;

    pub fn create() -> Result<sys::hipEvent_t, HipError> {
        let lib = lib()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(
            lib,
            unsafe { (lib.hipEventCreateWithFlags)(&mut e, sys::hipEventDefault) },
            "hipEventCreateWithFlags",
        )?;
        Ok(e)
    }

    /// # Safety
    /// Both handles are live.
    pub unsafe fn record(e: sys::hipEvent_t, s: sys::hipStream_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipEventRecord)(e, s), "hipEventRecord")
    }

    /// # Safety
    /// `e` is live.
    pub unsafe fn synchronize(e: sys::hipEvent_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipEventSynchronize)(e), "hipEventSynchronize")
    }

    /// Milliseconds between two recorded events.
    ///
    /// # Safety
    /// Both are live and recorded.
    pub unsafe fn elapsed_ms(
        start: sys::hipEvent_t,
        stop: sys::hipEvent_t,
    ) -> Result<f32, HipError> {
        let lib = lib()?;
        let mut ms = 0f32;
        check(
            lib,
            (lib.hipEventElapsedTime)(&mut ms, start, stop),
            "hipEventElapsedTime",
        )?;
        Ok(ms)
    }

    /// # Safety
    /// `e` is not used afterwards.
    pub unsafe fn destroy(e: sys::hipEvent_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipEventDestroy)(e), "hipEventDestroy")
    }
}

/// Graph capture (what engines do with decode steps), for tests.
pub mod graph {
    use super::*;

    /// Start capturing this thread's work on `s`.
    ///
    /// # Safety
    /// `s` is a live, non-null stream; the capture is ended with [`end_capture`].
    pub unsafe fn begin_capture(s: sys::hipStream_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(
            lib,
            (lib.hipStreamBeginCapture)(s, sys::hipStreamCaptureModeThreadLocal),
            "hipStreamBeginCapture",
        )
    }

    /// Whether `s` is being captured (active or invalidated).
    ///
    /// # Safety
    /// `s` is a live stream or null.
    pub unsafe fn is_capturing(s: sys::hipStream_t) -> Result<bool, HipError> {
        let lib = lib()?;
        let mut status = 0;
        check(
            lib,
            (lib.hipStreamIsCapturing)(s, &mut status),
            "hipStreamIsCapturing",
        )?;
        Ok(status != 0)
    }

    /// # Safety
    /// `s` is capturing.
    pub unsafe fn end_capture(s: sys::hipStream_t) -> Result<sys::hipGraph_t, HipError> {
        let lib = lib()?;
        let mut g = std::ptr::null_mut();
        check(
            lib,
            (lib.hipStreamEndCapture)(s, &mut g),
            "hipStreamEndCapture",
        )?;
        Ok(g)
    }

    /// # Safety
    /// `g` is a live graph.
    pub unsafe fn instantiate(g: sys::hipGraph_t) -> Result<sys::hipGraphExec_t, HipError> {
        let lib = lib()?;
        let mut e = std::ptr::null_mut();
        check(
            lib,
            (lib.hipGraphInstantiate)(&mut e, g, std::ptr::null_mut(), std::ptr::null_mut(), 0),
            "hipGraphInstantiate",
        )?;
        Ok(e)
    }

    /// # Safety
    /// `e` is an instantiated graph and `s` a live stream.
    pub unsafe fn launch(e: sys::hipGraphExec_t, s: sys::hipStream_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipGraphLaunch)(e, s), "hipGraphLaunch")
    }

    /// # Safety
    /// Neither is used afterwards.
    pub unsafe fn destroy(e: sys::hipGraphExec_t, g: sys::hipGraph_t) -> Result<(), HipError> {
        let lib = lib()?;
        if !e.is_null() {
            check(lib, (lib.hipGraphExecDestroy)(e), "hipGraphExecDestroy")?;
        }
        if !g.is_null() {
            check(lib, (lib.hipGraphDestroy)(g), "hipGraphDestroy")?;
        }
        Ok(())
    }
}

pub mod module {
    use super::*;

    /// Load a code object (a plain AMDGPU ELF or an offload bundle) on the current device.
    ///
    /// # Safety
    /// `image` is a complete code object.
    pub unsafe fn load_data(image: &[u8]) -> Result<sys::hipModule_t, HipError> {
        let lib = lib()?;
        let mut m = std::ptr::null_mut();
        check(
            lib,
            (lib.hipModuleLoadData)(&mut m, image.as_ptr() as *const c_void),
            "hipModuleLoadData",
        )?;
        Ok(m)
    }

    /// # Safety
    /// `m` is not used afterwards (nor are its functions).
    pub unsafe fn unload(m: sys::hipModule_t) -> Result<(), HipError> {
        let lib = lib()?;
        check(lib, (lib.hipModuleUnload)(m), "hipModuleUnload")
    }

    /// # Safety
    /// `m` is a loaded module.
    pub unsafe fn get_function(
        m: sys::hipModule_t,
        name: &CStr,
    ) -> Result<sys::hipFunction_t, HipError> {
        let lib = lib()?;
        let mut f = std::ptr::null_mut();
        check(
            lib,
            (lib.hipModuleGetFunction)(&mut f, m, name.as_ptr()),
            "hipModuleGetFunction",
        )?;
        Ok(f)
    }

    /// # Safety
    /// `f` is a function of a loaded module.
    pub unsafe fn max_threads_per_block(f: sys::hipFunction_t) -> Result<i32, HipError> {
        let lib = lib()?;
        let mut v = 0;
        check(
            lib,
            (lib.hipFuncGetAttribute)(&mut v, sys::HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f),
            "hipFuncGetAttribute",
        )?;
        Ok(v)
    }

    /// Launch `f` on a 1-D grid with `args` as its whole argument block (copied at launch).
    ///
    /// # Safety
    /// `A` matches the kernel's parameters byte for byte, and every pointer in it is valid
    /// until the kernel has run.
    pub unsafe fn launch<A>(
        f: sys::hipFunction_t,
        grid: u32,
        block: u32,
        stream: sys::hipStream_t,
        args: &A,
    ) -> Result<(), HipError> {
        launch_packed(
            f,
            grid,
            block,
            stream,
            std::slice::from_raw_parts(args as *const A as *const u8, size_of::<A>()),
        )
    }

    /// Launch `f` on a 1-D grid with `params`, its parameters packed as the kernel lays them
    /// out, as its whole argument block (copied at launch).
    ///
    /// # Safety
    /// As [`launch`].
    pub unsafe fn launch_packed(
        f: sys::hipFunction_t,
        grid: u32,
        block: u32,
        stream: sys::hipStream_t,
        params: &[u8],
    ) -> Result<(), HipError> {
        let lib = lib()?;
        let mut size = params.len();
        let mut extra = [
            sys::HIP_LAUNCH_PARAM_BUFFER_POINTER,
            params.as_ptr() as *mut c_void,
            sys::HIP_LAUNCH_PARAM_BUFFER_SIZE,
            &mut size as *mut usize as *mut c_void,
            sys::HIP_LAUNCH_PARAM_END,
        ];
        check(
            lib,
            (lib.hipModuleLaunchKernel)(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream,
                std::ptr::null_mut(),
                extra.as_mut_ptr(),
            ),
            "hipModuleLaunchKernel",
        )
    }
}
