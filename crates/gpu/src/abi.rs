//! The host side of the kernels' ABI, shared by the GPU backends. Every struct and offset here
//! mirrors one in `kernels-common/include/allreduce/abi.h` (which `static_assert`s the same
//! sizes); change both or neither. Every vendor's backend uses this one copy.

use std::ffi::c_void;

/// The version of everything ranks of other processes read of each other: the workspace
/// layout below, `Args`, the call descriptor and the numbering of kernels and codecs. The
/// processes of a group exchange it and refuse to form a group if it differs (they write into
/// each other's workspaces). Bump it with any such change.
pub const LAYOUT_VERSION: u32 = 1;

pub const MAX_WORLD: usize = 8;
pub const MAX_BLOCKS: usize = 64;
pub const THREADS: u32 = 512;

/// Byte offsets inside one rank's workspace allocation.
pub const HEADER_BYTES: usize = 4096;
pub const FLAGS_OFFSET: usize = 4096;
pub const DESC_OFFSET: usize = 8192;
pub const DESC2_OFFSET: usize = 16384;
pub const STAGING_OFFSET: usize = 24576;

const _: () = assert!(FLAGS_OFFSET + MAX_BLOCKS * MAX_WORLD * 4 <= DESC_OFFSET);
const _: () = assert!(DESC_OFFSET + 2 * MAX_BLOCKS * MAX_WORLD * 8 <= DESC2_OFFSET);
const _: () = assert!(DESC2_OFFSET + 2 * MAX_BLOCKS * MAX_WORLD * 8 <= STAGING_OFFSET);
// Header: epoch[64], calls[64], abort, skip[64] (abi.h asserts 772 bytes).
/// Byte offset of the abort word in a workspace (`Header::abort`, abi.h asserts it).
pub const ABORT_OFFSET: usize = 2 * MAX_BLOCKS * 4;
const _: () = assert!(ABORT_OFFSET == 512);
const _: () = assert!(3 * MAX_BLOCKS * 4 + 4 <= HEADER_BYTES);

/// Workspace bytes for calls of up to `max_bytes` (rounded up to 256): header, flags,
/// two staging buffers (one-shot alternates them by call parity) and the reduced shards.
pub fn workspace_bytes(max_bytes: usize) -> usize {
    STAGING_OFFSET + 3 * round_max_bytes(max_bytes)
}

pub fn round_max_bytes(max_bytes: usize) -> usize {
    max_bytes.div_ceil(256).max(1) * 256
}

/// Where kernels report a failed wait or a mismatch (host-mapped, read by the host without a
/// copy; written by kernels only on those rare paths, never read by them). The group-wide
/// abort word kernels poll lives in each workspace's header, in device memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Control {
    pub error: u32,
    pub rank: u32,
    pub block: u32,
    pub epoch: u32,
    pub waited_ns: u64,
    pub mine: u64,
    pub theirs: u64,
}

const _: () = assert!(size_of::<Control>() == 40);

pub const ERROR_NONE: u32 = 0;
/// A wait passed its deadline; the group is out of step for good.
pub const ERROR_TIMEOUT: u32 = 1;
/// The ranks described the call differently; all skipped it and the group is intact.
pub const ERROR_MISMATCH: u32 = 2;
/// This rank's kernel left a call because a peer timed out and set the group's abort word;
/// fatal like a timeout. The only report a rank gets of a peer's timeout in another process.
pub const ERROR_ABORTED: u32 = 3;
/// The ranks entered a fused call with different shapes (`mine`/`theirs` hold fused.h's call
/// descriptors); not fatal: every rank skipped the call, and the next one refills the buffer
/// its pushes landed in. Cleared once reported, like [`ERROR_MISMATCH`].
pub const ERROR_FUSED_MISMATCH: u32 = 4;

/// What a timeout's [`Control::theirs`] holds when a fused kernel's poll timed out
/// (`kTimeoutInFused`); 0 for the exact kernels' barrier. It says where the ranks that never
/// arrived can be read: the fused call tags or the barrier flags.
pub const TIMEOUT_IN_FUSED: u64 = 1;

/// A call descriptor, compared between ranks at the first barrier of every call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc(pub u64);

impl Desc {
    /// A rank whose arguments the host refused: it launches with this so its peers fail fast.
    pub const REJECTED: Desc = Desc(2);
    /// Or-ed into every piece but the first of a call split because it is larger than the
    /// workspace (`kDescContinued`).
    pub const CONTINUED: u64 = 4;
    /// Or-ed into the descriptor of a call that reads registered inputs in place
    /// (`kDescRegistered`): the path is part of what ranks compare.
    pub const REGISTERED: u64 = 8;

    /// Bit 63 stays clear: the kernels or their call tag into it (`kDescTag`). Lengths up to
    /// 2^47 elements are told apart, far past any device's memory.
    pub fn new(n: usize, dtype: u64, strategy: u64, precision: u64) -> Desc {
        let n = (n as u64) & ((1 << 47) - 1);
        Desc((n << 16) | (dtype << 12) | (strategy << 8) | (precision << 4) | 1)
    }
    pub fn len(self) -> u64 {
        self.0 >> 16
    }
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
    pub fn dtype(self) -> u64 {
        (self.0 >> 12) & 0xF
    }
    pub fn strategy(self) -> u64 {
        (self.0 >> 8) & 0xF
    }
    pub fn precision(self) -> u64 {
        (self.0 >> 4) & 0xF
    }
    pub fn registered(self) -> bool {
        self.0 & Self::REGISTERED != 0
    }
    /// Whether this is a [`Desc2`] word (a registered call's second word), as a mismatch
    /// report may hold: descriptors have bit 0 or bit 1 set, second words neither.
    pub fn is_desc2(self) -> bool {
        self.0 & 3 == 0
    }
}

/// A registered call's second descriptor word: the registration and the byte offset of the
/// inputs in it, `id << 40 | (offset / 16) << 2` (`RegisteredArgs::desc2`). Offsets are
/// multiples of 16 (inputs are 16-byte aligned and registrations start so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc2(pub u64);

impl Desc2 {
    /// Registration ids with this bit name a graph slot (its index below it) rather than a
    /// registration: a registration id reaches it only after 2^22 registrations, and then can
    /// only make two calls look alike, as the wrap below.
    pub const GRAPH_SLOT: u64 = 1 << 22;
    /// What a rank publishes for a graph slot whose row was never filled
    /// (`kDesc2Unregistered`): registration 0, which names nothing (ids start at 1).
    pub const UNREGISTERED: Desc2 = Desc2(0);

    /// Offsets up to 4 TiB and 2^23 registrations are told apart (bit 63 stays clear for the
    /// kernels' call tag); beyond, the word wraps, which can only make two different calls look
    /// alike to the comparison, never fail one.
    pub fn new(id: u64, offset: usize) -> Desc2 {
        let id = id & ((1 << 23) - 1);
        Desc2((id << 40) | ((((offset / 16) as u64) & ((1 << 38) - 1)) << 2))
    }
    pub fn id(self) -> u64 {
        self.0 >> 40
    }
    pub fn offset(self) -> u64 {
        ((self.0 >> 2) & ((1 << 38) - 1)) * 16
    }
    /// The word of a call captured on graph slot `slot`.
    pub fn graph_slot(slot: usize) -> Desc2 {
        Desc2::new(Self::GRAPH_SLOT | slot as u64, 0)
    }
}

/// The kernels' one by-value parameter. Only `input`, `output` and `n` change from call to
/// call, and those are what a CUDA graph captures anyway: epochs and parities live in device
/// memory and are advanced by the kernels themselves.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Args {
    pub input: *const c_void,
    pub output: *mut c_void,
    pub n: u64,
    pub peers: [u64; MAX_WORLD],
    pub control: u64,
    pub max_bytes: u64,
    pub timeout_ns: u64,
    pub rank: u32,
    pub world: u32,
    pub desc: u64,
}

const _: () = assert!(size_of::<Args>() == 128);
const _: () = assert!(std::mem::offset_of!(Args, peers) == 24);
const _: () = assert!(std::mem::offset_of!(Args, control) == 88);
const _: () = assert!(std::mem::offset_of!(Args, timeout_ns) == 104);
const _: () = assert!(std::mem::offset_of!(Args, world) == 116);
const _: () = assert!(std::mem::offset_of!(Args, desc) == 120);
const _: () = assert!(std::mem::offset_of!(Control, waited_ns) == 16);
const _: () = assert!(std::mem::offset_of!(Control, theirs) == 32);

/// The registered kernels' parameter (`RegisteredArgs` in abi.h): [`Args`], every rank's
/// input of the call (in rank order, ours included), the second descriptor word, and for a
/// call captured on a graph slot the device address of its row (then `inputs` is unused).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RegisteredArgs {
    pub a: Args,
    pub inputs: [u64; MAX_WORLD],
    pub desc2: u64,
    pub slot: u64,
}

const _: () = assert!(size_of::<RegisteredArgs>() == 208);
const _: () = assert!(std::mem::offset_of!(RegisteredArgs, inputs) == 128);
const _: () = assert!(std::mem::offset_of!(RegisteredArgs, desc2) == 192);
const _: () = assert!(std::mem::offset_of!(RegisteredArgs, slot) == 200);

/// Rows of a rank's graph slot table: how many calls captured on unregistered inputs a group
/// can register after capture over its life (slots are never reused: a destroyed graph's
/// rows stay as they were). Calls past it take the staged path. A row is [`MAX_WORLD`]
/// addresses, so the table is 1 MiB per rank.
pub const GRAPH_SLOTS: usize = 16384;
pub const GRAPH_SLOT_BYTES: usize = MAX_WORLD * 8;

/// The fused kernels' one by-value parameter (`ar::fused::FusedKernelArgs` in
/// `kernels-common/include/allreduce/fused.h`, which asserts the same size and offsets). Null
/// (0) output pointers are outputs not asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FusedKernelArgs {
    pub input: u64,
    pub allreduce_out: u64,
    pub residual_in: u64,
    pub residual_out: u64,
    pub norm_out: u64,
    pub quant_out: u64,
    /// Per-token scales out (pattern 2), or the caller's static scale, read (pattern 3).
    pub scale: u64,
    pub gamma: u64,
    pub lamport: [u64; MAX_WORLD],
    pub ws: [u64; MAX_WORLD],
    pub state: u64,
    pub control: u64,
    pub comm_bytes: u64,
    pub max_elems: u64,
    pub timeout_ns: u64,
    pub tokens: u32,
    pub hidden: u32,
    pub rank: u32,
    pub world: u32,
    pub pattern: u32,
    pub eps: f32,
    /// Added to gamma before it scales the normalized rows (`fused::weight`); 0 for none.
    pub weight_bias: f32,
    /// The push all-reduce (`push.h`): elements in the last 16-byte vector, 0 when the
    /// length is whole vectors; 0 for the fused kernels.
    pub tail: u32,
}

const _: () = assert!(size_of::<FusedKernelArgs>() == 264);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, weight_bias) == 256);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, lamport) == 64);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, ws) == 128);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, state) == 192);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, comm_bytes) == 208);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, tokens) == 232);
const _: () = assert!(std::mem::offset_of!(FusedKernelArgs, pattern) == 248);
// `ar::fused::BlockState` is 16 bytes, one per block of at most MAX_BLOCKS.
const _: () = assert!(allreduce_core::fused::FLAG_BYTES == MAX_BLOCKS * 16);

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels or their call tag into bit 63 of both words (`kDescTag`): the host must never
    /// set it, whatever the length or the registration, or a stale word would read as fresh.
    #[test]
    fn descriptor_words_leave_the_tag_bit_clear() {
        const TAG: u64 = 1 << 63;
        for n in [0, 1, usize::MAX >> 1, usize::MAX] {
            assert_eq!(Desc::new(n, 3, 5, 15).0 & TAG, 0, "n = {n}");
        }
        for id in [1, (1 << 23) - 1, 1 << 23, u64::MAX] {
            assert_eq!(Desc2::new(id, usize::MAX).0 & TAG, 0, "id = {id}");
        }
        // Told apart below the documented limits.
        assert_ne!(Desc2::new(1, 0), Desc2::new(2, 0));
        assert_eq!(Desc2::new((1 << 23) - 1, 4096).id(), (1 << 23) - 1);
        assert_eq!(Desc::new((1 << 47) - 1, 1, 1, 0).len(), (1 << 47) - 1);
    }
}
