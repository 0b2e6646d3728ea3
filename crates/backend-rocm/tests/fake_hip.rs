//! The HIP layers against a stub libamdhip64 built here from C (skipped, with the reason
//! printed, when no C compiler is found): loading through `ALLREDUCE_LIBAMDHIP64`, a
//! missing symbol, the runtime's error strings, device checks, and a group that stops with a
//! clear error where the stub (or the build) runs out.
//!
//! One test function: the stub is chosen through a process-wide environment variable and
//! the library is opened once per process.

use std::path::{Path, PathBuf};
use std::process::Command;

use allreduce_backend_rocm::{hip, kernels, Rocm};
use allreduce_core::{Backend, Error, GroupConfig};

/// Every symbol returns hipErrorInvalidValue (1) unless defined below; the device count and
/// wave size come from the environment so one stub serves several scenarios.
const STUB_SPECIAL: &str = r#"
#include <stdlib.h>
#include <string.h>
static int env_int(const char* k, int d) { const char* v = getenv(k); return v ? atoi(v) : d; }
const char* hipGetErrorName(int e) { return e == 1 ? "hipErrorInvalidValue" : "hipErrorStub"; }
const char* hipGetErrorString(int e) { (void)e; return "stub runtime refuses"; }
int hipInit(unsigned f) { (void)f; return 0; }
int hipRuntimeGetVersion(int* v) { *v = 60342134; return 0; }
int hipGetLastError(void) { return 0; }
int hipGetDeviceCount(int* n) { *n = env_int("STUB_HIP_DEVICES", 0); return *n ? 0 : 100; }
int hipSetDevice(int d) { return d < env_int("STUB_HIP_DEVICES", 0) ? 0 : 101; }
int hipDeviceGetAttribute(int* v, int attr, int d) {
  (void)d;
  if (attr == 87) { *v = env_int("STUB_HIP_WAVE", 64); return 0; }
  if (attr == 63) { *v = 304; return 0; }
  return 1;
}
int hipDeviceGetName(char* name, int len, int d) { (void)d; strncpy(name, "Stub MI300X", len); return 0; }
"#;

fn c_compiler() -> Option<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    Command::new(&cc)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| cc)
}

fn build_stub(cc: &str, dir: &Path, name: &str, skip: &[&str]) -> PathBuf {
    let special = [
        "hipGetErrorName",
        "hipGetErrorString",
        "hipInit",
        "hipRuntimeGetVersion",
        "hipGetLastError",
        "hipGetDeviceCount",
        "hipSetDevice",
        "hipDeviceGetAttribute",
        "hipDeviceGetName",
    ];
    let mut src = String::from(STUB_SPECIAL);
    for s in hip::sys::SYMBOLS {
        if !special.contains(s) && !skip.contains(s) {
            src.push_str(&format!("int {s}() {{ return 1; }}\n"));
        }
    }
    let c = dir.join(format!("{name}.c"));
    let so = dir.join(format!("{name}.so"));
    std::fs::write(&c, src).unwrap();
    let out = Command::new(cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

#[test]
fn hip_layers_against_a_stub_runtime() {
    let Some(cc) = c_compiler() else {
        println!("skipped: no C compiler (cc or $CC) to build the stub libamdhip64");
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake-hip");
    std::fs::create_dir_all(&dir).unwrap();

    // A library lacking a symbol is refused by name.
    let partial = build_stub(&cc, &dir, "libamdhip64_partial", &["hipModuleLaunchKernel"]);
    // SAFETY: the stub has no initialisers.
    let library = unsafe { libloading::Library::new(&partial) }.unwrap();
    // SAFETY: the stub's signatures match where it matters (see STUB_SPECIAL).
    let err = unsafe { hip::sys::Lib::from_library(library, partial.display().to_string()) }
        .err()
        .expect("a symbol is missing");
    assert!(err.contains("lacks hipModuleLaunchKernel"), "{err}");

    let full = build_stub(&cc, &dir, "libamdhip64_stub", &[]);
    std::env::set_var(hip::sys::PATH_ENV, &full);
    std::env::set_var("STUB_HIP_DEVICES", "0");
    let lib = hip::sys::lib().expect("the stub loads");
    assert_eq!(lib.path, full.display().to_string());
    assert_eq!(hip::result::init().unwrap(), 60342134);

    // A runtime with no device: zero devices, and a group says so.
    assert_eq!(allreduce_backend_rocm::device_count().unwrap(), 0);
    match Rocm::create_group(&GroupConfig::new(2)) {
        Err(Error::InvalidConfig(m)) => assert!(m.contains("0 present"), "{m}"),
        other => panic!("{:?}", other.err()),
    }

    // The runtime's own name and message for a failed call.
    std::env::set_var("STUB_HIP_DEVICES", "1");
    let e = hip::result::memory::malloc(64).expect_err("the stub refuses");
    assert_eq!(e.code(), Some(1));
    let core: Error = e.into();
    assert_eq!(
        core.to_string(),
        "hipMalloc failed: stub runtime refuses (hipErrorInvalidValue, 1)"
    );

    // A wave32 (RDNA) device is refused at open with the reason.
    std::env::set_var("STUB_HIP_WAVE", "32");
    match Rocm::create_group(&GroupConfig::new(1)) {
        Err(Error::InvalidConfig(m)) => assert!(m.contains("wave64"), "{m}"),
        other => panic!("{:?}", other.err()),
    }

    // A CDNA device: the group gets as far as the kernels. Without a HIP compiler at build
    // time there are none, and the error says how to get them; with them, the stub refuses
    // to load them and the error names every target tried.
    std::env::set_var("STUB_HIP_WAVE", "64");
    let err = Rocm::create_group(&GroupConfig::new(1))
        .err()
        .expect("the stub cannot run kernels");
    if kernels::code_objects().is_empty() {
        match &err {
            Error::LibraryUnavailable { library, detail } => {
                assert_eq!(*library, "allreduce's HIP kernels");
                assert!(detail.contains("scripts/setup-hip.sh"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    } else {
        let text = err.to_string();
        assert!(text.contains("hipModuleLoadData"), "{text}");
        for arch in kernels::targets() {
            assert!(text.contains(arch), "{text}");
        }
    }
    println!("{err}");
}
