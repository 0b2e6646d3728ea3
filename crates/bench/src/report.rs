//! The nccl-tests-style table, the JSON document, and what they say about the machine.

use std::process::{Command, Stdio};

use serde_json::{json, Value};

use crate::cli::format_size;
use crate::metrics::{algbw_gbps, bus_factor};
use crate::runner::{Config, Iters, Outcome, RowResult};

/// The facts about the run that the header and the JSON document share.
pub struct RunInfo {
    pub command: String,
    pub backend: String,
    pub world: usize,
    pub devices: Vec<String>,
    pub minbytes: usize,
    pub maxbytes: usize,
    pub stepfactor: u64,
    pub sizes: usize,
    pub strategies: Vec<String>,
    pub precisions: Vec<String>,
    pub timeout_s: f64,
    pub cfg: Config,
    pub machine: Machine,
    pub git: Option<Git>,
    /// The GPU topology as the backend sees it (`Topology`'s matrix), if it has one.
    pub topology: Option<String>,
    /// What the ranks run on, one line per distinct device ([`device_models`]).
    pub device_models: Vec<String>,
}

pub struct Machine {
    pub hostname: String,
    pub cpus: usize,
    pub os: String,
    pub kernel: Option<String>,
    pub arch: String,
    pub cpu_model: Option<String>,
}

pub struct Git {
    pub commit: String,
    pub dirty: bool,
}

fn read_trimmed(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

impl Machine {
    pub fn detect() -> Self {
        let hostname = read_trimmed("/proc/sys/kernel/hostname")
            .or_else(|| read_trimmed("/etc/hostname"))
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "unknown".into());
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        Machine {
            hostname,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            os: std::env::consts::OS.into(),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            arch: std::env::consts::ARCH.into(),
            cpu_model,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!("{}, {} cpus, {}", self.hostname, self.cpus, self.os);
        if let Some(k) = &self.kernel {
            s += &format!(" {k}");
        }
        s += &format!(" {}", self.arch);
        if let Some(m) = &self.cpu_model {
            s += &format!(", {m}");
        }
        s
    }
}

/// One line per distinct device the ranks use: the GPU's model, driver and CUDA version, or
/// the CPU model for the host backend. Figures are comparable only on the same model and
/// driver, so the header records them next to the commit. A driver that cannot say gives its
/// error in the line's place rather than stopping the run.
pub fn device_models(devices: &[allreduce::Device], machine: &Machine) -> Vec<String> {
    let mut seen = Vec::new();
    for d in devices {
        if !seen.contains(d) {
            seen.push(*d);
        }
    }
    seen.into_iter()
        .map(|d| match d {
            allreduce::Device::Host => format!(
                "host: {}",
                machine.cpu_model.as_deref().unwrap_or("CPU model unknown")
            ),
            #[cfg(feature = "cuda")]
            allreduce::Device::Cuda(i) => match allreduce::cuda::device_description(i) {
                Ok(s) => format!("{d}: {s}"),
                Err(e) => format!("{d}: model unknown ({e})"),
            },
            other => format!("{other}: model not reported by this build"),
        })
        .collect()
}

/// `# git ...` and `# device ...` lines for the modes that print their own table (`--fused`,
/// `--peers`), so that a pasted table says which commit and which GPU it came from.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub fn print_origin(devices: &[allreduce::Device]) {
    if let Some(g) = Git::detect() {
        println!(
            "# git {}{}",
            g.commit,
            if g.dirty { " (dirty)" } else { "" }
        );
    }
    for m in device_models(devices, &Machine::detect()) {
        println!("# device {m}");
    }
}

impl Git {
    /// The commit the binary was built from, when its build said so (`ALLREDUCE_BUILD_GIT`,
    /// `<commit>` or `<commit>-dirty`, set by scripts/build-gpu-bin.sh): a binary carried to
    /// another machine runs in a checkout that need not be its own (the GPU machine's copy
    /// reported a commit weeks old). Else the checkout's, if `git rev-parse HEAD` works here.
    pub fn detect() -> Option<Self> {
        option_env!("ALLREDUCE_BUILD_GIT")
            .and_then(Self::from_build)
            .or_else(Self::from_checkout)
    }

    /// `<commit>` or `<commit>-dirty`; None when empty.
    pub fn from_build(s: &str) -> Option<Self> {
        let s = s.trim();
        let (commit, dirty) = match s.strip_suffix("-dirty") {
            Some(c) => (c, true),
            None => (s, false),
        };
        (!commit.is_empty()).then(|| Git {
            commit: commit.to_string(),
            dirty,
        })
    }

    fn from_checkout() -> Option<Self> {
        let run = |args: &[&str]| {
            Command::new("git")
                .args(args)
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        let commit = run(&["rev-parse", "HEAD"]).filter(|c| !c.is_empty())?;
        let dirty =
            run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        Some(Git { commit, dirty })
    }
}

fn iters_text(cfg: &Config) -> String {
    match cfg.iters {
        Iters::Fixed(n) => format!("{n} per row"),
        Iters::Budget { seconds, max } => format!("auto ({seconds} s of calls per row, 1..={max})"),
    }
}

fn placement(in_place: bool) -> &'static str {
    if in_place {
        "in"
    } else {
        "out"
    }
}

/// The lines before the table.
pub fn header(info: &RunInfo) -> String {
    let cfg = &info.cfg;
    let mut s = String::new();
    s += &format!(
        "# allreduce-bench {}: all-reduce (sum)\n",
        env!("CARGO_PKG_VERSION")
    );
    s += &format!("# Command    : {}\n", info.command);
    s += &format!(
        "# Backend    : {}   ranks: {}   dtype: {}   {}\n",
        info.backend,
        info.world,
        cfg.dtype,
        if cfg.in_place {
            "in-place"
        } else {
            "out-of-place"
        }
    );
    s += &format!(
        "# Sizes      : {} .. {} bytes per rank, factor {} ({} sizes)\n",
        format_size(info.minbytes),
        format_size(info.maxbytes),
        info.stepfactor,
        info.sizes
    );
    s += &format!(
        "# Strategies : {}   precisions: {}   lossy data: {}   hidden: {}\n",
        info.strategies.join(","),
        info.precisions.join(","),
        cfg.data.name(),
        cfg.hidden
    );
    s += &format!(
        "# Iterations : {}   warm-up: {}\n",
        iters_text(cfg),
        cfg.warmup.max(1)
    );
    s += &format!("# Machine    : {}\n", info.machine.describe());
    if let Some(g) = &info.git {
        s += &format!(
            "# Git        : {}{}\n",
            g.commit,
            if g.dirty { " (dirty)" } else { "" }
        );
    }
    for m in &info.device_models {
        s += &format!("# Device     : {m}\n");
    }
    if let Some(t) = &info.topology {
        s += "# Topology   : (X same GPU, NV NVLink, PCI PCIe peer access, - none)\n";
        for line in t.lines() {
            s += &format!("#   {line}\n");
        }
    }
    s += "#\n";
    let pid = std::process::id();
    for (rank, dev) in info.devices.iter().enumerate() {
        s += &format!(
            "#  Rank {rank:2} Pid {pid:6} on {} device {dev}\n",
            info.machine.hostname
        );
    }
    s += "#\n";
    s += &format!(
        "#{:>11} {:>12} {:>5} {:>15} {:>6} {:>5} {:>6} {:>10} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9}\n",
        "size",
        "count",
        "type",
        "strategy",
        "prec",
        "place",
        "iters",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "snr",
        "eqsnr",
        "minch",
        "plain",
        "maxerr"
    );
    s += &format!(
        "#{:>11} {:>12} {:>5} {:>15} {:>6} {:>5} {:>6} {:>10} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "(B)", "(elements)", "", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(dB)", "(dB)", "(dB)", "(dB)", ""
    );
    s
}

fn strategy_text(row: &RowResult) -> String {
    let requested = row.spec.strategy;
    match &row.outcome {
        Outcome::Done(m) if requested == allreduce::Strategy::Auto => format!("auto>{}", m.ran),
        _ => requested.to_string(),
    }
}

/// SNR as printed: 2 decimals, `inf` for an exact result.
fn snr_text(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{v:.2}")
    }
}

/// `v` as `1.234e-02` (printf's %.3e), `-` for NaN.
fn sci(v: f64) -> String {
    if v.is_nan() {
        return "-".into();
    }
    if !v.is_finite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    let s = format!("{v:.3e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// One table line.
pub fn row_line(row: &RowResult, world: usize, cfg: &Config) -> String {
    let spec = &row.spec;
    let lead = format!(
        "{:>12} {:>12} {:>5} {:>15} {:>6} {:>5}",
        spec.bytes,
        spec.count,
        cfg.dtype,
        strategy_text(row),
        spec.precision,
        placement(cfg.in_place)
    );
    match &row.outcome {
        Outcome::Skipped(reason) => format!("{lead}  skipped: {reason}"),
        Outcome::Done(m) => {
            let algbw = algbw_gbps(spec.bytes, m.seconds);
            let busbw = algbw * bus_factor(world);
            let (wrong, snr, eqsnr, minch, plain, maxerr) = if spec.exact() {
                (
                    m.check.wrong_elements.to_string(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                )
            } else {
                (
                    m.check.ranks_differing().to_string(),
                    snr_text(m.check.stats.snr_db()),
                    snr_text(m.check.stats.channel_snr_db()),
                    snr_text(m.check.stats.worst_channel_snr_db()),
                    snr_text(m.check.stats.plain_snr_db()),
                    if m.check.stats.elements == 0 {
                        "-".into()
                    } else {
                        sci(m.check.stats.max_abs_err)
                    },
                )
            };
            format!(
                "{lead} {:>6} {:>10.2} {:>9.3} {:>9.3} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9}",
                m.iters,
                m.seconds * 1e6,
                algbw,
                busbw,
                wrong,
                snr,
                eqsnr,
                minch,
                plain,
                maxerr
            )
        }
    }
}

/// Totals over the rows.
pub struct Summary {
    pub run: usize,
    pub skipped: usize,
    pub failed: usize,
    pub avg_busbw: f64,
}

pub fn summarize(rows: &[RowResult], world: usize) -> Summary {
    let mut s = Summary {
        run: 0,
        skipped: 0,
        failed: 0,
        avg_busbw: 0.0,
    };
    let mut sum = 0.0;
    for row in rows {
        match &row.outcome {
            Outcome::Skipped(_) => s.skipped += 1,
            Outcome::Done(m) => {
                s.run += 1;
                sum += algbw_gbps(row.spec.bytes, m.seconds) * bus_factor(world);
                if m.failed(row.spec.exact()) {
                    s.failed += 1;
                }
            }
        }
    }
    if s.run > 0 {
        s.avg_busbw = sum / s.run as f64;
    }
    s
}

/// The lines after the table.
pub fn footer(summary: &Summary) -> String {
    format!(
        "# Rows                 : {} run, {} skipped\n\
         # Out of bounds values : {} {}\n\
         # Avg bus bandwidth    : {:.3} GB/s\n#",
        summary.run,
        summary.skipped,
        summary.failed,
        if summary.failed == 0 { "OK" } else { "FAILED" },
        summary.avg_busbw
    )
}

/// A float as JSON: `null` where JSON has no number (NaN, infinities).
fn num(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        Value::Null
    }
}

fn row_json(row: &RowResult, world: usize, cfg: &Config) -> Value {
    let spec = &row.spec;
    let mut v = json!({
        "bytes": spec.bytes,
        "count": spec.count,
        "dtype": cfg.dtype.name(),
        "strategy": spec.strategy.name(),
        "precision": spec.precision.to_string(),
        "in_place": cfg.in_place,
    });
    let fields = match &row.outcome {
        Outcome::Skipped(reason) => json!({ "status": "skipped", "reason": reason }),
        Outcome::Done(m) => {
            let algbw = algbw_gbps(spec.bytes, m.seconds);
            let snr = m.check.stats.snr_db();
            json!({
                "status": if m.failed(spec.exact()) { "failed" } else { "ok" },
                "ran": m.ran.name(),
                "data": m.data.name(),
                "iters": m.iters,
                "time_us": num(m.seconds * 1e6),
                "algbw_gbps": num(algbw),
                "busbw_gbps": num(algbw * bus_factor(world)),
                "wrong_elements": m.check.wrong_elements,
                "ranks_differing": m.check.ranks_differing(),
                "snr_db": num(snr),
                // Mean over hidden channels (index % hidden) of each channel's error-to-signal
                // ratio, in dB: massive channels cannot hide the rest.
                "snr_eq_db": num(m.check.stats.channel_snr_db()),
                // The channel served worst, and the rows without the data set's massive values.
                "snr_worst_channel_db": num(m.check.stats.worst_channel_snr_db()),
                "snr_plain_rows_db": num(m.check.stats.plain_snr_db()),
                "exact_result": snr == f64::INFINITY,
                "max_abs_err": num(m.check.stats.max_abs_err),
                "non_finite": m.check.stats.non_finite,
            })
        }
    };
    if let (Value::Object(o), Value::Object(f)) = (&mut v, fields) {
        o.extend(f);
    }
    v
}

/// The whole run as one JSON document.
pub fn json_document(
    info: &RunInfo,
    rows: &[RowResult],
    summary: &Summary,
    error: Option<&str>,
) -> Value {
    let cfg = &info.cfg;
    let iters = match cfg.iters {
        Iters::Fixed(n) => json!({ "mode": "fixed", "iters": n }),
        Iters::Budget { seconds, max } => {
            json!({ "mode": "budget", "row_time_s": seconds, "max_iters": max })
        }
    };
    json!({
        "tool": "allreduce-bench",
        "version": env!("CARGO_PKG_VERSION"),
        "command": info.command,
        "config": {
            "backend": info.backend,
            "ranks": info.world,
            "devices": info.devices,
            "dtype": cfg.dtype.name(),
            "in_place": cfg.in_place,
            "minbytes": info.minbytes,
            "maxbytes": info.maxbytes,
            "stepfactor": info.stepfactor,
            "strategies": info.strategies,
            "precisions": info.precisions,
            "data": cfg.data.name(),
            "hidden": cfg.hidden,
            "warmup": cfg.warmup.max(1),
            "iters": iters,
            "timeout_s": info.timeout_s,
            "bus_factor": bus_factor(info.world),
        },
        "machine": {
            "hostname": info.machine.hostname,
            "cpus": info.machine.cpus,
            "os": info.machine.os,
            "kernel": info.machine.kernel,
            "arch": info.machine.arch,
            "cpu_model": info.machine.cpu_model,
        },
        "git": info.git.as_ref().map(|g| json!({ "commit": g.commit, "dirty": g.dirty })),
        "device_models": info.device_models,
        "rows": rows.iter().map(|r| row_json(r, info.world, cfg)).collect::<Vec<_>>(),
        "summary": {
            "rows_run": summary.run,
            "rows_skipped": summary.skipped,
            "rows_failed": summary.failed,
            "avg_busbw_gbps": num(summary.avg_busbw),
        },
        "error": error,
    })
}

/// Bytes each rank sends (and receives) per call, at the sweep's largest size, for every
/// strategy and precision that ran, against the exact two-shot on the same size: the traffic
/// a bandwidth-bound link (PCIe) carries (`allreduce::layout::traffic_per_rank`).
pub fn traffic(rows: &[crate::runner::RowResult], world: usize, dtype: allreduce::DType) -> String {
    use allreduce::layout::{cross_group_traffic_per_rank, traffic_per_rank};
    use allreduce::{Precision, Strategy};
    let Some(max) = rows.iter().map(|r| r.spec.count).max() else {
        return String::new();
    };
    let exact = traffic_per_rank(Strategy::TwoShot, Precision::Exact, max, dtype, world);
    let mut seen = Vec::new();
    let mut s = String::new();
    for r in rows.iter().filter(|r| r.spec.count == max) {
        let crate::runner::Outcome::Done(m) = &r.outcome else {
            continue;
        };
        let key = (m.ran, r.spec.precision);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        if let (Some(t), Some(e)) = (
            traffic_per_rank(m.ran, r.spec.precision, max, dtype, world),
            exact,
        ) {
            if s.is_empty() {
                s += &format!(
                    "# Traffic per rank per call at {} ({world} ranks): bytes sent (= received), vs exact two-shot\n",
                    format_size(max * dtype.size())
                );
            }
            s += &format!(
                "#   {:>12} {:<6} {:>14} B  {:>6.3}x",
                m.ran.to_string(),
                r.spec.precision.to_string(),
                t,
                t as f64 / e.max(1) as f64
            );
            // With two NUMA groups of world/2 ranks: what crosses between them (the CPU
            // interconnect of a 2 x 4 PCIe box), against the exact two-shot's.
            let across = |s, p| cross_group_traffic_per_rank(s, p, max, dtype, world);
            if let (Some(a), Some(ea)) = (
                across(m.ran, r.spec.precision),
                across(Strategy::TwoShot, Precision::Exact),
            ) {
                s += &format!(
                    "   across 2 groups {:>14} B  {:>6.3}x",
                    a,
                    a as f64 / ea.max(1) as f64
                );
            }
            s += "\n";
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scientific_like_printf() {
        assert_eq!(sci(0.007202), "7.202e-03");
        assert_eq!(sci(1.5), "1.500e+00");
        assert_eq!(sci(0.0), "0.000e+00");
        assert_eq!(sci(12345.0), "1.234e+04");
        assert_eq!(sci(f64::INFINITY), "inf");
        assert_eq!(snr_text(f64::INFINITY), "inf");
        assert_eq!(snr_text(20.004), "20.00");
    }

    #[test]
    fn build_commit_with_and_without_dirty() {
        let g = Git::from_build("554b235abc-dirty\n").unwrap();
        assert_eq!((g.commit.as_str(), g.dirty), ("554b235abc", true));
        let g = Git::from_build("554b235abc").unwrap();
        assert_eq!((g.commit.as_str(), g.dirty), ("554b235abc", false));
        assert!(Git::from_build("").is_none());
        assert!(Git::from_build("-dirty").is_none());
    }
}
