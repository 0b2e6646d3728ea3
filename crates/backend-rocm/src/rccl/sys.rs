//! The slice of RCCL's (= NCCL's) C API this crate calls, loaded at run time.

#![allow(non_camel_case_types, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::loader;

pub type ncclResult_t = c_int;
pub type ncclComm_t = *mut c_void;
pub type ncclDataType_t = c_int;
pub type ncclRedOp_t = c_int;

pub const ncclSuccess: ncclResult_t = 0;
pub const ncclInProgress: ncclResult_t = 7;

pub const ncclFloat16: ncclDataType_t = 6;
pub const ncclFloat32: ncclDataType_t = 7;
pub const ncclBfloat16: ncclDataType_t = 9;

pub const ncclSum: ncclRedOp_t = 0;

pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

const _: () = assert!(size_of::<ncclUniqueId>() == 128);

loader::function_table! {
    fn ncclGetVersion(version: *mut c_int) -> ncclResult_t;
    fn ncclGetErrorString(result: ncclResult_t) -> *const c_char;
    fn ncclGetUniqueId(id: *mut ncclUniqueId) -> ncclResult_t;
    fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int)
        -> ncclResult_t;
    fn ncclCommInitAll(comms: *mut ncclComm_t, ndev: c_int, devlist: *const c_int)
        -> ncclResult_t;
    fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t;
    fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t;
    fn ncclCommGetAsyncError(comm: ncclComm_t, result: *mut ncclResult_t) -> ncclResult_t;
    fn ncclGroupStart() -> ncclResult_t;
    fn ncclGroupEnd() -> ncclResult_t;
    fn ncclAllReduce(
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        datatype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: *mut c_void,
    ) -> ncclResult_t;
}

/// RCCL's soname is librccl.so.1 in ROCm 5 to 7.
pub const SONAMES: &[&str] = &["librccl.so", "librccl.so.1"];

/// Set to a full path to load that file and nothing else.
pub const PATH_ENV: &str = "ALLREDUCE_LIBRCCL";

/// RCCL, opened on first use; `Err` says what was tried.
pub fn lib() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let candidates = loader::candidates(PATH_ENV, SONAMES);
        match loader::open_first(&candidates) {
            // SAFETY: a library found under librccl's names is RCCL.
            Ok((library, path)) => unsafe { Lib::from_library(library, path) },
            Err(tried) => Err(format!(
                "librccl could not be loaded: {} (install RCCL, part of ROCm, or set {PATH_ENV})",
                loader::describe_tried(&tried)
            )),
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The window API (`Strategy::VendorSymmetric`), which RCCL exports only in its newer
/// releases: resolved apart from [`Lib`], so an RCCL without it still serves `Vendor`.
pub mod window {
    use std::ffi::{c_int, c_void};
    use std::sync::OnceLock;

    use super::{ncclComm_t, ncclResult_t};
    use crate::loader;

    pub type ncclWindow_t = *mut c_void;

    /// `ncclCommWindowRegister`'s flag for windows the symmetric kernels run on.
    pub const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;

    loader::function_table! {
        fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t;
        fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t;
        fn ncclCommWindowRegister(
            comm: ncclComm_t,
            buff: *mut c_void,
            size: usize,
            win: *mut ncclWindow_t,
            flags: c_int,
        ) -> ncclResult_t;
        fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t;
    }

    /// The window functions of the RCCL [`super::lib`] loaded, or why it has none.
    pub fn lib() -> Result<&'static Lib, String> {
        static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
        LIB.get_or_init(|| {
            let rccl = super::lib()?;
            // SAFETY: the library is already loaded; this takes another reference to it.
            let library = unsafe { libloading::Library::new(&rccl.path) }
                .map_err(|e| format!("{}: {e}", rccl.path))?;
            // SAFETY: RCCL's window functions have NCCL's signatures, declared above.
            unsafe { Lib::from_library(library, rccl.path.clone()) }
                .map_err(|e| format!("no symmetric windows: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
    }
}
