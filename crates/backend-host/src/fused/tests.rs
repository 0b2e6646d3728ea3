use allreduce_core::fused::{default_table, prepare_fused, reference, FusedArgs, FusedOutputs};
use allreduce_core::{
    Backend, BufMut, BufRef, DType, Fp8BufMut, FusedPattern, GroupConfig, HostBytes, Strategy,
};

use super::*;
use crate::Host;

fn data(dtype: DType, n: usize, seed: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let v = ((i * 29 + seed * 13) % 89) as f32 / 8.0 - 5.0;
        dtype.store_f32(b.as_mut_slice(), i, v);
    }
    b
}

const STATIC_SCALE: f32 = 0.02;

/// A group's shape and every rank's data for one fused call.
struct Case {
    world: usize,
    max_bytes: usize,
    tokens: usize,
    hidden: usize,
    dtype: DType,
    inputs: Vec<HostBytes>,
    residual: HostBytes,
    gamma: HostBytes,
}

/// Every rank's outputs of one fused call.
fn run_group(case: &Case, pattern: FusedPattern, strategy: Strategy) -> Vec<FusedOutputs> {
    let Case {
        world,
        max_bytes,
        tokens,
        hidden,
        dtype,
        ref inputs,
        ref residual,
        ref gamma,
    } = *case;
    let comms = Host::create_group(&GroupConfig::new(world).max_bytes(max_bytes)).unwrap();
    let ws = comms[0]
        .create_fused_group(&FusedConfig::new(64, hidden, dtype))
        .unwrap()
        .expect("the host backend has a fused op");
    assert!(!ws[0].is_fused());
    let n = tokens * hidden;
    std::thread::scope(|s| {
        let hs: Vec<_> = ws
            .iter()
            .zip(inputs)
            .map(|(w, x)| {
                s.spawn(move || {
                    let mut ar = HostBytes::zeroed(n * dtype.size());
                    let mut res = HostBytes::zeroed(n * dtype.size());
                    let mut norm = HostBytes::zeroed(n * dtype.size());
                    let mut quant = vec![0u8; n];
                    let mut scale = vec![0f32; tokens];
                    let static_scale = [STATIC_SCALE];
                    let mut args = FusedArgs::new(pattern, tokens, x.view(dtype))
                        .allreduce_out(ar.view_mut(dtype))
                        .strategy(strategy);
                    if pattern.has_norm() {
                        args = args
                            .residual(residual.view(dtype), Some(res.view_mut(dtype)))
                            .rms_norm(gamma.view(dtype), 1e-5, Some(norm.view_mut(dtype)));
                    }
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
                    let call =
                        prepare_fused(&args, w.metadata(), &default_table(), Device::Host, 1)
                            .unwrap();
                    w.run(&call).unwrap();
                    let norm_rows = pattern.has_norm();
                    FusedOutputs {
                        allreduce: ar.as_slice().to_vec(),
                        residual: if norm_rows {
                            res.as_slice().to_vec()
                        } else {
                            vec![]
                        },
                        norm: if norm_rows {
                            norm.as_slice().to_vec()
                        } else {
                            vec![]
                        },
                        quant: if pattern.has_fp8() { quant } else { vec![] },
                        scale: if pattern == FusedPattern::ResidualRmsNormFp8 {
                            scale
                        } else {
                            vec![]
                        },
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn calls_larger_than_max_bytes_run_and_match_the_reference() {
    let (world, tokens, hidden, max_bytes) = (3, 48, 256, 1024);
    for dtype in [DType::BF16, DType::F32] {
        let n = tokens * hidden;
        assert!(n * dtype.size() > 8 * max_bytes);
        // A plain all-reduce of the same rows is refused by this group: the fused call's
        // success below is not the bound being absent altogether.
        let comms = Host::create_group(&GroupConfig::new(world).max_bytes(max_bytes)).unwrap();
        let (x, mut y) = (data(dtype, n, 0), HostBytes::zeroed(n * dtype.size()));
        let plain = allreduce_core::prepare(
            Some(x.view(dtype)),
            &y.view_mut(dtype),
            &Default::default(),
            &comms[0].limits(),
            world,
            comms[0].selection(),
            |s, d, p| comms[0].strategy_available(s, d, p),
        );
        assert!(matches!(plain, Err(Error::TooLarge { .. })), "{plain:?}");

        let case = Case {
            world,
            max_bytes,
            tokens,
            hidden,
            dtype,
            inputs: (0..world).map(|r| data(dtype, n, r)).collect(),
            residual: data(dtype, n, 7),
            gamma: data(dtype, hidden, 11),
        };
        for pattern in FusedPattern::ALL {
            let refs: Vec<&[u8]> = case.inputs.iter().map(|b| b.as_slice()).collect();
            let want = reference(
                &refs,
                dtype,
                tokens,
                hidden,
                Some(case.residual.as_slice()),
                Some(case.gamma.as_slice()),
                1e-5,
                pattern,
                Some(STATIC_SCALE).filter(|_| pattern == FusedPattern::ResidualRmsNormFp8Static),
                0.0,
            );
            for strategy in [Strategy::OneShot, Strategy::TwoShot] {
                let got = run_group(&case, pattern, strategy);
                for (r, g) in got.iter().enumerate() {
                    assert_eq!(g, &want, "rank {r}, {dtype} {pattern} {strategy}");
                }
            }
        }
    }
}

/// Ranks that disagree on a fused call's shape (rank 0: 1 token, rank 1: 2) are all refused
/// with the group intact, and the next fused call and a plain all-reduce are exact: what the
/// GPU backends do too (their kernels skip the call together).
#[test]
fn a_fused_mismatch_is_refused_and_the_group_stays_usable() {
    let (world, hidden, dtype) = (2, 256, DType::BF16);
    let comms = Host::create_group(&GroupConfig::new(world)).unwrap();
    let ws = comms[0]
        .create_fused_group(&FusedConfig::new(8, hidden, dtype))
        .unwrap()
        .expect("the host backend has a fused op");
    let inputs: Vec<HostBytes> = (0..world).map(|r| data(dtype, 2 * hidden, r)).collect();
    let fused = |w: &dyn FusedComm, x: &HostBytes, tokens: usize| -> Result<HostBytes> {
        let mut out = HostBytes::zeroed(tokens * hidden * dtype.size());
        let x = HostBytes::from_bytes(&x.as_slice()[..tokens * hidden * dtype.size()]);
        let args = FusedArgs::new(FusedPattern::AllReduce, tokens, x.view(dtype))
            .allreduce_out(out.view_mut(dtype));
        let call = prepare_fused(&args, w.metadata(), &default_table(), Device::Host, 1)?;
        w.run(&call)?;
        Ok(out)
    };
    let outcomes: Vec<(Result<HostBytes>, Result<HostBytes>, HostBytes)> =
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let (w, x, comm) = (&*ws[r], &inputs[r], &comms[r]);
                    s.spawn(move || {
                        let refused = fused(w, x, 1 + r);
                        let after = fused(w, x, 2);
                        let mut plain = HostBytes::zeroed(x.len());
                        let call = allreduce_core::prepare(
                            Some(x.view(dtype)),
                            &plain.view_mut(dtype),
                            &allreduce_core::AllReduceOptions::default(),
                            &comm.limits(),
                            world,
                            comm.selection(),
                            |_, _, _| Ok(()),
                        )
                        .unwrap();
                        comm.all_reduce(&call).unwrap();
                        (refused, after, plain)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
    let views: Vec<&[u8]> = inputs.iter().map(|x| x.as_slice()).collect();
    let want = reference(
        &views,
        dtype,
        2,
        hidden,
        None,
        None,
        0.0,
        FusedPattern::AllReduce,
        None,
        0.0,
    );
    for (r, (refused, after, plain)) in outcomes.iter().enumerate() {
        match refused {
            Err(e) => assert_eq!(
                e.aftermath(),
                allreduce_core::Aftermath::Intact,
                "rank {r}: {e}"
            ),
            Ok(_) => panic!("rank {r}: a mismatched fused call ran"),
        }
        let after = after.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(
            after.as_slice(),
            want.allreduce.as_slice(),
            "rank {r}: the fused call after"
        );
        assert_eq!(
            plain.as_slice(),
            want.allreduce.as_slice(),
            "rank {r}: the plain call after"
        );
    }
}
