//! The fused all-reduce + residual + RMSNorm (+ FP8) on ROCm virtual ranks: the shared test of
//! tests/src/fused.rs over the ROCm backend (fused.hip's generic kernels). Never run: no AMD
//! GPU has been available to this project yet. Skips with the reason when no GPU is usable.
//! `ALLREDUCE_FUSED_QUICK=1` runs fewer token counts.

#[cfg(not(feature = "rocm"))]
fn main() {
    println!("rocm_fused skipped: built without the rocm feature");
}

#[cfg(feature = "rocm")]
fn main() {
    allreduce_conformance::fused::run::<allreduce::rocm::Hip>();
}
