//! The `cudarc` feature on virtual ranks: calls on cudarc's `CudaSlice` / `CudaView` and
//! `Arc<CudaStream>` (a stream per rank, made by cudarc), in place and out of place, f32 and
//! bf16, whole buffers and views at an offset, exact sums of integer data checked bit for bit
//! after reading the results back through cudarc. Skips with the reason when no GPU is usable.

#[cfg(not(feature = "cudarc"))]
fn main() {
    println!("cuda_cudarc skipped: built without the cudarc feature");
}

#[cfg(feature = "cudarc")]
fn main() {
    use std::sync::Arc;

    use allreduce::cuda::CudaRuntime;
    use allreduce::{AllReduceOptions, Communicator, GroupConfig, Strategy};
    use allreduce_gpu::device::GpuDevice;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use half::bf16;

    if !allreduce_conformance::gpu_available::<CudaRuntime>("cudarc") {
        return;
    }
    // Several ranks on one GPU: the memory pool must not make one rank's allocation wait for
    // another's free (allreduce_gpu::device::GpuDevice::prepare_virtual_ranks).
    GpuDevice::<CudaRuntime>::open(0)
        .and_then(|d| d.prepare_virtual_ranks())
        .unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let n = 70_001usize;
    let value = |r: usize, i: usize| ((r * 5 + i * 3) % 17) as f32 - 8.0;
    for world in [1usize, 2, 4] {
        let comms =
            Communicator::new_group_cudarc(&vec![ctx.clone(); world], GroupConfig::new(world))
                .unwrap();
        let streams: Vec<Arc<CudaStream>> = (0..world).map(|_| ctx.new_stream().unwrap()).collect();
        // Every buffer before any call, freed after every rank is done (virtual ranks).
        let mut bufs: Vec<(CudaSlice<f32>, CudaSlice<f32>, CudaSlice<bf16>)> = (0..world)
            .map(|r| {
                let s = &streams[r];
                let x: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                (
                    s.clone_htod(&x).unwrap(),
                    s.alloc_zeros::<f32>(n).unwrap(),
                    s.clone_htod(&xb).unwrap(),
                )
            })
            .collect();
        for s in &streams {
            s.synchronize().unwrap();
        }
        let results: Vec<(Vec<f32>, Vec<bf16>)> = std::thread::scope(|scope| {
            let hs: Vec<_> = (comms.iter().zip(&streams).zip(bufs.iter_mut()))
                .map(|((comm, stream), (x, out, xb))| {
                    scope.spawn(move || {
                        let o = AllReduceOptions::default();
                        comm.all_reduce_cudarc(x, out, stream, &o).unwrap();
                        // A view at an offset, in place, two-shot.
                        let mut tail = xb.slice_mut(16..n);
                        let two = o.strategy(if comm.world_size() > 1 {
                            Strategy::TwoShot
                        } else {
                            Strategy::OneShot
                        });
                        comm.all_reduce_cudarc_in_place(&mut tail, stream, &two)
                            .unwrap();
                        comm.synchronize(allreduce::Stream::from_raw(stream.cu_stream() as _))
                            .unwrap();
                        (
                            stream.clone_dtoh(&*out).unwrap(),
                            stream.clone_dtoh(&*xb).unwrap(),
                        )
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (sum, sum_b)) in results.iter().enumerate() {
            for i in 0..n {
                let want: f32 = (0..world).map(|q| value(q, i)).sum();
                assert_eq!(sum[i], want, "world {world} rank {r} f32 element {i}");
                let want_b = if i < 16 { value(r, i) } else { want };
                assert_eq!(
                    sum_b[i].to_f32(),
                    want_b,
                    "world {world} rank {r} bf16 element {i}"
                );
            }
        }
        drop(bufs);
        println!("[cuda] cudarc buffers and streams, {world} ranks: ok");
    }
}
