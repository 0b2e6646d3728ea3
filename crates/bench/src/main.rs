//! `allreduce-bench`: an nccl-tests-like bandwidth and correctness sweep of the allreduce
//! library. `--help` describes the flags and the measurements.

#[cfg(any(feature = "cuda", feature = "rocm"))]
mod baselines;
mod buffers;
mod cli;
mod data;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod fused;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod gpu;
mod metrics;
#[cfg(feature = "peers")]
mod peer_harness;
mod plot;
mod report;
mod runner;
mod tune;
#[cfg(feature = "peers")]
mod versus;
#[cfg(feature = "peers")]
mod versus_fused;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use allreduce::{Communicator, GroupConfig, Strategy};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use cli::Args;
use report::{Git, Machine, RunInfo};
use runner::{Config, Iters, RowSpec};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("allreduce-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `items` without repeats, in first-seen order.
fn dedup<T: PartialEq + Copy>(items: &[T]) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(items.len());
    for &x in items {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// A row as the progress bar names it while it runs.
fn describe(row: &RowSpec) -> String {
    format!("{} B {} {}", row.bytes, row.strategy, row.precision)
}

fn run(args: &Args) -> Result<ExitCode, BoxError> {
    if args.peers {
        return run_peers(args);
    }
    if args.fused {
        return run_fused(args);
    }
    if !(args.row_time.is_finite() && args.row_time > 0.0) {
        return Err(format!(
            "--row-time must be a positive number of seconds, not {}",
            args.row_time
        )
        .into());
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout < 1e9) {
        return Err(format!(
            "--timeout must be a positive number of seconds, not {}",
            args.timeout
        )
        .into());
    }
    let dtype = args.dtype;
    let sizes = cli::sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, dtype.size());
    if args.minbytes > args.maxbytes {
        return Err(format!(
            "--minbytes ({}) is larger than --maxbytes ({})",
            args.minbytes, args.maxbytes
        )
        .into());
    }
    if sizes.is_empty() {
        return Err(format!(
            "no sizes to run: -b {} -e {} holds no whole {dtype} element ({} bytes)",
            args.minbytes,
            args.maxbytes,
            dtype.size()
        )
        .into());
    }
    let mut strategies = args.strategy.clone();
    if args.tune.is_some() {
        // A tuned table must never pick a custom path measured slower than the vendor
        // library, so the vendor strategies are always measured (rows the group cannot run
        // are skipped and win nothing).
        strategies.extend([Strategy::Vendor, Strategy::VendorSymmetric]);
    }
    let strategies = dedup(&strategies);
    let precisions = dedup(&args.precision);
    let rows: Vec<RowSpec> = sizes
        .iter()
        .flat_map(|&bytes| {
            let precisions = &precisions;
            strategies.iter().flat_map(move |&strategy| {
                precisions.iter().map(move |&precision| RowSpec {
                    bytes,
                    count: bytes / dtype.size(),
                    strategy,
                    precision,
                })
            })
        })
        .collect();

    let max_bytes = sizes.iter().copied().max().unwrap_or(0).max(1);
    let mut config = GroupConfig::new(args.ranks)
        .max_bytes(max_bytes)
        .timeout(Duration::from_secs_f64(args.timeout));
    if !args.devices.is_empty() && args.backend != allreduce::BackendKind::Host {
        config = config.devices(
            (0..args.ranks)
                .map(|r| args.devices[r % args.devices.len()])
                .collect(),
        );
    }
    let comms = Communicator::new_group(args.backend, config).map_err(|e| {
        format!(
            "cannot build a {}-rank {} group: {e}",
            args.ranks, args.backend
        )
    })?;
    let factory = buffers::factory(args.backend)?;

    let cfg = Config {
        dtype,
        in_place: args.inplace,
        data: args.data,
        hidden: args.hidden,
        warmup: args.warmup,
        iters: match args.iters {
            Some(n) => Iters::Fixed(n),
            None => Iters::Budget {
                seconds: args.row_time,
                max: args.max_iters,
            },
        },
    };
    let machine = Machine::detect();
    let devices: Vec<_> = comms.iter().map(|c| c.device()).collect();
    let device_models = report::device_models(&devices, &machine);
    let info = RunInfo {
        command: cli::command_line(),
        backend: args.backend.to_string(),
        world: comms.len(),
        devices: comms.iter().map(|c| c.device().to_string()).collect(),
        minbytes: args.minbytes,
        maxbytes: args.maxbytes,
        stepfactor: args.stepfactor,
        sizes: sizes.len(),
        strategies: strategies.iter().map(|s| s.to_string()).collect(),
        precisions: precisions.iter().map(|p| p.to_string()).collect(),
        timeout_s: args.timeout,
        cfg: cfg.clone(),
        machine,
        git: Git::detect(),
        topology: comms[0].topology().map(|t| t.to_string()),
        device_models,
    };

    let mut stdout = std::io::stdout().lock();
    if !args.json {
        writeln!(stdout, "{}", report::header(&info))?;
    }
    let progress = if std::io::stderr().is_terminal() {
        let pb = ProgressBar::new(rows.len() as u64);
        if let Ok(style) =
            ProgressStyle::with_template("{bar:32} {pos}/{len} rows  {elapsed}  {msg}")
        {
            pb.set_style(style);
        }
        pb
    } else {
        ProgressBar::hidden()
    };
    if let Some(first) = rows.first() {
        progress.set_message(describe(first));
    }
    let world = comms.len();
    let mut done = 0;
    let mut write_error = None;
    let sweep = runner::run_sweep(&comms, &*factory, &cfg, &rows, |row| {
        if !args.json {
            let line = report::row_line(row, world, &cfg);
            progress.suspend(|| {
                if let Err(e) = writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
                    write_error.get_or_insert(e);
                }
            });
        }
        done += 1;
        progress.inc(1);
        if let Some(next) = rows.get(done) {
            progress.set_message(describe(next));
        }
    });
    progress.finish_and_clear();
    if let Some(e) = write_error {
        return Err(format!("writing the table: {e}").into());
    }

    let summary = report::summarize(&sweep.rows, world);
    if args.json {
        let doc = report::json_document(&info, &sweep.rows, &summary, sweep.error.as_deref());
        serde_json::to_writer_pretty(&mut stdout, &doc)?;
        writeln!(stdout)?;
    } else {
        writeln!(stdout, "{}", report::footer(&summary))?;
        write!(stdout, "{}", report::traffic(&sweep.rows, world, dtype))?;
    }
    stdout.flush()?;
    if let Some(path) = &args.plot {
        let title = format!(
            "allreduce-bench: {} backend, {} ranks, {}, {}",
            info.backend,
            world,
            dtype,
            if cfg.in_place {
                "in-place"
            } else {
                "out-of-place"
            }
        );
        plot::draw(path, &title, &sweep.rows, world)?;
        if !args.json {
            writeln!(stdout, "# Plot written to {}", path.display())?;
        }
    }
    if args.baselines {
        baselines(args, &comms, &sizes, &mut stdout)?;
    }
    if let Some(bytes) = args.codec_bench {
        codec_bench(args, &comms, bytes, &mut stdout)?;
    }
    if let Some(path) = &args.tune {
        let existing = if path.exists() {
            allreduce::SelectionTable::load(path)?
        } else {
            allreduce::SelectionTable::default_table()
        };
        let new = tune::rules(&sweep.rows, world, dtype);
        let count = new.len();
        let table = tune::merge(existing, new);
        let mut doc = table.to_json();
        doc["tuned"] = serde_json::json!({
            "world": world,
            "dtype": dtype.name(),
            "backend": args.backend.name(),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        if !args.json {
            writeln!(
                stdout,
                "# Selection table written to {} ({count} rules for {world} ranks, {dtype})",
                path.display()
            )?;
        }
    }
    if let Some(e) = sweep.error {
        return Err(format!(
            "the sweep stopped after {} of {} rows: {e}",
            sweep.rows.len(),
            rows.len()
        )
        .into());
    }
    if summary.failed > 0 {
        eprintln!(
            "allreduce-bench: {} of {} measured rows failed the correctness check",
            summary.failed, summary.run
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `--baselines`: the copy roofline and the per-call host overhead, same run, same GPU.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn baselines(
    args: &Args,
    comms: &[Communicator],
    sizes: &[usize],
    out: &mut dyn Write,
) -> Result<(), BoxError> {
    struct Job<'a>(&'a [Communicator], &'a [usize], &'a mut dyn Write);
    impl gpu::WithRuntime for Job<'_> {
        type Output = Result<(), BoxError>;
        fn run<R: allreduce_gpu::GpuRuntime>(self) -> Self::Output {
            baselines_on::<R>(self.0, self.1, self.2)
        }
    }
    gpu::with_runtime(args.backend, "--baselines", Job(comms, sizes, out))
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn baselines_on<R: allreduce_gpu::GpuRuntime>(
    comms: &[Communicator],
    sizes: &[usize],
    out: &mut dyn Write,
) -> Result<(), BoxError> {
    writeln!(
        out,
        "#\n# Copy-kernel roofline (same fatbin, whole GPU, read + write bytes)"
    )?;
    writeln!(out, "#       size       time     copy bw")?;
    writeln!(out, "#        (B)       (us)      (GB/s)")?;
    for (bytes, us, gbs) in baselines::copy_roofline::<R>(&comms[0], sizes)? {
        writeln!(out, "{bytes:>12} {us:>10.2} {gbs:>11.1}")?;
    }
    let (call, launch) = baselines::launch_overhead::<R>(comms, 8192)?;
    writeln!(
        out,
        "#\n# Host time per call, 8 KiB bf16 one-shot, mean over {} rank threads",
        comms.len()
    )?;
    writeln!(out, "#   all_reduce enqueue : {call:.2} us")?;
    writeln!(out, "#   bare kernel launch : {launch:.2} us")?;
    writeln!(out, "#   ratio              : {:.2}x", call / launch)?;
    Ok(())
}

/// `--codec-bench`: encode + decode throughput per codec against the copy kernel.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn codec_bench(
    args: &Args,
    comms: &[Communicator],
    bytes: usize,
    out: &mut dyn Write,
) -> Result<(), BoxError> {
    struct Job<'a>(&'a Communicator, usize, data::Inputs);
    impl gpu::WithRuntime for Job<'_> {
        type Output = Result<baselines::CodecReport, BoxError>;
        fn run<R: allreduce_gpu::GpuRuntime>(self) -> Self::Output {
            baselines::codec_speed::<R>(self.0, self.1, self.2)
        }
    }
    let inputs = data::Inputs::new(args.data, allreduce::DType::BF16, bytes).hidden(args.hidden);
    let r = gpu::with_runtime(args.backend, "--codec-bench", Job(&comms[0], bytes, inputs))?;
    writeln!(
        out,
        "#\n# Codec kernels, {} MiB of bf16 (--data {}), whole GPU; bandwidth = bytes read + written",
        r.bytes >> 20,
        args.data.name()
    )?;
    writeln!(
        out,
        "#   copy kernel          : {:>9.1} us {:>8.1} GB/s",
        r.copy_us, r.copy_gbs
    )?;
    writeln!(
        out,
        "#   codec  encode (us)  decode (us)  enc+dec (GB/s)  fraction of copy"
    )?;
    for c in &r.codecs {
        writeln!(
            out,
            "#   {:<5} {:>12.1} {:>12.1} {:>15.1} {:>17.3}",
            c.codec.name(),
            c.encode_us,
            c.decode_us,
            c.gbs,
            c.gbs / r.copy_gbs
        )?;
    }
    Ok(())
}

#[cfg(not(any(feature = "cuda", feature = "rocm")))]
fn codec_bench(_: &Args, _: &[Communicator], _: usize, _: &mut dyn Write) -> Result<(), BoxError> {
    Err("--codec-bench needs a build with --features cuda or rocm".into())
}

#[cfg(not(any(feature = "cuda", feature = "rocm")))]
fn baselines(_: &Args, _: &[Communicator], _: &[usize], _: &mut dyn Write) -> Result<(), BoxError> {
    Err("--baselines needs a build with --features cuda or rocm".into())
}

/// `--fused`: fused against unfused, same run, same inputs.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn run_fused(args: &Args) -> Result<ExitCode, BoxError> {
    struct Job<'a>(&'a Args);
    impl gpu::WithRuntime for Job<'_> {
        type Output = Result<(), BoxError>;
        fn run<R: allreduce_gpu::GpuRuntime>(self) -> Self::Output {
            fused::run::<R>(self.0)
        }
    }
    gpu::with_runtime(args.backend, "--fused", Job(args))?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(any(feature = "cuda", feature = "rocm")))]
fn run_fused(_: &Args) -> Result<ExitCode, BoxError> {
    Err("--fused needs a build with --features cuda or rocm".into())
}

/// `--peers`: ours against the peers' kernels, same run, same buffers.
#[cfg(feature = "peers")]
fn run_peers(args: &Args) -> Result<ExitCode, BoxError> {
    if args.backend != allreduce::BackendKind::Cuda {
        return Err("--peers times the CUDA kernels: use it with --backend cuda".into());
    }
    if args.fused {
        versus_fused::run(args)?;
    } else {
        versus::run(args)?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "peers"))]
fn run_peers(_: &Args) -> Result<ExitCode, BoxError> {
    Err("--peers needs a build with --features peers (after scripts/peers/fetch.sh)".into())
}
