//! Memory the ranks of a host group share, and the rules that make sharing it sound.
//!
//! Each rank owns one [`Slot`]. A rank writes only its own slot and reads peers' slots only
//! after a barrier that follows their writes; the barrier's mutex gives the happens-before
//! edge. Buffers written before a call's first barrier and read after it (`stage`, `desc`)
//! alternate by call parity: a rank may start call k+1 while a slower peer still reads call
//! k, but it cannot start call k+2 before that peer has reached call k+1's barrier, so two
//! copies suffice (the same argument as vLLM's two alternating counter sets). Buffers written
//! and read between a call's barriers (`reduced`, `qsend`, `qresult`) need one copy.

use std::cell::UnsafeCell;
use std::sync::Mutex;

use allreduce_core::CallDesc;

/// A growable byte buffer with 16-byte alignment that one thread writes and others read,
/// ordered by barriers rather than by the type system.
pub struct SharedBuf(UnsafeCell<Vec<u128>>);

// SAFETY: access follows the owner-writes / peers-read-after-barrier discipline above; the
// methods that touch the contents are unsafe and state it.
unsafe impl Sync for SharedBuf {}

impl SharedBuf {
    pub fn new() -> Self {
        SharedBuf(UnsafeCell::new(Vec::new()))
    }

    /// Make room for `bytes` and return the start.
    ///
    /// # Safety
    /// Only the owning rank calls this, in a phase where no peer reads this buffer.
    pub unsafe fn prepare(&self, bytes: usize) -> *mut u8 {
        let v = &mut *self.0.get();
        let words = bytes.div_ceil(16);
        if v.len() < words {
            v.resize(words, 0);
        }
        v.as_mut_ptr() as *mut u8
    }

    /// # Safety
    /// The owner prepared at least `bytes` in an earlier phase, separated from this read by a
    /// barrier, and does not write the buffer until a later barrier.
    pub unsafe fn read(&self, bytes: usize) -> &[u8] {
        let v = &*self.0.get();
        debug_assert!(v.len() * 16 >= bytes);
        std::slice::from_raw_parts(v.as_ptr() as *const u8, bytes)
    }
}

/// What a rank says it is about to do; all ranks compare these before moving data.
#[derive(Clone, Debug, PartialEq)]
pub enum Desc {
    /// The call, as every backend describes it.
    Call(CallDesc),
    /// The rank's own arguments were invalid (its error message).
    Rejected(String),
}

pub struct Slot {
    pub desc: [Mutex<Option<Desc>>; 2],
    pub stage: [SharedBuf; 2],
    pub reduced: SharedBuf,
    pub qsend: SharedBuf,
    /// The hierarchical path's encoded partial shard, read by the other group's partner.
    pub qpartial: SharedBuf,
    pub qresult: SharedBuf,
}

impl Slot {
    pub fn new() -> Self {
        Slot {
            desc: [Mutex::new(None), Mutex::new(None)],
            stage: [SharedBuf::new(), SharedBuf::new()],
            reduced: SharedBuf::new(),
            qsend: SharedBuf::new(),
            qpartial: SharedBuf::new(),
            qresult: SharedBuf::new(),
        }
    }

    pub fn publish(&self, parity: usize, desc: Desc) {
        *self.desc[parity].lock().unwrap_or_else(|e| e.into_inner()) = Some(desc);
    }

    pub fn desc(&self, parity: usize) -> Option<Desc> {
        self.desc[parity]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
