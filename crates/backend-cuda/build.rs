//! Compiles kernels-cuda (+ kernels-common) into fatbins with SASS per architecture
//! (`ALLREDUCE_CUDA_ARCHS`, default sm_80,sm_90,sm_100) and leaves them in OUT_DIR for
//! `include_bytes!`: `allreduce.fatbin` (the all-reduce kernels) and `fused.fatbin` (the
//! Lamport all-reduce fused with residual + RMSNorm). Without nvcc the build stops with a
//! message saying how to get one.

use allreduce_build_support::{compile_fatbin, FatbinOptions};

fn main() {
    // Read at run time, not baked in with env!: a build script compiled for one checkout is
    // reused by cargo for another that shares the target directory (a git worktree), and would
    // then compile the first checkout's kernels.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = std::path::Path::new(&manifest).join("../..");
    for (name, source) in [
        ("allreduce", "kernels-cuda/allreduce.cu"),
        ("fused", "kernels-cuda/fused.cu"),
    ] {
        let mut opts = FatbinOptions::new(name, root.join(source));
        opts.include_dirs = vec![
            root.join("kernels-common/include"),
            root.join("kernels-cuda"),
        ];
        if let Err(e) = compile_fatbin(&opts) {
            panic!("\n\nallreduce-backend-cuda cannot compile its kernels:\n{e}\n");
        }
    }
}
