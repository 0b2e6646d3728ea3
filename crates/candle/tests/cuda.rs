//! The ops on candle CUDA tensors (the `cuda` feature), virtual ranks on GPU 0 with a candle
//! device (and stream) each: `all_reduce_` equal bit for bit to the host backend's sum of the
//! same tensors (f32 and bf16), the fused add + RMSNorm's residual output bit for bit the
//! host's and its norm within rounding, every rank the same bits. Skipped, saying why, on a
//! machine without a GPU; refused dtypes and shapes fail as candle errors.
#![cfg(feature = "cuda")]

use allreduce::{BackendKind, Communicator, FusedConfig, FusedWorkspace, GroupConfig};
use allreduce_gpu::device::GpuDevice;
use candle_core::{DType, Device, Tensor};

/// `world` candle devices on GPU 0, each with its own stream, and a CUDA group over them; or
/// `None`, having said why the test skips.
fn gpu_group(world: usize) -> Option<(Vec<Device>, Vec<Communicator>)> {
    match try_gpu_group(world) {
        Ok(g) => Some(g),
        Err(why) => {
            println!("skipped: no CUDA group on GPU 0 ({why})");
            None
        }
    }
}

fn try_gpu_group(world: usize) -> Result<(Vec<Device>, Vec<Communicator>), String> {
    // Before any context exists: the hardware queues and the memory pool virtual ranks need.
    GpuDevice::<allreduce::cuda::CudaRuntime>::open(0)
        .and_then(|d| d.prepare_virtual_ranks())
        .map_err(|e| e.to_string())?;
    let devices = (0..world)
        .map(|_| Device::new_cuda_with_stream(0))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let contexts: Vec<_> = devices
        .iter()
        .map(|d| d.as_cuda_device().unwrap().cuda_stream().context().clone())
        .collect();
    let comms = Communicator::new_group_cudarc(&contexts, GroupConfig::new(world))
        .map_err(|e| e.to_string())?;
    Ok((devices, comms))
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Each rank's `f(rank)` on its own thread.
fn per_rank<T: Send>(world: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (0..world).map(|r| s.spawn(move || f(r))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn cuda_tensors_sum_as_the_host_backend_does() {
    for world in [1usize, 2, 4] {
        let Some((devices, comms)) = gpu_group(world) else {
            return;
        };
        let host = Communicator::new_group(BackendKind::Host, GroupConfig::new(world)).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            // 5 rows of 384, a row-parallel output of the model's size, and an odd length.
            for shape in [(5usize, 384usize), (3, 1001)] {
                let xs: Vec<Tensor> = (0..world)
                    .map(|_| {
                        let x = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
                        x.to_dtype(dtype).unwrap()
                    })
                    .collect();
                let want = per_rank(world, |r| {
                    let y = xs[r].copy().unwrap();
                    allreduce_candle::all_reduce_(&y, &host[r]).unwrap();
                    y
                });
                // Copies between host and device happen outside the ranks' calls: a pageable
                // copy may wait in the driver's staging behind a peer's copy that waits for
                // the all-reduce.
                let on: Vec<Tensor> = (0..world)
                    .map(|r| xs[r].to_device(&devices[r]).unwrap())
                    .collect();
                per_rank(world, |r| {
                    allreduce_candle::all_reduce_(&on[r], &comms[r]).unwrap()
                });
                let got: Vec<Tensor> = on
                    .iter()
                    .map(|y| y.to_device(&Device::Cpu).unwrap())
                    .collect();
                for r in 0..world {
                    assert_eq!(
                        bits(&got[r]),
                        bits(&want[r]),
                        "world {world} {dtype:?} {shape:?}: rank {r} differs from the host"
                    );
                }
            }
        }
        // A view that is not contiguous, and an integer tensor, are refused.
        let m = Tensor::zeros((4, 6), DType::F32, &devices[0]).unwrap();
        let e = allreduce_candle::all_reduce_(&m.t().unwrap(), &comms[0]).unwrap_err();
        assert!(e.to_string().contains("contiguous"), "{e}");
        let i = Tensor::zeros(8, DType::U32, &devices[0]).unwrap();
        assert!(allreduce_candle::all_reduce_(&i, &comms[0]).is_err());
        println!("world {world}: f32 and bf16 sums as the host backend's");
    }
}

#[test]
fn cuda_fused_add_rms_norm_matches_the_host() {
    let (world, tokens, hidden) = (2usize, 3usize, 384usize);
    let Some((devices, comms)) = gpu_group(world) else {
        return;
    };
    let host = Communicator::new_group(BackendKind::Host, GroupConfig::new(world)).unwrap();
    let config = FusedConfig::new(8, hidden, allreduce::DType::F32);
    let gpu_ws = FusedWorkspace::create_group(&comms, config.clone()).unwrap();
    let host_ws = FusedWorkspace::create_group(&host, config).unwrap();
    let xs: Vec<Tensor> = (0..world)
        .map(|_| Tensor::randn(0f32, 1.0, (tokens, hidden), &Device::Cpu).unwrap())
        .collect();
    let residual = Tensor::randn(0f32, 1.0, (tokens, hidden), &Device::Cpu).unwrap();
    let gamma = Tensor::randn(1f32, 0.1, hidden, &Device::Cpu).unwrap();
    let eps = 1e-6f32;
    let want = per_rank(world, |r| {
        allreduce_candle::all_reduce_add_rms_norm(
            &xs[r],
            &residual,
            &gamma,
            eps,
            &host[r],
            &host_ws[r],
        )
        .unwrap()
    });
    // Inputs copied in before the ranks' calls and outputs copied out after (see above).
    let inputs: Vec<[Tensor; 3]> = (0..world)
        .map(|r| [&xs[r], &residual, &gamma].map(|t| t.to_device(&devices[r]).unwrap()))
        .collect();
    let outs = per_rank(world, |r| {
        let [x, res, g] = &inputs[r];
        allreduce_candle::all_reduce_add_rms_norm(x, res, g, eps, &comms[r], &gpu_ws[r]).unwrap()
    });
    let got: Vec<(Tensor, Tensor)> = outs
        .iter()
        .map(|(res, norm)| {
            (
                res.to_device(&Device::Cpu).unwrap(),
                norm.to_device(&Device::Cpu).unwrap(),
            )
        })
        .collect();
    let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for r in 0..world {
        assert_eq!(bits(&got[r].0), bits(&want[r].0), "rank {r}: residual_out");
        assert_eq!(
            bits(&got[r].1),
            bits(&got[0].1),
            "rank {r}: norm_out vs rank 0"
        );
        for (a, b) in v(&got[r].1).iter().zip(v(&want[r].1)) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "rank {r}: norm {a} vs {b}"
            );
        }
    }
    // Mixed dtypes are refused as a candle error.
    let e = allreduce_candle::all_reduce_add_rms_norm(
        &xs[0].to_device(&devices[0]).unwrap(),
        &residual
            .to_dtype(DType::BF16)
            .unwrap()
            .to_device(&devices[0])
            .unwrap(),
        &gamma.to_device(&devices[0]).unwrap(),
        eps,
        &comms[0],
        &gpu_ws[0],
    )
    .unwrap_err();
    assert!(e.to_string().contains("one dtype"), "{e}");
    println!("world {world}: the fused op on CUDA tensors as the host's");
}
