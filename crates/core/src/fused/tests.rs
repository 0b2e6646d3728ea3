use super::*;
use crate::HostBytes;

fn bytes(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; v.len() * dtype.size()];
    for (i, &x) in v.iter().enumerate() {
        dtype.store_f32(&mut b, i, x);
    }
    b
}

fn meta(max_tokens: usize, hidden: usize, dtype: DType, world: usize) -> FusedMetadata {
    FusedMetadata::new(&FusedConfig::new(max_tokens, hidden, dtype), 0, world)
}

#[test]
fn call_descriptors_read_back() {
    // fused.h's call_desc: tokens << 32 | hidden << 8 | pattern << 4 | twoshot << 3 | dtype << 1 | 1
    let d = 7u64 << 32 | 4096 << 8 | 2 << 4 | 1 << 3 | 3 << 1 | 1;
    let text = describe_desc(d);
    assert_eq!(
        text,
        format!(
            "7 tokens x 4096 bf16, {}, twoshot",
            FusedPattern::ResidualRmsNormFp8
        )
    );
}

#[test]
fn metadata_sizes() {
    let m = meta(128, 4096, DType::BF16, 8);
    assert_eq!(m.lamport_comm_size, 9 * 128 * 4096 * 2 + TAG_BYTES);
    assert_eq!(m.lamport_buffer_size, 3 * m.lamport_comm_size);
    assert_eq!(m.buffer_size, m.lamport_buffer_size + FLAG_BYTES);
    let f = FusedConfig::new(16, 1024, DType::F32);
    assert!(f.fp32_lamport);
    assert_eq!(
        FusedMetadata::new(&f, 0, 2).lamport_comm_size,
        3 * 16 * 1024 * 4 + TAG_BYTES
    );
}

#[test]
fn config_is_checked() {
    assert!(FusedConfig::new(8, 4096, DType::BF16).validate().is_ok());
    for bad in [
        FusedConfig::new(0, 4096, DType::BF16),
        FusedConfig::new(8, 4100, DType::BF16),
        FusedConfig::new(8, 32768, DType::BF16),
        FusedConfig::new(8, 4096, DType::BF16).fp32_lamport(true),
        FusedConfig::new(8, 4096, DType::F32).fp32_lamport(false),
    ] {
        assert!(
            matches!(bad.validate(), Err(Error::InvalidConfig(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn calls_beyond_the_workspace_are_refused() {
    let m = meta(4, 64, DType::F16, 2);
    let t = default_table();
    let input = HostBytes::zeroed(5 * 64 * 2);
    let mut out = HostBytes::zeroed(5 * 64 * 2);
    let args = FusedArgs::new(FusedPattern::AllReduce, 5, input.view(DType::F16))
        .allreduce_out(out.view_mut(DType::F16));
    let e = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap_err();
    assert_eq!(
        e,
        Error::WorkspaceExceeded {
            what: "tokens",
            requested: 5,
            max: 4
        }
    );
    assert!(e.is_rejection());
    // dtype and length mismatches, missing outputs.
    let input = HostBytes::zeroed(4 * 64 * 2);
    let mut out = HostBytes::zeroed(4 * 64 * 2);
    let args = FusedArgs::new(FusedPattern::AllReduce, 4, input.view(DType::BF16))
        .allreduce_out(out.view_mut(DType::BF16));
    assert!(matches!(
        prepare_fused(&args, &m, &t, Device::Host, 16),
        Err(Error::InvalidArgument(_))
    ));
    let args = FusedArgs::new(FusedPattern::ResidualRmsNorm, 4, input.view(DType::F16));
    let e = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap_err();
    assert!(e.to_string().contains("needs gamma"), "{e}");
    let args = FusedArgs::new(FusedPattern::AllReduce, 3, input.view(DType::F16))
        .allreduce_out(out.view_mut(DType::F16));
    assert!(matches!(
        prepare_fused(&args, &m, &t, Device::Host, 16),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn misaligned_and_overlapping_buffers_are_refused() {
    let m = meta(4, 64, DType::F16, 2);
    let t = default_table();
    let input = HostBytes::zeroed(4 * 64 * 2 + 32);
    let mut out = HostBytes::zeroed(4 * 64 * 2);
    let addr = input.as_slice().as_ptr() as usize + 2;
    // SAFETY: in bounds of `input`, which outlives the view.
    let shifted = unsafe { BufRef::from_raw(addr, 4 * 64, DType::F16, Device::Host) };
    let args =
        FusedArgs::new(FusedPattern::AllReduce, 4, shifted).allreduce_out(out.view_mut(DType::F16));
    assert!(matches!(
        prepare_fused(&args, &m, &t, Device::Host, 16),
        Err(Error::Misaligned { .. })
    ));
    let base = input.as_slice().as_ptr() as usize;
    // SAFETY: views of `input`, never written here (prepare only validates).
    let (i, o) = unsafe {
        (
            BufRef::from_raw(base, 4 * 64, DType::F16, Device::Host),
            BufMut::from_raw(base + 16, 4 * 64, DType::F16, Device::Host),
        )
    };
    let args = FusedArgs::new(FusedPattern::AllReduce, 4, i).allreduce_out(o);
    assert!(matches!(
        prepare_fused(&args, &m, &t, Device::Host, 16),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn auto_picks_oneshot_for_few_tokens_and_twoshot_for_many() {
    let t = default_table();
    let m = meta(4096, 4096, DType::BF16, 8);
    let input = HostBytes::zeroed(4096 * 4096 * 2);
    let mut out = HostBytes::zeroed(4096 * 4096 * 2);
    for (tokens, want) in [
        (1, Strategy::OneShot),
        (8, Strategy::OneShot),
        (16, Strategy::TwoShot),
        (2048, Strategy::TwoShot),
    ] {
        let n = tokens * 4096;
        // SAFETY: prefixes of live buffers.
        let (i, o) = unsafe {
            (
                BufRef::from_raw(
                    input.as_slice().as_ptr() as usize,
                    n,
                    DType::BF16,
                    Device::Host,
                ),
                BufMut::from_raw(
                    out.as_mut_slice().as_mut_ptr() as usize,
                    n,
                    DType::BF16,
                    Device::Host,
                ),
            )
        };
        let args = FusedArgs::new(FusedPattern::AllReduce, tokens, i).allreduce_out(o);
        let call = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap();
        assert_eq!(call.strategy, want, "{tokens} tokens");
    }
}

#[test]
#[allow(clippy::needless_range_loop)]
fn reference_matches_an_unfused_pipeline_by_value() {
    let (tokens, hidden, dtype) = (3, 8, DType::BF16);
    let n = tokens * hidden;
    let x0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut x1: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut x0 = x0;
    // A position where every rank holds -0.0: the fused sum is +0.0, the plain one -0.0.
    x0[5] = -0.0;
    x1[5] = -0.0;
    let res: Vec<f32> = (0..n).map(|i| i as f32 * 0.01 - 0.1).collect();
    let gamma: Vec<f32> = (0..hidden).map(|i| 1.0 + i as f32 * 0.125).collect();
    let (b0, b1, br, bg) = (
        bytes(dtype, &x0),
        bytes(dtype, &x1),
        bytes(dtype, &res),
        bytes(dtype, &gamma),
    );
    let out = reference(
        &[&b0, &b1],
        dtype,
        tokens,
        hidden,
        Some(&br),
        Some(&bg),
        1e-6,
        FusedPattern::ResidualRmsNormFp8,
        None,
        0.0,
    );
    assert_eq!(
        dtype.load_f32(&out.allreduce, 5).to_bits(),
        0,
        "+0.0, not -0.0"
    );
    for t in 0..tokens {
        let mut r = vec![0f32; hidden];
        let mut ss = 0f32;
        for i in 0..hidden {
            let k = t * hidden + i;
            let a = round_canonical(dtype, dtype.load_f32(&b0, k) + dtype.load_f32(&b1, k));
            assert_eq!(dtype.load_f32(&out.allreduce, k), a);
            r[i] = round_canonical(dtype, a + dtype.load_f32(&br, k));
            assert_eq!(dtype.load_f32(&out.residual, k), r[i]);
            ss += r[i] * r[i];
        }
        let inv = 1.0 / (ss / hidden as f32 + 1e-6).sqrt();
        let mut amax = 0f32;
        for i in 0..hidden {
            let want = round_canonical(dtype, r[i] * inv * gamma[i]);
            let got = dtype.load_f32(&out.norm, t * hidden + i);
            assert_eq!(got, want);
            amax = amax.max(got.abs());
        }
        assert_eq!(out.scale[t], amax / 448.0);
        // Dequantized codes are within an E4M3 step of the normalized values.
        for i in 0..hidden {
            let k = t * hidden + i;
            let deq = crate::codec::e4m3_to_f32(out.quant[k]) * out.scale[t];
            let v = dtype.load_f32(&out.norm, k);
            assert!((deq - v).abs() <= v.abs() / 8.0 + 1e-6, "{deq} vs {v}");
        }
    }
}

#[test]
fn fp8_scale_handles_zero_rows() {
    assert_eq!(fp8_scale(0.0), (1.0, 1.0));
    assert_eq!(fp8_scale(448.0), (1.0, 1.0));
    assert_eq!(fp8_scale(2.0), (2.0 / 448.0, 224.0));
}

#[test]
fn static_fp8_takes_the_callers_scale() {
    let (dtype, tokens, hidden) = (DType::BF16, 3, 16);
    let x: Vec<f32> = (0..tokens * hidden)
        .map(|i| (i % 7) as f32 - 3.0 + (i / 7) as f32 * 0.1)
        .collect();
    let zero = vec![0f32; tokens * hidden];
    let res: Vec<f32> = (0..tokens * hidden)
        .map(|i| (i % 5) as f32 * 0.25)
        .collect();
    let gamma: Vec<f32> = (0..hidden).map(|i| 0.5 + i as f32 / 16.0).collect();
    let (b0, b1, br, bg) = (
        bytes(dtype, &x),
        bytes(dtype, &zero),
        bytes(dtype, &res),
        bytes(dtype, &gamma),
    );
    let run = |pattern, scale| {
        reference(
            &[&b0, &b1],
            dtype,
            tokens,
            hidden,
            Some(&br),
            Some(&bg),
            1e-6,
            pattern,
            scale,
            0.0,
        )
    };
    let plain = run(FusedPattern::ResidualRmsNorm, None);
    for scale in [0.01f32, 0.003, 1.0 / 3.0] {
        let out = run(FusedPattern::ResidualRmsNormFp8Static, Some(scale));
        // Everything before the codes is the plain pattern's; no per-token scales.
        assert_eq!(
            (&out.allreduce, &out.residual, &out.norm),
            (&plain.allreduce, &plain.residual, &plain.norm)
        );
        assert!(out.scale.is_empty());
        let mul = 1.0 / scale;
        for (k, &q) in out.quant.iter().enumerate() {
            let v = dtype.load_f32(&out.norm, k);
            assert_eq!(q, crate::codec::f32_to_e4m3(v * mul), "{scale} {k}");
        }
    }
    // A scale small enough to saturate: every code of a nonzero value is +-448.
    let out = run(FusedPattern::ResidualRmsNormFp8Static, Some(1e-6));
    for (k, &q) in out.quant.iter().enumerate() {
        if dtype.load_f32(&out.norm, k) != 0.0 {
            assert_eq!(q & 0x7f, 0x7e, "{k}");
        }
    }
}

#[test]
fn static_fp8_arguments_are_checked() {
    let m = meta(4, 64, DType::F16, 2);
    let t = default_table();
    let input = HostBytes::zeroed(4 * 64 * 2);
    let residual = HostBytes::zeroed(4 * 64 * 2);
    let gamma = HostBytes::zeroed(64 * 2);
    let mut quant = vec![0u8; 4 * 64];
    let scale = [0.5f32, 0.25];
    let mut scales = [0f32; 4];
    let base = |p| {
        FusedArgs::new(p, 4, input.view(DType::F16))
            .residual(residual.view(DType::F16), None)
            .rms_norm(gamma.view(DType::F16), 1e-6, None)
    };
    // Valid: one f32.
    let args = base(FusedPattern::ResidualRmsNormFp8Static).fp8_static(
        Fp8BufMut::from_slice(&mut quant),
        BufRef::from_slice(&scale[..1]),
    );
    let call = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap();
    assert_eq!(call.scale_in.map(|b| b.len), Some(1));
    assert!(call.scale_out.is_none());
    // Two f32 is not a scale.
    let args = base(FusedPattern::ResidualRmsNormFp8Static).fp8_static(
        Fp8BufMut::from_slice(&mut quant),
        BufRef::from_slice(&scale[..]),
    );
    let e = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap_err();
    assert!(e.to_string().contains("one f32"), "{e}");
    // The pattern needs it.
    let mut args = base(FusedPattern::ResidualRmsNormFp8Static);
    args.quant_out = Some(Fp8BufMut::from_slice(&mut quant));
    let e = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap_err();
    assert!(e.to_string().contains("needs scale_in"), "{e}");
    // Other patterns refuse it, and the static pattern refuses per-token scales.
    let mut args = base(FusedPattern::ResidualRmsNormFp8).fp8(
        Fp8BufMut::from_slice(&mut quant),
        BufMut::from_slice(&mut scales),
    );
    args.scale_in = Some(BufRef::from_slice(&scale[..1]));
    let e = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap_err();
    assert!(e.to_string().contains("reads no scale_in"), "{e}");
    let mut args = base(FusedPattern::ResidualRmsNormFp8Static).fp8_static(
        Fp8BufMut::from_slice(&mut quant),
        BufRef::from_slice(&scale[..1]),
    );
    args.scale_out = Some(BufMut::from_slice(&mut scales));
    let e = prepare_fused(&args, &m, &t, Device::Host, 16).unwrap_err();
    assert!(e.to_string().contains("writes no scale_out"), "{e}");
}

#[test]
fn the_norm_without_a_residual_is_of_the_all_reduce_output() {
    let (dtype, tokens, hidden) = (DType::BF16, 3, 24);
    let x: Vec<f32> = (0..tokens * hidden)
        .map(|i| (i as f32 * 0.7).sin() * 3.0)
        .collect();
    let y: Vec<f32> = (0..tokens * hidden)
        .map(|i| (i as f32 * 0.3).cos())
        .collect();
    let gamma: Vec<f32> = (0..hidden).map(|i| 0.5 + i as f32 / 32.0).collect();
    let zeros = bytes(dtype, &vec![0f32; tokens * hidden]);
    let (bx, by, bg) = (bytes(dtype, &x), bytes(dtype, &y), bytes(dtype, &gamma));
    let run = |residual: Option<&[u8]>| {
        reference(
            &[&bx, &by],
            dtype,
            tokens,
            hidden,
            residual,
            Some(&bg),
            1e-5,
            FusedPattern::ResidualRmsNormFp8,
            None,
            0.0,
        )
    };
    let none = run(None);
    // A zero residual adds nothing (a + 0 rounds to a), so the norms agree bit for bit.
    let zero = run(Some(&zeros));
    assert!(
        none.residual.is_empty(),
        "no residual_out without a residual"
    );
    assert_eq!(none.allreduce, zero.allreduce);
    assert_eq!(none.norm, zero.norm);
    assert_eq!((none.quant, none.scale), (zero.quant, zero.scale));
    // And it is not the norm of something else: a non-zero residual moves it.
    let ones = bytes(dtype, &vec![1f32; tokens * hidden]);
    assert_ne!(run(Some(&ones)).norm, none.norm);
}

#[test]
fn weight_bias_is_added_to_gamma_in_f32() {
    let (dtype, tokens, hidden) = (DType::F16, 2, 16);
    let x: Vec<f32> = (0..tokens * hidden)
        .map(|i| i as f32 * 0.25 - 3.0)
        .collect();
    let gamma: Vec<f32> = (0..hidden).map(|i| i as f32 / 64.0 - 0.125).collect();
    let (bx, bg) = (bytes(dtype, &x), bytes(dtype, &gamma));
    // Gemma's (1 + gamma): every shifted gamma is exact in f16, so a gamma buffer holding
    // 1 + gamma must give the same bits.
    let shifted: Vec<f32> = gamma.iter().map(|g| g + 1.0).collect();
    let bs = bytes(dtype, &shifted);
    let run = |g: &[u8], bias| {
        reference(
            &[&bx],
            dtype,
            tokens,
            hidden,
            None,
            Some(g),
            1e-6,
            FusedPattern::ResidualRmsNorm,
            None,
            bias,
        )
        .norm
    };
    assert_eq!(run(&bg, 1.0), run(&bs, 0.0));
    assert_ne!(run(&bg, 1.0), run(&bg, 0.0));
    // A zero bias leaves a -0.0 gamma as it is (so the sign of a zero output stays).
    assert_eq!(weight(-0.0, 0.0).to_bits(), (-0.0f32).to_bits());
    assert_eq!(weight(0.5, 1.0), 1.5);
}

#[test]
fn optional_residual_and_weight_bias_are_checked() {
    let m = meta(4, 64, DType::F16, 2);
    let t = default_table();
    let (input, gamma) = (HostBytes::zeroed(4 * 64 * 2), HostBytes::zeroed(64 * 2));
    let (mut norm, mut res_out, mut out) = (
        HostBytes::zeroed(4 * 64 * 2),
        HostBytes::zeroed(4 * 64 * 2),
        HostBytes::zeroed(4 * 64 * 2),
    );
    let f16 = DType::F16;
    let norm_only = || {
        FusedArgs::new(FusedPattern::ResidualRmsNorm, 4, input.view(f16)).rms_norm(
            gamma.view(f16),
            1e-6,
            None,
        )
    };
    // No residual: fine.
    let mut n = norm.view_mut(f16);
    let ok = FusedArgs {
        norm_out: Some(n),
        ..norm_only()
    };
    let call = prepare_fused(&ok, &m, &t, Device::Host, 16).unwrap();
    assert!(call.residual_in.is_none());
    // A residual_out with no residual_in has nothing to hold.
    n = norm.view_mut(f16);
    let bad = FusedArgs {
        norm_out: Some(n),
        residual_out: Some(res_out.view_mut(f16)),
        ..norm_only()
    };
    let e = prepare_fused(&bad, &m, &t, Device::Host, 16).unwrap_err();
    assert!(
        e.to_string().contains("residual_out needs residual_in"),
        "{e}"
    );
    for bias in [f32::NAN, f32::INFINITY] {
        let bad = FusedArgs {
            norm_out: Some(norm.view_mut(f16)),
            ..norm_only()
        }
        .weight_bias(bias);
        let e = prepare_fused(&bad, &m, &t, Device::Host, 16).unwrap_err();
        assert!(e.to_string().contains("weight_bias must be finite"), "{e}");
    }
    let bad = FusedArgs::new(FusedPattern::AllReduce, 4, input.view(f16))
        .allreduce_out(out.view_mut(f16))
        .weight_bias(1.0);
    let e = prepare_fused(&bad, &m, &t, Device::Host, 16).unwrap_err();
    assert!(e.to_string().contains("no norm for a weight_bias"), "{e}");
}

#[test]
fn the_pattern_can_be_inferred_from_the_outputs() {
    let (input, gamma, scale) = (
        HostBytes::zeroed(64 * 2),
        HostBytes::zeroed(64 * 2),
        HostBytes::zeroed(4),
    );
    let (mut out, mut quant, mut scales) = (
        HostBytes::zeroed(64 * 2),
        vec![0u8; 64],
        HostBytes::zeroed(4),
    );
    let f16 = DType::F16;
    let base = || FusedArgs::new(FusedPattern::ResidualRmsNormFp8, 1, input.view(f16));
    let p = base()
        .allreduce_out(out.view_mut(f16))
        .infer_pattern()
        .pattern;
    assert_eq!(p, FusedPattern::AllReduce);
    let p = base()
        .rms_norm(gamma.view(f16), 1e-6, None)
        .infer_pattern()
        .pattern;
    assert_eq!(p, FusedPattern::ResidualRmsNorm);
    let p = base()
        .rms_norm(gamma.view(f16), 1e-6, None)
        .fp8(
            Fp8BufMut::from_slice(&mut quant),
            scales.view_mut(DType::F32),
        )
        .infer_pattern()
        .pattern;
    assert_eq!(p, FusedPattern::ResidualRmsNormFp8);
    let p = base()
        .rms_norm(gamma.view(f16), 1e-6, None)
        .fp8_static(Fp8BufMut::from_slice(&mut quant), scale.view(DType::F32))
        .infer_pattern()
        .pattern;
    assert_eq!(p, FusedPattern::ResidualRmsNormFp8Static);
}
