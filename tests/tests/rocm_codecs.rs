//! The GPU codecs against the Rust reference, byte for byte (tests/src/codecs.rs), on ROCm.
//! Never run: no AMD GPU has been available to this project yet. Skips with the reason when
//! no GPU is usable.

#[cfg(not(feature = "rocm"))]
fn main() {
    println!("rocm_codecs skipped: built without the rocm feature");
}

#[cfg(feature = "rocm")]
fn main() {
    allreduce_conformance::codecs::run::<allreduce::rocm::Hip>();
}
