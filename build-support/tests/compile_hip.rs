//! Compiles the real HIP kernels (kernels-hip/allreduce.hip and fused.hip + kernels-common)
//! with whatever compiler `find_hip_compiler` finds, and checks that they export every kernel
//! of the table, so a broken or missing kernel fails `cargo test` on a machine without a GPU
//! or ROCm. Without a compiler the tests say so and pass, unless
//! `ALLREDUCE_REQUIRE_HIP=1` (CI's HIP step), which turns every skip into a failure.

use std::path::{Path, PathBuf};
use std::time::Instant;

use allreduce_build_support::{compile_hip_code_objects, find_hip_compiler, HipOptions};
use allreduce_gpu::kernels::{self, Module, Vendor};

/// What `module` must export: every kernel of the table for HIP.
fn kernel_names(module: Module) -> Vec<String> {
    kernels::kernels(Vendor::Hip, module)
        .iter()
        .map(|k| k.name())
        .collect()
}

const REQUIRE_ENV: &str = "ALLREDUCE_REQUIRE_HIP";

fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Prints why the test is skipped, or fails when a HIP build is required.
fn skip(why: String) -> Option<(PathBuf, PathBuf)> {
    if required() {
        panic!("{REQUIRE_ENV} is set, so this is a failure, not a skip: {why}");
    }
    println!("skipped: {why}");
    None
}

/// The compiler and the workspace root, or None after printing why the test is skipped.
fn setup() -> Option<(PathBuf, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !root.join("kernels-hip/allreduce.hip").is_file() {
        return skip(format!(
            "kernels-hip/allreduce.hip not found under {}",
            root.display()
        ));
    }
    match find_hip_compiler() {
        Ok(cc) => Some((cc, root)),
        Err(e) => skip(format!("no HIP compiler (run scripts/setup-hip.sh): {e}")),
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ar-compile-hip-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `EF_AMDGPU_MACH_*`, the processor in the low byte of an AMDGPU ELF's e_flags.
fn mach_of(arch: &str) -> Option<u32> {
    match arch {
        "gfx90a" => Some(0x3f),
        "gfx942" => Some(0x4c),
        "gfx950" => Some(0x4f),
        _ => None,
    }
}

/// An AMDGPU HSA code object for `arch`, exporting every kernel of `module` (symbol and
/// descriptor).
fn check_code_object(module: Module, arch: &str, bytes: &[u8]) {
    assert!(
        bytes.len() > 64 && &bytes[..4] == b"\x7fELF",
        "{arch}: not an ELF"
    );
    assert_eq!(
        (bytes[4], bytes[5]),
        (2, 1),
        "{arch}: not ELF64 little endian"
    );
    assert_eq!(bytes[7], 64, "{arch}: OS ABI is not AMDGPU_HSA");
    assert_eq!(
        u16::from_le_bytes([bytes[18], bytes[19]]),
        224,
        "{arch}: not EM_AMDGPU"
    );
    let flags = u32::from_le_bytes(bytes[48..52].try_into().unwrap());
    if let Some(mach) = mach_of(arch) {
        assert_eq!(
            flags & 0xff,
            mach,
            "{arch}: e_flags {flags:#x} name another processor"
        );
    }
    for k in kernel_names(module) {
        for name in [k.clone(), format!("{k}.kd")] {
            assert!(
                bytes
                    .windows(name.len() + 1)
                    .any(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0),
                "{arch}: symbol {name} missing (extern \"C\" kernels must keep their names)"
            );
        }
    }
}

fn compile(cc: &Path, root: &Path, archs: Option<&[&str]>, out: &Path) -> Vec<String> {
    let opts = HipOptions {
        name: "allreduce".into(),
        source: root.join("kernels-hip/allreduce.hip"),
        include_dirs: vec![root.join("kernels-common/include")],
        archs: archs.map(|a| a.iter().map(|s| s.to_string()).collect()),
        out_dir: Some(out.to_path_buf()),
        compiler: Some(cc.to_path_buf()),
        cargo_directives: false,
    };
    let start = Instant::now();
    let objs = compile_hip_code_objects(&opts).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "{:?}: built in {:.2?} with {}",
        objs.iter().map(|o| o.arch.as_str()).collect::<Vec<_>>(),
        start.elapsed(),
        cc.display()
    );
    for o in &objs {
        let bytes = std::fs::read(&o.path).unwrap();
        println!("  {}: {} bytes", o.path.display(), bytes.len());
        check_code_object(Module::AllReduce, &o.arch, &bytes);
    }
    let listing = std::fs::read_to_string(out.join("allreduce.hip.rs")).unwrap();
    assert_eq!(
        listing.matches("include_bytes!").count(),
        objs.len(),
        "{listing}"
    );
    objs.into_iter().map(|o| o.arch).collect()
}

/// What CI requires: MI300X (gfx942) and MI200 (gfx90a).
#[test]
fn hip_kernels_compile_for_gfx942_and_gfx90a() {
    let Some((cc, root)) = setup() else { return };
    let dir = scratch("required");
    let archs = compile(&cc, &root, Some(&["gfx942", "gfx90a"]), &dir);
    assert_eq!(archs, ["gfx942", "gfx90a"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The default list a build script gets: the two above, plus gfx950 when the compiler
/// knows it (the pinned clang 22 of scripts/setup-hip.sh does).
#[test]
fn hip_kernels_compile_for_default_archs() {
    let Some((cc, root)) = setup() else { return };
    if std::env::var_os("ALLREDUCE_HIP_ARCHS").is_some() {
        println!("ALLREDUCE_HIP_ARCHS is set: the default list is not what builds");
    }
    let dir = scratch("default");
    let archs = compile(&cc, &root, None, &dir);
    if !archs.iter().any(|a| a == "gfx950") {
        println!("{} does not know gfx950: not built", cc.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fused all-reduce + RMSNorm kernels (kernels-hip/fused.hip) build for AMD too;
/// nothing runs them there yet. gfx942 only: the code is the same for gfx90a, and CI's two
/// cores are slow at it.
#[test]
fn hip_fused_kernels_compile_for_gfx942() {
    let Some((cc, root)) = setup() else { return };
    let dir = scratch("fused");
    let opts = HipOptions {
        name: "fused".into(),
        source: root.join("kernels-hip/fused.hip"),
        include_dirs: vec![root.join("kernels-common/include")],
        archs: Some(vec!["gfx942".into()]),
        out_dir: Some(dir.clone()),
        compiler: Some(cc.to_path_buf()),
        cargo_directives: false,
    };
    let objs = compile_hip_code_objects(&opts).unwrap_or_else(|e| panic!("{e}"));
    for o in &objs {
        let bytes = std::fs::read(&o.path).unwrap();
        check_code_object(Module::Fused, &o.arch, &bytes);
    }
    assert_eq!(objs.len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
