//! The suite on GPUs: device buffers, one stream per rank, calls enqueued back to back with no
//! synchronisation between them unless a step asks for it. Written once over the device API
//! (`allreduce_gpu::device`), for every [`GpuTestRuntime`].
//!
//! Every buffer of a sequence is allocated and filled before any rank makes its first call,
//! and freed only after every rank is done: on virtual ranks, anything that may wait for the
//! whole device (an allocation that maps memory, a free, a module load) made while a peer's
//! kernel waits for this rank's next launch is a cycle that only the deadline breaks.

use std::marker::PhantomData;
use std::sync::Barrier;

use allreduce::{
    BackendKind, BufMut, BufRef, Communicator, FusedWorkspace, HostBytes, RegisteredBuffer, Result,
};
use allreduce_gpu::device::{DeviceBuffer, GpuStream};
use allreduce_gpu::upload_registered;

use crate::harness::{
    alloc_registered, call_fused, registered_at, registered_layout, transpose, FusedOutcome,
    FusedRankArgs, Harness, Outcome, RankArgs,
};
use crate::{open_rank, GpuTestRuntime};

/// The suite on the GPUs of runtime `R`.
pub struct GpuHarness<R> {
    /// Device ordinal of every rank (repeats: virtual ranks on one GPU).
    pub devices: Vec<u32>,
    runtime: PhantomData<fn() -> R>,
}

impl<R: GpuTestRuntime> GpuHarness<R> {
    /// Every rank on device 0 (the single-GPU machine), unless `ALLREDUCE_TEST_DEVICES`
    /// lists ordinals to cycle through (e.g. `0,1,2,3`).
    pub fn from_env() -> Self {
        let devices = std::env::var("ALLREDUCE_TEST_DEVICES")
            .ok()
            .map(|s| {
                s.split(',')
                    .filter_map(|d| d.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| vec![0]);
        GpuHarness {
            devices,
            runtime: PhantomData,
        }
    }

    fn ordinal(&self, rank: usize) -> u32 {
        self.devices[rank % self.devices.len()]
    }
}

impl<R: GpuTestRuntime> Harness for GpuHarness<R> {
    fn name(&self) -> String {
        let mut d = self.devices.clone();
        d.dedup();
        format!(
            "{}:{}",
            R::NAME,
            d.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    }

    fn backend(&self) -> BackendKind {
        R::KIND
    }

    fn group(&self, config: allreduce::GroupConfig) -> Result<Vec<Communicator>> {
        let world = config.world_size;
        let config = if config.devices.is_empty() && world > 0 {
            config.devices((0..world).map(|r| self.ordinal(r)).collect())
        } else {
            config
        };
        Communicator::new_group(R::KIND, config)
    }

    fn run(&self, comms: &[Communicator], steps: &[Vec<RankArgs>]) -> Vec<Vec<Outcome>> {
        // Collective, before any rank's first call (it allocates on every rank's device).
        let registered = match alloc_registered(comms, steps) {
            Ok(r) => r,
            Err(e) => {
                return steps
                    .iter()
                    .map(|_| vec![Err(e.clone()); comms.len()])
                    .collect()
            }
        };
        let barrier = Barrier::new(comms.len());
        let per_rank: Vec<Vec<Outcome>> = std::thread::scope(|s| {
            let barrier = &barrier;
            let registered = &registered;
            let handles: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, comm)| {
                    let mine = registered.as_ref().map(|b| &b[r]);
                    s.spawn(move || run_rank::<R>(comm, r, steps, mine, barrier))
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
        let barrier = Barrier::new(comms.len());
        let per_rank: Vec<Vec<FusedOutcome>> = std::thread::scope(|s| {
            let barrier = &barrier;
            let handles: Vec<_> = comms
                .iter()
                .zip(ws)
                .enumerate()
                .map(|(r, (comm, ws))| {
                    s.spawn(move || run_fused_rank::<R>(comm, ws, r, steps, barrier))
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

/// One rank's fused sequence: every buffer allocated and filled before any rank calls (see
/// the module docs), each call synchronized before the next.
fn run_fused_rank<R: GpuTestRuntime>(
    comm: &Communicator,
    ws: &FusedWorkspace,
    r: usize,
    steps: &[Vec<FusedRankArgs>],
    barrier: &Barrier,
) -> Vec<FusedOutcome> {
    let meta = ws.metadata();
    let row_bytes = meta.hidden * meta.dtype.size();
    let setup = (|| -> Result<_> {
        let (dev, stream) = open_rank::<R>(comm)?;
        stream.warm(&dev)?;
        let bufs = steps
            .iter()
            .map(|step| {
                let a = &step[r];
                let bytes = (a.tokens * row_bytes).max(16);
                let up = |b: Option<&HostBytes>, len: usize| match b {
                    Some(b) => DeviceBuffer::<R>::from_host(b.as_slice(), &stream),
                    None => DeviceBuffer::zeroed(len, &stream),
                };
                Ok([
                    up(Some(&a.input), bytes)?,
                    up(a.residual.as_ref(), bytes)?,
                    up(a.gamma.as_ref(), row_bytes)?,
                    DeviceBuffer::zeroed(bytes, &stream)?,
                    DeviceBuffer::zeroed(bytes, &stream)?,
                    DeviceBuffer::zeroed(bytes, &stream)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        stream.synchronize()?;
        Ok((dev, stream, bufs))
    })();
    // Everyone is ready (or failed) before anyone calls.
    barrier.wait();
    let (_dev, stream, bufs) = match setup {
        Ok(x) => x,
        Err(e) => {
            barrier.wait();
            return steps.iter().map(|_| Err(e.clone())).collect();
        }
    };
    let outcomes = steps
        .iter()
        .zip(&bufs)
        .map(|(step, b)| {
            let a = &step[r];
            call_fused(comm, ws, a, b.each_ref().map(|d| d.addr()), stream.handle())?;
            comm.synchronize(stream.handle())?;
            let bytes = a.tokens * row_bytes;
            let wanted = [
                bytes,
                if a.residual.is_some() { bytes } else { 0 },
                if a.pattern.has_norm() { bytes } else { 0 },
            ];
            let mut outs = wanted.map(HostBytes::zeroed);
            for (o, d) in outs.iter_mut().zip(&b[3..]) {
                d.download(o.as_mut_slice(), &stream)?;
            }
            Ok(outs)
        })
        .collect();
    // Nobody frees while a peer may still be calling.
    barrier.wait();
    outcomes
}

/// One rank's buffers for one step.
struct Prepared<R: GpuTestRuntime> {
    input: Option<DeviceBuffer<R>>,
    /// The buffer the result is read from (the input itself in place).
    out: Option<DeviceBuffer<R>>,
    out_bytes: usize,
    /// The input's view in the group's registered allocation, instead of `input`.
    registered: Option<usize>,
}

fn prepare<R: GpuTestRuntime>(
    a: &RankArgs,
    stream: &GpuStream<R>,
    registered: Option<(&RegisteredBuffer, usize)>,
) -> Result<Prepared<R>> {
    if a.skip {
        return Ok(Prepared {
            input: None,
            out: None,
            out_bytes: 0,
            registered: None,
        });
    }
    if a.in_place {
        let buf = DeviceBuffer::from_host(a.input.as_slice(), stream)?;
        return Ok(Prepared {
            input: None,
            out: Some(buf),
            out_bytes: a.input.len(),
            registered: None,
        });
    }
    let out_bytes = a.out_len * a.out_dtype.size();
    if let Some((buf, at)) = registered {
        upload_registered::<R>(buf.memory(), at, a.input.as_slice(), stream)?;
        return Ok(Prepared {
            input: None,
            out: Some(DeviceBuffer::zeroed(out_bytes, stream)?),
            out_bytes,
            registered: Some(buf.addr() + at),
        });
    }
    let mut staged = vec![0u8; a.input.len() + a.misalign];
    staged[a.misalign..].copy_from_slice(a.input.as_slice());
    Ok(Prepared {
        input: Some(DeviceBuffer::from_host(&staged, stream)?),
        out: Some(DeviceBuffer::zeroed(out_bytes, stream)?),
        out_bytes,
        registered: None,
    })
}

fn run_rank<R: GpuTestRuntime>(
    comm: &Communicator,
    r: usize,
    steps: &[Vec<RankArgs>],
    registered: Option<&RegisteredBuffer>,
    barrier: &Barrier,
) -> Vec<Outcome> {
    let (offsets, _) = registered_layout(steps);
    let setup = (|| -> Result<_> {
        let (dev, stream) = open_rank::<R>(comm)?;
        stream.warm(&dev)?;
        let prepared = steps
            .iter()
            .zip(&offsets)
            .map(|(step, &base)| {
                prepare(
                    &step[r],
                    &stream,
                    registered.zip(registered_at(base, &step[r])),
                )
            })
            .collect::<Vec<_>>();
        stream.synchronize()?;
        Ok((dev, stream, prepared))
    })();
    // Everyone is ready (or failed) before anyone calls.
    barrier.wait();
    let (_dev, stream, prepared) = match setup {
        Ok(x) => x,
        Err(e) => {
            barrier.wait();
            return steps.iter().map(|_| Err(e.clone())).collect();
        }
    };

    // Enqueue every step; wait only where a step asks, and once at the end. An asynchronous
    // error belongs to every call enqueued since the previous wait.
    let mut results: Vec<Result<()>> = Vec::with_capacity(steps.len());
    let mut since_sync = 0;
    let settle = |results: &mut Vec<Result<()>>, since: &mut usize| {
        let sync = comm.synchronize(stream.handle());
        let n = results.len();
        for res in &mut results[n - *since..] {
            if res.is_ok() {
                *res = sync.clone();
            }
        }
        *since = 0;
    };
    for (step, p) in steps.iter().zip(&prepared) {
        let a = &step[r];
        let p = match p {
            Ok(p) => p,
            Err(e) => {
                results.push(Err(e.clone()));
                continue;
            }
        };
        if a.skip {
            results.push(Ok(()));
            continue;
        }
        if !a.delay.is_zero() {
            std::thread::sleep(a.delay);
        }
        results.push(enqueue(comm, &stream, a, p));
        since_sync += 1;
        if a.sync_after {
            settle(&mut results, &mut since_sync);
        }
    }
    settle(&mut results, &mut since_sync);

    let outcomes = results
        .into_iter()
        .zip(&prepared)
        .map(|(res, p)| {
            res?;
            let p = p.as_ref().map_err(Clone::clone)?;
            let mut h = HostBytes::zeroed(p.out_bytes);
            if let Some(b) = &p.out {
                b.download(h.as_mut_slice(), &stream)?;
            }
            Ok(h)
        })
        .collect();
    // Nobody frees while a peer may still be calling.
    barrier.wait();
    outcomes
}

fn enqueue<R: GpuTestRuntime>(
    comm: &Communicator,
    stream: &GpuStream<R>,
    a: &RankArgs,
    p: &Prepared<R>,
) -> Result<()> {
    let opts = a.options.stream(stream.handle());
    let dev = comm.device();
    let out = p.out.as_ref().expect("prepared");
    if a.in_place {
        let len = a.input.len() / a.dtype.size();
        // SAFETY: the buffer holds `len` elements and outlives the sequence.
        let view = unsafe { BufMut::from_raw(out.addr(), len, a.dtype, dev) };
        return comm.all_reduce_in_place(view, &opts).map(|_| ());
    }
    let in_len = a.input.len() / a.dtype.size();
    let in_addr = match p.registered {
        Some(addr) => addr,
        None => p.input.as_ref().expect("prepared").addr() + a.misalign,
    };
    // SAFETY: both buffers hold what the views claim and outlive the sequence.
    let (iv, ov) = unsafe {
        (
            BufRef::from_raw(in_addr, in_len, a.dtype, dev),
            BufMut::from_raw(out.addr(), a.out_len, a.out_dtype, dev),
        )
    };
    comm.all_reduce(iv, ov, &opts).map(|_| ())
}
