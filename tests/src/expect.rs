//! Tests known to fail on a backend, each with its reason, in the manner of wgpu's
//! `FailureCase`: a listed failure is reported but does not fail the run, and a listed test
//! that passes does fail it, so the list cannot outlive the bug it records.

/// A test (by name, as the suite names it) expected to fail on one backend, and why.
#[derive(Clone, Copy, Debug)]
pub struct FailureCase {
    /// `BackendKind::name()`: "host", "cuda", "rocm".
    pub backend: &'static str,
    pub test: &'static str,
    pub reason: &'static str,
}

/// Every expected failure. Empty: no test of the suite is known to fail on any backend.
pub const EXPECTED_FAILURES: &[FailureCase] = &[];

/// How one test's outcome counts.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail(String),
    /// Failed as listed: the listed reason, and the failure.
    ExpectedFailure {
        reason: &'static str,
        error: String,
    },
    /// Passed though listed as failing: the list is stale.
    UnexpectedPass {
        reason: &'static str,
    },
}

impl Verdict {
    /// Whether the run fails because of this outcome.
    pub fn fails_run(&self) -> bool {
        matches!(self, Verdict::Fail(_) | Verdict::UnexpectedPass { .. })
    }
}

/// The verdict on `test`'s `outcome` on `backend`, against `list` ([`EXPECTED_FAILURES`]).
pub fn judge(
    list: &[FailureCase],
    backend: &str,
    test: &str,
    outcome: Result<(), String>,
) -> Verdict {
    let listed = list.iter().find(|c| c.backend == backend && c.test == test);
    match (outcome, listed) {
        (Ok(()), None) => Verdict::Pass,
        (Err(e), None) => Verdict::Fail(e),
        (Err(error), Some(c)) => Verdict::ExpectedFailure {
            reason: c.reason,
            error,
        },
        (Ok(()), Some(c)) => Verdict::UnexpectedPass { reason: c.reason },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &[FailureCase] = &[FailureCase {
        backend: "rocm",
        test: "t",
        reason: "r",
    }];

    #[test]
    fn a_listed_pass_fails_the_run_and_a_listed_failure_does_not() {
        assert_eq!(
            judge(LIST, "rocm", "t", Ok(())),
            Verdict::UnexpectedPass { reason: "r" }
        );
        assert!(judge(LIST, "rocm", "t", Ok(())).fails_run());
        let v = judge(LIST, "rocm", "t", Err("e".into()));
        assert!(
            matches!(v, Verdict::ExpectedFailure { reason: "r", .. }),
            "{v:?}"
        );
        assert!(!v.fails_run());
        // Other backends and tests are judged plainly.
        assert_eq!(judge(LIST, "cuda", "t", Ok(())), Verdict::Pass);
        assert!(judge(LIST, "cuda", "t", Err("e".into())).fails_run());
        assert!(judge(LIST, "rocm", "u", Err("e".into())).fails_run());
    }
}
