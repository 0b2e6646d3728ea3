//! HIP graph safety on virtual ranks: the shared test of tests/src/graphs.rs over the ROCm
//! backend. Never run: no AMD GPU has been available to this project yet. Skips with the
//! reason when no GPU is usable.

#[cfg(not(feature = "rocm"))]
fn main() {
    println!("rocm_graphs skipped: built without the rocm feature");
}

#[cfg(feature = "rocm")]
fn main() {
    allreduce_conformance::graphs::run::<allreduce::rocm::Hip>();
}
