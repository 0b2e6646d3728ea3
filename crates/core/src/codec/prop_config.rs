//! The configuration of the codec property tests: a fixed seed, so that every run, CI's
//! included, draws the same cases, and no failure files (a file proptest writes beside the
//! source would replay its case in every later run of that checkout and nowhere else).
//!
//! `PROPTEST_RNG_SEED=<u64>` (proptest's own variable) draws other cases: a loop over seeds
//! explores, and a failure found there becomes a named regression test beside its property.

use proptest::test_runner::{Config, RngSeed};

/// The seed of every property test unless `PROPTEST_RNG_SEED` is set.
const SEED: u64 = 0xC0DE_C5EE_D000_0001;

/// `cases` cases from [`SEED`] (or `PROPTEST_RNG_SEED`), nothing persisted.
pub(super) fn config(cases: u32) -> Config {
    let mut c = Config::with_cases(cases);
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        c.rng_seed = RngSeed::Fixed(SEED);
    }
    c.failure_persistence = None;
    c
}
