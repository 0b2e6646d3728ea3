//! CPU threads as ranks: the reference implementation of every allreduce algorithm.
//!
//! Each rank is a thread holding a [`HostComm`]; the ranks of a group share a workspace
//! ([`workspace`]). The algorithms are the ones the GPU kernels run, phase for phase:
//!
//! - one-shot: copy the input into the workspace | barrier | every rank reduces all of it;
//! - two-shot: copy | barrier | rank r reduces shard r | barrier | every rank gathers;
//! - quantized two-shot: encode shard j for owner j (j != r) | barrier | owner decodes the
//!   peers' pieces, adds its own unquantized piece, sums in f32, re-encodes | barrier | every
//!   rank decodes every shard.
//! - hierarchical quantized (two NUMA groups of g, [`hierarchical`]): the quantized
//!   reduce-scatter inside the group | barrier | the owner encodes its group's partial |
//!   barrier | the owner and its partner in the other group sum both decoded partials (group
//!   0 first) and encode | barrier | every rank decodes its group's owners' bytes.
//! - fused all-reduce + residual + RMSNorm (+ FP8) ([`fused`]): the exact one-shot or
//!   two-shot above, then core's epilogue on the summed rows (composed, the reference the
//!   GPU's fused kernels are held to).
//!
//! Every call starts by publishing a descriptor (core's [`CallDesc`]: length, dtype, strategy,
//! precision, where the input is read from, a fused call's shape) with the first copy; after
//! the first barrier all ranks compare descriptors as the GPU kernels do and, if any differ or
//! a rank rejected its arguments, all return the same error before any output is written.

mod barrier;
mod fused;
mod hierarchical;
mod pieces;
mod reduce;
mod workspace;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allreduce_core::codec;
use allreduce_core::layout::{exact_granule, shard_range, QUANT_GRANULE};
use allreduce_core::{
    Backend, BackendComm, Call, CallDesc, Codec, DType, Deregister, Device, Element, Error,
    FusedComm, FusedConfig, GroupConfig, InputPath, Limits, Precision, RegisteredMemory,
    RegisteredRange, RegistrationId, Registry, Result, SelectionTable, Strategy, Stream, Topology,
};
use half::{bf16, f16};

use barrier::DeadlineBarrier;
use workspace::{Desc, Slot};

/// The host backend.
pub struct Host;

impl Backend for Host {
    const NAME: &'static str = "host";
    type Comm = HostComm;

    fn create_group(config: &GroupConfig) -> Result<Vec<HostComm>> {
        config.validate()?;
        let world = config.world_size;
        let group = Arc::new(Group {
            world,
            topology: config.topology.clone(),
            timeout: config.timeout,
            barrier: DeadlineBarrier::new(world),
            slots: (0..world).map(|_| Slot::new()).collect(),
            calls: (0..world).map(|_| AtomicU64::new(0)).collect(),
            registry: Arc::new(Mutex::new(Registry::new())),
            registered_min_bytes: config.resolved_registered_min_bytes()?,
        });
        let table = config.selection.clone().unwrap_or_default();
        Ok((0..world)
            .map(|rank| HostComm::new(&group, rank, config.max_bytes, table.clone()))
            .collect())
    }
}

struct Group {
    world: usize,
    /// Only a forced one ([`GroupConfig::topology`]): threads have no links to probe. The
    /// hierarchical path takes its NUMA groups from it, so the host can be its reference.
    topology: Option<Topology>,
    timeout: Duration,
    barrier: DeadlineBarrier,
    slots: Vec<Slot>,
    /// Calls each rank has begun. Per rank rather than per [`HostComm`]: a rank's fused
    /// workspace runs its all-reduce as that rank, so its calls are numbered in the same
    /// sequence as the rank's plain calls.
    calls: Vec<AtomicU64>,
    /// Registered memory: validated and recorded so that code written for the GPU paths runs
    /// here too; the host reads every input where it is anyway.
    registry: Arc<Mutex<Registry>>,
    /// Registered inputs smaller than this are described as staged, as on a GPU
    /// ([`GroupConfig::registered_min_bytes`]).
    registered_min_bytes: usize,
}

/// A registered host allocation: deregistered first, then freed.
struct HostRegistered {
    _deregister: Deregister,
    _mem: allreduce_core::HostBytes,
}

impl allreduce_core::MemoryOwner for HostRegistered {
    fn apply(&self, mem: &RegisteredMemory, op: allreduce_core::MemoryOp<'_>) -> Result<()> {
        use allreduce_core::MemoryOp;
        // The memory is written through its address, as the host's calls write an output
        // view of it: ranges were checked against it by `RegisteredMemory::apply`.
        let at = |offset: usize| (mem.addr + offset) as *mut u8;
        // SAFETY: every range lies inside a live allocation (checked by the caller), and a
        // copy's ranges do not overlap (checked too).
        unsafe {
            match op {
                MemoryOp::Upload { offset, src } => {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), at(offset), src.len())
                }
                MemoryOp::Download { offset, dst } => {
                    std::ptr::copy_nonoverlapping(at(offset), dst.as_mut_ptr(), dst.len())
                }
                MemoryOp::Fill {
                    offset,
                    bytes,
                    value,
                } => std::ptr::write_bytes(at(offset), value, bytes),
                MemoryOp::Copy {
                    offset,
                    src,
                    src_offset,
                    bytes,
                } => std::ptr::copy_nonoverlapping(
                    (src.addr + src_offset) as *const u8,
                    at(offset),
                    bytes,
                ),
            }
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[derive(Default)]
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// One rank of a host group.
pub struct HostComm {
    rank: usize,
    group: Arc<Group>,
    max_bytes: usize,
    table: SelectionTable,
    scratch: Mutex<Scratch>,
}

/// Where a call is: its number, the parity that picks double-buffered slots, and the timeout.
#[derive(Clone, Copy)]
struct Ctx {
    call: u64,
    parity: usize,
}

impl HostComm {
    fn new(group: &Arc<Group>, rank: usize, max_bytes: usize, table: SelectionTable) -> Self {
        HostComm {
            rank,
            group: group.clone(),
            max_bytes,
            table,
            scratch: Mutex::new(Scratch::default()),
        }
    }

    fn barrier(&self, ctx: Ctx, what: &str) -> Result<()> {
        self.group
            .barrier
            .wait(self.rank, ctx.call, self.group.timeout, what)
    }

    fn begin(&self) -> Ctx {
        let call = self.group.calls[self.rank].fetch_add(1, Ordering::Relaxed);
        Ctx {
            call,
            parity: (call % 2) as usize,
        }
    }

    /// After the first barrier: every rank reads every descriptor and reaches the same verdict,
    /// the one the GPU kernels reach from the same descriptors ([`CallDesc::mismatch`]).
    fn agree(&self, ctx: Ctx) -> Result<()> {
        let descs: Vec<Option<Desc>> = self
            .group
            .slots
            .iter()
            .map(|s| s.desc(ctx.parity))
            .collect();
        let mut calls = Vec::with_capacity(descs.len());
        for (rank, d) in descs.into_iter().enumerate() {
            match d {
                None => {
                    return Err(Error::RankMismatch {
                        what: "call sequence",
                        call: ctx.call,
                        detail: format!("rank {rank} published no descriptor"),
                    })
                }
                Some(Desc::Rejected(reason)) => {
                    return Err(Error::PeerRejected {
                        rank,
                        call: ctx.call,
                        reason,
                    })
                }
                Some(Desc::Call(d)) => calls.push(d),
            }
        }
        match calls
            .iter()
            .enumerate()
            .skip(1)
            .find_map(|(rank, d)| calls[0].mismatch(0, rank, ctx.call, d))
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn publish(&self, ctx: Ctx, desc: CallDesc) {
        self.group.slots[self.rank].publish(ctx.parity, Desc::Call(desc));
    }

    /// Where a plain call's input is read from, as the GPU engine decides it: in place from a
    /// registration for out-of-place exact one-shot and two-shot calls at or above the
    /// group's threshold, else staged. The host reads every input where it is anyway; the
    /// path is described so that ranks that would disagree on a GPU disagree here too.
    fn input_path(&self, call: &Call) -> InputPath {
        if !allreduce_core::registration::reads_in_place(call, self.group.registered_min_bytes) {
            return InputPath::Staged;
        }
        let reg = self
            .group
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match reg.find(self.rank, call.input.addr, call.input.bytes()) {
            Some(r) => InputPath::Registered {
                id: r.id,
                offset: r.offset,
            },
            None => InputPath::Staged,
        }
    }

    /// Run a validated call that every rank describes as `desc`.
    fn run_described(&self, call: &Call, desc: CallDesc) -> Result<()> {
        if let Some(reason) = self.group.barrier.aborted() {
            return Err(Error::Aborted { reason });
        }
        match call.dtype() {
            DType::F32 => self.run::<f32>(call, desc),
            DType::F16 => self.run::<f16>(call, desc),
            DType::BF16 => self.run::<bf16>(call, desc),
        }
    }

    fn run<T: Element>(&self, call: &Call, desc: CallDesc) -> Result<()> {
        let ctx = self.begin();
        self.publish(ctx, desc);
        match call.strategy {
            Strategy::OneShot => self.one_shot::<T>(ctx, call, reduce::sum_into),
            // The reference of the GPU's push one-shot: the one-shot's arithmetic on inputs
            // whose -0.0 were pushed as +0.0 (the kernel's sentinel is -0.0, so no rank sends
            // one). The host has no push to make; it stages and sums.
            Strategy::PushOneShot => self.one_shot::<T>(ctx, call, reduce::sum_pushed_into),
            Strategy::TwoShot => self.two_shot::<T>(ctx, call),
            Strategy::QuantizedTwoShot => {
                let codec = call
                    .codec()
                    .expect("prepare() pairs QuantizedTwoShot with a codec");
                self.quantized::<T>(ctx, call, codec)
            }
            Strategy::HierarchicalQuantized => {
                let codec = call
                    .codec()
                    .expect("prepare() pairs HierarchicalQuantized with a codec");
                let g = allreduce_core::hierarchical::group_size(
                    self.group.topology.as_ref(),
                    self.group.world,
                )
                .map_err(|reason| Error::StrategyUnavailable {
                    strategy: call.strategy,
                    reason,
                })?;
                self.hierarchical::<T>(ctx, call, codec, g)
            }
            s => Err(Error::StrategyUnavailable {
                strategy: s,
                reason: "not implemented by the host backend".into(),
            }),
        }
    }

    /// Copy this rank's input into its stage buffer for the call's parity.
    fn stage_input(&self, ctx: Ctx, call: &Call) {
        let bytes = call.bytes();
        // SAFETY: our own slot, before the first barrier of the call: by the parity argument
        // in `workspace`, no peer reads this stage buffer now.
        unsafe {
            let dst = self.group.slots[self.rank].stage[ctx.parity].prepare(bytes);
            std::ptr::copy_nonoverlapping(call.input.addr as *const u8, dst, bytes);
        }
    }

    /// Every rank's staged input as `&[T]`.
    ///
    /// # Safety
    /// Only between the call's first barrier and the next call's first barrier.
    unsafe fn staged<T: Element>(&self, ctx: Ctx, len: usize) -> Vec<&[T]> {
        let bytes = len * size_of::<T>();
        self.group
            .slots
            .iter()
            .map(|s| {
                let b = s.stage[ctx.parity].read(bytes);
                std::slice::from_raw_parts(b.as_ptr() as *const T, len)
            })
            .collect()
    }

    /// Stage, agree, then sum every rank's staged input with `sum` (the one-shot's
    /// `reduce::sum_into`, or the push one-shot's `reduce::sum_pushed_into`).
    fn one_shot<T: Element>(
        &self,
        ctx: Ctx,
        call: &Call,
        sum: fn(&[&[T]], &mut [T]),
    ) -> Result<()> {
        self.stage_input(ctx, call);
        self.barrier(ctx, "all ranks to stage their input")?;
        self.agree(ctx)?;
        let n = call.len();
        // SAFETY: after the barrier that follows every rank's staging.
        let inputs = unsafe { self.staged::<T>(ctx, n) };
        // SAFETY: `prepare` checked the output's size, alignment and device; the caller
        // lends it exclusively for the call. The input was staged, so in-place is fine.
        let out = unsafe { output_slice::<T>(call) };
        sum(&inputs, out);
        Ok(())
    }

    fn two_shot<T: Element>(&self, ctx: Ctx, call: &Call) -> Result<()> {
        let n = call.len();
        let world = self.group.world;
        let granule = exact_granule(call.dtype());
        self.stage_input(ctx, call);
        self.barrier(ctx, "all ranks to stage their input")?;
        self.agree(ctx)?;

        // ---- stage 1: reduce-scatter. Rank r reduces shard r of every rank's input.
        let mine = shard_range(n, world, self.rank, granule);
        // SAFETY: after the staging barrier.
        let inputs = unsafe { self.staged::<T>(ctx, n) };
        let parts: Vec<&[T]> = inputs.iter().map(|s| &s[mine.clone()]).collect();
        // SAFETY: own slot; peers read `reduced` only after the next barrier, and the previous
        // call's readers finished before this call's first barrier.
        let reduced = unsafe {
            let p = self.group.slots[self.rank]
                .reduced
                .prepare(mine.len() * size_of::<T>()) as *mut T;
            std::slice::from_raw_parts_mut(p, mine.len())
        };
        reduce::sum_into(&parts, reduced);
        self.barrier(ctx, "all ranks to reduce their shard")?;

        // ---- stage 2: all-gather. Copy every owner's reduced shard, bytes unchanged, so all
        // ranks hold the same rounding of the same f32 sums.
        // SAFETY: as in one_shot.
        let out = unsafe { output_slice::<T>(call) };
        for (owner, slot) in self.group.slots.iter().enumerate() {
            let range = shard_range(n, world, owner, granule);
            // SAFETY: written by `owner` before the barrier above.
            let src = unsafe {
                let b = slot.reduced.read(range.len() * size_of::<T>());
                std::slice::from_raw_parts(b.as_ptr() as *const T, range.len())
            };
            out[range].copy_from_slice(src);
        }
        Ok(())
    }

    fn quantized<T: Element>(&self, ctx: Ctx, call: &Call, codec: Codec) -> Result<()> {
        let n = call.len();
        let world = self.group.world;
        let shard = |r| shard_range(n, world, r, QUANT_GRANULE);
        let layout = pieces::SendLayout::new(codec, world, shard);
        let total = layout.total();
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { a, b } = &mut *scratch;
        let max_shard = shard(0).len();
        a.resize(max_shard, 0.0);
        b.resize(max_shard, 0.0);

        // ---- stage 1a: encode shard j of our input for owner j.
        // SAFETY: the caller's input, validated by `prepare`.
        let input = unsafe { std::slice::from_raw_parts(call.input.addr as *const T, n) };
        // SAFETY: own slot before the first barrier; the previous call's readers of `qsend`
        // finished before its second barrier.
        let send = unsafe {
            std::slice::from_raw_parts_mut(self.group.slots[self.rank].qsend.prepare(total), total)
        };
        pieces::encode_pieces(codec, input, send, &layout, self.rank, shard, a);
        self.barrier(ctx, "all ranks to encode their shards")?;
        self.agree(ctx)?;

        // ---- stage 1b: the owner decodes every peer's piece of its shard, sums in f32 in
        // rank order and re-encodes the sum once. Its own piece never travels, so it enters
        // the sum unquantized: one quantization fewer than QuickReduce, which round-trips
        // every rank's piece through the codec (+0.28 dB at 8 ranks, docs/codecs.md).
        let mine = shard(self.rank);
        let acc = &mut a[..mine.len()];
        let tmp = &mut b[..mine.len()];
        // SAFETY (of the reads): each peer wrote its `qsend` before the barrier above.
        let sent = |src: usize| unsafe { self.group.slots[src].qsend.read(total) };
        let own_piece = &input[mine.clone()];
        pieces::sum_pieces(codec, own_piece, &layout, self.rank, sent, acc, tmp);
        let enc_len = codec.encoded_len(mine.len());
        // SAFETY: own slot; peers read `qresult` only after the next barrier.
        let result = unsafe {
            std::slice::from_raw_parts_mut(
                self.group.slots[self.rank]
                    .qresult
                    .prepare(codec.encoded_len(max_shard)),
                enc_len,
            )
        };
        codec::encode(codec, acc, result);
        self.barrier(ctx, "all ranks to reduce their shard")?;

        // ---- stage 2: every rank decodes every owner's bytes: identical bytes in, identical
        // values out on every rank.
        // SAFETY: as in one_shot; the input was fully read in stage 1a.
        let out = unsafe { output_slice::<T>(call) };
        for (owner, slot) in self.group.slots.iter().enumerate() {
            let range = shard(owner);
            let len = range.len();
            // SAFETY: written by `owner` before the barrier above.
            let bytes = unsafe { slot.qresult.read(codec.encoded_len(len)) };
            codec::decode(codec, bytes, &mut a[..len]);
            reduce::narrow(&a[..len], &mut out[range]);
        }
        Ok(())
    }
}

/// # Safety
/// `call.output` must be valid, aligned, host memory lent exclusively for the call.
unsafe fn output_slice<'a, T: Element>(call: &Call) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(call.output.addr as *mut T, call.len())
}

impl BackendComm for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn group_key(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.group) as usize)
    }

    fn register_group(&self, ranges: &[RegisteredRange]) -> Result<RegistrationId> {
        let mut reg = self
            .group
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        reg.register(self.group.world, ranges)
    }

    /// Host ranks have no graphs: nothing is ever captured, so nothing waits for registration.
    fn set_graph_registration(&self, _on: bool) -> Result<()> {
        Ok(())
    }

    fn register_graph_buffers_group(&self) -> Result<usize> {
        Ok(0)
    }

    fn deregister_group(&self, id: RegistrationId) -> Result<()> {
        let mut reg = self
            .group
            .registry
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        reg.deregister(id)
    }

    fn alloc_registered_group(&self, bytes: usize) -> Result<Vec<RegisteredMemory>> {
        let mems: Vec<_> = (0..self.group.world)
            .map(|_| allreduce_core::HostBytes::zeroed(bytes))
            .collect();
        let ranges: Vec<RegisteredRange> = mems
            .iter()
            .map(|m| RegisteredRange {
                addr: m.view(DType::F32).raw().addr,
                bytes,
            })
            .collect();
        let id = self.register_group(&ranges)?;
        Ok(mems
            .into_iter()
            .zip(ranges)
            .map(|(mem, range)| RegisteredMemory {
                addr: range.addr,
                bytes,
                device: Device::Host,
                id,
                owner: Box::new(HostRegistered {
                    _deregister: Deregister {
                        registry: self.group.registry.clone(),
                        id,
                    },
                    _mem: mem,
                }),
            })
            .collect())
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn limits(&self) -> Limits {
        Limits {
            chunks: false,
            device: Device::Host,
            max_bytes: self.max_bytes,
            // The GPU backends' rule (their kernels move 16-byte vectors), enforced here too so
            // that code tested on the host does not fail on a GPU.
            align: allreduce_core::BUFFER_ALIGN,
            topology: self.group.topology.as_ref().and_then(|t| t.class()),
        }
    }

    fn selection(&self) -> &SelectionTable {
        &self.table
    }

    fn strategy_available(
        &self,
        strategy: Strategy,
        dtype: DType,
        precision: Precision,
    ) -> Result<(), String> {
        match strategy {
            Strategy::OneShot | Strategy::TwoShot => Ok(()),
            Strategy::PushOneShot => match precision {
                Precision::Exact => Ok(()),
                Precision::Lossy(_) => Err("it is exact (Precision::Exact)".into()),
            },
            Strategy::QuantizedTwoShot => match precision {
                Precision::Lossy(c) if c.supports(dtype) => Ok(()),
                Precision::Lossy(c) => Err(format!("codec {c} does not accept {dtype}")),
                Precision::Exact => Err("it needs Precision::Lossy(codec)".into()),
            },
            Strategy::HierarchicalQuantized => match precision {
                Precision::Lossy(c) if c.supports(dtype) => {
                    allreduce_core::hierarchical::group_size(
                        self.group.topology.as_ref(),
                        self.group.world,
                    )
                    .map(|_| ())
                }
                Precision::Lossy(c) => Err(format!("codec {c} does not accept {dtype}")),
                Precision::Exact => Err("it needs Precision::Lossy(codec)".into()),
            },
            Strategy::Vendor | Strategy::VendorSymmetric => {
                Err("the host backend has no vendor library (NCCL/RCCL come with the cuda/rocm backends)".into())
            }
            Strategy::Auto => Err("Auto is resolved before the backend is called".into()),
        }
    }

    fn all_reduce(&self, call: &Call) -> Result<()> {
        self.run_described(call, CallDesc::plain(call, self.input_path(call)))
    }

    fn topology(&self) -> Option<&Topology> {
        self.group.topology.as_ref()
    }

    fn reject(&self, reason: &Error, _stream: Stream) {
        let ctx = self.begin();
        self.group.slots[self.rank].publish(ctx.parity, Desc::Rejected(reason.to_string()));
        // The peers learn of the rejection at this barrier; our own error is what the caller
        // sees, so a failure here (timeout, abort) has nothing to add.
        let _ = self.barrier(ctx, "all ranks to publish their arguments");
    }

    /// The host has no fused kernels: each rank's workspace runs the exact all-reduce, then
    /// the epilogue.
    fn create_fused_group(&self, config: &FusedConfig) -> Result<Option<Vec<Box<dyn FusedComm>>>> {
        config.validate()?;
        let world = self.group.world;
        Ok(Some(
            (0..world)
                .map(|rank| {
                    let comm = HostComm::new(&self.group, rank, self.max_bytes, self.table.clone());
                    Box::new(fused::HostFused::new(config, comm)) as Box<dyn FusedComm>
                })
                .collect(),
        ))
    }

    fn abort(&self, reason: &str) -> Result<()> {
        self.group.barrier.abort(reason);
        Ok(())
    }

    fn synchronize(&self, _stream: Stream) -> Result<()> {
        // Host calls complete before returning; only an abort is left to report.
        match self.group.barrier.aborted() {
            Some(reason) => Err(Error::Aborted { reason }),
            None => Ok(()),
        }
    }
}
