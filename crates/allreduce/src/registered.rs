//! Collectively allocated registered memory ([`Communicator::alloc_registered_group`]).

use allreduce_core::{
    BufMut, BufRef, DType, Device, Error, RegisteredMemory, RegistrationId, Result,
};

#[cfg(doc)]
use crate::Communicator;

/// One rank's allocation of a registered group allocation. Calls whose input is a view of it
/// (at any 16-byte aligned offset, the same on every rank) read the peers' inputs in place.
/// Dropping it deregisters the group's allocation, then frees this rank's memory; keep it
/// alive until the calls that read it have completed.
#[derive(Debug)]
pub struct RegisteredBuffer {
    mem: RegisteredMemory,
}

impl RegisteredBuffer {
    pub(crate) fn new(mem: RegisteredMemory) -> Self {
        RegisteredBuffer { mem }
    }

    /// The backend's allocation (what backend-specific code fills it through).
    pub fn memory(&self) -> &RegisteredMemory {
        &self.mem
    }

    /// The device address of the first byte.
    pub fn addr(&self) -> usize {
        self.mem.addr
    }

    pub fn bytes(&self) -> usize {
        self.mem.bytes
    }

    pub fn device(&self) -> Device {
        self.mem.device
    }

    pub fn id(&self) -> RegistrationId {
        self.mem.id
    }

    fn range(&self, offset: usize, len: usize, dtype: DType) -> Result<usize> {
        let end = len
            .checked_mul(dtype.size())
            .and_then(|b| b.checked_add(offset))
            .filter(|&end| end <= self.mem.bytes);
        match end {
            Some(_) => Ok(self.mem.addr + offset),
            None => Err(Error::InvalidArgument(format!(
                "{len} {dtype} elements at byte offset {offset} do not fit a registered buffer \
                 of {} bytes",
                self.mem.bytes
            ))),
        }
    }

    /// `len` elements of `dtype` from byte `offset`, to read (a call's input).
    pub fn view(&self, offset: usize, len: usize, dtype: DType) -> Result<BufRef<'_>> {
        let addr = self.range(offset, len, dtype)?;
        // SAFETY: inside this live allocation, borrowed for the view's lifetime.
        Ok(unsafe { BufRef::from_raw(addr, len, dtype, self.mem.device) })
    }

    /// `len` elements of `dtype` from byte `offset`, to write (fill it, or an in-place call).
    pub fn view_mut(&mut self, offset: usize, len: usize, dtype: DType) -> Result<BufMut<'_>> {
        let addr = self.range(offset, len, dtype)?;
        // SAFETY: inside this live allocation, borrowed mutably for the view's lifetime.
        Ok(unsafe { BufMut::from_raw(addr, len, dtype, self.mem.device) })
    }
}
