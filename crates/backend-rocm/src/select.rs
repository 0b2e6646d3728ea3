//! The ROCm backend's default table behind `Strategy::Auto`, from vLLM's published ROCm
//! thresholds (QuickReduce's `_QR_MIN_SIZE` and the custom all-reduce's size rules):
//!
//! - **Quantized two-shot** (QuickReduce's role) for a lossy call of world 2, 4 or 8 from
//!   QuickReduce's minimum size for its dtype, world size and codec bit width
//!   (`_QR_MIN_SIZE`). With [`GroupConfig::cast_bf16_to_f16`](allreduce_core::GroupConfig)
//!   bf16 uses the f16 row, as vLLM does with its cast on (its default; ours is off).
//! - **Custom one-shot / two-shot** below 8 MiB (vLLM's custom all-reduce `max_size`): one
//!   stage always at world 2, below 512 KiB up to 4 ranks, below 256 KiB up to 8.
//! - **RCCL** for everything larger; two-shot when RCCL is absent (the fallback).
//!
//! QuickReduce has no FP8 or adaptive codecs; ours take the threshold of the plain codec of
//! the same width (FP8 and Q8a as Q8, Q6a as Q6, Q4a as Q4). Unmeasured on AMD hardware: a
//! tuned table (`allreduce-bench --tune`, `ALLREDUCE_SELECTION_TABLE`) replaces it.

use allreduce_core::{Codec, DType, Rule, SelectionTable, Strategy};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// vLLM's `_QR_MIN_SIZE` in MiB: (world, [INT8, INT6, INT4]) (its FP column is the 16-bit
/// two-shot, our exact path).
const QR_MIN_MIB_F16: [(usize, [usize; 3]); 3] = [(2, [2, 2, 1]), (4, [16, 4, 2]), (8, [4, 4, 2])];
const QR_MIN_MIB_BF16: [(usize, [usize; 3]); 3] = [
    (2, [8, 8, 8]),
    (4, [64, 64, 16]),
    // 2 GiB: QuickReduce is effectively off for bf16 at 8 ranks without the cast.
    (8, [2048, 2048, 2048]),
];

/// The largest message the custom one-/two-shot kernels take by default (exclusive).
pub const CUSTOM_MAX_BYTES: usize = 8 * MIB;

/// Which column of `_QR_MIN_SIZE` a codec uses: by bits on the wire.
fn qr_column(c: Codec) -> usize {
    match c.code_bits() {
        8 => 0,
        6 => 1,
        _ => 2,
    }
}

/// QuickReduce's minimum message size for this call shape, if it runs at this world size.
pub fn quantized_min_bytes(
    world: usize,
    dtype: DType,
    codec: Codec,
    cast_bf16: bool,
) -> Option<usize> {
    let table = match dtype {
        DType::F16 => &QR_MIN_MIB_F16,
        DType::BF16 if cast_bf16 => &QR_MIN_MIB_F16,
        DType::BF16 => &QR_MIN_MIB_BF16,
        DType::F32 => return None,
    };
    table
        .iter()
        .find(|(w, _)| *w == world)
        .map(|(_, mins)| mins[qr_column(codec)] * MIB)
}

/// The default table; `cast_bf16_to_f16` picks the bf16 thresholds (see the module docs).
pub fn default_table(cast_bf16_to_f16: bool) -> SelectionTable {
    let any = |world: (usize, usize), max_bytes: usize, strategy| Rule {
        world,
        min_bytes: 0,
        max_bytes,
        dtype: None,
        lossy: None,
        codec: None,
        topology: None,
        strategy,
    };
    let mut rules = vec![any((1, 1), usize::MAX, Strategy::OneShot)];
    for dtype in [DType::F16, DType::BF16] {
        for &(world, _) in &QR_MIN_MIB_F16 {
            // The v2 codecs have kernels but no thresholds measured on AMD: no rule, so Auto
            // runs them exact.
            for codec in Codec::V1 {
                let min = quantized_min_bytes(world, dtype, codec, cast_bf16_to_f16)
                    .expect("listed world");
                rules.push(Rule {
                    world: (world, world),
                    min_bytes: min,
                    max_bytes: usize::MAX,
                    dtype: Some(dtype),
                    lossy: None,
                    codec: Some(codec),
                    topology: None,
                    strategy: Strategy::QuantizedTwoShot,
                });
            }
        }
    }
    rules.extend([
        any((2, 2), CUSTOM_MAX_BYTES - 1, Strategy::OneShot),
        any((3, 4), 512 * KIB - 1, Strategy::OneShot),
        any((5, 8), 256 * KIB - 1, Strategy::OneShot),
        any((2, 8), CUSTOM_MAX_BYTES - 1, Strategy::TwoShot),
        any((2, usize::MAX), usize::MAX, Strategy::Vendor),
    ]);
    SelectionTable {
        rules,
        fallback: Strategy::TwoShot,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allreduce_core::Precision;

    fn pick(
        t: &SelectionTable,
        bytes: usize,
        world: usize,
        dtype: DType,
        p: Precision,
    ) -> Strategy {
        t.choose(bytes, world, dtype, p, |_| true)
    }

    #[test]
    fn quantized_from_quickreduce_minimum_sizes() {
        let t = default_table(false);
        let q4 = Precision::Lossy(Codec::Int4);
        let q8 = Precision::Lossy(Codec::Int8);
        // f16, 4 ranks: Q4 from 2 MiB, Q8 from 16 MiB.
        assert_eq!(
            pick(&t, 2 * MIB, 4, DType::F16, q4),
            Strategy::QuantizedTwoShot
        );
        assert_eq!(pick(&t, 2 * MIB - 16, 4, DType::F16, q4), Strategy::TwoShot);
        assert_eq!(pick(&t, 8 * MIB, 4, DType::F16, q8), Strategy::Vendor);
        assert_eq!(
            pick(&t, 16 * MIB, 4, DType::F16, q8),
            Strategy::QuantizedTwoShot
        );
        // bf16 without the cast: 4 ranks Q4 from 16 MiB; 8 ranks Q8 effectively never.
        assert_eq!(pick(&t, 2 * MIB, 4, DType::BF16, q4), Strategy::TwoShot);
        assert_eq!(pick(&t, 10 * MIB, 4, DType::BF16, q4), Strategy::Vendor);
        assert_eq!(
            pick(&t, 16 * MIB, 4, DType::BF16, q4),
            Strategy::QuantizedTwoShot
        );
        assert_eq!(pick(&t, 1 << 30, 8, DType::BF16, q8), Strategy::Vendor);
        assert_eq!(
            pick(&t, 2 << 30, 8, DType::BF16, q8),
            Strategy::QuantizedTwoShot
        );
        // The codecs QuickReduce lacks take their width's threshold.
        let fp8 = Precision::Lossy(Codec::Fp8E4M3);
        let q6a = Precision::Lossy(Codec::Int6Adaptive);
        assert_eq!(
            pick(&t, 4 * MIB, 8, DType::F16, fp8),
            Strategy::QuantizedTwoShot
        );
        assert_eq!(
            pick(&t, 4 * MIB - 16, 8, DType::F16, q6a),
            Strategy::TwoShot
        );
        assert_eq!(
            pick(&t, 4 * MIB, 8, DType::F16, q6a),
            Strategy::QuantizedTwoShot
        );
        // No QuickReduce at 6 ranks (vLLM refuses 6 and odd sizes).
        assert_eq!(pick(&t, 64 * MIB, 6, DType::F16, q4), Strategy::Vendor);
    }

    #[test]
    fn cast_bf16_uses_the_f16_thresholds() {
        let t = default_table(true);
        let q4 = Precision::Lossy(Codec::Int4);
        assert_eq!(
            pick(&t, 2 * MIB, 4, DType::BF16, q4),
            Strategy::QuantizedTwoShot
        );
        assert_eq!(
            pick(&t, 4 * MIB, 8, DType::BF16, Precision::Lossy(Codec::Int8)),
            Strategy::QuantizedTwoShot
        );
        assert_ne!(default_table(true), default_table(false));
        assert_eq!(quantized_min_bytes(4, DType::F32, Codec::Int4, true), None);
    }

    #[test]
    fn exact_calls_follow_vllm_custom_allreduce_then_rccl() {
        let t = default_table(false);
        let e = Precision::Exact;
        assert_eq!(pick(&t, 1 << 30, 1, DType::F32, e), Strategy::OneShot);
        assert_eq!(pick(&t, 4 * MIB, 2, DType::BF16, e), Strategy::OneShot);
        assert_eq!(pick(&t, 8 * MIB, 2, DType::BF16, e), Strategy::Vendor);
        assert_eq!(pick(&t, 300 * KIB, 4, DType::BF16, e), Strategy::OneShot);
        assert_eq!(pick(&t, 512 * KIB, 4, DType::BF16, e), Strategy::TwoShot);
        assert_eq!(pick(&t, 200 * KIB, 8, DType::F16, e), Strategy::OneShot);
        assert_eq!(pick(&t, 256 * KIB, 8, DType::F16, e), Strategy::TwoShot);
        assert_eq!(pick(&t, 8 * MIB - 16, 8, DType::F32, e), Strategy::TwoShot);
        assert_eq!(pick(&t, 8 * MIB, 8, DType::F32, e), Strategy::Vendor);
        // A lossy call below QuickReduce's minimum takes the exact paths.
        let q4 = Precision::Lossy(Codec::Int4);
        assert_eq!(pick(&t, 64 * KIB, 8, DType::F16, q4), Strategy::OneShot);
    }

    #[test]
    fn unavailable_strategies_are_skipped() {
        let t = default_table(false);
        let q4 = Precision::Lossy(Codec::Int4);
        // Today: no quantized kernels and, on most machines, no RCCL.
        let exact_kernels_only = |s: Strategy| matches!(s, Strategy::OneShot | Strategy::TwoShot);
        assert_eq!(
            t.choose(2 * MIB, 4, DType::F16, q4, exact_kernels_only),
            Strategy::TwoShot
        );
        assert_eq!(
            t.choose(
                1 << 30,
                8,
                DType::BF16,
                Precision::Exact,
                exact_kernels_only
            ),
            Strategy::TwoShot
        );
    }

    #[test]
    fn table_round_trips_through_json() {
        for cast in [false, true] {
            let t = default_table(cast);
            let back = SelectionTable::from_json(&t.to_json().to_string()).unwrap();
            assert_eq!(back, t);
        }
    }
}
