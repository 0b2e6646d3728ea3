//! GPU baselines measured in the same run as the sweep (`--baselines`, CUDA only):
//!
//! - the copy roofline: the plain 16-byte-vector copy kernel from the same fatbin, over the
//!   same sizes, with the whole GPU (SMs x 4 blocks of 512), read + write bytes per second;
//! - host CPU time per `all_reduce` call against a bare kernel launch: every rank thread
//!   enqueues `CALLS` calls back to back, timed without the final synchronisation.

use std::time::Instant;

use allreduce::cuda::driver;
use allreduce::cuda::testing::{bind, Buffer, CopyKernel, OwnedStream};
use allreduce::{AllReduceOptions, BufMut, BufRef, Communicator, DType, Device, Strategy};

const CALLS: usize = 200;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn ordinal(comm: &Communicator) -> Result<u32, BoxError> {
    match comm.device() {
        Device::Cuda(o) => Ok(o),
        d => Err(format!("--baselines needs CUDA ranks, not {d}").into()),
    }
}

/// Copy-kernel time and bandwidth per size, on the first rank's GPU.
pub fn copy_roofline(
    comm: &Communicator,
    sizes: &[usize],
) -> Result<Vec<(usize, f64, f64)>, BoxError> {
    let dev = bind(ordinal(comm)?)?;
    let grid = dev.sm_count * 4;
    let kernel = CopyKernel::load()?;
    let stream = OwnedStream::new()?;
    let max = sizes.iter().copied().max().unwrap_or(16).div_ceil(16) * 16;
    let (src, dst) = (Buffer::zeroed(max, &stream)?, Buffer::zeroed(max, &stream)?);
    let mut rows = Vec::new();
    for &bytes in sizes {
        let bytes = bytes.div_ceil(16) * 16;
        let iters = (2_000_000_000 / bytes.max(1)).clamp(20, 2000);
        for _ in 0..5 {
            kernel.copy(&src, &dst, bytes, grid, &stream)?;
        }
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            kernel.copy(&src, &dst, bytes, grid, &stream)?;
        }
        stream.synchronize()?;
        let secs = t.elapsed().as_secs_f64() / iters as f64;
        rows.push((bytes, secs * 1e6, 2.0 * bytes as f64 / secs / 1e9));
    }
    drop(dev);
    Ok(rows)
}

/// Mean host time per call, in microseconds: (all_reduce enqueue, bare launch), over ranks.
pub fn launch_overhead(comms: &[Communicator], bytes: usize) -> Result<(f64, f64), BoxError> {
    // Module loads and allocations may wait for the whole device; no rank may make them while
    // a peer's collective is in flight, or the two wait for each other until the deadline.
    let ready = std::sync::Barrier::new(comms.len());
    let per_rank: Vec<Result<(f64, f64), String>> = std::thread::scope(|s| {
        let ready = &ready;
        let hs: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || rank_overhead(comm, bytes, ready).map_err(|e| e.to_string()))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    });
    let mut sum = (0.0, 0.0);
    for r in &per_rank {
        let (a, b) = r.clone()?;
        sum.0 += a;
        sum.1 += b;
    }
    let n = per_rank.len() as f64;
    Ok((sum.0 / n, sum.1 / n))
}

fn rank_overhead(
    comm: &Communicator,
    bytes: usize,
    ready: &std::sync::Barrier,
) -> Result<(f64, f64), BoxError> {
    let setup = (|| -> Result<_, BoxError> {
        let dev: driver::Device = bind(ordinal(comm)?)?;
        let stream = OwnedStream::new()?;
        let kernel = CopyKernel::load()?;
        let bufs = (
            Buffer::zeroed(bytes, &stream)?,
            Buffer::zeroed(bytes, &stream)?,
        );
        stream.synchronize()?;
        Ok((dev, stream, kernel, bufs))
    })();
    // Every rank passes the barrier, even one whose setup failed, so none is left waiting.
    ready.wait();
    let (_dev, stream, kernel, (input, output)) = setup?;
    let n = bytes / 2;
    // SAFETY: both buffers hold n bf16 elements and outlive every call below.
    let (iv, ov) = unsafe {
        (
            BufRef::from_raw(input.addr(), n, DType::BF16, comm.device()),
            BufMut::from_raw(output.addr(), n, DType::BF16, comm.device()),
        )
    };
    let opts = AllReduceOptions::default()
        .strategy(Strategy::OneShot)
        .stream(stream.handle());
    let call = |iv: BufRef<'_>, ov: BufMut<'_>| comm.all_reduce(iv, ov, &opts);
    for _ in 0..10 {
        // SAFETY: as above; views are plain copies of the same addresses.
        unsafe {
            call(
                BufRef::from_raw(iv.raw().addr, n, DType::BF16, comm.device()),
                BufMut::from_raw(ov.raw().addr, n, DType::BF16, comm.device()),
            )?;
        }
    }
    comm.synchronize(stream.handle())?;
    let t = Instant::now();
    for _ in 0..CALLS {
        // SAFETY: as above.
        unsafe {
            call(
                BufRef::from_raw(iv.raw().addr, n, DType::BF16, comm.device()),
                BufMut::from_raw(ov.raw().addr, n, DType::BF16, comm.device()),
            )?;
        }
    }
    let per_call = t.elapsed().as_secs_f64() / CALLS as f64;
    comm.synchronize(stream.handle())?;
    let t = Instant::now();
    for _ in 0..CALLS {
        kernel.copy(&input, &output, 0, 1, &stream)?;
    }
    let per_launch = t.elapsed().as_secs_f64() / CALLS as f64;
    stream.synchronize()?;
    Ok((per_call * 1e6, per_launch * 1e6))
}
