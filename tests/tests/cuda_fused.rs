//! The fused all-reduce + residual + RMSNorm (+ FP8) on CUDA virtual ranks: the shared test of
//! tests/src/fused.rs over the CUDA backend. Skips with the reason when no GPU is usable.
//! `ALLREDUCE_FUSED_QUICK=1` runs fewer token counts.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("cuda_fused skipped: built without the cuda feature");
}

#[cfg(feature = "cuda")]
fn main() {
    allreduce_conformance::fused::run::<allreduce::cuda::CudaRuntime>();
}
