//! NCCL behind `Strategy::Vendor`, loaded at run time through cudarc's `nccl::sys`.
//!
//! A missing libnccl is not an error of the group: the vendor strategy is then unavailable
//! and says why, and `Auto` skips it. NCCL needs one GPU per rank, so groups of virtual ranks
//! (several on one GPU) have no vendor path either, except a group of one.
//!
//! NCCL's kernels have no deadline of ours: a peer that never arrives hangs them the way it
//! hangs NCCL anywhere. Only our own kernels report `Timeout`.

use std::ffi::CStr;

use allreduce_core::{DType, Error, Result, Stream};
use cudarc::nccl::sys;

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
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
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
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
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
