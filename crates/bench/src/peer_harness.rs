//! What the side-by-side runs (`--peers`, `--peers --fused`) share: the watchdog for peers
//! whose kernels wait without a deadline, the timed loop every contender runs through, the
//! ranks' agreement on which contenders were wrong, and the row's arithmetic.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread::Scope;
use std::time::{Duration, Instant};

/// A row that makes no progress for this long has hung.
pub const WATCHDOG: Duration = Duration::from_secs(60);

/// Progress of the rank threads, watched while they run.
#[derive(Default)]
pub struct Heartbeat {
    beats: AtomicU64,
    done: AtomicBool,
}

impl Heartbeat {
    pub fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// The rank threads are done: the watchdog leaves.
    pub fn finish(&self) {
        self.done.store(true, Ordering::Relaxed);
    }

    /// A thread of scope `s` that ends the process with a message, naming `what`, once no
    /// beat came for [`WATCHDOG`]: the peers' kernels have no deadline, so a hang would
    /// otherwise hang the bench.
    pub fn watch<'scope>(&'scope self, s: &'scope Scope<'scope, '_>, what: &'static str) {
        s.spawn(move || {
            let mut last = (self.beats.load(Ordering::Relaxed), Instant::now());
            while !self.done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let beat = self.beats.load(Ordering::Relaxed);
                if beat != last.0 {
                    last = (beat, Instant::now());
                } else if last.1.elapsed() > WATCHDOG {
                    eprintln!("allreduce-bench {what}: no progress for {WATCHDOG:?} (a peer kernel without a deadline hung?): exiting");
                    std::process::exit(3);
                }
            }
        });
    }
}

/// Seconds per call of `calls` calls of `f`, started together on every rank (`barrier`) and
/// ended when `sync` (this rank's stream) returns.
pub fn timed(
    barrier: &Barrier,
    heartbeat: &Heartbeat,
    sync: &dyn Fn() -> Result<(), String>,
    f: &dyn Fn() -> Result<(), String>,
    calls: usize,
) -> Result<f64, String> {
    barrier.wait();
    let start = Instant::now();
    for _ in 0..calls {
        f()?;
    }
    sync()?;
    heartbeat.beat();
    Ok(start.elapsed().as_secs_f64() / calls as f64)
}

/// One call of a contender, as the timed loop runs it.
pub type Call<'a> = &'a dyn Fn() -> Result<(), String>;

/// The eager timing of one row: five warm-up calls of every contender `timed` allows, then
/// two rounds of `iters` calls each, keeping each contender's faster loop in `out[i]` (NaN
/// stays for one not timed). `time(f, calls)` is the ranks' common timed loop ([`timed`]).
pub fn time_eager<W: Copy>(
    contenders: &[W],
    timed: &[bool],
    iters: usize,
    time: &dyn Fn(Call, usize) -> Result<f64, String>,
    call: &dyn Fn(W) -> Result<(), String>,
    out: &mut [f64],
) -> Result<(), String> {
    for (i, &w) in contenders.iter().enumerate() {
        if timed[i] {
            time(&|| call(w), 5)?;
        }
    }
    for _ in 0..2 {
        for (i, &w) in contenders.iter().enumerate() {
            if timed[i] {
                keep_min(&mut out[i], time(&|| call(w), iters)?);
            }
        }
    }
    Ok(())
}

/// Keeps the faster of two loops' times (NaN: not yet timed).
pub fn keep_min(slot: &mut f64, t: f64) {
    *slot = if slot.is_nan() { t } else { slot.min(t) };
}

/// Every rank's wrong counts per contender, summed: after it every rank times the same
/// contenders (a contender wrong on any rank is not timed).
pub fn agree_wrong<const N: usize>(
    rank: usize,
    mine: [usize; N],
    all: &Mutex<Vec<[usize; N]>>,
    barrier: &Barrier,
) -> [usize; N] {
    all.lock().unwrap()[rank] = mine;
    barrier.wait();
    let sum = all.lock().unwrap().iter().fold([0; N], |mut acc, w| {
        for (a, x) in acc.iter_mut().zip(w) {
            *a += x;
        }
        acc
    });
    // Nobody rewrites `all` for the next row before every rank has read this one.
    barrier.wait();
    sum
}

/// The slowest rank's value of row `k` (NaN where no rank timed it).
pub fn slowest<Row>(per_rank: &[Vec<Row>], k: usize, f: impl Fn(&Row) -> f64) -> f64 {
    per_rank
        .iter()
        .map(|r| f(&r[k]))
        .fold(f64::NAN, |a, b| if a.is_nan() || b > a { b } else { a })
}

/// The smaller, NaN meaning "not run".
pub fn min_nan(a: f64, b: f64) -> f64 {
    match (a.is_nan(), b.is_nan()) {
        (true, _) => b,
        (_, true) => a,
        _ => a.min(b),
    }
}

/// Microseconds with two decimals, "-" for not run.
pub fn us(s: f64) -> String {
    if s.is_nan() {
        "-".into()
    } else {
        format!("{:.2}", s * 1e6)
    }
}

/// a / b with three decimals, "-" when either was not run.
pub fn ratio(a: f64, b: f64) -> String {
    if a.is_nan() || b.is_nan() {
        "-".into()
    } else {
        format!("{:.3}", a / b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_arithmetic_treats_nan_as_not_run() {
        let mut t = f64::NAN;
        keep_min(&mut t, 2.0);
        keep_min(&mut t, 3.0);
        assert_eq!(t, 2.0);
        assert_eq!(min_nan(f64::NAN, 1.0), 1.0);
        assert_eq!(min_nan(2.0, 1.0), 1.0);
        assert!(min_nan(f64::NAN, f64::NAN).is_nan());
        assert_eq!(
            (us(f64::NAN), us(1.5e-6)),
            ("-".to_string(), "1.50".to_string())
        );
        assert_eq!(
            (ratio(1.0, f64::NAN), ratio(1.0, 2.0)),
            ("-".to_string(), "0.500".to_string())
        );
        let per_rank = vec![vec![1.0, f64::NAN], vec![3.0, f64::NAN]];
        assert_eq!(slowest(&per_rank, 0, |&x| x), 3.0);
        assert!(slowest(&per_rank, 1, |&x| x).is_nan());
    }

    #[test]
    fn eager_timing_warms_up_then_keeps_the_faster_of_two_loops() {
        use std::cell::RefCell;
        let calls = RefCell::new(Vec::new());
        let loops = RefCell::new(0usize);
        // Loop k of the fake clock takes 10 - k seconds per call.
        let time = |f: &dyn Fn() -> Result<(), String>, n: usize| {
            for _ in 0..n {
                f()?;
            }
            *loops.borrow_mut() += 1;
            Ok(10.0 - *loops.borrow() as f64)
        };
        let call = |w: char| {
            calls.borrow_mut().push(w);
            Ok(())
        };
        let mut out = [f64::NAN; 3];
        time_eager(
            &['a', 'b', 'c'],
            &[true, false, true],
            3,
            &time,
            &call,
            &mut out,
        )
        .unwrap();
        let calls = calls.into_inner();
        assert_eq!(calls.iter().filter(|&&w| w == 'b').count(), 0);
        assert_eq!(calls.iter().filter(|&&w| w == 'a').count(), 5 + 2 * 3);
        // Loops: warm-ups 1-2, then a (3), c (4), a (5), c (6): the second round is faster.
        assert_eq!(out[0], 5.0);
        assert!(out[1].is_nan());
        assert_eq!(out[2], 4.0);
    }

    #[test]
    fn wrong_counts_are_summed_over_ranks() {
        let all = Mutex::new(vec![[0usize; 2]; 2]);
        let barrier = Barrier::new(2);
        let sums: Vec<[usize; 2]> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (all, barrier) = (&all, &barrier);
                    s.spawn(move || agree_wrong(rank, [rank, 1], all, barrier))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![[1, 2], [1, 2]]);
    }
}
