//! A thin `Result` layer over [`super::sys`]: errors carry RCCL's own message.

use std::ffi::{c_int, c_void, CStr};

use allreduce_core::{DType, Error, Result};

use super::sys::{self, window, Lib};

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

/// This process's ranks' symmetric windows: `ncclMemAlloc` memory, registered with
/// `NCCL_WIN_COLL_SYMMETRIC` once [`Windows::register`] ran.
pub struct Windows {
    bytes: usize,
    /// Per window: its device, address, communicator and registration (null until
    /// registered).
    ranks: Vec<(i32, *mut c_void, sys::ncclComm_t, window::ncclWindow_t)>,
}

// SAFETY: device addresses and RCCL handles, used from one thread at a time.
unsafe impl Send for Windows {}
unsafe impl Sync for Windows {}

impl Windows {
    /// `bytes` from `ncclMemAlloc` on each of `devices` (ordinals).
    pub fn alloc(devices: &[i32], bytes: usize) -> Result<Windows> {
        let (lib, win) = (lib()?, window_lib()?);
        let mut w = Windows {
            bytes,
            ranks: Vec::new(),
        };
        for &d in devices {
            crate::hip::result::device::set(d).map_err(Error::from)?;
            let mut ptr = std::ptr::null_mut();
            // SAFETY: RCCL writes the address; what was made so far is freed by drop.
            check(
                lib,
                unsafe { (win.ncclMemAlloc)(&mut ptr, bytes) },
                "ncclMemAlloc",
            )?;
            w.ranks
                .push((d, ptr, std::ptr::null_mut(), std::ptr::null_mut()));
        }
        Ok(w)
    }

    /// Register window i with `comms[i]`, every rank of this process in one RCCL group.
    pub fn register(&mut self, comms: &[sys::ncclComm_t]) -> Result<()> {
        let (lib, win) = (lib()?, window_lib()?);
        let bytes = self.bytes;
        // SAFETY: each window is live memory of its device; the group is always closed;
        // handles are filled by ncclGroupEnd.
        unsafe {
            check(lib, (lib.ncclGroupStart)(), "ncclGroupStart")?;
            let mut first_err = Ok(());
            for ((dev, ptr, comm, handle), &c) in self.ranks.iter_mut().zip(comms) {
                let r = crate::hip::result::device::set(*dev)
                    .map_err(Error::from)
                    .and_then(|()| {
                        check(
                            lib,
                            (win.ncclCommWindowRegister)(
                                c,
                                *ptr,
                                bytes,
                                handle,
                                window::NCCL_WIN_COLL_SYMMETRIC,
                            ),
                            "ncclCommWindowRegister",
                        )
                    });
                if let Err(e) = r {
                    first_err = Err(e);
                    break;
                }
                *comm = c;
            }
            let end = check(lib, (lib.ncclGroupEnd)(), "ncclGroupEnd");
            first_err?;
            end?;
        }
        Ok(())
    }

    pub fn addr(&self, i: usize) -> u64 {
        self.ranks[i].1 as u64
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        let (Ok(lib), Ok(win)) = (lib(), window_lib()) else {
            return;
        };
        // SAFETY: registrations and allocations made above; deregistration is collective
        // like the registration, so it goes in one group.
        unsafe {
            if self.ranks.iter().any(|r| !r.3.is_null()) {
                let _ = (lib.ncclGroupStart)();
                for (dev, _, comm, handle) in &self.ranks {
                    if !handle.is_null() {
                        let _ = crate::hip::result::device::set(*dev);
                        let _ = (win.ncclCommWindowDeregister)(*comm, *handle);
                    }
                }
                let _ = (lib.ncclGroupEnd)();
            }
            for (dev, ptr, _, _) in &self.ranks {
                let _ = crate::hip::result::device::set(*dev);
                let _ = (win.ncclMemFree)(*ptr);
            }
        }
    }
}

/// The window functions, or why this RCCL has none (as `Error::LibraryUnavailable`).
pub fn window_lib() -> Result<&'static window::Lib> {
    window::lib().map_err(|detail| Error::LibraryUnavailable {
        library: "librccl",
        detail,
    })
}
