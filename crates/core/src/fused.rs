//! The fused all-reduce + residual add + RMSNorm (+ FP8) operation: its workspace description,
//! per-call validation, the `Auto` switch between one-shot and two-shot, and the host
//! reference every backend is checked against.
//!
//! Semantics (the same on every backend, and what an unfused pipeline computes, so the fused
//! call is a drop-in replacement for "all-reduce, then a residual + RMSNorm kernel"):
//!
//! ```text
//! a[t, i]   = round_T(sum over ranks 0..world-1 of x_r[t, i], f32, rank order)   (-0.0 -> +0.0)
//! r[t, i]   = round_T(a[t, i] + residual[t, i])  (a[t, i] with no residual)       residual_out
//! inv[t]    = 1 / sqrt(sum_i r[t, i]^2 / hidden + eps)
//! w[i]      = gamma[i] + weight_bias  (f32; gamma[i] itself when weight_bias is 0)
//! n[t, i]   = round_T((r[t, i] * inv[t]) * w[i])                                  norm_out
//! amax[t]   = max_i |n[t, i]|;  scale[t] = amax[t] / 448 (1 when amax is 0)       scale_out
//! q[t, i]   = e4m3(n[t, i] * (448 / amax[t]))  (saturating, nearest even)         quant_out
//! ```
//!
//! The one deviation from the unfused all-reduce: a sum that rounds to -0.0 comes out as
//! +0.0. The GPU kernels are Lamport kernels whose buffers are pre-filled with -0.0 as the
//! "not written yet" sentinel, so a -0.0 can never travel (inputs are pushed as +0.0, and the
//! two-shot's reduced rows are pushed the same way); every rank must see the same bits, so
//! the canonical result is +0.0 everywhere. By value (`==`) the fused and unfused results
//! are equal, since -0.0 == +0.0 and `x + -0.0 == x + +0.0` for every non-zero x.
//!
//! The all-reduce output and the residual output are bitwise reproducible across backends.
//! The RMSNorm sums squares in a backend-specific order (the GPU reduces a row across a
//! thread block), so `norm_out` may differ from the host reference by one unit in the last
//! place of T, and `quant_out` by one E4M3 step: [`norm_tolerance`] is the bound tests use.

mod prepare;

use std::fmt;

use half::{bf16, f16};

use crate::codec::f32_to_e4m3;
use crate::{
    BufMut, BufRef, DType, Device, Error, RawBuffer, Result, Rule, SelectionTable, Strategy, Stream,
};

pub use prepare::prepare_fused;

/// What the fused call computes after the all-reduce (TensorRT-LLM's / FlashInfer's
/// `AllReduceFusionPattern` 0, 1 and 2/4 with per-token dynamic FP8 scales).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FusedPattern {
    /// Only the all-reduce (`allreduce_out` required).
    AllReduce,
    /// All-reduce, residual add, RMSNorm (`gamma`, `norm_out` required). Without
    /// `residual_in` the norm is of the all-reduce output itself (FlashInfer's and
    /// TensorRT-LLM's all-reduce + RMSNorm without residual), and `residual_out` is refused.
    #[default]
    ResidualRmsNorm,
    /// As `ResidualRmsNorm`, plus the normalized rows quantized to FP8 E4M3 with one f32 scale
    /// per token (`quant_out`, `scale_out` required; `norm_out` optional).
    ResidualRmsNormFp8,
    /// As `ResidualRmsNorm`, plus the normalized rows quantized to FP8 E4M3 at the caller's
    /// one static scale, read from device memory at run time (`quant_out` and `scale_in`
    /// required; `norm_out` optional): `code = e4m3(norm * (1 / scale))`, saturating at
    /// +-448, as TensorRT-LLM's and FlashInfer's `kARResidualRMSNormFP8Quant` and vLLM's
    /// `static_scaled_fp8_quant`. The scale should be positive and finite; others follow
    /// IEEE arithmetic (1 / 0 is infinity: every nonzero code saturates).
    ResidualRmsNormFp8Static,
}

impl FusedPattern {
    /// In code order.
    pub const ALL: [FusedPattern; 4] = [
        FusedPattern::AllReduce,
        FusedPattern::ResidualRmsNorm,
        FusedPattern::ResidualRmsNormFp8,
        FusedPattern::ResidualRmsNormFp8Static,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            FusedPattern::AllReduce => "allreduce",
            FusedPattern::ResidualRmsNorm => "residual_rmsnorm",
            FusedPattern::ResidualRmsNormFp8 => "residual_rmsnorm_fp8",
            FusedPattern::ResidualRmsNormFp8Static => "residual_rmsnorm_fp8_static",
        }
    }

    /// Whether the pattern runs the residual add and the RMSNorm.
    pub const fn has_norm(self) -> bool {
        !matches!(self, FusedPattern::AllReduce)
    }

    /// The code the GPU kernels take (kernels-common/include/allreduce/fused.h).
    pub const fn code(self) -> u32 {
        match self {
            FusedPattern::AllReduce => 0,
            FusedPattern::ResidualRmsNorm => 1,
            FusedPattern::ResidualRmsNormFp8 => 2,
            FusedPattern::ResidualRmsNormFp8Static => 3,
        }
    }

    /// Whether the pattern writes FP8 codes (`quant_out`).
    pub const fn has_fp8(self) -> bool {
        matches!(
            self,
            FusedPattern::ResidualRmsNormFp8 | FusedPattern::ResidualRmsNormFp8Static
        )
    }
}

impl fmt::Display for FusedPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a fused workspace is created for (FlashInfer's
/// `trtllm_create_ipc_workspace_for_all_reduce_fusion(max_token_num, hidden_dim,
/// use_fp32_lamport)`). Calls beyond these sizes are refused with
/// [`Error::WorkspaceExceeded`].
#[derive(Clone, Debug, PartialEq)]
pub struct FusedConfig {
    pub max_tokens: usize,
    pub hidden: usize,
    pub dtype: DType,
    /// Lamport buffers hold f32 rather than T. Required for (and only for) f32 data: 16-bit
    /// data is accumulated in f32 whatever the buffers hold, so f32 buffers for it would only
    /// double the traffic.
    pub fp32_lamport: bool,
    /// The one-shot/two-shot switch of `Strategy::Auto`, over the per-rank message size in
    /// bytes (`tokens * hidden * dtype.size()`); `None` uses [`default_table`].
    pub selection: Option<SelectionTable>,
    /// Blocks per fused kernel launch; `None`: `ALLREDUCE_FUSED_BLOCKS` if set, else one block
    /// per SM (CU) for all the ranks of the busiest device together. A GPU workspace refuses
    /// more than that (the kernels fit two blocks per SM: one for the fused grids of all
    /// ranks, one for the group's other collective a rank may have moved on to, which polls
    /// too) or more than [`MAX_BLOCKS`]; the host backend runs no kernel and ignores it.
    pub blocks: Option<u32>,
    /// Programmatic dependent launch (CUDA sm_90+): each fused kernel may be scheduled while
    /// the stream's previous kernel finishes, and waits for it on the device. `None`:
    /// `ALLREDUCE_FUSED_PDL` (0 or 1) if set, else on where every device has it. The host
    /// backend and devices without it ignore it.
    pub pdl: Option<bool>,
}

/// Most blocks per fused launch (the per-block call state holds 64).
pub const MAX_BLOCKS: u32 = 64;

/// Largest hidden size the kernels keep in registers (one row per thread block, 512
/// threads, at most 4 vectors of 16 bytes per thread).
pub const MAX_HIDDEN_BYTES: usize = 512 * 4 * 16;

impl FusedConfig {
    pub fn new(max_tokens: usize, hidden: usize, dtype: DType) -> Self {
        FusedConfig {
            max_tokens,
            hidden,
            dtype,
            fp32_lamport: dtype == DType::F32,
            selection: None,
            blocks: None,
            pdl: None,
        }
    }

    pub fn blocks(mut self, blocks: u32) -> Self {
        self.blocks = Some(blocks);
        self
    }

    pub fn pdl(mut self, yes: bool) -> Self {
        self.pdl = Some(yes);
        self
    }

    pub fn fp32_lamport(mut self, yes: bool) -> Self {
        self.fp32_lamport = yes;
        self
    }

    pub fn selection(mut self, table: SelectionTable) -> Self {
        self.selection = Some(table);
        self
    }

    /// Elements per 16-byte vector of this dtype: `hidden` must be a multiple.
    pub fn vector_elems(&self) -> usize {
        16 / self.dtype.size()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(Error::InvalidConfig(format!("fused workspace: {s}")));
        if self.max_tokens == 0 || self.hidden == 0 {
            return bad("max_tokens and hidden must be positive".into());
        }
        if self.hidden % self.vector_elems() != 0 {
            return bad(format!(
                "hidden {} is not a multiple of {} ({} elements are one 16-byte vector)",
                self.hidden,
                self.vector_elems(),
                self.dtype
            ));
        }
        if self.hidden * self.dtype.size() > MAX_HIDDEN_BYTES {
            return bad(format!(
                "hidden {} {} is over the kernels' {} bytes per row",
                self.hidden, self.dtype, MAX_HIDDEN_BYTES
            ));
        }
        if self.fp32_lamport != (self.dtype == DType::F32) {
            return bad(format!(
                "fp32_lamport must be {} for {} data (f32 buffers carry f32 data; 16-bit data \
                 is accumulated in f32 either way)",
                self.dtype == DType::F32,
                self.dtype
            ));
        }
        if let Some(b) = self.blocks {
            if !(1..=MAX_BLOCKS).contains(&b) {
                return bad(format!("blocks {b}: want 1 to {MAX_BLOCKS}"));
            }
        }
        // Element offsets are 32-bit in the kernels.
        if self.max_tokens.saturating_mul(self.hidden) >= 1 << 31 {
            return bad("max_tokens * hidden must be below 2^31".into());
        }
        Ok(())
    }

    /// Bytes per Lamport element.
    pub fn lamport_elem(&self) -> usize {
        if self.fp32_lamport {
            4
        } else {
            self.dtype.size()
        }
    }
}

/// Sizes of one rank's fused workspace (FlashInfer's `create_metadata=True` dict).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedMetadata {
    pub rank: usize,
    pub world: usize,
    pub max_tokens: usize,
    pub hidden: usize,
    pub dtype: DType,
    pub fp32_lamport: bool,
    /// Bytes of one of the three Lamport buffers: `world` rank-indexed slots of
    /// `max_tokens * hidden` elements (one-shot pushes, two-shot reduce-scatter), one more
    /// (the two-shot's gathered rows), and [`TAG_BYTES`] of call tags (how ranks check that
    /// they agree on a call).
    pub lamport_comm_size: usize,
    /// `3 * lamport_comm_size`: the triple buffer.
    pub lamport_buffer_size: usize,
    /// Bytes of device-side call state (per-block call counters and the previous call's
    /// token count: what lets a captured graph replay).
    pub flag_size: usize,
    /// Everything this rank allocates for the workspace.
    pub buffer_size: usize,
    /// Blocks per fused kernel launch (the same on every rank); 0 where no kernel runs (the
    /// host backend's composed call).
    pub blocks: u32,
    /// The fused kernels are launched with programmatic dependent launch
    /// ([`FusedConfig::pdl`]); false where no kernel runs.
    pub pdl: bool,
}

/// Per-block state bytes (64 blocks x 16 bytes), mirrored by fused.h.
pub const FLAG_BYTES: usize = MAX_BLOCKS as usize * 16;

/// Call tags at the end of each Lamport buffer: one 16-byte tag per rank (8 at most), mirrored
/// by fused.h's `tags`.
pub const TAG_BYTES: usize = 8 * 16;

/// The pattern code a rank launches the fused kernel with, with no rows, when its own
/// arguments were refused (`FusedComm::reject`; fused.h's `kPatternRejected`): no call has it,
/// so its call tag differs from every peer's, and every rank skips the call.
pub const REJECTED_PATTERN_CODE: u64 = 0xf;

/// Whether a fused call descriptor (fused.h's `call_desc`) is a refusal's.
pub fn desc_is_rejection(d: u64) -> bool {
    (d >> 4) & 0xf == REJECTED_PATTERN_CODE
}

/// A fused call descriptor (fused.h's `call_desc`) as the [`crate::CallDesc`] it packs, or
/// `None` for a refusal's or a word no call makes.
pub fn call_desc_of(d: u64) -> Option<crate::CallDesc> {
    let dtype = *DType::ALL.get((((d >> 1) & 3) as usize).checked_sub(1)?)?;
    let pattern = *FusedPattern::ALL.get(((d >> 4) & 0xf) as usize)?;
    let strategy = if (d >> 3) & 1 == 1 {
        Strategy::TwoShot
    } else {
        Strategy::OneShot
    };
    let (tokens, hidden) = ((d >> 32) as usize, ((d >> 8) & 0xff_ffff) as usize);
    Some(crate::CallDesc {
        len: tokens * hidden,
        dtype,
        strategy,
        precision: crate::Precision::Exact,
        input: crate::InputPath::Staged,
        fused: Some(crate::FusedShape {
            tokens,
            hidden,
            pattern,
        }),
    })
}

/// The call descriptor the fused kernels exchange (fused.h's `call_desc`), in words: what a
/// `RankMismatch` from a fused call shows for each side.
pub fn describe_desc(d: u64) -> String {
    if desc_is_rejection(d) {
        return "a refusal of its arguments".into();
    }
    let dtype = match (d >> 1) & 3 {
        1 => "f32",
        2 => "f16",
        3 => "bf16",
        _ => "?",
    };
    let pattern = FusedPattern::ALL
        .get(((d >> 4) & 0xf) as usize)
        .map_or("?".to_string(), |p| p.to_string());
    let strategy = if (d >> 3) & 1 == 1 {
        "twoshot"
    } else {
        "oneshot"
    };
    format!(
        "{} tokens x {} {dtype}, {pattern}, {strategy}",
        d >> 32,
        (d >> 8) & 0xff_ffff
    )
}

impl FusedMetadata {
    pub fn new(config: &FusedConfig, rank: usize, world: usize) -> Self {
        let row = config.hidden * config.lamport_elem();
        let lamport_comm_size = (world + 1) * config.max_tokens * row + TAG_BYTES;
        FusedMetadata {
            rank,
            world,
            max_tokens: config.max_tokens,
            hidden: config.hidden,
            dtype: config.dtype,
            fp32_lamport: config.fp32_lamport,
            lamport_comm_size,
            lamport_buffer_size: 3 * lamport_comm_size,
            flag_size: FLAG_BYTES,
            buffer_size: 3 * lamport_comm_size + FLAG_BYTES,
            blocks: 0,
            pdl: false,
        }
    }
}

/// The default one-shot/two-shot switch over the per-rank bytes of a call (`tokens * hidden *
/// dtype.size()`). One-shot moves `world` times the message into every rank in one hop,
/// two-shot twice the message in two hops, so one-shot wins while latency dominates. Thresholds
/// measured on one H200 with virtual ranks (docs/history/benchmarks-2026-12.md, fused section:
/// the forced one-shot and two-shot columns of the kernels specialised per world size):
/// one-shot up to 512 KiB at 2 ranks, 256 KiB at 3-4, 64 KiB above (2 ranks: 1 MiB until the
/// two-shot pulled its reduced rows instead of pushing them; at 1 MiB it is now 1-3% faster, at
/// 512 KiB still 4% slower). A GPU workspace whose one-shot shares rows among cluster blocks
/// puts a rule in front of these ([`FusedComm::default_table`]). Virtual ranks share one GPU's
/// memory, which charges one-shot `world` times its real per-GPU traffic, so on distinct GPUs
/// the crossover is expected higher (TensorRT-LLM keeps one-shot up to 128 tokens); the
/// multi-GPU table waits for a multi-GPU machine to measure it on.
pub fn default_table() -> SelectionTable {
    const KIB: usize = 1 << 10;
    let rule = |world: (usize, usize), max_bytes, strategy| Rule {
        world,
        min_bytes: 0,
        max_bytes,
        dtype: None,
        lossy: None,
        codec: None,
        topology: None,
        strategy,
    };
    SelectionTable {
        rules: vec![
            rule((1, 1), usize::MAX, Strategy::OneShot),
            rule((2, 2), 512 * KIB, Strategy::OneShot),
            rule((3, 4), 256 * KIB, Strategy::OneShot),
            rule((5, usize::MAX), 64 * KIB, Strategy::OneShot),
        ],
        fallback: Strategy::TwoShot,
    }
}

/// A writable byte buffer for FP8 codes (one byte per element).
#[derive(Debug)]
pub struct Fp8BufMut<'a> {
    addr: usize,
    len: usize,
    device: Device,
    _borrow: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Fp8BufMut<'a> {
    pub fn from_slice(s: &'a mut [u8]) -> Self {
        Fp8BufMut {
            addr: s.as_mut_ptr() as usize,
            len: s.len(),
            device: Device::Host,
            _borrow: std::marker::PhantomData,
        }
    }

    /// # Safety
    /// `addr` must point to `len` writable bytes on `device` until every operation enqueued
    /// with this view has completed.
    pub unsafe fn from_raw(addr: usize, len: usize, device: Device) -> Self {
        Fp8BufMut {
            addr,
            len,
            device,
            _borrow: std::marker::PhantomData,
        }
    }

    /// Address, length in bytes, device.
    pub fn parts(&self) -> (usize, usize, Device) {
        (self.addr, self.len, self.device)
    }
}

/// One fused call's buffers and options (FlashInfer's `allreduce_fusion` arguments).
/// Rows are `hidden` elements of the workspace's dtype; `tokens` rows per buffer.
#[derive(Debug)]
pub struct FusedArgs<'a> {
    pub pattern: FusedPattern,
    pub tokens: usize,
    pub input: BufRef<'a>,
    pub allreduce_out: Option<BufMut<'a>>,
    pub residual_in: Option<BufRef<'a>>,
    pub residual_out: Option<BufMut<'a>>,
    pub norm_out: Option<BufMut<'a>>,
    /// FP8 E4M3 codes of the normalized rows, `tokens * hidden` bytes.
    pub quant_out: Option<Fp8BufMut<'a>>,
    /// One f32 per token: the dequantization scale (`value = code * scale`).
    pub scale_out: Option<BufMut<'a>>,
    /// One f32, the static dequantization scale (`ResidualRmsNormFp8Static`), on the
    /// communicator's device; read when the call runs, so a captured graph sees its value at
    /// each replay.
    pub scale_in: Option<BufRef<'a>>,
    /// `hidden` elements of the workspace's dtype.
    pub gamma: Option<BufRef<'a>>,
    pub eps: f32,
    /// Added to every gamma in f32 before it scales the normalized row (FlashInfer's
    /// `weight_bias`; Gemma's RMSNorm is `(1 + gamma)`, weight_bias 1). Finite; 0 by default.
    pub weight_bias: f32,
    /// `Auto` (the workspace's table), `OneShot` or `TwoShot`.
    pub strategy: Strategy,
    pub stream: Stream,
}

impl<'a> FusedArgs<'a> {
    pub fn new(pattern: FusedPattern, tokens: usize, input: BufRef<'a>) -> Self {
        FusedArgs {
            pattern,
            tokens,
            input,
            allreduce_out: None,
            residual_in: None,
            residual_out: None,
            norm_out: None,
            quant_out: None,
            scale_out: None,
            scale_in: None,
            gamma: None,
            eps: 1e-6,
            weight_bias: 0.0,
            strategy: Strategy::Auto,
            stream: Stream::NULL,
        }
    }

    /// Whichever pattern the outputs given so far ask for: FP8 codes with a static scale or
    /// with per-token scales, else a norm when `gamma` is given, else the all-reduce alone
    /// (FlashInfer infers its pattern from its arguments the same way). Call it last.
    pub fn infer_pattern(mut self) -> Self {
        self.pattern = match (&self.quant_out, &self.scale_in, &self.gamma) {
            (Some(_), Some(_), _) => FusedPattern::ResidualRmsNormFp8Static,
            (Some(_), None, _) => FusedPattern::ResidualRmsNormFp8,
            (None, _, Some(_)) => FusedPattern::ResidualRmsNorm,
            (None, _, None) => FusedPattern::AllReduce,
        };
        self
    }
    pub fn allreduce_out(mut self, b: BufMut<'a>) -> Self {
        self.allreduce_out = Some(b);
        self
    }
    pub fn residual(mut self, residual_in: BufRef<'a>, residual_out: Option<BufMut<'a>>) -> Self {
        self.residual_in = Some(residual_in);
        self.residual_out = residual_out;
        self
    }
    pub fn rms_norm(mut self, gamma: BufRef<'a>, eps: f32, norm_out: Option<BufMut<'a>>) -> Self {
        self.gamma = Some(gamma);
        self.eps = eps;
        self.norm_out = norm_out;
        self
    }
    pub fn fp8(mut self, quant_out: Fp8BufMut<'a>, scale_out: BufMut<'a>) -> Self {
        self.quant_out = Some(quant_out);
        self.scale_out = Some(scale_out);
        self
    }
    /// `gamma + bias` scales the normalized rows (see [`FusedArgs::weight_bias`]).
    pub fn weight_bias(mut self, bias: f32) -> Self {
        self.weight_bias = bias;
        self
    }
    /// FP8 codes at a static scale (`ResidualRmsNormFp8Static`): `scale` holds one f32.
    pub fn fp8_static(mut self, quant_out: Fp8BufMut<'a>, scale: BufRef<'a>) -> Self {
        self.quant_out = Some(quant_out);
        self.scale_in = Some(scale);
        self
    }
    pub fn strategy(mut self, s: Strategy) -> Self {
        self.strategy = s;
        self
    }
    pub fn stream(mut self, s: Stream) -> Self {
        self.stream = s;
        self
    }
}

/// A validated fused call; absent outputs are `None`, and `strategy` is concrete.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedCall {
    pub pattern: FusedPattern,
    pub tokens: usize,
    pub hidden: usize,
    pub dtype: DType,
    pub input: RawBuffer,
    pub allreduce_out: Option<RawBuffer>,
    pub residual_in: Option<RawBuffer>,
    pub residual_out: Option<RawBuffer>,
    pub norm_out: Option<RawBuffer>,
    /// Address and byte length.
    pub quant_out: Option<(usize, usize)>,
    pub scale_out: Option<RawBuffer>,
    pub scale_in: Option<RawBuffer>,
    pub gamma: Option<RawBuffer>,
    pub eps: f32,
    pub weight_bias: f32,
    pub strategy: Strategy,
    pub stream: Stream,
}

/// A backend's fused workspace for one rank (created for all ranks of a group at once).
pub trait FusedComm: Send + Sync {
    fn metadata(&self) -> &FusedMetadata;
    /// Whether a call runs as one fused kernel; false where the backend composes it from its
    /// all-reduce and [`epilogue`] (the host backend).
    fn is_fused(&self) -> bool {
        true
    }
    /// The workspace's `Strategy::Auto` table when the caller gives none, where the backend
    /// knows better than [`default_table`] (the GPU one-shot's cluster kernel); `None` for
    /// [`default_table`].
    fn default_table(&self) -> Option<SelectionTable> {
        None
    }
    /// Enqueue a validated call on `call.stream`. Device-side failures (a poll past its
    /// deadline) surface through the communicator's `synchronize`.
    fn run(&self, call: &FusedCall) -> Result<()>;
    /// This rank's part of the group's next fused call was refused before anything was
    /// enqueued (`reason`): take part in the call as a refusal, so every peer's matching fused
    /// call fails with `Error::PeerRejected` (carrying `reason`) instead of waiting out the
    /// deadline, and the workspace and the group stay usable. `stream` is the call's: GPU
    /// backends enqueue their part there, and their peers learn it at `synchronize`.
    fn reject(&self, reason: &Error, stream: Stream);
}

// ---- Host reference ----------------------------------------------------------------------

/// Outputs of the reference, each in its own dtype's bytes (little endian).
#[derive(Clone, Debug, PartialEq)]
pub struct FusedOutputs {
    pub allreduce: Vec<u8>,
    pub residual: Vec<u8>,
    pub norm: Vec<u8>,
    pub quant: Vec<u8>,
    pub scale: Vec<f32>,
}

/// Round to T and back, with -0.0 as +0.0 (see the module docs).
fn round_canonical(dtype: DType, v: f32) -> f32 {
    let r = match dtype {
        DType::F32 => v,
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
    };
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

/// The fused reference from every rank's input (`inputs[r]`: rank r's `tokens * hidden`
/// elements): the all-reduce as the exact path computes it (f32 in rank order from rank 0's
/// value, one rounding), then [`epilogue`].
#[allow(clippy::too_many_arguments)]
pub fn reference(
    inputs: &[&[u8]],
    dtype: DType,
    tokens: usize,
    hidden: usize,
    residual: Option<&[u8]>,
    gamma: Option<&[u8]>,
    eps: f32,
    pattern: FusedPattern,
    scale_in: Option<f32>,
    weight_bias: f32,
) -> FusedOutputs {
    let n = tokens * hidden;
    let mut sum = vec![0u8; n * dtype.size()];
    for i in 0..n {
        let mut acc = dtype.load_f32(inputs[0], i);
        for x in &inputs[1..] {
            acc += dtype.load_f32(x, i);
        }
        dtype.store_f32(&mut sum, i, acc);
    }
    epilogue(
        &sum,
        dtype,
        tokens,
        hidden,
        residual,
        gamma,
        eps,
        pattern,
        scale_in,
        weight_bias,
    )
}

/// Everything after the all-reduce, from its rounded output `summed`: what the host backend
/// runs after its exact all-reduce, and what the GPU kernels compute per row. `scale_in`:
/// the static FP8 scale of `ResidualRmsNormFp8Static` (the codes are taken at `1 / scale_in`,
/// one IEEE division, as in the kernels). No `residual`: the norm is of the all-reduce output.
#[allow(clippy::too_many_arguments)]
pub fn epilogue(
    summed: &[u8],
    dtype: DType,
    tokens: usize,
    hidden: usize,
    residual: Option<&[u8]>,
    gamma: Option<&[u8]>,
    eps: f32,
    pattern: FusedPattern,
    scale_in: Option<f32>,
    weight_bias: f32,
) -> FusedOutputs {
    let n = tokens * hidden;
    let size = dtype.size();
    let mut out = FusedOutputs {
        allreduce: vec![0u8; n * size],
        residual: Vec::new(),
        norm: Vec::new(),
        quant: Vec::new(),
        scale: Vec::new(),
    };
    for i in 0..n {
        let a = round_canonical(dtype, dtype.load_f32(summed, i));
        dtype.store_f32(&mut out.allreduce, i, a);
    }
    if !pattern.has_norm() {
        return out;
    }
    let gamma = gamma.expect("validated: gamma");
    if residual.is_some() {
        out.residual = vec![0u8; n * size];
    }
    out.norm = vec![0u8; n * size];
    let mut row = vec![0f32; hidden];
    for t in 0..tokens {
        let mut sum_sq = 0f32;
        for (i, r) in row.iter_mut().enumerate() {
            let k = t * hidden + i;
            *r = dtype.load_f32(&out.allreduce, k);
            if let Some(residual) = residual {
                dtype.store_f32(&mut out.residual, k, *r + dtype.load_f32(residual, k));
                *r = dtype.load_f32(&out.residual, k);
            }
            sum_sq += *r * *r;
        }
        let inv = 1.0 / (sum_sq / hidden as f32 + eps).sqrt();
        let mut amax = 0f32;
        for (i, &r) in row.iter().enumerate() {
            let k = t * hidden + i;
            dtype.store_f32(
                &mut out.norm,
                k,
                (r * inv) * weight(dtype.load_f32(gamma, i), weight_bias),
            );
            amax = amax.max(dtype.load_f32(&out.norm, k).abs());
        }
        if pattern.has_fp8() {
            let mul = if pattern == FusedPattern::ResidualRmsNormFp8Static {
                1.0 / scale_in.expect("validated: scale_in")
            } else {
                let (scale, mul) = fp8_scale(amax);
                out.scale.push(scale);
                mul
            };
            for i in 0..hidden {
                let k = t * hidden + i;
                out.quant
                    .push(f32_to_e4m3(dtype.load_f32(&out.norm, k) * mul));
            }
        }
    }
    out
}

/// A gamma with the weight bias added in f32; untouched when the bias is 0, so a gamma of -0.0
/// keeps its sign (and every call without a bias its bits), as in the kernels.
pub fn weight(gamma: f32, weight_bias: f32) -> f32 {
    if weight_bias == 0.0 {
        gamma
    } else {
        gamma + weight_bias
    }
}

/// (dequantization scale, quantization multiplier) for a row whose largest magnitude is
/// `amax`. The kernels compute the same two IEEE operations.
pub fn fp8_scale(amax: f32) -> (f32, f32) {
    if amax > 0.0 && amax.is_finite() {
        (amax / 448.0, 448.0 / amax)
    } else {
        (1.0, 1.0)
    }
}

/// The bound `norm_out` is held to against [`reference`]: one unit in the last place of T at
/// the reference value (the sum of squares is reduced in another order on the GPU, which can
/// move `inv` by an f32 ulp or two and the rounded result across one T boundary).
pub fn norm_tolerance(dtype: DType, reference: f32) -> f32 {
    (2.0 * dtype.unit_roundoff() * reference.abs() as f64 + dtype.min_subnormal()) as f32
}

#[cfg(test)]
mod tests;
