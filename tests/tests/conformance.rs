//! Runs the conformance suite once per backend present: `[backend] test ... ok`.
//! A backend that is not compiled in or has no device is skipped with the reason printed.
//! Arguments that do not start with `-` filter tests by substring, as libtest does.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::Instant;

use allreduce::BackendKind;
use allreduce_conformance::expect::{judge, Verdict, EXPECTED_FAILURES};
use allreduce_conformance::{Harness, HostHarness, TESTS};

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let harnesses = harnesses();
    let mut failed = Vec::new();
    let mut ran = 0;
    for h in &harnesses {
        for t in TESTS {
            let name = format!("[{}] {}", h.name(), t.name);
            if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
                continue;
            }
            let start = Instant::now();
            let result =
                catch_unwind(AssertUnwindSafe(|| (t.run)(h.as_ref()))).unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(format!("panicked: {msg}"))
                });
            ran += 1;
            let verdict = judge(EXPECTED_FAILURES, h.backend().name(), t.name, result);
            match &verdict {
                Verdict::Pass => println!("{name} ... ok ({:.2} s)", start.elapsed().as_secs_f64()),
                Verdict::Fail(e) => println!("{name} ... FAILED\n    {e}"),
                Verdict::ExpectedFailure { reason, error } => {
                    println!("{name} ... expected failure ({reason})\n    {error}")
                }
                Verdict::UnexpectedPass { reason } => println!(
                    "{name} ... FAILED: passed, but listed as an expected failure ({reason}); \
                     remove it from tests/src/expect.rs"
                ),
            }
            if verdict.fails_run() {
                failed.push(name);
            }
        }
    }
    println!(
        "\nconformance: {} passed, {} failed",
        ran - failed.len(),
        failed.len()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        for f in &failed {
            println!("    {f}");
        }
        ExitCode::FAILURE
    }
}

/// Every backend compiled in and usable here; the others are reported as skipped.
fn harnesses() -> Vec<Box<dyn Harness>> {
    #[allow(unused_mut)] // only the GPU features push more
    let mut list: Vec<Box<dyn Harness>> = vec![Box::new(HostHarness)];
    for kind in [BackendKind::Cuda, BackendKind::Rocm] {
        if !kind.is_compiled() {
            println!("[{kind}] skipped: backend not compiled in (build with --features {kind})");
        }
    }
    #[cfg(feature = "cuda")]
    push_gpu::<allreduce::cuda::CudaRuntime>(&mut list);
    // No ROCm runtime: the error names the libraries tried. A runtime but a build without
    // kernels: the harness runs and every test fails with the error saying how to get them,
    // which is the point (the build was asked for rocm).
    #[cfg(feature = "rocm")]
    push_gpu::<allreduce::rocm::Hip>(&mut list);
    list
}

/// `R`'s harness when its runtime reports a device; else why it is skipped.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn push_gpu<R: allreduce_conformance::GpuTestRuntime>(list: &mut Vec<Box<dyn Harness>>) {
    R::before_init();
    match R::device_count() {
        Ok(n) if n > 0 => list.push(Box::new(allreduce_conformance::GpuHarness::<R>::from_env())),
        Ok(_) => println!("[{}] skipped: the runtime reports no device", R::NAME),
        Err(e) => println!("[{}] skipped: {e}", R::NAME),
    }
}
