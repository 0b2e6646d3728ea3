//! The GPU codecs against the Rust reference, byte for byte: every codec encodes random and
//! adversarial blocks (zeros, -0.0, one huge value, subnormals, Inf, NaN, ties, first-maximum
//! ties, the adaptive range's edges, f32 extremes) from f32 and from bf16 input on the GPU,
//! and the bytes (codes, scales, padding) must equal `allreduce::codec::encode`'s; decoding the
//! reference's bytes on the GPU must give `codec::decode`'s values (NaN as NaN).
//! Skips with the reason when no GPU is usable.

use allreduce::codec::{self, BLOCK};
use allreduce::{Codec, DType};
use allreduce_gpu::device::{
    CodecInput, CodecKernels, DeviceBuffer, GpuDevice, GpuStream, Segment,
};

use crate::{gpu_available, GpuTestRuntime};

/// What byte `i` of a segment of `n` elements holds, and its block.
fn byte_place(codec: Codec, n: usize, i: usize) -> (String, usize) {
    let so = codec.scales_offset(n);
    if i < so {
        let b = i / codec.code_bytes();
        return (
            format!("code byte {} of block {b}", i % codec.code_bytes()),
            b,
        );
    }
    let nb = n.div_ceil(BLOCK);
    let mut at = so;
    for (f, &w) in codec.side_widths().iter().enumerate() {
        let len = (nb * w).div_ceil(16) * 16;
        if i < at + len {
            let b = (i - at) / w;
            return (
                format!("byte {} of side field {f} of block {b}", (i - at) % w),
                b,
            );
        }
        at += len;
    }
    ("past the segment".into(), nb)
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn check_codec<R: GpuTestRuntime>(
    k: &CodecKernels<R>,
    stream: &GpuStream<R>,
    codec: Codec,
    input: CodecInput,
    x: &[f32],
) -> Result<(), String> {
    let e = |e: allreduce::Error| e.to_string();
    let n = x.len();
    // The values the encoder sees: bf16 input is widened exactly, so its reference input
    // is the bf16-rounded data.
    let (bytes, xs): (Vec<u8>, Vec<f32>) = match input {
        CodecInput::F32 => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), x.to_vec()),
        CodecInput::Bf16 => {
            let mut b = vec![0u8; 2 * n];
            for (i, &v) in x.iter().enumerate() {
                DType::BF16.store_f32(&mut b, i, v);
            }
            let xs = (0..n).map(|i| DType::BF16.load_f32(&b, i)).collect();
            (b, xs)
        }
    };
    let mut want = vec![0u8; codec.encoded_len(n)];
    codec::encode(codec, &xs, &mut want);

    let src = DeviceBuffer::from_host(&bytes, stream).map_err(e)?;
    let enc = DeviceBuffer::zeroed(want.len(), stream).map_err(e)?;
    let job = |grid| Segment {
        input,
        codec,
        n,
        grid,
    };
    k.encode(job(7), &src, &enc, stream).map_err(e)?;
    let mut got = vec![0u8; want.len()];
    enc.download(&mut got, stream).map_err(e)?;
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        let (place, blk) = byte_place(codec, n, i);
        return Err(format!(
            "{codec} {input:?} encode: byte {i} ({place}) is {:#04x}, reference {:#04x}; block input {:?}",
            got[i],
            want[i],
            &xs[(blk * BLOCK).min(n)..((blk + 1) * BLOCK).min(n)]
        ));
    }

    // Decode the reference's bytes.
    let elem = if input == CodecInput::F32 { 4 } else { 2 };
    let mut dec_want = vec![0f32; n];
    codec::decode(codec, &want, &mut dec_want);
    let encoded = DeviceBuffer::from_host(&want, stream).map_err(e)?;
    let out = DeviceBuffer::zeroed(n * elem, stream).map_err(e)?;
    k.decode(job(5), &encoded, &out, stream).map_err(e)?;
    let mut raw = vec![0u8; n * elem];
    out.download(&mut raw, stream).map_err(e)?;
    for i in 0..n {
        let (g, w) = match input {
            CodecInput::F32 => (
                f32::from_le_bytes(raw[4 * i..4 * i + 4].try_into().unwrap()),
                dec_want[i],
            ),
            CodecInput::Bf16 => {
                let mut b = [0u8; 2];
                DType::BF16.store_f32(&mut b, 0, dec_want[i]);
                (DType::BF16.load_f32(&raw, i), DType::BF16.load_f32(&b, 0))
            }
        };
        if !same(g, w) {
            return Err(format!(
                "{codec} {input:?} decode: element {i} is {g:e}, reference {w:e}"
            ));
        }
    }
    Ok(())
}

/// Panics (a failing test) on the first difference.
pub fn run<R: GpuTestRuntime>() {
    if !gpu_available::<R>("codecs") {
        return;
    }
    let dev = GpuDevice::<R>::open(0).expect("device");
    dev.prepare_virtual_ranks().expect("memory pool");
    let stream = GpuStream::new(&dev).expect("stream");
    let k = CodecKernels::load(&dev).expect("codec kernels");
    let x = crate::codec_data::elements();
    let mut failures = Vec::new();
    for codec in Codec::ALL {
        for input in [CodecInput::F32, CodecInput::Bf16] {
            // The whole set, and a short prefix (a single partial block).
            for len in [x.len(), 19] {
                match check_codec(&k, &stream, codec, input, &x[..len]) {
                    Ok(()) => crate::say!(R, "{codec} {input:?} n={len}: bytes and values match"),
                    Err(e) => {
                        crate::say!(R, "{e}");
                        failures.push(e);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} codec mismatches", failures.len());
}
