//! The fused all-reduce + residual add + RMSNorm (+ FP8) on the facade: a [`FusedWorkspace`]
//! per rank, created for a whole group like FlashInfer's
//! `trtllm_create_ipc_workspace_for_all_reduce_fusion`, and
//! [`Communicator::all_reduce_fused`], FlashInfer's `allreduce_fusion(input, workspace,
//! pattern, ...)`. Semantics, tolerances and the host reference are core's
//! (`allreduce_core::fused`), re-exported here.
//!
//! ```
//! use allreduce::{
//!     BackendKind, BufMut, BufRef, Communicator, FusedArgs, FusedConfig, FusedWorkspace,
//!     FusedPattern, GroupConfig,
//! };
//!
//! let (tokens, hidden) = (2, 8);
//! let comms = Communicator::new_group(BackendKind::Host, GroupConfig::new(2)).unwrap();
//! let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(16, hidden, f32::DTYPE)).unwrap();
//! # use allreduce::Element;
//! std::thread::scope(|s| {
//!     for (comm, ws) in comms.iter().zip(&ws) {
//!         s.spawn(move || {
//!             let x = vec![1.0f32; tokens * hidden];
//!             let residual = vec![1.0f32; tokens * hidden];
//!             let gamma = vec![2.0f32; hidden];
//!             let (mut res_out, mut norm) = (vec![0f32; tokens * hidden], vec![0f32; tokens * hidden]);
//!             let args = FusedArgs::new(FusedPattern::ResidualRmsNorm, tokens, BufRef::from_slice(&x))
//!                 .residual(BufRef::from_slice(&residual), Some(BufMut::from_slice(&mut res_out)))
//!                 .rms_norm(BufRef::from_slice(&gamma), 0.0, Some(BufMut::from_slice(&mut norm)));
//!             comm.all_reduce_fused(ws, args).unwrap();
//!             assert!(res_out.iter().all(|&v| v == 3.0)); // 1 + 1 summed, + 1
//!             assert!(norm.iter().all(|&v| v == 2.0)); // 3 / rms(3) * 2
//!         });
//!     }
//! });
//! ```

pub use allreduce_core::fused::*;

use allreduce_core::{Error, Result, SelectionTable, Strategy, Stream};

use crate::Communicator;

/// One rank's fused workspace: Lamport buffers sized for `max_tokens x hidden` of one dtype
/// on GPU backends; on the host, which has no fused kernels, a rank that runs the all-reduce
/// and the epilogue one after the other.
pub struct FusedWorkspace {
    meta: FusedMetadata,
    table: SelectionTable,
    native: Option<Box<dyn FusedComm>>,
}

impl FusedWorkspace {
    /// Workspaces for every rank of the group `comms` (all of it, in rank order, as
    /// `Communicator::new_group` returned it); element r is rank r's.
    pub fn create_group(comms: &[Communicator], config: FusedConfig) -> Result<Vec<Self>> {
        config.validate()?;
        let world = comms.len();
        if world == 0
            || comms
                .iter()
                .enumerate()
                .any(|(r, c)| c.rank() != r || c.world_size() != world)
        {
            return Err(Error::InvalidConfig(
                "a fused workspace is created for a whole group: pass every rank's communicator, in rank order".into(),
            ));
        }
        let natives = comms[0].comm.create_fused_group(&config)?;
        // The caller's table, else the backend's (which knows its kernels), else the default.
        let table = config
            .selection
            .clone()
            .or_else(|| natives.as_ref()?.first()?.default_table())
            .unwrap_or_else(default_table);
        let mut natives: Vec<Option<Box<dyn FusedComm>>> = match natives {
            Some(v) => v.into_iter().map(Some).collect(),
            None => (0..world).map(|_| None).collect(),
        };
        Ok((0..world)
            .map(|r| FusedWorkspace {
                meta: natives[r]
                    .as_ref()
                    .map(|n| n.metadata().clone())
                    .unwrap_or_else(|| FusedMetadata::new(&config, r, world)),
                table: table.clone(),
                native: natives[r].take(),
            })
            .collect())
    }

    /// Sizes and shape (FlashInfer's workspace metadata).
    pub fn metadata(&self) -> &FusedMetadata {
        &self.meta
    }

    /// Whether calls run as one fused kernel (otherwise: all-reduce, then the epilogue).
    pub fn is_fused(&self) -> bool {
        self.native.as_ref().is_some_and(|n| n.is_fused())
    }
}

impl std::fmt::Debug for FusedWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedWorkspace")
            .field("meta", &self.meta)
            .field("fused", &self.is_fused())
            .finish()
    }
}

impl Communicator {
    /// `allreduce_out = sum over ranks of input`, then, by `args.pattern`,
    /// `residual_out = allreduce_out + residual_in`, `norm_out = RMSNorm(residual_out) * gamma`
    /// and FP8 codes of `norm_out` with a scale per token. `ws` is this rank's workspace.
    /// Returns the strategy that ran.
    ///
    /// Arguments the workspace cannot take (more tokens than `max_tokens`, a buffer missing
    /// for the pattern, a wrong size, device or alignment) are refused before anything is
    /// enqueued: this rank gets the error, and every peer's matching fused call fails with
    /// `Error::PeerRejected` naming this rank and carrying the same reason (on the host at
    /// once; on GPU backends at the peer's next `synchronize`, since its call was enqueued)
    /// instead of waiting for the deadline. Every rank skips that call; the group and the
    /// workspace stay usable, and the next calls, fused or plain, are exact. Ranks that call
    /// with different shapes, patterns or strategies all get `Error::RankMismatch` and stay
    /// usable likewise. The one refusal the peers are not told of is a workspace of another
    /// rank (nothing of this rank's to tell them through): they time out.
    pub fn all_reduce_fused(&self, ws: &FusedWorkspace, args: FusedArgs<'_>) -> Result<Strategy> {
        let comm = &*self.comm;
        if ws.meta.rank != comm.rank() || ws.meta.world != comm.world_size() {
            return Err(Error::InvalidArgument(format!(
                "workspace of rank {} of {} used by rank {} of {}",
                ws.meta.rank,
                ws.meta.world,
                comm.rank(),
                comm.world_size()
            )));
        }
        let limits = comm.limits();
        let call = match prepare_fused(&args, &ws.meta, &ws.table, limits.device, limits.align) {
            Ok(call) => call,
            Err(e) => {
                tracing::debug!(rank = comm.rank(), error = %e, "fused call rejected");
                if let Some(n) = &ws.native {
                    n.reject(&e, args.stream);
                }
                return Err(e);
            }
        };
        let _span = tracing::debug_span!(
            "all_reduce_fused",
            rank = comm.rank(),
            tokens = call.tokens,
            pattern = %call.pattern,
            strategy = %call.strategy,
        )
        .entered();
        match &ws.native {
            Some(n) => n.run(&call)?,
            None => {
                return Err(Error::StrategyUnavailable {
                    strategy: call.strategy,
                    reason: format!("the {} backend has no fused all-reduce", self.backend),
                })
            }
        }
        Ok(call.strategy)
    }

    /// Refuse this rank's part of the group's next fused call on `ws` for a reason found
    /// before the call could be built (a language binding's own checks: a pattern code that
    /// names nothing, a null pointer), the way [`Communicator::all_reduce_fused`] refuses
    /// arguments it checks itself: every peer's matching fused call fails with
    /// `Error::PeerRejected` carrying `reason`, and the group and the workspace stay usable.
    /// Call it where this rank would have called `all_reduce_fused`, with that call's stream.
    /// A workspace of another rank is refused with `Error::InvalidArgument` and tells nobody.
    pub fn reject_fused(&self, ws: &FusedWorkspace, reason: &Error, stream: Stream) -> Result<()> {
        if ws.meta.rank != self.rank() || ws.meta.world != self.world_size() {
            return Err(Error::InvalidArgument(format!(
                "workspace of rank {} of {} used by rank {} of {}",
                ws.meta.rank,
                ws.meta.world,
                self.rank(),
                self.world_size()
            )));
        }
        tracing::debug!(rank = self.rank(), error = %reason, "fused call rejected by the caller");
        if let Some(n) = &ws.native {
            n.reject(reason, stream);
        }
        Ok(())
    }
}
