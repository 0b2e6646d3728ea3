//! Result codes: one per `allreduce::Error` variant, so a C caller can branch on what a Rust
//! caller would match on, plus the two failures only the C boundary has.

use std::ffi::{c_char, c_int, CStr};

use allreduce::Error;

/// What every `ar_` function returns. `AR_SUCCESS` is 0; every other code names one kind of
/// failure, and `ar_last_error()` on the same thread has its message. "Intact": the
/// communicator (and every peer's) still works and the next valid call is exact. "Rebuild":
/// destroy every rank's communicator and build the group anew; later calls return
/// `AR_ABORTED`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ar_result_t {
    AR_SUCCESS = 0,
    /// Input and output lengths differ (Intact).
    AR_LENGTH_MISMATCH = 1,
    /// Input and output dtypes differ (Intact).
    AR_DTYPE_MISMATCH = 2,
    /// The call is larger than the communicator's maximum (`ar_comm_max_bytes`) on a backend
    /// that does not split calls (Intact).
    AR_TOO_LARGE = 3,
    /// A buffer address is not aligned to `ar_comm_alignment` bytes (Intact).
    AR_MISALIGNED = 4,
    /// A buffer lives on another device than the communicator (Intact).
    AR_WRONG_DEVICE = 5,
    /// The precision's codec does not take this dtype: codecs take f16 and bf16 (Intact).
    AR_UNSUPPORTED_CODEC = 6,
    /// The requested strategy cannot run here; the message says why (Intact).
    AR_STRATEGY_UNAVAILABLE = 7,
    /// The ranks entered the same call with different arguments; no output was written
    /// (Intact).
    AR_RANK_MISMATCH = 8,
    /// Another rank refused its own arguments, so this rank's call was abandoned before any
    /// data moved (Intact).
    AR_PEER_REJECTED = 9,
    /// A peer did not arrive before the deadline (Rebuild).
    AR_TIMEOUT = 10,
    /// The group is unusable after an earlier failure (Rebuild).
    AR_ABORTED = 11,
    /// A group, workspace or bootstrap configuration was refused; nothing was built (Intact).
    AR_INVALID_CONFIG = 12,
    /// A fused call asked for more than its workspace was created for (Intact).
    AR_WORKSPACE_EXCEEDED = 13,
    /// The library refused an argument: an integer that names no value of its enum, a
    /// reduction other than `AR_SUM`, a null buffer for a non-empty call, a count whose byte
    /// size overflows, buffers that overlap without being the same (Intact; the peers' calls
    /// return `AR_PEER_REJECTED`).
    AR_INVALID_ARGUMENT = 14,
    /// A driver or vendor library could not be loaded (Intact).
    AR_LIBRARY_UNAVAILABLE = 15,
    /// The backend or device lacks an optional capability (Intact).
    AR_UNSUPPORTED = 16,
    /// The backend is not compiled into this library (Intact).
    AR_BACKEND_NOT_BUILT = 17,
    /// The device runtime or vendor library returned an error (Rebuild).
    AR_DEVICE_ERROR = 18,
    /// The multi-process rendezvous failed (Rebuild).
    AR_BOOTSTRAP_ERROR = 19,
    /// The C call itself is malformed and reached no communicator: a handle that is null,
    /// destroyed or never created, a null pointer where the function writes its result, an
    /// `ar_config_t` whose `size` is not this header's `sizeof(ar_config_t)`.
    AR_INVALID_USAGE = 20,
    /// A bug in the library (a caught panic) or an error this code does not know. Treat the
    /// group as needing a rebuild.
    AR_INTERNAL_ERROR = 21,
}

use ar_result_t::*;

/// Every code, in value order.
const ALL: [ar_result_t; 22] = [
    AR_SUCCESS,
    AR_LENGTH_MISMATCH,
    AR_DTYPE_MISMATCH,
    AR_TOO_LARGE,
    AR_MISALIGNED,
    AR_WRONG_DEVICE,
    AR_UNSUPPORTED_CODEC,
    AR_STRATEGY_UNAVAILABLE,
    AR_RANK_MISMATCH,
    AR_PEER_REJECTED,
    AR_TIMEOUT,
    AR_ABORTED,
    AR_INVALID_CONFIG,
    AR_WORKSPACE_EXCEEDED,
    AR_INVALID_ARGUMENT,
    AR_LIBRARY_UNAVAILABLE,
    AR_UNSUPPORTED,
    AR_BACKEND_NOT_BUILT,
    AR_DEVICE_ERROR,
    AR_BOOTSTRAP_ERROR,
    AR_INVALID_USAGE,
    AR_INTERNAL_ERROR,
];

impl ar_result_t {
    /// Every code, in value order.
    pub fn all() -> [ar_result_t; 22] {
        ALL
    }

    /// The code of a facade error. `Error` may grow variants; one this build does not know is
    /// reported as internal rather than as a wrong kind.
    pub fn of(error: &Error) -> ar_result_t {
        match error {
            Error::LengthMismatch { .. } => AR_LENGTH_MISMATCH,
            Error::DTypeMismatch { .. } => AR_DTYPE_MISMATCH,
            Error::TooLarge { .. } => AR_TOO_LARGE,
            Error::Misaligned { .. } => AR_MISALIGNED,
            Error::WrongDevice { .. } => AR_WRONG_DEVICE,
            Error::UnsupportedCodec { .. } => AR_UNSUPPORTED_CODEC,
            Error::StrategyUnavailable { .. } => AR_STRATEGY_UNAVAILABLE,
            Error::RankMismatch { .. } => AR_RANK_MISMATCH,
            Error::PeerRejected { .. } => AR_PEER_REJECTED,
            Error::Timeout { .. } => AR_TIMEOUT,
            Error::Aborted { .. } => AR_ABORTED,
            Error::InvalidConfig(_) => AR_INVALID_CONFIG,
            Error::WorkspaceExceeded { .. } => AR_WORKSPACE_EXCEEDED,
            Error::InvalidArgument(_) => AR_INVALID_ARGUMENT,
            Error::LibraryUnavailable { .. } => AR_LIBRARY_UNAVAILABLE,
            Error::Unsupported { .. } => AR_UNSUPPORTED,
            Error::BackendNotBuilt(_) => AR_BACKEND_NOT_BUILT,
            Error::Device { .. } => AR_DEVICE_ERROR,
            Error::Bootstrap { .. } => AR_BOOTSTRAP_ERROR,
            _ => AR_INTERNAL_ERROR,
        }
    }

    /// Whether the code is one of a call refused for its arguments, which `ar_reject` takes:
    /// the `Error` kinds that are rejections, less the two about the group (`AR_RANK_MISMATCH`,
    /// `AR_PEER_REJECTED`), which no rank reports about its own arguments.
    pub fn is_argument_refusal(self) -> bool {
        matches!(
            self,
            AR_LENGTH_MISMATCH
                | AR_DTYPE_MISMATCH
                | AR_TOO_LARGE
                | AR_MISALIGNED
                | AR_WRONG_DEVICE
                | AR_UNSUPPORTED_CODEC
                | AR_STRATEGY_UNAVAILABLE
                | AR_WORKSPACE_EXCEEDED
                | AR_INVALID_ARGUMENT
        )
    }

    /// The code whose value is `code`, if any.
    pub fn from_raw(code: c_int) -> Option<ar_result_t> {
        usize::try_from(code).ok().and_then(|i| ALL.get(i).copied())
    }

    /// A fixed description of the kind of failure (not of one failure: that is the last
    /// error's message).
    pub fn description(self) -> &'static CStr {
        match self {
            AR_SUCCESS => c"success",
            AR_LENGTH_MISMATCH => c"input and output lengths differ",
            AR_DTYPE_MISMATCH => c"input and output dtypes differ",
            AR_TOO_LARGE => c"call larger than the communicator's maximum",
            AR_MISALIGNED => c"buffer address not aligned",
            AR_WRONG_DEVICE => c"buffer on another device than the communicator",
            AR_UNSUPPORTED_CODEC => c"codec does not take this dtype",
            AR_STRATEGY_UNAVAILABLE => c"strategy unavailable",
            AR_RANK_MISMATCH => c"ranks disagree on the call",
            AR_PEER_REJECTED => c"another rank rejected its arguments",
            AR_TIMEOUT => c"timed out waiting for a peer",
            AR_ABORTED => c"communicator group aborted",
            AR_INVALID_CONFIG => c"invalid configuration",
            AR_WORKSPACE_EXCEEDED => c"call exceeds the workspace",
            AR_INVALID_ARGUMENT => c"invalid argument",
            AR_LIBRARY_UNAVAILABLE => c"driver or library unavailable",
            AR_UNSUPPORTED => c"unsupported on this backend or device",
            AR_BACKEND_NOT_BUILT => c"backend not compiled in",
            AR_DEVICE_ERROR => c"device runtime error",
            AR_BOOTSTRAP_ERROR => c"bootstrap failed",
            AR_INVALID_USAGE => c"invalid usage: bad handle or required pointer",
            AR_INTERNAL_ERROR => c"internal error",
        }
    }
}

/// A fixed, static description of a result code (NCCL's `ncclGetErrorString`); a value that
/// is no `ar_result_t` gives "unknown result code". Never null. Thread-safe.
#[no_mangle]
pub extern "C" fn ar_get_error_string(result: c_int) -> *const c_char {
    ar_result_t::from_raw(result)
        .map_or(c"unknown result code", ar_result_t::description)
        .as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_variant_has_its_own_code_in_declaration_order() {
        let codes: Vec<ar_result_t> = Error::one_of_each().iter().map(ar_result_t::of).collect();
        // The variants in declaration order take codes 1, 2, 3, ...: one to one, none
        // internal, none shared.
        let want: Vec<ar_result_t> = ALL[1..=codes.len()].to_vec();
        assert_eq!(codes, want);
        assert_eq!(ALL[codes.len() + 1], AR_INVALID_USAGE);
    }

    #[test]
    fn argument_refusals_are_the_rejections_less_the_group_ones() {
        for e in Error::one_of_each() {
            let code = ar_result_t::of(&e);
            let about_the_group = matches!(code, AR_RANK_MISMATCH | AR_PEER_REJECTED);
            assert_eq!(
                code.is_argument_refusal(),
                e.is_rejection() && !about_the_group,
                "{code:?}"
            );
        }
        assert!(!AR_INVALID_USAGE.is_argument_refusal());
        assert!(!AR_SUCCESS.is_argument_refusal());
    }

    #[test]
    fn codes_round_trip_and_have_distinct_descriptions() {
        for (i, &code) in ALL.iter().enumerate() {
            assert_eq!(code as usize, i);
            assert_eq!(ar_result_t::from_raw(i as c_int), Some(code));
            let s = unsafe { CStr::from_ptr(ar_get_error_string(i as c_int)) };
            assert_eq!(s, code.description());
            let dupes = ALL
                .iter()
                .filter(|c| c.description() == code.description())
                .count();
            assert_eq!(dupes, 1, "{code:?}");
        }
        for bad in [-1, 22, c_int::MAX] {
            assert_eq!(ar_result_t::from_raw(bad), None);
            let s = unsafe { CStr::from_ptr(ar_get_error_string(bad)) };
            assert_eq!(s, c"unknown result code");
        }
    }
}
