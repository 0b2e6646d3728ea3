//! Registered memory: ranges every rank of a group has declared, so that peers may read a
//! call's inputs where they are instead of from a staged copy (vLLM's `register_buffer`,
//! NCCL's windows). A registration holds one range per rank, all of the same length; a call
//! whose input lies inside this rank's range at offset `o` finds each peer's input at that
//! peer's base + `o`.
//!
//! The [`Registry`] is the bookkeeping every backend shares: validation, ids, lookup. What a
//! registration makes a backend do is the backend's (the host backend: nothing).

use std::any::Any;

use crate::{Device, Error, Result};

/// Names a registration of one group; never reused within the group while it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegistrationId(pub u64);

/// One rank's range of a registration: a device address and its length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegisteredRange {
    pub addr: usize,
    pub bytes: usize,
}

/// Where a call's input lies in a registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredInput {
    pub id: RegistrationId,
    /// Byte offset of the input in this rank's range, the same in every rank's.
    pub offset: usize,
    /// Every rank's base, in rank order.
    pub bases: Vec<usize>,
}

/// The registrations of one group.
#[derive(Debug, Default)]
pub struct Registry {
    // Ids only grow: a stale id held by a caller never names a later registration.
    next: u64,
    entries: Vec<(RegistrationId, Vec<RegisteredRange>)>,
}

/// Whether `call` reads the peers' inputs where they are when its input lies in registered
/// memory: out of place, exact, one-shot or two-shot, and at least `min_bytes` (the group's
/// `GroupConfig::registered_min_bytes`). Other calls stage their input whatever memory it is
/// in. Every backend decides it so, since the path is part of what ranks agree on.
pub fn reads_in_place(call: &crate::Call, min_bytes: usize) -> bool {
    !call.in_place()
        && call.precision == crate::Precision::Exact
        && matches!(
            call.strategy,
            crate::Strategy::OneShot | crate::Strategy::TwoShot
        )
        && call.input.bytes() >= min_bytes
}

/// Ranges start on this boundary, so an input's offset is 16-byte aligned on every rank
/// exactly when it is on one (the kernels read 16-byte vectors).
pub const REGISTRATION_ALIGN: usize = 16;

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record `ranges` (element r is rank r's) for a group of `world` ranks.
    pub fn register(&mut self, world: usize, ranges: &[RegisteredRange]) -> Result<RegistrationId> {
        if ranges.len() != world {
            return Err(Error::InvalidArgument(format!(
                "a registration needs one range per rank: {} given for {world} ranks",
                ranges.len()
            )));
        }
        let bytes = ranges[0].bytes;
        for (r, range) in ranges.iter().enumerate() {
            if range.bytes == 0 || range.bytes != bytes {
                return Err(Error::InvalidArgument(format!(
                    "registered ranges must be non-empty and of one length: rank 0 has {bytes} \
                     bytes, rank {r} {}",
                    range.bytes
                )));
            }
            if range.addr == 0 || range.addr % REGISTRATION_ALIGN != 0 {
                return Err(Error::Misaligned {
                    addr: range.addr,
                    align: REGISTRATION_ALIGN,
                });
            }
            if range.addr.checked_add(range.bytes).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "rank {r}'s range at {:#x} of {} bytes wraps the address space",
                    range.addr, range.bytes
                )));
            }
        }
        self.next += 1;
        let id = RegistrationId(self.next);
        self.entries.push((id, ranges.to_vec()));
        Ok(id)
    }

    /// Forget `id`. An id this registry does not hold (never made, or already removed) is an
    /// error.
    pub fn deregister(&mut self, id: RegistrationId) -> Result<()> {
        match self.entries.iter().position(|(i, _)| *i == id) {
            Some(i) => {
                self.entries.remove(i);
                Ok(())
            }
            None => Err(Error::InvalidArgument(format!(
                "registration {} is not registered with this group",
                id.0
            ))),
        }
    }

    /// The registration whose range of `rank` holds all of `[addr, addr + bytes)`, if any
    /// (the earliest, where ranges overlap). Empty inputs are never registered ones.
    pub fn find(&self, rank: usize, addr: usize, bytes: usize) -> Option<RegisteredInput> {
        if bytes == 0 {
            return None;
        }
        self.entries.iter().find_map(|(id, ranges)| {
            let mine = ranges.get(rank)?;
            let offset = addr.checked_sub(mine.addr)?;
            (offset.checked_add(bytes)? <= mine.bytes).then(|| RegisteredInput {
                id: *id,
                offset,
                bases: ranges.iter().map(|r| r.addr).collect(),
            })
        })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Removes a registration from a shared registry when dropped (a no-op when it is gone
/// already): what [`RegisteredMemory::owner`] drops first.
pub struct Deregister {
    pub registry: std::sync::Arc<std::sync::Mutex<Registry>>,
    pub id: RegistrationId,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let _ = reg.deregister(self.id);
    }
}

/// One rank's memory from a collective registered allocation
/// (`BackendComm::alloc_registered_group`): its address, length and device, and what owns it.
/// Dropping it deregisters the allocation from the group (once: the first rank's drop does it
/// for all) and then frees this rank's memory, so no later call finds a freed range.
pub struct RegisteredMemory {
    pub addr: usize,
    pub bytes: usize,
    pub device: Device,
    pub id: RegistrationId,
    /// Deregisters on drop, then frees (the backend's types, in that order), and carries out
    /// copies and fills on the memory.
    pub owner: Box<dyn MemoryOwner>,
}

/// A copy or fill on one rank's registered memory, at byte offsets into it.
#[derive(Debug)]
pub enum MemoryOp<'a> {
    /// `src` to the memory at `offset`.
    Upload { offset: usize, src: &'a [u8] },
    /// The memory at `offset` into `dst`.
    Download { offset: usize, dst: &'a mut [u8] },
    /// `bytes` bytes of `value` from `offset`.
    Fill {
        offset: usize,
        bytes: usize,
        value: u8,
    },
    /// `bytes` from `src` at `src_offset` to the memory at `offset` (the same backend and
    /// device; `src` may be this memory if the ranges do not overlap).
    Copy {
        offset: usize,
        src: &'a RegisteredMemory,
        src_offset: usize,
        bytes: usize,
    },
}

/// What owns a rank's registered memory: the backend's allocation and its deregistration.
pub trait MemoryOwner: Any + Send + Sync {
    /// Carry out `op`, complete on return (ranges already checked by
    /// [`RegisteredMemory::apply`]). `mem` is the memory this owner owns.
    fn apply(&self, mem: &RegisteredMemory, op: MemoryOp<'_>) -> Result<()>;
    /// For a backend to find its own type behind another owner (a copy's source).
    fn as_any(&self) -> &dyn Any;
}

impl RegisteredMemory {
    /// `len` bytes from `offset` lie inside this memory, or an `InvalidArgument` naming `what`.
    pub fn check_range(&self, offset: usize, len: usize, what: &str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "{what}: {len} bytes at offset {offset} do not fit a registered allocation of {} \
                 bytes",
                self.bytes
            ))),
        }
    }

    /// Carry out `op` on this memory, synchronously: on return the bytes are in place (a
    /// download: in `dst`). Not ordered with any stream: a caller who enqueued work that reads
    /// or writes the same bytes synchronizes that stream first. A range past the end, an
    /// overlapping copy or a copy across devices is an `InvalidArgument`, nothing touched.
    pub fn apply(&self, op: MemoryOp<'_>) -> Result<()> {
        match &op {
            MemoryOp::Upload { offset, src } => self.check_range(*offset, src.len(), "upload")?,
            MemoryOp::Download { offset, dst } => {
                self.check_range(*offset, dst.len(), "download")?
            }
            MemoryOp::Fill { offset, bytes, .. } => self.check_range(*offset, *bytes, "fill")?,
            MemoryOp::Copy {
                offset,
                src,
                src_offset,
                bytes,
            } => {
                self.check_range(*offset, *bytes, "copy destination")?;
                src.check_range(*src_offset, *bytes, "copy source")?;
                if src.device != self.device {
                    return Err(Error::InvalidArgument(format!(
                        "copy from {:?} memory to {:?} memory: one device only",
                        src.device, self.device
                    )));
                }
                let (d, s) = (self.addr + offset, src.addr + src_offset);
                if *bytes > 0 && d < s + bytes && s < d + bytes {
                    return Err(Error::InvalidArgument(
                        "copy between overlapping ranges".into(),
                    ));
                }
            }
        }
        self.owner.apply(self, op)
    }
}

impl std::fmt::Debug for RegisteredMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredMemory")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("bytes", &self.bytes)
            .field("device", &self.device)
            .field("id", &self.id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(addr: usize, bytes: usize) -> RegisteredRange {
        RegisteredRange { addr, bytes }
    }

    #[test]
    fn finds_inputs_inside_this_ranks_range_at_the_same_offset() {
        let mut reg = Registry::new();
        let id = reg
            .register(2, &[range(0x1000, 256), range(0x9000, 256)])
            .unwrap();
        let hit = reg.find(1, 0x9010, 64).unwrap();
        assert_eq!(hit.id, id);
        assert_eq!(hit.offset, 16);
        assert_eq!(hit.bases, vec![0x1000, 0x9000]);
        assert_eq!(reg.find(0, 0x1000, 256).unwrap().offset, 0);
        // Past the end, before the start, another rank's range, empty.
        assert!(reg.find(0, 0x1010, 256).is_none());
        assert!(reg.find(0, 0xff0, 32).is_none());
        assert!(reg.find(0, 0x9000, 16).is_none());
        assert!(reg.find(0, 0x1000, 0).is_none());
    }

    #[test]
    fn refuses_wrong_counts_lengths_and_alignment() {
        let mut reg = Registry::new();
        assert!(reg.register(2, &[range(0x1000, 256)]).is_err());
        assert!(reg
            .register(2, &[range(0x1000, 256), range(0x2000, 128)])
            .is_err());
        assert!(reg
            .register(2, &[range(0x1000, 0), range(0x2000, 0)])
            .is_err());
        assert!(matches!(
            reg.register(2, &[range(0x1008, 256), range(0x2000, 256)]),
            Err(Error::Misaligned { .. })
        ));
        assert!(reg.is_empty());
    }

    #[test]
    fn deregistration_forgets_and_ids_are_not_reused() {
        let mut reg = Registry::new();
        let a = reg.register(1, &[range(0x1000, 64)]).unwrap();
        reg.deregister(a).unwrap();
        assert!(reg.find(0, 0x1000, 16).is_none());
        assert!(reg.deregister(a).is_err());
        let b = reg.register(1, &[range(0x1000, 64)]).unwrap();
        assert_ne!(a, b);
    }
}
