//! GPU baselines measured in the same run as the sweep (`--baselines`, any GPU backend):
//!
//! - the copy roofline: the plain 16-byte-vector copy kernel from the same fatbin, over the
//!   same sizes, with the whole GPU (SMs x 4 blocks of 512), read + write bytes per second;
//! - host CPU time per `all_reduce` call against a bare kernel launch: every rank thread
//!   enqueues `CALLS` calls back to back, timed without the final synchronisation;
//! - the codec kernels alone (`--codec-bench`): encode then decode of one bf16 buffer per
//!   codec (`--data`'s values), bytes read + written per second, against the copy kernel on
//!   the same bytes.

use std::time::Instant;

use allreduce::{AllReduceOptions, BufMut, BufRef, Codec, Communicator, DType, Strategy};
use allreduce_gpu::device::{
    CodecInput, CodecKernels, CopyKernel, DeviceBuffer, GpuDevice, GpuStream, Segment,
};
use allreduce_gpu::GpuRuntime;

use crate::data::Inputs;
use crate::gpu::open_rank;

const CALLS: usize = 200;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The whole GPU's worth of blocks: 4 of 512 threads per SM or compute unit.
fn whole_gpu<R: GpuRuntime>(dev: &GpuDevice<R>) -> u32 {
    R::compute_units(dev.raw()) * 4
}

/// Copy-kernel time and bandwidth per size, on the first rank's GPU.
pub fn copy_roofline<R: GpuRuntime>(
    comm: &Communicator,
    sizes: &[usize],
) -> Result<Vec<(usize, f64, f64)>, BoxError> {
    let (dev, stream) = open_rank::<R>(comm)?;
    let grid = whole_gpu(&dev);
    let kernel = CopyKernel::load(&dev)?;
    let max = sizes.iter().copied().max().unwrap_or(16).div_ceil(16) * 16;
    let (src, dst) = (
        DeviceBuffer::zeroed(max, &stream)?,
        DeviceBuffer::zeroed(max, &stream)?,
    );
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
    drop((src, dst, stream, dev));
    Ok(rows)
}

/// Mean host time per call, in microseconds: (all_reduce enqueue, bare launch), over ranks.
pub fn launch_overhead<R: GpuRuntime>(
    comms: &[Communicator],
    bytes: usize,
) -> Result<(f64, f64), BoxError> {
    // Module loads and allocations may wait for the whole device; no rank may make them while
    // a peer's collective is in flight, or the two wait for each other until the deadline.
    let ready = std::sync::Barrier::new(comms.len());
    let per_rank: Vec<Result<(f64, f64), String>> = std::thread::scope(|s| {
        let ready = &ready;
        let hs: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || rank_overhead::<R>(comm, bytes, ready).map_err(|e| e.to_string()))
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

fn rank_overhead<R: GpuRuntime>(
    comm: &Communicator,
    bytes: usize,
    ready: &std::sync::Barrier,
) -> Result<(f64, f64), BoxError> {
    let setup = (|| -> Result<_, BoxError> {
        let (dev, stream) = open_rank::<R>(comm)?;
        let kernel = CopyKernel::load(&dev)?;
        let bufs = (
            DeviceBuffer::zeroed(bytes, &stream)?,
            DeviceBuffer::zeroed(bytes, &stream)?,
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

/// One codec's encode and decode times (`--codec-bench`).
pub struct CodecSpeed {
    pub codec: Codec,
    pub encode_us: f64,
    pub decode_us: f64,
    /// (read + written bytes of encode and decode) / (encode + decode time).
    pub gbs: f64,
}

pub struct CodecReport {
    pub bytes: usize,
    pub copy_us: f64,
    pub copy_gbs: f64,
    pub codecs: Vec<CodecSpeed>,
}

/// Mean seconds per launch of `f` over `iters` launches after 3 warm-up ones.
fn time_launches<R: GpuRuntime>(
    stream: &GpuStream<R>,
    iters: usize,
    mut f: impl FnMut() -> allreduce::Result<()>,
) -> Result<f64, BoxError> {
    for _ in 0..3 {
        f()?;
    }
    stream.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    stream.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

/// Encode + decode of `bytes` of bf16 per codec (rank 0's values of `data`, see
/// `--data`), and the copy kernel on the same bytes, on the first rank's GPU with the whole
/// GPU's worth of blocks.
pub fn codec_speed<R: GpuRuntime>(
    comm: &Communicator,
    bytes: usize,
    data: Inputs,
) -> Result<CodecReport, BoxError> {
    let (dev, stream) = open_rank::<R>(comm)?;
    let grid = whole_gpu(&dev);
    let n = (bytes / 2).div_ceil(32) * 32;
    let bytes = n * 2;
    let host = Inputs {
        dtype: DType::BF16,
        bytes,
        ..data
    }
    .fill(0);
    let src = DeviceBuffer::from_host(&host, &stream)?;
    let back = DeviceBuffer::zeroed(bytes, &stream)?;
    // The largest wire format of all, v2's side fields included.
    let enc_bytes = Codec::ALL
        .iter()
        .map(|c| c.encoded_len(n))
        .max()
        .unwrap_or(0);
    let enc = DeviceBuffer::zeroed(enc_bytes, &stream)?;
    let copy = CopyKernel::load(&dev)?;
    let kernels = CodecKernels::load(&dev)?;
    let iters = (8_000_000_000 / bytes.max(1)).clamp(5, 200);
    let copy_s = time_launches(&stream, iters, || {
        copy.copy(&src, &back, bytes, grid, &stream)
    })?;
    let mut codecs = Vec::new();
    for codec in Codec::ALL {
        let job = Segment {
            input: CodecInput::Bf16,
            codec,
            n,
            grid,
        };
        let e = time_launches(&stream, iters, || kernels.encode(job, &src, &enc, &stream))?;
        let d = time_launches(&stream, iters, || kernels.decode(job, &enc, &back, &stream))?;
        let moved = 2.0 * (bytes + codec.encoded_len(n)) as f64;
        codecs.push(CodecSpeed {
            codec,
            encode_us: e * 1e6,
            decode_us: d * 1e6,
            gbs: moved / (e + d) / 1e9,
        });
    }
    drop((src, back, enc, stream, dev));
    Ok(CodecReport {
        bytes,
        copy_us: copy_s * 1e6,
        copy_gbs: 2.0 * bytes as f64 / copy_s / 1e9,
        codecs,
    })
}
