//! The GPU codecs against the Rust reference, byte for byte (tests/src/codecs.rs), on CUDA.
//! Skips with the reason when no GPU is usable.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("cuda_codecs skipped: built without the cuda feature");
}

#[cfg(feature = "cuda")]
fn main() {
    allreduce_conformance::codecs::run::<allreduce::cuda::CudaRuntime>();
}
