//! The TCP bootstrap across real processes. Each test spawns this test binary again as the
//! ranks: with `ALLREDUCE_BOOTSTRAP_CHILD=1` the `child` test below acts as one rank (reading
//! RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT like a torchrun worker) and runs the scenario in
//! `ALLREDUCE_BOOTSTRAP_SCENARIO`; without it, `child` does nothing.
//!
//! A child prints `CHILD-OK ...` and exits 0 on success, or prints `CHILD-ERR <ms> <error>`
//! and exits 3, the way an application would report a failed rendezvous.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use allreduce_bootstrap::{Secret, TcpBootstrap, TcpBootstrapConfig};
use allreduce_core::{Bootstrap, Error};

const CHILD_ENV: &str = "ALLREDUCE_BOOTSTRAP_CHILD";
const SCENARIO_ENV: &str = "ALLREDUCE_BOOTSTRAP_SCENARIO";
/// Exit status of a child whose rank failed with an error (as opposed to a panic: 101).
const FAILED: i32 = 3;
/// Longest any child may run before the test calls it hung and kills it.
const HANG_LIMIT: Duration = Duration::from_secs(20);
/// The rank the parent kills in the `killed_while_waiting` scenario.
const VICTIM_ENV: &str = "ALLREDUCE_BOOTSTRAP_VICTIM";
/// Where the survivors of a killed rank meet again (a new rendezvous, ranks renumbered).
const REBUILD_PORT_ENV: &str = "ALLREDUCE_BOOTSTRAP_REBUILD_PORT";

// ------------------------------------------------------------------------------------------
// The child side.

#[test]
fn child() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let scenario = std::env::var(SCENARIO_ENV).expect("scenario");
    let start = Instant::now();
    match run_scenario(&scenario) {
        Ok(summary) => println!("CHILD-OK {summary}"),
        Err(e) => {
            println!("CHILD-ERR {} {e}", start.elapsed().as_millis());
            std::process::exit(FAILED);
        }
    }
}

/// Bytes rank `rank` contributes to round `round`: distinct per rank and round, of varying
/// length (including empty).
fn message(rank: usize, round: usize) -> Vec<u8> {
    let len = (rank * 37 + round * 11) % 200;
    (0..len)
        .map(|i| (rank * 31 + round * 7 + i) as u8)
        .collect()
}

fn run_scenario(scenario: &str) -> Result<String, Error> {
    let mut boot = TcpBootstrap::from_env()?;
    let (rank, world) = (boot.rank(), boot.world_size());
    assert_eq!(
        boot.local_rank(),
        std::env::var("LOCAL_RANK").ok().map(|v| v.parse().unwrap())
    );
    for line in boot.refused_connections() {
        println!("REFUSED {line}");
    }
    match scenario {
        "collectives" => {
            for round in 0..5 {
                let got = boot.all_gather(&message(rank, round))?;
                let want: Vec<Vec<u8>> = (0..world).map(|r| message(r, round)).collect();
                assert_eq!(got, want, "all_gather round {round}");
            }
            for root in 0..world {
                let got = boot.broadcast(root, &message(rank, 100 + root))?;
                assert_eq!(got, message(root, 100 + root), "broadcast from {root}");
            }
            // A message of 1 MiB from the last rank (several TCP segments, a large tag).
            let big: Vec<u8> = (0..1 << 20).map(|i| (i * 13 % 251) as u8).collect();
            let mine = if rank == world - 1 {
                big.clone()
            } else {
                vec![]
            };
            assert_eq!(boot.broadcast(world - 1, &mine)?, big);
            Ok(format!("rank {rank} of {world}, {} calls", boot.calls()))
        }
        "out_of_order" => {
            // Rank 1 calls a different collective: everyone is told, nobody gets data.
            let r = if rank == 1 {
                boot.broadcast(0, b"x").map(|_| ())
            } else {
                boot.all_gather(b"y").map(|_| ())
            };
            match r {
                Err(Error::RankMismatch { call: 1, .. }) => {}
                other => panic!("call 1: expected RankMismatch, got {other:?}"),
            }
            // Rank 1 names another root.
            let root = if rank == 1 { 1 } else { 0 };
            match boot.broadcast(root, b"z") {
                Err(Error::RankMismatch {
                    call: 2, detail, ..
                }) => {
                    assert!(detail.contains("root"), "{detail}")
                }
                other => panic!("call 2: expected RankMismatch, got {other:?}"),
            }
            // The group is still in step.
            let got = boot.all_gather(&[rank as u8])?;
            assert_eq!(got, (0..world).map(|r| vec![r as u8]).collect::<Vec<_>>());
            // The last rank makes one call more than the others, which leave: it must fail,
            // not hang and not receive anything.
            if rank == world - 1 {
                let t = Instant::now();
                let r = boot.all_gather(b"extra");
                assert!(r.is_err(), "an unmatched call returned {r:?}");
                println!(
                    "EXTRA-CALL {} ms: {}",
                    t.elapsed().as_millis(),
                    r.unwrap_err()
                );
            }
            Ok(format!("rank {rank}"))
        }
        "leave_after_join" => {
            // The last rank leaves right after joining; the others must fail fast.
            if rank == world - 1 {
                return Ok(format!("rank {rank} left"));
            }
            boot.all_gather(b"hello")?;
            panic!("all_gather succeeded without the last rank")
        }
        "killed_while_waiting" => {
            // Everyone has joined and made one call; then the victim says so and waits to be
            // killed (SIGKILL: no goodbye on its sockets beyond what the kernel sends), while
            // the others enter the next collective and wait for its part.
            boot.all_gather(b"joined")?;
            let victim: usize = std::env::var(VICTIM_ENV).unwrap().parse().unwrap();
            if rank == victim {
                println!("VICTIM-READY");
                std::io::stdout().flush().unwrap();
                std::thread::sleep(HANG_LIMIT);
                panic!("the victim was not killed");
            }
            let err = match boot.all_gather(b"after") {
                Ok(_) => panic!("all_gather succeeded with rank {victim} killed"),
                Err(e) => e,
            };
            // Wall-clock milliseconds, so the parent can measure from the moment it killed.
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis();
            println!("KILLED-ERR {now} {err}");
            // The survivors build a new group in the same processes, as a serving process
            // would after losing a peer, and it works.
            let port: u16 = std::env::var(REBUILD_PORT_ENV).unwrap().parse().unwrap();
            let secret = Secret::from_hex(&std::env::var("ALLREDUCE_BOOTSTRAP_SECRET").unwrap())?;
            let new_rank = rank - usize::from(rank > victim);
            let mut again = TcpBootstrap::new(
                TcpBootstrapConfig::new(new_rank, world - 1, port)
                    .secret(secret)
                    .timeout(Duration::from_secs(10)),
            )?;
            let got = again.all_gather(&message(new_rank, 7))?;
            let want: Vec<Vec<u8>> = (0..world - 1).map(|r| message(r, 7)).collect();
            assert_eq!(got, want, "the rebuilt group's all_gather");
            Ok(format!(
                "rank {rank} rebuilt as rank {new_rank} of {}",
                world - 1
            ))
        }
        other => panic!("unknown scenario {other}"),
    }
}

// ------------------------------------------------------------------------------------------
// The parent side.

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Group {
    world: usize,
    port: u16,
    secret: String,
    timeout_s: String,
    scenario: &'static str,
}

impl Group {
    fn new(world: usize, scenario: &'static str, timeout: Duration) -> Self {
        Group {
            world,
            port: free_port(),
            secret: Secret::generate().unwrap().to_hex(),
            timeout_s: format!("{}", timeout.as_secs_f64()),
            scenario,
        }
    }

    fn command(&self, rank: usize) -> Command {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--quiet",
        ])
        .env(CHILD_ENV, "1")
        .env(SCENARIO_ENV, self.scenario)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", self.world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", self.port.to_string())
        .env("ALLREDUCE_BOOTSTRAP_SECRET", &self.secret)
        .env("ALLREDUCE_BOOTSTRAP_TIMEOUT_S", &self.timeout_s)
        .env_remove("ALLREDUCE_BOOTSTRAP_PORT")
        .env_remove("ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        cmd
    }

    fn spawn(&self, rank: usize) -> Running {
        self.spawn_with(rank, |_| {})
    }

    fn spawn_with(&self, rank: usize, edit: impl FnOnce(&mut Command)) -> Running {
        let mut cmd = self.command(rank);
        edit(&mut cmd);
        Running {
            rank,
            start: Instant::now(),
            child: cmd.spawn().expect("spawn a rank"),
        }
    }

    fn spawn_all(&self, ranks: impl IntoIterator<Item = usize>) -> Vec<Running> {
        ranks.into_iter().map(|r| self.spawn(r)).collect()
    }
}

struct Running {
    rank: usize,
    start: Instant,
    child: Child,
}

#[derive(Debug)]
struct Finished {
    rank: usize,
    code: Option<i32>,
    elapsed: Duration,
    stdout: String,
    /// Panic messages; shown by `{:#?}` when an assertion fails.
    #[allow(dead_code)]
    stderr: String,
}

impl Finished {
    fn assert_ok(&self) {
        assert!(
            self.code == Some(0) && self.stdout.contains("CHILD-OK"),
            "rank {} failed: {self:#?}",
            self.rank
        );
    }

    fn assert_failed_with(&self, needle: &str) {
        assert!(
            self.code == Some(FAILED) && self.stdout.contains("CHILD-ERR"),
            "rank {} should have failed cleanly: {self:#?}",
            self.rank
        );
        assert!(
            self.stdout.contains(needle),
            "rank {}'s error lacks {needle:?}: {self:#?}",
            self.rank
        );
    }

    /// Milliseconds from the start of the rank's bootstrap to its error, as it reported.
    fn error_ms(&self) -> u64 {
        let line = self
            .stdout
            .lines()
            .find(|l| l.starts_with("CHILD-ERR "))
            .unwrap_or_else(|| panic!("no error line: {self:#?}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

/// Waits for `r` (killing it past [`HANG_LIMIT`], which fails the test).
fn finish(mut r: Running) -> Finished {
    let mut out = r.child.stdout.take().unwrap();
    let mut err = r.child.stderr.take().unwrap();
    // Drain the pipes while waiting, so a chatty child cannot block on a full pipe.
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = r.child.try_wait().unwrap() {
            break Some(status);
        }
        if r.start.elapsed() > HANG_LIMIT {
            let _ = r.child.kill();
            let _ = r.child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let done = Finished {
        rank: r.rank,
        code: status.and_then(|s| s.code()),
        elapsed: r.start.elapsed(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    assert!(status.is_some(), "rank {} hung: {done:#?}", r.rank);
    if std::env::var_os("ALLREDUCE_BOOTSTRAP_TEST_VERBOSE").is_some() {
        eprintln!(
            "rank {} exited {:?} after {:?}:\n{}",
            done.rank, done.code, done.elapsed, done.stdout
        );
    }
    done
}

fn finish_all(running: Vec<Running>) -> Vec<Finished> {
    running.into_iter().map(finish).collect()
}

fn collectives(world: usize) {
    let t = Instant::now();
    let group = Group::new(world, "collectives", Duration::from_secs(15));
    // Start the ranks in reverse, so most connect before rank 0 listens (they retry).
    let done = finish_all(group.spawn_all((0..world).rev()));
    for f in &done {
        f.assert_ok();
    }
    eprintln!("{world} processes: {:?}", t.elapsed());
}

#[test]
fn collectives_2_processes() {
    collectives(2);
}

#[test]
fn collectives_3_processes() {
    collectives(3);
}

#[test]
fn collectives_8_processes() {
    collectives(8);
}

/// MASTER_ADDR as a host name, resolved on every rank.
#[test]
fn master_addr_localhost() {
    let group = Group::new(2, "collectives", Duration::from_secs(15));
    let running = (0..2)
        .map(|r| {
            group.spawn_with(r, |c| {
                c.env("MASTER_ADDR", "localhost");
            })
        })
        .collect();
    for f in finish_all(running) {
        f.assert_ok();
    }
}

/// Rank 0's output lines starting `REFUSED `.
fn refusals(rank0: &Finished) -> Vec<&str> {
    rank0
        .stdout
        .lines()
        .filter(|l| l.starts_with("REFUSED "))
        .collect()
}

/// How soon every side of a refused join must fail: far below the groups' deadline below, so
/// a side that waits it out fails the test.
const FAST_MS: u64 = 3000;
const LONG_DEADLINE: Duration = Duration::from_secs(15);

/// Every rank failed cleanly with `needle` in its error, within [`FAST_MS`].
fn all_fail_fast_with(done: &[Finished], needle: &str) {
    for f in done {
        f.assert_failed_with(needle);
        assert!(
            f.error_ms() < FAST_MS,
            "rank {} took {} ms: {f:#?}",
            f.rank,
            f.error_ms()
        );
    }
}

#[test]
fn a_rank_with_another_secret_fails_every_side_fast() {
    let group = Group::new(2, "collectives", LONG_DEADLINE);
    let rank0 = group.spawn(0);
    // A stale secret on rank 1: refused with the reason, and rank 0 cannot form the group.
    let rank1 = group.spawn_with(1, |c| {
        c.env(
            "ALLREDUCE_BOOTSTRAP_SECRET",
            Secret::generate().unwrap().to_hex(),
        );
    });
    let done = finish_all(vec![rank0, rank1]);
    all_fail_fast_with(&done, "authentication failed");
    done[0].assert_failed_with("cannot form");
}

#[test]
fn ranks_that_disagree_on_world_size_fail_every_side_fast() {
    let group = Group::new(2, "collectives", LONG_DEADLINE);
    let running = vec![
        group.spawn(0),
        group.spawn_with(1, |c| {
            c.env("WORLD_SIZE", "3");
        }),
    ];
    let done = finish_all(running);
    all_fail_fast_with(&done, "rank 1 has WORLD_SIZE 3, rank 0 has 2");
}

#[test]
fn rank_0_given_twice_fails_both_fast() {
    let group = Group::new(2, "collectives", LONG_DEADLINE);
    let done = finish_all(vec![group.spawn(0), group.spawn(0)]);
    all_fail_fast_with(&done, "rank 0 given twice");
}

#[test]
fn a_rank_given_twice_fails_every_side_fast() {
    // Rank 2 is missing and rank 1 comes twice, as with a launcher's off-by-one. Whichever rank
    // 1 is admitted first is told by rank 0; the other is refused.
    let group = Group::new(3, "collectives", LONG_DEADLINE);
    let done = finish_all(group.spawn_all([0, 1, 1]));
    all_fail_fast_with(&done, "rank 1 given twice");
}

/// Connects to rank 0's port, retrying until it listens.
fn connect(port: u16) -> TcpStream {
    let t = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                return s;
            }
            Err(_) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    }
}

#[test]
fn stray_connections_are_refused_and_the_group_completes() {
    let group = Group::new(3, "collectives", Duration::from_secs(15));
    let rank0 = group.spawn(0);

    // 1. Garbage: rank 0 greets, reads a hello's worth of bytes, and closes unanswered.
    let mut garbage = connect(group.port);
    let mut greeting = [0u8; 40];
    garbage.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..4], b"ARBS");
    garbage.write_all(&[0xff; 200]).unwrap();
    let mut rest = Vec::new();
    // EOF (or a reset, since we sent more than it read): no answer either way.
    let _ = garbage.read_to_end(&mut rest);
    assert!(rest.is_empty(), "rank 0 answered garbage with {rest:?}");

    // 2. A well-formed hello with a made-up proof: refused with a reason.
    let mut forger = connect(group.port);
    forger.read_exact(&mut greeting).unwrap();
    let mut hello = vec![0u8; 80];
    hello[..4].copy_from_slice(b"ARBC");
    hello[4] = 1; // version 1
    hello[8] = 1; // rank 1

    // Of a group of 9: a claim that does not fit this group is taken for another group's
    // process on the port, which does not stop this one.
    hello[12] = 9;
    forger.write_all(&hello).unwrap();
    let mut reply = Vec::new();
    forger.read_to_end(&mut reply).unwrap();
    assert_eq!(&reply[..5], b"ARBA\x01", "expected a refusal: {reply:?}");
    assert!(String::from_utf8_lossy(&reply[8..]).contains("authentication failed"));

    // 3. A connection that says nothing and stays open: it must not hold up anyone.
    let mut silent = connect(group.port);
    silent.read_exact(&mut greeting).unwrap();

    // 4. A huge, slow stream of bytes: read up to a hello's length, then refused.
    let mut flood = connect(group.port);
    flood.read_exact(&mut greeting).unwrap();
    let _ = flood.write_all(&vec![b'A'; 1 << 20]);

    let t = Instant::now();
    let mut done = finish_all(group.spawn_all([1, 2]));
    done.insert(0, finish(rank0));
    for f in &done {
        f.assert_ok();
    }
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "the silent connection held the group up: {:?}",
        t.elapsed()
    );
    let refused = refusals(&done[0]);
    assert!(
        refused.iter().filter(|l| l.contains("bad magic")).count() >= 2,
        "{refused:?}"
    );
    assert!(
        refused.iter().any(|l| l.contains("authentication failed")),
        "{refused:?}"
    );
    drop(silent);
}

/// Slack over the configured timeout for a rank to notice, report and exit.
const SLACK_MS: u64 = 1500;

#[test]
fn a_rank_that_never_arrives_times_out_everywhere() {
    let timeout = Duration::from_secs(2);
    let group = Group::new(3, "collectives", timeout);
    let t = Instant::now();
    // Rank 2 never starts.
    let done = finish_all(group.spawn_all([0, 1]));
    for f in &done {
        f.assert_failed_with("timed out");
        let ms = f.error_ms();
        assert!(
            ms >= timeout.as_millis() as u64 - 100 && ms <= timeout.as_millis() as u64 + SLACK_MS,
            "rank {} failed after {ms} ms",
            f.rank
        );
    }
    assert!(done[0].stdout.contains("[2]"), "{:#?}", done[0]);
    assert!(
        done[0].stdout.contains("same MASTER_ADDR and MASTER_PORT"),
        "{:#?}",
        done[0]
    );
    eprintln!("timeout reported after {:?}", t.elapsed());
}

#[test]
fn rank_0_never_arrives_times_out() {
    let timeout = Duration::from_secs(2);
    let group = Group::new(3, "collectives", timeout);
    for f in finish_all(group.spawn_all([1, 2])) {
        f.assert_failed_with("timed out");
        f.assert_failed_with("is rank 0 running");
        assert!(f.error_ms() <= timeout.as_millis() as u64 + SLACK_MS);
    }
}

#[test]
fn out_of_sequence_calls_fail_on_every_rank() {
    let group = Group::new(3, "out_of_order", Duration::from_secs(5));
    let done = finish_all(group.spawn_all(0..3));
    for f in &done {
        f.assert_ok();
    }
    // The unmatched extra call failed quickly (the others left), not at its deadline.
    let extra = done[2]
        .stdout
        .lines()
        .find(|l| l.starts_with("EXTRA-CALL"))
        .unwrap_or_else(|| panic!("{:#?}", done[2]));
    let ms: u64 = extra.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(ms < 4000, "{extra}");
}

#[test]
fn a_rank_that_leaves_fails_the_others_fast() {
    let group = Group::new(4, "leave_after_join", Duration::from_secs(10));
    let done = finish_all(group.spawn_all(0..4));
    done[3].assert_ok();
    for f in &done[..3] {
        f.assert_failed_with("rank 3");
        assert!(f.elapsed < Duration::from_secs(8), "{f:#?}");
    }
}

/// A rank killed with SIGKILL while the others wait in a collective: every survivor fails
/// within the deadline (at once, in fact: the kernel closes the dead process's sockets), its
/// error names the dead rank, and the survivors build a new group that works. Rank 0 is the
/// hub of the star, so both cases: a member killed, and rank 0 killed.
fn killed_while_waiting(world: usize, victim: usize) {
    let timeout = Duration::from_secs(10);
    let group = Group::new(world, "killed_while_waiting", timeout);
    let rebuild = free_port().to_string();
    let mut running: Vec<Running> = (0..world)
        .map(|r| {
            group.spawn_with(r, |c| {
                c.env(VICTIM_ENV, victim.to_string())
                    .env(REBUILD_PORT_ENV, &rebuild);
            })
        })
        .collect();
    let mut v = running.remove(victim);
    let mut out = std::io::BufReader::new(v.child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(
            n > 0,
            "rank {victim} ended before it was ready: {:?}",
            v.child.wait()
        );
        if line.starts_with("VICTIM-READY") {
            break;
        }
    }
    // Give the survivors time to enter the collective (one that arrives later fails the same
    // way: the dead rank's connection is gone either way).
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    v.child.kill().unwrap(); // SIGKILL
    let status = v.child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "{status:?}"
    );
    let named = format!("rank {victim}");
    for f in finish_all(running) {
        f.assert_ok();
        let line = f
            .stdout
            .lines()
            .find(|l| l.starts_with("KILLED-ERR "))
            .unwrap_or_else(|| panic!("no error line: {f:#?}"));
        let mut words = line.splitn(3, ' ');
        let at: u128 = words.nth(1).unwrap().parse().unwrap();
        let err = words.next().unwrap();
        let after = at.saturating_sub(killed_at);
        assert!(
            after <= timeout.as_millis() + SLACK_MS as u128,
            "rank {} failed {after} ms after the kill: {err}",
            f.rank
        );
        // "rank 2" but not "rank 20": the error names the dead rank itself.
        let names = err
            .match_indices(&named)
            .any(|(i, _)| !err[i + named.len()..].starts_with(|c: char| c.is_ascii_digit()));
        assert!(
            names,
            "rank {}'s error does not name {named}: {err}",
            f.rank
        );
        eprintln!("rank {}: {after} ms after the kill: {err}", f.rank);
    }
}

#[test]
fn a_member_killed_while_the_others_wait_is_named_and_the_survivors_regroup() {
    killed_while_waiting(4, 2);
}

#[test]
fn rank_0_killed_while_the_others_wait_is_named_and_the_survivors_regroup() {
    killed_while_waiting(3, 0);
}

#[test]
fn no_secret_is_a_clear_error() {
    let group = Group::new(2, "collectives", Duration::from_secs(2));
    let f = finish(group.spawn_with(1, |c| {
        c.env_remove("ALLREDUCE_BOOTSTRAP_SECRET");
    }));
    f.assert_failed_with("no bootstrap secret");
    f.assert_failed_with("openssl rand -hex 32");
}

#[test]
fn missing_environment_is_a_clear_error() {
    let group = Group::new(2, "collectives", Duration::from_secs(2));
    let f = finish(group.spawn_with(1, |c| {
        c.env_remove("MASTER_PORT");
    }));
    f.assert_failed_with("MASTER_PORT is not set");
}
