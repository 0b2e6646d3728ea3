//! Validation of one fused call against its workspace ([`prepare_fused`]), in the steps a
//! call is checked in: its size, each buffer, what its pattern needs and refuses, its eps,
//! the overlaps among its buffers, and the strategy. The first failing step's error is the
//! call's.

use crate::{
    BufMut, BufRef, DType, Device, Error, Precision, RawBuffer, Result, SelectionTable, Strategy,
};

use super::{Fp8BufMut, FusedArgs, FusedCall, FusedMetadata, FusedPattern};

/// Validate `args` against the workspace `meta`; resolve `Auto` through `table`.
/// `device` and `align` are the communicator's.
pub fn prepare_fused(
    args: &FusedArgs<'_>,
    meta: &FusedMetadata,
    table: &SelectionTable,
    device: Device,
    align: usize,
) -> Result<FusedCall> {
    check_tokens(args.tokens, meta)?;
    let shape = Shape {
        tokens: args.tokens,
        hidden: meta.hidden,
        dtype: meta.dtype,
        device,
        align,
    };
    let call = shape.call(args)?;
    check_pattern_needs(&call)?;
    check_pattern_uses(&call)?;
    check_eps(call.eps, call.weight_bias)?;
    check_overlaps(&call, device)?;
    let strategy = choose_strategy(&call, meta.world, table)?;
    Ok(FusedCall { strategy, ..call })
}

fn check_tokens(tokens: usize, meta: &FusedMetadata) -> Result<()> {
    if tokens > meta.max_tokens {
        return Err(Error::WorkspaceExceeded {
            what: "tokens",
            requested: tokens,
            max: meta.max_tokens,
        });
    }
    Ok(())
}

/// What every buffer of one call is checked against.
struct Shape {
    tokens: usize,
    hidden: usize,
    dtype: DType,
    device: Device,
    align: usize,
}

impl Shape {
    fn elems(&self) -> usize {
        self.tokens * self.hidden
    }

    /// Each buffer checked, in argument order; the strategy is still the requested one.
    fn call(&self, args: &FusedArgs<'_>) -> Result<FusedCall> {
        let (elems, dtype) = (self.elems(), self.dtype);
        let input = self.buffer("input", args.input.raw(), elems, dtype)?;
        let rows = |name, b: &Option<BufMut<'_>>| {
            b.as_ref()
                .map(|b| self.buffer(name, b.raw(), elems, dtype))
                .transpose()
        };
        let read = |name, b: &Option<BufRef<'_>>, len, dt| {
            b.as_ref()
                .map(|b| self.buffer(name, b.raw(), len, dt))
                .transpose()
        };
        let allreduce_out = rows("allreduce_out", &args.allreduce_out)?;
        let residual_out = rows("residual_out", &args.residual_out)?;
        let norm_out = rows("norm_out", &args.norm_out)?;
        let residual_in = read("residual_in", &args.residual_in, elems, dtype)?;
        let gamma = read("gamma", &args.gamma, self.hidden, dtype)?;
        let scale_out = args
            .scale_out
            .as_ref()
            .map(|b| self.buffer("scale_out", b.raw(), self.tokens, DType::F32))
            .transpose()?;
        let scale_in = args
            .scale_in
            .as_ref()
            .map(|b| self.scale_in(b.raw()))
            .transpose()?;
        let quant_out = args
            .quant_out
            .as_ref()
            .map(|q| self.quant_out(q))
            .transpose()?;
        Ok(FusedCall {
            pattern: args.pattern,
            tokens: self.tokens,
            hidden: self.hidden,
            dtype,
            input,
            allreduce_out,
            residual_in,
            residual_out,
            norm_out,
            quant_out,
            scale_out,
            scale_in,
            gamma,
            eps: args.eps,
            weight_bias: args.weight_bias,
            strategy: args.strategy,
            stream: args.stream,
        })
    }

    /// A buffer of `len` elements of `dt` on the communicator's device, aligned as its
    /// buffers must be.
    fn buffer(&self, name: &str, b: RawBuffer, len: usize, dt: DType) -> Result<RawBuffer> {
        let (tokens, hidden) = (self.tokens, self.hidden);
        if b.dtype != dt {
            return Err(Error::InvalidArgument(format!(
                "{name} is {} but the fused workspace is for {dt}",
                b.dtype
            )));
        }
        if b.len != len {
            return Err(Error::InvalidArgument(format!(
                "{name} has {} elements, expected {len} ({tokens} tokens x hidden {hidden})",
                b.len
            )));
        }
        self.on_device(b.device)?;
        if len > 0 && b.addr % self.align != 0 {
            return Err(Error::Misaligned {
                addr: b.addr,
                align: self.align,
            });
        }
        Ok(b)
    }

    /// One f32, read by every block: f32 alignment is enough.
    fn scale_in(&self, b: RawBuffer) -> Result<RawBuffer> {
        if b.dtype != DType::F32 || b.len != 1 {
            return Err(Error::InvalidArgument(format!(
                "scale_in must be one f32, not {} x {}",
                b.len, b.dtype
            )));
        }
        self.on_device(b.device)?;
        if b.addr % 4 != 0 {
            return Err(Error::Misaligned {
                addr: b.addr,
                align: 4,
            });
        }
        Ok(b)
    }

    /// One FP8 code per element: address and byte length.
    fn quant_out(&self, q: &Fp8BufMut<'_>) -> Result<(usize, usize)> {
        let (addr, len, dev) = q.parts();
        let elems = self.elems();
        if len != elems {
            return Err(Error::InvalidArgument(format!(
                "quant_out has {len} bytes, expected {elems} (one FP8 code per element)"
            )));
        }
        self.on_device(dev)?;
        if len > 0 && addr % self.align != 0 {
            return Err(Error::Misaligned {
                addr,
                align: self.align,
            });
        }
        Ok((addr, len))
    }

    fn on_device(&self, buffer: Device) -> Result<()> {
        if buffer != self.device {
            return Err(Error::WrongDevice {
                buffer,
                comm: self.device,
            });
        }
        Ok(())
    }
}

/// The buffers the pattern reads or writes are all there.
fn check_pattern_needs(call: &FusedCall) -> Result<()> {
    let need = |what: &str, present: bool| -> Result<()> {
        if present {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "pattern {} needs {what}",
                call.pattern
            )))
        }
    };
    match call.pattern {
        FusedPattern::AllReduce => need("allreduce_out", call.allreduce_out.is_some())?,
        FusedPattern::ResidualRmsNorm => {
            need("gamma", call.gamma.is_some())?;
            need("norm_out", call.norm_out.is_some())?;
        }
        FusedPattern::ResidualRmsNormFp8 => {
            need("gamma", call.gamma.is_some())?;
            need("quant_out", call.quant_out.is_some())?;
            need("scale_out", call.scale_out.is_some())?;
        }
        FusedPattern::ResidualRmsNormFp8Static => {
            need("gamma", call.gamma.is_some())?;
            need("quant_out", call.quant_out.is_some())?;
            need("scale_in", call.scale_in.is_some())?;
        }
    }
    Ok(())
}

/// What a pattern does not use is refused rather than ignored: a caller who passes it
/// expects it to be read or written.
fn check_pattern_uses(call: &FusedCall) -> Result<()> {
    let pattern = call.pattern;
    if pattern != FusedPattern::ResidualRmsNormFp8 && call.scale_out.is_some() {
        return Err(Error::InvalidArgument(format!(
            "pattern {pattern} writes no scale_out"
        )));
    }
    if pattern != FusedPattern::ResidualRmsNormFp8Static && call.scale_in.is_some() {
        return Err(Error::InvalidArgument(format!(
            "pattern {pattern} reads no scale_in"
        )));
    }
    if !pattern.has_norm()
        && (call.residual_out.is_some() || call.norm_out.is_some() || call.quant_out.is_some())
    {
        return Err(Error::InvalidArgument(
            "pattern allreduce writes only allreduce_out".into(),
        ));
    }
    if call.residual_out.is_some() && call.residual_in.is_none() {
        return Err(Error::InvalidArgument(
            "residual_out needs residual_in (without a residual the norm is of the all-reduce \
             output, which allreduce_out holds)"
                .into(),
        ));
    }
    if !pattern.has_norm() && call.weight_bias != 0.0 {
        return Err(Error::InvalidArgument(
            "pattern allreduce has no norm for a weight_bias".into(),
        ));
    }
    if !pattern.has_fp8() && call.quant_out.is_some() {
        return Err(Error::InvalidArgument(format!(
            "pattern {pattern} writes no quant_out"
        )));
    }
    Ok(())
}

fn check_eps(eps: f32, weight_bias: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "eps must be finite and non-negative, not {eps}"
        )));
    }
    if !weight_bias.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "weight_bias must be finite, not {weight_bias}"
        )));
    }
    Ok(())
}

/// Outputs must not overlap each other or the inputs, except in place: allreduce_out may be
/// the input, and residual_out may be residual_in (vLLM's fused_add_rms_norm updates the
/// residual in place). Both are safe in the kernels: an input row is pushed to the peers
/// before any rank can finish that row, and the residual row is read and written by the same
/// threads.
fn check_overlaps(call: &FusedCall, device: Device) -> Result<()> {
    let (input, residual_in) = (call.input, call.residual_in);
    let same = |a: RawBuffer, b: Option<RawBuffer>| b.is_some_and(|b| b == a);
    let reads = [Some(input), residual_in, call.gamma, call.scale_in];
    let writes = [
        call.allreduce_out,
        call.residual_out,
        call.norm_out,
        call.scale_out,
        call.quant_out.map(|(addr, len)| RawBuffer {
            addr,
            len: len.div_ceil(4),
            dtype: DType::F32,
            device,
        }),
    ];
    for (i, w) in writes.iter().enumerate() {
        let Some(w) = *w else { continue };
        let in_place = |r: &RawBuffer| {
            (i == 0 && *r == input && same(w, Some(input)))
                || (i == 1 && same(w, residual_in) && Some(*r) == residual_in)
        };
        let clash = reads
            .iter()
            .flatten()
            .any(|r| r.overlaps(&w) && !in_place(r))
            || writes[i + 1..].iter().flatten().any(|o| o.overlaps(&w));
        if clash {
            return Err(Error::InvalidArgument(
                "fused outputs must not overlap each other or the inputs (in place: \
                 allreduce_out = input, residual_out = residual_in)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// The requested strategy, or `Auto` resolved through `table` over the per-rank bytes.
fn choose_strategy(call: &FusedCall, world: usize, table: &SelectionTable) -> Result<Strategy> {
    match call.strategy {
        Strategy::Auto => {
            if call.tokens < world {
                // Two-shot splits rows among ranks: with fewer rows than ranks it cannot.
                Ok(Strategy::OneShot)
            } else {
                Ok(table.choose(
                    call.tokens * call.hidden * call.dtype.size(),
                    world,
                    call.dtype,
                    Precision::Exact,
                    |s| matches!(s, Strategy::OneShot | Strategy::TwoShot),
                ))
            }
        }
        s @ (Strategy::OneShot | Strategy::TwoShot) => Ok(s),
        s => Err(Error::StrategyUnavailable {
            strategy: s,
            reason: "the fused call runs oneshot or twoshot".into(),
        }),
    }
}
