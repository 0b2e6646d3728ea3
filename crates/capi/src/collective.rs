//! The all-reduce call, and the refusal of one a binding makes for its own reasons.

use std::ffi::{c_char, c_int, c_void, CStr};

use allreduce::{AllReduceOptions, BufMut, BufRef, Communicator, DType, Error, Stream};

use crate::args;
use crate::call::{self, Failure};
use crate::codes::ar_result_t;
use crate::handle::{self, ar_comm_t};

/// Sum `count` elements of `dtype` over every rank of the group (NCCL's `ncclAllReduce`,
/// plus a precision and a strategy). `sendbuff == recvbuff` runs in place; other overlapping
/// buffers are `AR_INVALID_ARGUMENT`. Buffers are host memory on the host backend and device
/// memory of this rank's GPU otherwise, aligned to `ar_comm_alignment` (16 bytes). `dtype`
/// is an `ar_dtype_t`, `op` must be `AR_SUM`, `precision` an `ar_precision_t`, `strategy` an
/// `ar_strategy_t`. `stream` is the `cudaStream_t` / `hipStream_t` the call is enqueued on
/// (NULL: the legacy default stream); the host backend takes NULL and runs the call before
/// returning. Every rank must make the matching call with the same count, dtype,
/// precision and strategy; ranks that do not all get `AR_RANK_MISMATCH` and nothing is
/// written.
///
/// Arguments this rank refuses (a code that names nothing, a null buffer, a misaligned one,
/// a call over `ar_comm_max_bytes` on the host) are reported to the peers, whose matching
/// call returns `AR_PEER_REJECTED`; the group stays usable. An invalid `comm` handle reaches
/// no peer: their calls wait until the deadline (`AR_TIMEOUT`).
///
/// Thread safety: call it from one thread at a time per communicator (each rank from its
/// own thread, as NCCL's ranks of one process need their own threads for host-blocking
/// backends); different communicators may be called concurrently.
///
/// # Safety
/// When `count` > 0: `sendbuff` holds `count` readable elements and `recvbuff` `count`
/// writable elements of `dtype` on this rank's device, and they stay valid until the call's
/// work on `stream` has completed (on the host, until it returns). NULL is refused.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // NCCL's shape, plus precision and strategy
pub unsafe extern "C" fn ar_all_reduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    precision: c_int,
    strategy: c_int,
    comm: ar_comm_t,
    stream: *mut c_void,
) -> ar_result_t {
    call::run(|| {
        let found = handle::comm(comm)?;
        let comm = found.comm();
        let stream = Stream::from_raw(stream);
        let checked = (|| {
            let dtype = args::dtype(dtype)?;
            args::op(op)?;
            let options = AllReduceOptions::default()
                .precision(args::precision(precision)?)
                .strategy(args::strategy(strategy)?)
                .stream(stream);
            args::byte_len(count, dtype)?;
            if count > 0 && (sendbuff.is_null() || recvbuff.is_null()) {
                let which = if sendbuff.is_null() {
                    "sendbuff"
                } else {
                    "recvbuff"
                };
                return Err(Error::InvalidArgument(format!(
                    "{which} is null for a call of {count} elements"
                )));
            }
            Ok((dtype, options))
        })();
        let (dtype, options) = checked.inspect_err(|error| {
            // The facade never saw this call, so tell the peers as it would have (through the
            // push protocol where the call named the push one-shot).
            match args::strategy(strategy) {
                Ok(s) => comm.reject_call(error, stream, s),
                Err(_) => comm.reject(error, stream),
            }
        })?;
        // SAFETY: the caller's promise: `count` elements of `dtype` on this rank's device,
        // valid until the call's work has completed. The facade checks alignment, size and
        // overlap before anything touches them.
        unsafe { enqueue(comm, sendbuff, recvbuff, count, dtype, &options) }
    })
}

/// Refuse this rank's part of the group's next `ar_all_reduce` for a reason the caller found
/// itself, before it could make the call: a language binding's own checks (an object that is
/// no array, a strided view, an option name it does not know). The peers' matching call
/// returns `AR_PEER_REJECTED` at once, its message carrying `message`, as it does for the
/// arguments `ar_all_reduce` refuses itself; the group stays usable. Call it where this rank
/// would have called `ar_all_reduce`, on that call's `stream`. On the GPU backends the peers
/// learn that the call was refused, but not the message: their wait runs on the device.
///
/// `code` says what kind of refusal it is and must be one of the codes of a refused argument:
/// `AR_LENGTH_MISMATCH`, `AR_DTYPE_MISMATCH`, `AR_TOO_LARGE`, `AR_MISALIGNED`,
/// `AR_WRONG_DEVICE`, `AR_UNSUPPORTED_CODEC`, `AR_STRATEGY_UNAVAILABLE`,
/// `AR_WORKSPACE_EXCEEDED` or `AR_INVALID_ARGUMENT`. `message` is NULL (the code's
/// description is sent) or a NUL-terminated string (UTF-8; other bytes are replaced).
/// Returns `AR_SUCCESS` once the refusal is delivered (host) or enqueued (GPU); another
/// `code`, or an invalid `comm`, is `AR_INVALID_USAGE` and reaches no peer.
///
/// Thread safety: as `ar_all_reduce`, whose place in the sequence of calls it takes.
///
/// # Safety
/// `message` is NULL or points to a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ar_reject(
    comm: ar_comm_t,
    code: c_int,
    message: *const c_char,
    stream: *mut c_void,
) -> ar_result_t {
    call::run(|| {
        let found = handle::comm(comm)?;
        let kind = ar_result_t::from_raw(code)
            .filter(|c| c.is_argument_refusal())
            .ok_or_else(|| {
                Failure::usage(format!(
                    "code {code} is not the code of a refused argument (AR_LENGTH_MISMATCH to \
                     AR_STRATEGY_UNAVAILABLE, AR_WORKSPACE_EXCEEDED or AR_INVALID_ARGUMENT)"
                ))
            })?;
        let text = if message.is_null() {
            None
        } else {
            // SAFETY: the caller's promise: a NUL-terminated string.
            Some(unsafe { CStr::from_ptr(message) }.to_string_lossy())
        };
        let reason = refusal(kind, text.as_deref());
        found.comm().reject(&reason, Stream::from_raw(stream));
        Ok(())
    })
}

/// The error the peers are told of for `ar_reject`: the caller's message, named by its kind
/// unless that is the generic `AR_INVALID_ARGUMENT` (whose text already says so).
fn refusal(kind: ar_result_t, message: Option<&str>) -> Error {
    let description = kind.description().to_string_lossy();
    Error::InvalidArgument(match message.filter(|m| !m.trim().is_empty()) {
        None => description.into_owned(),
        Some(m) if kind == ar_result_t::AR_INVALID_ARGUMENT => m.to_string(),
        Some(m) => format!("{description}: {m}"),
    })
}

/// # Safety
/// As `ar_all_reduce`'s buffers.
unsafe fn enqueue(
    comm: &Communicator,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    dtype: DType,
    options: &AllReduceOptions,
) -> Result<(), Failure> {
    // Views on the communicator's own device: a C pointer carries no device, and the
    // contract is that it is this rank's.
    let device = comm.device();
    // SAFETY: the caller's promise.
    let output = unsafe { BufMut::from_raw(recvbuff as usize, count, dtype, device) };
    if std::ptr::eq(sendbuff, recvbuff) {
        comm.all_reduce_in_place(output, options)?;
    } else {
        // SAFETY: the caller's promise.
        let input = unsafe { BufRef::from_raw(sendbuff as usize, count, dtype, device) };
        comm.all_reduce(input, output, options)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_carries_the_callers_message_and_names_its_kind() {
        use ar_result_t::*;
        let text = |kind, m| refusal(kind, m).to_string();
        assert_eq!(
            text(AR_INVALID_ARGUMENT, Some("x is a list")),
            "invalid argument: x is a list"
        );
        assert_eq!(
            text(AR_DTYPE_MISMATCH, Some("x is float32, out is float16")),
            "invalid argument: input and output dtypes differ: x is float32, out is float16"
        );
        assert_eq!(
            text(AR_MISALIGNED, None),
            "invalid argument: buffer address not aligned"
        );
        assert_eq!(text(AR_MISALIGNED, Some(" ")), text(AR_MISALIGNED, None));
    }
}
