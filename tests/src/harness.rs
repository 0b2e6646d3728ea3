//! What the suite needs from a backend: a group, and a way to run a sequence of calls with
//! host-side inputs and read the outputs back. The host harness is here; a GPU backend adds
//! one that allocates device memory, uploads, enqueues, synchronizes and downloads.

use allreduce::{
    AllReduceOptions, BackendKind, BufRef, Communicator, DType, Device, GroupConfig, HostBytes,
    Result,
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
pub fn transpose(per_rank: Vec<Vec<Outcome>>, steps: usize) -> Vec<Vec<Outcome>> {
    let mut out: Vec<Vec<Outcome>> = (0..steps).map(|_| Vec::new()).collect();
    for rank in per_rank {
        for (k, o) in rank.into_iter().enumerate() {
            out[k].push(o);
        }
    }
    out
}
