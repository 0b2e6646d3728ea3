//! Building, querying and destroying communicators.

use std::ffi::{c_int, c_void};

use allreduce::{Bootstrap, Communicator, Device, Error, GroupConfig};
use allreduce_bootstrap::TcpBootstrap;

use crate::args::{self, ar_config_t};
use crate::call::{self, write_out, Failure};
use crate::codes::ar_result_t;
use crate::handle::{self, ar_comm_t, Group};
use crate::unique_id::{ar_unique_id_t, Rendezvous};

fn to_c_int(what: &str, value: usize) -> Result<c_int, Failure> {
    c_int::try_from(value).map_err(|_| {
        Failure::from(Error::InvalidArgument(format!(
            "{what} {value} exceeds int"
        )))
    })
}

/// Write the handle of a group of one rank built by `new_rank`.
///
/// # Safety
/// `comm` is non-null and writable.
unsafe fn publish_rank(
    comm: *mut ar_comm_t,
    built: Communicator,
    boot: TcpBootstrap,
) -> Result<(), Failure> {
    let handles = handle::insert_group(Group {
        comms: vec![built],
        bootstrap: Some(std::sync::Mutex::new(boot)),
    });
    // SAFETY: the caller's promise.
    unsafe { write_out(comm, "comm", handles[0]) }
}

/// Build every rank of a group in this process (NCCL's `ncclCommInitAll`): `comms[r]`
/// receives rank r's handle, for r in 0..nranks. `devlist[r]` is rank r's device ordinal;
/// NULL means devices 0..nranks-1, as in NCCL, and a device may repeat (several ranks on one
/// GPU). The host backend ignores devices. `config` may be NULL (every default). Each rank
/// is then driven from its own thread: a call blocks (host) or its kernels wait (GPU) until
/// every rank has made the matching call. Nothing is written to `comms` on failure.
///
/// A backend not compiled into this library returns `AR_BACKEND_NOT_BUILT`; one whose driver
/// is missing returns `AR_LIBRARY_UNAVAILABLE`.
///
/// Thread-safe (it builds a new group; concurrent calls build independent groups).
///
/// # Safety
/// `comms` points to `nranks` writable `ar_comm_t`; `devlist` is NULL or points to `nranks`
/// readable `int`; `config` is NULL or points to an `ar_config_t`.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_init_all(
    comms: *mut ar_comm_t,
    backend: c_int,
    nranks: c_int,
    devlist: *const c_int,
    config: *const ar_config_t,
) -> ar_result_t {
    call::run(|| {
        if comms.is_null() {
            return Err(Failure::usage("comms is null"));
        }
        let kind = args::backend(backend)?;
        let world = args::index("nranks", nranks)?;
        // SAFETY: the caller's promise about `config`.
        let mut group = unsafe { args::group_config(world, config) }?;
        // Checked before `devlist` is read, so a wild `nranks` reads nothing.
        group.validate()?;
        let devices: Vec<u32> = if devlist.is_null() {
            (0..world as u32).collect()
        } else {
            // SAFETY: the caller promises `nranks` readable ints.
            let list = unsafe { std::slice::from_raw_parts(devlist, world) };
            list.iter()
                .map(|&d| Ok(args::index("device", d)? as u32))
                .collect::<Result<_, Failure>>()?
        };
        group = group.devices(devices);
        let built = Communicator::new_group(kind, group)?;
        let handles = handle::insert_group(Group {
            comms: built,
            bootstrap: None,
        });
        for (r, h) in handles.into_iter().enumerate() {
            // SAFETY: `comms` holds `nranks` writable handles.
            unsafe { comms.add(r).write(h) };
        }
        Ok(())
    })
}

/// Build this process's rank of a group with one process per rank (NCCL's
/// `ncclCommInitRank`): every process of the group calls it at about the same time with the
/// same `nranks` and `id` (from `ar_get_unique_id` on one of them) and its own `rank`, and
/// it returns once all have joined (or fails at the rendezvous deadline,
/// `ALLREDUCE_BOOTSTRAP_TIMEOUT_S` seconds, 60 by default). A rank that rank 0 refuses
/// (another `nranks` or id, a `rank` given twice) fails at once with `AR_BOOTSTRAP_ERROR` and
/// the reason, and so do rank 0 and every rank that has joined: the group cannot form.
/// `device` is this process's GPU ordinal. GPU backends only: the host backend's ranks are
/// threads of one process (`ar_comm_init_all`), so it returns `AR_INVALID_CONFIG` once the
/// group met.
///
/// Thread-safe; blocks for the rendezvous.
///
/// # Safety
/// `comm` points to one writable `ar_comm_t`; `config` is NULL or points to an
/// `ar_config_t`.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_init_rank(
    comm: *mut ar_comm_t,
    backend: c_int,
    nranks: c_int,
    id: ar_unique_id_t,
    rank: c_int,
    device: c_int,
    config: *const ar_config_t,
) -> ar_result_t {
    call::run(|| {
        if comm.is_null() {
            return Err(Failure::usage("comm is null"));
        }
        let kind = args::backend(backend)?;
        let world = args::index("nranks", nranks)?;
        let rank = args::index("rank", rank)?;
        let device = args::index("device", device)? as u32;
        // SAFETY: the caller's promise about `config`.
        let group = unsafe { args::group_config(world, config) }?.devices(vec![device]);
        group.validate_for_rank()?;
        let mut boot = Rendezvous::decode(&id)?.join(rank, world)?;
        let built = Communicator::new_rank(kind, group, &mut boot)?;
        // SAFETY: checked non-null; the caller promises it is writable.
        unsafe { publish_rank(comm, built, boot) }
    })
}

/// Build this process's rank from a torchrun-style environment: `RANK`, `WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT` and the group's `ALLREDUCE_BOOTSTRAP_SECRET` (64 hex digits,
/// the same in every process), and optionally `ALLREDUCE_BOOTSTRAP_TIMEOUT_S` (the
/// rendezvous deadline, 60 s by default), `ALLREDUCE_BOOTSTRAP_PORT` (instead of
/// `MASTER_PORT`) and `ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE=1` (on every rank, for a group across
/// hosts). `device` < 0 takes `LOCAL_RANK` (0 if unset). Otherwise as `ar_comm_init_rank`
/// (launch mistakes rank 0 refuses, such as two processes with `RANK=0`, are
/// `AR_BOOTSTRAP_ERROR` with the reason at once); a missing or malformed variable is
/// `AR_INVALID_CONFIG` naming it.
///
/// Thread-safe; blocks for the rendezvous.
///
/// # Safety
/// `comm` points to one writable `ar_comm_t`; `config` is NULL or points to an
/// `ar_config_t`.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_init_env(
    comm: *mut ar_comm_t,
    backend: c_int,
    device: c_int,
    config: *const ar_config_t,
) -> ar_result_t {
    call::run(|| {
        if comm.is_null() {
            return Err(Failure::usage("comm is null"));
        }
        let kind = args::backend(backend)?;
        // Read before the rendezvous, so a bad config fails without waiting for the group.
        // SAFETY: the caller's promise about `config`.
        let template = unsafe { args::group_config(1, config) }?;
        let mut boot = TcpBootstrap::from_env()?;
        let device = match device {
            d if d < 0 => boot.local_rank().unwrap_or(0),
            d => d as usize,
        };
        let device = u32::try_from(device).map_err(|_| {
            Failure::from(Error::InvalidConfig(format!(
                "LOCAL_RANK {device} is too large"
            )))
        })?;
        let group = GroupConfig {
            world_size: boot.world_size(),
            ..template
        }
        .devices(vec![device]);
        let built = Communicator::new_rank(kind, group, &mut boot)?;
        // SAFETY: checked non-null; the caller promises it is writable.
        unsafe { publish_rank(comm, built, boot) }
    })
}

/// Release this rank (NCCL's `ncclCommDestroy`). The handle is invalid afterwards (later use
/// is `AR_INVALID_USAGE`). A call running on another thread with this handle completes
/// first; the ranks of an in-process group release their shared resources when the last of
/// them is destroyed. On a GPU, synchronize the streams of this rank's calls first.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn ar_comm_destroy(comm: ar_comm_t) -> ar_result_t {
    call::run(|| handle::remove_comm(comm))
}

/// Abort the group and release this rank (NCCL's `ncclCommAbort`). Callable from any thread,
/// also while another thread's call with any rank of the group waits for a peer that will
/// never come: every call in flight leaves its wait now (instead of at the deadline) with
/// `AR_ABORTED`, as does every later call of every rank. Then this handle is destroyed as by
/// `ar_comm_destroy`, even when the abort itself failed (its error is returned). Destroy the
/// other ranks and build a new group. In a group of one process per rank, the other processes'
/// calls learn it from the device (GPU backends); NCCL calls in flight are not interrupted.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn ar_comm_abort(comm: ar_comm_t) -> ar_result_t {
    call::run(|| {
        let found = handle::comm(comm)?;
        let aborted = found.comm().abort();
        handle::remove_comm(comm)?;
        aborted.map_err(Failure::from)
    })
}

/// Wait for this rank's work on `stream` (a `cudaStream_t` / `hipStream_t`; NULL on the
/// host) and report any error the device recorded since the last check (a peer past the
/// deadline, an aborted group), as NCCL's `ncclCommGetAsyncError` after a stream
/// synchronisation. Call it from the thread that drives this rank.
///
/// # Safety
/// `stream` is NULL or a live stream of this communicator's device.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_synchronize(
    comm: ar_comm_t,
    stream: *mut std::ffi::c_void,
) -> ar_result_t {
    call::run(|| {
        let comm = handle::comm(comm)?;
        Ok(comm
            .comm()
            .synchronize(allreduce::Stream::from_raw(stream))?)
    })
}

/// Look `comm` up, compute a value from it and write it to `out`.
///
/// # Safety
/// `out` is null (refused) or writable.
unsafe fn query<T>(
    comm: ar_comm_t,
    out: *mut T,
    what: &str,
    value: impl FnOnce(&Communicator) -> Result<T, Failure>,
) -> ar_result_t {
    call::run(|| {
        let found = handle::comm(comm)?;
        let v = value(found.comm())?;
        // SAFETY: the caller's promise about `out`.
        unsafe { write_out(out, what, v) }
    })
}

/// The number of ranks of the group (NCCL's `ncclCommCount`). Thread-safe.
///
/// # Safety
/// `count` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_count(comm: ar_comm_t, count: *mut c_int) -> ar_result_t {
    // SAFETY: the caller's promise about `count`.
    unsafe {
        query(comm, count, "count", |c| {
            to_c_int("world size", c.world_size())
        })
    }
}

/// This communicator's rank (NCCL's `ncclCommUserRank`). Thread-safe.
///
/// # Safety
/// `rank` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_user_rank(comm: ar_comm_t, rank: *mut c_int) -> ar_result_t {
    // SAFETY: the caller's promise about `rank`.
    unsafe { query(comm, rank, "rank", |c| to_c_int("rank", c.rank())) }
}

/// The device ordinal this rank runs on (NCCL's `ncclCommCuDevice`); -1 on the host
/// backend. Thread-safe.
///
/// # Safety
/// `device` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_device(comm: ar_comm_t, device: *mut c_int) -> ar_result_t {
    // SAFETY: the caller's promise about `device`.
    unsafe {
        query(comm, device, "device", |c| match c.device() {
            Device::Host => Ok(-1),
            Device::Cuda(i) | Device::Rocm(i) => to_c_int("device", i as usize),
        })
    }
}

/// The backend this communicator runs on (an `ar_backend_t` value). Thread-safe.
///
/// # Safety
/// `backend` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_backend(comm: ar_comm_t, backend: *mut c_int) -> ar_result_t {
    // SAFETY: the caller's promise about `backend`.
    unsafe {
        query(comm, backend, "backend", |c| {
            Ok(args::backend_code(c.backend()))
        })
    }
}

/// The alignment in bytes every buffer address of this communicator's calls must have (16
/// on every backend); other addresses are `AR_MISALIGNED`. Thread-safe.
///
/// # Safety
/// `bytes` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_alignment(comm: ar_comm_t, bytes: *mut usize) -> ar_result_t {
    // SAFETY: the caller's promise about `bytes`.
    unsafe { query(comm, bytes, "bytes", |c| Ok(c.alignment())) }
}

/// The largest call in bytes this communicator runs in one piece (its workspace). Thread-safe.
///
/// # Safety
/// `bytes` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_max_bytes(comm: ar_comm_t, bytes: *mut usize) -> ar_result_t {
    // SAFETY: the caller's promise about `bytes`.
    unsafe { query(comm, bytes, "bytes", |c| Ok(c.max_bytes())) }
}

/// This rank's symmetric window of the vendor library (`AR_STRATEGY_VENDOR_SYMMETRIC`,
/// NCCL 2.27 or later): its device address and size. Buffers in it, at the same offset on
/// every rank, are reduced with no copy; others are copied in and out. Writes NULL and 0
/// where the group has no window (no NCCL/RCCL, an NCCL older than 2.27, virtual ranks, the
/// host backend). The window lives as long as the communicator. Thread-safe.
///
/// # Safety
/// `addr` and `bytes` are NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_vendor_window(
    comm: ar_comm_t,
    addr: *mut *mut c_void,
    bytes: *mut usize,
) -> ar_result_t {
    call::run(|| {
        let found = handle::comm(comm)?;
        if addr.is_null() || bytes.is_null() {
            return Err(Failure::usage("addr and bytes must not be NULL"));
        }
        let (a, b) = found.comm().vendor_window().unwrap_or((0, 0));
        // SAFETY: the caller's promise about `addr` and `bytes`.
        unsafe {
            write_out(addr, "addr", a as usize as *mut c_void)?;
            write_out(bytes, "bytes", b)
        }
    })
}

/// 1 if calls larger than `ar_comm_max_bytes` run in pieces (GPU backends), 0 if they are
/// refused with `AR_TOO_LARGE` (the host backend). Thread-safe.
///
/// # Safety
/// `splits` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_splits_large_calls(
    comm: ar_comm_t,
    splits: *mut c_int,
) -> ar_result_t {
    // SAFETY: the caller's promise about `splits`.
    unsafe {
        query(comm, splits, "splits", |c| {
            Ok(c_int::from(c.splits_large_calls()))
        })
    }
}

/// What `AR_STRATEGY_AUTO` would run for a call of `count` elements of `dtype` at
/// `precision` (an `ar_strategy_t` value in `*strategy`): an engine can keep its own path
/// for shapes where it would rather not call this library. Thread-safe.
///
/// # Safety
/// `strategy` is NULL (refused) or writable.
#[no_mangle]
pub unsafe extern "C" fn ar_comm_select(
    comm: ar_comm_t,
    count: usize,
    dtype: c_int,
    precision: c_int,
    strategy: *mut c_int,
) -> ar_result_t {
    call::run(|| {
        let found = handle::comm(comm)?;
        let dtype = args::dtype(dtype)?;
        let precision = args::precision(precision)?;
        args::byte_len(count, dtype)?;
        let chosen = found.comm().select(count, dtype, precision);
        // SAFETY: the caller's promise about `strategy`.
        unsafe { write_out(strategy, "strategy", args::strategy_code(chosen)) }
    })
}
