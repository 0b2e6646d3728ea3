//! CUDA/HIP graph buffers registered after capture (vLLM's `capture()` and
//! `register_graph_buffers`): calls captured with graph registration on read every rank's
//! input in place once their buffers are registered.

use std::ffi::c_int;

use allreduce::{Communicator, Error};

use crate::call::{self, write_out, Failure};
use crate::codes::ar_result_t;
use crate::handle::{self, ar_comm_t, CommRef};

/// While `on` is non-zero, every out-of-place exact one-shot or two-shot call this rank
/// enqueues on a stream being captured into a graph, on an input the group has not
/// registered, is captured to read every rank's input in place from addresses that
/// `ar_comm_register_graph_buffers` supplies after the capture. Eager calls are unchanged.
/// Turn it on for the capture on every rank, capture, register, then replay: a replay before
/// the registration skips the call on every rank and `ar_comm_synchronize` returns
/// `AR_INVALID_ARGUMENT` (the group stays usable). The captured inputs must stay allocated
/// while the graph may replay. Call it from the thread that drives this rank.
#[no_mangle]
pub extern "C" fn ar_comm_set_graph_registration(comm: ar_comm_t, on: c_int) -> ar_result_t {
    call::run(|| {
        let comm = handle::comm(comm)?;
        Ok(comm.comm().set_graph_registration(on != 0)?)
    })
}

/// Register the inputs of the calls captured with graph registration on since the last
/// registration; `*count` receives how many calls each rank captured. `comms` is either every
/// rank of an in-process group (`ar_comm_init_all`), in rank order, with `ncomms` its size,
/// or this rank of a group of processes (`ar_comm_init_rank`, `ar_comm_init_env`) with
/// `ncomms` 1: then it is collective, every rank calls it, and the inputs travel as IPC
/// handles over the group's rendezvous. Ranks that captured different calls get
/// `AR_RANK_MISMATCH` and those calls keep failing on replay. No graph of the group may be
/// running.
///
/// # Safety
/// `comms` points to `ncomms` readable `ar_comm_t`; `count` is writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_register_graph_buffers(
    comms: *const ar_comm_t,
    ncomms: c_int,
    count: *mut usize,
) -> ar_result_t {
    call::run(|| {
        if comms.is_null() || ncomms <= 0 {
            return Err(Failure::usage("comms is null or ncomms is not positive"));
        }
        // SAFETY: the caller's promise.
        let handles = unsafe { std::slice::from_raw_parts(comms, ncomms as usize) };
        let found: Vec<CommRef> = handles
            .iter()
            .map(|&h| handle::comm(h))
            .collect::<Result<_, _>>()?;
        let n = match found[0].group.bootstrap.as_ref() {
            Some(boot) if found.len() == 1 => {
                let mut boot = boot.lock().unwrap_or_else(|e| e.into_inner());
                found[0].comm().register_graph_buffers_rank(&mut *boot)?
            }
            Some(_) => {
                return Err(Error::InvalidArgument(
                    "a rank of a group of processes registers alone: pass its handle with \
                     ncomms 1"
                        .into(),
                )
                .into())
            }
            None => {
                let group = &found[0].group;
                let whole = found.len() == group.comms.len()
                    && found
                        .iter()
                        .enumerate()
                        .all(|(i, c)| c.index == i && std::sync::Arc::ptr_eq(&c.group, group));
                if !whole {
                    return Err(Error::InvalidArgument(
                        "comms must be every rank of one in-process group, in rank order".into(),
                    )
                    .into());
                }
                Communicator::register_graph_buffers(&group.comms)?
            }
        };
        // SAFETY: the caller's promise about `count`.
        unsafe { write_out(count, "count", n) }
    })
}
