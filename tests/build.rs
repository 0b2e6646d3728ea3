//! Compiles the CPU emulation of the GPU codecs (tests/emulated: the kernels' codec source,
//! kernels-common/include/allreduce/segment.h, built by the host C++ compiler against a host
//! shim) into a static library for the `codecs_emulated` test. Std only, like the workspace's
//! other build scripts.
//!
//! Two variants of the codec source, each its own object: `sm90` (AR_PACK_SAT and AR_MAX_NAN
//! 1, the paths the CUDA sm_90 build takes) and `generic` (both 0). The compiler is `$CXX`,
//! else `g++`, else `c++`; without one the build fails saying so. If the codec source does not
//! compile, the build goes on and the test fails with the compiler's messages (cfg
//! `ar_emu_built` is unset), so that the rest of the conformance suite still builds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// (name, AR_PACK_SAT, AR_MAX_NAN)
const VARIANTS: [(&str, u8, u8); 2] = [("sm90", 1, 1), ("generic", 0, 0)];

/// IEEE f32 as the GPU computes it: every operation rounded once, nothing fused into an FMA
/// (-ffp-contract=off: GCC contracts by default where the target has FMA), no fast math.
const FLAGS: &[&str] = &[
    "-c",
    "-O2",
    "-std=c++17",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-strict-aliasing",
    "-fno-exceptions",
    "-fno-rtti",
    "-fno-threadsafe-statics",
    "-fPIC",
    "-Wall",
    "-Wno-unknown-pragmas",
];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo"));
    let emulated = manifest.join("emulated");
    // AR_EMU_KERNELS_INCLUDE: another kernels-common/include to compile (an edited copy).
    println!("cargo:rerun-if-env-changed=AR_EMU_KERNELS_INCLUDE");
    let kernels = match std::env::var_os("AR_EMU_KERNELS_INCLUDE") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => manifest.join("../kernels-common/include"),
    };
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", emulated.display());
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=AR");
    println!("cargo::rustc-check-cfg=cfg(ar_emu_built)");

    let cxx = find_cxx();
    let log = out.join("ar_emu_build.log");
    match build(&cxx, &emulated, &kernels, &out) {
        Ok(()) => {
            std::fs::write(&log, "").expect("write the build log");
            println!("cargo:rustc-link-search=native={}", out.display());
            println!("cargo:rustc-cfg=ar_emu_built");
        }
        Err(e) => {
            println!(
                "cargo:warning=the CPU codec emulation (tests/emulated) did not build; \
                 the codecs_emulated test will fail with the compiler's messages"
            );
            std::fs::write(&log, e).expect("write the build log");
        }
    }
    println!("cargo:rustc-env=AR_EMU_BUILD_LOG={}", log.display());
}

/// `$CXX`, else the first of g++ and c++ that runs.
fn find_cxx() -> String {
    let candidates: Vec<String> = match std::env::var("CXX") {
        Ok(c) if !c.is_empty() => vec![c],
        _ => vec!["g++".into(), "c++".into()],
    };
    for c in &candidates {
        let ok = Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return c.clone();
        }
    }
    panic!(
        "allreduce-conformance needs a C++17 compiler to build its CPU emulation of the GPU \
         codecs (tests/emulated, for the codecs_emulated test): tried {}. Install g++ or set \
         CXX.",
        candidates.join(", ")
    );
}

/// Compiles lanes.cpp and one driver.cpp per variant (in parallel) and archives them as
/// libar_emu.a in `out`. Err: what failed, with the compiler's messages.
fn build(cxx: &str, emulated: &Path, kernels: &Path, out: &Path) -> Result<(), String> {
    let mut jobs = Vec::new();
    let lanes = out.join("ar_emu_lanes.o");
    let mut cmd = Command::new(cxx);
    cmd.args(FLAGS)
        .arg(emulated.join("lanes.cpp"))
        .arg("-o")
        .arg(&lanes);
    jobs.push((lanes, cmd));
    for (name, pack_sat, max_nan) in VARIANTS {
        let obj = out.join(format!("ar_emu_driver_{name}.o"));
        let mut cmd = Command::new(cxx);
        cmd.args(FLAGS)
            // The host shim first, so that codec.h's "allreduce/shim.h" is it.
            .arg("-I")
            .arg(emulated.join("include"))
            .arg("-I")
            .arg(kernels)
            .arg(format!("-DAR_EMU_VARIANT={name}"))
            .arg(format!("-DAR_EMU_NS=ar_{name}"))
            .arg(format!("-DAR_EMU_PACK_SAT={pack_sat}"))
            .arg(format!("-DAR_EMU_MAX_NAN={max_nan}"))
            .arg(emulated.join("driver.cpp"))
            .arg("-o")
            .arg(&obj);
        jobs.push((obj, cmd));
    }
    let running: Vec<_> = jobs
        .into_iter()
        .map(|(obj, mut cmd)| {
            let shown = format!("{cmd:?}");
            let child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("allreduce-conformance: cannot run {cxx}: {e}"));
            (obj, shown, child)
        })
        .collect();
    let mut objects = Vec::new();
    let mut errors = String::new();
    for (obj, shown, child) in running {
        let output = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("allreduce-conformance: {cxx} did not finish: {e}"));
        match failure(&output) {
            None => objects.push(obj),
            Some(why) => errors.push_str(&format!("{shown}\n{why}\n")),
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let lib = out.join("libar_emu.a");
    let _ = std::fs::remove_file(&lib);
    let ar = std::env::var("AR")
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| "ar".into());
    let output = Command::new(&ar)
        .arg("crs")
        .arg(&lib)
        .args(&objects)
        .output()
        .unwrap_or_else(|e| {
            panic!("allreduce-conformance: cannot run `{ar}` to archive tests/emulated: {e}")
        });
    match failure(&output) {
        None => Ok(()),
        Some(why) => Err(format!("{ar} crs {}:\n{why}", lib.display())),
    }
}

fn failure(output: &Output) -> Option<String> {
    (!output.status.success()).then(|| {
        format!(
            "{}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}
