//! Builds tests/c/smoke.c with the system C compiler against the header and the cdylib
//! cargo built for these tests, runs it, and requires "smoke: ok". Without a C compiler it
//! prints "skipped: no C compiler" and passes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn compiler(var: &str, default: &str) -> Option<String> {
    let cc = std::env::var(var).unwrap_or_else(|_| default.into());
    Command::new(&cc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| cc)
}

/// The directory holding this test binary, where cargo also writes the library's cdylib
/// (crates with a cdylib keep an unhashed file name there).
fn artifacts() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_path_buf()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
fn a_c_program_runs_a_two_rank_group() {
    let Some(cc) = compiler("CC", "cc") else {
        println!("skipped: no C compiler");
        return;
    };
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let libdir = artifacts();
    let lib = libdir.join(if cfg!(target_os = "macos") {
        "liballreduce_c.dylib"
    } else {
        "liballreduce_c.so"
    });
    assert!(lib.exists(), "{} is missing", lib.display());
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi-smoke");
    std::fs::create_dir_all(&out).unwrap();
    let exe = out.join("smoke");
    run(Command::new(&cc)
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Wpedantic",
            "-Werror",
            "-I",
        ])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/c/smoke.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&libdir)
        .args(["-lallreduce_c", "-lpthread"])
        .arg(format!("-Wl,-rpath,{}", libdir.display())));
    let text = run(&mut Command::new(&exe));
    assert!(text.contains("smoke: ok"), "{text}");
}

#[test]
fn the_header_compiles_as_cpp() {
    let Some(cxx) = compiler("CXX", "c++") else {
        println!("skipped: no C++ compiler");
        return;
    };
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    run(Command::new(&cxx)
        .args([
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-x",
            "c++",
        ])
        .arg(crate_dir.join("include/allreduce.h")));
}
