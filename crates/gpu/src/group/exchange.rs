//! Registration in a group of one process per rank. A rank's memory reaches its peers as the
//! IPC handle of the allocation that holds it plus the offset in it, sent over the caller's
//! bootstrap (as vLLM sends its buffers' handles over its process group). Each process maps an
//! allocation once and keeps the mapping for the life of the group: CUDA refuses to open one
//! handle twice in a process, and many buffers (every layer's activations, from one caching
//! allocator segment) share an allocation. After the exchange a registration is the same
//! bookkeeping as an in-process one, with the peers' addresses in this process's space.

use std::collections::HashMap;

use super::*;

/// What one rank sends: its own failure, or a tag the ranks must agree on and its items.
struct Shared {
    tag: Vec<u8>,
    items: Vec<SharedItem>,
}

struct SharedItem {
    bytes: u64,
    offset: u64,
    handle: Vec<u8>,
}

/// The mapped peer allocations of a group of processes, by handle; unmapped on drop of the
/// group.
pub(super) type Mapped = Mutex<HashMap<Vec<u8>, u64>>;

fn field<'a>(rest: &mut &'a [u8], from: usize) -> Result<&'a [u8]> {
    let bad = || Error::Bootstrap {
        detail: format!("rank {from} sent a malformed registration message"),
    };
    let len = u32::from_le_bytes(rest.get(..4).ok_or_else(bad)?.try_into().unwrap()) as usize;
    let f = rest.get(4..4 + len).ok_or_else(bad)?;
    *rest = &rest[4 + len..];
    Ok(f)
}

fn word(f: &[u8], from: usize) -> Result<u64> {
    f.try_into()
        .map(u64::from_le_bytes)
        .map_err(|_| Error::Bootstrap {
            detail: format!("rank {from} sent a malformed registration message"),
        })
}

impl<R: GpuRuntime> Group<R> {
    /// Send `items` (this rank's addresses and lengths) and `tag` to every rank; every rank's
    /// message comes back. A rank that cannot export its memory sends why instead, and every
    /// rank then fails with it, so all of them leave the exchange the same way.
    fn share(
        &self,
        boot: &mut dyn Bootstrap,
        items: &[(u64, usize)],
        tag: &[u8],
    ) -> Result<Vec<Shared>> {
        let dev = &self.devices[0];
        let exported: Result<Vec<(Vec<u8>, u64)>> = R::bind(dev).and_then(|()| {
            items
                .iter()
                .map(|&(addr, _)| R::export_address(dev, addr))
                .collect()
        });
        let msg = match &exported {
            Ok(handles) => {
                let mut fields: Vec<Vec<u8>> = vec![vec![1], tag.to_vec()];
                for ((_, bytes), (handle, offset)) in items.iter().zip(handles) {
                    fields.push((*bytes as u64).to_le_bytes().to_vec());
                    fields.push(offset.to_le_bytes().to_vec());
                    fields.push(handle.clone());
                }
                pack(&fields.iter().map(Vec::as_slice).collect::<Vec<_>>())
            }
            Err(e) => pack(&[&[0], e.to_string().as_bytes()]),
        };
        let all = boot.all_gather(&msg)?;
        exported?;
        if all.len() != self.world {
            return Err(Error::Bootstrap {
                detail: format!(
                    "all_gather returned {} messages for {} ranks",
                    all.len(),
                    self.world
                ),
            });
        }
        let mut out = Vec::with_capacity(all.len());
        for (from, msg) in all.iter().enumerate() {
            let mut rest = msg.as_slice();
            let status = field(&mut rest, from)?;
            if status != [1] {
                let why = field(&mut rest, from)?;
                return Err(Error::PeerRejected {
                    rank: from,
                    call: 0,
                    reason: format!(
                        "it could not share its memory: {}",
                        String::from_utf8_lossy(why)
                    ),
                });
            }
            let tag = field(&mut rest, from)?.to_vec();
            let mut items = Vec::new();
            while !rest.is_empty() {
                let bytes = word(field(&mut rest, from)?, from)?;
                let offset = word(field(&mut rest, from)?, from)?;
                let handle = field(&mut rest, from)?.to_vec();
                items.push(SharedItem {
                    bytes,
                    offset,
                    handle,
                });
            }
            out.push(Shared { tag, items });
        }
        Ok(out)
    }

    /// Whether every rank sent as many items as rank 0, of the same lengths.
    fn same_items(all: &[Shared], what: &'static str) -> Result<()> {
        let first = &all[0].items;
        for (r, s) in all.iter().enumerate() {
            if s.items.len() != first.len() {
                return Err(Error::RankMismatch {
                    what,
                    call: 0,
                    detail: format!(
                        "rank 0 has {} to register, rank {r} {}",
                        first.len(),
                        s.items.len()
                    ),
                });
            }
            if let Some(i) = (0..first.len()).find(|&i| s.items[i].bytes != first[i].bytes) {
                return Err(Error::RankMismatch {
                    what,
                    call: 0,
                    detail: format!(
                        "item {i} is {} bytes on rank 0, {} on rank {r}",
                        first[i].bytes, s.items[i].bytes
                    ),
                });
            }
        }
        Ok(())
    }

    /// Every rank's items in this process's address space: `mine` as given for `rank`, the
    /// peers' mapped (once per allocation). `out[k][i]` is rank k's item i.
    fn map_shared(
        &self,
        rank: usize,
        all: &[Shared],
        mine: &[(u64, usize)],
    ) -> Result<Vec<Vec<u64>>> {
        let dev = &self.devices[0];
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::with_capacity(all.len());
        for (k, s) in all.iter().enumerate() {
            if k == rank {
                out.push(mine.iter().map(|&(addr, _)| addr).collect());
                continue;
            }
            let mut addrs = Vec::with_capacity(s.items.len());
            for item in &s.items {
                let base = match mapped.get(&item.handle) {
                    Some(&base) => base,
                    None => {
                        // SAFETY: the handle of a live allocation of a peer of this group,
                        // which keeps it while registered (the caller's contract).
                        let base = unsafe { R::import_memory(dev, &item.handle)? };
                        mapped.insert(item.handle.clone(), base);
                        base
                    }
                };
                addrs.push(base + item.offset);
            }
            out.push(addrs);
        }
        Ok(out)
    }

    /// This process's rank registers `range`: every rank's range mapped here, then recorded
    /// as an in-process registration would be. Every rank must call, in the same order as its
    /// other registrations (ids are counted per process and compared between ranks).
    pub(super) fn register_rank(
        &self,
        rank: usize,
        range: RegisteredRange,
        boot: &mut dyn Bootstrap,
    ) -> Result<RegistrationId> {
        let mine = [(range.addr as u64, range.bytes)];
        let all = self.share(boot, &mine, &[])?;
        Self::same_items(&all, "registered memory")?;
        let addrs = self.map_shared(rank, &all, &mine)?;
        let ranges: Vec<RegisteredRange> = addrs
            .iter()
            .map(|a| RegisteredRange {
                addr: a[0] as usize,
                bytes: range.bytes,
            })
            .collect();
        let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.register(self.world, &ranges)
    }

    /// Fill the rows of the graph slots this process's rank took since its last registration,
    /// with every rank's inputs, exchanged over `boot`. The ranks must have taken the same
    /// slots for inputs of the same lengths; if not, nothing is filled and every rank's next
    /// slot is the largest of them (so later captures line up again).
    pub(super) fn register_graph_slots_rank(
        &self,
        rank: usize,
        boot: &mut dyn Bootstrap,
    ) -> Result<usize> {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let pending = std::mem::take(&mut s.pending[rank]);
        let next = s.next[rank];
        drop(s);
        let mine: Vec<(u64, usize)> = pending.iter().map(|p| (p.addr as u64, p.bytes)).collect();
        // The tag: our next slot (not compared) and the slots taken (compared).
        let mut tag = (next as u64).to_le_bytes().to_vec();
        for p in &pending {
            tag.extend_from_slice(&(p.slot as u64).to_le_bytes());
        }
        let all = self.share(boot, &mine, &tag)?;
        let agreed = Self::same_items(&all, "graph buffers").and_then(|()| {
            match all.iter().position(|s| s.tag.get(8..) != tag.get(8..)) {
                Some(r) => Err(Error::RankMismatch {
                    what: "graph buffers",
                    call: 0,
                    detail: format!("rank {rank} and rank {r} captured different graph slots"),
                }),
                None => Ok(()),
            }
        });
        if agreed.is_err() {
            let most = all
                .iter()
                .filter_map(|s| {
                    s.tag
                        .get(..8)
                        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                })
                .max()
                .unwrap_or(next as u64) as usize;
            let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            s.next[rank] = s.next[rank].max(most);
        }
        agreed?;
        let Some(lo) = pending.first().map(|p| p.slot) else {
            return Ok(0);
        };
        let addrs = self.map_shared(rank, &all, &mine)?;
        let rows = self.slot_rows(pending.len(), |k, i| addrs[k][i]);
        self.write_rows(rank, lo, &rows)?;
        Ok(pending.len())
    }
}
