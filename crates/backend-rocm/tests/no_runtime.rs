//! Without a ROCm runtime (this CI machine), every entry point returns an error value that
//! names the libraries tried; nothing panics. On a machine with ROCm the checks that assume
//! its absence are skipped, with the reason printed.

use allreduce_backend_rocm::{hip, rccl, Rocm};
use allreduce_core::{Backend, Error, GroupConfig};

#[test]
fn missing_hip_runtime_is_a_clear_error() {
    if std::env::var_os(hip::sys::PATH_ENV).is_some() {
        println!("skipped: {} is set", hip::sys::PATH_ENV);
        return;
    }
    if let Ok(lib) = hip::sys::lib() {
        println!("skipped: a HIP runtime is present here ({})", lib.path);
        return;
    }
    let Err(group) = Rocm::create_group(&GroupConfig::new(2)) else {
        panic!("a group without a runtime");
    };
    let count = allreduce_backend_rocm::device_count().expect_err("no runtime");
    for err in [group, count] {
        match &err {
            Error::LibraryUnavailable { library, detail } => {
                assert_eq!(*library, "libamdhip64");
                for soname in hip::sys::SONAMES {
                    assert!(detail.contains(soname), "{detail}");
                }
                assert!(
                    detail.contains("/opt/rocm/lib/libamdhip64.so.6"),
                    "{detail}"
                );
                assert!(detail.contains(hip::sys::PATH_ENV), "{detail}");
            }
            other => panic!("expected LibraryUnavailable, got {other:?}"),
        }
        println!("{err}");
    }
}

#[test]
fn missing_rccl_is_a_clear_reason() {
    if std::env::var_os(rccl::sys::PATH_ENV).is_some() || rccl::sys::lib().is_ok() {
        println!("skipped: librccl is present here");
        return;
    }
    let why = rccl::sys::lib().err().expect("absent");
    assert!(why.contains("librccl.so.1"), "{why}");
    assert!(matches!(
        rccl::result::version(),
        Err(Error::LibraryUnavailable {
            library: "librccl",
            ..
        })
    ));
}
