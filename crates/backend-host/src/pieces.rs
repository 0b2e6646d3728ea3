//! Stage 1 of both quantized paths (flat, `HostComm::quantized`, and hierarchical): every rank
//! encodes its piece of each owner's shard into one send buffer, and each owner sums the
//! pieces of its own shard in member order, its own piece unquantized (one quantization fewer
//! than QuickReduce, docs/codecs.md). The flat path's owners are all ranks; the hierarchical
//! path's are the ranks of one NUMA group.

use std::ops::Range;

use allreduce_core::{codec, Codec, Element};

use crate::reduce;

/// Where each owner's encoded segment lies in a rank's send buffer: end to end, in owner order.
pub(crate) struct SendLayout {
    off: Vec<usize>,
}

impl SendLayout {
    pub(crate) fn new(codec: Codec, owners: usize, shard: impl Fn(usize) -> Range<usize>) -> Self {
        let mut off = Vec::with_capacity(owners + 1);
        let mut total = 0;
        off.push(0);
        for j in 0..owners {
            total += codec.encoded_len(shard(j).len());
            off.push(total);
        }
        Self { off }
    }

    pub(crate) fn total(&self) -> usize {
        *self.off.last().expect("at least the leading 0")
    }

    /// Owners, who are also the members whose pieces make up each shard.
    pub(crate) fn owners(&self) -> usize {
        self.off.len() - 1
    }

    pub(crate) fn segment(&self, owner: usize) -> Range<usize> {
        self.off[owner]..self.off[owner + 1]
    }
}

/// Our piece of every owner's shard but `own`'s, widened into `x` and encoded into `send`.
pub(crate) fn encode_pieces<T: Element>(
    codec: Codec,
    input: &[T],
    send: &mut [u8],
    layout: &SendLayout,
    own: usize,
    shard: impl Fn(usize) -> Range<usize>,
    x: &mut [f32],
) {
    for owner in (0..layout.owners()).filter(|&o| o != own) {
        let range = shard(owner);
        let x = &mut x[..range.len()];
        reduce::widen(&input[range], x);
        codec::encode(codec, x, &mut send[layout.segment(owner)]);
    }
}

/// The f32 sum, in member order, of every member's piece of the shard of member `own`: ours
/// (`own_piece`) unquantized, each other member's decoded from its send buffer, which
/// `sent(member)` returns. `acc` and `tmp` have the shard's length.
pub(crate) fn sum_pieces<'a, T: Element>(
    codec: Codec,
    own_piece: &[T],
    layout: &SendLayout,
    own: usize,
    sent: impl Fn(usize) -> &'a [u8],
    acc: &mut [f32],
    tmp: &mut [f32],
) {
    for m in 0..layout.owners() {
        if m == own {
            reduce::widen(own_piece, tmp);
        } else {
            codec::decode(codec, &sent(m)[layout.segment(own)], tmp);
        }
        reduce::accumulate(acc, tmp, m == 0);
    }
}
