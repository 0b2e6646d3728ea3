//! The fused all-reduce + residual + RMSNorm (+ FP8) on host threads. Nothing is fused: the
//! rank runs its exact all-reduce, then core's [`epilogue`] on the summed rows, which is the
//! semantics every backend's fused call is specified by (`allreduce_core::fused`).
//!
//! A fused call is bounded by its workspace (`max_tokens x hidden`, checked by
//! `prepare_fused`), not by the group's `max_bytes`: the GPU's Lamport buffers are sized from
//! the workspace alone, and the host's shared buffers grow to whatever call they carry, so
//! the all-reduce runs in one piece of up to the workspace's size.

use allreduce_core::fused::{epilogue, FusedCall, FusedComm, FusedConfig, FusedMetadata};
use allreduce_core::{
    prepare, AllReduceOptions, BackendComm, BufMut, BufRef, CallDesc, Device, Error, HostBytes,
    Limits, RawBuffer, Result, Stream,
};

use crate::HostComm;

/// One rank's fused workspace: the rank itself (its all-reduce shares the rank's call
/// sequence) and the workspace's sizes.
pub(crate) struct HostFused {
    meta: FusedMetadata,
    comm: HostComm,
}

impl HostFused {
    pub(crate) fn new(config: &FusedConfig, comm: HostComm) -> Self {
        HostFused {
            meta: FusedMetadata::new(config, comm.rank, comm.group.world),
            comm,
        }
    }

    /// `summed = sum over ranks of call.input`, validated and agreed on among the ranks as a
    /// plain all-reduce is, except that `max_bytes` does not bound it (see the module docs).
    fn all_reduce(&self, call: &FusedCall, summed: RawBuffer) -> Result<()> {
        let comm = &self.comm;
        let limits = Limits {
            max_bytes: usize::MAX,
            ..comm.limits()
        };
        let options = AllReduceOptions::default()
            .strategy(call.strategy)
            .stream(call.stream);
        let n = call.tokens * call.hidden;
        // SAFETY: prepare_fused checked that these host views have the lengths and dtype
        // their callers' borrows (held by the caller's FusedArgs for this call) promise.
        let (input, output) = unsafe {
            (
                BufRef::from_raw(call.input.addr, n, call.dtype, Device::Host),
                BufMut::from_raw(summed.addr, n, call.dtype, Device::Host),
            )
        };
        let prepared = prepare(
            Some(input),
            &output,
            &options,
            &limits,
            comm.group.world,
            comm.selection(),
            |s, d, p| comm.strategy_available(s, d, p),
        );
        match prepared {
            // Described as the fused call it is, so ranks that differ in its pattern or shape
            // skip it together, as the GPU kernels' call tags make them.
            Ok(c) => comm.run_described(&c, CallDesc::fused(call)),
            Err(e) => {
                // The peers are in the same all-reduce: tell them rather than let them time out.
                comm.reject(&e, call.stream);
                Err(e)
            }
        }
    }
}

impl FusedComm for HostFused {
    fn metadata(&self) -> &FusedMetadata {
        &self.meta
    }

    fn is_fused(&self) -> bool {
        false
    }

    fn run(&self, call: &FusedCall) -> Result<()> {
        if call.input.device != Device::Host {
            let e = Error::StrategyUnavailable {
                strategy: call.strategy,
                reason: "the host backend's fused call runs on host memory only".into(),
            };
            self.reject(&e, call.stream);
            return Err(e);
        }
        let n = call.tokens * call.hidden;
        // Without an allreduce_out the sums are still needed, by the epilogue.
        let mut scratch = HostBytes::zeroed(if call.allreduce_out.is_some() {
            0
        } else {
            n * call.dtype.size()
        });
        let summed = call
            .allreduce_out
            .unwrap_or_else(|| scratch.view_mut(call.dtype).raw());
        self.all_reduce(call, summed)?;
        // SAFETY: prepare_fused checked every buffer's length, dtype and device, and that no
        // output overlaps another buffer except in place (allreduce_out = input,
        // residual_out = residual_in); the caller lends them all for the call. The epilogue
        // reads its inputs into owned outputs before anything is written back, so the in-place
        // pairs are safe.
        let out = unsafe {
            let bytes = |b: RawBuffer| std::slice::from_raw_parts(b.addr as *const u8, b.bytes());
            epilogue(
                bytes(summed),
                call.dtype,
                call.tokens,
                call.hidden,
                call.residual_in.map(bytes),
                call.gamma.map(bytes),
                call.eps,
                call.pattern,
                call.scale_in
                    .map(|b| (b.addr as *const f32).read_unaligned()),
                call.weight_bias,
            )
        };
        let scale: Vec<u8> = out.scale.iter().flat_map(|s| s.to_ne_bytes()).collect();
        let writes = [
            (call.allreduce_out.map(|b| b.addr), &out.allreduce[..]),
            (call.residual_out.map(|b| b.addr), &out.residual[..]),
            (call.norm_out.map(|b| b.addr), &out.norm[..]),
            (call.quant_out.map(|(addr, _)| addr), &out.quant[..]),
            (call.scale_out.map(|b| b.addr), &scale[..]),
        ];
        for (addr, src) in writes {
            if let Some(addr) = addr {
                // SAFETY: as above; each output holds exactly what the epilogue produced for
                // it (n elements, n FP8 codes, or one f32 per token).
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) };
            }
        }
        drop(scratch);
        Ok(())
    }

    /// The fused call's all-reduce is the rank's own, so the plain path's refusal tells the
    /// peers: they meet it at the same per-call agreement.
    fn reject(&self, reason: &Error, stream: Stream) {
        self.comm.reject(reason, stream);
    }
}

#[cfg(test)]
mod tests;
