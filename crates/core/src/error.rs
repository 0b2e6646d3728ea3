//! The one error type of the library. Every failure a caller can cause or meet is a variant
//! here; nothing in the library panics or exits on bad input or a missing driver.

use std::time::Duration;

use crate::{Codec, DType, Device, Strategy};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("input has {input} elements but output has {output}")]
    LengthMismatch { input: usize, output: usize },

    #[error("input dtype {input} differs from output dtype {output}")]
    DTypeMismatch { input: DType, output: DType },

    #[error(
        "{bytes} bytes exceed this communicator's maximum of {max} bytes (GroupConfig::max_bytes)"
    )]
    TooLarge { bytes: usize, max: usize },

    #[error("buffer address {addr:#x} is not aligned to {align} bytes")]
    Misaligned { addr: usize, align: usize },

    #[error("buffer lives on {buffer} but this communicator runs on {comm}")]
    WrongDevice { buffer: Device, comm: Device },

    #[error("codec {codec} does not accept {dtype} input (codecs take f16 and bf16)")]
    UnsupportedCodec { codec: Codec, dtype: DType },

    #[error("strategy {strategy} is unavailable: {reason}")]
    StrategyUnavailable { strategy: Strategy, reason: String },

    /// The ranks entered the same call with different arguments. Every rank of the call gets
    /// this error and nothing was written to any output.
    #[error("ranks disagree on {what} in call {call}: {detail}")]
    RankMismatch {
        what: &'static str,
        call: u64,
        detail: String,
    },

    /// Another rank rejected its own arguments, so this rank's call was abandoned before any
    /// data moved.
    #[error("rank {rank} rejected its arguments in call {call}: {reason}")]
    PeerRejected {
        rank: usize,
        call: u64,
        reason: String,
    },

    /// A wait passed its deadline: a peer never arrived (or arrived too late).
    #[error("rank {rank} timed out after {waited:?} in call {call} waiting for {waiting_for}")]
    Timeout {
        rank: usize,
        call: u64,
        waited: Duration,
        waiting_for: String,
    },

    /// The group is unusable after an earlier timeout; drop the communicators and build anew.
    #[error("communicator group aborted: {reason}")]
    Aborted { reason: String },

    #[error("invalid group configuration: {0}")]
    InvalidConfig(String),

    /// A call asked for more than its workspace was created for (the fused all-reduce's
    /// `max_tokens`).
    #[error("{requested} {what} exceed the workspace's maximum of {max}")]
    WorkspaceExceeded {
        what: &'static str,
        requested: usize,
        max: usize,
    },

    /// A call's arguments do not fit together (a missing or mis-sized buffer of the fused
    /// all-reduce, say); nothing was enqueued.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A driver or library needed by the backend could not be loaded.
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
    #[error("unsupported: {what}")]
    Unsupported { what: String },

    /// The backend is not compiled into this build (see the cargo features).
    #[error("backend {0} is not compiled in (enable its cargo feature)")]
    BackendNotBuilt(&'static str),

    /// An error returned by the device runtime or vendor library.
    #[error("{api} failed: {detail}")]
    Device { api: &'static str, detail: String },

    /// The multi-process rendezvous (a `Bootstrap`) failed: a peer was refused or lost, a
    /// message was malformed, or the network failed. Not a rejection: the group must be
    /// rebuilt.
    #[error("bootstrap failed: {detail}")]
    Bootstrap { detail: String },
}

impl Error {
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
