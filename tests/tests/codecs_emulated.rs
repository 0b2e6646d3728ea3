//! The GPU codec source on the CPU against the Rust reference, bit for bit, with no GPU.
//!
//! tests/build.rs compiles kernels-common/include/allreduce/segment.h (codec.h, codec_v2.h)
//! with the host C++ compiler against a host shim (tests/emulated), twice: `sm90`
//! (AR_PACK_SAT = AR_MAX_NAN = 1, the paths CUDA sm_90 takes) and `generic` (both 0). Each
//! block is coded by its group of 32 / N lanes as the kernels call the codec
//! (encode_quad + Segment::store, Segment::load + decode_quad), the lanes run as fibers whose
//! `__shfl_xor_sync` exchange values in lockstep. Every block must make the same number of
//! shuffles whatever its data: on the GPU one warp holds the groups of several blocks, and a
//! full-mask shuffle that some of them skip hangs the warp.
//!
//! For every codec, build variant and lane shape (encode: 8, 16 and 32 elements per lane;
//! decode: 8 and 16) the encoded segment must equal `allreduce::codec::encode`'s byte for
//! byte (codes, side fields, padding), and decoding the reference's bytes must give
//! `codec::decode`'s values bit for bit (NaN equals any NaN). The data are
//! `allreduce_conformance::codec_data::elements()`, a ragged segment, and its first 19
//! elements (one partial block). One test per codec; each prints its first few mismatching
//! blocks (codec, variant, lane shape, block, input, differing bytes or elements) and fails.

#[cfg(not(ar_emu_built))]
#[test]
fn emulation_builds() {
    panic!(
        "tests/emulated (the GPU codec source, compiled for the CPU) did not build:\n{}",
        include_str!(env!("AR_EMU_BUILD_LOG"))
    );
}

#[cfg(ar_emu_built)]
mod emulated {
    use std::collections::{BTreeMap, HashSet};
    use std::ffi::{c_char, c_int, CStr};
    use std::fmt::Write;
    use std::sync::OnceLock;
    use std::time::Instant;

    use allreduce::codec::{self, BLOCK};
    use allreduce::Codec;
    use allreduce_conformance::codec_data;

    type EncodeFn = unsafe extern "C" fn(
        codec: c_int,
        lanes_n: c_int,
        x: *const f32,
        n: u64,
        dst: *mut u8,
        dst_len: u64,
        err: *mut c_char,
        err_cap: u64,
    ) -> c_int;
    type DecodeFn = unsafe extern "C" fn(
        codec: c_int,
        lanes_n: c_int,
        src: *const u8,
        src_len: u64,
        n: u64,
        out: *mut f32,
        err: *mut c_char,
        err_cap: u64,
    ) -> c_int;
    type LayoutFn = unsafe extern "C" fn(codec: c_int, layout: *mut u32) -> c_int;

    // tests/emulated/driver.cpp, once per variant (tests/build.rs).
    #[link(name = "ar_emu", kind = "static")]
    extern "C" {
        fn ar_emu_encode_sm90(
            codec: c_int,
            lanes_n: c_int,
            x: *const f32,
            n: u64,
            dst: *mut u8,
            dst_len: u64,
            err: *mut c_char,
            err_cap: u64,
        ) -> c_int;
        fn ar_emu_decode_sm90(
            codec: c_int,
            lanes_n: c_int,
            src: *const u8,
            src_len: u64,
            n: u64,
            out: *mut f32,
            err: *mut c_char,
            err_cap: u64,
        ) -> c_int;
        fn ar_emu_layout_sm90(codec: c_int, layout: *mut u32) -> c_int;
        fn ar_emu_encode_generic(
            codec: c_int,
            lanes_n: c_int,
            x: *const f32,
            n: u64,
            dst: *mut u8,
            dst_len: u64,
            err: *mut c_char,
            err_cap: u64,
        ) -> c_int;
        fn ar_emu_decode_generic(
            codec: c_int,
            lanes_n: c_int,
            src: *const u8,
            src_len: u64,
            n: u64,
            out: *mut f32,
            err: *mut c_char,
            err_cap: u64,
        ) -> c_int;
        fn ar_emu_layout_generic(codec: c_int, layout: *mut u32) -> c_int;
    }

    /// One build of the codec source.
    struct Variant {
        name: &'static str,
        encode: EncodeFn,
        decode: DecodeFn,
        layout: LayoutFn,
    }

    const VARIANTS: [Variant; 2] = [
        Variant {
            name: "sm90 (AR_PACK_SAT=1 AR_MAX_NAN=1)",
            encode: ar_emu_encode_sm90,
            decode: ar_emu_decode_sm90,
            layout: ar_emu_layout_sm90,
        },
        Variant {
            name: "generic (AR_PACK_SAT=0 AR_MAX_NAN=0)",
            encode: ar_emu_encode_generic,
            decode: ar_emu_decode_generic,
            layout: ar_emu_layout_generic,
        },
    ];

    /// Elements per lane: the all-reduce kernels' quads (8), pairs (16, the adaptive segment
    /// decoders) and a lane per block (32, the CUDA segment encoder). Decoders take 8 or 16.
    const ENCODE_SHAPES: [usize; 3] = [8, 16, 32];
    const DECODE_SHAPES: [usize; 2] = [8, 16];

    /// Mismatching blocks reported per (variant, direction, shape, n).
    const REPORT: usize = 3;

    fn codec_index(codec: Codec) -> c_int {
        Codec::ALL
            .iter()
            .position(|&c| c == codec)
            .expect("a codec of Codec::ALL") as c_int
    }

    fn message(err: &[c_char]) -> String {
        // SAFETY: the driver writes a NUL-terminated string (snprintf) into the buffer,
        // which is zeroed beforehand.
        unsafe { CStr::from_ptr(err.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// What the emulator's encode gave: the segment, and a complaint about it (the lanes
    /// of a block returned different side fields) that does not stop the byte comparison.
    struct Encoded {
        bytes: Vec<u8>,
        complaint: Option<String>,
    }

    fn emu_encode(v: &Variant, codec: Codec, lanes_n: usize, x: &[f32]) -> Result<Encoded, String> {
        let mut bytes = vec![0u8; codec.encoded_len(x.len())];
        let mut err = vec![0 as c_char; 1024];
        // SAFETY: x and bytes are valid for the lengths passed; err for err_cap bytes.
        let rc = unsafe {
            (v.encode)(
                codec_index(codec),
                lanes_n as c_int,
                x.as_ptr(),
                x.len() as u64,
                bytes.as_mut_ptr(),
                bytes.len() as u64,
                err.as_mut_ptr(),
                err.len() as u64 - 1,
            )
        };
        match rc {
            0 => Ok(Encoded {
                bytes,
                complaint: None,
            }),
            1 => Ok(Encoded {
                bytes,
                complaint: Some(message(&err)),
            }),
            _ => Err(message(&err)),
        }
    }

    fn emu_decode(
        v: &Variant,
        codec: Codec,
        lanes_n: usize,
        src: &[u8],
        n: usize,
    ) -> Result<Vec<f32>, String> {
        // A value no decoder gives for an element it writes, so a skipped one shows up.
        let mut out = vec![f32::from_bits(0x7F80_DEAD); n];
        let mut err = vec![0 as c_char; 1024];
        // SAFETY: src and out are valid for the lengths passed; err for err_cap bytes.
        let rc = unsafe {
            (v.decode)(
                codec_index(codec),
                lanes_n as c_int,
                src.as_ptr(),
                src.len() as u64,
                n as u64,
                out.as_mut_ptr(),
                err.as_mut_ptr(),
                err.len() as u64 - 1,
            )
        };
        if rc == 0 {
            Ok(out)
        } else {
            Err(message(&err))
        }
    }

    /// Where byte `i` of an encoded segment of `n` elements is: its block (None: alignment
    /// padding) and a description.
    fn byte_place(codec: Codec, n: usize, i: usize) -> (Option<usize>, String) {
        let nb = n.div_ceil(BLOCK);
        let cb = codec.code_bytes();
        if i < nb * cb {
            return (Some(i / cb), format!("code byte {}", i % cb));
        }
        let mut at = codec.scales_offset(n);
        if i < at {
            return (None, format!("padding after the codes (byte {i})"));
        }
        for (f, &w) in codec.side_widths().iter().enumerate() {
            if i < at + nb * w {
                return (
                    Some((i - at) / w),
                    format!("side field {f} byte {}", (i - at) % w),
                );
            }
            let len = (nb * w).div_ceil(16) * 16;
            if i < at + len {
                return (
                    None,
                    format!("padding after side field {f}'s array (byte {i})"),
                );
            }
            at += len;
        }
        (None, format!("byte {i}, past the segment"))
    }

    /// Block `b`'s codes and side fields (in `Codec::side_widths` order) in a segment.
    fn block_bytes(codec: Codec, n: usize, seg: &[u8], b: usize) -> (Vec<u8>, Vec<u8>) {
        let nb = n.div_ceil(BLOCK);
        let cb = codec.code_bytes();
        let codes = seg[b * cb..(b + 1) * cb].to_vec();
        let mut side = Vec::new();
        let mut at = codec.scales_offset(n);
        for &w in codec.side_widths() {
            side.extend_from_slice(&seg[at + b * w..at + (b + 1) * w]);
            at += (nb * w).div_ceil(16) * 16;
        }
        (codes, side)
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A block's side fields in hex, one group per field (byte order as stored).
    fn side_hex(codec: Codec, side: &[u8]) -> String {
        let mut at = 0;
        let fields: Vec<String> = codec
            .side_widths()
            .iter()
            .map(|&w| {
                at += w;
                hex(&side[at - w..at])
            })
            .collect();
        fields.join(" ")
    }

    /// A block's input elements (the tail block's padding shown as the +0.0 it codes).
    fn block_input(x: &[f32], b: usize) -> String {
        let vals: Vec<String> = (b * BLOCK..(b + 1) * BLOCK)
            .map(|i| match x.get(i) {
                Some(v) => format!("{v:e}"),
                None => "(pad +0)".into(),
            })
            .collect();
        let bits: Vec<String> = (b * BLOCK..(b + 1) * BLOCK)
            .map(|i| format!("{:08x}", x.get(i).map_or(0, |v| v.to_bits())))
            .collect();
        format!("[{}]\n      bits [{}]", vals.join(", "), bits.join(" "))
    }

    /// The differing bytes of two encoded segments, by block (None: padding).
    fn encode_mismatches(
        codec: Codec,
        n: usize,
        got: &[u8],
        want: &[u8],
    ) -> BTreeMap<Option<usize>, Vec<String>> {
        assert_eq!(got.len(), want.len());
        let mut by_block: BTreeMap<Option<usize>, Vec<String>> = BTreeMap::new();
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if g != w {
                let (block, place) = byte_place(codec, n, i);
                by_block
                    .entry(block)
                    .or_default()
                    .push(format!("{place}: emulator {g:#04x}, reference {w:#04x}"));
            }
        }
        by_block
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// The differing elements of two decoded segments, by block: (element, emulator,
    /// reference).
    fn decode_mismatches(got: &[f32], want: &[f32]) -> BTreeMap<usize, Vec<(usize, f32, f32)>> {
        assert_eq!(got.len(), want.len());
        let mut by_block: BTreeMap<usize, Vec<(usize, f32, f32)>> = BTreeMap::new();
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if !same(g, w) {
                by_block.entry(i / BLOCK).or_default().push((i, g, w));
            }
        }
        by_block
    }

    fn shape(lanes_n: usize) -> String {
        match BLOCK / lanes_n {
            1 => format!("{lanes_n} elements per lane (1 lane)"),
            lanes => format!("{lanes_n} elements per lane ({lanes} lanes)"),
        }
    }

    /// Appends a block's report to `r`, or a reference to the same report made before (other
    /// variants and lane shapes tend to fail the same way).
    fn report_block(r: &mut String, seen: &mut HashSet<String>, b: usize, detail: String) {
        if seen.insert(detail.clone()) {
            r.push_str(&detail);
        } else {
            write!(r, "\n  block {b}: the same as reported above").unwrap();
        }
    }

    /// Encode with the emulator and compare; a report of what differs.
    fn check_encode(
        v: &Variant,
        codec: Codec,
        lanes_n: usize,
        x: &[f32],
        want: &[u8],
        seen: &mut HashSet<String>,
    ) -> Option<String> {
        let n = x.len();
        let head = format!("{codec} [{}] encode, {}, n={n}", v.name, shape(lanes_n));
        let got = match emu_encode(v, codec, lanes_n, x) {
            Ok(e) => e,
            Err(e) => return Some(format!("{head}: the emulator failed: {e}")),
        };
        let bad = encode_mismatches(codec, n, &got.bytes, want);
        if bad.is_empty() && got.complaint.is_none() {
            return None;
        }
        let mut r = head;
        if let Some(c) = &got.complaint {
            write!(r, "\n  lanes disagree: {c}").unwrap();
        }
        if !bad.is_empty() {
            let blocks = bad.keys().filter(|b| b.is_some()).count();
            write!(
                r,
                ": {blocks} of {} blocks differ{}",
                n.div_ceil(BLOCK),
                if bad.contains_key(&None) {
                    ", and padding"
                } else {
                    ""
                }
            )
            .unwrap();
        }
        for (block, diffs) in bad.iter().take(REPORT) {
            match block {
                Some(b) => {
                    let (gc, gs) = block_bytes(codec, n, &got.bytes, *b);
                    let (wc, ws) = block_bytes(codec, n, want, *b);
                    let detail = format!(
                        "\n  block {b} (elements {}..{}), input {}\n    {}\n    codes      emulator {}\n               reference {}\n    side bytes emulator {}, reference {}",
                        b * BLOCK,
                        ((b + 1) * BLOCK).min(n),
                        block_input(x, *b),
                        diffs.join("\n    "),
                        hex(&gc),
                        hex(&wc),
                        side_hex(codec, &gs),
                        side_hex(codec, &ws),
                    );
                    report_block(&mut r, seen, *b, detail);
                }
                None => write!(r, "\n  padding: {}", diffs.join("; ")).unwrap(),
            }
        }
        Some(r)
    }

    /// Decode the reference's bytes with the emulator and compare; a report of what differs.
    fn check_decode(
        v: &Variant,
        codec: Codec,
        lanes_n: usize,
        x: &[f32],
        encoded: &[u8],
        want: &[f32],
        seen: &mut HashSet<String>,
    ) -> Option<String> {
        let n = x.len();
        let head = format!("{codec} [{}] decode, {}, n={n}", v.name, shape(lanes_n));
        let got = match emu_decode(v, codec, lanes_n, encoded, n) {
            Ok(g) => g,
            Err(e) => return Some(format!("{head}: the emulator failed: {e}")),
        };
        let bad = decode_mismatches(&got, want);
        if bad.is_empty() {
            return None;
        }
        let mut r = format!(
            "{head}: {} of {} blocks differ",
            bad.len(),
            n.div_ceil(BLOCK)
        );
        for (b, diffs) in bad.iter().take(REPORT) {
            let (codes, side) = block_bytes(codec, n, encoded, *b);
            let mut detail = format!(
                "\n  block {b}: codes {}, side bytes {} (the reference's encoding of {})",
                hex(&codes),
                side_hex(codec, &side),
                block_input(x, *b)
            );
            for (i, g, w) in diffs {
                write!(
                    detail,
                    "\n    element {} (index {i}): emulator {g:e} ({:#010x}), reference {w:e} ({:#010x})",
                    i % BLOCK,
                    g.to_bits(),
                    w.to_bits()
                )
                .unwrap();
            }
            report_block(&mut r, seen, *b, detail);
        }
        Some(r)
    }

    /// Blocks of the reference's segment by kind, to show the data reach the codec's branches:
    /// (Hadamard-coded, poisoned, empty).
    fn coverage(codec: Codec, n: usize, seg: &[u8]) -> (usize, usize, usize) {
        let (mut hadamard, mut poisoned, mut empty) = (0, 0, 0);
        for b in 0..n.div_ceil(BLOCK) {
            let (_, side) = block_bytes(codec, n, seg, b);
            let (h, p, e) = match codec {
                Codec::Int8V2 | Codec::Int6V2 => {
                    let w = u32::from_le_bytes([side[0], side[1], side[2], side[3]]);
                    (w & 1 != 0, w == codec::POISON_SCALE24, w & 0xFFFF_FF00 == 0)
                }
                Codec::Fp4E2M1 => (false, side[0] == 0xFF, side[0] == 0),
                _ => {
                    let f = u16::from_le_bytes([side[0], side[1]]);
                    let flagged =
                        f & codec::FLAG_BIT != 0 && (codec.is_adaptive() || codec == Codec::Int4V2);
                    (flagged, f == codec::POISON_SCALE, f & !codec::FLAG_BIT == 0)
                }
            };
            hadamard += usize::from(h);
            poisoned += usize::from(p);
            empty += usize::from(e);
        }
        (hadamard, poisoned, empty)
    }

    fn elements() -> &'static [f32] {
        static DATA: OnceLock<Vec<f32>> = OnceLock::new();
        DATA.get_or_init(codec_data::elements)
    }

    /// Every check of one codec; panics with the reports when any fails.
    fn check(codec: Codec) {
        let start = Instant::now();
        let all = elements();
        let mut failures = Vec::new();
        let mut seen = HashSet::new();
        for v in &VARIANTS {
            let mut layout = [0u32; 3];
            // SAFETY: layout holds the 3 words the driver writes.
            let rc = unsafe { (v.layout)(codec_index(codec), layout.as_mut_ptr()) };
            let mut want_layout = vec![codec.code_bytes() as u32];
            want_layout.extend(codec.side_widths().iter().map(|&w| w as u32));
            want_layout.resize(3, 0);
            if rc != 0 || layout[..] != want_layout[..] {
                failures.push(format!(
                    "{codec} [{}]: the codec source's layout (code bytes, side widths) is {layout:?} (rc {rc}), the reference's {want_layout:?}",
                    v.name
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        for len in [all.len(), 19] {
            let x = &all[..len];
            let mut want = vec![0u8; codec.encoded_len(len)];
            codec::encode(codec, x, &mut want);
            let mut decoded = vec![0f32; len];
            codec::decode(codec, &want, &mut decoded);
            if len == all.len() {
                let (h, p, e) = coverage(codec, len, &want);
                println!(
                    "{codec}: {} blocks, of which {h} Hadamard-coded, {p} poisoned, {e} empty",
                    len.div_ceil(BLOCK)
                );
                if codec.is_adaptive() || (codec.is_v2() && codec != Codec::Fp4E2M1) {
                    assert!(h > 0, "{codec}: the data never reach the Hadamard branch");
                }
                assert!(
                    p > 0 && e > 0,
                    "{codec}: the data miss poisoned or empty blocks"
                );
            }
            for v in &VARIANTS {
                for lanes_n in ENCODE_SHAPES {
                    failures.extend(check_encode(v, codec, lanes_n, x, &want, &mut seen));
                }
                for lanes_n in DECODE_SHAPES {
                    failures.extend(check_decode(
                        v, codec, lanes_n, x, &want, &decoded, &mut seen,
                    ));
                }
            }
        }
        let runs = 2 * VARIANTS.len() * (ENCODE_SHAPES.len() + DECODE_SHAPES.len());
        if failures.is_empty() {
            println!(
                "{codec}: {runs} emulated encodes/decodes match the reference bit for bit ({:.1} s)",
                start.elapsed().as_secs_f64()
            );
        } else {
            for f in &failures {
                println!("{f}\n");
            }
            panic!(
                "{codec}: {} of {runs} emulated encodes/decodes differ from the reference (reports above)",
                failures.len()
            );
        }
    }

    macro_rules! codec_tests {
        ($($name:ident => $codec:expr,)*) => {
            $(
                #[test]
                fn $name() {
                    check($codec);
                }
            )*
        };
    }

    codec_tests! {
        fp8 => Codec::Fp8E4M3,
        q8 => Codec::Int8,
        q6 => Codec::Int6,
        q4 => Codec::Int4,
        q8a => Codec::Int8Adaptive,
        q6a => Codec::Int6Adaptive,
        q4a => Codec::Int4Adaptive,
        q8v2 => Codec::Int8V2,
        q6v2 => Codec::Int6V2,
        q4v2 => Codec::Int4V2,
        fp4 => Codec::Fp4E2M1,
    }

    /// The comparisons see a single flipped byte or bit, and NaN payloads do not count.
    #[test]
    fn harness_detects_mismatches() {
        let codec = Codec::Int6;
        let x = &codec_data::adversarial_blocks()[..3 * BLOCK + 5];
        let n = x.len();
        let mut want = vec![0u8; codec.encoded_len(n)];
        codec::encode(codec, x, &mut want);
        let got = emu_encode(&VARIANTS[0], codec, 8, x).expect("emulated encode");
        assert!(got.complaint.is_none());
        assert!(encode_mismatches(codec, n, &got.bytes, &want).is_empty());
        assert!(check_encode(&VARIANTS[0], codec, 8, x, &want, &mut HashSet::new()).is_none());

        // A code byte of block 2, a side byte of block 1, a padding byte.
        let mut bad = got.bytes.clone();
        bad[2 * codec.code_bytes() + 5] ^= 0x10;
        bad[codec.scales_offset(n) + 2 + 1] ^= 0x01;
        let pad = codec.encoded_len(n) - 1;
        assert_eq!(byte_place(codec, n, pad).0, None);
        bad[pad] ^= 0x80;
        let m = encode_mismatches(codec, n, &bad, &want);
        assert_eq!(
            m.keys().copied().collect::<Vec<_>>(),
            vec![None, Some(1), Some(2)]
        );
        let at = 2 * codec.code_bytes() + 5;
        assert_eq!(
            m[&Some(2)],
            vec![format!(
                "code byte 5: emulator {:#04x}, reference {:#04x}",
                bad[at], want[at]
            )]
        );
        assert!(m[&Some(1)][0].starts_with("side field 0 byte 1:"));

        // Decode: one bit of one element; NaN against another NaN is equal.
        let mut decoded = vec![0f32; n];
        codec::decode(codec, &want, &mut decoded);
        let got = emu_decode(&VARIANTS[0], codec, 8, &want, n).expect("emulated decode");
        assert!(decode_mismatches(&got, &decoded).is_empty());
        let mut bad = got.clone();
        bad[BLOCK + 8] = f32::from_bits(bad[BLOCK + 8].to_bits() ^ 1);
        let m = decode_mismatches(&bad, &decoded);
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(m[&1].len(), 1);
        assert_eq!(m[&1][0].0, BLOCK + 8);
        assert!(same(f32::NAN, f32::from_bits(0xFFC0_0001)));
        assert!(!same(f32::NAN, 0.0));
        assert!(!same(0.0, -0.0));

        // The emulator refuses what the GPU code cannot do.
        assert!(emu_decode(&VARIANTS[0], codec, 32, &want, n).is_err());
        assert!(emu_encode(&VARIANTS[0], codec, 4, x).is_err());
    }
}
