//! Command-line flags, size parsing and the sweep's size list.

use std::path::PathBuf;

use allreduce::{BackendKind, DType, Precision, Strategy};
use clap::Parser;

use crate::data::DataSet;

const ABOUT: &str = "nccl-tests-style all-reduce benchmark: bandwidth and correctness of every \
                     (size, strategy, precision) combination of the allreduce library";

const LONG_ABOUT: &str = "\
nccl-tests-style all-reduce benchmark for the allreduce library.

For every message size from --minbytes to --maxbytes (multiplying by --stepfactor) and every
combination of --strategy and --precision, the ranks of one in-process group (one thread per
rank) run warm-up calls, then a timed loop, then a correctness check, and one row is printed:

  time   per call: each rank times its own loop with a monotonic clock; the row's time is the
         slowest rank's loop time divided by the iteration count
  algbw  size / time (size = bytes per rank, as in nccl-tests)
  busbw  algbw * 2*(ranks-1)/ranks (the ring all-reduce's traffic per rank)
  #wrong exact rows: output elements, over all ranks, that are not bitwise equal to the
         exact sum; lossy rows: ranks whose output differs bitwise from rank 0's
  snr    lossy rows: 10*log10(sum ref^2 / sum (out-ref)^2) in dB against the f64 sum of the
         dtype-rounded inputs, and the largest absolute error (maxerr). A lossy row that ran
         an exact path (auto picks oneshot for small sizes) shows the dtype's own rounding
         floor: about 55 dB for bf16, 73 dB for f16 on gauss data
  eqsnr  lossy rows: the channel-equalized SNR, -10*log10 of the mean over hidden channels
         (element index mod --hidden) of each channel's sum (out-ref)^2 / sum ref^2, so a
         few massive channels cannot hide the error of the rest (--data channels)

Exact rows always use the integer pattern ((rank*7 + i*3) % 23) - 11, whose sums are exact;
lossy rows use --data. Sizes are bytes per rank, rounded down to whole elements.
With --inplace the timed loop sums the buffer into itself call after call (as nccl-tests
does: values grow); the checked call then runs once more on fresh inputs.
Combinations the backend rejects (quantized with exact precision, lossy codecs with f32,
vendor on the host backend) are printed as skipped rows with the library's reason.

Running with no arguments is the quick sweep: host backend, 8 ranks, bf16, 8 B to 8 MiB by
factors of 2, strategies oneshot and twoshot, exact precision, iterations chosen per row.";

const AFTER_HELP: &str = "\
Iterations: without -n each row gets as many timed calls as fit in --row-time seconds
(estimated from the warm-up calls), at least 1 and at most --max-iters; with -n every row runs
exactly that many. At least one warm-up call always runs: it also tells whether the backend
accepts the combination.

Exit status: 0 on success; 1 on an error (bad arguments the library rejects, a backend that is
not built, a timeout) or when a row fails its check (#wrong > 0); 2 on a usage error.

Examples:
  allreduce-bench                                   # quick sweep (host, 8 ranks, bf16)
  allreduce-bench -b 1M -e 64M -f 2 --strategy oneshot,twoshot,auto -n 20 -w 5
  allreduce-bench --precision q8,q4 --strategy quantized -d bf16 -b 64K -e 16M
  ALLREDUCE_TOPOLOGY=pcie:2x4 allreduce-bench --ranks 8 --strategy quantized,hierarchical \
      --precision fp8 -b 2M -e 64M              # two NUMA groups: cross-group traffic cut
  allreduce-bench --json > run.json
  allreduce-bench --plot busbw.svg";

#[derive(Debug, Parser)]
#[command(name = "allreduce-bench", version, about = ABOUT, long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct Args {
    /// Smallest size in bytes per rank (suffixes K, M, G, 1024-based: 8, 1K, 4M, 1G)
    #[arg(short = 'b', long, default_value = "8", value_parser = parse_size, value_name = "BYTES")]
    pub minbytes: usize,

    /// Largest size in bytes per rank (same suffixes)
    #[arg(short = 'e', long, default_value = "8M", value_parser = parse_size, value_name = "BYTES")]
    pub maxbytes: usize,

    /// Multiply the size by this factor between rows (at least 2)
    #[arg(short = 'f', long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..), value_name = "N")]
    pub stepfactor: u64,

    /// Element type: f32, f16 or bf16
    #[arg(short = 'd', long, default_value = "bf16", value_name = "DTYPE")]
    pub dtype: DType,

    /// Timed calls per row [default: as many as fit in --row-time]
    #[arg(short = 'n', long, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub iters: Option<u32>,

    /// Warm-up calls per row before timing (at least 1 always runs)
    #[arg(short = 'w', long, default_value_t = 2, value_name = "N")]
    pub warmup: u32,

    /// Seconds of timed calls per row when -n is not given
    #[arg(long, default_value_t = 0.15, value_name = "SECONDS")]
    pub row_time: f64,

    /// Cap on the timed calls per row when -n is not given
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..), value_name = "N")]
    pub max_iters: u32,

    /// World size: ranks in the group (one thread each)
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub ranks: usize,

    /// GPU backends: device ordinals the ranks cycle through (e.g. 0,1,2,3: rank r on
    /// devices[r % len]); default every rank on GPU 0 (virtual ranks)
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub devices: Vec<u32>,

    /// Backend: host, cuda or rocm (only the backends compiled into the library run)
    #[arg(long, default_value = "host", value_name = "NAME")]
    pub backend: BackendKind,

    /// Strategies, comma-separated: auto, oneshot, twoshot, quantized, hierarchical (two NUMA
    /// groups: a topology from the GPUs or ALLREDUCE_TOPOLOGY=pcie:2x4), vendor (NCCL/RCCL),
    /// vendor-symmetric (NCCL 2.27+ on symmetric windows), push-oneshot (Lamport, no barrier;
    /// calls up to 512 KiB)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "oneshot,twoshot",
        value_name = "LIST"
    )]
    pub strategy: Vec<Strategy>,

    /// Precisions, comma-separated: exact, fp8, q8, q6, q4, q8a, q6a, q4a (adaptive), q8v2, q6v2,
    /// q4v2, fp4 (format v2; host backend only)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "exact",
        value_name = "LIST"
    )]
    pub precision: Vec<Precision>,

    /// Reduce in place (the output buffer is the input) instead of out of place
    #[arg(long)]
    pub inplace: bool,

    /// Input data of lossy rows (exact rows always use the integer pattern)
    #[arg(long, value_enum, default_value_t = DataSet::Gauss, value_name = "SET")]
    pub data: DataSet,

    /// Hidden size: the row length of --data channels, and the channels (element index mod N)
    /// of the channel-equalized SNR (eqsnr)
    #[arg(
        long,
        default_value_t = crate::data::DEFAULT_HIDDEN,
        value_parser = clap::builder::TypedValueParser::map(
            clap::value_parser!(u32).range(1..=1 << 24),
            |n| n as usize
        ),
        value_name = "N"
    )]
    pub hidden: usize,

    /// CUDA only: instead of the sweep, time the fused all-reduce + residual + RMSNorm
    /// against the unfused pipeline (our all-reduce, then a residual + RMSNorm kernel) on the
    /// same inputs in the same run, for every --tokens x --fused-hidden (dtype -d, --ranks)
    #[arg(long)]
    pub fused: bool,

    /// CUDA with the `peers` feature: instead of the sweep, time our exact all-reduce against
    /// the peers' kernels (vLLM's custom all-reduce, FlashInfer's PCIe IPC all-reduce) on the
    /// same buffers in the same run, eager and in CUDA graphs, over the sweep's sizes (-b/-e/-f,
    /// -d, --ranks); out of place
    #[arg(long)]
    pub peers: bool,

    /// --fused: token counts (rows), comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,8,32,128",
        value_name = "LIST"
    )]
    pub tokens: Vec<usize>,

    /// --fused: hidden sizes (row lengths), comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4096,8192",
        value_name = "LIST"
    )]
    pub fused_hidden: Vec<usize>,

    /// --fused: the pattern, residual_rmsnorm, residual_rmsnorm_fp8 (per-token scales) or
    /// residual_rmsnorm_fp8_static (one static scale), or the same without the residual add
    /// (rmsnorm, rmsnorm_fp8, rmsnorm_fp8_static); the unfused norm kernel runs the same
    #[arg(long, default_value = "residual_rmsnorm", value_parser = parse_pattern, value_name = "PATTERN")]
    pub fused_pattern: BenchPattern,

    /// --fused: added to gamma by the norm (FlashInfer's weight_bias; 1 for Gemma), in the
    /// fused call and the unfused norm kernel alike
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub weight_bias: f32,

    /// Deadline, in seconds, of every wait for a peer inside the library (default: the
    /// library's, allreduce::DEFAULT_TIMEOUT)
    #[arg(long, default_value_t = allreduce::DEFAULT_TIMEOUT.as_secs_f64(), value_name = "SECONDS")]
    pub timeout: f64,

    /// Print one JSON document (config, machine, git commit, rows) on stdout instead of the table
    #[arg(long)]
    pub json: bool,

    /// Also draw bus bandwidth against size to this SVG file (with --peers: ours / the best
    /// peer against size, or against tokens with --fused)
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// CUDA only: after the sweep, measure in the same run the copy-kernel roofline over the
    /// sweep's sizes and the host time per all_reduce call against a bare kernel launch
    #[arg(long)]
    pub baselines: bool,

    /// CUDA only: after the sweep, time the codec kernels alone in the same run: encode then
    /// decode of this many bytes of bf16 (e.g. 256M; rank 0's values of --data) per codec,
    /// as bytes read + written per second and as a fraction of the copy kernel's, measured on
    /// the same buffers
    #[arg(long, value_parser = parse_size, value_name = "BYTES")]
    pub codec_bench: Option<usize>,

    /// Write the measured winners into this selection-table file (read by `Auto` through
    /// GroupConfig::selection or ALLREDUCE_SELECTION_TABLE): per size, the fastest strategy
    /// among those swept (the vendor strategies always among them), for this world size and
    /// dtype, exact and lossy separately. Rules already in the file for other world sizes or
    /// dtypes are kept
    #[arg(long, value_name = "FILE.json")]
    pub tune: Option<PathBuf>,
}

/// Parse a byte count: digits with an optional 1024-based suffix K, M, G or T (also KB, KiB,
/// ...; case-insensitive) or a plain B.
/// A fused pattern with a norm (the bench compares against the unfused norm kernel), with
/// or without the residual add.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BenchPattern {
    pub pattern: allreduce::FusedPattern,
    pub residual: bool,
}

impl BenchPattern {
    /// The names `--fused-pattern` takes: the library's pattern names, and without the
    /// `residual_` prefix for the same norm without a residual.
    pub fn names() -> impl Iterator<Item = (String, BenchPattern)> {
        allreduce::FusedPattern::ALL
            .into_iter()
            .filter(|p| p.has_norm())
            .flat_map(|pattern| {
                let name = pattern.name();
                let bare = name.trim_start_matches("residual_").to_string();
                [
                    (
                        name.to_string(),
                        BenchPattern {
                            pattern,
                            residual: true,
                        },
                    ),
                    (
                        bare,
                        BenchPattern {
                            pattern,
                            residual: false,
                        },
                    ),
                ]
            })
    }
}

impl std::fmt::Display for BenchPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.pattern.name();
        if self.residual {
            f.write_str(name)
        } else {
            f.write_str(name.trim_start_matches("residual_"))
        }
    }
}

pub fn parse_pattern(s: &str) -> Result<BenchPattern, String> {
    BenchPattern::names()
        .find(|(name, _)| name == s)
        .map(|(_, p)| p)
        .ok_or_else(|| {
            let names: Vec<String> = BenchPattern::names().map(|(n, _)| n).collect();
            format!("{s:?}: want one of {}", names.join(", "))
        })
}

pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (num, suffix) = lower.split_at(digits_end);
    if num.is_empty() {
        return Err(format!(
            "invalid size `{s}`: expected a number such as 8, 1K, 4M or 1G"
        ));
    }
    let shift = match suffix {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "invalid size `{s}`: unknown suffix `{suffix}` (use K, M, G or T)"
            ))
        }
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size `{s}`: number too large"))?;
    let bytes = n
        .checked_mul(1u64 << shift)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| format!("invalid size `{s}`: too large"))?;
    Ok(bytes)
}

/// `bytes` in the shortest exact 1024-based form: 8, 1K, 3M, 1536 (not 1.5K).
pub fn format_size(bytes: usize) -> String {
    const UNITS: [(&str, u32); 4] = [("T", 40), ("G", 30), ("M", 20), ("K", 10)];
    for (unit, shift) in UNITS {
        let b = bytes as u64;
        if b >= 1 << shift && b % (1 << shift) == 0 {
            return format!("{}{unit}", b >> shift);
        }
    }
    bytes.to_string()
}

/// The sizes of the sweep, in bytes per rank: `min, min*factor, ...` up to `max`, each rounded
/// down to a whole number of `elem`-byte elements. Sizes that round to zero elements are
/// dropped unless `min` is 0 (then one 0-byte row comes first and the sweep goes on from one
/// element); repeated sizes are dropped.
pub fn sweep_sizes(min: usize, max: usize, factor: u64, elem: usize) -> Vec<usize> {
    let mut out = Vec::new();
    if min > max {
        return out;
    }
    let mut raw = min as u128;
    if min == 0 {
        out.push(0);
        raw = elem as u128;
    }
    let factor = u128::from(factor.max(2));
    while raw <= max as u128 {
        let bytes = (raw as usize) / elem * elem;
        if bytes > 0 && out.last() != Some(&bytes) {
            out.push(bytes);
        }
        raw *= factor;
    }
    out
}

/// The command line as typed, quoted where a shell would need it.
pub fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn sizes_parse_with_1024_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("8B"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("0"), Ok(0));
        assert!(parse_size("").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("1.5M").is_err());
        assert!(parse_size("3X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999999").is_err());
    }

    #[test]
    fn sizes_format_back() {
        assert_eq!(format_size(8), "8");
        assert_eq!(format_size(1024), "1K");
        assert_eq!(format_size(1536), "1536");
        assert_eq!(format_size(16 << 20), "16M");
        assert_eq!(format_size(1 << 30), "1G");
    }

    #[test]
    fn sweep_rounds_to_elements() {
        assert_eq!(sweep_sizes(8, 64, 2, 2), vec![8, 16, 32, 64]);
        assert_eq!(sweep_sizes(8, 8 << 20, 4, 2).len(), 11);
        // 1, 2 bytes hold no f32; 3 rounds to 0 too.
        assert_eq!(sweep_sizes(1, 16, 2, 4), vec![4, 8, 16]);
        assert_eq!(sweep_sizes(6, 20, 3, 4), vec![4, 16]);
        assert_eq!(sweep_sizes(0, 8, 2, 2), vec![0, 2, 4, 8]);
        assert_eq!(sweep_sizes(9, 8, 2, 2), Vec::<usize>::new());
        assert_eq!(sweep_sizes(usize::MAX / 2 + 1, usize::MAX, 2, 2).len(), 1);
    }

    #[test]
    fn defaults_parse() {
        Args::command().debug_assert();
        let a = Args::try_parse_from(["allreduce-bench"]).unwrap();
        assert_eq!(a.strategy, vec![Strategy::OneShot, Strategy::TwoShot]);
        assert_eq!(a.precision, vec![Precision::Exact]);
        assert_eq!(a.dtype, DType::BF16);
        assert_eq!(a.ranks, 8);
        let a = Args::try_parse_from([
            "x",
            "--precision",
            "exact,q8,q4",
            "--strategy",
            "auto,quantized",
        ])
        .unwrap();
        assert_eq!(a.precision.len(), 3);
        assert_eq!(a.strategy, vec![Strategy::Auto, Strategy::QuantizedTwoShot]);
        let a = Args::try_parse_from(["x", "--strategy", "oneshot,push-oneshot"]).unwrap();
        assert_eq!(a.strategy, vec![Strategy::OneShot, Strategy::PushOneShot]);
        assert!(Args::try_parse_from(["x", "--precision", "q9"]).is_err());
        assert!(Args::try_parse_from(["x", "-f", "1"]).is_err());
    }
}
