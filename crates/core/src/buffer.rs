//! Backend-neutral views of caller memory.
//!
//! A view is an address, an element count, a dtype and the device the memory lives on: the
//! same shape as a CUDA/HIP device pointer, so GPU callers hand over `CUdeviceptr`s without a
//! copy, and host callers hand over slices. The lifetime ties a view to the borrow it came
//! from; raw views promise (unsafely) that the memory outlives the call and, on GPUs, every
//! stream operation the call enqueues.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;

use crate::{DType, Element};

/// Where memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Host,
    Cuda(u32),
    Rocm(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Rocm(i) => write!(f, "rocm:{i}"),
        }
    }
}

/// A raw stream handle (`CUstream` / `hipStream_t`). The null handle is the legacy default
/// stream on GPUs and is what the host backend expects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Stream(usize);

impl Stream {
    pub const NULL: Stream = Stream(0);

    pub fn from_raw(handle: *mut c_void) -> Self {
        Stream(handle as usize)
    }

    pub fn as_raw(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

/// Address, length, dtype and device of a buffer, with no lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBuffer {
    pub addr: usize,
    pub len: usize,
    pub dtype: DType,
    pub device: Device,
}

impl RawBuffer {
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// Whether `[addr, addr+bytes)` of the two buffers intersect (empty buffers never do).
    pub fn overlaps(&self, other: &RawBuffer) -> bool {
        self.device == other.device
            && self.bytes() > 0
            && other.bytes() > 0
            && self.addr < other.addr + other.bytes()
            && other.addr < self.addr + self.bytes()
    }
}

/// A read-only buffer for the duration of `'a`.
#[derive(Clone, Copy, Debug)]
pub struct BufRef<'a> {
    raw: RawBuffer,
    _borrow: PhantomData<&'a [u8]>,
}

/// A writable buffer for the duration of `'a`.
#[derive(Debug)]
pub struct BufMut<'a> {
    raw: RawBuffer,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> BufRef<'a> {
    pub fn from_slice<T: Element>(s: &'a [T]) -> Self {
        Self::wrap(RawBuffer {
            addr: s.as_ptr() as usize,
            len: s.len(),
            dtype: T::DTYPE,
            device: Device::Host,
        })
    }

    /// # Safety
    /// `addr` must point to `len` elements of `dtype` on `device`, readable until every
    /// operation enqueued with this view has completed.
    pub unsafe fn from_raw(addr: usize, len: usize, dtype: DType, device: Device) -> Self {
        Self::wrap(RawBuffer {
            addr,
            len,
            dtype,
            device,
        })
    }

    fn wrap(raw: RawBuffer) -> Self {
        BufRef {
            raw,
            _borrow: PhantomData,
        }
    }

    pub fn raw(&self) -> RawBuffer {
        self.raw
    }
    pub fn len(&self) -> usize {
        self.raw.len
    }
    pub fn is_empty(&self) -> bool {
        self.raw.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.raw.dtype
    }
    pub fn device(&self) -> Device {
        self.raw.device
    }
}

impl<'a> BufMut<'a> {
    pub fn from_slice<T: Element>(s: &'a mut [T]) -> Self {
        Self::wrap(RawBuffer {
            addr: s.as_mut_ptr() as usize,
            len: s.len(),
            dtype: T::DTYPE,
            device: Device::Host,
        })
    }

    /// # Safety
    /// `addr` must point to `len` elements of `dtype` on `device`, writable and not aliased by
    /// anything else until every operation enqueued with this view has completed.
    pub unsafe fn from_raw(addr: usize, len: usize, dtype: DType, device: Device) -> Self {
        Self::wrap(RawBuffer {
            addr,
            len,
            dtype,
            device,
        })
    }

    fn wrap(raw: RawBuffer) -> Self {
        BufMut {
            raw,
            _borrow: PhantomData,
        }
    }

    pub fn raw(&self) -> RawBuffer {
        self.raw
    }
    pub fn len(&self) -> usize {
        self.raw.len
    }
    pub fn is_empty(&self) -> bool {
        self.raw.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.raw.dtype
    }
    pub fn device(&self) -> Device {
        self.raw.device
    }
}

/// Host memory as raw bytes, aligned for any dtype. Used by tests and the bench to hold
/// rank data, and by the host backend for its workspace.
#[derive(Clone)]
pub struct HostBytes {
    words: Vec<u128>,
    len: usize,
}

impl HostBytes {
    pub fn zeroed(len: usize) -> Self {
        HostBytes {
            words: vec![0; len.div_ceil(16)],
            len,
        }
    }

    pub fn from_bytes(b: &[u8]) -> Self {
        let mut h = Self::zeroed(b.len());
        h.as_mut_slice().copy_from_slice(b);
        h
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the Vec<u128> holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }

    /// View as `len / dtype.size()` elements of `dtype` on the host.
    pub fn view(&self, dtype: DType) -> BufRef<'_> {
        BufRef::wrap(RawBuffer {
            addr: self.words.as_ptr() as usize,
            len: self.len / dtype.size(),
            dtype,
            device: Device::Host,
        })
    }

    pub fn view_mut(&mut self, dtype: DType) -> BufMut<'_> {
        BufMut::wrap(RawBuffer {
            addr: self.words.as_mut_ptr() as usize,
            len: self.len / dtype.size(),
            dtype,
            device: Device::Host,
        })
    }
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len)
    }
}
