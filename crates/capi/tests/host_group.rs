//! The C functions on the host backend, called from Rust exactly as C would call them: a
//! 4-rank in-process group with one thread per rank, results checked bit for bit against
//! the rank-order f32 sum (and, for the lossy codecs and the fused call, against the Rust
//! facade on the same input), and every refusal's code, message and aftermath.

use std::ffi::{c_int, c_void, CStr};
use std::ptr;

use allreduce::{
    AllReduceOptions, BackendKind, Codec, Communicator, DType, GroupConfig, HostBytes, Precision,
    Strategy,
};
use allreduce_c::*;

const WORLD: usize = 4;

/// A handle that may cross threads: it is a token, not a pointer to anything.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Comm(ar_comm_t);
// SAFETY: the library looks handles up in a thread-safe table; nothing dereferences them.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

fn last_error() -> String {
    // SAFETY: ar_last_error returns a valid C string.
    unsafe { CStr::from_ptr(ar_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// `code`, and a non-empty message if it is a failure.
fn checked(code: ar_result_t) -> ar_result_t {
    if code != ar_result_t::AR_SUCCESS {
        assert!(!last_error().is_empty(), "{code:?} left no message");
    }
    code
}

fn config(max_bytes: usize) -> ar_config_t {
    ar_config_t {
        size: std::mem::size_of::<ar_config_t>(),
        max_bytes,
        // A test that hangs fails in seconds instead.
        timeout_ms: 5000,
    }
}

fn host_group(world: usize, max_bytes: usize) -> Vec<Comm> {
    let mut comms = vec![ptr::null_mut(); world];
    let cfg = config(max_bytes);
    // SAFETY: `comms` has `world` slots; no devlist; a valid config.
    let code = unsafe {
        ar_comm_init_all(
            comms.as_mut_ptr(),
            ar_backend_t::AR_BACKEND_HOST as c_int,
            world as c_int,
            ptr::null(),
            &cfg,
        )
    };
    assert_eq!(code, ar_result_t::AR_SUCCESS, "{}", last_error());
    comms.into_iter().map(Comm).collect()
}

fn destroy(comms: &[Comm]) {
    for c in comms {
        assert_eq!(ar_comm_destroy(c.0), ar_result_t::AR_SUCCESS);
    }
}

/// Run `f(rank)` on one thread per rank; results in rank order.
fn on_ranks<R: Send>(world: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..world).map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn dtype_code(d: DType) -> c_int {
    (match d {
        DType::F32 => ar_dtype_t::AR_FLOAT32,
        DType::F16 => ar_dtype_t::AR_FLOAT16,
        DType::BF16 => ar_dtype_t::AR_BFLOAT16,
    }) as c_int
}

/// Rank `rank`'s input: values whose sums round (so the accumulation order shows), with
/// some -0.0 (whose sum must stay -0.0).
fn input(dtype: DType, n: usize, rank: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let v = match (i + 3 * rank) % 29 {
            0 => -0.0,
            k => ((i * 37 + rank * 11) % 101) as f32 / 7.0 - 6.5 + k as f32 * 1.0e-3,
        };
        dtype.store_f32(b.as_mut_slice(), i, v);
    }
    b
}

/// The host backend's arithmetic: f32 accumulation in rank order from rank 0's value, one
/// rounding into the dtype.
fn expected(dtype: DType, n: usize, world: usize) -> Vec<u8> {
    let inputs: Vec<HostBytes> = (0..world).map(|r| input(dtype, n, r)).collect();
    let mut out = vec![0u8; n * dtype.size()];
    for i in 0..n {
        let mut acc = dtype.load_f32(inputs[0].as_slice(), i);
        for x in &inputs[1..] {
            acc += dtype.load_f32(x.as_slice(), i);
        }
        dtype.store_f32(&mut out, i, acc);
    }
    out
}

/// One all-reduce on one rank through the C entry point; the output bytes.
fn reduce_on(
    comm: Comm,
    rank: usize,
    dtype: DType,
    n: usize,
    precision: c_int,
    strategy: c_int,
    in_place: bool,
) -> Result<Vec<u8>, (ar_result_t, String)> {
    let mut send = input(dtype, n, rank);
    let mut recv = HostBytes::zeroed(n * dtype.size());
    let send_ptr = send.as_mut_slice().as_mut_ptr() as *mut c_void;
    let recv_ptr = if in_place {
        send_ptr
    } else {
        recv.as_mut_slice().as_mut_ptr() as *mut c_void
    };
    // SAFETY: both buffers hold `n` elements of `dtype` and outlive the (blocking) call.
    let code = checked(unsafe {
        ar_all_reduce(
            send_ptr,
            recv_ptr,
            n,
            dtype_code(dtype),
            ar_red_op_t::AR_SUM as c_int,
            precision,
            strategy,
            comm.0,
            ptr::null_mut(),
        )
    });
    if code != ar_result_t::AR_SUCCESS {
        return Err((code, last_error()));
    }
    Ok(if in_place { send } else { recv }.as_slice().to_vec())
}

fn exact_round_is_right(comms: &[Comm], dtype: DType, n: usize) {
    let want = expected(dtype, n, comms.len());
    let got = on_ranks(comms.len(), |r| {
        reduce_on(
            comms[r],
            r,
            dtype,
            n,
            ar_precision_t::AR_EXACT as c_int,
            ar_strategy_t::AR_STRATEGY_AUTO as c_int,
            false,
        )
    });
    for (r, g) in got.into_iter().enumerate() {
        assert!(g.as_ref() == Ok(&want), "rank {r}: {:?}", g.err());
    }
}

#[test]
fn sums_equal_the_rank_order_f32_sum_bit_for_bit() {
    let comms = host_group(WORLD, 1 << 20);
    let strategies = [
        ar_strategy_t::AR_STRATEGY_AUTO,
        ar_strategy_t::AR_STRATEGY_ONESHOT,
        ar_strategy_t::AR_STRATEGY_TWOSHOT,
    ];
    for dtype in DType::ALL {
        // 1013: not a multiple of any shard or vector size; 0: an empty call.
        for n in [1013, 4096, 0] {
            let want = expected(dtype, n, WORLD);
            for strategy in strategies {
                for in_place in [false, true] {
                    let got = on_ranks(WORLD, |r| {
                        reduce_on(
                            comms[r],
                            r,
                            dtype,
                            n,
                            ar_precision_t::AR_EXACT as c_int,
                            strategy as c_int,
                            in_place,
                        )
                    });
                    for (r, g) in got.into_iter().enumerate() {
                        let case = format!("{dtype} n={n} {strategy:?} in_place={in_place}");
                        let g = g.unwrap_or_else(|e| panic!("{case} rank {r}: {e:?}"));
                        assert!(g == want, "{case}: rank {r} differs");
                    }
                }
            }
        }
    }
    destroy(&comms);
}

#[test]
fn lossy_precisions_equal_the_rust_facade_bit_for_bit() {
    let n = 8192;
    let comms = host_group(WORLD, 1 << 20);
    let rust = Communicator::new_group(BackendKind::Host, GroupConfig::new(WORLD)).unwrap();
    let codecs = [
        (ar_precision_t::AR_FP8, Codec::Fp8E4M3),
        (ar_precision_t::AR_Q8, Codec::Int8),
        (ar_precision_t::AR_Q6, Codec::Int6),
        (ar_precision_t::AR_Q4, Codec::Int4),
        (ar_precision_t::AR_Q8A, Codec::Int8Adaptive),
        (ar_precision_t::AR_Q6A, Codec::Int6Adaptive),
        (ar_precision_t::AR_Q4A, Codec::Int4Adaptive),
        (ar_precision_t::AR_Q8V2, Codec::Int8V2),
        (ar_precision_t::AR_Q6V2, Codec::Int6V2),
        (ar_precision_t::AR_Q4V2, Codec::Int4V2),
        (ar_precision_t::AR_FP4, Codec::Fp4E2M1),
    ];
    for dtype in [DType::F16, DType::BF16] {
        let mut previous: Option<Vec<u8>> = None;
        for (code, codec) in codecs {
            let got = on_ranks(WORLD, |r| {
                reduce_on(
                    comms[r],
                    r,
                    dtype,
                    n,
                    code as c_int,
                    ar_strategy_t::AR_STRATEGY_QUANTIZED as c_int,
                    false,
                )
                .unwrap()
            });
            let want = on_ranks(WORLD, |r| {
                let send = input(dtype, n, r);
                let mut recv = HostBytes::zeroed(n * dtype.size());
                let options = AllReduceOptions::default()
                    .precision(Precision::Lossy(codec))
                    .strategy(Strategy::QuantizedTwoShot);
                rust[r]
                    .all_reduce(send.view(dtype), recv.view_mut(dtype), &options)
                    .unwrap();
                recv.as_slice().to_vec()
            });
            assert_eq!(got, want, "{dtype} {codec}");
            // Each code must reach its own codec: neighbouring codecs give other bytes.
            assert_ne!(previous.as_ref(), Some(&got[0]), "{dtype} {codec}");
            previous = Some(got[0].clone());
        }
    }
    destroy(&comms);
}

#[test]
fn queries_describe_the_communicator() {
    let comms = host_group(WORLD, 1 << 16);
    let rust = Communicator::new_group(BackendKind::Host, GroupConfig::new(WORLD)).unwrap();
    for (r, c) in comms.iter().enumerate() {
        let (mut count, mut rank, mut device, mut backend, mut splits) = (0, 0, 0, 0, 0);
        let (mut align, mut max) = (0usize, 0usize);
        // SAFETY: every out-pointer is a writable local.
        unsafe {
            assert_eq!(ar_comm_count(c.0, &mut count), ar_result_t::AR_SUCCESS);
            assert_eq!(ar_comm_user_rank(c.0, &mut rank), ar_result_t::AR_SUCCESS);
            assert_eq!(ar_comm_device(c.0, &mut device), ar_result_t::AR_SUCCESS);
            assert_eq!(ar_comm_backend(c.0, &mut backend), ar_result_t::AR_SUCCESS);
            assert_eq!(ar_comm_alignment(c.0, &mut align), ar_result_t::AR_SUCCESS);
            assert_eq!(ar_comm_max_bytes(c.0, &mut max), ar_result_t::AR_SUCCESS);
            let code = ar_comm_splits_large_calls(c.0, &mut splits);
            assert_eq!(code, ar_result_t::AR_SUCCESS);
        }
        assert_eq!((count, rank), (WORLD as c_int, r as c_int));
        assert_eq!(device, -1);
        assert_eq!(backend, ar_backend_t::AR_BACKEND_HOST as c_int);
        assert_eq!((align, max, splits), (16, 1 << 16, 0));
        // The host backend has no vendor window: NULL and 0; a NULL out-pointer is refused.
        let (mut addr, mut bytes) = (std::ptr::dangling_mut::<std::ffi::c_void>(), 1usize);
        // SAFETY: both are writable.
        let code = unsafe { ar_comm_vendor_window(c.0, &mut addr, &mut bytes) };
        assert_eq!(code, ar_result_t::AR_SUCCESS);
        assert_eq!((addr as usize, bytes), (0, 0));
        // SAFETY: NULL is refused before anything is written.
        let code = unsafe { ar_comm_vendor_window(c.0, &mut addr, std::ptr::null_mut()) };
        assert_eq!(code, ar_result_t::AR_INVALID_USAGE);
    }
    // What Auto picks is the facade's choice, as a strategy code.
    let code_of = |s: Strategy| {
        (match s {
            Strategy::Auto => ar_strategy_t::AR_STRATEGY_AUTO,
            Strategy::OneShot => ar_strategy_t::AR_STRATEGY_ONESHOT,
            Strategy::TwoShot => ar_strategy_t::AR_STRATEGY_TWOSHOT,
            Strategy::QuantizedTwoShot => ar_strategy_t::AR_STRATEGY_QUANTIZED,
            Strategy::HierarchicalQuantized => ar_strategy_t::AR_STRATEGY_HIERARCHICAL,
            Strategy::Vendor => ar_strategy_t::AR_STRATEGY_VENDOR,
            Strategy::VendorSymmetric => ar_strategy_t::AR_STRATEGY_VENDOR_SYMMETRIC,
            Strategy::PushOneShot => ar_strategy_t::AR_STRATEGY_PUSH_ONESHOT,
        }) as c_int
    };
    for (count, precision, codec) in [
        (16usize, ar_precision_t::AR_EXACT, None),
        (1 << 22, ar_precision_t::AR_EXACT, None),
        (1 << 22, ar_precision_t::AR_Q4, Some(Codec::Int4)),
    ] {
        let mut chosen = -1;
        // SAFETY: `chosen` is writable.
        let code = unsafe {
            ar_comm_select(
                comms[0].0,
                count,
                ar_dtype_t::AR_FLOAT16 as c_int,
                precision as c_int,
                &mut chosen,
            )
        };
        assert_eq!(code, ar_result_t::AR_SUCCESS);
        let p = codec.map_or(Precision::Exact, Precision::Lossy);
        assert_eq!(chosen, code_of(rust[0].select(count, DType::F16, p)));
    }
    let mut version = 0;
    // SAFETY: writable.
    assert_eq!(
        unsafe { ar_get_version(&mut version) },
        ar_result_t::AR_SUCCESS
    );
    assert_eq!(version, AR_VERSION_CODE);
    destroy(&comms);
}

/// Every rank makes the call `bad(rank)` describes; ranks for which it returns `None` make a
/// valid call. Returns each rank's code and message.
fn round_with(
    comms: &[Comm],
    n: usize,
    bad: impl Fn(usize, &mut Call) + Sync,
) -> Vec<(ar_result_t, String)> {
    on_ranks(comms.len(), |r| {
        // Room for a misaligned view of `n` elements.
        let mut send = HostBytes::zeroed((n + 4) * 4);
        let mut recv = HostBytes::zeroed((n + 4) * 4);
        let mut call = Call {
            send: send.as_mut_slice().as_mut_ptr() as *const c_void,
            recv: recv.as_mut_slice().as_mut_ptr() as *mut c_void,
            count: n,
            dtype: ar_dtype_t::AR_FLOAT32 as c_int,
            op: ar_red_op_t::AR_SUM as c_int,
            precision: ar_precision_t::AR_EXACT as c_int,
            strategy: ar_strategy_t::AR_STRATEGY_AUTO as c_int,
        };
        bad(r, &mut call);
        // SAFETY: the pointers stay inside buffers of n + 4 f32 that outlive the call (or are
        // null, which is refused); counts past them are refused before anything is read.
        let code = checked(unsafe {
            ar_all_reduce(
                call.send,
                call.recv,
                call.count,
                call.dtype,
                call.op,
                call.precision,
                call.strategy,
                comms[r].0,
                ptr::null_mut(),
            )
        });
        (code, last_error())
    })
}

struct Call {
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    precision: c_int,
    strategy: c_int,
}

#[test]
fn refused_arguments_have_their_code_and_message_and_leave_the_group_intact() {
    use ar_result_t::*;
    // 4 KiB: 1024 f32 per call at most.
    let comms = host_group(WORLD, 4096);
    let n = 256;
    type Bad = fn(usize, &mut Call);
    let cases: Vec<(&str, usize, Bad, ar_result_t, &str)> = vec![
        (
            "unknown dtype",
            1,
            |_, c| c.dtype = 3,
            AR_INVALID_ARGUMENT,
            "dtype 3",
        ),
        (
            "null sendbuff",
            2,
            |_, c| c.send = ptr::null(),
            AR_INVALID_ARGUMENT,
            "sendbuff is null",
        ),
        (
            "null recvbuff",
            0,
            |_, c| c.recv = ptr::null_mut(),
            AR_INVALID_ARGUMENT,
            "recvbuff is null",
        ),
        (
            "product",
            3,
            |_, c| c.op = 1,
            AR_INVALID_ARGUMENT,
            "reduction 1",
        ),
        (
            "unknown precision",
            1,
            |_, c| c.precision = 12,
            AR_INVALID_ARGUMENT,
            "precision 12",
        ),
        (
            "unknown strategy",
            2,
            |_, c| c.strategy = -1,
            AR_INVALID_ARGUMENT,
            "strategy -1",
        ),
        (
            "count overflow",
            0,
            |_, c| c.count = usize::MAX / 2,
            AR_INVALID_ARGUMENT,
            "address space",
        ),
        (
            "misaligned",
            3,
            |_, c| c.send = c.send.wrapping_byte_add(4),
            AR_MISALIGNED,
            "not aligned to 16",
        ),
        (
            "overlap",
            1,
            |_, c| c.recv = c.send.cast_mut().wrapping_byte_add(16),
            AR_INVALID_ARGUMENT,
            "overlap",
        ),
        (
            "codec on f32",
            0,
            |_, c| c.precision = ar_precision_t::AR_Q8 as c_int,
            AR_UNSUPPORTED_CODEC,
            "q8",
        ),
        (
            "quantized without a codec",
            2,
            |_, c| c.strategy = ar_strategy_t::AR_STRATEGY_QUANTIZED as c_int,
            AR_STRATEGY_UNAVAILABLE,
            "Lossy",
        ),
        (
            "vendor on the host",
            3,
            |_, c| c.strategy = ar_strategy_t::AR_STRATEGY_VENDOR as c_int,
            AR_STRATEGY_UNAVAILABLE,
            "vendor",
        ),
    ];
    for (what, culprit, bad, code, message) in cases {
        let results = round_with(&comms, n, |r, c| {
            if r == culprit {
                bad(r, c)
            }
        });
        for (r, (got, text)) in results.iter().enumerate() {
            if r == culprit {
                assert_eq!(*got, code, "{what}: rank {r}: {text}");
                assert!(text.contains(message), "{what}: {text:?} lacks {message:?}");
            } else {
                // The peers hear of it at once, with the reason, instead of timing out.
                assert_eq!(*got, AR_PEER_REJECTED, "{what}: rank {r}: {text}");
                assert!(
                    text.contains(&format!("rank {culprit} rejected")) && text.contains(message),
                    "{what}: rank {r}: {text}"
                );
            }
        }
        exact_round_is_right(&comms, DType::F32, n);
    }

    // Every rank over the 4 KiB maximum: each refuses its own call.
    let results = round_with(&comms, 1025, |_, _| {});
    for (r, (got, text)) in results.iter().enumerate() {
        assert_eq!(*got, AR_TOO_LARGE, "rank {r}: {text}");
        assert!(text.contains("4100 bytes exceed"), "{text}");
    }
    exact_round_is_right(&comms, DType::F32, n);

    // Ranks that disagree on the count: all told, nothing written, group intact.
    let results = round_with(&comms, n, |r, c| c.count = if r == 2 { n - 4 } else { n });
    for (r, (got, text)) in results.iter().enumerate() {
        assert_eq!(*got, AR_RANK_MISMATCH, "rank {r}: {text}");
    }
    exact_round_is_right(&comms, DType::BF16, 999);
    destroy(&comms);
}

/// One rank refuses its call through `ar_reject` (as a binding does for what it checks
/// itself) while the others call `ar_all_reduce`; each rank's code and message.
fn round_with_reject(
    comms: &[Comm],
    culprit: usize,
    code: c_int,
    message: Option<&CStr>,
) -> Vec<(ar_result_t, String)> {
    on_ranks(comms.len(), |r| {
        if r != culprit {
            return match reduce_on(
                comms[r],
                r,
                DType::F32,
                256,
                ar_precision_t::AR_EXACT as c_int,
                ar_strategy_t::AR_STRATEGY_AUTO as c_int,
                false,
            ) {
                Ok(_) => (ar_result_t::AR_SUCCESS, String::new()),
                Err(failed) => failed,
            };
        }
        let text = message.map_or(ptr::null(), CStr::as_ptr);
        // SAFETY: a live handle; the message is NULL or a C string; the host takes no stream.
        let got = checked(unsafe { ar_reject(comms[r].0, code, text, ptr::null_mut()) });
        (got, last_error())
    })
}

#[test]
fn a_refusal_the_caller_makes_reaches_the_peers_with_its_message() {
    use ar_result_t::*;
    let comms = host_group(WORLD, 4096);
    let cases: [(usize, ar_result_t, Option<&CStr>, &str); 3] = [
        (
            2,
            AR_INVALID_ARGUMENT,
            Some(c"x is a list; pass a numpy array"),
            "rank 2 rejected its arguments in call 0: invalid argument: x is a list; pass a \
             numpy array",
        ),
        (
            0,
            AR_DTYPE_MISMATCH,
            Some(c"x is float32, out is float16"),
            "rank 0 rejected its arguments in call 2: invalid argument: input and output dtypes \
             differ: x is float32, out is float16",
        ),
        (3, AR_MISALIGNED, None, "buffer address not aligned"),
    ];
    for (culprit, code, message, want) in cases {
        for (r, (got, text)) in round_with_reject(&comms, culprit, code as c_int, message)
            .into_iter()
            .enumerate()
        {
            if r == culprit {
                assert_eq!(got, AR_SUCCESS, "rank {r}: {text}");
            } else {
                assert_eq!(got, AR_PEER_REJECTED, "rank {r}: {text}");
                assert!(text.contains(want), "rank {r}: {text:?} lacks {want:?}");
            }
        }
        // The group stays in step and exact.
        exact_round_is_right(&comms, DType::F32, 256);
    }

    // A code that is no argument refusal, or a bad handle, is malformed and reaches no peer:
    // the exact round right after finds every rank in step.
    for code in [AR_SUCCESS, AR_PEER_REJECTED, AR_TIMEOUT, AR_INVALID_USAGE] {
        // SAFETY: a live handle and a C string.
        let got = unsafe { ar_reject(comms[1].0, code as c_int, c"no".as_ptr(), ptr::null_mut()) };
        assert_eq!(checked(got), AR_INVALID_USAGE, "{code:?}");
        assert!(last_error().contains("not the code of a refused argument"));
    }
    // SAFETY: a made-up handle is looked up, never dereferenced.
    let got = unsafe {
        ar_reject(
            0xdead as ar_comm_t,
            AR_INVALID_ARGUMENT as c_int,
            ptr::null(),
            ptr::null_mut(),
        )
    };
    assert_eq!(checked(got), AR_INVALID_USAGE);
    exact_round_is_right(&comms, DType::F32, 256);
    destroy(&comms);
}

#[test]
fn bad_handles_and_required_pointers_are_invalid_usage() {
    use ar_result_t::*;
    let comms = host_group(2, 1 << 16);
    let gone = host_group(2, 1 << 16);
    destroy(&gone);
    let made_up = 0xdead_beef_usize as ar_comm_t;
    let mut x = 0f32;
    let px = &mut x as *mut f32 as *mut c_void;
    for bad in [ptr::null_mut(), gone[0].0, gone[1].0, made_up] {
        // SAFETY: the handle is refused before the (valid) buffer is looked at.
        let code = checked(unsafe { ar_all_reduce(px, px, 1, 7, 0, 0, 0, bad, ptr::null_mut()) });
        assert_eq!(code, AR_INVALID_USAGE);
        assert!(
            last_error().contains("is not a live ar_comm_t"),
            "{}",
            last_error()
        );
        let mut v = 0;
        // SAFETY: writable.
        assert_eq!(
            checked(unsafe { ar_comm_count(bad, &mut v) }),
            AR_INVALID_USAGE
        );
        // SAFETY: a null stream on the host.
        let code = unsafe { ar_comm_synchronize(bad, ptr::null_mut()) };
        assert_eq!(checked(code), AR_INVALID_USAGE);
        assert_eq!(checked(ar_comm_destroy(bad)), AR_INVALID_USAGE);
    }
    // Null out-pointers.
    // SAFETY: null is refused.
    unsafe {
        assert_eq!(
            checked(ar_comm_count(comms[0].0, ptr::null_mut())),
            AR_INVALID_USAGE
        );
        assert_eq!(
            checked(ar_comm_alignment(comms[0].0, ptr::null_mut())),
            AR_INVALID_USAGE
        );
        assert_eq!(checked(ar_get_version(ptr::null_mut())), AR_INVALID_USAGE);
        let code = ar_comm_select(comms[0].0, 1, 7, 0, ptr::null_mut());
        assert_eq!(checked(code), AR_INVALID_USAGE);
    }
    assert!(
        last_error().contains("strategy is null"),
        "{}",
        last_error()
    );
    // A handle still works after all that, and a synchronize on the host has nothing to
    // report.
    let mut rank = -1;
    // SAFETY: writable; null stream.
    unsafe {
        assert_eq!(ar_comm_user_rank(comms[1].0, &mut rank), AR_SUCCESS);
        assert_eq!(ar_comm_synchronize(comms[1].0, ptr::null_mut()), AR_SUCCESS);
    }
    assert_eq!(rank, 1);
    exact_round_is_right(&comms, DType::F16, 77);
    destroy(&comms);
}

#[test]
fn group_construction_refusals() {
    use ar_result_t::*;
    let mut comms = [ptr::null_mut(); 4];
    let host = ar_backend_t::AR_BACKEND_HOST as c_int;
    let init = |comms: &mut [ar_comm_t],
                backend: c_int,
                n: c_int,
                devlist: *const c_int,
                cfg: *const ar_config_t| {
        // SAFETY: `comms` has room for 4 handles and every test passes n <= 4; devlist and
        // cfg are null or valid.
        checked(unsafe { ar_comm_init_all(comms.as_mut_ptr(), backend, n, devlist, cfg) })
    };
    assert_eq!(
        init(&mut comms, host, 0, ptr::null(), ptr::null()),
        AR_INVALID_CONFIG
    );
    assert!(last_error().contains("world size 0"), "{}", last_error());
    assert_eq!(
        init(&mut comms, host, -2, ptr::null(), ptr::null()),
        AR_INVALID_ARGUMENT
    );
    assert_eq!(
        init(&mut comms, 7, 2, ptr::null(), ptr::null()),
        AR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("backend 7"), "{}", last_error());
    let devices = [0, -1];
    assert_eq!(
        init(&mut comms, host, 2, devices.as_ptr(), ptr::null()),
        AR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("device -1"), "{}", last_error());
    let mut short = config(0);
    short.size = 8;
    assert_eq!(
        init(&mut comms, host, 2, ptr::null(), &short),
        AR_INVALID_USAGE
    );
    // SAFETY: null is refused.
    let code = unsafe { ar_comm_init_all(ptr::null_mut(), host, 2, ptr::null(), ptr::null()) };
    assert_eq!(checked(code), AR_INVALID_USAGE);
    assert_eq!(comms, [ptr::null_mut(); 4], "nothing written on failure");

    // GPU backends: not compiled in (the default build), or compiled with no driver here.
    for (kind, code) in [
        (BackendKind::Cuda, ar_backend_t::AR_BACKEND_CUDA),
        (BackendKind::Rocm, ar_backend_t::AR_BACKEND_ROCM),
    ] {
        let got = init(&mut comms, code as c_int, 2, [0, 0].as_ptr(), ptr::null());
        if !kind.is_compiled() {
            assert_eq!(got, AR_BACKEND_NOT_BUILT, "{kind}");
        } else if got == AR_SUCCESS {
            // A machine with the GPU and its driver.
            destroy(&[Comm(comms[0]), Comm(comms[1])]);
        } else {
            assert_ne!(got, AR_INTERNAL_ERROR, "{kind}: {}", last_error());
        }
    }
}

#[test]
fn destroying_one_rank_leaves_the_others_usable_until_their_own_destroy() {
    let comms = host_group(2, 1 << 16);
    assert_eq!(ar_comm_destroy(comms[0].0), ar_result_t::AR_SUCCESS);
    assert_eq!(ar_comm_destroy(comms[0].0), ar_result_t::AR_INVALID_USAGE);
    let mut rank = -1;
    // SAFETY: writable.
    let code = unsafe { ar_comm_user_rank(comms[1].0, &mut rank) };
    assert_eq!((code, rank), (ar_result_t::AR_SUCCESS, 1));
    assert_eq!(ar_comm_destroy(comms[1].0), ar_result_t::AR_SUCCESS);
}

/// `ar_comm_abort` from another thread releases ranks waiting for a peer that never comes
/// (well before their 5 s deadline), with `AR_ABORTED`; the aborted handle is gone and the
/// other ranks' later calls are `AR_ABORTED` too.
#[test]
fn abort_releases_waiting_ranks_and_destroys_its_handle() {
    let comms = host_group(3, 1 << 16);
    let start = std::time::Instant::now();
    let waiting = std::thread::scope(|s| {
        let calls: Vec<_> = [0usize, 2]
            .map(|r| {
                let c = comms[r];
                s.spawn(move || reduce_on(c, r, DType::F32, 64, 0, 1, false))
            })
            .into_iter()
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(ar_comm_abort(comms[1].0), ar_result_t::AR_SUCCESS);
        calls
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        start.elapsed() < std::time::Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    for w in waiting {
        let (code, msg) = w.expect_err("aborted");
        assert_eq!(code, ar_result_t::AR_ABORTED);
        assert!(msg.contains("rank 1 aborted"), "{msg}");
    }
    assert_eq!(ar_comm_abort(comms[1].0), ar_result_t::AR_INVALID_USAGE);
    let again = reduce_on(comms[0], 0, DType::F32, 64, 0, 1, false);
    assert_eq!(again.unwrap_err().0, ar_result_t::AR_ABORTED);
    assert_eq!(ar_comm_destroy(comms[0].0), ar_result_t::AR_SUCCESS);
    assert_eq!(ar_comm_destroy(comms[2].0), ar_result_t::AR_SUCCESS);
}

#[derive(Clone, Copy)]
struct Workspace(ar_fused_workspace_t);
// SAFETY: a token, as `Comm`.
unsafe impl Send for Workspace {}
unsafe impl Sync for Workspace {}

fn fused_args(tokens: usize) -> ar_fused_args_t {
    ar_fused_args_t {
        size: std::mem::size_of::<ar_fused_args_t>(),
        pattern: ar_fused_pattern_t::AR_FUSED_RESIDUAL_RMSNORM as c_int,
        strategy: ar_strategy_t::AR_STRATEGY_AUTO as c_int,
        tokens,
        input: ptr::null(),
        allreduce_out: ptr::null_mut(),
        residual_in: ptr::null(),
        residual_out: ptr::null_mut(),
        gamma: ptr::null(),
        norm_out: ptr::null_mut(),
        quant_out: ptr::null_mut(),
        scale_out: ptr::null_mut(),
        scale_in: ptr::null(),
        eps: 1e-6,
        weight_bias: 0.0,
    }
}

#[test]
fn fused_residual_rmsnorm_equals_the_reference_and_refuses_what_it_cannot_take() {
    use ar_result_t::*;
    let (world, max_tokens, hidden, dtype) = (2, 8, 64, DType::BF16);
    let comms = host_group(world, 1 << 16);
    let handles: Vec<ar_comm_t> = comms.iter().map(|c| c.0).collect();
    let mut ws = vec![ptr::null_mut(); world];
    // SAFETY: `ws` and `handles` hold `world` handles.
    let code = unsafe {
        ar_fused_workspace_create(
            ws.as_mut_ptr(),
            handles.as_ptr(),
            world as c_int,
            max_tokens,
            hidden,
            dtype_code(dtype),
        )
    };
    assert_eq!(code, AR_SUCCESS, "{}", last_error());
    let ws: Vec<Workspace> = ws.into_iter().map(Workspace).collect();

    let tokens = 5;
    let n = tokens * hidden;
    let residual = input(dtype, n, 9);
    let gamma = input(dtype, hidden, 5);
    let inputs: Vec<HostBytes> = (0..world).map(|r| input(dtype, n, r)).collect();
    let refs: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
    let want = allreduce::fused::reference(
        &refs,
        dtype,
        tokens,
        hidden,
        Some(residual.as_slice()),
        Some(gamma.as_slice()),
        1e-6,
        allreduce::FusedPattern::ResidualRmsNorm,
        None,
        0.0,
    );
    let run = |r: usize, tokens: usize, comm: Comm, w: Workspace| {
        let mut res_out = HostBytes::zeroed(n * dtype.size());
        let mut norm_out = HostBytes::zeroed(n * dtype.size());
        let mut args = fused_args(tokens);
        args.input = inputs[r].as_slice().as_ptr() as *const c_void;
        args.residual_in = residual.as_slice().as_ptr() as *const c_void;
        args.residual_out = res_out.as_mut_slice().as_mut_ptr() as *mut c_void;
        args.gamma = gamma.as_slice().as_ptr() as *const c_void;
        args.norm_out = norm_out.as_mut_slice().as_mut_ptr() as *mut c_void;
        // SAFETY: every buffer holds `n` (gamma: `hidden`) elements and outlives the call.
        let code = checked(unsafe { ar_all_reduce_fused(&args, w.0, comm.0, ptr::null_mut()) });
        (
            code,
            last_error(),
            res_out.as_slice().to_vec(),
            norm_out.as_slice().to_vec(),
        )
    };
    let got = on_ranks(world, |r| run(r, tokens, comms[r], ws[r]));
    for (r, (code, text, res, norm)) in got.into_iter().enumerate() {
        assert_eq!(code, AR_SUCCESS, "rank {r}: {text}");
        assert!(res == want.residual, "rank {r}: residual_out differs");
        assert!(norm == want.norm, "rank {r}: norm_out differs");
    }

    // Refusals every rank meets alike.
    let got = on_ranks(world, |r| run(r, max_tokens + 1, comms[r], ws[r]));
    for (code, text, ..) in got {
        assert_eq!(code, AR_WORKSPACE_EXCEEDED, "{text}");
    }
    let swapped = on_ranks(world, |r| run(r, tokens, comms[r], ws[1 - r]));
    for (code, text, ..) in swapped {
        assert_eq!(code, AR_INVALID_ARGUMENT, "{text}");
        assert!(text.contains("another group or rank"), "{text}");
    }
    // Rank 0's own refusals (by this library's checks) reach rank 1's matching call, which
    // fails with AR_PEER_REJECTED carrying the reason instead of waiting for the deadline.
    let mut args = fused_args(tokens);
    args.pattern = 9;
    let mut small = fused_args(tokens);
    small.size = 16;
    let bad: [(*const ar_fused_args_t, ar_result_t, &str); 3] = [
        (&args, AR_INVALID_ARGUMENT, "fused pattern 9"),
        (&small, AR_INVALID_USAGE, "ar_fused_args_t.size is 16"),
        (ptr::null(), AR_INVALID_USAGE, "args is null"),
    ];
    for (args, want, text) in bad {
        let args = args as usize;
        let got = on_ranks(world, |r| match r {
            // SAFETY: refused (pattern, size, null) before any buffer is used.
            0 => unsafe {
                let code = ar_all_reduce_fused(
                    args as *const ar_fused_args_t,
                    ws[0].0,
                    comms[0].0,
                    ptr::null_mut(),
                );
                (checked(code), last_error())
            },
            _ => {
                let (code, text, ..) = run(r, tokens, comms[r], ws[r]);
                (code, text)
            }
        });
        assert_eq!(got[0].0, want, "{}", got[0].1);
        assert!(got[0].1.contains(text), "{}", got[0].1);
        assert_eq!(got[1].0, AR_PEER_REJECTED, "{}", got[1].1);
        assert!(
            got[1].1.contains("rank 0") && got[1].1.contains(text),
            "{}",
            got[1].1
        );
    }
    // A binding's own refusal, with its message.
    let got = on_ranks(world, |r| match r {
        // SAFETY: a NUL-terminated reason.
        0 => unsafe {
            let why = c"x has shape (3, 60)".as_ptr();
            let code = ar_fused_reject(why, ws[0].0, comms[0].0, ptr::null_mut());
            (code, String::new())
        },
        _ => {
            let (code, text, ..) = run(r, tokens, comms[r], ws[r]);
            (code, text)
        }
    });
    assert_eq!(got[0].0, AR_SUCCESS);
    assert_eq!(got[1].0, AR_PEER_REJECTED, "{}", got[1].1);
    assert!(got[1].1.contains("x has shape (3, 60)"), "{}", got[1].1);
    // A workspace needs the whole group, in rank order.
    let reversed = [handles[1], handles[0]];
    let mut more = [ptr::null_mut(); 2];
    // SAFETY: two handles each way.
    let code =
        unsafe { ar_fused_workspace_create(more.as_mut_ptr(), reversed.as_ptr(), 2, 8, 64, 9) };
    assert_eq!(checked(code), AR_INVALID_ARGUMENT);
    // SAFETY: one handle each way.
    let code =
        unsafe { ar_fused_workspace_create(more.as_mut_ptr(), handles.as_ptr(), 1, 8, 64, 9) };
    assert_eq!(checked(code), AR_INVALID_CONFIG);
    // hidden 60 is not a whole number of 16-byte vectors of bf16.
    // SAFETY: two handles each way.
    let code =
        unsafe { ar_fused_workspace_create(more.as_mut_ptr(), handles.as_ptr(), 2, 8, 60, 9) };
    assert_eq!(checked(code), AR_INVALID_CONFIG);
    assert_eq!(more, [ptr::null_mut(); 2], "nothing written on failure");

    // The group still computes after all that.
    let got = on_ranks(world, |r| run(r, tokens, comms[r], ws[r]));
    assert!(got.iter().all(|g| g.0 == AR_SUCCESS && g.3 == want.norm));
    for w in &ws {
        assert_eq!(ar_fused_workspace_destroy(w.0), AR_SUCCESS);
        assert_eq!(ar_fused_workspace_destroy(w.0), AR_INVALID_USAGE);
    }
    destroy(&comms);
}

#[test]
fn error_strings_are_static_and_name_the_kind() {
    let s = |code: c_int| {
        // SAFETY: never null, static.
        unsafe { CStr::from_ptr(ar_get_error_string(code)) }
            .to_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(s(0), "success");
    assert_eq!(
        s(ar_result_t::AR_MISALIGNED as c_int),
        "buffer address not aligned"
    );
    assert_eq!(s(-5), "unknown result code");
    // Nothing failed on this thread yet.
    assert_eq!(last_error(), "");
}

#[test]
fn graph_registration_on_the_host_has_nothing_to_register_and_checks_its_handles() {
    let comms = host_group(WORLD, 1 << 16);
    let raw: Vec<ar_comm_t> = comms.iter().map(|c| c.0).collect();
    for c in &comms {
        // SAFETY: live handles; the host backend has no graphs, so nothing is ever captured.
        assert_eq!(
            checked(ar_comm_set_graph_registration(c.0, 1)),
            ar_result_t::AR_SUCCESS
        );
    }
    let mut count = usize::MAX;
    // SAFETY: WORLD live handles and a writable count.
    let code = unsafe { ar_comm_register_graph_buffers(raw.as_ptr(), WORLD as c_int, &mut count) };
    assert_eq!(checked(code), ar_result_t::AR_SUCCESS);
    assert_eq!(count, 0);
    // Not the whole group, or out of order: refused, and the group still sums exactly.
    let swapped = [raw[1], raw[0], raw[2], raw[3]];
    for (handles, n) in [(&raw[..], 2), (&swapped[..], WORLD as c_int)] {
        // SAFETY: as above.
        let code = unsafe { ar_comm_register_graph_buffers(handles.as_ptr(), n, &mut count) };
        assert_eq!(checked(code), ar_result_t::AR_INVALID_ARGUMENT);
        assert!(
            last_error().contains("every rank of one in-process group"),
            "{}",
            last_error()
        );
    }
    // SAFETY: null pointers are refused, not read.
    let code = unsafe { ar_comm_register_graph_buffers(ptr::null(), 1, &mut count) };
    assert_eq!(checked(code), ar_result_t::AR_INVALID_USAGE);
    for c in &comms {
        assert_eq!(
            checked(ar_comm_set_graph_registration(c.0, 0)),
            ar_result_t::AR_SUCCESS
        );
    }
    exact_round_is_right(&comms, DType::F32, 1000);
    destroy(&comms);
}

/// Registration of the caller's memory through the C ABI: calls on inputs inside it are
/// exact, a registration is forgotten once, and bad ranges are refused with the group going
/// on. (The host backend reads each rank's own input either way; the GPU path that reads in
/// place, and its offset checks, run in the conformance list on the GPU.)
#[test]
fn registered_caller_memory_is_read_in_place_and_checked() {
    let comms = host_group(WORLD, 1 << 16);
    let raw: Vec<ar_comm_t> = comms.iter().map(|c| c.0).collect();
    let (dtype, n) = (DType::F32, 1000);
    let bytes = 64 + n * 4;
    // One registered buffer per rank, holding the rank's input at byte 64.
    let mut mems: Vec<Vec<u128>> = (0..WORLD).map(|_| vec![0u128; bytes / 16 + 1]).collect();
    for (r, m) in mems.iter_mut().enumerate() {
        let src = input(dtype, n, r);
        // SAFETY: the buffer holds 64 + n * 4 bytes.
        unsafe {
            ptr::copy_nonoverlapping(
                src.as_slice().as_ptr(),
                (m.as_mut_ptr() as *mut u8).add(64),
                n * 4,
            )
        };
    }
    let ptrs: Vec<*mut c_void> = mems
        .iter_mut()
        .map(|m| m.as_mut_ptr() as *mut c_void)
        .collect();
    let mut id = 0u64;
    // SAFETY: WORLD handles and pointers, each to `bytes` bytes; `id` writable.
    let code =
        unsafe { ar_comm_register(raw.as_ptr(), WORLD as c_int, ptrs.as_ptr(), bytes, &mut id) };
    assert_eq!(checked(code), ar_result_t::AR_SUCCESS);
    let addrs: Vec<usize> = ptrs.iter().map(|&p| p as usize).collect();
    let call = |at: usize| {
        on_ranks(WORLD, |r| {
            let mut out = HostBytes::zeroed(n * 4);
            // SAFETY: `n` f32 inside rank r's registered buffer; `out` holds n f32.
            let code = checked(unsafe {
                ar_all_reduce(
                    (addrs[r] + at) as *const c_void as *mut c_void,
                    out.as_mut_slice().as_mut_ptr() as *mut c_void,
                    n,
                    dtype_code(dtype),
                    ar_red_op_t::AR_SUM as c_int,
                    ar_precision_t::AR_EXACT as c_int,
                    ar_strategy_t::AR_STRATEGY_ONESHOT as c_int,
                    comms[r].0,
                    ptr::null_mut(),
                )
            });
            (code, out.as_slice().to_vec(), last_error())
        })
    };
    let want = expected(dtype, n, WORLD);
    for (r, (code, out, _)) in call(64).into_iter().enumerate() {
        assert_eq!(code, ar_result_t::AR_SUCCESS, "rank {r}");
        assert_eq!(out, want, "rank {r}");
    }
    // SAFETY: live handles.
    let code = unsafe { ar_comm_deregister(raw.as_ptr(), WORLD as c_int, id) };
    assert_eq!(checked(code), ar_result_t::AR_SUCCESS);
    // SAFETY: as above.
    let again = unsafe { ar_comm_deregister(raw.as_ptr(), WORLD as c_int, id) };
    assert_eq!(checked(again), ar_result_t::AR_INVALID_ARGUMENT);
    // Misaligned, or a pointer per rank missing: refused.
    let odd: Vec<*mut c_void> = ptrs
        .iter()
        .map(|&p| (p as usize + 8) as *mut c_void)
        .collect();
    // SAFETY: as above (the library refuses before reading the memory).
    let code = unsafe { ar_comm_register(raw.as_ptr(), WORLD as c_int, odd.as_ptr(), 64, &mut id) };
    assert_eq!(checked(code), ar_result_t::AR_MISALIGNED);
    // SAFETY: null ptrs are refused, not read.
    let code = unsafe { ar_comm_register(raw.as_ptr(), WORLD as c_int, ptr::null(), 64, &mut id) };
    assert_eq!(checked(code), ar_result_t::AR_INVALID_USAGE);
    exact_round_is_right(&comms, DType::F32, 1000);
    destroy(&comms);
}
