//! Registration: memory the caller has, read by the peers in place (vLLM's
//! `register_buffer`), and CUDA/HIP graph buffers registered after capture (vLLM's
//! `capture()` and `register_graph_buffers`).

use std::ffi::{c_int, c_void};

use allreduce::{Communicator, Error, RegisteredRange, RegistrationId};

use crate::call::{self, write_out, Failure};
use crate::codes::ar_result_t;
use crate::handle::{self, ar_comm_t, CommRef};

/// The ranks `comms` names: every rank of one in-process group in rank order, or one rank of
/// a group of processes (with the rendezvous it keeps). What registrations run on.
enum Ranks {
    Group(std::sync::Arc<handle::Group>),
    Process(CommRef),
}

/// # Safety
/// `comms` points to `ncomms` readable handles.
unsafe fn ranks(comms: *const ar_comm_t, ncomms: c_int) -> Result<Ranks, Failure> {
    if comms.is_null() || ncomms <= 0 {
        return Err(Failure::usage("comms is null or ncomms is not positive"));
    }
    // SAFETY: the caller's promise.
    let handles = unsafe { std::slice::from_raw_parts(comms, ncomms as usize) };
    let found: Vec<CommRef> = handles
        .iter()
        .map(|&h| handle::comm(h))
        .collect::<Result<_, _>>()?;
    if found[0].group.bootstrap.is_some() {
        if found.len() != 1 {
            return Err(Error::InvalidArgument(
                "a rank of a group of processes registers alone: pass its handle with ncomms 1"
                    .into(),
            )
            .into());
        }
        return Ok(Ranks::Process(found.into_iter().next().expect("one")));
    }
    let group = found[0].group.clone();
    let whole = found.len() == group.comms.len()
        && found
            .iter()
            .enumerate()
            .all(|(i, c)| c.index == i && std::sync::Arc::ptr_eq(&c.group, &group));
    if !whole {
        return Err(Error::InvalidArgument(
            "comms must be every rank of one in-process group, in rank order".into(),
        )
        .into());
    }
    Ok(Ranks::Group(group))
}

/// Register memory the caller has, so that out-of-place exact one-shot and two-shot calls
/// whose input lies in it read every rank's input in place (no staging copy): `ptrs[i]` is
/// the `i`-th rank's memory of `bytes` bytes (16-byte aligned; one length for all), `*id`
/// receives the registration. `comms` as in `ar_comm_register_graph_buffers`: every rank of an
/// in-process group with `ptrs` holding one pointer per rank, or this rank of a group of
/// processes with one pointer (memory from cudaMalloc/hipMalloc, such as a PyTorch
/// caching-allocator tensor; collective: every rank calls it, in the same order as its other
/// registrations, and the memory travels as an IPC handle). Every rank must then call with its
/// input at the same offset of the registration. The memory must stay allocated until
/// `ar_comm_deregister` and the calls that read it have completed.
///
/// # Safety
/// `comms` points to `ncomms` readable handles, `ptrs` to `ncomms` readable pointers; `id` is
/// writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_register(
    comms: *const ar_comm_t,
    ncomms: c_int,
    ptrs: *const *mut c_void,
    bytes: usize,
    id: *mut u64,
) -> ar_result_t {
    call::run(|| {
        // SAFETY: the caller's promise.
        let ranks = unsafe { ranks(comms, ncomms) }?;
        if ptrs.is_null() {
            return Err(Failure::usage("ptrs is null"));
        }
        // SAFETY: the caller's promise: one pointer per handle.
        let ptrs = unsafe { std::slice::from_raw_parts(ptrs, ncomms as usize) };
        let range = |p: *mut c_void| RegisteredRange {
            addr: p as usize,
            bytes,
        };
        let made = match ranks {
            Ranks::Group(group) => {
                let ranges: Vec<RegisteredRange> = ptrs.iter().map(|&p| range(p)).collect();
                Communicator::register_group(&group.comms, &ranges)?
            }
            Ranks::Process(rank) => {
                let boot = rank.group.bootstrap.as_ref().expect("a process rank's");
                let mut boot = boot.lock().unwrap_or_else(|e| e.into_inner());
                rank.comm().register(range(ptrs[0]), &mut *boot)?
            }
        };
        // SAFETY: the caller's promise about `id`.
        unsafe { write_out(id, "id", made.0) }
    })
}

/// Forget a registration made by `ar_comm_register` (`comms` as there; a rank of a group of
/// processes forgets its own part, which every rank must do before its next call on that
/// memory). Calls that read it must have completed; later calls on the memory are staged.
///
/// # Safety
/// `comms` points to `ncomms` readable handles.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_deregister(
    comms: *const ar_comm_t,
    ncomms: c_int,
    id: u64,
) -> ar_result_t {
    call::run(|| {
        // SAFETY: the caller's promise.
        match unsafe { ranks(comms, ncomms) }? {
            Ranks::Group(group) => {
                Communicator::deregister_group(&group.comms, RegistrationId(id))?
            }
            Ranks::Process(rank) => rank.comm().deregister(RegistrationId(id))?,
        }
        Ok(())
    })
}

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
        // SAFETY: the caller's promise.
        let n = match unsafe { ranks(comms, ncomms) }? {
            Ranks::Group(group) => Communicator::register_graph_buffers(&group.comms)?,
            Ranks::Process(rank) => {
                let boot = rank.group.bootstrap.as_ref().expect("a process rank's");
                let mut boot = boot.lock().unwrap_or_else(|e| e.into_inner());
                rank.comm().register_graph_buffers_rank(&mut *boot)?
            }
        };
        // SAFETY: the caller's promise about `count`.
        unsafe { write_out(count, "count", n) }
    })
}
