//! What the suite needs from a backend: a group, and a way to run a sequence of calls with
//! host-side inputs and read the outputs back. The host harness is here; a GPU backend adds
//! one that allocates device memory, uploads, enqueues, synchronizes and downloads.

use allreduce::{
    AllReduceOptions, BackendKind, BufMut, BufRef, Communicator, DType, Device, FusedArgs,
    FusedPattern, FusedWorkspace, GroupConfig, HostBytes, Result, Strategy,
};

/// One rank's part of one call.
#[derive(Clone, Debug)]
pub struct RankArgs {
    pub input: HostBytes,
    pub dtype: DType,
    /// Output element count and dtype (differ from the input's only in bad-input tests).
    pub out_len: usize,
    pub out_dtype: DType,
    pub in_place: bool,
    pub options: AllReduceOptions,
    /// Sleep this long before the call (a late rank).
    pub delay: std::time::Duration,
    /// Do not make the call at all (a rank that never arrives).
    pub skip: bool,
    /// Place the input this many bytes past an aligned address (a misaligned buffer).
    pub misalign: usize,
    /// Wait for the call to finish before the next one (GPU harnesses otherwise enqueue a
    /// whole sequence with no synchronisation in between, and wait once at the end).
    pub sync_after: bool,
    /// Place the input in memory every rank registered ([`Communicator::alloc_registered_group`])
    /// this many bytes past the start of the step's own region of it (out of place only).
    /// Every step has its own region, filled before the sequence starts.
    pub registered: Option<usize>,
}

impl RankArgs {
    pub fn new(input: HostBytes, dtype: DType, in_place: bool, options: AllReduceOptions) -> Self {
        let out_len = input.len() / dtype.size();
        RankArgs {
            input,
            dtype,
            out_len,
            out_dtype: dtype,
            in_place,
            options,
            delay: Default::default(),
            skip: false,
            misalign: 0,
            sync_after: false,
            registered: None,
        }
    }

    /// The input in registered memory, `offset` bytes into the step's region.
    pub fn registered(mut self, offset: usize) -> Self {
        self.registered = Some(offset);
        self
    }
}

/// Where each step's region starts in the group's registered allocation (`None`: no rank's
/// input is registered), and the allocation's size: the same on every rank. A rank's input
/// sits at its own offset into the region ([`registered_at`]), so ranks may disagree on it (a
/// mismatch test). Regions are 256-byte aligned, one per step.
pub fn registered_layout(steps: &[Vec<RankArgs>]) -> (Vec<Option<usize>>, usize) {
    let mut cursor = 0;
    let bases = steps
        .iter()
        .map(|step| {
            let bytes = step.iter().map(|a| a.input.len()).max().unwrap_or(0);
            let extra = step.iter().filter_map(|a| a.registered).max()?;
            let base = cursor;
            cursor = (base + extra + bytes).div_ceil(256) * 256;
            Some(base)
        })
        .collect();
    (bases, cursor)
}

/// Where rank `a`'s input of a step whose region starts at `base` goes, if it is registered.
pub fn registered_at(base: Option<usize>, a: &RankArgs) -> Option<usize> {
    base.zip(a.registered).map(|(base, offset)| base + offset)
}

/// The group's registered allocation for `steps`, if any step asks for one.
pub fn alloc_registered(
    comms: &[Communicator],
    steps: &[Vec<RankArgs>],
) -> Result<Option<Vec<allreduce::RegisteredBuffer>>> {
    let (_, bytes) = registered_layout(steps);
    if bytes == 0 {
        return Ok(None);
    }
    Communicator::alloc_registered_group(comms, bytes).map(Some)
}

/// A call's outcome on one rank: the output bytes, or the error.
pub type Outcome = Result<HostBytes>;

/// One rank's part of one fused call ([`Communicator::all_reduce_fused`]) on a workspace of
/// `hidden` elements per row: `allreduce_out` is always asked for, `residual_out` where a
/// residual is given, `norm_out` where the pattern has a norm. No FP8 outputs.
#[derive(Clone, Debug)]
pub struct FusedRankArgs {
    pub pattern: FusedPattern,
    pub tokens: usize,
    /// `tokens x hidden` elements of the workspace's dtype.
    pub input: HostBytes,
    pub residual: Option<HostBytes>,
    /// `hidden` elements; `None` gives no gamma (a pattern with a norm then refuses the call).
    pub gamma: Option<HostBytes>,
    pub strategy: Strategy,
}

impl FusedRankArgs {
    /// The bytes of one output of `hidden`-element rows.
    fn out_bytes(&self, hidden: usize, dtype: DType) -> usize {
        self.tokens * hidden * dtype.size()
    }
}

/// A fused call's outputs on one rank: `allreduce_out`, `residual_out` and `norm_out` (empty
/// where not asked for), or the error.
pub type FusedOutcome = Result<[HostBytes; 3]>;

/// Run one rank's fused call on host memory, or on device memory through `views` (the
/// addresses of its input, residual, gamma and three outputs, each large enough).
pub fn call_fused(
    comm: &Communicator,
    ws: &FusedWorkspace,
    a: &FusedRankArgs,
    addrs: [usize; 6],
    stream: allreduce::Stream,
) -> Result<allreduce::Strategy> {
    let meta = ws.metadata();
    let (hidden, dtype, dev) = (meta.hidden, meta.dtype, comm.device());
    let n = a.tokens * hidden;
    let [input, residual, gamma, ar, res_out, norm] = addrs;
    // SAFETY: the caller's buffers at these addresses hold what the views claim (n elements,
    // `hidden` for gamma) and outlive the call.
    unsafe {
        let mut args = FusedArgs::new(a.pattern, a.tokens, BufRef::from_raw(input, n, dtype, dev))
            .allreduce_out(BufMut::from_raw(ar, n, dtype, dev))
            .strategy(a.strategy)
            .stream(stream);
        if a.residual.is_some() {
            args = args.residual(
                BufRef::from_raw(residual, n, dtype, dev),
                Some(BufMut::from_raw(res_out, n, dtype, dev)),
            );
        }
        if a.pattern.has_norm() {
            args.norm_out = Some(BufMut::from_raw(norm, n, dtype, dev));
        }
        if a.gamma.is_some() {
            args.gamma = Some(BufRef::from_raw(gamma, hidden, dtype, dev));
        }
        comm.all_reduce_fused(ws, args)
    }
}

pub trait Harness: Sync {
    fn name(&self) -> String;
    fn backend(&self) -> BackendKind;
    /// Largest world size this harness can run.
    fn max_world(&self) -> usize {
        8
    }
    fn group(&self, config: GroupConfig) -> Result<Vec<Communicator>> {
        Communicator::new_group(self.backend(), config)
    }
    /// Run `steps[k][r]` on rank r for each step k in order, every rank on its own thread.
    /// Returns `[k][r]`.
    fn run(&self, comms: &[Communicator], steps: &[Vec<RankArgs>]) -> Vec<Vec<Outcome>>;
    /// The same for fused calls on `ws` (one workspace per rank), each call waited for before
    /// the next.
    fn run_fused(
        &self,
        comms: &[Communicator],
        ws: &[FusedWorkspace],
        steps: &[Vec<FusedRankArgs>],
    ) -> Vec<Vec<FusedOutcome>>;
}

/// Ranks are threads and buffers are host memory.
pub struct HostHarness;

impl Harness for HostHarness {
    fn name(&self) -> String {
        "host".into()
    }

    fn backend(&self) -> BackendKind {
        BackendKind::Host
    }

    fn run(&self, comms: &[Communicator], steps: &[Vec<RankArgs>]) -> Vec<Vec<Outcome>> {
        let registered = match alloc_registered(comms, steps) {
            Ok(r) => r,
            Err(e) => {
                return steps
                    .iter()
                    .map(|_| vec![Err(e.clone()); comms.len()])
                    .collect()
            }
        };
        let (offsets, _) = registered_layout(steps);
        let per_rank: Vec<Vec<Outcome>> = std::thread::scope(|s| {
            let offsets = &offsets;
            let registered = &registered;
            let handles: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, comm)| {
                    s.spawn(move || {
                        let mine = registered.as_ref().map(|b| &b[r]);
                        steps
                            .iter()
                            .zip(offsets)
                            .map(
                                |(step, &base)| match (mine, registered_at(base, &step[r])) {
                                    (Some(buf), Some(at)) => {
                                        run_one_registered(comm, &step[r], buf, at)
                                    }
                                    _ => run_one_host(comm, &step[r]),
                                },
                            )
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        });
        transpose(per_rank, steps.len())
    }

    fn run_fused(
        &self,
        comms: &[Communicator],
        ws: &[FusedWorkspace],
        steps: &[Vec<FusedRankArgs>],
    ) -> Vec<Vec<FusedOutcome>> {
        let per_rank: Vec<Vec<FusedOutcome>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .zip(ws)
                .enumerate()
                .map(|(r, (comm, ws))| {
                    s.spawn(move || {
                        steps
                            .iter()
                            .map(|step| run_fused_host(comm, ws, &step[r]))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        });
        transpose(per_rank, steps.len())
    }
}

/// One rank's fused call on host memory.
fn run_fused_host(comm: &Communicator, ws: &FusedWorkspace, a: &FusedRankArgs) -> FusedOutcome {
    let meta = ws.metadata();
    let bytes = a.out_bytes(meta.hidden, meta.dtype);
    let empty = HostBytes::zeroed(0);
    let (residual, gamma) = (
        a.residual.as_ref().unwrap_or(&empty),
        a.gamma.as_ref().unwrap_or(&empty),
    );
    let mut outs = [
        HostBytes::zeroed(bytes),
        HostBytes::zeroed(if a.residual.is_some() { bytes } else { 0 }),
        HostBytes::zeroed(if a.pattern.has_norm() { bytes } else { 0 }),
    ];
    let addr = |b: &HostBytes| b.as_slice().as_ptr() as usize;
    let [ar, res_out, norm] = outs
        .each_mut()
        .map(|o| o.as_mut_slice().as_mut_ptr() as usize);
    let addrs = [
        addr(&a.input),
        addr(residual),
        addr(gamma),
        ar,
        res_out,
        norm,
    ];
    call_fused(comm, ws, a, addrs, allreduce::Stream::NULL)?;
    Ok(outs)
}

fn run_one_host(comm: &Communicator, a: &RankArgs) -> Outcome {
    if a.skip {
        return Ok(HostBytes::zeroed(0));
    }
    if !a.delay.is_zero() {
        std::thread::sleep(a.delay);
    }
    if a.in_place {
        let mut buf = a.input.clone();
        comm.all_reduce_in_place(buf.view_mut(a.dtype), &a.options)?;
        return Ok(buf);
    }
    let mut out = HostBytes::zeroed(a.out_len * a.out_dtype.size());
    if a.misalign == 0 {
        comm.all_reduce(a.input.view(a.dtype), out.view_mut(a.out_dtype), &a.options)?;
    } else {
        let mut shifted = HostBytes::zeroed(a.input.len() + a.misalign);
        shifted.as_mut_slice()[a.misalign..].copy_from_slice(a.input.as_slice());
        let addr = shifted.as_slice().as_ptr() as usize + a.misalign;
        let len = a.input.len() / a.dtype.size();
        // SAFETY: `shifted` holds `len` elements from `addr` and outlives the call.
        let input = unsafe { BufRef::from_raw(addr, len, a.dtype, Device::Host) };
        comm.all_reduce(input, out.view_mut(a.out_dtype), &a.options)?;
    }
    Ok(out)
}

/// A host call whose input is copied into the rank's registered allocation at `at` first.
fn run_one_registered(
    comm: &Communicator,
    a: &RankArgs,
    buf: &allreduce::RegisteredBuffer,
    at: usize,
) -> Outcome {
    if a.skip {
        return Ok(HostBytes::zeroed(0));
    }
    let len = a.input.len() / a.dtype.size();
    let input = buf.view(at, len, a.dtype)?;
    // SAFETY: the view lies inside this rank's host allocation, which only this rank's thread
    // touches, and no call reads it now.
    unsafe {
        std::ptr::copy_nonoverlapping(
            a.input.as_slice().as_ptr(),
            input.raw().addr as *mut u8,
            a.input.len(),
        )
    };
    let mut out = HostBytes::zeroed(a.out_len * a.out_dtype.size());
    comm.all_reduce(input, out.view_mut(a.out_dtype), &a.options)?;
    Ok(out)
}

/// `[rank][step]` -> `[step][rank]`.
pub fn transpose<T>(per_rank: Vec<Vec<T>>, steps: usize) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = (0..steps).map(|_| Vec::new()).collect();
    for rank in per_rank {
        for (k, o) in rank.into_iter().enumerate() {
            out[k].push(o);
        }
    }
    out
}
