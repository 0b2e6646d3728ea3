//! One rank's fault, seen by every rank: what the faulty rank gets, what its peers get, and
//! whether the group survives. At 2, 4 and 8 ranks (as many as the harness runs).

use std::time::{Duration, Instant};

use allreduce::fused::{norm_tolerance, reference};
use allreduce::{
    Aftermath, AllReduceOptions, Communicator, DType, Error, FusedConfig, FusedPattern,
    FusedWorkspace, GroupConfig, HostBytes, Strategy,
};

use crate::check::{self, Reference};
use crate::data::gauss;
use crate::harness::{FusedOutcome, FusedRankArgs, Harness, RankArgs};
use crate::suite::expect_all;

const WORLDS: [usize; 3] = [2, 4, 8];
const DTYPE: DType = DType::BF16;
const HIDDEN: usize = 64;
const MAX_TOKENS: usize = 4;

fn worlds(h: &dyn Harness) -> impl Iterator<Item = usize> + '_ {
    WORLDS.into_iter().filter(|&w| w <= h.max_world())
}

/// A group of `world` with deadline `timeout`, and its fused workspaces.
fn fused_group(
    h: &dyn Harness,
    world: usize,
    timeout: Duration,
) -> Result<(Vec<Communicator>, Vec<FusedWorkspace>), String> {
    let comms = h
        .group(GroupConfig::new(world).max_bytes(1 << 20).timeout(timeout))
        .map_err(|e| format!("group of {world}: {e}"))?;
    let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(MAX_TOKENS, HIDDEN, DTYPE))
        .map_err(|e| format!("fused workspaces of {world}: {e}"))?;
    Ok((comms, ws))
}

/// A valid fused call on every rank: its own input, one residual and one gamma for all (so
/// every output is the same on every rank); an all-reduce alone takes neither.
fn fused_step(
    world: usize,
    pattern: FusedPattern,
    tokens: usize,
    strategy: Strategy,
    seed: u64,
) -> Vec<FusedRankArgs> {
    let norm = pattern.has_norm();
    (0..world)
        .map(|r| FusedRankArgs {
            pattern,
            tokens,
            input: gauss(tokens * HIDDEN, DTYPE, seed, r),
            residual: norm.then(|| gauss(tokens * HIDDEN, DTYPE, seed + 1, 0)),
            gamma: norm.then(|| gauss(HIDDEN, DTYPE, seed + 2, 0)),
            strategy,
        })
        .collect()
}

/// Every rank succeeded with the same bytes, and those are core's reference: the all-reduce
/// and residual outputs bit for bit, the norm within its tolerance.
fn check_fused(
    outcomes: &[FusedOutcome],
    step: &[FusedRankArgs],
    what: &str,
) -> Result<(), String> {
    let mut first: Option<&[HostBytes; 3]> = None;
    for (r, o) in outcomes.iter().enumerate() {
        let o = o.as_ref().map_err(|e| format!("{what}: rank {r}: {e}"))?;
        match first {
            None => first = Some(o),
            Some(f) if f.iter().zip(o).any(|(a, b)| a.as_slice() != b.as_slice()) => {
                return Err(format!("{what}: rank {r} differs from rank 0"))
            }
            Some(_) => {}
        }
    }
    let [ar, res, norm] = first.ok_or_else(|| format!("{what}: no ranks"))?;
    let a = &step[0];
    let inputs: Vec<&[u8]> = step.iter().map(|s| s.input.as_slice()).collect();
    let want = reference(
        &inputs,
        DTYPE,
        a.tokens,
        HIDDEN,
        a.residual.as_ref().map(|b| b.as_slice()),
        a.gamma.as_ref().map(|b| b.as_slice()),
        1e-6,
        a.pattern,
        None,
        0.0,
    );
    if ar.as_slice() != want.allreduce.as_slice() {
        return Err(format!("{what}: allreduce_out is not the reference's"));
    }
    if res.as_slice() != want.residual.as_slice() {
        return Err(format!("{what}: residual_out is not the reference's"));
    }
    for i in 0..want.norm.len() / DTYPE.size() {
        let (got, r) = (
            DTYPE.load_f32(norm.as_slice(), i),
            DTYPE.load_f32(&want.norm, i),
        );
        if (got - r).abs() > norm_tolerance(DTYPE, r) {
            return Err(format!("{what}: norm_out[{i}] = {got}, the reference {r}"));
        }
    }
    Ok(())
}

/// After a fault the group is intact: a plain exact all-reduce is right on every rank.
fn plain_call_is_exact(h: &dyn Harness, comms: &[Communicator], what: &str) -> Result<(), String> {
    let inputs: Vec<HostBytes> = (0..comms.len()).map(|r| gauss(999, DTYPE, 5, r)).collect();
    let step: Vec<RankArgs> = inputs
        .iter()
        .map(|b| RankArgs::new(b.clone(), DTYPE, false, AllReduceOptions::default()))
        .collect();
    let results = h.run(comms, &[step]);
    let what = format!("{what}: the plain call after it");
    let out = check::bitwise_equal(&results[0], &what)?;
    check::exact(out, &Reference::new(&inputs, DTYPE), &what)
}

/// Every rank but `bad` got `PeerRejected` naming `bad` and carrying its error's text; `bad`
/// got its own error (which `own` accepts), and nothing needs a rebuild.
fn expect_refusal(
    outcomes: &[FusedOutcome],
    bad: usize,
    own: impl Fn(&Error) -> bool,
    what: &str,
) -> Result<(), String> {
    let theirs = match &outcomes[bad] {
        Err(e) if own(e) && e.aftermath() == Aftermath::Intact => e.to_string(),
        other => return Err(format!("{what}: the refusing rank {bad} got {other:?}")),
    };
    for (r, o) in outcomes.iter().enumerate().filter(|&(r, _)| r != bad) {
        match o {
            Err(Error::PeerRejected { rank, reason, .. }) if *rank == bad && *reason == theirs => {}
            other => {
                return Err(format!(
                    "{what}: rank {r} got {other:?}, not rank {bad}'s refusal ({theirs})"
                ))
            }
        }
    }
    Ok(())
}

/// One rank's invalid fused call (more tokens than the workspace takes; a norm without
/// gamma) is refused on that rank, and every peer's matching call fails at once with
/// `PeerRejected` carrying the reason, instead of waiting out the deadline and aborting the
/// group: the next fused calls (one-shot and two-shot, the skipped call's buffer reused) and
/// a plain call are right.
pub fn fused_refusal_reaches_every_peer(h: &dyn Harness) -> Result<(), String> {
    let timeout = Duration::from_secs(5);
    for world in worlds(h) {
        let (comms, ws) = fused_group(h, world, timeout)?;
        let (too_many, no_gamma) = (world - 1, 0);
        let norm = FusedPattern::ResidualRmsNorm;
        let mut over = fused_step(world, norm, 2, Strategy::Auto, 1);
        over[too_many].tokens = MAX_TOKENS + 1;
        over[too_many].input = gauss((MAX_TOKENS + 1) * HIDDEN, DTYPE, 1, too_many);
        over[too_many].residual = Some(gauss((MAX_TOKENS + 1) * HIDDEN, DTYPE, 2, 0));
        let mut gammaless = fused_step(world, norm, 2, Strategy::Auto, 3);
        gammaless[no_gamma].gamma = None;
        let steps = vec![
            over,
            gammaless,
            fused_step(world, norm, 3, Strategy::OneShot, 5),
            fused_step(world, FusedPattern::AllReduce, 4, Strategy::TwoShot, 7),
            fused_step(world, norm, 1, Strategy::TwoShot, 9),
        ];
        let start = Instant::now();
        let results = h.run_fused(&comms, &ws, &steps);
        let took = start.elapsed();
        let what = |k: usize| format!("world {world}, fused call {k}");
        expect_refusal(
            &results[0],
            too_many,
            |e| matches!(e, Error::WorkspaceExceeded { what: "tokens", .. }),
            &what(0),
        )?;
        expect_refusal(
            &results[1],
            no_gamma,
            |e| matches!(e, Error::InvalidArgument(m) if m.contains("gamma")),
            &what(1),
        )?;
        for k in 2..steps.len() {
            check_fused(&results[k], &steps[k], &what(k))?;
        }
        if took >= timeout {
            return Err(format!(
                "world {world}: the sequence took {took:?}, a peer waited out the {timeout:?} deadline"
            ));
        }
        plain_call_is_exact(h, &comms, &format!("world {world}"))?;
    }
    Ok(())
}

/// Ranks whose fused calls differ only in the pattern, or in the token count, are all refused
/// with `RankMismatch` ("a fused call's shape") on every backend (the GPU kernels compare the
/// pattern in their call tags, and the host the same descriptor), and the group stays usable.
pub fn fused_pattern_mismatch_is_refused(h: &dyn Harness) -> Result<(), String> {
    for world in worlds(h) {
        let (comms, ws) = fused_group(h, world, Duration::from_secs(5))?;
        let norm = FusedPattern::ResidualRmsNorm;
        let mut patterns = fused_step(world, norm, 2, Strategy::OneShot, 11);
        patterns[world - 1].pattern = FusedPattern::AllReduce;
        patterns[world - 1].gamma = None;
        patterns[world - 1].residual = None;
        let mut tokens = fused_step(world, FusedPattern::AllReduce, 2, Strategy::OneShot, 13);
        tokens[0].tokens = 1;
        tokens[0].input = gauss(HIDDEN, DTYPE, 13, 0);
        let steps = vec![
            patterns,
            fused_step(world, norm, 2, Strategy::OneShot, 15),
            tokens,
            fused_step(world, norm, 4, Strategy::TwoShot, 17),
        ];
        let results = h.run_fused(&comms, &ws, &steps);
        for k in [0, 2] {
            let what = format!("world {world}, fused call {k}");
            let errors: Vec<_> = results[k]
                .iter()
                .map(|o| {
                    o.as_ref()
                        .map(|_| HostBytes::zeroed(0))
                        .map_err(Clone::clone)
                })
                .collect();
            expect_all(&errors, &what, |_, e| {
                matches!(
                    e,
                    Error::RankMismatch {
                        what: "a fused call's shape",
                        ..
                    }
                ) && e.aftermath() == Aftermath::Intact
            })?;
            check_fused(
                &results[k + 1],
                &steps[k + 1],
                &format!("{what}: the call after it"),
            )?;
        }
        plain_call_is_exact(h, &comms, &format!("world {world}"))?;
    }
    Ok(())
}

/// Ranks that never call: the peers fail within the deadline, and a `Timeout` names exactly
/// the ranks that did not arrive, says the group is aborted and must be built again, and
/// gives the wait in readable units; every later call is `Aborted`.
pub fn timeout_names_the_missing_ranks(h: &dyn Harness) -> Result<(), String> {
    let timeout = Duration::from_millis(300);
    for world in worlds(h) {
        let comms = h
            .group(GroupConfig::new(world).timeout(timeout))
            .map_err(|e| format!("group of {world}: {e}"))?;
        let missing: Vec<usize> = if world == 2 {
            vec![1]
        } else {
            vec![1, world - 1]
        };
        let inputs: Vec<HostBytes> = (0..world).map(|r| gauss(100, DType::F32, 3, r)).collect();
        let options = AllReduceOptions::default().strategy(Strategy::OneShot);
        let mut step: Vec<RankArgs> = inputs
            .iter()
            .map(|b| RankArgs::new(b.clone(), DType::F32, false, options))
            .collect();
        for a in &mut step {
            a.sync_after = true;
        }
        for &r in &missing {
            step[r].skip = true;
        }
        let results = h.run(&comms, &[step.clone(), step]);
        let list: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
        let names = match list.len() {
            1 => format!("rank {}", list[0]),
            _ => format!("ranks {}", list.join(", ")),
        };
        let mut named = 0;
        for (r, o) in results[0].iter().enumerate() {
            if missing.contains(&r) {
                continue;
            }
            match o {
                Err(e @ Error::Timeout { .. }) => {
                    let text = e.to_string();
                    let wanted = format!("({names} never arrived)");
                    if !text.contains(&wanted) {
                        return Err(format!("world {world}: rank {r}: {text} (wanted {wanted})"));
                    }
                    if !text.contains(" ms in call") || !text.contains("aborted") {
                        return Err(format!("world {world}: rank {r}: {text}"));
                    }
                    named += 1;
                }
                Err(Error::Aborted { .. }) => {}
                other => return Err(format!("world {world}: rank {r}: {other:?}")),
            }
        }
        if named == 0 {
            return Err(format!("world {world}: no rank reported the timeout"));
        }
        for (r, o) in results[1].iter().enumerate() {
            if !missing.contains(&r) && !matches!(o, Err(Error::Aborted { .. })) {
                return Err(format!("world {world}: rank {r} after the timeout: {o:?}"));
            }
        }
    }
    Ok(())
}
