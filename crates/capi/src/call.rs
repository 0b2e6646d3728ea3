//! How every entry point runs: a closure returning `Result<(), Failure>` inside
//! `catch_unwind`, so no panic unwinds into C (which would abort the host process), and
//! every failure leaves its message for `ar_last_error()` on the calling thread.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use allreduce::Error;

use crate::codes::ar_result_t;

/// A failed C call: its code and the message `ar_last_error()` returns.
#[derive(Debug)]
pub struct Failure {
    pub code: ar_result_t,
    pub message: String,
}

impl Failure {
    /// `AR_INVALID_USAGE`: the call reached no communicator.
    pub fn usage(message: impl Into<String>) -> Self {
        Failure {
            code: ar_result_t::AR_INVALID_USAGE,
            message: message.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure {
            code: ar_result_t::of(&error),
            message: error.to_string(),
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A NUL inside a message would cut it short in C; none is expected, but the message
    // must stay a valid C string whatever a backend put in it.
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; the code still reports.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
}

/// Run one entry point's body. Argument checks, facade calls and a panic anywhere in them
/// all end here as one code.
pub fn run(body: impl FnOnce() -> Result<(), Failure>) -> ar_result_t {
    // AssertUnwindSafe: after a panic the caller gets AR_INTERNAL_ERROR, documented as
    // "rebuild the group", so no state the panic may have left half-updated is relied on.
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ar_result_t::AR_SUCCESS,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.code
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".into());
            set_last_error(&format!("internal error (please report): {what}"));
            ar_result_t::AR_INTERNAL_ERROR
        }
    }
}

/// Write `value` through an out-pointer the caller gave.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
pub unsafe fn write_out<T>(out: *mut T, what: &str, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::usage(format!("{what} is null")));
    }
    // SAFETY: non-null, and the caller promises it is valid for writes.
    unsafe { out.write(value) };
    Ok(())
}

/// The message of the most recent failed call of this library on this thread (NCCL's
/// `ncclGetLastError`, per thread); "" if none has failed. Successful calls leave it as it
/// is. Never null. The string belongs to the library: it stays valid until the next call of
/// this library on the same thread, so copy it to keep it. Thread-safe: each thread has its
/// own.
#[no_mangle]
pub extern "C" fn ar_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;

    fn last() -> String {
        // SAFETY: ar_last_error returns a valid C string.
        unsafe { CStr::from_ptr(ar_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let code = run(|| panic!("boom {}", 7));
        assert_eq!(code, ar_result_t::AR_INTERNAL_ERROR);
        assert!(last().contains("boom 7"), "{}", last());
        let code = run(|| std::panic::panic_any(3u8));
        assert_eq!(code, ar_result_t::AR_INTERNAL_ERROR);
        assert!(last().contains("a panic with no message"), "{}", last());
    }

    #[test]
    fn failures_set_the_message_per_thread_and_successes_keep_it() {
        let code = run(|| Err(Error::InvalidConfig("bad\0world".into()).into()));
        assert_eq!(code, ar_result_t::AR_INVALID_CONFIG);
        assert_eq!(last(), "invalid group configuration: bad world");
        assert_eq!(run(|| Ok(())), ar_result_t::AR_SUCCESS);
        assert_eq!(last(), "invalid group configuration: bad world");
        // Another thread has its own message.
        let other = std::thread::spawn(|| {
            let empty = last();
            run(|| Err(Failure::usage("theirs")));
            (empty, last())
        })
        .join()
        .unwrap();
        assert_eq!(other, (String::new(), "theirs".to_string()));
        assert_eq!(last(), "invalid group configuration: bad world");
    }
}
