//! The one error type of the library. Every failure a caller can cause or meet is a variant
//! here; nothing in the library panics or exits on bad input or a missing driver.

use std::time::Duration;

use crate::{Codec, DType, Device, Strategy};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// After it: [`Aftermath::Intact`] (refused before anything ran).
    #[error("input has {input} elements but output has {output}")]
    LengthMismatch { input: usize, output: usize },

    /// After it: [`Aftermath::Intact`].
    #[error("input dtype {input} differs from output dtype {output}")]
    DTypeMismatch { input: DType, output: DType },

    /// After it: [`Aftermath::Intact`].
    #[error(
        "{bytes} bytes exceed this communicator's maximum of {max} bytes (GroupConfig::max_bytes)"
    )]
    TooLarge { bytes: usize, max: usize },

    /// After it: [`Aftermath::Intact`]; `Communicator::alignment` says the rule.
    #[error("buffer address {addr:#x} is not aligned to {align} bytes")]
    Misaligned { addr: usize, align: usize },

    /// After it: [`Aftermath::Intact`].
    #[error("buffer lives on {buffer} but this communicator runs on {comm}")]
    WrongDevice { buffer: Device, comm: Device },

    /// After it: [`Aftermath::Intact`].
    #[error("codec {codec} does not accept {dtype} input (codecs take f16 and bf16)")]
    UnsupportedCodec { codec: Codec, dtype: DType },

    /// After it: [`Aftermath::Intact`].
    #[error("strategy {strategy} is unavailable: {reason}")]
    StrategyUnavailable { strategy: Strategy, reason: String },

    /// The ranks entered the same call with different arguments. Every rank of the call gets
    /// this error and nothing was written to any output. After it: [`Aftermath::Intact`].
    #[error("ranks disagree on {what} in call {call}: {detail}")]
    RankMismatch {
        what: &'static str,
        call: u64,
        detail: String,
    },

    /// Another rank rejected its own arguments, so this rank's call was abandoned before any
    /// data moved. After it: [`Aftermath::Intact`].
    #[error("rank {rank} rejected its arguments in call {call}: {reason}")]
    PeerRejected {
        rank: usize,
        call: u64,
        reason: String,
    },

    /// A wait passed its deadline: a peer never arrived (or arrived too late). `waiting_for`
    /// names the phase and, where the backend can tell, the ranks that had not arrived
    /// ([`Error::timeout`]). After it: [`Aftermath::Rebuild`] (every later call of the group
    /// is `Aborted`).
    #[error(
        "rank {rank} timed out after {} in call {call} waiting for {waiting_for}; the group is \
         now aborted: every rank's later calls fail until the group is dropped and built again",
        readable(*.waited)
    )]
    Timeout {
        rank: usize,
        call: u64,
        waited: Duration,
        waiting_for: String,
    },

    /// The group is unusable after an earlier timeout; drop the communicators and build anew.
    /// After it: [`Aftermath::Rebuild`].
    #[error("communicator group aborted: {reason}")]
    Aborted { reason: String },

    /// A configuration was refused (a group's, a workspace's, a bootstrap's, a selection
    /// table's). After it: [`Aftermath::Intact`]: whatever was being built was not, and an
    /// existing communicator is untouched.
    #[error("invalid group configuration: {0}")]
    InvalidConfig(String),

    /// A call asked for more than its workspace was created for (the fused all-reduce's
    /// `max_tokens`). After it: [`Aftermath::Intact`].
    #[error("{requested} {what} exceed the workspace's maximum of {max}")]
    WorkspaceExceeded {
        what: &'static str,
        requested: usize,
        max: usize,
    },

    /// A call's arguments do not fit together (a missing or mis-sized buffer of the fused
    /// all-reduce, say); nothing was enqueued. After it: [`Aftermath::Intact`].
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A driver or library needed by the backend could not be loaded. After it:
    /// [`Aftermath::Intact`]: a communicator that met it at a call (a vendor strategy without
    /// the vendor library) still runs the strategies that need no such library.
    #[error("{library} is unavailable: {detail}")]
    LibraryUnavailable {
        library: &'static str,
        detail: String,
    },

    /// The backend or its device lacks an optional capability (thread-block clusters,
    /// programmatic dependent launch, memory export to other processes, the fused kernels, a
    /// multi-process vendor library). Nothing was enqueued and nothing was changed: a
    /// communicator that meets it is intact, and the caller may take the path that needs no
    /// such capability. Not a rejection: the same arguments fail again on this backend.
    /// After it: [`Aftermath::Intact`].
    #[error("unsupported: {what}")]
    Unsupported { what: String },

    /// The backend is not compiled into this build (see the cargo features). After it:
    /// [`Aftermath::Intact`] (only group construction returns it; nothing was built).
    #[error("backend {0} is not compiled in (enable its cargo feature)")]
    BackendNotBuilt(&'static str),

    /// An error returned by the device runtime or vendor library. After it:
    /// [`Aftermath::Rebuild`]: the device's state is unknown.
    #[error("{api} failed: {detail}")]
    Device { api: &'static str, detail: String },

    /// The multi-process rendezvous (a `Bootstrap`) failed: a peer was refused or lost, a
    /// message was malformed, or the network failed. Not a rejection: the group must be
    /// rebuilt. After it: [`Aftermath::Rebuild`].
    #[error("bootstrap failed: {detail}")]
    Bootstrap { detail: String },
}

/// What an error leaves behind: whether the communicator that returned it still works. Each
/// variant's documentation says which; [`Error::aftermath`] answers it in code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aftermath {
    /// Nothing ran (or nothing that matters): the communicator, and every other rank's, is
    /// intact, and the next valid call works and is exact.
    Intact,
    /// The group is unusable: every rank's communicator must be dropped and the group built
    /// anew. Later calls return `Aborted`.
    Rebuild,
}

/// A duration as people read it: "10.0 s", "250.0 ms", "40 us".
pub fn readable(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.1} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{} us", d.as_micros())
    }
}

/// "rank 2", "ranks 1, 3": who `ranks` are, for a message.
pub fn rank_list(ranks: &[usize]) -> String {
    let list = ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    match ranks.len() {
        1 => format!("rank {list}"),
        _ => format!("ranks {list}"),
    }
}

impl Error {
    /// A timeout of `rank` in `call` after `waited`, in phase `waiting_for` (what it waited
    /// for), with `missing` the ranks that had not arrived when it gave up (empty where the
    /// backend cannot tell).
    pub fn timeout(
        rank: usize,
        call: u64,
        waited: Duration,
        waiting_for: &str,
        missing: &[usize],
    ) -> Error {
        let waiting_for = if missing.is_empty() {
            waiting_for.to_string()
        } else {
            format!("{waiting_for} ({} never arrived)", rank_list(missing))
        };
        Error::Timeout {
            rank,
            call,
            waited,
            waiting_for,
        }
    }

    /// Whether the communicator survives this error (see [`Aftermath`]).
    pub fn aftermath(&self) -> Aftermath {
        match self {
            Error::Timeout { .. }
            | Error::Aborted { .. }
            | Error::Device { .. }
            | Error::Bootstrap { .. } => Aftermath::Rebuild,
            Error::LengthMismatch { .. }
            | Error::DTypeMismatch { .. }
            | Error::TooLarge { .. }
            | Error::Misaligned { .. }
            | Error::WrongDevice { .. }
            | Error::UnsupportedCodec { .. }
            | Error::StrategyUnavailable { .. }
            | Error::RankMismatch { .. }
            | Error::PeerRejected { .. }
            | Error::InvalidConfig(_)
            | Error::WorkspaceExceeded { .. }
            | Error::InvalidArgument(_)
            | Error::LibraryUnavailable { .. }
            | Error::Unsupported { .. }
            | Error::BackendNotBuilt(_) => Aftermath::Intact,
        }
    }

    /// The call was refused before any data moved, because of its arguments (this rank's or a
    /// peer's): the communicator is intact and the next valid call works.
    pub fn is_rejection(&self) -> bool {
        matches!(
            self,
            Error::LengthMismatch { .. }
                | Error::DTypeMismatch { .. }
                | Error::TooLarge { .. }
                | Error::Misaligned { .. }
                | Error::WrongDevice { .. }
                | Error::UnsupportedCodec { .. }
                | Error::StrategyUnavailable { .. }
                | Error::RankMismatch { .. }
                | Error::PeerRejected { .. }
                | Error::WorkspaceExceeded { .. }
                | Error::InvalidArgument(_)
        )
    }
}

impl Error {
    /// Every variant, once, for tests (here and in the C ABI's, which gives each its own code):
    /// the match in `aftermath` is exhaustive, so a new variant must be classified there, and this
    /// list must grow with it (its length is checked).
    #[doc(hidden)]
    pub fn one_of_each() -> Vec<Error> {
        let s = || String::from("x");
        vec![
            Error::LengthMismatch {
                input: 1,
                output: 2,
            },
            Error::DTypeMismatch {
                input: DType::F32,
                output: DType::F16,
            },
            Error::TooLarge { bytes: 2, max: 1 },
            Error::Misaligned { addr: 8, align: 16 },
            Error::WrongDevice {
                buffer: Device::Host,
                comm: Device::Cuda(0),
            },
            Error::UnsupportedCodec {
                codec: Codec::Int4,
                dtype: DType::F32,
            },
            Error::StrategyUnavailable {
                strategy: Strategy::Vendor,
                reason: s(),
            },
            Error::RankMismatch {
                what: "length",
                call: 1,
                detail: s(),
            },
            Error::PeerRejected {
                rank: 1,
                call: 1,
                reason: s(),
            },
            Error::Timeout {
                rank: 1,
                call: 1,
                waited: Duration::from_secs(1),
                waiting_for: s(),
            },
            Error::Aborted { reason: s() },
            Error::InvalidConfig(s()),
            Error::WorkspaceExceeded {
                what: "tokens",
                requested: 2,
                max: 1,
            },
            Error::InvalidArgument(s()),
            Error::LibraryUnavailable {
                library: "libnccl",
                detail: s(),
            },
            Error::Unsupported { what: s() },
            Error::BackendNotBuilt("cuda"),
            Error::Device {
                api: "cuLaunchKernel",
                detail: s(),
            },
            Error::Bootstrap { detail: s() },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_names_the_missing_ranks_and_says_the_group_must_be_rebuilt() {
        let e = Error::timeout(
            0,
            3,
            Duration::from_nanos(10_011_906_371),
            "all ranks to stage their input",
            &[2, 3],
        );
        let text = e.to_string();
        assert!(text.contains("after 10.0 s in call 3"), "{text}");
        assert!(text.contains("(ranks 2, 3 never arrived)"), "{text}");
        assert!(
            text.contains("aborted") && text.contains("built again"),
            "{text}"
        );
        let one = Error::timeout(1, 0, Duration::from_millis(250), "x", &[0]).to_string();
        assert!(
            one.contains("250.0 ms") && one.contains("(rank 0 never arrived)"),
            "{one}"
        );
        assert_eq!(readable(Duration::from_micros(40)), "40 us");
    }

    #[test]
    fn every_rejection_leaves_the_communicator_intact_and_only_failures_need_a_rebuild() {
        let all = Error::one_of_each();
        assert_eq!(all.len(), 19, "one_of_each must name every variant");
        for e in &all {
            if e.is_rejection() {
                assert_eq!(e.aftermath(), Aftermath::Intact, "{e:?}");
            }
            let rebuild = matches!(
                e,
                Error::Timeout { .. }
                    | Error::Aborted { .. }
                    | Error::Device { .. }
                    | Error::Bootstrap { .. }
            );
            assert_eq!(e.aftermath() == Aftermath::Rebuild, rebuild, "{e:?}");
        }
    }
}
