//! The sweep: one thread per rank walks the same list of rows; the main thread gathers each
//! row's per-rank reports as they come.
//!
//! Nothing here knows the backend: buffers come from a [`BufferFactory`] and calls go through
//! [`buffers::call`]. Every decision that changes which calls a rank makes (skip a row, stop
//! the sweep, how many iterations) is taken from what *all* ranks reported at a barrier, so
//! the ranks always issue the same sequence of collective calls.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

use allreduce::{AllReduceOptions, Communicator, DType, Error, Precision, Strategy};

use crate::buffers::{self, BenchBuffers, BufferFactory};
use crate::data::{DataSet, Inputs};
use crate::metrics::{check_range, Check};

/// How many timed calls a row gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Iters {
    /// Exactly this many.
    Fixed(u32),
    /// As many as fit in `seconds` at the warm-up's pace, at least 1 and at most `max`.
    Budget { seconds: f64, max: u32 },
}

impl Iters {
    /// The count for a call estimated to take `per_call` seconds.
    pub fn count(self, per_call: f64) -> u32 {
        match self {
            Iters::Fixed(n) => n.max(1),
            Iters::Budget { seconds, max } => {
                let n = if per_call > 0.0 {
                    (seconds / per_call).floor()
                } else {
                    f64::from(max)
                };
                n.clamp(1.0, f64::from(max.max(1))) as u32
            }
        }
    }
}

/// What every row shares.
#[derive(Clone, Debug)]
pub struct Config {
    pub dtype: DType,
    pub in_place: bool,
    /// Data of lossy rows; exact rows use [`DataSet::Ints`].
    pub data: DataSet,
    /// Hidden size: the rows of [`DataSet::Channels`] and the channels of the
    /// channel-equalized SNR.
    pub hidden: usize,
    /// Warm-up calls per row (at least one runs).
    pub warmup: u32,
    pub iters: Iters,
}

/// One row of the sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSpec {
    /// Bytes per rank (a whole number of elements).
    pub bytes: usize,
    pub count: usize,
    pub strategy: Strategy,
    pub precision: Precision,
}

impl RowSpec {
    pub fn exact(&self) -> bool {
        self.precision == Precision::Exact
    }
}

/// A measured row.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The strategy that ran (what `Auto` resolved to).
    pub ran: Strategy,
    pub data: DataSet,
    pub iters: u32,
    /// Seconds per call: the slowest rank's loop time over `iters`.
    pub seconds: f64,
    pub check: Check,
}

impl Measured {
    /// Whether the row failed its check: an exact row with a wrong element, or any row whose
    /// ranks disagree.
    pub fn failed(&self, exact: bool) -> bool {
        (exact && self.check.wrong_elements > 0) || self.check.ranks_differing() > 0
    }
}

#[derive(Clone, Debug)]
pub enum Outcome {
    Done(Measured),
    /// The backend rejected the combination; the library's reason.
    Skipped(String),
}

#[derive(Clone, Debug)]
pub struct RowResult {
    pub spec: RowSpec,
    pub outcome: Outcome,
}

/// What a sweep produced: its rows, and the error that stopped it early, if any.
pub struct Sweep {
    pub rows: Vec<RowResult>,
    pub error: Option<String>,
}

/// Run `rows` on the group `comms` and call `on_row` as each row completes.
pub fn run_sweep(
    comms: &[Communicator],
    factory: &dyn BufferFactory,
    cfg: &Config,
    rows: &[RowSpec],
    mut on_row: impl FnMut(&RowResult),
) -> Sweep {
    let world = comms.len();
    let shared = Shared::new(world);
    let mut done = Vec::with_capacity(rows.len());
    let mut error = None;
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<Msg>();
        for comm in comms {
            let tx = tx.clone();
            let shared = &shared;
            s.spawn(move || {
                let rank = comm.rank();
                let res = catch_unwind(AssertUnwindSafe(|| {
                    worker(comm, factory, cfg, rows, shared, &tx)
                }));
                if res.is_err() {
                    shared.barrier.abort();
                    let _ = tx.send(Msg::Panicked(rank));
                }
            });
        }
        drop(tx);
        'rows: for (k, spec) in rows.iter().enumerate() {
            let mut reports = Vec::with_capacity(world);
            while reports.len() < world {
                match rx.recv() {
                    Ok(Msg::Row { row, rank, report }) => {
                        debug_assert_eq!(row, k, "rank {rank} reported out of order");
                        reports.push((rank, report));
                    }
                    Ok(Msg::Panicked(rank)) => {
                        error = Some(format!("rank {rank}'s thread panicked (a bug: see above)"));
                        break 'rows;
                    }
                    Err(_) => {
                        error = Some("the rank threads stopped early".into());
                        break 'rows;
                    }
                }
            }
            match aggregate(*spec, reports) {
                Ok(row) => {
                    on_row(&row);
                    done.push(row);
                }
                Err(e) => {
                    error = Some(e);
                    break 'rows;
                }
            }
        }
        // Whatever stopped us, no rank may stay parked at a barrier.
        shared.barrier.abort();
    });
    Sweep { rows: done, error }
}

enum Msg {
    Row {
        row: usize,
        rank: usize,
        report: Report,
    },
    Panicked(usize),
}

/// One rank's account of one row.
enum Report {
    Done {
        ran: Strategy,
        data: DataSet,
        iters: u32,
        seconds: f64,
        check: Check,
    },
    Skipped(String),
    Fatal(String),
}

fn aggregate(spec: RowSpec, reports: Vec<(usize, Report)>) -> Result<RowResult, String> {
    let mut measured: Option<Measured> = None;
    let mut rank0_ran = None;
    let mut skipped = None;
    for (rank, report) in reports {
        match report {
            Report::Fatal(e) => return Err(e),
            Report::Skipped(reason) => skipped = Some(reason),
            Report::Done {
                ran,
                data,
                iters,
                seconds,
                check,
            } => {
                if rank == 0 {
                    rank0_ran = Some(ran);
                }
                match &mut measured {
                    None => {
                        measured = Some(Measured {
                            ran,
                            data,
                            iters,
                            seconds,
                            check,
                        })
                    }
                    Some(m) => {
                        m.seconds = m.seconds.max(seconds);
                        m.check.merge(&check);
                    }
                }
            }
        }
    }
    let outcome = match (skipped, measured) {
        (Some(reason), _) => Outcome::Skipped(reason),
        (None, Some(mut m)) => {
            m.ran = rank0_ran.unwrap_or(m.ran);
            Outcome::Done(m)
        }
        (None, None) => return Err("no rank reported the row".into()),
    };
    Ok(RowResult { spec, outcome })
}

/// A barrier that can be abandoned, so a panicking rank cannot leave the others parked.
struct AbortableBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    cv: Condvar,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    aborted: bool,
}

/// The sweep was abandoned by another thread.
struct Abandoned;

impl AbortableBarrier {
    fn new(parties: usize) -> Self {
        AbortableBarrier {
            parties,
            state: Mutex::new(BarrierState {
                arrived: 0,
                generation: 0,
                aborted: false,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait(&self) -> Result<(), Abandoned> {
        let mut st = self.lock();
        if st.aborted {
            return Err(Abandoned);
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.parties {
            st.arrived = 0;
            st.generation = st.generation.wrapping_add(1);
            self.cv.notify_all();
            return Ok(());
        }
        while st.generation == generation {
            if st.aborted {
                return Err(Abandoned);
            }
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }

    fn abort(&self) {
        self.lock().aborted = true;
        self.cv.notify_all();
    }
}

/// One rank's status after a phase.
#[derive(Clone, Debug)]
enum Status {
    /// A time in seconds (the phase's measurement, or 0).
    Ok(f64),
    Failed {
        message: String,
        /// The backend rejected the combination: skip the row rather than stop.
        skip: bool,
        /// A consequence of another rank's failure (peer rejected, group aborted).
        secondary: bool,
    },
}

impl Status {
    fn from_error(rank: usize, e: &Error, skippable: bool) -> Status {
        let skip = skippable && e.is_rejection();
        let secondary = matches!(e, Error::PeerRejected { .. } | Error::Aborted { .. });
        let message = if skip {
            e.to_string()
        } else {
            format!("rank {rank}: {e}")
        };
        Status::Failed {
            message,
            skip,
            secondary,
        }
    }
}

/// What all ranks' statuses decide.
enum Verdict {
    Go(Vec<f64>),
    Skip(String),
    Fatal(String),
}

fn verdict(statuses: &[Status]) -> Verdict {
    let mut fatal: Option<(bool, &str)> = None;
    let mut skip: Option<(bool, &str)> = None;
    let mut times = Vec::with_capacity(statuses.len());
    for s in statuses {
        match s {
            Status::Ok(t) => times.push(*t),
            Status::Failed {
                message,
                skip: is_skip,
                secondary,
            } => {
                let slot = if *is_skip { &mut skip } else { &mut fatal };
                // Keep the first primary failure; a secondary one only until a primary comes.
                if slot.is_none_or(|(sec, _)| sec && !*secondary) {
                    *slot = Some((*secondary, message));
                }
            }
        }
    }
    match (fatal, skip) {
        (Some((_, m)), _) => Verdict::Fatal(m.to_string()),
        (None, Some((_, m))) => Verdict::Skip(m.to_string()),
        (None, None) => Verdict::Go(times),
    }
}

struct Shared {
    barrier: AbortableBarrier,
    statuses: Mutex<Vec<Status>>,
    /// Each rank's downloaded output of the current row.
    outputs: Vec<RwLock<Vec<u8>>>,
}

impl Shared {
    fn new(world: usize) -> Self {
        Shared {
            barrier: AbortableBarrier::new(world),
            statuses: Mutex::new(vec![Status::Ok(0.0); world]),
            outputs: (0..world).map(|_| RwLock::new(Vec::new())).collect(),
        }
    }

    /// Publish this rank's status and return every rank's, once all have published.
    fn agree(&self, rank: usize, status: Status) -> Result<Verdict, Abandoned> {
        self.statuses.lock().unwrap_or_else(PoisonError::into_inner)[rank] = status;
        self.barrier.wait()?;
        let v = verdict(&self.statuses.lock().unwrap_or_else(PoisonError::into_inner));
        // Nobody overwrites a status before everyone has read them.
        self.barrier.wait()?;
        Ok(v)
    }
}

fn worker(
    comm: &Communicator,
    factory: &dyn BufferFactory,
    cfg: &Config,
    rows: &[RowSpec],
    shared: &Shared,
    tx: &mpsc::Sender<Msg>,
) {
    let rank = comm.rank();
    for (row, spec) in rows.iter().enumerate() {
        let Ok(report) = rank_row(comm, factory, cfg, spec, shared) else {
            return;
        };
        let fatal = matches!(report, Report::Fatal(_));
        if tx.send(Msg::Row { row, rank, report }).is_err() || fatal {
            return;
        }
        if shared.barrier.wait().is_err() {
            return;
        }
    }
}

/// Warm-up calls: the first also probes whether the backend accepts the combination.
/// Returns the strategy that ran and the seconds per call (of the calls after the first, when
/// there are any: the first pays for first-touch page faults and workspace growth).
fn warm_up(
    comm: &Communicator,
    bufs: &mut dyn BenchBuffers,
    opts: &AllReduceOptions,
    warmup: u32,
) -> Result<(Strategy, f64), Error> {
    let t = Instant::now();
    let ran = buffers::call(comm, bufs, opts)?;
    comm.synchronize(opts.stream)?;
    let first = t.elapsed().as_secs_f64();
    let rest = warmup.max(1) - 1;
    if rest == 0 {
        return Ok((ran, first));
    }
    let t = Instant::now();
    for _ in 0..rest {
        buffers::call(comm, bufs, opts)?;
    }
    comm.synchronize(opts.stream)?;
    Ok((ran, t.elapsed().as_secs_f64() / f64::from(rest)))
}

fn rank_row(
    comm: &Communicator,
    factory: &dyn BufferFactory,
    cfg: &Config,
    spec: &RowSpec,
    shared: &Shared,
) -> Result<Report, Abandoned> {
    let rank = comm.rank();
    let world = comm.world_size();
    let data = if spec.exact() {
        DataSet::Ints
    } else {
        cfg.data
    };
    let inputs = Inputs::new(data, cfg.dtype, spec.bytes).hidden(cfg.hidden);
    let host = inputs.fill(rank);
    let mut opts = AllReduceOptions::default()
        .precision(spec.precision)
        .strategy(spec.strategy);

    // Phase 0: buffers.
    let mut bufs = None;
    let status = match factory
        .alloc(comm, spec.bytes, cfg.dtype, cfg.in_place)
        .and_then(|mut b| {
            b.upload(&host)?;
            Ok(b)
        }) {
        Ok(b) => {
            bufs = Some(b);
            Status::Ok(0.0)
        }
        Err(e) => Status::Failed {
            message: format!("rank {rank}: preparing buffers: {e}"),
            skip: false,
            secondary: false,
        },
    };
    match shared.agree(rank, status)? {
        Verdict::Go(_) => {}
        Verdict::Skip(m) => return Ok(Report::Skipped(m)),
        Verdict::Fatal(m) => return Ok(Report::Fatal(m)),
    }
    let bufs = bufs
        .as_deref_mut()
        .expect("every rank prepared its buffers");
    opts.stream = bufs.stream();

    // Phase 1: warm-up, which also probes the combination and paces the timed loop.
    let mut ran = spec.strategy;
    let status = match warm_up(comm, bufs, &opts, cfg.warmup) {
        Ok((r, per_call)) => {
            ran = r;
            Status::Ok(per_call)
        }
        Err(e) => Status::from_error(rank, &e, true),
    };
    let iters = match shared.agree(rank, status)? {
        Verdict::Go(times) => cfg.iters.count(times.iter().copied().fold(0.0, f64::max)),
        Verdict::Skip(m) => return Ok(Report::Skipped(m)),
        Verdict::Fatal(m) => return Ok(Report::Fatal(m)),
    };

    // Phase 2: the timed loop, then the output to check. In place, the loop has summed the
    // buffer into itself again and again, so the checked call starts from a fresh input.
    let timed = (|| -> Result<f64, Error> {
        let t = Instant::now();
        for _ in 0..iters {
            buffers::call(comm, bufs, &opts)?;
        }
        comm.synchronize(opts.stream)?;
        let seconds = t.elapsed().as_secs_f64();
        if cfg.in_place {
            bufs.upload(&host)?;
            buffers::call(comm, bufs, &opts)?;
            comm.synchronize(opts.stream)?;
        }
        let mut out = shared.outputs[rank]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        out.resize(spec.bytes, 0);
        bufs.download(&mut out)?;
        Ok(seconds)
    })();
    let status = match &timed {
        Ok(s) => Status::Ok(*s),
        Err(e) => Status::from_error(rank, e, false),
    };
    let seconds = match shared.agree(rank, status)? {
        Verdict::Go(_) => match timed {
            Ok(s) => s / f64::from(iters),
            Err(_) => unreachable!("an error is never a Go verdict"),
        },
        Verdict::Skip(m) | Verdict::Fatal(m) => return Ok(Report::Fatal(m)),
    };

    // Phase 3: check this rank's share of the elements, on every rank's output.
    let guards: Vec<_> = shared
        .outputs
        .iter()
        .map(|o| o.read().unwrap_or_else(PoisonError::into_inner))
        .collect();
    let outputs: Vec<&[u8]> = guards.iter().map(|g| &g[..spec.bytes]).collect();
    let n = spec.count;
    let range = n * rank / world..n * (rank + 1) / world;
    let check = check_range(&inputs, spec.exact(), &outputs, range);
    Ok(Report::Done {
        ran,
        data,
        iters,
        seconds,
        check,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffers::HostFactory;
    use allreduce::{BackendKind, BufMut, BufRef, Codec, GroupConfig, Result};

    #[test]
    fn iteration_budget() {
        let b = Iters::Budget {
            seconds: 0.1,
            max: 1000,
        };
        assert_eq!(b.count(0.01), 10);
        assert_eq!(b.count(1.0), 1);
        assert_eq!(b.count(1e-9), 1000);
        assert_eq!(b.count(0.0), 1000);
        assert_eq!(Iters::Fixed(20).count(5.0), 20);
    }

    #[test]
    fn verdict_prefers_fatal_and_primary_reasons() {
        let ok = Status::Ok(1.0);
        let peer = Status::Failed {
            message: "peer".into(),
            skip: true,
            secondary: true,
        };
        let own = Status::Failed {
            message: "own".into(),
            skip: true,
            secondary: false,
        };
        let fatal = Status::Failed {
            message: "boom".into(),
            skip: false,
            secondary: false,
        };
        assert!(
            matches!(verdict(&[ok.clone(), Status::Ok(2.0)]), Verdict::Go(t) if t == [1.0, 2.0])
        );
        assert!(matches!(verdict(&[peer.clone(), own.clone()]), Verdict::Skip(m) if m == "own"));
        assert!(matches!(verdict(&[own, fatal, peer]), Verdict::Fatal(m) if m == "boom"));
    }

    fn host_group(world: usize) -> Vec<Communicator> {
        Communicator::new_group(
            BackendKind::Host,
            GroupConfig::new(world).max_bytes(1 << 16),
        )
        .unwrap()
    }

    fn rows(
        dtype: DType,
        sizes: &[usize],
        strategies: &[Strategy],
        precisions: &[Precision],
    ) -> Vec<RowSpec> {
        let mut out = Vec::new();
        for &bytes in sizes {
            for &strategy in strategies {
                for &precision in precisions {
                    out.push(RowSpec {
                        bytes,
                        count: bytes / dtype.size(),
                        strategy,
                        precision,
                    });
                }
            }
        }
        out
    }

    const ALL: [Strategy; 7] = [
        Strategy::Auto,
        Strategy::OneShot,
        Strategy::TwoShot,
        Strategy::QuantizedTwoShot,
        Strategy::Vendor,
        Strategy::VendorSymmetric,
        Strategy::PushOneShot,
    ];

    #[test]
    fn host_sweep_checks_out_and_skips_what_the_backend_rejects() {
        for in_place in [false, true] {
            let comms = host_group(4);
            let cfg = Config {
                dtype: DType::BF16,
                in_place,
                data: DataSet::Gauss,
                hidden: 4096,
                warmup: 1,
                iters: Iters::Fixed(3),
            };
            let precisions = [Precision::Exact, Precision::Lossy(Codec::Int8)];
            let specs = rows(DType::BF16, &[0, 2, 2000, 1 << 15], &ALL, &precisions);
            let mut seen = 0;
            let sweep = run_sweep(&comms, &HostFactory, &cfg, &specs, |_| seen += 1);
            assert_eq!(sweep.error, None);
            assert_eq!((sweep.rows.len(), seen), (specs.len(), specs.len()));
            for row in &sweep.rows {
                let spec = row.spec;
                match &row.outcome {
                    Outcome::Skipped(reason) => {
                        assert!(
                            spec.strategy.is_vendor()
                                || (spec.strategy == Strategy::QuantizedTwoShot && spec.exact())
                                || (spec.strategy == Strategy::PushOneShot && !spec.exact()),
                            "{spec:?} skipped: {reason}"
                        );
                        assert!(reason.contains("unavailable"), "{reason}");
                    }
                    Outcome::Done(m) => {
                        assert!(!spec.strategy.is_vendor());
                        assert!(!m.failed(spec.exact()), "{spec:?}: {m:?}");
                        assert_eq!(m.iters, 3);
                        assert!(m.seconds > 0.0);
                        assert_eq!(m.check.stats.elements as usize, spec.count);
                        if spec.strategy != Strategy::Auto {
                            assert_eq!(m.ran, spec.strategy);
                        }
                        if m.ran == Strategy::QuantizedTwoShot && spec.count >= 1000 {
                            let snr = m.check.stats.snr_db();
                            assert!((30.0..60.0).contains(&snr), "{spec:?}: snr {snr}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lossy_f32_rows_are_skipped_with_the_library_reason() {
        let comms = host_group(2);
        let cfg = Config {
            dtype: DType::F32,
            in_place: false,
            data: DataSet::Ints,
            hidden: 4096,
            warmup: 2,
            iters: Iters::Fixed(1),
        };
        let specs = rows(
            DType::F32,
            &[64],
            &[Strategy::Auto, Strategy::OneShot],
            &[Precision::Lossy(Codec::Int4)],
        );
        let sweep = run_sweep(&comms, &HostFactory, &cfg, &specs, |_| {});
        assert_eq!(sweep.error, None);
        for row in &sweep.rows {
            assert!(
                matches!(&row.outcome, Outcome::Skipped(r) if r.contains("does not accept f32")),
                "{row:?}"
            );
        }
    }

    /// Host buffers whose rank 2 reads back one flipped bit.
    struct Corrupting;

    struct CorruptBuffers {
        inner: Box<dyn BenchBuffers>,
        rank: usize,
    }

    impl BufferFactory for Corrupting {
        fn alloc(
            &self,
            comm: &Communicator,
            bytes: usize,
            dtype: DType,
            in_place: bool,
        ) -> Result<Box<dyn BenchBuffers>> {
            let inner = HostFactory.alloc(comm, bytes, dtype, in_place)?;
            Ok(Box::new(CorruptBuffers {
                inner,
                rank: comm.rank(),
            }))
        }
    }

    impl BenchBuffers for CorruptBuffers {
        fn upload(&mut self, host: &[u8]) -> Result<()> {
            self.inner.upload(host)
        }
        fn download(&mut self, host: &mut [u8]) -> Result<()> {
            self.inner.download(host)?;
            if self.rank == 2 && host.len() > 6 {
                host[6] ^= 1;
            }
            Ok(())
        }
        fn views(&mut self) -> (Option<BufRef<'_>>, BufMut<'_>) {
            self.inner.views()
        }
    }

    #[test]
    fn a_wrong_element_on_one_rank_is_caught() {
        let comms = host_group(4);
        let cfg = Config {
            dtype: DType::BF16,
            in_place: false,
            data: DataSet::Gauss,
            hidden: 4096,
            warmup: 1,
            iters: Iters::Fixed(1),
        };
        let specs = rows(
            DType::BF16,
            &[256],
            &[Strategy::OneShot],
            &[Precision::Exact, Precision::Lossy(Codec::Int8)],
        );
        let sweep = run_sweep(&comms, &Corrupting, &cfg, &specs, |_| {});
        assert_eq!(sweep.error, None);
        for row in &sweep.rows {
            let Outcome::Done(m) = &row.outcome else {
                panic!("{row:?}")
            };
            assert!(m.failed(row.spec.exact()));
            assert_eq!(m.check.differs_from_rank0, vec![false, false, true, false]);
            if row.spec.exact() {
                assert_eq!(m.check.wrong_elements, 1);
            }
        }
    }
}
