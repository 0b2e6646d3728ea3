//! What a rank says a call is, and the one comparison every backend makes of the ranks'
//! sayings before any data moves.
//!
//! The host backend publishes a [`CallDesc`] per rank and compares them after the call's first
//! barrier; the GPU engine packs the same fields into the words its kernels compare
//! (`allreduce_gpu::abi::Desc`, fused.h's `call_desc`) and, when they differ, unpacks both
//! sides back into `CallDesc`s to report them. Both turn a difference into an error through
//! [`CallDesc::mismatch`], so a call one backend refuses is refused by every backend, with the
//! same variant and the same `what`.

use std::fmt;

use crate::fused::FusedCall;
use crate::{Call, DType, Error, FusedPattern, Precision, RegistrationId, Strategy};

/// Where a call's input is read from: part of what ranks agree on, since a rank that reads
/// its peers' inputs in place needs every peer's input at the same place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputPath {
    /// Copied into the group's workspace first (every call on memory no rank registered).
    Staged,
    /// Read in place from a registration, this many bytes into every rank's range.
    Registered { id: RegistrationId, offset: usize },
    /// Read in place at the addresses a graph slot was filled with after capture (GPU
    /// backends, `Communicator::set_graph_registration`).
    GraphSlot(usize),
}

impl fmt::Display for InputPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InputPath::Staged => f.write_str("a staged input"),
            InputPath::Registered { id, offset } => {
                write!(f, "registration {} at offset {offset}", id.0)
            }
            InputPath::GraphSlot(slot) => write!(f, "graph slot {slot}"),
        }
    }
}

/// The shape of a fused call (`Communicator::all_reduce_fused`): what its kernels agree on
/// besides the dtype and the strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedShape {
    pub tokens: usize,
    pub hidden: usize,
    pub pattern: FusedPattern,
}

/// One rank's description of a call. Ranks whose descriptions differ in any field skip the
/// call together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallDesc {
    /// Elements per rank (`tokens * hidden` for a fused call).
    pub len: usize,
    pub dtype: DType,
    /// Concrete (never `Auto`).
    pub strategy: Strategy,
    pub precision: Precision,
    pub input: InputPath,
    /// `Some` for a fused call.
    pub fused: Option<FusedShape>,
}

impl CallDesc {
    /// A plain all-reduce whose input is read from `input`.
    pub fn plain(call: &Call, input: InputPath) -> Self {
        CallDesc {
            len: call.len(),
            dtype: call.dtype(),
            strategy: call.strategy,
            precision: call.precision,
            input,
            fused: None,
        }
    }

    /// A fused call (always exact and staged).
    pub fn fused(call: &FusedCall) -> Self {
        CallDesc {
            len: call.tokens * call.hidden,
            dtype: call.dtype,
            strategy: call.strategy,
            precision: Precision::Exact,
            input: InputPath::Staged,
            fused: Some(FusedShape {
                tokens: call.tokens,
                hidden: call.hidden,
                pattern: call.pattern,
            }),
        }
    }

    /// The error every rank of call `call` reports when rank `me` described it as `self` and
    /// rank `peer` as `theirs`, or `None` when they agree. Always `Error::RankMismatch`: the
    /// ranks skip the call together and the group stays usable. Its `what` names the first
    /// field that differs, in the order the GPU kernels' words are decoded: length, dtype,
    /// strategy, path (staged or read in place), precision, registered input (registration,
    /// offset or graph slot); any difference of a fused call is "a fused call's shape".
    pub fn mismatch(&self, me: usize, peer: usize, call: u64, theirs: &CallDesc) -> Option<Error> {
        if self == theirs {
            return None;
        }
        if self.fused.is_some() || theirs.fused.is_some() {
            return Some(Error::RankMismatch {
                what: "a fused call's shape",
                call,
                detail: format!(
                    "rank {me} called with {}, rank {peer} with {}; every rank skipped the call",
                    self.fused_words(),
                    theirs.fused_words()
                ),
            });
        }
        let in_place = |d: &CallDesc| match d.input {
            InputPath::Staged => "a staged input".to_string(),
            _ => "a registered input".to_string(),
        };
        let (what, a, b) = if self.len != theirs.len {
            ("length", self.len.to_string(), theirs.len.to_string())
        } else if self.dtype != theirs.dtype {
            ("dtype", self.dtype.to_string(), theirs.dtype.to_string())
        } else if self.strategy != theirs.strategy {
            (
                "strategy",
                self.strategy.to_string(),
                theirs.strategy.to_string(),
            )
        } else if (self.input == InputPath::Staged) != (theirs.input == InputPath::Staged) {
            ("path", in_place(self), in_place(theirs))
        } else if self.precision != theirs.precision {
            (
                "precision",
                self.precision.to_string(),
                theirs.precision.to_string(),
            )
        } else {
            return Some(Error::RankMismatch {
                what: "registered input",
                call,
                detail: format!(
                    "rank {me} reads {}, rank {peer} {}",
                    self.input, theirs.input
                ),
            });
        };
        Some(Error::RankMismatch {
            what,
            call,
            detail: format!("rank {me} has {a}, rank {peer} has {b}"),
        })
    }

    /// A fused call in the words of [`crate::fused::describe_desc`]; a plain call as such.
    fn fused_words(&self) -> String {
        match self.fused {
            Some(f) => format!(
                "{} tokens x {} {}, {}, {}",
                f.tokens, f.hidden, self.dtype, f.pattern, self.strategy
            ),
            None => format!("a plain all-reduce of {} {}", self.len, self.dtype),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(len: usize) -> CallDesc {
        CallDesc {
            len,
            dtype: DType::BF16,
            strategy: Strategy::OneShot,
            precision: Precision::Exact,
            input: InputPath::Staged,
            fused: None,
        }
    }

    fn what(a: &CallDesc, b: &CallDesc) -> Option<&'static str> {
        match a.mismatch(0, 1, 7, b) {
            None => None,
            Some(Error::RankMismatch { what, call: 7, .. }) => Some(what),
            Some(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn each_field_is_named_in_the_kernels_order() {
        let a = plain(100);
        assert_eq!(what(&a, &a), None);
        assert_eq!(what(&a, &plain(101)), Some("length"));
        let b = CallDesc {
            dtype: DType::F16,
            strategy: Strategy::TwoShot,
            ..a
        };
        assert_eq!(what(&a, &b), Some("dtype"));
        let reg = |id, offset| InputPath::Registered {
            id: RegistrationId(id),
            offset,
        };
        let r = CallDesc {
            input: reg(1, 0),
            precision: Precision::Lossy(crate::Codec::Int8),
            ..a
        };
        assert_eq!(what(&a, &r), Some("path"));
        let r0 = CallDesc {
            input: reg(1, 0),
            ..a
        };
        assert_eq!(
            what(
                &r0,
                &CallDesc {
                    input: reg(1, 16),
                    ..a
                }
            ),
            Some("registered input")
        );
        assert_eq!(
            what(
                &r0,
                &CallDesc {
                    input: reg(2, 0),
                    ..a
                }
            ),
            Some("registered input")
        );
        assert_eq!(
            what(
                &r0,
                &CallDesc {
                    input: InputPath::GraphSlot(0),
                    ..a
                }
            ),
            Some("registered input")
        );
    }

    #[test]
    fn fused_calls_differ_in_their_shape_alone() {
        let f = |pattern| CallDesc {
            fused: Some(FusedShape {
                tokens: 4,
                hidden: 25,
                pattern,
            }),
            ..plain(100)
        };
        let a = f(FusedPattern::ResidualRmsNorm);
        assert_eq!(what(&a, &a), None);
        assert_eq!(
            what(&a, &f(FusedPattern::AllReduce)),
            Some("a fused call's shape")
        );
        // The same length as a plain call is still another call.
        assert_eq!(what(&a, &plain(100)), Some("a fused call's shape"));
        let Some(Error::RankMismatch { detail, .. }) =
            a.mismatch(0, 1, 7, &f(FusedPattern::AllReduce))
        else {
            unreachable!()
        };
        assert!(
            detail.contains("residual_rmsnorm") && detail.contains("allreduce"),
            "{detail}"
        );
    }
}
