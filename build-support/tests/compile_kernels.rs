//! Compiles the real kernels (kernels-cuda/allreduce.cu) with whatever nvcc `find_nvcc`
//! finds, so a broken kernel fails `cargo test` on a machine without a GPU. Without nvcc (or
//! away from the source tree, e.g. on the GPU machine) the tests say so and pass.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use allreduce_build_support::{compile_fatbin, find_nvcc, FatbinOptions, DEFAULT_ARCHS};

const KERNELS: &[&str] = &[
    "ar_oneshot_f32",
    "ar_oneshot_f16",
    "ar_oneshot_bf16",
    "ar_twoshot_f32",
    "ar_twoshot_f16",
    "ar_twoshot_bf16",
    "ar_copy_f32x4",
    "ar_quantized_bf16_fp8",
    "ar_hierarchical_f16_fp8",
    "ar_hierarchical_bf16_fp8",
    "ar_hierarchical_bf16_q4a",
];

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

fn compile(nvcc: &Path, root: &Path, archs: &[&str], out: &Path) -> PathBuf {
    let opts = FatbinOptions {
        name: "allreduce".into(),
        source: root.join("kernels-cuda/allreduce.cu"),
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
        "{archs:?}: {bytes} bytes in {:.2?} with {}",
        start.elapsed(),
        nvcc.display()
    );
    assert_eq!(path, out.join("allreduce.fatbin"));
    assert!(bytes > 0);
    path
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
    let fatbin = compile(&nvcc, &root, &["sm_90"], &dir);

    // Every kernel the backend looks up by name is exported (extern "C", unmangled). This
    // reads the names straight out of the fatbin, which nvcc leaves uncompressed.
    let bytes = std::fs::read(&fatbin).unwrap();
    for k in KERNELS {
        assert!(
            bytes.windows(k.len()).any(|w| w == k.as_bytes()),
            "{k} missing from the fatbin"
        );
    }

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
    compile(&nvcc, &root, DEFAULT_ARCHS, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}
