//! The kernels embedded at build time: one AMDGPU code object per gfx target (kernels-hip +
//! kernels-common, compiled by build-support when build.rs found a HIP compiler), or none.
//! Two modules, as on CUDA: the all-reduce kernels (allreduce.hip) and the fused all-reduce +
//! RMSNorm (fused.hip).

include!(concat!(env!("OUT_DIR"), "/allreduce.hip.rs"));

mod fused {
    include!(concat!(env!("OUT_DIR"), "/fused.hip.rs"));
}

/// What build.rs did: "compiled for gfx90a, gfx942, gfx950 (allreduce.hip, fused.hip)" or
/// "not compiled: ..." with the reason.
pub const BUILD: &str = env!("ALLREDUCE_HIP_BUILD");

/// `(gfx target, code object)` pairs, empty when the build found no HIP compiler.
pub fn code_objects() -> &'static [(&'static str, &'static [u8])] {
    HIP_CODE_OBJECTS
}

/// `(gfx target, code object)` pairs of the fused kernels (fused.hip), empty when the build
/// found no HIP compiler.
pub fn fused_code_objects() -> &'static [(&'static str, &'static [u8])] {
    fused::HIP_CODE_OBJECTS
}

/// The gfx targets compiled in.
pub fn targets() -> Vec<&'static str> {
    HIP_CODE_OBJECTS.iter().map(|(a, _)| *a).collect()
}

/// Why there are no kernels and how to get them (the run-time error of a build without).
pub fn missing() -> String {
    // build-support's own advice follows "; to get one"; ours below says the same, shorter.
    let why = BUILD.split("; to get one").next().unwrap_or(BUILD);
    format!(
        "no HIP kernels were compiled into this build of allreduce-backend-rocm ({why}); \
         to get them, run scripts/setup-hip.sh (a pinned clang 22, no ROCm needed) and rebuild \
         with the HIP_CLANG=... line it prints set, or set HIP_CLANG or ROCM_PATH to your own \
         HIP compiler (build.rs looks again when one of those changes; \
         ALLREDUCE_REQUIRE_HIP=1 makes a missing compiler a build error)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use allreduce_gpu::kernels::{self, Module, Vendor};

    /// Every kernel of the table for `module` is in `image` (as a NUL-terminated symbol, so
    /// `..._q8` is not found inside `..._q8a`), and with it every name the generic fused code
    /// asks for at each world the runtime promises.
    fn assert_exports(arch: &str, image: &[u8], module: Module) {
        let has = |k: &str| {
            let symbol = format!("{k}\0");
            image.windows(symbol.len()).any(|w| w == symbol.as_bytes())
        };
        for k in kernels::kernels(Vendor::Hip, module) {
            assert!(has(&k.name()), "{arch} lacks {}", k.name());
        }
        if module == Module::Fused {
            let worlds = <crate::Hip as allreduce_gpu::GpuRuntime>::FUSED_WORLDS;
            for w in [0].iter().chain(worlds) {
                let names = allreduce_gpu::fused::kernel_names::<crate::Hip>(*w);
                for k in names.iter().flatten() {
                    assert!(has(k), "{arch} lacks {k}");
                }
            }
        }
    }

    #[test]
    fn embedded_code_objects_are_amdgpu_elfs_or_absent_with_a_reason() {
        if code_objects().is_empty() {
            assert!(BUILD.starts_with("not compiled"), "{BUILD}");
            assert!(fused_code_objects().is_empty());
            assert!(missing().contains("scripts/setup-hip.sh"));
            // CI builds with ALLREDUCE_REQUIRE_HIP=1 after setup-hip.sh: kernels must be in.
            assert!(
                std::env::var("ALLREDUCE_REQUIRE_HIP").as_deref() != Ok("1"),
                "ALLREDUCE_REQUIRE_HIP=1 but no code objects are embedded ({BUILD})"
            );
            println!("no kernels embedded: {BUILD}");
            return;
        }
        assert!(BUILD.starts_with("compiled for"), "{BUILD}");
        for (arch, image) in code_objects() {
            assert!(arch.starts_with("gfx"), "{arch}");
            // ELF64, little-endian, EM_AMDGPU (224), ELFOSABI_AMDGPU_HSA (64).
            assert_eq!(&image[..4], b"\x7fELF", "{arch}");
            assert_eq!((image[4], image[5], image[7]), (2, 1, 64), "{arch}");
            assert_eq!(u16::from_le_bytes([image[18], image[19]]), 224, "{arch}");
            assert_exports(arch, image, Module::AllReduce);
        }
        assert_eq!(
            fused_code_objects()
                .iter()
                .map(|(a, _)| *a)
                .collect::<Vec<_>>(),
            targets()
        );
        for (arch, image) in fused_code_objects() {
            assert_eq!(&image[..4], b"\x7fELF", "{arch}");
            assert_exports(arch, image, Module::Fused);
            // And no per-world instance the host would never ask for (Hip::FUSED_WORLDS).
            let worlds = <crate::Hip as allreduce_gpu::GpuRuntime>::FUSED_WORLDS;
            for w in (1..=8).filter(|w| !worlds.contains(w)) {
                let k = format!("ar_fused_oneshot_f32_w{w}");
                assert!(
                    !image.windows(k.len()).any(|x| x == k.as_bytes()),
                    "{arch} has {k}, which Hip::FUSED_WORLDS does not list"
                );
            }
        }
        assert!(targets().contains(&"gfx942"), "{:?}", targets());
    }
}
