//! NCCL behind `Strategy::Vendor`, loaded at run time through cudarc's `nccl::sys`.
//!
//! A missing libnccl is not an error of the group: the vendor strategy is then unavailable
//! and says why, and `Auto` skips it. NCCL needs one GPU per rank, so groups of virtual ranks
//! (several on one GPU) have no vendor path either, except a group of one.
//!
//! NCCL's kernels have no deadline of ours: a peer that never arrives hangs them the way it
//! hangs NCCL anywhere. Only our own kernels report `Timeout`.
//!
//! Symmetric windows (`Strategy::VendorSymmetric`) need NCCL 2.27 or later. cudarc resolves
//! a symbol on first call and panics where it is missing, so the version and every window
//! symbol are checked here before the first window call.

use std::ffi::{c_void, CStr};

use allreduce_core::{DType, Error, Result, Stream};
use cudarc::nccl::sys;

use cudarc::driver::sys as cu;

use crate::driver;

fn check(r: sys::ncclResult_t, api: &'static str) -> Result<()> {
    if r == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: the library is loaded (callers probe first); the string is static.
    let detail = unsafe {
        let s = sys::ncclGetErrorString(r);
        if s.is_null() {
            format!("{r:?}")
        } else {
            CStr::from_ptr(s).to_string_lossy().into_owned()
        }
    };
    Err(Error::Device {
        api,
        detail: format!("{detail} ({r:?})"),
    })
}

/// Why NCCL cannot serve this group, or `None` if it can.
pub fn unavailable(ordinals: &[u32]) -> Option<String> {
    if std::env::var_os("ALLREDUCE_DISABLE_NCCL").is_some() {
        return Some("disabled by ALLREDUCE_DISABLE_NCCL".into());
    }
    let mut seen = Vec::new();
    for o in ordinals {
        if seen.contains(o) {
            return Some(format!(
                "NCCL needs one GPU per rank; this group has several ranks on GPU {o} (virtual ranks)"
            ));
        }
        seen.push(*o);
    }
    if !nccl_present() {
        return Some(
            "libnccl could not be loaded (install NCCL or put libnccl.so.2 on LD_LIBRARY_PATH)"
                .into(),
        );
    }
    None
}

/// One rank's NCCL communicator.
pub struct Comm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time per comm
// (each rank is driven from its own thread).
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitRank; nothing to report a failure to.
        unsafe {
            let _ = sys::ncclCommDestroy(self.0);
        }
    }
}

/// Build one communicator per rank, `devices[r]` being rank r's GPU (all distinct).
pub fn init(devices: &[&driver::Device]) -> Result<Vec<Comm>> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: library present (see `unavailable`); `id` is written by NCCL.
    check(unsafe { sys::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    let world = devices.len() as i32;
    let mut comms = vec![std::ptr::null_mut(); devices.len()];
    // One thread initialises every rank: NCCL requires the calls inside one group.
    // SAFETY: each init runs with its rank's context current; the group is always closed.
    unsafe {
        check(sys::ncclGroupStart(), "ncclGroupStart")?;
        let mut first_err = Ok(());
        for (rank, d) in devices.iter().enumerate() {
            if let Err(e) = d.bind().and_then(|_| {
                check(
                    sys::ncclCommInitRank(&mut comms[rank], world, id, rank as i32),
                    "ncclCommInitRank",
                )
            }) {
                first_err = Err(e);
                break;
            }
        }
        let end = check(sys::ncclGroupEnd(), "ncclGroupEnd");
        first_err?;
        end?;
    }
    Ok(comms.into_iter().map(Comm).collect())
}

/// A new group id (`ncclGetUniqueId`), for rank 0 of a multi-process group to send to the
/// others.
pub fn unique_id() -> Result<Vec<u8>> {
    if !nccl_present() {
        return Err(Error::LibraryUnavailable {
            library: "libnccl",
            detail: "could not be loaded (put libnccl.so.2 on LD_LIBRARY_PATH)".into(),
        });
    }
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: library present; `id` is written by NCCL.
    check(unsafe { sys::ncclGetUniqueId(&mut id) }, "ncclGetUniqueId")?;
    Ok(id.internal.iter().map(|&b| b as u8).collect())
}

/// This process's communicator of a group whose id rank 0 made with [`unique_id`]; the
/// device must be current.
pub fn init_rank(id: &[u8], rank: usize, world: usize) -> Result<Comm> {
    let bytes: [u8; 128] = id.try_into().map_err(|_| Error::Bootstrap {
        detail: format!("an NCCL id is 128 bytes, rank 0 sent {}", id.len()),
    })?;
    let id = sys::ncclUniqueId {
        internal: bytes.map(|b| b as std::ffi::c_char),
    };
    let mut comm = std::ptr::null_mut();
    // SAFETY: the id came from ncclGetUniqueId on rank 0; every rank calls this together.
    check(
        unsafe { sys::ncclCommInitRank(&mut comm, world as i32, id, rank as i32) },
        "ncclCommInitRank",
    )?;
    Ok(Comm(comm))
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

/// Enqueue a sum on `stream` (in place when `input == output`).
///
/// # Safety
/// The buffers must hold `n` elements on this rank's device, valid until the stream passes
/// the call.
pub unsafe fn all_reduce(
    comm: &Comm,
    input: usize,
    output: usize,
    n: usize,
    dtype: DType,
    stream: Stream,
) -> Result<()> {
    check(
        sys::ncclAllReduce(
            input as *const _,
            output as *mut _,
            n,
            nccl_dtype(dtype),
            sys::ncclRedOp_t::ncclSum,
            comm.0,
            stream.as_raw() as _,
        ),
        "ncclAllReduce",
    )
}

/// `ncclCommWindowRegister`'s flag for windows NCCL's symmetric kernels run on (nccl.h).
const NCCL_WIN_COLL_SYMMETRIC: i32 = 0x01;

/// The first NCCL with symmetric windows (2.27.0, in NCCL's version code).
pub const SYMMETRIC_MIN_VERSION: i32 = 22_700;

/// The symbols the windows call.
#[cfg_attr(feature = "linked", allow(dead_code))]
const WINDOW_SYMBOLS: [&str; 4] = [
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
];

/// "2.27.3" from NCCL's version code (major * 10000 + minor * 100 + patch since 2.9).
pub fn version_name(code: i32) -> String {
    format!("{}.{}.{}", code / 10_000, (code / 100) % 100, code % 100)
}

/// Why an NCCL of version `code`, lacking `missing` (the first window symbol not found), has
/// no symmetric windows; `None` if it has them.
pub fn symmetric_gate(code: i32, missing: Option<&str>) -> Option<String> {
    if code < SYMMETRIC_MIN_VERSION {
        return Some(format!(
            "NCCL {} has no symmetric windows (NCCL {} or later has them)",
            version_name(code),
            version_name(SYMMETRIC_MIN_VERSION)
        ));
    }
    missing.map(|m| {
        format!(
            "NCCL {} lacks {m}, which symmetric windows need",
            version_name(code)
        )
    })
}

/// Why the loaded NCCL cannot make symmetric windows, or `None`. The library must be
/// present ([`unavailable`] said so).
pub fn symmetric_unavailable() -> Option<String> {
    let mut code = 0;
    // SAFETY: the library is present; ncclGetVersion exists in every NCCL 2.
    if let Err(e) = check(unsafe { sys::ncclGetVersion(&mut code) }, "ncclGetVersion") {
        return Some(e.to_string());
    }
    symmetric_gate(code, missing_window_symbol())
}

/// The first window symbol the loaded NCCL lacks. Looked up before any call, because cudarc
/// panics on a missing symbol. A linked NCCL has them all: the process would not have
/// started otherwise (symbols bind when it loads).
fn missing_window_symbol() -> Option<&'static str> {
    #[cfg(feature = "linked")]
    return None;
    #[cfg(not(feature = "linked"))]
    {
        // SAFETY: only looks symbols up in the loaded library.
        let lib = unsafe { sys::culib() };
        WINDOW_SYMBOLS.into_iter().find(|name| {
            // SAFETY: a lookup; the pointer is not called here.
            unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err()
        })
    }
}

/// Whether libnccl can be used: probed when cudarc loads it, given when it is linked.
fn nccl_present() -> bool {
    #[cfg(feature = "linked")]
    return true;
    // SAFETY: only tries to open the library.
    #[cfg(not(feature = "linked"))]
    unsafe {
        sys::is_culib_present()
    }
}

/// This process's ranks' windows: `ncclMemAlloc` memory (VMM memory NCCL can map into its
/// peers), registered with `NCCL_WIN_COLL_SYMMETRIC` once [`Windows::register`] ran.
pub struct Windows {
    bytes: usize,
    /// Per window: its context, address, communicator and registration (null until
    /// registered).
    ranks: Vec<(
        cu::CUcontext,
        *mut c_void,
        sys::ncclComm_t,
        sys::ncclWindow_t,
    )>,
}

// SAFETY: device addresses and NCCL handles, usable from any thread one call at a time.
unsafe impl Send for Windows {}
unsafe impl Sync for Windows {}

impl Windows {
    /// `bytes` from `ncclMemAlloc` on each device (the symbols were checked by
    /// [`symmetric_unavailable`]).
    pub fn alloc(devices: &[&driver::Device], bytes: usize) -> Result<Windows> {
        let mut w = Windows {
            bytes,
            ranks: Vec::new(),
        };
        for d in devices {
            d.bind()?;
            let mut ptr = std::ptr::null_mut();
            // SAFETY: the device is current; NCCL writes the address. On failure the
            // windows made so far are freed by drop.
            check(
                unsafe { sys::ncclMemAlloc(&mut ptr, bytes) },
                "ncclMemAlloc",
            )?;
            w.ranks
                .push((d.ctx, ptr, std::ptr::null_mut(), std::ptr::null_mut()));
        }
        Ok(w)
    }

    /// Register window i with `comms[i]`, every rank of this process in one NCCL group
    /// (the registration is collective).
    pub fn register(&mut self, comms: &[Comm]) -> Result<()> {
        let bytes = self.bytes;
        // SAFETY: each window is live memory of its context's device; the group is always
        // closed; handles are filled by ncclGroupEnd.
        unsafe {
            check(sys::ncclGroupStart(), "ncclGroupStart")?;
            let mut first_err = Ok(());
            for ((ctx, ptr, comm, win), c) in self.ranks.iter_mut().zip(comms) {
                let r = set_current(*ctx).and_then(|()| {
                    check(
                        sys::ncclCommWindowRegister(c.0, *ptr, bytes, win, NCCL_WIN_COLL_SYMMETRIC),
                        "ncclCommWindowRegister",
                    )
                });
                if let Err(e) = r {
                    first_err = Err(e);
                    break;
                }
                *comm = c.0;
            }
            let end = check(sys::ncclGroupEnd(), "ncclGroupEnd");
            first_err?;
            end?;
        }
        Ok(())
    }

    pub fn addr(&self, i: usize) -> u64 {
        self.ranks[i].1 as u64
    }
}

fn set_current(ctx: cu::CUcontext) -> Result<()> {
    // SAFETY: a retained primary context of one of the group's devices.
    match unsafe { cu::cuCtxSetCurrent(ctx) } {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(Error::Device {
            api: "cuCtxSetCurrent",
            detail: format!("{e:?}"),
        }),
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        // SAFETY: registrations and allocations made above; deregistration is collective
        // like the registration, so every rank's goes in one group. Nothing to report a
        // failure to.
        unsafe {
            if self.ranks.iter().any(|r| !r.3.is_null()) {
                let _ = sys::ncclGroupStart();
                for (ctx, _, comm, win) in &self.ranks {
                    if !win.is_null() {
                        let _ = set_current(*ctx);
                        let _ = sys::ncclCommWindowDeregister(*comm, *win);
                    }
                }
                let _ = sys::ncclGroupEnd();
            }
            for (ctx, ptr, _, _) in &self.ranks {
                let _ = set_current(*ctx);
                let _ = sys::ncclMemFree(*ptr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symmetric_windows_need_nccl_2_27_and_its_symbols() {
        let old = symmetric_gate(22_605, None).expect("2.26.5 is too old");
        assert!(
            old.contains("NCCL 2.26.5") && old.contains("2.27.0"),
            "{old}"
        );
        assert_eq!(symmetric_gate(22_700, None), None);
        assert_eq!(symmetric_gate(22_809, None), None);
        let lacking = symmetric_gate(22_809, Some("ncclCommWindowRegister")).unwrap();
        assert!(
            lacking.contains("2.28.9") && lacking.contains("ncclCommWindowRegister"),
            "{lacking}"
        );
    }
}
