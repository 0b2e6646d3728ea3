//! How a buffer is cut into per-rank shards. Written once so the host backend and every GPU
//! kernel shard identically: that is what makes their results comparable byte for byte.

use std::ops::Range;

use crate::codec::BLOCK;
use crate::DType;

/// Shard granule, in elements, for the exact two-shot: 16 bytes, one vector load on a GPU.
pub const fn exact_granule(dtype: DType) -> usize {
    16 / dtype.size()
}

/// Shard granule for the quantized two-shot: one codec block. Because shard starts are
/// multiples of the block, the codec blocks are the buffer's global 32-element blocks
/// whatever the world size, so a quantized result depends on the data only.
pub const QUANT_GRANULE: usize = BLOCK;

/// Elements per piece of a call larger than a `max_bytes` workspace: as many as fit, rounded
/// down to whole codec blocks (so also 16-byte aligned for every dtype). Each piece is a whole
/// all-reduce of its range, so a lossy result is defined per piece: the owner of an element
/// (whose own contribution is summed unencoded) is its owner within the piece.
pub fn piece_len(max_bytes: usize, dtype: DType) -> usize {
    (max_bytes / dtype.size() / QUANT_GRANULE * QUANT_GRANULE).max(QUANT_GRANULE)
}

/// Elements per shard: `ceil(ceil(n / granule) / world) * granule`.
pub fn shard_len(n: usize, world: usize, granule: usize) -> usize {
    n.div_ceil(granule).div_ceil(world.max(1)) * granule
}

/// The element range owned by `rank`. Trailing ranks may own a short or empty range.
pub fn shard_range(n: usize, world: usize, rank: usize, granule: usize) -> Range<usize> {
    let s = shard_len(n, world, granule);
    let start = (rank * s).min(n);
    let end = ((rank + 1) * s).min(n);
    start..end
}

/// Bytes one rank moves over the links per call (sent; received is the same by symmetry),
/// for `n` elements of `dtype` on `world` ranks: what a strategy costs on a
/// bandwidth-bound link (PCIe, or NVLink at large sizes), from the algorithms as written:
///
/// * one-shot: every peer reads our whole input: `(w-1) * B`;
/// * two-shot (and a ring, NCCL's large-message algorithm): `2 (w-1)/w * B`;
/// * quantized two-shot: our `w-1` encoded pieces for the other owners, then our encoded
///   shard to the `w-1` others: `2 (w-1) * encoded_len(shard)`.
/// * hierarchical (two groups of `g = w/2`): `2 (g-1)` encoded shards of `n/g` inside the
///   group and one across ([`crate::hierarchical::traffic`]).
///
/// `None` for `Auto` (it names no algorithm) or a quantized call without a codec.
pub fn traffic_per_rank(
    strategy: crate::Strategy,
    precision: crate::Precision,
    n: usize,
    dtype: DType,
    world: usize,
) -> Option<usize> {
    use crate::{Precision, Strategy};
    let w = world.max(1);
    let bytes = n * dtype.size();
    Some(match strategy {
        Strategy::Auto => return None,
        Strategy::OneShot | Strategy::PushOneShot => (w - 1) * bytes,
        Strategy::TwoShot | Strategy::Vendor | Strategy::VendorSymmetric => 2 * (w - 1) * bytes / w,
        Strategy::QuantizedTwoShot => match precision {
            Precision::Exact => return None,
            Precision::Lossy(codec) => {
                2 * (w - 1) * codec.encoded_len(shard_len(n, w, QUANT_GRANULE))
            }
        },
        Strategy::HierarchicalQuantized => match precision {
            Precision::Exact => return None,
            Precision::Lossy(codec) => {
                let (inside, across) = crate::hierarchical::traffic(codec, n, w / 2);
                inside + across
            }
        },
    })
}

/// Of [`traffic_per_rank`], the bytes a rank sends to the other group when the `world` ranks
/// form two NUMA groups of `world / 2` (ranks `[0, g)` and `[g, 2g)`): what crosses the CPU
/// interconnect on a 2 x 4 PCIe machine, the link TensorRT-LLM's hierarchical path unloads.
/// A peer of the other group is `g` of the `w-1` peers:
///
/// * one-shot: `g * B`; two-shot: `2 g B / w = B`; quantized two-shot:
///   `2 g * encoded_len(shard)`; hierarchical: one encoded shard of `n/g`.
///
/// `None` where `traffic_per_rank` is, or for an odd world.
pub fn cross_group_traffic_per_rank(
    strategy: crate::Strategy,
    precision: crate::Precision,
    n: usize,
    dtype: DType,
    world: usize,
) -> Option<usize> {
    use crate::{Precision, Strategy};
    if world < 2 || world % 2 != 0 {
        return None;
    }
    let g = world / 2;
    let bytes = n * dtype.size();
    Some(match (strategy, precision) {
        (Strategy::Auto, _) => return None,
        (Strategy::OneShot | Strategy::PushOneShot, _) => g * bytes,
        (Strategy::TwoShot | Strategy::Vendor | Strategy::VendorSymmetric, _) => {
            2 * g * bytes / world
        }
        (Strategy::QuantizedTwoShot, Precision::Lossy(codec)) => {
            2 * g * codec.encoded_len(shard_len(n, world, QUANT_GRANULE))
        }
        (Strategy::HierarchicalQuantized, Precision::Lossy(codec)) => {
            crate::hierarchical::traffic(codec, n, g).1
        }
        (_, Precision::Exact) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_traffic_is_the_codec_fraction_of_two_shot() {
        use crate::{Codec, Precision, Strategy};
        let n = 8 << 20;
        let exact =
            traffic_per_rank(Strategy::TwoShot, Precision::Exact, n, DType::BF16, 8).unwrap();
        assert_eq!(exact, 2 * 7 * n * 2 / 8);
        for (codec, bits) in [
            (Codec::Fp8E4M3, 8.5),
            (Codec::Int6, 6.5),
            (Codec::Int4, 4.5),
        ] {
            let q = traffic_per_rank(
                Strategy::QuantizedTwoShot,
                Precision::Lossy(codec),
                n,
                DType::BF16,
                8,
            )
            .unwrap();
            let ratio = q as f64 / exact as f64;
            assert!((ratio - bits / 16.0).abs() < 1e-3, "{codec}: {ratio}");
        }
        assert_eq!(
            traffic_per_rank(Strategy::OneShot, Precision::Exact, 100, DType::F32, 4),
            Some(1200)
        );
        assert_eq!(
            traffic_per_rank(Strategy::Auto, Precision::Exact, 100, DType::F32, 4),
            None
        );
    }

    #[test]
    fn hierarchical_cuts_the_cross_group_traffic() {
        use crate::{Codec, Precision, Strategy};
        let n = 8 << 20;
        let fp8 = Precision::Lossy(Codec::Fp8E4M3);
        let across = |s, p| cross_group_traffic_per_rank(s, p, n, DType::BF16, 8).unwrap();
        let exact = across(Strategy::TwoShot, Precision::Exact);
        assert_eq!(exact, n * 2);
        let flat = across(Strategy::QuantizedTwoShot, fp8);
        let hier = across(Strategy::HierarchicalQuantized, fp8);
        // Flat: 8.5/16 of the exact bytes; hierarchical: a quarter of that again.
        assert!((flat as f64 / exact as f64 - 8.5 / 16.0).abs() < 1e-3);
        assert!((hier as f64 / flat as f64 - 0.25).abs() < 1e-3);
        let total =
            traffic_per_rank(Strategy::HierarchicalQuantized, fp8, n, DType::BF16, 8).unwrap();
        assert_eq!(total, 7 * hier);
        assert_eq!(
            cross_group_traffic_per_rank(Strategy::TwoShot, Precision::Exact, n, DType::BF16, 3),
            None
        );
    }

    #[test]
    fn shards_tile_the_buffer() {
        for n in [0usize, 1, 7, 31, 32, 33, 100, 4097, 1 << 20] {
            for world in 1..=9 {
                for granule in [1usize, 4, 8, 32] {
                    let mut next = 0;
                    for r in 0..world {
                        let range = shard_range(n, world, r, granule);
                        assert_eq!(range.start, next, "n={n} world={world} r={r}");
                        assert!(range.start % granule == 0 || range.start == n);
                        next = range.end;
                    }
                    assert_eq!(next, n);
                }
            }
        }
    }
}
