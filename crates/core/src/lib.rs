//! The specification every `allreduce` backend implements: types, errors, per-call
//! validation, the reference codecs, buffer layout and strategy selection. No device code:
//! the GPU engine that runs this specification on NVIDIA and AMD is `allreduce-gpu`.
//!
//! Users depend on the `allreduce` facade crate; this crate is what backends are written
//! against. Its pieces:
//!
//! | module      | what it holds                                                          |
//! |-------------|------------------------------------------------------------------------|
//! | [`dtype`]   | `DType` and conversions through f32 (round-to-nearest-even)            |
//! | [`op`]      | `ReduceOp`, `Codec`, `Precision`, `Strategy`                           |
//! | [`buffer`]  | device-neutral buffer views (address + length + dtype + device), `Stream` |
//! | [`backend`] | `Backend`/`BackendComm` traits, `GroupConfig`, per-call validation     |
//! | [`codec`]   | the reference codecs GPU kernels must match bit for bit                |
//! | [`layout`]  | how buffers are cut into per-rank shards                               |
//! | [`hierarchical`] | the two-NUMA-group quantized all-reduce: groups, shards, reference |
//! | [`registration`] | registered memory: ranges peers read in place, the registry     |
//! | [`select`]  | the table behind `Strategy::Auto`                                      |
//! | [`fused`]   | the fused all-reduce + residual + RMSNorm (+ FP8): validation, reference |
//! | [`call_desc`] | what ranks compare before a call moves data, and the error for a difference |

pub mod backend;
pub mod buffer;
pub mod call_desc;
pub mod codec;
pub mod dtype;
pub mod error;
pub mod fused;
pub mod hierarchical;
pub mod layout;
pub mod op;
pub mod registration;
pub mod select;
pub mod topology;

pub use backend::{
    prepare, AllReduceOptions, Backend, BackendComm, Bootstrap, Call, GroupConfig, Limits,
    BUFFER_ALIGN, DEFAULT_TIMEOUT, MAX_WORLD,
};
pub use buffer::{BufMut, BufRef, Device, HostBytes, RawBuffer, Stream};
pub use call_desc::{CallDesc, FusedShape, InputPath};
pub use dtype::{DType, Element};
pub use error::{Aftermath, Error, Result};
pub use fused::{
    Fp8BufMut, FusedArgs, FusedCall, FusedComm, FusedConfig, FusedMetadata, FusedPattern,
};
pub use op::{Codec, Precision, ReduceOp, Strategy};
pub use registration::{
    Deregister, MemoryOp, MemoryOwner, RegisteredInput, RegisteredMemory, RegisteredRange,
    RegistrationId, Registry,
};
pub use select::{Rule, SelectionTable};
pub use topology::{Link, Topology, TopologyClass};
