//! Collectively allocated registered memory ([`Communicator::alloc_registered_group`]).

use allreduce_core::{
    BufMut, BufRef, DType, Device, Error, Fp8BufMut, MemoryOp, RegisteredMemory, RegistrationId,
    Result,
};

#[cfg(doc)]
use crate::Communicator;

/// One rank's allocation of a registered group allocation: device memory (host memory on the
/// host backend) for callers who do not bring their own. Calls whose input is a view of it
/// (at any 16-byte aligned offset, the same on every rank) read the peers' inputs in place.
/// [`upload`](Self::upload), [`download`](Self::download), [`fill`](Self::fill) and
/// [`copy_from`](Self::copy_from) move bytes synchronously (complete on return, on a stream
/// of their own): synchronize the stream of any call that touches the same bytes first.
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

    /// Copy `src` into the buffer from byte `offset`.
    pub fn upload(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.mem.apply(MemoryOp::Upload { offset, src })
    }

    /// Copy the buffer from byte `offset` into `dst`.
    pub fn download(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.mem.apply(MemoryOp::Download { offset, dst })
    }

    /// Set `bytes` bytes from `offset` to `value`.
    pub fn fill(&mut self, offset: usize, bytes: usize, value: u8) -> Result<()> {
        self.mem.apply(MemoryOp::Fill {
            offset,
            bytes,
            value,
        })
    }

    /// Copy `bytes` of `src` from `src_offset` into the buffer at `offset`, on the device (the
    /// same backend and device).
    pub fn copy_from(
        &mut self,
        offset: usize,
        src: &RegisteredBuffer,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        self.mem.apply(MemoryOp::Copy {
            offset,
            src: &src.mem,
            src_offset,
            bytes,
        })
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

    /// `len` FP8 codes (one byte each) from byte `offset`, for a fused call's `quant_out`
    /// (`FusedArgs::fp8`, `fp8_static`), so library memory serves the FP8 patterns too.
    pub fn fp8_view_mut(&mut self, offset: usize, len: usize) -> Result<Fp8BufMut<'_>> {
        let end = offset.checked_add(len).filter(|&end| end <= self.mem.bytes);
        if end.is_none() {
            return Err(Error::InvalidArgument(format!(
                "{len} FP8 codes at byte offset {offset} do not fit a registered buffer of {} \
                 bytes",
                self.mem.bytes
            )));
        }
        // SAFETY: inside this live allocation, borrowed mutably for the view's lifetime.
        Ok(unsafe { Fp8BufMut::from_raw(self.mem.addr + offset, len, self.mem.device) })
    }
}
