//! The fused all-reduce + residual add + RMSNorm (+ FP8): workspaces for a whole in-process
//! group (FlashInfer's `trtllm_create_ipc_workspace_for_all_reduce_fusion`) and the call
//! (FlashInfer's `allreduce_fusion`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use allreduce::{
    BufMut, BufRef, DType, Device, Error, Fp8BufMut, FusedArgs, FusedConfig, FusedPattern,
    FusedWorkspace, Stream,
};

use crate::args;
use crate::call::{self, Failure};
use crate::codes::ar_result_t;
use crate::handle::{self, ar_comm_t, ar_fused_workspace_t, WorkspaceRef};

/// What a fused call computes after the all-reduce (TensorRT-LLM's / FlashInfer's
/// `AllReduceFusionPattern`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ar_fused_pattern_t {
    /// Only the all-reduce (`allreduce_out` required).
    AR_FUSED_ALLREDUCE = 0,
    /// All-reduce, residual add, RMSNorm (`gamma`, `norm_out` required; `residual_in`
    /// optional: without it the norm is of the all-reduce output, and `residual_out` must be
    /// null).
    AR_FUSED_RESIDUAL_RMSNORM = 1,
    /// As above, plus FP8 E4M3 codes of the normalized rows with one f32 scale per token
    /// (`quant_out`, `scale_out` required; `norm_out` optional).
    AR_FUSED_RESIDUAL_RMSNORM_FP8 = 2,
    /// As above at the caller's static scale, one f32 read from `scale_in` when the call runs
    /// (`quant_out`, `scale_in` required; `norm_out` optional).
    AR_FUSED_RESIDUAL_RMSNORM_FP8_STATIC = 3,
}

/// One fused call's buffers. Zero-initialise it, set `size` to `sizeof(ar_fused_args_t)`,
/// and set the buffers the pattern uses; NULL means absent. Row buffers hold `tokens *
/// hidden` elements of the workspace's dtype; `gamma` holds `hidden`; `quant_out` holds
/// `tokens * hidden` bytes; `scale_out` `tokens` floats; `scale_in` one float. All on this
/// rank's device, 16-byte aligned.
#[repr(C)]
pub struct ar_fused_args_t {
    /// `sizeof(ar_fused_args_t)` as the caller's header declares it.
    pub size: usize,
    /// An `ar_fused_pattern_t`.
    pub pattern: c_int,
    /// An `ar_strategy_t`: `AR_STRATEGY_AUTO`, `AR_STRATEGY_ONESHOT` or
    /// `AR_STRATEGY_TWOSHOT`.
    pub strategy: c_int,
    /// Rows in this call, at most the workspace's `max_tokens`.
    pub tokens: usize,
    pub input: *const c_void,
    pub allreduce_out: *mut c_void,
    pub residual_in: *const c_void,
    pub residual_out: *mut c_void,
    pub gamma: *const c_void,
    pub norm_out: *mut c_void,
    pub quant_out: *mut c_void,
    pub scale_out: *mut c_void,
    pub scale_in: *const c_void,
    /// The RMSNorm's epsilon.
    pub eps: f32,
    /// Added to every gamma before it scales the normalized rows (FlashInfer's
    /// `weight_bias`; 1 for Gemma's `(1 + gamma)`); 0 for none. Finite.
    pub weight_bias: f32,
}

fn pattern(code: c_int) -> Result<FusedPattern, Error> {
    FusedPattern::ALL
        .into_iter()
        .find(|p| i64::from(p.code()) == i64::from(code))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "fused pattern {code} is not one of the ar_fused_pattern_t values 0 to 3"
            ))
        })
}

/// Create one fused workspace per rank of an in-process group: `comms` are the handles
/// `ar_comm_init_all` wrote (all of them, in rank order), and `workspaces[r]` receives rank
/// r's. Calls may then carry up to `max_tokens` rows of `hidden` elements of `dtype` (an
/// `ar_dtype_t`). Groups of one process per rank are refused (`AR_INVALID_CONFIG`). Nothing
/// is written to `workspaces` on failure.
///
/// Thread-safe, but it is collective: no rank of the group may be in a call meanwhile.
///
/// # Safety
/// `workspaces` points to `nranks` writable handles; `comms` to `nranks` readable ones.
#[no_mangle]
pub unsafe extern "C" fn ar_fused_workspace_create(
    workspaces: *mut ar_fused_workspace_t,
    comms: *const ar_comm_t,
    nranks: c_int,
    max_tokens: usize,
    hidden: usize,
    dtype: c_int,
) -> ar_result_t {
    call::run(|| {
        if workspaces.is_null() || comms.is_null() {
            return Err(Failure::usage("workspaces or comms is null"));
        }
        let n = args::index("nranks", nranks)?;
        let dtype = args::dtype(dtype)?;
        let first = handle::comm(if n > 0 {
            // SAFETY: the caller promises `nranks` readable handles.
            unsafe { comms.read() }
        } else {
            std::ptr::null_mut()
        })?;
        let group = Arc::clone(&first.group);
        if n != group.comms.len() {
            return Err(Error::InvalidConfig(format!(
                "a fused workspace is created for a whole in-process group: {n} handles for a \
                 group of {} built in this process (groups of one process per rank have none)",
                group.comms.len()
            ))
            .into());
        }
        for r in 0..n {
            // SAFETY: as above.
            let c = handle::comm(unsafe { comms.add(r).read() })?;
            if !Arc::ptr_eq(&c.group, &group) || c.index != r {
                return Err(Error::InvalidArgument(format!(
                    "comms[{r}] is not rank {r} of the group of comms[0]"
                ))
                .into());
            }
        }
        let config = FusedConfig::new(max_tokens, hidden, dtype);
        let created = FusedWorkspace::create_group(&group.comms, config)?;
        for (r, ws) in created.into_iter().enumerate() {
            let h = handle::insert_workspace(WorkspaceRef {
                group: Arc::clone(&group),
                rank: r,
                workspace: Arc::new(ws),
            });
            // SAFETY: `workspaces` holds `nranks` writable handles.
            unsafe { workspaces.add(r).write(h) };
        }
        Ok(())
    })
}

/// Release one rank's fused workspace; the handle is invalid afterwards. A call running on
/// another thread with it completes first. On a GPU, synchronize the streams of its calls
/// first. Thread-safe.
#[no_mangle]
pub extern "C" fn ar_fused_workspace_destroy(workspace: ar_fused_workspace_t) -> ar_result_t {
    call::run(|| handle::remove_workspace(workspace))
}

/// The fused call on this rank (FlashInfer's `allreduce_fusion`): `allreduce_out = sum over
/// ranks of input`, then by pattern `residual_out = allreduce_out + residual_in`, `norm_out
/// = RMSNorm(residual_out) * gamma`, and FP8 codes of `norm_out`. `workspace` is this rank's
/// (from the same group as `comm`), `stream` as in `ar_all_reduce`. Arguments this library
/// or the workspace cannot take are refused before anything is enqueued, and, as with
/// `ar_all_reduce`, the peers are told: their matching fused call fails with
/// `AR_PEER_REJECTED` (at once on the host, at their next `ar_comm_synchronize` on a GPU)
/// instead of waiting out the deadline, and the group and the workspace stay usable. A
/// workspace of another rank or group is refused without telling anyone.
///
/// Thread safety: as `ar_all_reduce`.
///
/// # Safety
/// `args` points to an `ar_fused_args_t` whose non-NULL buffers are valid for the sizes
/// above until the call's work on `stream` has completed.
#[no_mangle]
pub unsafe extern "C" fn ar_all_reduce_fused(
    args: *const ar_fused_args_t,
    workspace: ar_fused_workspace_t,
    comm: ar_comm_t,
    stream: *mut c_void,
) -> ar_result_t {
    call::run(|| {
        let (found, ws) = comm_and_workspace(comm, workspace)?;
        let stream = Stream::from_raw(stream);
        // SAFETY: the caller's promise, passed on.
        let checked = unsafe { build(args, &ws.workspace, found.comm().device(), stream) };
        let call = checked.map_err(|(failure, reason)| {
            // The facade never saw this call, so tell the peers as it would have.
            let _ = found.comm().reject_fused(&ws.workspace, &reason, stream);
            failure
        })?;
        found.comm().all_reduce_fused(&ws.workspace, call)?;
        Ok(())
    })
}

/// Refuse this rank's part of the group's next fused call on `workspace` for `reason` (a
/// binding's own argument checks, made before it could call `ar_all_reduce_fused`): every
/// peer's matching fused call fails with `AR_PEER_REJECTED` carrying `reason` (at once on
/// the host, at its next `ar_comm_synchronize` on a GPU) instead of waiting out the
/// deadline, and the group and the workspace stay usable. Call it where this rank would have
/// called `ar_all_reduce_fused`, on that call's stream. `reason` is NULL (an unnamed
/// refusal) or a NUL-terminated string.
///
/// Thread safety: as `ar_all_reduce_fused`.
///
/// # Safety
/// `reason` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ar_fused_reject(
    reason: *const c_char,
    workspace: ar_fused_workspace_t,
    comm: ar_comm_t,
    stream: *mut c_void,
) -> ar_result_t {
    call::run(|| {
        let (found, ws) = comm_and_workspace(comm, workspace)?;
        let text = if reason.is_null() {
            "the caller refused its arguments".to_string()
        } else {
            // SAFETY: the caller's promise.
            unsafe { CStr::from_ptr(reason) }
                .to_string_lossy()
                .into_owned()
        };
        found.comm().reject_fused(
            &ws.workspace,
            &Error::InvalidArgument(text),
            Stream::from_raw(stream),
        )?;
        Ok(())
    })
}

/// A refusal by this library's own checks: the C result, and the reason the peers get.
type Refusal = (Failure, Error);

fn refused(e: Error) -> Refusal {
    (e.clone().into(), e)
}

fn usage(message: String) -> Refusal {
    (
        Failure::usage(message.clone()),
        Error::InvalidArgument(message),
    )
}

/// The facade's arguments from the caller's struct, or why there are none.
///
/// # Safety
/// As `ar_all_reduce_fused`'s `args`.
unsafe fn build<'a>(
    args: *const ar_fused_args_t,
    ws: &FusedWorkspace,
    device: Device,
    stream: Stream,
) -> Result<FusedArgs<'a>, Refusal> {
    if args.is_null() {
        return Err(usage("args is null".into()));
    }
    // SAFETY: non-null; the caller promises the leading `size` is readable.
    let size = unsafe { std::ptr::addr_of!((*args).size).read_unaligned() };
    if size != std::mem::size_of::<ar_fused_args_t>() {
        return Err(usage(format!(
            "ar_fused_args_t.size is {size}, this library's sizeof(ar_fused_args_t) is {}",
            std::mem::size_of::<ar_fused_args_t>()
        )));
    }
    // SAFETY: the caller's struct has this library's size and layout.
    let a = unsafe { args.read_unaligned() };
    let pattern = pattern(a.pattern).map_err(refused)?;
    let strategy = args::strategy(a.strategy).map_err(refused)?;
    let meta = ws.metadata();
    let views = Views {
        device,
        dtype: meta.dtype,
        rows: a.tokens.checked_mul(meta.hidden).ok_or_else(|| {
            refused(Error::InvalidArgument(format!(
                "tokens {} x hidden overflows",
                a.tokens
            )))
        })?,
    };
    if a.input.is_null() && views.rows > 0 {
        return Err(refused(Error::InvalidArgument("input is null".into())));
    }
    // SAFETY (every view below): the caller promises each non-null buffer holds the
    // documented size on this rank's device until the call's work has completed; the
    // facade checks sizes against the workspace, alignment and overlaps first.
    let mut call = unsafe {
        FusedArgs::new(
            pattern,
            a.tokens,
            views.read(a.input, views.rows, views.dtype),
        )
    };
    call.strategy = strategy;
    call.stream = stream;
    call.eps = a.eps;
    call.weight_bias = a.weight_bias;
    // SAFETY: as above.
    unsafe {
        call.allreduce_out = views.write(a.allreduce_out, views.rows, views.dtype);
        call.residual_in = views.maybe_read(a.residual_in, views.rows, views.dtype);
        call.residual_out = views.write(a.residual_out, views.rows, views.dtype);
        call.gamma = views.maybe_read(a.gamma, meta.hidden, views.dtype);
        call.norm_out = views.write(a.norm_out, views.rows, views.dtype);
        call.scale_out = views.write(a.scale_out, a.tokens, DType::F32);
        call.scale_in = views.maybe_read(a.scale_in, 1, DType::F32);
        call.quant_out = (!a.quant_out.is_null())
            .then(|| Fp8BufMut::from_raw(a.quant_out as usize, views.rows, views.device));
    }
    Ok(call)
}

/// Builds the facade's views of one call's raw pointers.
struct Views {
    device: Device,
    dtype: DType,
    rows: usize,
}

impl Views {
    /// # Safety
    /// `p` holds `len` readable elements of `dtype` on `self.device` for the call.
    unsafe fn read<'a>(&self, p: *const c_void, len: usize, dtype: DType) -> BufRef<'a> {
        // SAFETY: the caller's promise.
        unsafe { BufRef::from_raw(p as usize, len, dtype, self.device) }
    }

    /// # Safety
    /// As `read`, where `p` is not null.
    unsafe fn maybe_read<'a>(
        &self,
        p: *const c_void,
        len: usize,
        dtype: DType,
    ) -> Option<BufRef<'a>> {
        // SAFETY: the caller's promise.
        (!p.is_null()).then(|| unsafe { self.read(p, len, dtype) })
    }

    /// # Safety
    /// Where `p` is not null, it holds `len` writable elements of `dtype` on `self.device`,
    /// aliased by nothing else, for the call.
    unsafe fn write<'a>(&self, p: *mut c_void, len: usize, dtype: DType) -> Option<BufMut<'a>> {
        // SAFETY: the caller's promise.
        (!p.is_null()).then(|| unsafe { BufMut::from_raw(p as usize, len, dtype, self.device) })
    }
}

/// `comm` and `workspace` looked up, with the workspace checked to be this rank's of the same
/// group: a fused call or refusal on another rank's workspace would wait on the wrong peers.
fn comm_and_workspace(
    comm: ar_comm_t,
    workspace: ar_fused_workspace_t,
) -> Result<(handle::CommRef, WorkspaceRef), Failure> {
    let found = handle::comm(comm)?;
    let ws = handle::workspace(workspace)?;
    if !Arc::ptr_eq(&found.group, &ws.group) || found.index != ws.rank {
        return Err(Error::InvalidArgument(format!(
            "the workspace is rank {}'s of another group or rank than comm (rank {})",
            ws.rank,
            found.comm().rank()
        ))
        .into());
    }
    Ok((found, ws))
}
