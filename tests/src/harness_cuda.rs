//! The suite on NVIDIA GPUs: device buffers, one stream per rank, calls enqueued back to
//! back with no synchronisation between them unless a step asks for it.

use allreduce::cuda::testing::{bind, Buffer, OwnedStream};
use allreduce::{BackendKind, BufMut, BufRef, Communicator, Device, Error, HostBytes, Result};

use crate::harness::{transpose, Harness, Outcome, RankArgs};

pub struct CudaHarness {
    /// Device ordinal of every rank (repeats: virtual ranks on one GPU).
    pub devices: Vec<u32>,
}

impl CudaHarness {
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
        CudaHarness { devices }
    }

    fn ordinal(&self, rank: usize) -> u32 {
        self.devices[rank % self.devices.len()]
    }
}

struct Pending {
    out: Option<Buffer>,
    /// Keeps the input alive until the stream has consumed it.
    _input: Option<Buffer>,
    len: usize,
    result: Result<()>,
}

impl Harness for CudaHarness {
    fn name(&self) -> String {
        let mut d = self.devices.clone();
        d.dedup();
        format!(
            "cuda:{}",
            d.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    }

    fn backend(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn group(&self, config: allreduce::GroupConfig) -> Result<Vec<Communicator>> {
        let world = config.world_size;
        let config = if config.devices.is_empty() && world > 0 {
            config.devices((0..world).map(|r| self.ordinal(r)).collect())
        } else {
            config
        };
        Communicator::new_group(BackendKind::Cuda, config)
    }

    fn run(&self, comms: &[Communicator], steps: &[Vec<RankArgs>]) -> Vec<Vec<Outcome>> {
        let per_rank: Vec<Vec<Outcome>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, comm)| s.spawn(move || run_rank(comm, r, steps)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        });
        transpose(per_rank, steps.len())
    }
}

fn run_rank(comm: &Communicator, r: usize, steps: &[Vec<RankArgs>]) -> Vec<Outcome> {
    let ordinal = match comm.device() {
        Device::Cuda(o) => o,
        d => {
            return steps
                .iter()
                .map(|_| Err(Error::InvalidConfig(format!("rank on {d}"))))
                .collect()
        }
    };
    let setup = bind(ordinal).and_then(|dev| Ok((dev, OwnedStream::new()?)));
    let (_dev, stream) = match setup {
        Ok(x) => x,
        Err(e) => return steps.iter().map(|_| Err(e.clone())).collect(),
    };
    let mut pending: Vec<Pending> = Vec::new();
    let mut outcomes: Vec<Option<Outcome>> = Vec::new();
    // Enqueue every step; wait only where a step asks, and once at the end.
    let flush = |pending: &mut Vec<Pending>, outcomes: &mut Vec<Option<Outcome>>| {
        let sync = comm.synchronize(stream.handle());
        for p in pending.drain(..) {
            let o = p.result.and_then(|_| sync.clone()).and_then(|_| {
                let mut h = HostBytes::zeroed(p.len);
                if let Some(b) = &p.out {
                    b.download(h.as_mut_slice(), &stream)?;
                }
                Ok(h)
            });
            outcomes.push(Some(o));
        }
    };
    for step in steps {
        let a = &step[r];
        if a.skip {
            flush(&mut pending, &mut outcomes);
            outcomes.push(Some(Ok(HostBytes::zeroed(0))));
            continue;
        }
        if !a.delay.is_zero() {
            std::thread::sleep(a.delay);
        }
        pending.push(enqueue(comm, &stream, a));
        if a.sync_after {
            flush(&mut pending, &mut outcomes);
        }
    }
    flush(&mut pending, &mut outcomes);
    outcomes
        .into_iter()
        .map(|o| o.expect("every step has an outcome"))
        .collect()
}

fn enqueue(comm: &Communicator, stream: &OwnedStream, a: &RankArgs) -> Pending {
    let opts = a.options.stream(stream.handle());
    let dev = comm.device();
    let fail = |e: Error| Pending {
        out: None,
        _input: None,
        len: 0,
        result: Err(e),
    };
    if a.in_place {
        let buf = match Buffer::from_host(a.input.as_slice(), stream) {
            Ok(b) => b,
            Err(e) => return fail(e),
        };
        let len = a.input.len() / a.dtype.size();
        // SAFETY: `buf` holds `len` elements and is kept alive in `Pending`.
        let view = unsafe { BufMut::from_raw(buf.addr(), len, a.dtype, dev) };
        let result = comm.all_reduce_in_place(view, &opts).map(|_| ());
        return Pending {
            len: a.input.len(),
            out: Some(buf),
            _input: None,
            result,
        };
    }
    let mut staged = vec![0u8; a.input.len() + a.misalign];
    staged[a.misalign..].copy_from_slice(a.input.as_slice());
    let (input, out) = match (
        Buffer::from_host(&staged, stream),
        Buffer::zeroed(a.out_len * a.out_dtype.size(), stream),
    ) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(e), _) | (_, Err(e)) => return fail(e),
    };
    let in_len = a.input.len() / a.dtype.size();
    // SAFETY: both buffers hold what the views claim and are kept alive in `Pending`.
    let (iv, ov) = unsafe {
        (
            BufRef::from_raw(input.addr() + a.misalign, in_len, a.dtype, dev),
            BufMut::from_raw(out.addr(), a.out_len, a.out_dtype, dev),
        )
    };
    let result = comm.all_reduce(iv, ov, &opts).map(|_| ());
    Pending {
        len: a.out_len * a.out_dtype.size(),
        out: Some(out),
        _input: Some(input),
        result,
    }
}
