//! Compiles the real kernels (kernels-cuda/allreduce.cu and fused.cu) with whatever nvcc
//! `find_nvcc` finds, so a broken kernel, or one of the kernel table that is not compiled,
//! fails `cargo test` on a machine without a GPU. Without nvcc (or away from the source tree,
//! e.g. on the GPU machine) the tests say so and pass.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use allreduce_build_support::{compile_fatbin, find_nvcc, FatbinOptions, DEFAULT_ARCHS};
use allreduce_gpu::kernels::{self, Module, Vendor};

/// What `module` must export: every kernel of the table, as the backend looks it up.
fn kernel_names(module: Module) -> Vec<String> {
    kernels::kernels(Vendor::Cuda, module)
        .iter()
        .map(|k| k.name())
        .collect()
}

/// The nvcc and the workspace root, or None after printing why the test is skipped.
fn setup() -> Option<(PathBuf, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !root.join("kernels-cuda/allreduce.cu").is_file() {
        println!(
            "skipped: kernels-cuda/allreduce.cu not found under {}",
            root.display()
        );
        return None;
    }
    match find_nvcc() {
        Ok(nvcc) => Some((nvcc, root)),
        Err(e) => {
            println!("skipped: no nvcc (run scripts/setup-cuda.sh): {e}");
            None
        }
    }
}

fn compile(nvcc: &Path, root: &Path, module: Module, archs: &[&str], out: &Path) -> PathBuf {
    let stem = module.stem();
    let opts = FatbinOptions {
        name: stem.into(),
        source: root.join(format!("kernels-cuda/{stem}.cu")),
        include_dirs: vec![root.join("kernels-common/include")],
        archs: Some(archs.iter().map(|a| a.to_string()).collect()),
        out_dir: Some(out.to_path_buf()),
        compiler: Some(nvcc.to_path_buf()),
        cargo_directives: false,
    };
    let start = Instant::now();
    let path = compile_fatbin(&opts).unwrap_or_else(|e| panic!("{e}"));
    let bytes = std::fs::metadata(&path).unwrap().len();
    println!(
        "{stem} {archs:?}: {bytes} bytes in {:.2?} with {}",
        start.elapsed(),
        nvcc.display()
    );
    assert_eq!(path, out.join(format!("{stem}.fatbin")));
    assert!(bytes > 0);
    path
}

/// Every kernel of the table for `module` is exported (extern "C", unmangled). This reads the
/// names straight out of the fatbin, which nvcc leaves uncompressed; the terminating NUL keeps
/// `ar_quantized_f16_q8` from matching inside `ar_quantized_f16_q8a`.
fn check_exports(module: Module, fatbin: &Path) {
    let bytes = std::fs::read(fatbin).unwrap();
    for k in kernel_names(module) {
        let symbol = format!("{k}\0");
        assert!(
            bytes.windows(symbol.len()).any(|w| w == symbol.as_bytes()),
            "{k} missing from {}",
            fatbin.display()
        );
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ar-compile-kernels-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn kernels_compile_for_sm_90() {
    let Some((nvcc, root)) = setup() else { return };
    let dir = scratch("sm90");
    let fatbin = compile(&nvcc, &root, Module::AllReduce, &["sm_90"], &dir);
    check_exports(Module::AllReduce, &fatbin);

    let cuobjdump = nvcc.with_file_name("cuobjdump");
    match Command::new(&cuobjdump)
        .arg("--list-elf")
        .arg(&fatbin)
        .output()
    {
        Ok(o) => {
            let listing = String::from_utf8_lossy(&o.stdout);
            assert!(
                o.status.success() && listing.contains("sm_90"),
                "cuobjdump: {listing}"
            );
        }
        Err(_) => println!("cuobjdump not next to nvcc: ELF listing not checked"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernels_compile_for_default_archs() {
    let Some((nvcc, root)) = setup() else { return };
    let dir = scratch("default");
    compile(&nvcc, &root, Module::AllReduce, DEFAULT_ARCHS, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fused module (fused.cu), sm_90 only: the architecture its split one-shot needs, and
/// the slowest of the two to build.
#[test]
fn fused_kernels_compile_for_sm_90() {
    let Some((nvcc, root)) = setup() else { return };
    let dir = scratch("fused");
    let fatbin = compile(&nvcc, &root, Module::Fused, &["sm_90"], &dir);
    check_exports(Module::Fused, &fatbin);
    let _ = std::fs::remove_dir_all(&dir);
}
