//! The fused all-reduce + residual add + RMSNorm on candle CPU tensors and host ranks: the
//! residual output bit for bit the f32 sum (rank order) plus the residual, the norm within
//! rounding of candle's own RMSNorm of it, every rank the same bits; shapes refused.

use allreduce::{BackendKind, Communicator, FusedConfig, FusedWorkspace, GroupConfig};
use candle_core::{DType, Device, Tensor};

#[test]
fn fused_add_rms_norm_equals_the_unfused_layers() {
    let (world, tokens, hidden) = (2usize, 3usize, 64usize);
    let comms = Communicator::new_group(BackendKind::Host, GroupConfig::new(world)).unwrap();
    let wss =
        FusedWorkspace::create_group(&comms, FusedConfig::new(8, hidden, allreduce::DType::F32))
            .unwrap();
    let xs: Vec<Tensor> = (0..world)
        .map(|_| Tensor::randn(0f32, 1.0, (tokens, hidden), &Device::Cpu).unwrap())
        .collect();
    let residual = Tensor::randn(0f32, 1.0, (tokens, hidden), &Device::Cpu).unwrap();
    let gamma = Tensor::randn(1f32, 0.1, hidden, &Device::Cpu).unwrap();
    let eps = 1e-6f32;
    let outs: Vec<(Tensor, Tensor)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (c, ws, x, res, g) = (&comms[r], &wss[r], &xs[r], &residual, &gamma);
                s.spawn(move || allreduce_candle::all_reduce_add_rms_norm(x, res, g, eps, c, ws))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    let want_res = ((&xs[0] + &xs[1]).unwrap() + &residual).unwrap();
    let want_norm = candle_core_rms_norm(&want_res, &gamma, eps);
    let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (r, (res, norm)) in outs.iter().enumerate() {
        let bits =
            |a: Vec<f32>, b: Vec<f32>| a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(bits(v(res), v(&want_res)), "rank {r}: residual_out");
        assert!(
            bits(v(norm), v(&outs[0].1)),
            "rank {r}: norm differs from rank 0's"
        );
        for (a, b) in v(norm).iter().zip(v(&want_norm)) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "rank {r}: norm {a} vs {b}"
            );
        }
    }
    // Shapes that do not match are refused before anything is enqueued.
    let e = allreduce_candle::all_reduce_add_rms_norm(
        &xs[0],
        &residual,
        &Tensor::ones(hidden + 1, DType::F32, &Device::Cpu).unwrap(),
        eps,
        &comms[0],
        &wss[0],
    )
    .unwrap_err();
    assert!(e.to_string().contains("gamma"), "{e}");
}

/// RMSNorm as a candle user writes it: `x / sqrt(mean(x^2) + eps) * gamma`, in f32.
fn candle_core_rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(1).unwrap();
    let inv = (ms + eps as f64).unwrap().sqrt().unwrap().recip().unwrap();
    x.broadcast_mul(&inv).unwrap().broadcast_mul(gamma).unwrap()
}
