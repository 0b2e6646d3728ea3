//! The C ABI of `allreduce`: NCCL-shaped `extern "C"` functions over the facade's
//! [`Communicator`](allreduce::Communicator), for engines written in C, C++ or Python
//! (ctypes). The header is `include/allreduce.h`, generated from this crate's doc comments by
//! cbindgen (a test checks it is current).
//!
//! Rules every function follows:
//!
//! - It returns an `ar_result_t`: 0 on success, else one code per facade error kind, and the
//!   failure's message in `ar_last_error()` on the same thread.
//! - Handles are tokens looked up in a table, never dereferenced addresses: a null,
//!   destroyed or made-up handle is `AR_INVALID_USAGE`, not a crash.
//! - Enums arrive as plain `int`s and are decoded by match; a value that names nothing is
//!   `AR_INVALID_ARGUMENT`.
//! - No panic crosses into C: each body runs under `catch_unwind`, and a panic is
//!   `AR_INTERNAL_ERROR`.
//!
//! What C still promises, as with NCCL: buffer pointers hold `count` elements on this rank's
//! device until the call's work completes, out-pointers are writable, and a communicator is
//! driven by one thread at a time.

// The exported names are the C names the header declares (`ar_result_t`, `AR_SUCCESS`).
#![allow(non_camel_case_types)]

// In the order the header declares their items: result codes, argument enums and
// structs, handles, then the functions.
mod codes;

mod args;
mod handle;
mod unique_id;

mod call;
mod collective;
mod comm;
mod fused;
mod registration;

use std::ffi::c_int;

pub use args::{
    ar_backend_t, ar_config_t, ar_dtype_t, ar_precision_t, ar_red_op_t, ar_strategy_t,
    AR_DEFAULT_TIMEOUT_MS,
};
pub use call::ar_last_error;
pub use codes::{ar_get_error_string, ar_result_t};
pub use collective::{ar_all_reduce, ar_reject};
pub use comm::{
    ar_comm_abort, ar_comm_alignment, ar_comm_backend, ar_comm_count, ar_comm_destroy,
    ar_comm_device, ar_comm_init_all, ar_comm_init_env, ar_comm_init_rank, ar_comm_max_bytes,
    ar_comm_select, ar_comm_splits_large_calls, ar_comm_synchronize, ar_comm_user_rank,
    ar_comm_vendor_window,
};
pub use fused::{
    ar_all_reduce_fused, ar_fused_args_t, ar_fused_pattern_t, ar_fused_reject,
    ar_fused_workspace_create, ar_fused_workspace_destroy,
};
pub use handle::{ar_comm, ar_comm_t, ar_fused_workspace, ar_fused_workspace_t};
pub use registration::{
    ar_comm_deregister, ar_comm_register, ar_comm_register_graph_buffers,
    ar_comm_set_graph_registration,
};
pub use unique_id::{ar_get_unique_id, ar_unique_id_t, AR_UNIQUE_ID_BYTES};

/// The version the header describes, `major * 10000 + minor * 100 + patch` (NCCL's
/// `NCCL_VERSION_CODE` form). Compare it with `ar_get_version` to detect a library built
/// from another header.
pub const AR_VERSION_CODE: c_int = 100;

/// This library's version, `major * 10000 + minor * 100 + patch` (NCCL's `ncclGetVersion`).
/// Thread-safe.
///
/// # Safety
/// `version` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_get_version(version: *mut c_int) -> ar_result_t {
    call::run(|| {
        // SAFETY: the caller's promise.
        unsafe { call::write_out(version, "version", version_code()) }
    })
}

fn version_code() -> c_int {
    let part = |s: &str| s.parse::<c_int>().unwrap_or(0);
    part(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
        + part(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + part(env!("CARGO_PKG_VERSION_PATCH"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_constant_is_the_package_version() {
        // Bumping the workspace version must bump the constant (and so the header).
        assert_eq!(version_code(), AR_VERSION_CODE);
        let mut v = 0;
        // SAFETY: `v` is writable.
        assert_eq!(unsafe { ar_get_version(&mut v) }, ar_result_t::AR_SUCCESS);
        assert_eq!(v, AR_VERSION_CODE);
    }
}
