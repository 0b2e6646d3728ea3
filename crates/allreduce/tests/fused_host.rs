//! The fused call on the host backend (all-reduce, then the epilogue) against the reference,
//! bit for bit, and the workspace's refusals.

use allreduce::fused::{self, FusedOutputs};
use allreduce::{
    BackendKind, BufMut, BufRef, Communicator, DType, Error, Fp8BufMut, FusedArgs, FusedConfig,
    FusedPattern, FusedWorkspace, GroupConfig, HostBytes, Strategy,
};

fn data(dtype: DType, n: usize, seed: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let v = match (i + seed) % 13 {
            0 => -0.0,
            k => ((i * 31 + seed * 17) % 97) as f32 / 16.0 - 3.0 + k as f32 * 0.01,
        };
        dtype.store_f32(b.as_mut_slice(), i, v);
    }
    b
}

/// The static FP8 pattern's scale: codes of values up to 448 x this are not saturated.
const STATIC_SCALE: f32 = 0.0075;

fn run(
    world: usize,
    tokens: usize,
    hidden: usize,
    dtype: DType,
    pattern: FusedPattern,
    strategy: Strategy,
) {
    run_in(
        GroupConfig::new(world),
        tokens,
        hidden,
        dtype,
        pattern,
        strategy,
        Norm::default(),
    )
}

/// The norm's options: with a residual or not, and the weight bias.
#[derive(Clone, Copy, Debug)]
struct Norm {
    residual: bool,
    weight_bias: f32,
}

impl Default for Norm {
    fn default() -> Self {
        Norm {
            residual: true,
            weight_bias: 0.0,
        }
    }
}

fn run_in(
    config: GroupConfig,
    tokens: usize,
    hidden: usize,
    dtype: DType,
    pattern: FusedPattern,
    strategy: Strategy,
    norm_options: Norm,
) {
    let world = config.world_size;
    let comms = Communicator::new_group(BackendKind::Host, config).unwrap();
    let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(64, hidden, dtype)).unwrap();
    assert!(!ws[0].is_fused());
    let n = tokens * hidden;
    let inputs: Vec<HostBytes> = (0..world).map(|r| data(dtype, n, r)).collect();
    let residual = data(dtype, n, 99);
    let gamma = data(dtype, hidden, 7);
    let refs: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
    let want = fused::reference(
        &refs,
        dtype,
        tokens,
        hidden,
        Some(residual.as_slice()).filter(|_| norm_options.residual),
        Some(gamma.as_slice()),
        1e-5,
        pattern,
        Some(STATIC_SCALE).filter(|_| pattern == FusedPattern::ResidualRmsNormFp8Static),
        norm_options.weight_bias,
    );
    let got: Vec<FusedOutputs> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&ws)
            .zip(&inputs)
            .map(|((c, w), x)| {
                let (residual, gamma) = (&residual, &gamma);
                s.spawn(move || {
                    let mut ar = HostBytes::zeroed(n * dtype.size());
                    let mut res = HostBytes::zeroed(n * dtype.size());
                    let mut norm = HostBytes::zeroed(n * dtype.size());
                    let mut quant = vec![0u8; n];
                    let mut scale = vec![0f32; tokens];
                    let mut args = FusedArgs::new(pattern, tokens, x.view(dtype))
                        .allreduce_out(ar.view_mut(dtype))
                        .strategy(strategy);
                    if pattern.has_norm() && norm_options.residual {
                        args = args.residual(residual.view(dtype), Some(res.view_mut(dtype)));
                    }
                    if pattern.has_norm() {
                        args = args
                            .rms_norm(gamma.view(dtype), 1e-5, Some(norm.view_mut(dtype)))
                            .weight_bias(norm_options.weight_bias);
                    }
                    let static_scale = [STATIC_SCALE];
                    match pattern {
                        FusedPattern::ResidualRmsNormFp8 => {
                            args = args.fp8(
                                Fp8BufMut::from_slice(&mut quant),
                                BufMut::from_slice(&mut scale),
                            )
                        }
                        FusedPattern::ResidualRmsNormFp8Static => {
                            args = args.fp8_static(
                                Fp8BufMut::from_slice(&mut quant),
                                BufRef::from_slice(&static_scale),
                            )
                        }
                        _ => {}
                    }
                    c.all_reduce_fused(w, args).unwrap();
                    let has = pattern.has_norm();
                    let has_residual = has && norm_options.residual;
                    let fp8 = pattern.has_fp8();
                    let scales = pattern == FusedPattern::ResidualRmsNormFp8;
                    FusedOutputs {
                        allreduce: ar.as_slice().to_vec(),
                        residual: if has_residual {
                            res.as_slice().to_vec()
                        } else {
                            vec![]
                        },
                        norm: if has {
                            norm.as_slice().to_vec()
                        } else {
                            vec![]
                        },
                        quant: if fp8 { quant } else { vec![] },
                        scale: if scales { scale } else { vec![] },
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, g) in got.iter().enumerate() {
        assert_eq!(
            g, &want,
            "rank {r}, {world} ranks, {tokens}x{hidden} {dtype} {pattern}"
        );
    }
}

#[test]
fn host_fused_matches_the_reference() {
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        for pattern in FusedPattern::ALL {
            for (world, tokens) in [(2, 1), (3, 7), (4, 16)] {
                for strategy in [Strategy::Auto, Strategy::OneShot, Strategy::TwoShot] {
                    run(world, tokens, 64, dtype, pattern, strategy);
                }
            }
        }
    }
}

#[test]
fn host_fused_norms_without_a_residual_and_with_a_weight_bias_match_the_reference() {
    for pattern in FusedPattern::ALL.into_iter().filter(|p| p.has_norm()) {
        for (residual, weight_bias) in [(false, 0.0), (true, 1.0), (false, -0.5)] {
            for strategy in [Strategy::OneShot, Strategy::TwoShot] {
                let norm = Norm {
                    residual,
                    weight_bias,
                };
                run_in(
                    GroupConfig::new(3),
                    5,
                    64,
                    DType::BF16,
                    pattern,
                    strategy,
                    norm,
                );
            }
        }
    }
}

#[test]
fn host_fused_is_bounded_by_the_workspace_not_max_bytes() {
    // 16 x 64 bf16 is 2 KiB per rank: four times what a plain all-reduce of this group takes.
    let config = GroupConfig::new(2).max_bytes(512);
    let comms = Communicator::new_group(BackendKind::Host, config.clone()).unwrap();
    assert!(!comms[0].splits_large_calls() && comms[0].max_bytes() < 16 * 64 * 2);
    for pattern in FusedPattern::ALL {
        for strategy in [Strategy::OneShot, Strategy::TwoShot] {
            run_in(
                config.clone(),
                16,
                64,
                DType::BF16,
                pattern,
                strategy,
                Norm::default(),
            );
        }
    }
}

#[test]
fn host_fused_refuses_what_the_workspace_cannot_take() {
    let comms = Communicator::new_group(BackendKind::Host, GroupConfig::new(2)).unwrap();
    let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(4, 64, DType::BF16)).unwrap();
    let m = ws[1].metadata();
    assert_eq!((m.rank, m.world, m.max_tokens, m.hidden), (1, 2, 4, 64));
    // Three buffers of 2 + 1 slots of 4 x 64 bf16, each with 128 bytes of call tags.
    assert_eq!(m.lamport_buffer_size, 3 * (3 * 4 * 64 * 2 + 128));
    let x = HostBytes::zeroed(8 * 64 * 2);
    let mut out = HostBytes::zeroed(8 * 64 * 2);
    // Rank 0 asks for 8 rows; rank 1's matching call of 2 rows learns of the refusal at once.
    let (e, peer) = std::thread::scope(|s| {
        let peer = s.spawn(|| {
            let x = HostBytes::zeroed(2 * 64 * 2);
            let mut out = HostBytes::zeroed(2 * 64 * 2);
            comms[1].all_reduce_fused(
                &ws[1],
                FusedArgs::new(FusedPattern::AllReduce, 2, x.view(DType::BF16))
                    .allreduce_out(out.view_mut(DType::BF16)),
            )
        });
        let e = comms[0]
            .all_reduce_fused(
                &ws[0],
                FusedArgs::new(FusedPattern::AllReduce, 8, x.view(DType::BF16))
                    .allreduce_out(out.view_mut(DType::BF16)),
            )
            .unwrap_err();
        (e, peer.join().unwrap().unwrap_err())
    });
    assert!(
        matches!(
            e,
            Error::WorkspaceExceeded {
                requested: 8,
                max: 4,
                ..
            }
        ),
        "{e}"
    );
    match peer {
        Error::PeerRejected {
            rank: 0, reason, ..
        } => assert_eq!(reason, e.to_string()),
        other => panic!("{other}"),
    }
    // The other rank's workspace.
    let e = comms[0]
        .all_reduce_fused(
            &ws[1],
            FusedArgs::new(FusedPattern::AllReduce, 8, x.view(DType::BF16))
                .allreduce_out(out.view_mut(DType::BF16)),
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let _ = BufRef::from_slice(&[0f32; 1]);
    assert!(
        FusedWorkspace::create_group(&comms[1..], FusedConfig::new(4, 64, DType::BF16)).is_err()
    );
}

/// The FP8 pattern on library memory alone: inputs, scales and codes all in registered
/// buffers (`fp8_view_mut` for the codes), equal to the reference.
#[test]
fn fp8_codes_go_to_library_memory() {
    let (world, tokens, hidden, dtype) = (2, 3, 64, DType::BF16);
    let comms = Communicator::new_group(BackendKind::Host, GroupConfig::new(world)).unwrap();
    let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(4, hidden, dtype)).unwrap();
    let n = tokens * hidden;
    let inputs: Vec<HostBytes> = (0..world).map(|r| data(dtype, n, r)).collect();
    let gamma = data(dtype, hidden, 7);
    let refs: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
    let want = fused::reference(
        &refs,
        dtype,
        tokens,
        hidden,
        None,
        Some(gamma.as_slice()),
        1e-5,
        FusedPattern::ResidualRmsNormFp8,
        None,
        0.0,
    );
    // Per rank: input, gamma, scales (f32) and codes, one after another.
    let (at_gamma, at_scale, at_quant) = (n * 2, n * 2 + hidden * 2, n * 2 + hidden * 2 + 16);
    let bytes = at_quant + n;
    let mut bufs = Communicator::alloc_registered_group(&comms, bytes).unwrap();
    for (b, x) in bufs.iter_mut().zip(&inputs) {
        b.upload(0, x.as_slice()).unwrap();
        b.upload(at_gamma, gamma.as_slice()).unwrap();
        let e = b.fp8_view_mut(at_quant, n + 1).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }
    let got: Vec<(Vec<u8>, Vec<u8>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&ws)
            .zip(bufs.iter_mut())
            .map(|((c, w), b)| {
                s.spawn(move || {
                    let base = b.addr();
                    // SAFETY: views of disjoint parts of this rank's buffer, live for the call.
                    let (x, g, scale) = unsafe {
                        (
                            BufRef::from_raw(base, n, dtype, b.device()),
                            BufRef::from_raw(base + at_gamma, hidden, dtype, b.device()),
                            BufMut::from_raw(base + at_scale, tokens, DType::F32, b.device()),
                        )
                    };
                    let quant = b.fp8_view_mut(at_quant, n).unwrap();
                    let args = FusedArgs::new(FusedPattern::ResidualRmsNorm, tokens, x)
                        .rms_norm(g, 1e-5, None)
                        .fp8(quant, scale)
                        .infer_pattern();
                    assert_eq!(args.pattern, FusedPattern::ResidualRmsNormFp8);
                    c.all_reduce_fused(w, args).unwrap();
                    let (mut q, mut sc) = (vec![0u8; n], vec![0u8; tokens * 4]);
                    b.download(at_quant, &mut q).unwrap();
                    b.download(at_scale, &mut sc).unwrap();
                    (q, sc)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want_scale: Vec<u8> = want.scale.iter().flat_map(|s| s.to_le_bytes()).collect();
    for (r, (q, sc)) in got.iter().enumerate() {
        assert_eq!(q, &want.quant, "rank {r} codes");
        assert_eq!(sc, &want_scale, "rank {r} scales");
    }
}
