//! Soak tests on every backend present (`[backend] test`), as `conformance` runs its list:
//! groups created and destroyed (resident memory, device memory and IPC mappings back to the
//! baseline) and mixed calls at 8 ranks with bad arguments among them (see
//! `allreduce_conformance::soak`). A backend that is absent is skipped with the reason.
//!
//! CI runs 1,000 cycles and 40,000 calls on the host (each about 10 and 40 s on 2 cores), a
//! GPU 200 cycles and 20,000 calls; `ALLREDUCE_SOAK_FULL=1` runs 1,000 cycles and 100,000
//! calls everywhere (`ALLREDUCE_SOAK_CYCLES` / `ALLREDUCE_SOAK_CALLS` set either count). Arguments that do not start with `-` filter
//! tests by substring.

use std::process::ExitCode;
use std::time::Instant;

use allreduce_conformance::soak::{self, Target};
use allreduce_conformance::HostHarness;

/// CI's counts: each takes under a minute on 2 cores.
const CI_CYCLES: usize = 1000;
const CI_CALLS: usize = 40_000;
/// What `ALLREDUCE_SOAK_FULL=1` runs.
const FULL_CYCLES: usize = 1000;
const FULL_CALLS: usize = 100_000;
/// The GPU's counts in a default run: each cycle there also starts the vendor library, and
/// GPU time is shared.
#[cfg(feature = "cuda")]
const GPU_CYCLES: usize = 200;
#[cfg(feature = "cuda")]
const GPU_CALLS: usize = 20_000;

/// A test of one target: its one-line summary, or why it failed.
type Run<'a> = &'a dyn Fn() -> Result<String, String>;

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    #[allow(unused_mut)] // only the GPU features push more
    // (name, target, default cycles, default calls)
    let mut targets: Vec<(String, Box<dyn Target>, usize, usize)> = vec![(
        "host".into(),
        Box::new(soak::HostTarget(HostHarness)),
        CI_CYCLES,
        CI_CALLS,
    )];
    #[cfg(feature = "cuda")]
    {
        use allreduce_conformance::{gpu_available, GpuHarness};
        type R = allreduce::cuda::CudaRuntime;
        if gpu_available::<R>("soak") {
            let h = GpuHarness::<R>::from_env();
            let name = allreduce_conformance::Harness::name(&h);
            targets.push((name, Box::new(soak::GpuTarget(h)), GPU_CYCLES, GPU_CALLS));
        }
    }
    #[cfg(not(feature = "cuda"))]
    println!("[cuda] skipped: backend not compiled in (build with --features cuda)");

    let mut failed = Vec::new();
    for (name, t, ci_cycles, ci_calls) in &targets {
        let tests: [(&str, Run); 2] = [
            ("create_destroy", &|| {
                let cycles = soak::count(soak::CYCLES_ENV, *ci_cycles, FULL_CYCLES);
                let r = soak::create_destroy(t.as_ref(), 8, cycles)?;
                Ok(format!(
                    "{} cycles of a group of 8 ranks and one of 1 in {:.2} s ({:.1} ms each, \
                     after {} warm-up; {}); baseline {}; after {}",
                    r.cycles,
                    r.elapsed.as_secs_f64(),
                    r.elapsed.as_secs_f64() * 1e3 / r.cycles.max(1) as f64,
                    soak::WARM_UP_CYCLES,
                    if r.vendor {
                        "with the vendor library's calls and window"
                    } else {
                        "no vendor library here"
                    },
                    r.baseline,
                    r.end
                ))
            }),
            ("mixed_calls", &|| {
                let calls = soak::count(soak::CALLS_ENV, *ci_calls, FULL_CALLS);
                let before = t.resources();
                let r = soak::mixed_calls(t.as_ref(), calls)?;
                Ok(format!(
                    "{} calls at 8 ranks in {:.2} s ({:.1} us each): {} checked against the \
                     reference and bitwise equal on every rank, {} bad calls rejected on every \
                     rank ({} of {} peers' rejections carried the reason{}); {} before, {} after",
                    r.calls,
                    r.elapsed.as_secs_f64(),
                    r.elapsed.as_secs_f64() * 1e6 / r.calls.max(1) as f64,
                    r.checked,
                    r.bad_calls,
                    r.reasons_carried.0,
                    r.reasons_carried.1,
                    if soak::FUSED_BAD_ARGUMENTS {
                        ""
                    } else {
                        "; no fused bad calls: soak::FUSED_BAD_ARGUMENTS is off"
                    },
                    before,
                    t.resources()
                ))
            }),
        ];
        for (test, run) in tests {
            let full = format!("[{name}] {test}");
            if !filters.is_empty() && !filters.iter().any(|f| full.contains(f.as_str())) {
                continue;
            }
            let start = Instant::now();
            match run() {
                Ok(summary) => println!(
                    "{full} ... ok ({:.2} s)\n    {summary}",
                    start.elapsed().as_secs_f64()
                ),
                Err(e) => {
                    println!("{full} ... FAILED\n    {e}");
                    failed.push(full);
                }
            }
        }
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        println!("\nsoak: failed:");
        for f in &failed {
            println!("    {f}");
        }
        ExitCode::FAILURE
    }
}
