//! Kernels of the backend's main module that are not the collective: the roofline copy
//! (`ar_copy_f32x4`), a baseline measured in the same run as the all-reduce, and the codec
//! segment kernels (`ar_encode_*` / `ar_decode_*`, kernels-common quantized.h), which the
//! bit-exactness tests compare with the Rust reference and the bench times.

use allreduce_core::{Codec, DType, Error, Result};

use super::{DeviceBuffer, GpuDevice, GpuStream};
use crate::kernels::{self, Kernel};
use crate::GpuRuntime;

/// The roofline copy kernel: a plain device copy, and a bare launch.
pub struct CopyKernel<R: GpuRuntime> {
    f: R::Function,
    _module: R::Module,
}

impl<R: GpuRuntime> CopyKernel<R> {
    /// Load on `dev`.
    pub fn load(dev: &GpuDevice<R>) -> Result<Self> {
        let module = R::load_module(dev.raw())?;
        let f = kernels::function::<R>(&module, Kernel::Copy)?;
        Ok(CopyKernel { f, _module: module })
    }

    /// Copy `bytes` (a multiple of 16) from `src` to `dst` on `stream` with `grid` x 512
    /// threads; 0 bytes is a launch that touches no memory.
    pub fn copy(
        &self,
        src: &DeviceBuffer<R>,
        dst: &DeviceBuffer<R>,
        bytes: usize,
        grid: u32,
        stream: &GpuStream<R>,
    ) -> Result<()> {
        if bytes % 16 != 0 || bytes > src.len() || bytes > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "the copy kernel moves whole 16-byte vectors within both buffers: {bytes} bytes \
                 from {} into {}",
                src.len(),
                dst.len()
            )));
        }
        let words = [src.addr() as u64, dst.addr() as u64, (bytes / 16) as u64];
        // SAFETY: the kernel takes (src, dst, n_vec), three 8-byte parameters; bounds checked.
        unsafe { R::launch_words(self.f, grid, 512, stream.handle(), &words) }
    }
}

/// Element types the segment kernels are built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodecInput {
    F32,
    Bf16,
}

impl CodecInput {
    pub fn size(self) -> usize {
        match self {
            CodecInput::F32 => 4,
            CodecInput::Bf16 => 2,
        }
    }
}

/// One segment kernel launch: `n` elements of `input` through `codec`, `grid` blocks of 512.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub input: CodecInput,
    pub codec: Codec,
    pub n: usize,
    pub grid: u32,
}

/// One buffer encoded into one segment of the codec format (docs/codecs.md) and back.
pub struct CodecKernels<R: GpuRuntime> {
    /// `[f32, bf16][codec index in Codec::ALL][encode, decode]`.
    f: Vec<[[R::Function; 2]; 2]>,
    _module: R::Module,
}

/// kernels-common's CodecArgs.
#[repr(C)]
struct CodecArgs {
    src: u64,
    dst: u64,
    n: u64,
}

impl<R: GpuRuntime> CodecKernels<R> {
    /// Load on `dev`.
    pub fn load(dev: &GpuDevice<R>) -> Result<Self> {
        let module = R::load_module(dev.raw())?;
        let mut f = Vec::with_capacity(Codec::ALL.len());
        for codec in Codec::ALL {
            let [ef, df, eb, db] = kernels::functions::<R, 4>(
                &module,
                [
                    Kernel::Encode(DType::F32, codec),
                    Kernel::Decode(DType::F32, codec),
                    Kernel::Encode(DType::BF16, codec),
                    Kernel::Decode(DType::BF16, codec),
                ],
            )?;
            f.push([[ef, df], [eb, db]]);
        }
        Ok(CodecKernels { f, _module: module })
    }

    fn launch(
        &self,
        job: Segment,
        dir: usize,
        src: usize,
        dst: usize,
        stream: &GpuStream<R>,
    ) -> Result<()> {
        let c = Codec::ALL
            .iter()
            .position(|&x| x == job.codec)
            .expect("every codec is listed");
        let t = match job.input {
            CodecInput::F32 => 0,
            CodecInput::Bf16 => 1,
        };
        let args = CodecArgs {
            src: src as u64,
            dst: dst as u64,
            n: job.n as u64,
        };
        // SAFETY: one 24-byte parameter, kernels-common's CodecArgs; the callers checked the
        // buffer sizes, and the buffers outlive the launch in stream order.
        unsafe { R::launch(self.f[c][t][dir], job.grid, 512, stream.handle(), &args) }
    }

    fn check(job: Segment, plain: &DeviceBuffer<R>, coded: &DeviceBuffer<R>) -> Result<()> {
        let (p, e) = (job.n * job.input.size(), job.codec.encoded_len(job.n));
        if p > plain.len() || e > coded.len() {
            return Err(Error::InvalidArgument(format!(
                "a segment of {} {:?} elements through {} needs {p} and {e} bytes, the buffers \
                 hold {} and {}",
                job.n,
                job.input,
                job.codec,
                plain.len(),
                coded.len()
            )));
        }
        Ok(())
    }

    /// Encode `job.n` elements of `src` into one segment at `dst`, which must hold
    /// `codec.encoded_len(n)` bytes (padding bytes are left as they were).
    pub fn encode(
        &self,
        job: Segment,
        src: &DeviceBuffer<R>,
        dst: &DeviceBuffer<R>,
        stream: &GpuStream<R>,
    ) -> Result<()> {
        Self::check(job, src, dst)?;
        self.launch(job, 0, src.addr(), dst.addr(), stream)
    }

    /// Decode one segment of `job.n` elements at `src` into `dst`.
    pub fn decode(
        &self,
        job: Segment,
        src: &DeviceBuffer<R>,
        dst: &DeviceBuffer<R>,
        stream: &GpuStream<R>,
    ) -> Result<()> {
        Self::check(job, dst, src)?;
        self.launch(job, 1, src.addr(), dst.addr(), stream)
    }
}
