//! Compiles kernels-cuda (+ kernels-common) into one fatbin with SASS per architecture
//! (`ALLREDUCE_CUDA_ARCHS`, default sm_80,sm_90,sm_100) and leaves it in OUT_DIR for
//! `include_bytes!`. Without nvcc the build stops with a message saying how to get one.

use allreduce_build_support::{compile_fatbin, FatbinOptions};

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut opts = FatbinOptions::new("allreduce", root.join("kernels-cuda/allreduce.cu"));
    opts.include_dirs = vec![
        root.join("kernels-common/include"),
        root.join("kernels-cuda"),
    ];
    if let Err(e) = compile_fatbin(&opts) {
        panic!("\n\nallreduce-backend-cuda cannot compile its kernels:\n{e}\n");
    }
}
