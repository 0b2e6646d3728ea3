//! `Strategy::Auto`: a first-match table over (bytes, world size, dtype, precision).
//!
//! Backends ship a default table; a tuner can replace it. A rule whose strategy the backend
//! cannot run for the call (no vendor library, a codec it lacks) is skipped, so one table
//! serves every backend.

use crate::{DType, Precision, Strategy};

/// One row: if every set condition holds, use `strategy`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    /// Inclusive range of world sizes.
    pub world: (usize, usize),
    /// Applies to calls of at most this many bytes (`usize::MAX` for no limit).
    pub max_bytes: usize,
    /// Only for this dtype (`None`: all).
    pub dtype: Option<DType>,
    /// Only when the caller allowed a lossy codec (`Some(true)`), only when not (`Some(false)`).
    pub lossy: Option<bool>,
    pub strategy: Strategy,
}

impl Rule {
    fn matches(&self, bytes: usize, world: usize, dtype: DType, precision: Precision) -> bool {
        (self.world.0..=self.world.1).contains(&world)
            && bytes <= self.max_bytes
            && self.dtype.is_none_or(|d| d == dtype)
            && self
                .lossy
                .is_none_or(|l| l == matches!(precision, Precision::Lossy(_)))
    }
}

/// Ordered rules, first match wins; `fallback` when none matches.
#[derive(Clone, Debug, PartialEq)]
pub struct SelectionTable {
    pub rules: Vec<Rule>,
    pub fallback: Strategy,
}

impl SelectionTable {
    /// Starting thresholds from the public ones: vLLM's custom all-reduce uses one stage
    /// below 512 KiB for up to 4 ranks and below 256 KiB for up to 8, two stages above;
    /// the quantized path pays off from about 1-2 MiB (vLLM's QuickReduce minimum sizes,
    /// TensorRT-LLM's low-precision threshold of 2 MiB). Vendor takes what is larger than
    /// the custom paths' workspace. References: ../shared/references/quickreduce.md §4-5.
    pub fn default_table() -> Self {
        const KIB: usize = 1024;
        const MIB: usize = 1024 * KIB;
        let rule = |world: (usize, usize), max_bytes, lossy, strategy| Rule {
            world,
            max_bytes,
            dtype: None,
            lossy,
            strategy,
        };
        SelectionTable {
            rules: vec![
                rule((1, 1), usize::MAX, None, Strategy::OneShot),
                rule((2, 2), 8 * MIB, Some(false), Strategy::OneShot),
                rule((2, usize::MAX), 2 * MIB - 1, Some(true), Strategy::OneShot),
                rule(
                    (2, usize::MAX),
                    usize::MAX,
                    Some(true),
                    Strategy::QuantizedTwoShot,
                ),
                rule((3, 4), 512 * KIB - 1, None, Strategy::OneShot),
                rule((5, usize::MAX), 256 * KIB - 1, None, Strategy::OneShot),
                rule((2, usize::MAX), 64 * MIB, None, Strategy::TwoShot),
                rule((2, usize::MAX), usize::MAX, None, Strategy::Vendor),
            ],
            fallback: Strategy::TwoShot,
        }
    }

    /// The first matching rule whose strategy `available` accepts, else the fallback.
    pub fn choose(
        &self,
        bytes: usize,
        world: usize,
        dtype: DType,
        precision: Precision,
        available: impl Fn(Strategy) -> bool,
    ) -> Strategy {
        self.rules
            .iter()
            .filter(|r| r.matches(bytes, world, dtype, precision))
            .map(|r| r.strategy)
            .find(|&s| s != Strategy::Auto && available(s))
            .unwrap_or(self.fallback)
    }
}

impl Default for SelectionTable {
    fn default() -> Self {
        Self::default_table()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_table_follows_public_thresholds() {
        let t = SelectionTable::default_table();
        let all = |_: Strategy| true;
        let exact = Precision::Exact;
        assert_eq!(
            t.choose(4096, 8, DType::BF16, exact, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(256 * 1024, 8, DType::BF16, exact, all),
            Strategy::TwoShot
        );
        assert_eq!(
            t.choose(300 * 1024, 4, DType::BF16, exact, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(1 << 30, 8, DType::BF16, exact, all),
            Strategy::Vendor
        );
        let lossy = Precision::Lossy(crate::Codec::Int4);
        assert_eq!(
            t.choose(1 << 20, 8, DType::BF16, lossy, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(4 << 20, 8, DType::BF16, lossy, all),
            Strategy::QuantizedTwoShot
        );
        // Without a vendor library the large exact call falls back to two-shot.
        let no_vendor = |s: Strategy| s != Strategy::Vendor;
        assert_eq!(
            t.choose(1 << 30, 8, DType::F32, exact, no_vendor),
            Strategy::TwoShot
        );
    }
}
