//! Compiles the shims in shim/ against the peers' headers that scripts/peers/fetch.sh put in
//! .peers/ at the workspace root, with the same pinned nvcc as our kernels, and links them with
//! the CUDA runtime (static, from that nvcc's release). Without .peers/ nothing is compiled and
//! every baseline reports, as an error value, how to fetch it; SGLang's shim is compiled when
//! its sources are there too.

use std::path::{Path, PathBuf};
use std::process::Command;

use allreduce_build_support::{find_nvcc, ARCHS_ENV};

fn main() {
    // Read at run time, not baked in with env! (backend-cuda's build.rs says why).
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest.join("../..");
    let peers = root.join(".peers");
    println!(
        "cargo:rerun-if-changed={}",
        peers.join("VERSIONS").display()
    );
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rerun-if-env-changed={ARCHS_ENV}");
    println!("cargo::rustc-check-cfg=cfg(peers_built)");
    println!("cargo::rustc-check-cfg=cfg(peers_sglang)");
    let Ok(versions) = std::fs::read_to_string(peers.join("VERSIONS")) else {
        return; // lib.rs's unavailable() says how to fetch them
    };
    let nvcc = find_nvcc().unwrap_or_else(|e| panic!("allreduce-peers needs nvcc: {e}"));
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let archs = std::env::var(ARCHS_ENV).unwrap_or_else(|_| "sm_90".into());
    let archs: Vec<&str> = archs
        .split([',', ' '])
        .map(|a| a.trim_start_matches("sm_"))
        .filter(|a| !a.is_empty())
        .collect();
    // SGLang's sources (a later fetch.sh than the other peers'): compiled when present, so a
    // .peers/ fetched before them still builds the rest.
    let sglang = peers.join("sglang/include").is_dir();
    let shims: &[&str] = if sglang {
        &["vllm", "trtllm", "pcie", "sglang"]
    } else {
        &["vllm", "trtllm", "pcie"]
    };
    let mut objects = Vec::new();
    for &shim in shims {
        let src = manifest.join(format!("shim/{shim}.cu"));
        let obj = out.join(format!("{shim}.o"));
        let mut cmd = Command::new(&nvcc);
        // SGLang's headers are C++20 (concepts, ranges) and, as its JIT builds them, compiled
        // for one architecture named to them (SGL_CUDA_ARCH, checked against __CUDA_ARCH__):
        // the first of the list.
        let std = if shim == "sglang" {
            "-std=c++20"
        } else {
            "-std=c++17"
        };
        cmd.args(["-c", "-O3", std, "-Xcompiler", "-fPIC", "-w"])
            // As FlashInfer's own JIT builds compile these headers.
            .arg("--expt-relaxed-constexpr")
            .arg("-I")
            .arg(peers.join("include"))
            .arg("-I")
            .arg(peers.join("cccl"))
            // libcu++ (cuda/std), which the cooperative-groups and cluster code needs.
            .arg("-I")
            .arg(peers.join("cccl/cccl"))
            .arg("-I")
            .arg(peers.join("spdlog"));
        if shim == "sglang" {
            let n = archs.first().copied().unwrap_or("90");
            cmd.arg(format!("-DSGL_CUDA_ARCH={n}0"))
                .arg("-I")
                .arg(peers.join("sglang/include"))
                .arg("-I")
                .arg(peers.join("sglang/csrc"))
                .arg("-I")
                .arg(peers.join("tvm-ffi"))
                .arg(format!("-gencode=arch=compute_{n},code=sm_{n}"));
        } else {
            for n in &archs {
                cmd.arg(format!("-gencode=arch=compute_{n},code=sm_{n}"));
            }
        }
        let status = cmd.arg(&src).arg("-o").arg(&obj).status();
        match status {
            Ok(s) if s.success() => objects.push(obj),
            other => panic!(
                "allreduce-peers: nvcc failed on {}: {other:?}",
                src.display()
            ),
        }
    }
    let lib = out.join("libpeers_shim.a");
    let _ = std::fs::remove_file(&lib);
    let ok = Command::new("ar")
        .arg("rcs")
        .arg(&lib)
        .args(&objects)
        .status();
    assert!(
        matches!(ok, Ok(s) if s.success()),
        "allreduce-peers: ar failed: {ok:?}"
    );
    // libcudart_static.a sits in the lib/ beside nvcc's bin/ in the pip wheels and toolkits.
    let cudart = nvcc.parent().and_then(Path::parent).map(|p| p.join("lib"));
    let cudart = cudart
        .into_iter()
        .chain([PathBuf::from("/usr/local/cuda/lib64")])
        .find(|d| d.join("libcudart_static.a").exists())
        .expect("allreduce-peers: no libcudart_static.a beside nvcc");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-search=native={}", cudart.display());
    println!("cargo:rustc-link-lib=static=peers_shim");
    println!("cargo:rustc-link-lib=static=cudart_static");
    for l in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    println!(
        "cargo:rustc-env=ALLREDUCE_PEERS_VERSIONS={}",
        versions.trim()
    );
    println!("cargo:rustc-cfg=peers_built");
    if sglang {
        println!("cargo:rustc-cfg=peers_sglang");
    }
}
