//! One process per rank on CUDA: the launcher (this program with no `RANK` set) starts N
//! copies of itself torchrun-style (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, a
//! per-group secret), each builds its rank with `Communicator::new_rank` over the TCP
//! bootstrap (workspaces exchanged as CUDA IPC handles), and runs calls whose results it
//! checks itself: exact sums of integer data bit for bit, quantized results against the
//! format's definition. Then a group in which one rank stops making calls: the others must
//! report `Error::Timeout` (or `Aborted`) within the deadline, not hang, drop cleanly, and
//! build a new group of the survivors (ranks renumbered, a new rendezvous) that works.
//! Then registration across processes: memory allocated and registered over the bootstrap is
//! read by the peers in place (ranks that disagree on the offset get the registered path's
//! mismatch), and a graph captured on plain memory replays exactly once its buffers are
//! registered after capture (and fails on every rank before).
//!
//! Then the soak and fault scenarios: groups of 4 processes created and dropped over and over
//! (each with registered memory, a checked call, and a call through the vendor library where
//! it is present), after which each process's resident memory, the device memory in use and
//! its open IPC mappings must be back at their baseline; and a rank killed with SIGKILL while
//! the group calls: every survivor's call fails within the deadline with an error that names
//! the dead rank, and the survivors build a new group in the same processes that works. The
//! kill runs last: a fault it provoked could take the other MPS clients down with it.
//! Arguments that do not start with `-` pick scenarios by substring (`calls`, `registered`,
//! `quit`, `cycles`, `kill`).
//!
//! All ranks share GPU 0 by default (`ALLREDUCE_TEST_DEVICES=0,1,..` spreads them): start
//! MPS first (`nvidia-cuda-mps-control -d`), or the processes' kernels only time-slice. Skips with the
//! reason when there is no GPU.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("cuda_processes skipped: built without the cuda feature");
}

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    if std::env::var_os("RANK").is_some() {
        procs::worker()
    } else {
        procs::launcher()
    }
}

#[cfg(feature = "cuda")]
mod procs {
    use std::process::{Command, ExitCode};
    use std::time::{Duration, Instant};

    use allreduce::cuda::CudaRuntime;
    use allreduce::{
        AllReduceOptions, BackendKind, BufMut, BufRef, Codec, Communicator, DType, Error,
        GroupConfig, HostBytes, Precision, Strategy,
    };
    use allreduce_bootstrap::{Secret, TcpBootstrap, TcpBootstrapConfig, SECRET_ENV};
    use allreduce_gpu::device::{DeviceBuffer, GpuDevice, GpuStream};

    /// Exit code of a rank that saw the expected timeout in the failure scenario.
    const TIMED_OUT: u8 = 3;
    /// The rank that leaves early in the failure scenario.
    const QUITTER: usize = 1;
    /// The rank killed with SIGKILL in the kill scenario.
    const VICTIM: usize = 2;
    /// What the victim prints once it is making calls, which the launcher waits for.
    const CALLING: &str = "KILL-ME-NOW";
    /// The calls' deadline (`GroupConfig::timeout`) in every scenario.
    const DEADLINE: Duration = Duration::from_secs(3);
    /// Over the deadline, for a survivor to notice, report and return.
    const SLACK: Duration = Duration::from_secs(2);

    fn ints(n: usize, dtype: DType, rank: usize, round: usize) -> HostBytes {
        let mut b = HostBytes::zeroed(n * dtype.size());
        for i in 0..n {
            let v = ((rank * 7 + i * 3 + round * 5) % 23) as f32 - 11.0;
            dtype.store_f32(b.as_mut_slice(), i, v);
        }
        b
    }

    /// (length, dtype, strategy, precision) of each call.
    fn calls() -> Vec<(usize, DType, Strategy, Precision)> {
        vec![
            (1, DType::F32, Strategy::OneShot, Precision::Exact),
            (4097, DType::BF16, Strategy::OneShot, Precision::Exact),
            (70_001, DType::F16, Strategy::TwoShot, Precision::Exact),
            (1 << 20, DType::BF16, Strategy::TwoShot, Precision::Exact),
            (
                33_333,
                DType::BF16,
                Strategy::QuantizedTwoShot,
                Precision::Lossy(Codec::Int4Adaptive),
            ),
            (
                1 << 18,
                DType::F16,
                Strategy::QuantizedTwoShot,
                Precision::Lossy(Codec::Fp8E4M3),
            ),
            (5000, DType::F32, Strategy::Auto, Precision::Exact),
        ]
    }

    fn expected(
        n: usize,
        dtype: DType,
        precision: Precision,
        world: usize,
        round: usize,
    ) -> HostBytes {
        let inputs: Vec<HostBytes> = (0..world).map(|r| ints(n, dtype, r, round)).collect();
        match precision {
            Precision::Exact => {
                let mut b = HostBytes::zeroed(n * dtype.size());
                for i in 0..n {
                    let s: f32 = inputs.iter().map(|x| dtype.load_f32(x.as_slice(), i)).sum();
                    dtype.store_f32(b.as_mut_slice(), i, s);
                }
                b
            }
            Precision::Lossy(codec) => {
                allreduce_conformance::check::quantized_expected(&inputs, dtype, codec)
            }
        }
    }

    pub fn launcher() -> ExitCode {
        // Under MPS every client's hardware queues count against the server's limit: with the
        // default (8) only 3 clients got a context on the H200 (MPS_MAX_CONNECTIONS_REACHED),
        // and setting 1 in the workers alone was not enough while this launcher, the server's
        // first client (it asks the driver for devices), kept the default. So before any CUDA
        // call, here and (inherited) in every worker. A rank uses one stream.
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "1");
        }
        match allreduce::cuda::driver::device_count() {
            Ok(n) if n > 0 => {}
            Ok(_) => {
                println!("cuda_processes skipped: the driver reports no CUDA device");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                println!("cuda_processes skipped: {e}");
                return ExitCode::SUCCESS;
            }
        }
        let filters: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f));
        let mut ok = true;
        for world in [2usize, 4, 8].into_iter().filter(|_| wanted("calls")) {
            let t = Instant::now();
            let codes = launch(world, "calls");
            let good = codes.iter().all(|&c| c == 0);
            println!(
                "{world} processes, {} calls x 3 rounds: {} ({:.2} s)",
                calls().len(),
                if good { "ok" } else { "FAILED" },
                t.elapsed().as_secs_f64()
            );
            ok &= good;
        }
        for world in [2usize, 4, 8].into_iter().filter(|_| wanted("registered")) {
            let t = Instant::now();
            let codes = launch(world, "registered");
            let good = codes.iter().all(|&c| c == 0);
            println!(
                "{world} processes, registered memory and graph buffers registered after \
                 capture x {GRAPH_REPLAYS} replays: {} ({:.2} s)",
                if good { "ok" } else { "FAILED" },
                t.elapsed().as_secs_f64()
            );
            ok &= good;
        }
        let world = 4;
        if wanted("quit") {
            let t = Instant::now();
            let codes = launch(world, "quit");
            let good = codes
                .iter()
                .enumerate()
                .all(|(r, &c)| c == if r == QUITTER { 0 } else { TIMED_OUT as i32 });
            println!(
                "{world} processes, rank {QUITTER} stops calling: the others {} ({:.2} s, exit codes {codes:?})",
                if good {
                    "time out cleanly, then rebuild a group of 3 that works"
                } else {
                    "FAILED"
                },
                t.elapsed().as_secs_f64()
            );
            ok &= good;
        }
        if wanted("cycles") {
            let t = Instant::now();
            let codes = launch(world, "cycles");
            let good = codes.iter().all(|&c| c == 0);
            println!(
                "{world} processes, {} groups created and dropped (registered memory, a call,                  the vendor library's where present): RSS, device memory and IPC mappings {}                  ({:.2} s)",
                soak_cycles(),
                if good { "back at the baseline" } else { "FAILED" },
                t.elapsed().as_secs_f64()
            );
            ok &= good;
        }
        if wanted("kill") {
            let t = Instant::now();
            let codes = launch_and_kill(world);
            let good = codes
                .iter()
                .enumerate()
                .all(|(r, &c)| c == if r == VICTIM { -9 } else { TIMED_OUT as i32 });
            println!(
                "{world} processes, rank {VICTIM} killed with SIGKILL mid-call: the others {}                  ({:.2} s, exit codes {codes:?}, -9: killed)",
                if good {
                    "fail within the deadline naming it, then rebuild a group of 3 that works"
                } else {
                    "FAILED"
                },
                t.elapsed().as_secs_f64()
            );
            ok &= good;
        }
        if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    /// The commands that start `world` workers for `scenario`, in rank order.
    fn workers(world: usize, scenario: &str) -> Vec<Command> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let rebuild_port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let secret = Secret::generate().expect("random bytes");
        let exe = std::env::current_exe().expect("this program");
        (0..world)
            .map(|rank| {
                let mut c = Command::new(&exe);
                c.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env(SECRET_ENV, secret.to_hex())
                    .env("SCENARIO", scenario)
                    .env("REBUILD_PORT", rebuild_port.to_string());
                c
            })
            .collect()
    }

    /// An exit status as a number: the code, or minus the signal that ended the process.
    fn code(status: std::process::ExitStatus) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        status.code().or(status.signal().map(|s| -s)).unwrap_or(-1)
    }

    /// Start `world` workers for `scenario`; their exit codes in rank order.
    fn launch(world: usize, scenario: &str) -> Vec<i32> {
        let children: Vec<_> = workers(world, scenario)
            .iter_mut()
            .map(|c| c.spawn().expect("start a worker"))
            .collect();
        children
            .into_iter()
            .map(|mut c| c.wait().map_or(-1, code))
            .collect()
    }

    /// The kill scenario: start `world` workers, and once the victim says it is making calls
    /// (the others are too, in step with it), kill it with SIGKILL. Exit codes in rank order
    /// (the victim's -9).
    fn launch_and_kill(world: usize) -> Vec<i32> {
        use std::io::BufRead;
        let mut children: Vec<_> = workers(world, "kill")
            .iter_mut()
            .enumerate()
            .map(|(r, c)| {
                if r == VICTIM {
                    c.stdout(std::process::Stdio::piped());
                }
                c.spawn().expect("start a worker")
            })
            .collect();
        let out = children[VICTIM].stdout.take().expect("piped");
        let mut lines = std::io::BufReader::new(out).lines();
        let ready = lines.any(|l| l.is_ok_and(|l| l.starts_with(CALLING)));
        if ready {
            // Well into its calls: a few rounds of them run in the meantime.
            std::thread::sleep(Duration::from_millis(200));
            eprintln!("killing rank {VICTIM} (SIGKILL)");
        } else {
            eprintln!("rank {VICTIM} ended before it made its calls");
        }
        let _ = children[VICTIM].kill();
        children
            .into_iter()
            .map(|mut c| c.wait().map_or(-1, code))
            .collect()
    }

    /// Groups the cycles scenario creates and drops after its warm-up.
    fn soak_cycles() -> usize {
        allreduce_conformance::soak::count(allreduce_conformance::soak::CYCLES_ENV, 100, 1000)
    }

    fn ordinal(rank: usize) -> u32 {
        let list: Vec<u32> = std::env::var("ALLREDUCE_TEST_DEVICES")
            .ok()
            .map(|s| s.split(',').filter_map(|d| d.trim().parse().ok()).collect())
            .unwrap_or_default();
        if list.is_empty() {
            0
        } else {
            list[rank % list.len()]
        }
    }

    pub fn worker() -> ExitCode {
        let scenario = std::env::var("SCENARIO").unwrap_or_default();
        match run_worker(&scenario) {
            Ok(code) => code,
            Err(e) => {
                let rank = std::env::var("RANK").unwrap_or_default();
                eprintln!("rank {rank} ({scenario}): {e}");
                ExitCode::FAILURE
            }
        }
    }

    /// One round of every call on `comm`: inputs from `rank`, results checked for a group of
    /// `world`. `Err(Ok(e))` is the error `synchronize` reported; `Err(Err(text))` anything else.
    fn round(
        comm: &Communicator,
        stream: &GpuStream<CudaRuntime>,
        bufs: &[(DeviceBuffer<CudaRuntime>, DeviceBuffer<CudaRuntime>)],
        rank: usize,
        world: usize,
        round: usize,
    ) -> Result<(), Result<Error, String>> {
        let e = |e: Error| Err(e.to_string());
        let shapes = calls();
        for (&(n, dtype, _, _), (input, _)) in shapes.iter().zip(bufs) {
            input
                .upload(ints(n, dtype, rank, round).as_slice(), stream)
                .map_err(e)?;
        }
        for (&(n, dtype, strategy, precision), (input, output)) in shapes.iter().zip(bufs) {
            // SAFETY: both buffers hold n elements and outlive the calls.
            let (iv, ov) = unsafe {
                (
                    BufRef::from_raw(input.addr(), n, dtype, comm.device()),
                    BufMut::from_raw(output.addr(), n, dtype, comm.device()),
                )
            };
            let opts = AllReduceOptions::default()
                .strategy(strategy)
                .precision(precision)
                .stream(stream.handle());
            comm.all_reduce(iv, ov, &opts).map_err(e)?;
        }
        comm.synchronize(stream.handle()).map_err(Ok)?;
        for (&(n, dtype, _, precision), (_, output)) in shapes.iter().zip(bufs) {
            let mut got = HostBytes::zeroed(n * dtype.size());
            output.download(got.as_mut_slice(), stream).map_err(e)?;
            let want = expected(n, dtype, precision, world, round);
            if let Some(i) = (0..n)
                .find(|&i| dtype.load_f32(got.as_slice(), i) != dtype.load_f32(want.as_slice(), i))
            {
                return Err(Err(format!(
                    "round {round}, {n} {dtype} {precision}: element {i} is {} not {}",
                    dtype.load_f32(got.as_slice(), i),
                    dtype.load_f32(want.as_slice(), i)
                )));
            }
        }
        Ok(())
    }

    fn new_comm(
        boot: &mut TcpBootstrap,
        rank: usize,
        world: usize,
    ) -> Result<Communicator, String> {
        let config = GroupConfig::new(world)
            .devices(vec![ordinal(rank)])
            .max_bytes(4 << 20)
            .timeout(DEADLINE);
        Communicator::new_rank(BackendKind::Cuda, config, boot).map_err(|e| e.to_string())
    }

    const GRAPH_REPLAYS: usize = 100;

    /// Registered memory and graph buffers across processes (see the module's comment).
    fn registered(
        comm: &Communicator,
        boot: &mut TcpBootstrap,
        stream: &GpuStream<CudaRuntime>,
    ) -> Result<(), String> {
        let e = |e: Error| e.to_string();
        let (rank, world) = (comm.rank(), comm.world_size());
        // (length, dtype, strategy, byte offset); the two-shot is split by the 4 MiB workspace.
        let shapes = [
            (1000, DType::F16, Strategy::OneShot, 0usize),
            (3 << 20, DType::BF16, Strategy::TwoShot, 4096),
            (
                4097,
                DType::F32,
                Strategy::Auto,
                (4096 + (6 << 20) + 4095) / 16 * 16,
            ),
        ];
        let bytes = shapes
            .iter()
            .map(|&(n, d, _, at)| at + n * d.size())
            .max()
            .unwrap();
        let check = |out: &DeviceBuffer<CudaRuntime>, n: usize, dtype: DType, round: usize| {
            let mut got = HostBytes::zeroed(n * dtype.size());
            out.download(got.as_mut_slice(), stream).map_err(e)?;
            let want = expected(n, dtype, Precision::Exact, world, round);
            match (0..n).find(|&i| {
                got.as_slice()[i * dtype.size()..][..dtype.size()]
                    != want.as_slice()[i * dtype.size()..][..dtype.size()]
            }) {
                Some(i) => Err(format!(
                    "round {round}, {n} {dtype}: element {i} is {} not {}",
                    dtype.load_f32(got.as_slice(), i),
                    dtype.load_f32(want.as_slice(), i)
                )),
                None => Ok(()),
            }
        };
        let outs: Vec<DeviceBuffer<CudaRuntime>> = shapes
            .iter()
            .map(|&(n, d, _, _)| DeviceBuffer::zeroed(n * d.size(), stream))
            .collect::<Result<_, _>>()
            .map_err(e)?;
        stream.synchronize().map_err(e)?;

        // Eager calls on registered memory.
        let mut reg = comm.alloc_registered(bytes, boot).map_err(e)?;
        for &(n, dtype, _, at) in &shapes {
            reg.upload(at, ints(n, dtype, rank, 0).as_slice())
                .map_err(e)?;
        }
        allreduce::Bootstrap::all_gather(boot, b"uploaded").map_err(e)?;
        for (&(n, dtype, strategy, at), out) in shapes.iter().zip(&outs) {
            let iv = reg.view(at, n, dtype).map_err(e)?;
            // SAFETY: the output holds n elements and outlives the call.
            let ov = unsafe { BufMut::from_raw(out.addr(), n, dtype, comm.device()) };
            let o = AllReduceOptions::default()
                .strategy(strategy)
                .stream(stream.handle());
            comm.all_reduce(iv, ov, &o).map_err(e)?;
        }
        comm.synchronize(stream.handle()).map_err(e)?;
        for (&(n, dtype, _, _), out) in shapes.iter().zip(&outs) {
            check(out, n, dtype, 0)?;
        }
        // Only the registered path compares offsets: rank 1 reads 16 bytes further.
        let at = if rank == 1 { 16 } else { 0 };
        let iv = reg.view(at, 64, DType::F32).map_err(e)?;
        // SAFETY: as above.
        let ov = unsafe { BufMut::from_raw(outs[0].addr(), 64, DType::F32, comm.device()) };
        let o = AllReduceOptions::default()
            .strategy(Strategy::OneShot)
            .stream(stream.handle());
        comm.all_reduce(iv, ov, &o).map_err(e)?;
        match comm.synchronize(stream.handle()) {
            Err(Error::RankMismatch {
                what: "registered input",
                ..
            }) => {}
            other => return Err(format!("offsets that differ gave {other:?}")),
        }

        // Graph buffers: plain memory (this allocation, deregistered), captured with graph
        // registration on, registered after capture.
        let id = reg.id();
        comm.deregister(id).map_err(e)?;
        comm.set_graph_registration(true).map_err(e)?;
        let enqueue = || -> allreduce::Result<()> {
            for (&(n, dtype, strategy, at), out) in shapes.iter().zip(&outs) {
                let iv = reg.view(at, n, dtype)?;
                // SAFETY: as above; the graph outlives neither buffer.
                let ov = unsafe { BufMut::from_raw(out.addr(), n, dtype, comm.device()) };
                let o = AllReduceOptions::default()
                    .strategy(strategy)
                    .stream(stream.handle());
                comm.all_reduce(iv, ov, &o)?;
            }
            Ok(())
        };
        let graph = allreduce_gpu::device::GpuGraph::capture(stream, enqueue).map_err(e)?;
        graph.launch(stream).map_err(e)?;
        match comm.synchronize(stream.handle()) {
            Err(Error::InvalidArgument(m)) if m.contains("register_graph_buffers") => {}
            other => return Err(format!("a replay before registration gave {other:?}")),
        }
        let n = comm.register_graph_buffers_rank(boot).map_err(e)?;
        if n != shapes.len() {
            return Err(format!(
                "registered {n} graph calls, captured {}",
                shapes.len()
            ));
        }
        for round in 1..=GRAPH_REPLAYS {
            // Every rank's new input is in place before any rank's replay reads it.
            for &(n, dtype, _, at) in &shapes {
                reg.upload(at, ints(n, dtype, rank, round).as_slice())
                    .map_err(e)?;
            }
            allreduce::Bootstrap::all_gather(boot, b"uploaded").map_err(e)?;
            graph.launch(stream).map_err(e)?;
            comm.synchronize(stream.handle()).map_err(e)?;
            for (&(n, dtype, _, _), out) in shapes.iter().zip(&outs) {
                check(out, n, dtype, round)?;
            }
            // No rank overwrites its input while a peer's replay may still read it.
            allreduce::Bootstrap::all_gather(boot, b"checked").map_err(e)?;
        }
        comm.set_graph_registration(false).map_err(e)?;
        Ok(())
    }

    fn run_worker(scenario: &str) -> Result<ExitCode, String> {
        let e = |e: Error| e.to_string();
        let mut boot = TcpBootstrap::from_env().map_err(e)?;
        let rank = allreduce::Bootstrap::rank(&boot);
        let world = allreduce::Bootstrap::world_size(&boot);
        let comm = new_comm(&mut boot, rank, world)?;
        let dev = GpuDevice::<CudaRuntime>::open(ordinal(rank)).map_err(e)?;
        dev.prepare_virtual_ranks().map_err(e)?;
        let stream = GpuStream::new(&dev).map_err(e)?;
        stream.warm(&dev).map_err(e)?;
        if scenario == "registered" {
            registered(&comm, &mut boot, &stream)?;
            allreduce::Bootstrap::all_gather(&mut boot, b"done").map_err(e)?;
            return Ok(ExitCode::SUCCESS);
        }
        if scenario == "cycles" {
            drop(comm);
            cycles(&mut boot, &stream)?;
            return Ok(ExitCode::SUCCESS);
        }
        let mut bufs = Vec::new();
        for &(n, dtype, _, _) in &calls() {
            bufs.push((
                DeviceBuffer::zeroed(n * dtype.size(), &stream).map_err(e)?,
                DeviceBuffer::zeroed(n * dtype.size(), &stream).map_err(e)?,
            ));
        }
        stream.synchronize().map_err(e)?;
        // Everyone's buffers exist before anyone calls (an allocation may wait for the
        // device, which a peer's spinning kernel keeps busy).
        allreduce::Bootstrap::all_gather(&mut boot, b"ready").map_err(e)?;

        if scenario == "kill" {
            return killed(comm, &stream, &bufs, rank, world);
        }
        let rounds = if scenario == "quit" { 2 } else { 3 };
        for r in 0..rounds {
            if scenario == "quit" && r == 1 && rank == QUITTER {
                // Stop taking part (a rank stuck in its own code, or dead): no more calls.
                // The process stays until its peers have given up, so its workspace, which
                // they map, outlives their kernels: a process that exits for real frees it
                // under them, and a fault there would take every MPS client down with it.
                std::thread::sleep(Duration::from_secs(12));
                return Ok(ExitCode::SUCCESS);
            }
            match round(&comm, &stream, &bufs, rank, world, r) {
                Ok(()) => {}
                Err(Ok(err @ (Error::Timeout { .. } | Error::Aborted { .. })))
                    if scenario == "quit" =>
                {
                    eprintln!("rank {rank}: as expected: {err}");
                    // The survivors drop the broken group and build a new one without the
                    // quitter (ranks renumbered, a new rendezvous), as a serving process
                    // would after losing a peer, and check a round of calls on it.
                    drop(comm);
                    let port: u16 = std::env::var("REBUILD_PORT")
                        .ok()
                        .and_then(|p| p.parse().ok())
                        .ok_or("no REBUILD_PORT")?;
                    let secret = Secret::from_hex(&std::env::var(SECRET_ENV).unwrap_or_default())
                        .map_err(e)?;
                    let (new_rank, new_world) = (rank - usize::from(rank > QUITTER), world - 1);
                    let mut boot2 = TcpBootstrap::new(
                        TcpBootstrapConfig::new(new_rank, new_world, port)
                            .master_addr("127.0.0.1")
                            .secret(secret),
                    )
                    .map_err(e)?;
                    let comm2 = new_comm(&mut boot2, new_rank, new_world)?;
                    allreduce::Bootstrap::all_gather(&mut boot2, b"ready").map_err(e)?;
                    round(&comm2, &stream, &bufs, new_rank, new_world, 7).map_err(|r| {
                        format!(
                            "the rebuilt group of {new_world}: {}",
                            r.map_or_else(|t| t, |e| e.to_string())
                        )
                    })?;
                    allreduce::Bootstrap::all_gather(&mut boot2, b"done").map_err(e)?;
                    return Ok(ExitCode::from(TIMED_OUT));
                }
                Err(Ok(err)) => return Err(err.to_string()),
                Err(Err(text)) => return Err(text),
            }
        }
        if scenario == "quit" {
            return Err("the call without rank 1 did not time out".into());
        }
        // Nobody unmaps a peer's workspace while that peer may still run a call.
        allreduce::Bootstrap::all_gather(&mut boot, b"done").map_err(e)?;
        Ok(ExitCode::SUCCESS)
    }

    /// The survivors' new group without `dead` (ranks renumbered, a new rendezvous on
    /// `REBUILD_PORT`): a round of calls on it, checked.
    fn rebuild(
        stream: &GpuStream<CudaRuntime>,
        bufs: &[(DeviceBuffer<CudaRuntime>, DeviceBuffer<CudaRuntime>)],
        rank: usize,
        world: usize,
        dead: usize,
    ) -> Result<(), String> {
        let e = |e: Error| e.to_string();
        let port: u16 = std::env::var("REBUILD_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .ok_or("no REBUILD_PORT")?;
        let secret = Secret::from_hex(&std::env::var(SECRET_ENV).unwrap_or_default()).map_err(e)?;
        let (new_rank, new_world) = (rank - usize::from(rank > dead), world - 1);
        let mut boot = TcpBootstrap::new(
            TcpBootstrapConfig::new(new_rank, new_world, port)
                .master_addr("127.0.0.1")
                .secret(secret),
        )
        .map_err(e)?;
        let comm = new_comm(&mut boot, new_rank, new_world)?;
        allreduce::Bootstrap::all_gather(&mut boot, b"ready").map_err(e)?;
        round(&comm, stream, bufs, new_rank, new_world, 7).map_err(|r| {
            format!(
                "the rebuilt group of {new_world}: {}",
                r.map_or_else(|t| t, |e| e.to_string())
            )
        })?;
        allreduce::Bootstrap::all_gather(&mut boot, b"done").map_err(e)?;
        Ok(())
    }

    /// Whether `text` names rank `r`: "rank 2", or "ranks 1, 2" / "ranks [1, 2]".
    fn names_rank(text: &str, r: usize) -> bool {
        text.match_indices("rank").any(|(i, _)| {
            let rest = text[i + 4..].trim_start_matches(['s', ' ', '[']);
            let list: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || ", ]&and".contains(*c))
                .collect();
            list.split([',', ' ', ']', '&', 'a', 'n', 'd'])
                .any(|n| n.parse() == Ok(r))
        })
    }

    /// The kill scenario's worker: rounds of calls until one fails. The victim never sees
    /// one fail (the launcher kills it in its calls); every survivor's must fail within the
    /// deadline with an error naming the victim, and the survivors then regroup.
    fn killed(
        comm: Communicator,
        stream: &GpuStream<CudaRuntime>,
        bufs: &[(DeviceBuffer<CudaRuntime>, DeviceBuffer<CudaRuntime>)],
        rank: usize,
        world: usize,
    ) -> Result<ExitCode, String> {
        // Long enough for the launcher to have killed the victim many times over.
        let give_up = Instant::now() + Duration::from_secs(60);
        for r in 0.. {
            if rank == VICTIM && r == 2 {
                use std::io::Write;
                println!("{CALLING}");
                let _ = std::io::stdout().flush();
            }
            let start = Instant::now();
            match round(&comm, stream, bufs, rank, world, r % 5) {
                Ok(()) if Instant::now() < give_up => continue,
                Ok(()) => return Err(format!("rank {VICTIM} was never killed")),
                Err(Ok(err @ (Error::Timeout { .. } | Error::Aborted { .. }))) => {
                    let took = start.elapsed();
                    let text = err.to_string();
                    eprintln!("rank {rank}: after {took:?}, as expected: {text}");
                    if took > DEADLINE + SLACK {
                        return Err(format!(
                            "the failing round took {took:?}, past the {DEADLINE:?} deadline"
                        ));
                    }
                    if !names_rank(&text, VICTIM) {
                        return Err(format!(
                            "the error does not name the killed rank {VICTIM}: {text}"
                        ));
                    }
                    // The dead rank's mapping goes with the group; the survivors' new group
                    // works.
                    drop(comm);
                    rebuild(stream, bufs, rank, world, VICTIM)?;
                    return Ok(ExitCode::from(TIMED_OUT));
                }
                Err(Ok(err)) => return Err(format!("round {r}: {err}")),
                Err(Err(text)) => return Err(format!("round {r}: {text}")),
            }
        }
        unreachable!("the loop returns")
    }

    /// Peers' allocations mapped, RSS and device memory in use, at a point where no process
    /// of the group holds a group (every rank measures between two all-gathers).
    fn measure(boot: &mut TcpBootstrap) -> Result<allreduce_conformance::soak::Resources, String> {
        let e = |e: Error| e.to_string();
        let rank = allreduce::Bootstrap::rank(boot);
        allreduce::Bootstrap::all_gather(boot, b"measure").map_err(e)?;
        let r = allreduce_conformance::soak::Resources {
            rss: allreduce_conformance::soak::rss_bytes(),
            device_used: Some(allreduce::cuda::driver::memory_in_use(ordinal(rank)).map_err(e)?),
            ipc_mappings: Some(allreduce::cuda::open_ipc_mappings()),
        };
        allreduce::Bootstrap::all_gather(boot, b"measured").map_err(e)?;
        Ok(r)
    }

    /// The cycles scenario's worker: groups of one process per rank created over the same
    /// bootstrap and dropped, each with registered memory and checked calls; after a warm-up,
    /// this process's resources must come back to the baseline (the soak module's
    /// tolerances; IPC mappings exactly). Device memory is the whole device's, measured when
    /// every process has dropped its group.
    fn cycles(boot: &mut TcpBootstrap, stream: &GpuStream<CudaRuntime>) -> Result<(), String> {
        use allreduce_conformance::soak;
        let e = |e: Error| e.to_string();
        let (rank, world) = (
            allreduce::Bootstrap::rank(boot),
            allreduce::Bootstrap::world_size(boot),
        );
        let n = 4097;
        let dtype = DType::BF16;
        let out = DeviceBuffer::<CudaRuntime>::zeroed(n * dtype.size(), stream).map_err(e)?;
        let input = DeviceBuffer::<CudaRuntime>::zeroed(n * dtype.size(), stream).map_err(e)?;
        stream.synchronize().map_err(e)?;
        let want = expected(n, dtype, Precision::Exact, world, 0);
        let one = |boot: &mut TcpBootstrap, c: usize| -> Result<(), String> {
            let comm = new_comm(boot, rank, world)?;
            let mut reg = comm.alloc_registered(64 << 10, boot).map_err(e)?;
            reg.upload(32, ints(n, dtype, rank, 0).as_slice())
                .map_err(e)?;
            input
                .upload(ints(n, dtype, rank, 0).as_slice(), stream)
                .map_err(e)?;
            allreduce::Bootstrap::all_gather(boot, b"uploaded").map_err(e)?;
            let mut strategies = vec![Strategy::OneShot, Strategy::TwoShot];
            strategies.extend(
                [Strategy::Vendor, Strategy::VendorSymmetric]
                    .into_iter()
                    .filter(|&s| comm.strategy_available(s, dtype, Precision::Exact).is_ok()),
            );
            for (i, &s) in strategies.iter().enumerate() {
                // The registered input for our own strategies, a plain one for the vendor's.
                let iv = if s.is_vendor() {
                    // SAFETY: the buffer holds n elements and outlives the call.
                    unsafe { BufRef::from_raw(input.addr(), n, dtype, comm.device()) }
                } else {
                    reg.view(32, n, dtype).map_err(e)?
                };
                // SAFETY: as above.
                let ov = unsafe { BufMut::from_raw(out.addr(), n, dtype, comm.device()) };
                let o = AllReduceOptions::default()
                    .strategy(s)
                    .stream(stream.handle());
                comm.all_reduce(iv, ov, &o).map_err(e)?;
                comm.synchronize(stream.handle()).map_err(e)?;
                let mut got = HostBytes::zeroed(n * dtype.size());
                out.download(got.as_mut_slice(), stream).map_err(e)?;
                if got.as_slice() != want.as_slice() {
                    return Err(format!("cycle {c}, call {i} ({s}): wrong sum"));
                }
            }
            // Nobody unmaps a peer's memory while that peer may still run a call.
            allreduce::Bootstrap::all_gather(boot, b"done").map_err(e)?;
            drop(reg);
            drop(comm);
            Ok(())
        };
        for c in 0..soak::WARM_UP_CYCLES {
            one(boot, c)?;
        }
        let baseline = measure(boot)?;
        let cycles = soak_cycles();
        let t = Instant::now();
        for c in 0..cycles {
            one(boot, soak::WARM_UP_CYCLES + c)?;
        }
        let elapsed = t.elapsed();
        let end = measure(boot)?;
        println!(
            "rank {rank}: {cycles} groups in {:.2} s ({:.1} ms each): baseline {baseline}; after {end}",
            elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e3 / cycles.max(1) as f64
        );
        soak::within(&baseline, &end).map_err(|w| format!("after {cycles} groups: {w}"))
    }
}
