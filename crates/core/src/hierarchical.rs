//! The hierarchical quantized all-reduce (`Strategy::HierarchicalQuantized`): TensorRT-LLM's
//! low-precision PCIe all-reduce for 8 GPUs in two NUMA groups of 4, for any world of two
//! equal groups. What every backend shares: which ranks form the groups, and the result
//! defined in one place ([`reference`]), which every backend must give bit for bit.
//!
//! The algorithm, with `g` ranks per group, group `G` = ranks `[G*g, (G+1)*g)`, local index
//! `l = rank % g`, and shards of whole codec blocks over `g` owners (`layout::shard_range(n,
//! g, l, QUANT_GRANULE)`):
//!
//! 1. reduce-scatter inside the group: each rank encodes its piece of shard `j` for the
//!    group's owner `j`; the owner sums, in f32 in local order from local 0, the decoded
//!    pieces and its own piece unquantized: the group's partial `P_G`;
//! 2. exchange with the partner (the other group's rank with the same local index, which owns
//!    the same shard): both send `enc(P_G)`, and both compute
//!    `F = enc(decode(enc(P_0)) + decode(enc(P_1)))`, group 0 first, from the very same
//!    bytes, so the two owners of a shard agree bit for bit;
//! 3. all-gather inside the group: every rank decodes every owner's `F` (its own too).
//!
//! Each rank sends `2 (g-1)` encoded shards inside its group and one across: the cross-group
//! link (the CPU interconnect on a 2 x 4 PCIe box) carries `1/g` of what a flat two-shot
//! would put on it.

use crate::codec;
use crate::layout::{shard_range, QUANT_GRANULE};
use crate::{Codec, Topology};

/// Ranks per group when `topology` splits `world` ranks into two equal NUMA groups of
/// consecutive ranks (`[0, g)` and `[g, 2g)`), else why the strategy cannot run.
///
/// Consecutive ranks because the kernels derive the groups from the rank alone (no per-group
/// table in their fixed arguments), as TensorRT-LLM's partner `(rank + 4) % 8` does; a launcher
/// that numbers ranks by GPU, and GPUs by NUMA node, gets that layout.
pub fn group_size(topology: Option<&Topology>, world: usize) -> Result<usize, String> {
    let Some(t) = topology else {
        return Err(
            "it needs the group's topology (two NUMA groups), and this backend has \
                    none: force one with GroupConfig::topology or ALLREDUCE_TOPOLOGY=pcie:2x4"
                .into(),
        );
    };
    let groups = t.numa_groups();
    if groups.len() != 2 || world % 2 != 0 {
        return Err(format!(
            "it needs two NUMA groups of equal size; the {world} ranks form {} group(s)",
            groups.len()
        ));
    }
    let g = world / 2;
    if groups[0] != (0..g).collect::<Vec<_>>() || groups[1] != (g..world).collect::<Vec<_>>() {
        return Err(format!(
            "it needs the NUMA groups to be ranks 0..{g} and {g}..{world}, they are {groups:?}"
        ));
    }
    Ok(g)
}

/// The result of the hierarchical all-reduce of `inputs` (one f32 vector per rank, all of one
/// length, world = 2 g), before rounding into the call's dtype: the algorithm above with the
/// reference codecs. Every rank's output is this, rounded once.
pub fn reference(inputs: &[Vec<f32>], g: usize, codec: Codec) -> Vec<f32> {
    assert_eq!(inputs.len(), 2 * g, "two groups of {g}");
    let n = inputs.first().map_or(0, Vec::len);
    let mut out = vec![0f32; n];
    for owner in 0..g {
        let range = shard_range(n, g, owner, QUANT_GRANULE);
        let len = range.len();
        if len == 0 {
            continue;
        }
        let mut bytes = vec![0u8; codec.encoded_len(len)];
        let mut piece = vec![0f32; len];
        let mut total = vec![0f32; len];
        for group in 0..2 {
            // Stage 1: the group's partial, own piece unquantized.
            let mut partial = vec![0f32; len];
            for local in 0..g {
                let x = &inputs[group * g + local][range.clone()];
                if local == owner {
                    piece.copy_from_slice(x);
                } else {
                    codec::encode(codec, x, &mut bytes);
                    codec::decode(codec, &bytes, &mut piece);
                }
                accumulate(&mut partial, &piece, local == 0);
            }
            // Stage 2: both owners decode both encoded partials, group 0 first.
            codec::encode(codec, &partial, &mut bytes);
            codec::decode(codec, &bytes, &mut piece);
            accumulate(&mut total, &piece, group == 0);
        }
        // Stage 3: every rank decodes the owners' encoded totals.
        codec::encode(codec, &total, &mut bytes);
        codec::decode(codec, &bytes, &mut out[range]);
    }
    out
}

/// `acc = x` for the first term (a sum of -0.0s stays -0.0), `acc += x` after.
fn accumulate(acc: &mut [f32], x: &[f32], first: bool) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a = if first { *v } else { *a + *v };
    }
}

/// Bytes one rank sends per call: `(in_group, cross_group)`. In the group: `g-1` encoded
/// pieces (stage 1) and the encoded total to the `g-1` others (stage 3); across: one encoded
/// partial shard (stage 2).
pub fn traffic(codec: Codec, n: usize, g: usize) -> (usize, usize) {
    let g = g.max(1);
    let shard = codec.encoded_len(crate::layout::shard_len(n, g, QUANT_GRANULE));
    (2 * (g - 1) * shard, shard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_come_from_two_equal_consecutive_numa_groups() {
        let t = |s: &str, w| Topology::parse(s, w).unwrap();
        assert_eq!(group_size(Some(&t("pcie:2x4", 8)), 8), Ok(4));
        assert_eq!(group_size(Some(&t("pcie:2x1", 2)), 2), Ok(1));
        assert_eq!(group_size(Some(&t("nvlink:2x3", 6)), 6), Ok(3));
        for (spec, w) in [("pcie", 8), ("pcie:4x2", 8), ("pcie:1x4", 4)] {
            let e = group_size(Some(&t(spec, w)), w).unwrap_err();
            assert!(e.contains("two NUMA groups"), "{spec}: {e}");
        }
        assert!(group_size(None, 8)
            .unwrap_err()
            .contains("ALLREDUCE_TOPOLOGY"));
        let mut interleaved = t("pcie:2x2", 4);
        interleaved.numa = vec![Some(0), Some(1), Some(0), Some(1)];
        assert!(group_size(Some(&interleaved), 4)
            .unwrap_err()
            .contains("ranks 0..2 and 2..4"));
    }

    #[test]
    fn reference_is_close_to_the_sum() {
        // Three quantizations (a piece, the partial, the total), each within the codec's step
        // bound of the block's largest magnitude: fp8's relative step is 2^-3 at worst.
        let world = 8;
        let n = 1000;
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| (0..n).map(|i| ((r * 7 + i * 3) % 5) as f32 - 2.0).collect())
            .collect();
        let got = reference(&inputs, 4, Codec::Fp8E4M3);
        for i in 0..n {
            let want: f32 = inputs.iter().map(|x| x[i]).sum();
            let abs: f32 = inputs.iter().map(|x| x[i].abs()).sum();
            assert!(
                (got[i] - want).abs() <= 0.2 * abs + 1e-6,
                "element {i}: {} vs {want}",
                got[i]
            );
        }
    }

    #[test]
    fn cross_group_traffic_is_one_shard() {
        let n = 8 << 20;
        let (inside, across) = traffic(Codec::Fp8E4M3, n, 4);
        assert_eq!(across, Codec::Fp8E4M3.encoded_len(n / 4));
        assert_eq!(inside, 6 * across);
    }
}
