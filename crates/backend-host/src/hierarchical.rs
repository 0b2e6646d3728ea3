//! The hierarchical quantized all-reduce on the host: the reference the GPU kernel
//! (kernels-common hierarchical.h) is checked against, stage for stage. The algorithm and why
//! every rank ends with the same bits: `allreduce_core::hierarchical`.
//!
//! Buffers, as in the flat quantized path: `qsend` (stage 1's pieces, written before the
//! call's first barrier), `qpartial` (the group's encoded partial, written after the first
//! barrier and read by the partner before the third), `qresult` (the encoded total, written
//! after the second barrier, read by the group after the third). A rank reaches the next call's
//! first barrier only after every rank finished this call, so one copy of each suffices.

use allreduce_core::codec;
use allreduce_core::layout::{shard_range, QUANT_GRANULE};
use allreduce_core::{Call, Codec, Element, Result};

use crate::pieces::{self, SendLayout};
use crate::{output_slice, reduce, Ctx, HostComm, Scratch};

impl HostComm {
    /// `g` ranks per group (checked by `hierarchical::group_size`), world = 2 g.
    pub(crate) fn hierarchical<T: Element>(
        &self,
        ctx: Ctx,
        call: &Call,
        codec: Codec,
        g: usize,
    ) -> Result<()> {
        let n = call.len();
        let (group, local) = (self.rank / g, self.rank % g);
        let partner = (self.rank + g) % (2 * g);
        let slots = &self.group.slots;
        let shard = |j| shard_range(n, g, j, QUANT_GRANULE);
        let layout = SendLayout::new(codec, g, shard);
        let total = layout.total();
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { a, b } = &mut *scratch;
        let max_shard = shard(0).len();
        a.resize(max_shard, 0.0);
        b.resize(max_shard, 0.0);
        let max_enc = codec.encoded_len(max_shard);

        // ---- stage 1a: our piece of every other in-group owner's shard, encoded.
        // SAFETY: the caller's input, validated by `prepare`.
        let input = unsafe { std::slice::from_raw_parts(call.input.addr as *const T, n) };
        // SAFETY: own slot before the first barrier; last call's readers are done (module doc).
        let send =
            unsafe { std::slice::from_raw_parts_mut(slots[self.rank].qsend.prepare(total), total) };
        pieces::encode_pieces(codec, input, send, &layout, local, shard, a);
        self.barrier(ctx, "all ranks to encode their in-group pieces")?;
        self.agree(ctx)?;

        // ---- stage 1b: the group's partial of our shard, local order, own piece raw; sent
        // encoded to the partner.
        let mine = shard(local);
        let len = mine.len();
        let enc_len = codec.encoded_len(len);
        let acc = &mut a[..len];
        let tmp = &mut b[..len];
        // SAFETY (of the reads): each group member wrote its `qsend` before the barrier above.
        let sent = |i: usize| unsafe { slots[group * g + i].qsend.read(total) };
        let own_piece = &input[mine.clone()];
        pieces::sum_pieces(codec, own_piece, &layout, local, sent, acc, tmp);
        // SAFETY: own slot; the partner reads it only after the next barrier.
        let partial = unsafe {
            std::slice::from_raw_parts_mut(slots[self.rank].qpartial.prepare(max_enc), enc_len)
        };
        codec::encode(codec, acc, partial);
        self.barrier(ctx, "all ranks to encode their group's partial")?;

        // ---- stage 2: both owners of the shard decode both partials from the same bytes,
        // group 0 first, and encode the total: the two groups agree bit for bit.
        for h in 0..2 {
            let src = if h == group { self.rank } else { partner };
            // SAFETY: written before the barrier above, not rewritten before the next call.
            let bytes = unsafe { slots[src].qpartial.read(enc_len) };
            codec::decode(codec, bytes, tmp);
            reduce::accumulate(acc, tmp, h == 0);
        }
        // SAFETY: own slot; the group reads it only after the next barrier.
        let result = unsafe {
            std::slice::from_raw_parts_mut(slots[self.rank].qresult.prepare(max_enc), enc_len)
        };
        codec::encode(codec, acc, result);
        self.barrier(ctx, "all ranks to encode their shard's total")?;

        // ---- stage 3: every owner of our group's bytes, decoded (our own too).
        // SAFETY: as in one_shot; the input was fully read in stage 1.
        let out = unsafe { output_slice::<T>(call) };
        for j in 0..g {
            let range = shard(j);
            let len = range.len();
            // SAFETY: written by that owner before the barrier above.
            let bytes = unsafe { slots[group * g + j].qresult.read(codec.encoded_len(len)) };
            codec::decode(codec, bytes, &mut a[..len]);
            reduce::narrow(&a[..len], &mut out[range]);
        }
        Ok(())
    }
}
