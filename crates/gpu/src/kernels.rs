//! Every kernel the backends compile, in one table: its symbol, the module it lives in, and the
//! template instance of kernels-common it runs. The engine asks this table for the names it
//! looks up ([`Kernel::name`]); the instance lists nvcc and the HIP compiler build
//! (`kernels-cuda/*_kernels.inc`, `kernels-hip/*_kernels.inc`) are rendered from it
//! ([`instance_list`]) and checked in, with a test that they are current; the compile tests
//! check that every kernel of the table is exported. A kernel added here is compiled, looked
//! up and checked everywhere, or a test says where it is missing.
//!
//! The symbols are part of the backends' contract with their embedded code objects: a name
//! changed here changes what an older build looks up.

use std::ffi::CString;

use crate::GpuRuntime;
use allreduce_core::{Codec, DType, Error, Result};

/// The two code objects a backend loads: the all-reduce kernels and the fused all-reduce +
/// residual + RMSNorm ([`crate::GpuRuntime::load_fused_module`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// `allreduce.cu` / `allreduce.hip`.
    AllReduce,
    /// `fused.cu` / `fused.hip`.
    Fused,
}

impl Module {
    pub const ALL: [Module; 2] = [Module::AllReduce, Module::Fused];

    /// The stem of its source (`kernels-cuda/<stem>.cu`, `kernels-hip/<stem>.hip`) and of its
    /// generated instance list (`<stem>_kernels.inc` beside it).
    pub const fn stem(self) -> &'static str {
        match self {
            Module::AllReduce => "allreduce",
            Module::Fused => "fused",
        }
    }
}

/// Whose compiler builds a list: the vendors' lists differ only in which fused instances they
/// hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Vendor {
    Cuda,
    Hip,
}

impl Vendor {
    pub const ALL: [Vendor; 2] = [Vendor::Cuda, Vendor::Hip];

    /// The directory of its sources and instance lists, from the workspace root.
    pub const fn source_dir(self) -> &'static str {
        match self {
            Vendor::Cuda => "kernels-cuda",
            Vendor::Hip => "kernels-hip",
        }
    }

    /// The world sizes its fused module has specialised instances for (`_w2`, ...), besides
    /// the generic `_w0`: its runtime's [`crate::GpuRuntime::FUSED_WORLDS`]. HIP has none
    /// yet: each would add about 80 s per target to a two-core build, for code never yet run
    /// on AMD hardware.
    pub const fn fused_worlds(self) -> &'static [usize] {
        match self {
            Vendor::Cuda => &[2, 4, 8],
            Vendor::Hip => &[],
        }
    }

    /// Whether its fused module holds the split one-shot, which needs thread-block clusters
    /// (CUDA sm_90 and later).
    pub const fn has_split(self) -> bool {
        matches!(self, Vendor::Cuda)
    }
}

/// One kernel: which body of kernels-common it runs, instantiated for what.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `oneshot<T>` (exact.h).
    OneShot(DType),
    /// `twoshot<T>` (exact.h).
    TwoShot(DType),
    /// `oneshot_registered<T>` (exact.h): one-shot reading registered inputs in place.
    OneShotRegistered(DType),
    /// `twoshot_registered<T>` (exact.h).
    TwoShotRegistered(DType),
    /// `copy_vectors` (exact.h): the roofline the bench compares against.
    Copy,
    /// `quantized_twoshot<T, C>` (quantized.h), f16 and bf16.
    Quantized(DType, Codec),
    /// `hierarchical_quantized<T, C>` (hierarchical.h), f16 and bf16.
    Hierarchical(DType, Codec),
    /// `encode_segment<T, C>` (quantized.h), f32 and bf16: the codec tests and bench.
    Encode(DType, Codec),
    /// `decode_segment<T, C>` (quantized.h), f32 and bf16.
    Decode(DType, Codec),
    /// `fused::oneshot<T, W>` (fused.h); world 0 is the generic instance.
    FusedOneShot(DType, usize),
    /// `fused::twoshot<T, W>`.
    FusedTwoShot(DType, usize),
    /// `fused::oneshot_split<T, W>`, launched in clusters.
    FusedOneShotSplit(DType, usize),
    /// `fused::norm_only<T>`: the unfused baseline's residual + RMSNorm.
    RmsNorm(DType),
    /// `fused::push_oneshot<T, W>` (push.h): the plain exact all-reduce by push
    /// (`Strategy::PushOneShot`); world 0 is the generic instance.
    PushOneShot(DType, usize),
}

/// The element types the codec kernels carry (the codecs are for 16-bit traffic).
const CODEC_DTYPES: [DType; 2] = [DType::F16, DType::BF16];
/// The element types of the codec segment kernels: f32 for the host reference's own
/// arithmetic, bf16 for a model's.
const SEGMENT_DTYPES: [DType; 2] = [DType::F32, DType::BF16];

impl Kernel {
    /// The exported symbol, as the engine looks it up.
    pub fn name(self) -> String {
        use Kernel::*;
        match self {
            OneShot(d) => format!("ar_oneshot_{}", d.name()),
            TwoShot(d) => format!("ar_twoshot_{}", d.name()),
            OneShotRegistered(d) => format!("ar_oneshot_registered_{}", d.name()),
            TwoShotRegistered(d) => format!("ar_twoshot_registered_{}", d.name()),
            Copy => "ar_copy_f32x4".into(),
            Quantized(d, c) => format!("ar_quantized_{}_{}", d.name(), c.name()),
            Hierarchical(d, c) => format!("ar_hierarchical_{}_{}", d.name(), c.name()),
            Encode(d, c) => format!("ar_encode_{}_{}", d.name(), c.name()),
            Decode(d, c) => format!("ar_decode_{}_{}", d.name(), c.name()),
            FusedOneShot(d, w) => format!("ar_fused_oneshot_{}_w{w}", d.name()),
            FusedTwoShot(d, w) => format!("ar_fused_twoshot_{}_w{w}", d.name()),
            FusedOneShotSplit(d, w) => format!("ar_fused_oneshot_split_{}_w{w}", d.name()),
            RmsNorm(d) => format!("ar_rmsnorm_{}", d.name()),
            PushOneShot(d, w) => format!("ar_push_oneshot_{}_w{w}", d.name()),
        }
    }

    pub fn module(self) -> Module {
        use Kernel::*;
        match self {
            OneShot(_) | TwoShot(_) | OneShotRegistered(_) | TwoShotRegistered(_) | Copy
            | Quantized(..) | Hierarchical(..) | Encode(..) | Decode(..) => Module::AllReduce,
            FusedOneShot(..)
            | FusedTwoShot(..)
            | FusedOneShotSplit(..)
            | RmsNorm(_)
            | PushOneShot(..) => Module::Fused,
        }
    }

    /// Whether the engine (group.rs, fused.rs) looks it up; the others serve the bench and
    /// the codec tests.
    pub fn engine(self) -> bool {
        !matches!(self, Kernel::Copy | Kernel::Encode(..) | Kernel::Decode(..))
    }
}

/// Every kernel `vendor` compiles into `module`, in the order of its instance list.
pub fn kernels(vendor: Vendor, module: Module) -> Vec<Kernel> {
    let mut out = Vec::new();
    match module {
        // The order the sources listed them in before there was a table, so the code objects
        // came out the same byte for byte when it was introduced.
        Module::AllReduce => {
            for d in DType::ALL {
                out.push(Kernel::OneShot(d));
                out.push(Kernel::TwoShot(d));
            }
            out.push(Kernel::Copy);
            for c in Codec::V1 {
                out.extend(CODEC_DTYPES.map(|d| Kernel::Quantized(d, c)));
                for d in SEGMENT_DTYPES {
                    out.push(Kernel::Encode(d, c));
                    out.push(Kernel::Decode(d, c));
                }
            }
            for c in Codec::V1 {
                out.extend(CODEC_DTYPES.map(|d| Kernel::Hierarchical(d, c)));
            }
            // Appended, so every earlier instance keeps its place in the code object.
            for d in DType::ALL {
                out.push(Kernel::OneShotRegistered(d));
                out.push(Kernel::TwoShotRegistered(d));
            }
            for c in Codec::V2 {
                out.extend(CODEC_DTYPES.map(|d| Kernel::Quantized(d, c)));
                for d in SEGMENT_DTYPES {
                    out.push(Kernel::Encode(d, c));
                    out.push(Kernel::Decode(d, c));
                }
                out.extend(CODEC_DTYPES.map(|d| Kernel::Hierarchical(d, c)));
            }
        }
        Module::Fused => {
            let worlds: Vec<usize> = [0].iter().chain(vendor.fused_worlds()).copied().collect();
            for d in DType::ALL {
                for &w in &worlds {
                    out.push(Kernel::FusedOneShot(d, w));
                    out.push(Kernel::FusedTwoShot(d, w));
                    if vendor.has_split() {
                        out.push(Kernel::FusedOneShotSplit(d, w));
                    }
                }
                out.push(Kernel::RmsNorm(d));
            }
            // Appended, so every earlier instance keeps its place in the code object.
            for d in DType::ALL {
                for &w in &worlds {
                    out.push(Kernel::PushOneShot(d, w));
                }
            }
        }
    }
    out
}

/// `kernel`, looked up in a module of runtime `R` loaded on some device.
pub fn function<R: GpuRuntime>(module: &R::Module, kernel: Kernel) -> Result<R::Function> {
    let name = kernel.name();
    let name = CString::new(name.as_str())
        .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?} holds a NUL")))?;
    R::function(module, &name)
}

/// `kernels`, looked up in order; the first missing one is the error.
pub fn functions<R: GpuRuntime, const N: usize>(
    module: &R::Module,
    kernels: [Kernel; N],
) -> Result<[R::Function; N]> {
    let mut out = Vec::with_capacity(N);
    for k in kernels {
        out.push(function::<R>(module, k)?);
    }
    Ok(out.try_into().ok().expect("one function per kernel"))
}

/// Every kernel `vendor` compiles, both modules.
pub fn all(vendor: Vendor) -> Vec<Kernel> {
    Module::ALL
        .iter()
        .flat_map(|&m| kernels(vendor, m))
        .collect()
}

/// The C++ element type kernels-common instantiates for `d` (shim.h).
fn cxx_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F16 => "ar_half",
        DType::BF16 => "ar_bf16",
    }
}

/// The codec formats these kernels encode, bit `v` for format `v` (see `Codec::format`).
pub const CODEC_FORMATS: u32 = 1 << 1 | 1 << 2;

/// The codec description type of codec.h.
fn cxx_codec(c: Codec) -> &'static str {
    match c {
        Codec::Fp8E4M3 => "CodecFp8",
        Codec::Int8 => "CodecQ8",
        Codec::Int6 => "CodecQ6",
        Codec::Int4 => "CodecQ4",
        Codec::Int8Adaptive => "CodecQ8a",
        Codec::Int6Adaptive => "CodecQ6a",
        Codec::Int4Adaptive => "CodecQ4a",
        Codec::Int8V2 => "CodecQ8v2",
        Codec::Int6V2 => "CodecQ6v2",
        Codec::Int4V2 => "CodecQ4v2",
        Codec::Fp4E2M1 => "CodecFp4",
    }
}

/// The line of an instance list that defines `k`: a macro the including source defines (it
/// holds the launch bounds, which differ by vendor), with the symbol and the body's template
/// instance.
fn instance(k: Kernel) -> String {
    use Kernel::*;
    let name = k.name();
    match k {
        OneShot(d) => format!("AR_ARGS_KERNEL({name}, oneshot<{}>)", cxx_type(d)),
        TwoShot(d) => format!("AR_ARGS_KERNEL({name}, twoshot<{}>)", cxx_type(d)),
        OneShotRegistered(d) => format!(
            "AR_REGISTERED_KERNEL({name}, oneshot_registered<{}>)",
            cxx_type(d)
        ),
        TwoShotRegistered(d) => format!(
            "AR_REGISTERED_KERNEL({name}, twoshot_registered<{}>)",
            cxx_type(d)
        ),
        Copy => format!("AR_COPY_KERNEL({name})"),
        Quantized(d, c) => format!(
            "AR_ARGS_KERNEL({name}, quantized_twoshot<{}, {}>)",
            cxx_type(d),
            cxx_codec(c)
        ),
        Hierarchical(d, c) => format!(
            "AR_ARGS_KERNEL({name}, hierarchical_quantized<{}, {}>)",
            cxx_type(d),
            cxx_codec(c)
        ),
        Encode(d, c) => format!(
            "AR_ENCODE_KERNEL({name}, {c}, encode_segment<{}, {c}>)",
            cxx_type(d),
            c = cxx_codec(c)
        ),
        Decode(d, c) => format!(
            "AR_DECODE_KERNEL({name}, {c}, decode_segment<{}, {c}>)",
            cxx_type(d),
            c = cxx_codec(c)
        ),
        FusedOneShot(d, w) => format!("AR_FUSED_KERNEL({name}, oneshot<{}, {w}>)", cxx_type(d)),
        FusedTwoShot(d, w) => format!("AR_FUSED_KERNEL({name}, twoshot<{}, {w}>)", cxx_type(d)),
        FusedOneShotSplit(d, w) => {
            format!(
                "AR_FUSED_KERNEL({name}, oneshot_split<{}, {w}>)",
                cxx_type(d)
            )
        }
        RmsNorm(d) => format!("AR_FUSED_KERNEL({name}, norm_only<{}>)", cxx_type(d)),
        PushOneShot(d, w) => format!(
            "AR_FUSED_KERNEL({name}, push_oneshot<{}, {w}>)",
            cxx_type(d)
        ),
    }
}

/// The instance list `vendor`'s source of `module` includes: one macro line per kernel of
/// [`kernels`]. Checked in as `<source_dir>/<stem>_kernels.inc`.
pub fn instance_list(vendor: Vendor, module: Module) -> String {
    let source = match vendor {
        Vendor::Cuda => format!("{}.cu", module.stem()),
        Vendor::Hip => format!("{}.hip", module.stem()),
    };
    let mut out = format!(
        "// Generated from crates/gpu/src/kernels.rs (the table of every kernel): do not edit.\n\
         // Regenerate with ALLREDUCE_REGENERATE=1 cargo test -p allreduce-gpu kernels.\n\
         // Included by {source}, which defines the macros.\n\n"
    );
    for k in kernels(vendor, module) {
        out.push_str(&instance(k));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::path::Path;

    /// The checked-in lists are what the table renders. With `ALLREDUCE_REGENERATE=1` they
    /// are rewritten first (the test then checks the rewrite).
    #[test]
    fn checked_in_instance_lists_are_current() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let regenerate = std::env::var("ALLREDUCE_REGENERATE").is_ok_and(|v| v == "1");
        let mut stale = Vec::new();
        for vendor in Vendor::ALL {
            for module in Module::ALL {
                let path = root
                    .join(vendor.source_dir())
                    .join(format!("{}_kernels.inc", module.stem()));
                let want = instance_list(vendor, module);
                if regenerate {
                    std::fs::write(&path, &want).unwrap();
                }
                match std::fs::read_to_string(&path) {
                    Ok(have) if have == want => {}
                    _ => stale.push(path.display().to_string()),
                }
            }
        }
        assert!(
            stale.is_empty(),
            "stale instance lists (regenerate: ALLREDUCE_REGENERATE=1 cargo test -p \
             allreduce-gpu kernels): {stale:?}"
        );
    }

    #[test]
    fn names_are_unique_and_in_their_module() {
        for vendor in Vendor::ALL {
            let all = all(vendor);
            let names: HashSet<String> = all.iter().map(|k| k.name()).collect();
            assert_eq!(names.len(), all.len(), "{vendor:?}");
            for module in Module::ALL {
                assert!(kernels(vendor, module).iter().all(|k| k.module() == module));
            }
        }
    }

    /// The symbols the compiled code objects have always exported.
    #[test]
    fn names_keep_their_spelling() {
        let cuda: Vec<String> = all(Vendor::Cuda).iter().map(|k| k.name()).collect();
        for name in [
            "ar_oneshot_f32",
            "ar_twoshot_bf16",
            "ar_oneshot_registered_f16",
            "ar_twoshot_registered_bf16",
            "ar_copy_f32x4",
            "ar_quantized_f16_fp8",
            "ar_quantized_bf16_q4a",
            "ar_hierarchical_f16_q6",
            "ar_encode_f32_q8",
            "ar_decode_bf16_q8a",
            "ar_fused_oneshot_bf16_w2",
            "ar_fused_twoshot_f16_w0",
            "ar_fused_oneshot_split_f32_w8",
            "ar_rmsnorm_f16",
            "ar_push_oneshot_bf16_w2",
            "ar_push_oneshot_f32_w0",
        ] {
            assert!(cuda.iter().any(|n| n == name), "{name}");
        }
        assert_eq!(
            kernels(Vendor::Cuda, Module::AllReduce),
            kernels(Vendor::Hip, Module::AllReduce)
        );
        // HIP's fused module: the generic instance only, and no split.
        assert_eq!(kernels(Vendor::Hip, Module::Fused).len(), 3 * (3 + 1));
        assert_eq!(
            kernels(Vendor::Cuda, Module::Fused).len(),
            3 * (4 * 3 + 1 + 4)
        );
    }

    #[test]
    fn instance_lines_name_the_template_instance() {
        let list = instance_list(Vendor::Cuda, Module::AllReduce);
        assert!(list.contains("AR_ARGS_KERNEL(ar_oneshot_f16, oneshot<ar_half>)\n"));
        assert!(list.contains(
            "AR_ENCODE_KERNEL(ar_encode_bf16_q4a, CodecQ4a, encode_segment<ar_bf16, CodecQ4a>)\n"
        ));
        let fused = instance_list(Vendor::Cuda, Module::Fused);
        assert!(fused.contains("AR_FUSED_KERNEL(ar_fused_twoshot_f32_w4, twoshot<float, 4>)\n"));
        assert!(!instance_list(Vendor::Hip, Module::Fused).contains("oneshot_split"));
    }
}
