//! The op in a tensor-parallel layer, on CPU tensors and host ranks (one thread each): a
//! row-parallel linear layer whose partial products are summed by `all_reduce_`, equal bit
//! for bit to the partials summed in rank order in f32 and within rounding of the unsplit
//! matmul; and refusals (a strided view, an integer tensor) as candle errors.

use allreduce::{BackendKind, Communicator, GroupConfig};
use candle_core::{DType, Device, IndexOp, Tensor};

fn group(world: usize) -> Vec<Communicator> {
    Communicator::new_group(BackendKind::Host, GroupConfig::new(world)).unwrap()
}

#[test]
fn a_row_parallel_linear_layer_sums_its_partials() {
    let (tokens, inner, out) = (5, 48, 16);
    let x = Tensor::randn(0f32, 1.0, (tokens, inner), &Device::Cpu).unwrap();
    let w = Tensor::randn(0f32, 1.0, (out, inner), &Device::Cpu).unwrap();
    let full = x.matmul(&w.t().unwrap()).unwrap();
    for world in [1usize, 2, 3, 4] {
        let comms = group(world);
        let shard = inner / world;
        let partials: Vec<Tensor> = (0..world)
            .map(|r| {
                let xs = x.narrow(1, r * shard, shard).unwrap().contiguous().unwrap();
                let ws = w.narrow(1, r * shard, shard).unwrap();
                xs.matmul(&ws.t().unwrap()).unwrap()
            })
            .collect();
        let summed: Vec<Tensor> = std::thread::scope(|s| {
            let hs: Vec<_> = (comms.iter().zip(&partials))
                .map(|(c, p)| {
                    let y = p.copy().unwrap();
                    s.spawn(move || {
                        allreduce_candle::all_reduce_(&y, c).unwrap();
                        y
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut want = partials[0].clone();
        for p in &partials[1..] {
            want = (want + p).unwrap();
        }
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (r, y) in summed.iter().enumerate() {
            let (got, want) = (bits(y), bits(&want));
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "world {world} rank {r}: not the rank-order f32 sum"
            );
        }
        let err = (&summed[0] - &full)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(err < 1e-4, "world {world}: {err} from the unsplit matmul");
    }
}

#[test]
fn half_precision_tensors_and_refusals() {
    let comms = group(2);
    let ys: Vec<Tensor> = (0..2)
        .map(|r| Tensor::full(1.5f32 + r as f32, (3, 8), &Device::Cpu).unwrap())
        .map(|t| t.to_dtype(DType::BF16).unwrap())
        .collect();
    std::thread::scope(|s| {
        for (c, y) in comms.iter().zip(&ys) {
            s.spawn(move || allreduce_candle::all_reduce_(y, c).unwrap());
        }
    });
    let v = ys[1].to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    assert!(v.to_vec1::<f32>().unwrap().iter().all(|&x| x == 4.0));

    // A strided view and an integer tensor are refused before any rank waits for a peer.
    let t = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
    let strided = t.t().unwrap();
    let e = allreduce_candle::all_reduce_(&strided, &comms[0]).unwrap_err();
    assert!(e.to_string().contains("contiguous"), "{e}");
    let ints = Tensor::zeros(8, DType::U32, &Device::Cpu).unwrap();
    let e = allreduce_candle::all_reduce_(&ints, &comms[0]).unwrap_err();
    assert!(e.to_string().contains("allreduce-all-reduce"), "{e}");
    // The group is still usable.
    let zs: Vec<Tensor> = (0..2)
        .map(|_| Tensor::ones(6, DType::F32, &Device::Cpu).unwrap())
        .collect();
    std::thread::scope(|s| {
        for (c, z) in comms.iter().zip(&zs) {
            s.spawn(move || allreduce_candle::all_reduce_(&z.i(..).unwrap(), c).unwrap());
        }
    });
    assert_eq!(zs[0].to_vec1::<f32>().unwrap(), vec![2.0; 6]);
}
