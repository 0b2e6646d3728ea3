//! A thin `Result` layer over [`super::sys`]: errors carry RCCL's own message.

use std::ffi::{c_int, CStr};

use allreduce_core::{DType, Error, Result};

use super::sys::{self, Lib};

/// The loaded library, or why there is none (as `Error::LibraryUnavailable`).
pub fn lib() -> Result<&'static Lib> {
    sys::lib().map_err(|detail| Error::LibraryUnavailable {
        library: "librccl",
        detail,
    })
}

pub fn check(lib: &Lib, r: sys::ncclResult_t, api: &'static str) -> Result<()> {
    if r == sys::ncclSuccess {
        return Ok(());
    }
    // SAFETY: takes any code, returns a static string or null.
    let s = unsafe { (lib.ncclGetErrorString)(r) };
    let detail = if s.is_null() {
        format!("ncclResult_t {r}")
    } else {
        // SAFETY: a NUL-terminated static string.
        let msg = unsafe { CStr::from_ptr(s) }.to_string_lossy();
        format!("{msg} (ncclResult_t {r})")
    };
    Err(Error::Device { api, detail })
}

/// RCCL's version code (NCCL's encoding: 22_005 for 2.20.5).
pub fn version() -> Result<i32> {
    let lib = lib()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    check(
        lib,
        unsafe { (lib.ncclGetVersion)(&mut v) },
        "ncclGetVersion",
    )?;
    Ok(v)
}

/// One communicator per device of `devices` (rank r on `devices[r]`, all distinct), created
/// together from this thread.
pub fn init_all(devices: &[i32]) -> Result<Vec<sys::ncclComm_t>> {
    let lib = lib()?;
    let mut comms = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: `comms` has room for one handle per device.
    check(
        lib,
        unsafe {
            (lib.ncclCommInitAll)(comms.as_mut_ptr(), devices.len() as c_int, devices.as_ptr())
        },
        "ncclCommInitAll",
    )?;
    Ok(comms)
}

/// # Safety
/// `comm` is not used afterwards.
pub unsafe fn destroy(comm: sys::ncclComm_t) -> Result<()> {
    let lib = lib()?;
    check(lib, (lib.ncclCommDestroy)(comm), "ncclCommDestroy")
}

pub fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclFloat32,
        DType::F16 => sys::ncclFloat16,
        DType::BF16 => sys::ncclBfloat16,
    }
}

/// Enqueue a sum on `stream` (in place when `input == output`).
///
/// # Safety
/// Both buffers hold `n` elements on the communicator's device until the stream passes the
/// call.
pub unsafe fn all_reduce(
    comm: sys::ncclComm_t,
    input: usize,
    output: usize,
    n: usize,
    dtype: DType,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    let lib = lib()?;
    check(
        lib,
        (lib.ncclAllReduce)(
            input as *const _,
            output as *mut _,
            n,
            nccl_dtype(dtype),
            sys::ncclSum,
            comm,
            stream,
        ),
        "ncclAllReduce",
    )
}
