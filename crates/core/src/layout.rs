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

#[cfg(test)]
mod tests {
    use super::*;

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
