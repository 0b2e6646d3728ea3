//! The push (Lamport) one-shot all-reduce's host side (`Strategy::PushOneShot`), over any
//! [`GpuRuntime`]: the receive buffers every rank of an in-process group keeps, the kernel
//! (`push_oneshot` in `kernels-common/include/allreduce/push.h`, an instance of the fused
//! module), its argument block (the fused kernels' [`FusedKernelArgs`]), the warm-up, and how
//! a disagreement the kernels report reads on the host.
//!
//! Each rank allocates, once per group, three receive buffers of `world + 1` slots of
//! [`Strategy::PUSH_MAX_BYTES`] plus the call tags, filled with the f32 sentinel (-0.0, whose
//! high half is also the 16-bit one, so calls of every dtype share the buffers), and 1 KiB of
//! per-block call state (zeroed). Slot `world` is unused by the one-shot; the protocol's
//! refill after a skipped call covers `world + 1` slots, as in the fused workspace.

use crate::abi::{FusedKernelArgs, MAX_WORLD, THREADS};
use crate::kernels::{self, Kernel};
use crate::{Fill, GpuRuntime};
use allreduce_core::{DType, Error, Result, Strategy, Stream};

/// `kPatternPush` / `kPatternPushRejected` (push.h): what the descriptor's pattern field says.
pub const PATTERN_PUSH: u32 = 4;
pub const PATTERN_PUSH_REJECTED: u32 = 5;

/// The fill of a fresh receive buffer: -0.0 as f32 words (push.h says why one fill serves
/// every dtype).
pub const SENTINEL: Fill = Fill::U32(0x8000_0000);

/// Bytes of one slot: the largest call.
pub const SLOT_BYTES: usize = Strategy::PUSH_MAX_BYTES;
const TAG_BYTES: usize = MAX_WORLD * 16;
/// The per-block call state (`ar::fused::BlockState`, 16 bytes per block).
const STATE_BYTES: usize = allreduce_core::fused::FLAG_BYTES;

/// Bytes of one of a rank's three receive buffers in a group of `world`.
pub fn buffer_bytes(world: usize) -> usize {
    (world + 1) * SLOT_BYTES + TAG_BYTES
}

/// The kernel instances for groups of `world` ranks, f32, f16, bf16: the world-specialised
/// ones where the module has them, else the generic one.
pub fn kernel_set<R: GpuRuntime>(world: usize) -> [Kernel; 3] {
    let w = if R::FUSED_WORLDS.contains(&world) {
        world
    } else {
        0
    };
    DType::ALL.map(|d| Kernel::PushOneShot(d, w))
}

/// One device's kernels (its own load of the fused module).
pub(crate) struct PushKernels<R: GpuRuntime> {
    pub functions: [R::Function; 3],
    _module: R::Module,
}

impl<R: GpuRuntime> PushKernels<R> {
    pub fn load(dev: &R::Device, world: usize) -> Result<Self> {
        let module = R::load_fused_module(dev)?;
        Ok(PushKernels {
            functions: kernels::functions::<R, 3>(&module, kernel_set::<R>(world))?,
            _module: module,
        })
    }
}

/// One rank's receive buffers and call state.
pub(crate) struct PushMemory<R: GpuRuntime> {
    pub buffers: R::Memory,
    pub state: R::Memory,
}

impl<R: GpuRuntime> PushMemory<R> {
    /// On `dev`, which the caller bound.
    pub fn alloc(dev: &R::Device, world: usize) -> Result<Self> {
        Ok(PushMemory {
            buffers: R::alloc_filled(dev, 3 * buffer_bytes(world), SENTINEL)?,
            state: R::alloc_workspace(dev, STATE_BYTES)?,
        })
    }
}

/// What a launch needs to know of its group.
pub(crate) struct Launch {
    pub rank: usize,
    pub world: usize,
    /// Every rank's receive buffers, rank order.
    pub buffers: [u64; MAX_WORLD],
    /// Every rank's exact-kernel workspace (its header holds the abort word).
    pub workspaces: [u64; MAX_WORLD],
    pub state: u64,
    pub control: u64,
    pub timeout_ns: u64,
}

/// The argument block of one call of `n` elements of `dtype`; `None` for input and output
/// and `rejected` for the launch of a rank whose call the host refused (no data: its tag
/// alone tells the peers).
pub(crate) fn args(
    l: &Launch,
    dtype: DType,
    input: u64,
    output: u64,
    n: usize,
    rejected: bool,
) -> FusedKernelArgs {
    let per_vec = 16 / dtype.size();
    FusedKernelArgs {
        input,
        allreduce_out: output,
        lamport: l.buffers,
        ws: l.workspaces,
        state: l.state,
        control: l.control,
        comm_bytes: buffer_bytes(l.world) as u64,
        // The protocol's bookkeeping counts f32 elements, whatever the dtype (push.h).
        max_elems: (SLOT_BYTES / 4) as u64,
        timeout_ns: l.timeout_ns,
        tokens: n.div_ceil(per_vec) as u32,
        hidden: 4,
        rank: l.rank as u32,
        world: l.world as u32,
        pattern: if rejected {
            PATTERN_PUSH_REJECTED
        } else {
            PATTERN_PUSH
        },
        tail: (n % per_vec) as u32,
        ..Default::default()
    }
}

/// `ALLREDUCE_PUSH_PDL`: 0 for ordinary launches of the push one-shot, 1 (the default) for
/// programmatic dependent launch where every device of the group has it (as the fused
/// kernels': the kernel waits in `pdl_wait` before its first access and lets the stream's next
/// kernel be scheduled once its polls are over). A comparison knob.
pub const PDL_ENV: &str = "ALLREDUCE_PUSH_PDL";

pub(crate) fn pdl_setting() -> Result<bool> {
    match std::env::var(PDL_ENV) {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            "0" => Ok(false),
            "1" => Ok(true),
            _ => Err(Error::InvalidConfig(format!(
                "{PDL_ENV}={v:?}: want 0 or 1"
            ))),
        },
    }
}

/// Launch the push one-shot `f` for `args` on `stream`, as a programmatic dependent launch
/// when `pdl`.
///
/// # Safety
/// `args` from [`args`] for a live group; input and output hold the call's elements (or the
/// call has none), on the current device.
pub(crate) unsafe fn launch<R: GpuRuntime>(
    f: R::Function,
    grid: u32,
    stream: Stream,
    args: &FusedKernelArgs,
    pdl: bool,
) -> Result<()> {
    if pdl {
        R::launch_dependent(f, grid, 1, THREADS, stream, args)
    } else {
        R::launch(f, grid, THREADS, stream, args)
    }
}

/// Whether a descriptor a push kernel reported is one of push.h's (rather than a fused
/// call's).
pub fn is_push_desc(d: u64) -> bool {
    matches!(
        ((d >> 4) & 0xf) as u32,
        PATTERN_PUSH | PATTERN_PUSH_REJECTED
    )
}

/// Ranks whose push calls differed, as the error the other strategies give: `PeerRejected`
/// when the peer's call was refused on its host (`refusal` gives its reason), else
/// `RankMismatch` naming what differs.
pub fn mismatch_error(
    me: usize,
    peer: usize,
    call: u64,
    mine: u64,
    theirs: u64,
    refusal: impl Fn(usize) -> String,
) -> Error {
    let pattern = |d: u64| ((d >> 4) & 0xf) as u32;
    if pattern(theirs) == PATTERN_PUSH_REJECTED {
        return Error::PeerRejected {
            rank: peer,
            call,
            reason: refusal(peer),
        };
    }
    let (what, a, b) = if (mine >> 1) & 3 != (theirs >> 1) & 3 {
        ("dtype", dtype_name(mine), dtype_name(theirs))
    } else {
        ("length", length(mine), length(theirs))
    };
    Error::RankMismatch {
        what,
        call,
        detail: format!("rank {me} has {a}, rank {peer} has {b}; every rank skipped the call"),
    }
}

fn dtype_name(d: u64) -> String {
    match (d >> 1) & 3 {
        1 => "f32",
        2 => "f16",
        3 => "bf16",
        _ => "?",
    }
    .to_string()
}

/// The element count a descriptor names: whole vectors, the last one holding `tail` elements.
fn length(d: u64) -> String {
    let per_vec: u64 = match (d >> 1) & 3 {
        1 => 4,
        _ => 8,
    };
    let (vectors, tail) = (d >> 32, (d >> 8) & 0xff_ffff);
    let n = if tail == 0 {
        vectors * per_vec
    } else {
        (vectors - 1) * per_vec + tail
    };
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(n: usize, dtype: DType, rejected: bool) -> u64 {
        // push.h's push_desc, from what args() passes it.
        let l = Launch {
            rank: 0,
            world: 2,
            buffers: [0; MAX_WORLD],
            workspaces: [0; MAX_WORLD],
            state: 0,
            control: 0,
            timeout_ns: 0,
        };
        let a = args(&l, dtype, 0, 0, n, rejected);
        let code = 1 + DType::ALL.iter().position(|&d| d == dtype).unwrap() as u64;
        (a.tokens as u64) << 32
            | ((a.tail & 0xff_ffff) as u64) << 8
            | ((a.pattern & 0xf) as u64) << 4
            | code << 1
            | 1
    }

    #[test]
    fn arguments_count_vectors_and_the_tail() {
        let l = Launch {
            rank: 1,
            world: 4,
            buffers: [0; MAX_WORLD],
            workspaces: [0; MAX_WORLD],
            state: 0,
            control: 0,
            timeout_ns: 0,
        };
        let a = args(&l, DType::BF16, 16, 32, 17, false);
        assert_eq!((a.tokens, a.tail, a.hidden), (3, 1, 4));
        let a = args(&l, DType::F32, 16, 32, 8, false);
        assert_eq!((a.tokens, a.tail), (2, 0));
        assert_eq!(a.max_elems as usize * 4, SLOT_BYTES);
        assert_eq!(a.comm_bytes as usize, 5 * SLOT_BYTES + 128);
        assert_eq!(a.pattern, PATTERN_PUSH);
    }

    #[test]
    fn mismatches_name_what_differs() {
        let e = mismatch_error(
            0,
            1,
            7,
            desc(9, DType::BF16, false),
            desc(10, DType::BF16, false),
            |_| unreachable!(),
        );
        assert!(
            matches!(&e, Error::RankMismatch { what: "length", call: 7, detail } if detail.contains("has 9, rank 1 has 10")),
            "{e:?}"
        );
        let e = mismatch_error(
            0,
            1,
            7,
            desc(8, DType::F16, false),
            desc(4, DType::F32, false),
            |_| unreachable!(),
        );
        assert!(
            matches!(&e, Error::RankMismatch { what: "dtype", .. }),
            "{e:?}"
        );
        let e = mismatch_error(
            0,
            1,
            7,
            desc(8, DType::F16, false),
            desc(0, DType::F32, true),
            |r| format!("rank {r}'s reason"),
        );
        assert!(
            matches!(&e, Error::PeerRejected { rank: 1, reason, .. } if reason == "rank 1's reason"),
            "{e:?}"
        );
        assert!(is_push_desc(desc(3, DType::F32, false)));
        assert!(!is_push_desc(1 << 32 | 4096 << 8 | 1 << 4 | 3 << 1 | 1));
    }
}
