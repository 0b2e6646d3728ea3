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
        let mut ok = true;
        for world in [2usize, 4, 8] {
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
        for world in [2usize, 4, 8] {
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
        if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    /// Start `world` workers for `scenario`; their exit codes in rank order.
    fn launch(world: usize, scenario: &str) -> Vec<i32> {
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
        let children: Vec<_> = (0..world)
            .map(|rank| {
                Command::new(&exe)
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env(SECRET_ENV, secret.to_hex())
                    .env("SCENARIO", scenario)
                    .env("REBUILD_PORT", rebuild_port.to_string())
                    .spawn()
                    .expect("start a worker")
            })
            .collect();
        children
            .into_iter()
            .map(|mut c| c.wait().ok().and_then(|s| s.code()).unwrap_or(-1))
            .collect()
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
            .timeout(Duration::from_secs(3));
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
}
