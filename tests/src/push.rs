//! The push one-shot (`Strategy::PushOneShot`) on every backend: the host's reference and the
//! GPU's Lamport kernel (push.h) must give the same bits, which are the one-shot's on inputs
//! whose -0.0 are taken as +0.0 (computed here independently of either), and ranks that
//! disagree on a call must all get the same error and go on working.

use allreduce::{AllReduceOptions, DType, Error, GroupConfig, HostBytes, Precision, Strategy};

use crate::check;
use crate::data::gauss;
use crate::harness::{Harness, Outcome, RankArgs};

fn push() -> AllReduceOptions {
    AllReduceOptions::default().strategy(Strategy::PushOneShot)
}

/// Worlds to cover: 2, 4 and 8 (the kernels specialised for them) and 3 (the generic one),
/// as far as the harness goes.
fn worlds(h: &dyn Harness) -> Vec<usize> {
    [2, 3, 4, 8]
        .into_iter()
        .filter(|&w| w <= h.max_world())
        .collect()
}

/// Gaussian inputs with signed zeros planted: element i is -0.0 on every rank where
/// i % 7 == 3 (the one place the push rule changes a result), on rank 0 only where
/// i % 7 == 5, and +0.0 on rank 0 where i % 7 == 6.
fn inputs(n: usize, dtype: DType, world: usize, seed: u64) -> Vec<HostBytes> {
    (0..world)
        .map(|r| {
            let mut b = gauss(n, dtype, seed, r);
            for i in 0..n {
                match i % 7 {
                    3 => dtype.store_f32(b.as_mut_slice(), i, -0.0),
                    5 if r == 0 => dtype.store_f32(b.as_mut_slice(), i, -0.0),
                    6 if r == 0 => dtype.store_f32(b.as_mut_slice(), i, 0.0),
                    _ => {}
                }
            }
            b
        })
        .collect()
}

/// The definition: f32 sum in rank order from rank 0's value, each input's -0.0 as +0.0,
/// rounded once (nearest even) to the dtype.
fn expected(inputs: &[HostBytes], dtype: DType) -> HostBytes {
    let n = inputs[0].len() / dtype.size();
    let mut out = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let plus = |b: &HostBytes| {
            let x = dtype.load_f32(b.as_slice(), i);
            if x == 0.0 {
                0.0
            } else {
                x
            }
        };
        let mut acc = plus(&inputs[0]);
        for b in &inputs[1..] {
            acc += plus(b);
        }
        dtype.store_f32(out.as_mut_slice(), i, acc);
    }
    out
}

fn same_bytes(out: &HostBytes, want: &HostBytes, dtype: DType, what: &str) -> Result<(), String> {
    let e = dtype.size();
    match (0..want.len() / e)
        .find(|&i| out.as_slice()[i * e..][..e] != want.as_slice()[i * e..][..e])
    {
        None if out.len() == want.len() => Ok(()),
        None => Err(format!("{what}: {} bytes, want {}", out.len(), want.len())),
        Some(i) => Err(format!(
            "{what}: element {i} is {:?} (bits {:x?}), want {:?} (bits {:x?})",
            dtype.load_f32(out.as_slice(), i),
            &out.as_slice()[i * e..][..e],
            dtype.load_f32(want.as_slice(), i),
            &want.as_slice()[i * e..][..e],
        )),
    }
}

/// Lengths with every tail (a 16-byte vector holds 4 f32 or 8 f16/bf16), small to the
/// largest call the strategy takes, at 2, 3, 4 and 8 ranks; all three dtypes in one sequence
/// (the receive buffers are shared by calls of every dtype), out of place and in place, with
/// the staged one-shot beside it: its bits must equal the push's but where every rank's input
/// is -0.0 (there it keeps -0.0, the push +0.0).
pub fn push_oneshot_exact_every_length(h: &dyn Harness) -> Result<(), String> {
    for world in worlds(h) {
        let comms = h
            .group(GroupConfig::new(world).max_bytes(1 << 20))
            .map_err(|e| format!("group of {world}: {e}"))?;
        let largest = |d: DType| Strategy::PUSH_MAX_BYTES / d.size();
        let mut lengths: Vec<Option<usize>> = [0, 1, 2, 3, 5, 7, 8, 9, 15, 17, 33, 1000, 4097]
            .into_iter()
            .map(Some)
            .collect();
        // The largest per dtype (None: the dtype's own), and one just below it.
        lengths.extend([Some(65_535), None]);
        for (k, &len) in lengths.iter().enumerate() {
            let mut steps = Vec::new();
            let mut names = Vec::new();
            let mut wants = Vec::new();
            for dtype in DType::ALL {
                let n = len.unwrap_or_else(|| largest(dtype));
                let ins = inputs(n, dtype, world, 40 + k as u64);
                let want = expected(&ins, dtype);
                for (in_place, strategy) in [
                    (false, Strategy::PushOneShot),
                    (true, Strategy::PushOneShot),
                    (false, Strategy::OneShot),
                ] {
                    let o = AllReduceOptions::default().strategy(strategy);
                    steps.push(
                        ins.iter()
                            .map(|b| RankArgs::new(b.clone(), dtype, in_place, o))
                            .collect::<Vec<_>>(),
                    );
                    names.push((
                        format!("world {world} n {n} {dtype} {strategy} in_place={in_place}"),
                        strategy,
                        dtype,
                    ));
                    wants.push(want.clone());
                }
            }
            let results = h.run(&comms, &steps);
            for ((outcomes, (what, strategy, dtype)), want) in
                results.iter().zip(&names).zip(&wants)
            {
                let out = check::bitwise_equal(outcomes, what)?;
                if *strategy == Strategy::PushOneShot {
                    same_bytes(out, want, *dtype, what)?;
                    continue;
                }
                // The one-shot: -0.0 where every input is, the push's bits elsewhere.
                let mut one = want.clone();
                let n = want.len() / dtype.size();
                for i in (3..n).step_by(7) {
                    dtype.store_f32(one.as_mut_slice(), i, -0.0);
                }
                same_bytes(out, &one, *dtype, what)?;
            }
        }
    }
    Ok(())
}

fn expect_all(
    outcomes: &[Outcome],
    what: &str,
    pred: impl Fn(usize, &Error) -> bool,
) -> Result<(), String> {
    for (r, o) in outcomes.iter().enumerate() {
        match o {
            Err(e) if pred(r, e) && e.aftermath() == allreduce::Aftermath::Intact => {}
            Err(e) => return Err(format!("{what}: rank {r} got the wrong error: {e:?}")),
            Ok(_) => return Err(format!("{what}: rank {r} succeeded")),
        }
    }
    Ok(())
}

/// Ranks that disagree on a push call (lengths that differ only in the last vector's tail,
/// dtypes of the same size, one rank's call too large for the strategy, a precision it
/// refuses) all fail it with the same kind of error, and the next push call is exact.
pub fn push_oneshot_mismatch_is_reported_and_harmless(h: &dyn Harness) -> Result<(), String> {
    let world = 4.min(h.max_world()).max(2);
    let comms = h
        .group(GroupConfig::new(world).max_bytes(1 << 20))
        .map_err(|e| e.to_string())?;
    let n = 1001;
    let valid = inputs(n, DType::BF16, world, 77);
    let want = expected(&valid, DType::BF16);
    let good: Vec<RankArgs> = valid
        .iter()
        .map(|b| RankArgs::new(b.clone(), DType::BF16, false, push()))
        .collect();
    type Expect = Box<dyn Fn(usize, &Error) -> bool>;
    let mut cases: Vec<(&str, Vec<RankArgs>, Expect)> = Vec::new();

    // 1001 and 1002 bf16 elements are both 126 vectors: only the tail tells them apart.
    let mut s = good.clone();
    s[1] = RankArgs::new(gauss(n + 1, DType::BF16, 1, 1), DType::BF16, false, push());
    cases.push((
        "lengths differ in the last vector",
        s,
        Box::new(|_, e| matches!(e, Error::RankMismatch { what: "length", .. })),
    ));

    let mut s = good.clone();
    s[world - 1] = RankArgs::new(gauss(n, DType::F16, 2, 1), DType::F16, false, push());
    cases.push((
        "dtypes differ",
        s,
        Box::new(|_, e| matches!(e, Error::RankMismatch { what: "dtype", .. })),
    ));

    let big = Strategy::PUSH_MAX_BYTES / 2 + 8;
    let mut s = good.clone();
    s[0] = RankArgs::new(gauss(big, DType::BF16, 3, 0), DType::BF16, false, push());
    cases.push((
        "one rank's call larger than the strategy takes",
        s,
        Box::new(|r, e| {
            if r == 0 {
                matches!(e, Error::TooLarge { max, .. } if *max == Strategy::PUSH_MAX_BYTES)
            } else {
                matches!(e, Error::PeerRejected { rank: 0, .. })
            }
        }),
    ));

    let mut s = good.clone();
    s.iter_mut().for_each(|a| {
        a.options = push().precision(Precision::Lossy(allreduce::Codec::Int8));
    });
    cases.push((
        "a lossy precision",
        s,
        Box::new(|_, e| {
            matches!(
                e,
                Error::StrategyUnavailable {
                    strategy: Strategy::PushOneShot,
                    ..
                }
            )
        }),
    ));

    // Each case, then a valid call, twice in a row (the second round finds the receive
    // buffers as the first round's skipped calls left them), each waited for, so a backend
    // that reports at the next synchronisation attributes each error to its own call.
    let mut steps = Vec::new();
    for _ in 0..2 {
        for (_, s, _) in &cases {
            steps.push(s.clone());
            steps.push(good.clone());
        }
    }
    steps.iter_mut().flatten().for_each(|a| a.sync_after = true);
    let results = h.run(&comms, &steps);
    for (k, (what, _, pred)) in cases.iter().cycle().take(2 * cases.len()).enumerate() {
        expect_all(&results[2 * k], what, pred)?;
        let after = format!("valid call after `{what}`");
        let out = check::bitwise_equal(&results[2 * k + 1], &after)?;
        same_bytes(out, &want, DType::BF16, &after)?;
    }
    Ok(())
}
