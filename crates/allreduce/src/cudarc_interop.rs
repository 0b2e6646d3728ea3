//! The `cudarc` feature: calls on what a Rust engine holds (cudarc 0.19 buffers and streams),
//! not on raw pointers taken out of them.
//!
//! Addresses come from cudarc's `device_ptr` / `device_ptr_mut` on the call's stream: cudarc
//! makes the stream wait for the buffer's last writer (and, for an output, its readers), and
//! when the guard drops after our kernel is enqueued, records the call as the buffer's latest
//! use. So a later cudarc launch on another stream waits for the all-reduce, as it would for
//! any cudarc kernel.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::{
    AllReduceOptions, BackendKind, BufMut, BufRef, Communicator, Device, Element, FusedArgs,
    FusedPattern, FusedWorkspace, GroupConfig, Result, Strategy, Stream,
};

/// The element types both libraries carry: f32, `half::f16`, `half::bf16`.
pub trait CudarcElement: Element + DeviceRepr {}
impl CudarcElement for f32 {}
impl CudarcElement for half::f16 {}
impl CudarcElement for half::bf16 {}

fn on(stream: &CudaStream, options: &AllReduceOptions) -> (Device, AllReduceOptions) {
    let device = Device::Cuda(stream.context().ordinal() as u32);
    let raw = Stream::from_raw(stream.cu_stream() as *mut std::ffi::c_void);
    (device, options.stream(raw))
}

impl Communicator {
    /// One communicator per rank of an in-process group on the devices of `contexts` (rank r
    /// on `contexts[r]`'s GPU; a context may repeat for several ranks on one GPU), on the CUDA
    /// backend. `config.world_size` must equal `contexts.len()`.
    pub fn new_group_cudarc(
        contexts: &[Arc<CudaContext>],
        config: GroupConfig,
    ) -> Result<Vec<Communicator>> {
        let devices = contexts.iter().map(|c| c.ordinal() as u32).collect();
        Communicator::new_group(BackendKind::Cuda, config.devices(devices))
    }

    /// [`Communicator::all_reduce`] from `input` into `output` (a `CudaSlice<T>`, a
    /// `CudaView<T>` or `CudaViewMut<T>`), on `stream`, which must be on this rank's device
    /// (otherwise `Error::WrongDevice`). `options.stream` is replaced by `stream`.
    pub fn all_reduce_cudarc<T: CudarcElement>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        options: &AllReduceOptions,
    ) -> Result<Strategy> {
        let (device, options) = on(stream, options);
        let (n_in, n_out) = (input.len(), output.len());
        let (src, _read) = input.device_ptr(stream);
        let (dst, _write) = output.device_ptr_mut(stream);
        // SAFETY: cudarc's addresses of `len` elements of T, alive at least until the guards
        // drop, which is after the call is enqueued on `stream` (the guards then record it).
        let (i, o) = unsafe {
            (
                BufRef::from_raw(src as usize, n_in, T::DTYPE, device),
                BufMut::from_raw(dst as usize, n_out, T::DTYPE, device),
            )
        };
        self.all_reduce(i, o, &options)
    }

    /// [`Communicator::all_reduce_in_place`] on a cudarc buffer, as
    /// [`Communicator::all_reduce_cudarc`].
    pub fn all_reduce_cudarc_in_place<T: CudarcElement>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
        options: &AllReduceOptions,
    ) -> Result<Strategy> {
        let (device, options) = on(stream, options);
        let n = buf.len();
        let (ptr, _write) = buf.device_ptr_mut(stream);
        // SAFETY: as in all_reduce_cudarc.
        let b = unsafe { BufMut::from_raw(ptr as usize, n, T::DTYPE, device) };
        self.all_reduce_in_place(b, &options)
    }

    /// The all-reduce fused with the residual add and the RMSNorm
    /// ([`Communicator::all_reduce_fused`], `FusedPattern::ResidualRmsNorm`) on cudarc
    /// buffers: with `a` the sum over the ranks of `x` (`tokens` rows of `ws`'s hidden size),
    /// `residual_out = a + residual` and `norm_out = residual_out / rms(residual_out) * gamma`,
    /// enqueued on `stream`. `ws` is this rank's workspace (`FusedWorkspace::create_group`).
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm_cudarc<T: CudarcElement>(
        &self,
        ws: &FusedWorkspace,
        tokens: usize,
        x: &impl DevicePtr<T>,
        residual: &impl DevicePtr<T>,
        gamma: &impl DevicePtr<T>,
        eps: f32,
        residual_out: &mut impl DevicePtrMut<T>,
        norm_out: &mut impl DevicePtrMut<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<Strategy> {
        let (device, options) = on(stream, &AllReduceOptions::default());
        let lens = [
            x.len(),
            residual.len(),
            gamma.len(),
            residual_out.len(),
            norm_out.len(),
        ];
        let (x, _x) = x.device_ptr(stream);
        let (r, _r) = residual.device_ptr(stream);
        let (g, _g) = gamma.device_ptr(stream);
        let (ro, _ro) = residual_out.device_ptr_mut(stream);
        let (no, _no) = norm_out.device_ptr_mut(stream);
        // SAFETY: as in all_reduce_cudarc; the library checks every length against `tokens`
        // and the workspace's hidden size before enqueuing anything.
        let (x, r, g, ro, no) = unsafe {
            (
                BufRef::from_raw(x as usize, lens[0], T::DTYPE, device),
                BufRef::from_raw(r as usize, lens[1], T::DTYPE, device),
                BufRef::from_raw(g as usize, lens[2], T::DTYPE, device),
                BufMut::from_raw(ro as usize, lens[3], T::DTYPE, device),
                BufMut::from_raw(no as usize, lens[4], T::DTYPE, device),
            )
        };
        let args = FusedArgs::new(FusedPattern::ResidualRmsNorm, tokens, x)
            .residual(r, Some(ro))
            .rms_norm(g, eps, Some(no))
            .stream(options.stream);
        self.all_reduce_fused(ws, args)
    }
}
