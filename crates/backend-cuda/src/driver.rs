//! The slice of the CUDA driver API this backend uses, over cudarc's `sys` layer.
//!
//! cudarc loads libcuda lazily and panics if it is missing, so [`init`] probes for the
//! library first and every later call can assume it. Errors become `Error::Device` with the
//! driver's own message.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use allreduce_core::{Error, Result};
use cudarc::driver::sys;

pub use sys::{CUcontext, CUdevice, CUdeviceptr, CUfunction, CUmodule, CUstream};

pub fn check(r: sys::CUresult, api: &'static str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the library is loaded (every caller runs after `init`); cuGetErrorString
    // writes a pointer to a static string or leaves it null.
    let detail = unsafe {
        if sys::cuGetErrorString(r, &mut s) == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
            CStr::from_ptr(s).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    Err(Error::Device {
        api,
        detail: format!("{detail} ({r:?})"),
    })
}

/// Whether libcuda can be used: probed when cudarc loads it, given when it is linked (the
/// process would not have started without it).
fn driver_present() -> bool {
    #[cfg(feature = "linked")]
    return true;
    // SAFETY: probing only tries to open the library.
    #[cfg(not(feature = "linked"))]
    unsafe {
        sys::is_culib_present()
    }
}

/// Load libcuda and initialise the driver, once per process.
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_present() {
            return Err(Error::LibraryUnavailable {
                library: "libcuda",
                detail: "the NVIDIA driver library could not be loaded (no driver installed?)"
                    .into(),
            });
        }
        // Ranks on one GPU run on their own streams and spin on each other: if two of those
        // streams share one of the device's hardware work queues (8 by default), the kernel
        // behind waits for the one in front, which waits for it. 32 queues (the maximum) keep
        // up to 32 streams apart. Read when a context is created, so it only helps if this
        // process has not made one yet; a caller's own setting wins.
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
        }
        // SAFETY: the library is present.
        check(unsafe { sys::cuInit(0) }, "cuInit")
    })
    .clone()
}

pub fn device_count() -> Result<usize> {
    init()?;
    let mut n = 0;
    // SAFETY: driver initialised.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n as usize)
}

/// Bytes of device memory in use on device `ordinal` (total - free, as cuMemGetInfo reports
/// them for the whole device: every process's allocations and the driver's own), with the
/// device's primary context current on the calling thread afterwards. For soak tests that
/// check that nothing leaks.
pub fn memory_in_use(ordinal: u32) -> Result<usize> {
    let dev = Device::open(ordinal)?;
    dev.bind()?;
    let (mut free, mut total) = (0, 0);
    // SAFETY: out-pointers to locals; a context is current.
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok(total - free)
}

/// One line naming a device for benchmark reports: model, compute capability, SMs, the
/// kernel driver's version and the CUDA version the driver supports. Figures are only
/// comparable between runs on the same model and driver, so a report must say which.
/// Needs no context. Without libcuda or the device, an error value.
pub fn device_description(ordinal: u32) -> Result<String> {
    init()?;
    let count = device_count()?;
    if ordinal as usize >= count {
        return Err(Error::InvalidConfig(format!(
            "CUDA device {ordinal} requested but {count} present"
        )));
    }
    let mut dev = 0;
    let mut name = [0 as std::ffi::c_char; 256];
    let (mut major, mut minor, mut sms, mut cuda) = (0, 0, 0, 0);
    let attr = |value: &mut i32, a: sys::CUdevice_attribute, dev: CUdevice| {
        // SAFETY: driver initialised, `dev` from cuDeviceGet.
        check(
            unsafe { sys::cuDeviceGetAttribute(value, a, dev) },
            "cuDeviceGetAttribute",
        )
    };
    // SAFETY: driver initialised, ordinal checked; the name buffer's length is passed and the
    // driver NUL-terminates within it.
    let name = unsafe {
        check(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
        check(
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
            "cuDeviceGetName",
        )?;
        check(sys::cuDriverGetVersion(&mut cuda), "cuDriverGetVersion")?;
        CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned()
    };
    use sys::CUdevice_attribute as A;
    attr(
        &mut major,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        dev,
    )?;
    attr(
        &mut minor,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        dev,
    )?;
    attr(&mut sms, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)?;
    // The driver API reports only the CUDA version; the driver's own release (580.159) is
    // in the kernel module's version file on Linux.
    let driver = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|s| kernel_module_version(&s))
        .unwrap_or_else(|| "unknown".into());
    Ok(format!(
        "{name}, sm_{major}{minor}, {sms} SMs, driver {driver}, CUDA {}.{}",
        cuda / 1000,
        (cuda % 1000) / 10
    ))
}

/// The release in `/proc/driver/nvidia/version`'s first line ("NVRM version: NVIDIA UNIX
/// Open Kernel Module for x86_64  580.159  Release Build ..."): the first word after
/// "Module" made of digits and dots.
fn kernel_module_version(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    let (_, rest) = line.split_once("Module")?;
    rest.split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

/// Retain each device's primary context once for the life of the process. Releasing the
/// last reference destroys the context, and the next group would build a new one, paying its
/// lazy first-launch work again (see `GpuBackend`'s warm-up).
fn keep_primary_context(dev: CUdevice) -> Result<()> {
    static KEPT: std::sync::Mutex<Vec<CUdevice>> = std::sync::Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if !kept.contains(&dev) {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a valid device; never released on purpose.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        kept.push(dev);
    }
    Ok(())
}

/// A device's primary context, retained for as long as this value lives.
pub struct Device {
    pub ordinal: u32,
    pub dev: CUdevice,
    pub ctx: CUcontext,
    pub sm_count: u32,
    /// Compute capability major (9: Hopper, clusters).
    pub cc_major: u32,
}

// SAFETY: contexts and device handles may be used from any thread.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    pub fn open(ordinal: u32) -> Result<Self> {
        init()?;
        let count = device_count()?;
        if ordinal as usize >= count {
            return Err(Error::InvalidConfig(format!(
                "CUDA device {ordinal} requested but {count} present"
            )));
        }
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        let mut sms = 0;
        let mut major = 0;
        // SAFETY: driver initialised, ordinal checked.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
            keep_primary_context(dev)?;
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(
                sys::cuDeviceGetAttribute(
                    &mut sms,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
                "cuDeviceGetAttribute",
            )?;
            check(
                sys::cuDeviceGetAttribute(
                    &mut major,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
                "cuDeviceGetAttribute",
            )?;
        }
        Ok(Device {
            ordinal,
            dev,
            ctx,
            sm_count: sms as u32,
            cc_major: major as u32,
        })
    }

    /// Make this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    pub fn can_access_peer(&self, other: &Device) -> Result<bool> {
        let mut ok = 0;
        // SAFETY: both handles are valid devices.
        check(
            unsafe { sys::cuDeviceCanAccessPeer(&mut ok, self.dev, other.dev) },
            "cuDeviceCanAccessPeer",
        )?;
        Ok(ok != 0)
    }

    /// Let this context read and write `other`'s memory.
    pub fn enable_peer(&self, other: &Device) -> Result<()> {
        self.bind()?;
        // SAFETY: both contexts are retained.
        let r = unsafe { sys::cuCtxEnablePeerAccess(other.ctx, 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check(r, "cuCtxEnablePeerAccess")
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balanced with the retain in `open`. A failure here has no one to report to.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// Device memory, freed on drop: in the order of `stream` when it came from
/// [`DeviceMem::alloc_async`], else at once.
pub struct DeviceMem {
    pub ptr: CUdeviceptr,
    pub bytes: usize,
    stream: Option<CUstream>,
}

// SAFETY: a device address and a stream handle, usable from any thread.
unsafe impl Send for DeviceMem {}
unsafe impl Sync for DeviceMem {}

impl DeviceMem {
    /// Allocate `bytes` in the current context, uninitialised.
    pub fn alloc(bytes: usize) -> Result<Self> {
        let mut ptr = 0;
        // SAFETY: a context is current (callers bind first).
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
            "cuMemAlloc",
        )?;
        Ok(DeviceMem {
            ptr,
            bytes,
            stream: None,
        })
    }

    /// Allocate `bytes` from the current device's default memory pool in the order of
    /// `stream`, uninitialised, and free it in that order on drop.
    ///
    /// # Safety
    /// `stream` is a live stream of the current context that outlives the memory.
    pub unsafe fn alloc_async(bytes: usize, stream: CUstream) -> Result<Self> {
        let mut ptr = 0;
        check(
            sys::cuMemAllocAsync(&mut ptr, bytes.max(1), stream),
            "cuMemAllocAsync",
        )?;
        Ok(DeviceMem {
            ptr,
            bytes,
            stream: Some(stream),
        })
    }

    /// Allocate and zero, and wait for the zeroing: a memset on the legacy stream does not
    /// order with the non-blocking streams kernels later run on.
    pub fn zeroed(bytes: usize) -> Result<Self> {
        let m = Self::alloc(bytes)?;
        // SAFETY: the allocation holds at least `bytes.max(1)`.
        unsafe {
            check(sys::cuMemsetD8_v2(m.ptr, 0, bytes.max(1)), "cuMemsetD8")?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        Ok(m)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc, or by cuMemAllocAsync on a stream that is still
        // alive (alloc_async's contract); unified addressing lets any context free it.
        unsafe {
            match self.stream {
                Some(s) => {
                    let _ = sys::cuMemFreeAsync(self.ptr, s);
                }
                None => {
                    let _ = sys::cuMemFree_v2(self.ptr);
                }
            }
        }
    }
}

/// Pinned host memory mapped into every context: where kernels report errors so the host
/// can read them without a copy.
pub struct HostMapped {
    pub host: *mut c_void,
    pub dev: CUdeviceptr,
}

unsafe impl Send for HostMapped {}
unsafe impl Sync for HostMapped {}

impl HostMapped {
    pub fn zeroed(bytes: usize) -> Result<Self> {
        let mut host = std::ptr::null_mut();
        let mut dev = 0;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a context is current; the allocation is zeroed before use.
        unsafe {
            check(
                sys::cuMemHostAlloc(&mut host, bytes, flags),
                "cuMemHostAlloc",
            )?;
            std::ptr::write_bytes(host as *mut u8, 0, bytes);
            check(
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0),
                "cuMemHostGetDevicePointer",
            )?;
        }
        Ok(HostMapped { host, dev })
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc.
        unsafe {
            let _ = sys::cuMemFreeHost(self.host);
        }
    }
}

/// A module loaded from the embedded fatbin, with the functions we launch.
pub struct Module {
    pub module: CUmodule,
}

unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    pub fn load(image: &[u8]) -> Result<Self> {
        let mut module = std::ptr::null_mut();
        // SAFETY: a context is current; the image is a fatbin produced by build-support.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        Ok(Module { module })
    }

    pub fn function(&self, name: &CStr) -> Result<CUfunction> {
        let mut f = std::ptr::null_mut();
        // SAFETY: module is loaded; `f` is the function just returned.
        unsafe {
            check(
                sys::cuModuleGetFunction(&mut f, self.module, name.as_ptr()),
                "cuModuleGetFunction",
            )?;
            // Load the code now. With CUDA's default lazy loading the first launch loads it,
            // and loading can wait for the device to go idle: a rank's first launch would then
            // wait for its peers' kernels, which wait for that launch. A deadlock.
            check(sys::cuFuncLoad(f), "cuFuncLoad")?;
        }
        Ok(f)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by cuModuleLoadData.
        unsafe {
            let _ = sys::cuModuleUnload(self.module);
        }
    }
}

/// Launch `f` with one by-value argument struct.
///
/// # Safety
/// `A` must match the kernel's parameter layout, and every pointer in it must be valid for
/// the kernel's lifetime.
pub unsafe fn launch<A>(
    f: CUfunction,
    grid: u32,
    block: u32,
    stream: CUstream,
    args: &A,
) -> Result<()> {
    launch_params(
        f,
        grid,
        block,
        stream,
        &mut [args as *const A as *mut c_void],
    )
}

/// `cuLaunchKernel` on a 1-D grid with the parameter pointers given.
///
/// # Safety
/// `params` match the kernel's parameters, as for [`launch`].
unsafe fn launch_params(
    f: CUfunction,
    grid: u32,
    block: u32,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    check(
        sys::cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
        "cuLaunchKernel",
    )
}

/// Launch `f` with one 8-byte parameter per word of `words`.
///
/// # Safety
/// The kernel takes `words.len()` parameters of 8 bytes; every pointer among them must be
/// valid for the kernel's lifetime.
pub unsafe fn launch_words(
    f: CUfunction,
    grid: u32,
    block: u32,
    stream: CUstream,
    words: &[u64],
) -> Result<()> {
    let mut params: Vec<*mut c_void> = words
        .iter()
        .map(|w| w as *const u64 as *mut c_void)
        .collect();
    launch_params(f, grid, block, stream, &mut params)
}

/// [`launch`] in clusters of `cluster` blocks along x (`grid` a multiple of it).
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_cluster<A>(
    f: CUfunction,
    grid: u32,
    cluster: u32,
    block: u32,
    stream: CUstream,
    args: &A,
) -> Result<()> {
    launch_ex(f, grid, cluster, false, block, stream, args)
}

/// [`launch`] through cuLaunchKernelEx: in clusters of `cluster` blocks where it is above 1,
/// and with programmatic stream serialization where `pdl` (the kernel may be scheduled once
/// the stream's previous kernel triggers, and waits for it with griddepcontrol.wait).
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_ex<A>(
    f: CUfunction,
    grid: u32,
    cluster: u32,
    pdl: bool,
    block: u32,
    stream: CUstream,
    args: &A,
) -> Result<()> {
    let mut params = [args as *const A as *mut c_void];
    let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
    let mut n = 0;
    if cluster > 1 {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim.x = cluster;
        attrs[n].value.clusterDim.y = 1;
        attrs[n].value.clusterDim.z = 1;
        n += 1;
    }
    if pdl {
        attrs[n].id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    check(
        sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()),
        "cuLaunchKernelEx",
    )
}

pub fn stream_synchronize(stream: allreduce_core::Stream) -> Result<()> {
    // SAFETY: driver initialised; a bad handle is reported by the driver.
    check(
        unsafe { sys::cuStreamSynchronize(stream.as_raw() as CUstream) },
        "cuStreamSynchronize",
    )
}

/// Wait for everything on the current context.
pub fn context_synchronize() -> Result<()> {
    // SAFETY: driver initialised; a context is bound by the caller.
    check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
}

#[cfg(test)]
mod tests {
    use super::kernel_module_version;

    #[test]
    fn kernel_module_version_from_both_module_kinds() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159  Release \
                    Build  (dvs-builder@U22)  Thu Oct  2 2025\nGCC version:  gcc 12\n";
        assert_eq!(kernel_module_version(open).as_deref(), Some("580.159"));
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024";
        assert_eq!(kernel_module_version(closed).as_deref(), Some("550.54.15"));
        assert_eq!(kernel_module_version(""), None);
    }
}
