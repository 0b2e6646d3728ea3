//! CUDA graph safety on virtual ranks: the shared test of tests/src/graphs.rs over the CUDA
//! backend. Skips with the reason when no GPU is usable.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("cuda_graphs skipped: built without the cuda feature");
}

#[cfg(feature = "cuda")]
fn main() {
    allreduce_conformance::graphs::run::<allreduce::cuda::CudaRuntime>();
}
