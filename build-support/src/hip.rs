//! The AMD side: find a clang that compiles HIP for AMDGPU, and compile one `.hip` file into
//! one code object per gfx target.
//!
//! The kernels are header-free on HIP (kernels-common's `shim.h`), so any clang with the
//! AMDGPU target that knows the gfx names will do: ROCm's, a distribution's (Debian's
//! clang-19 with lld-19: gfx90a and gfx942), or the pinned clang 22 that
//! `scripts/setup-hip.sh` installs (gfx90a, gfx942, gfx950). No ROCm headers, device
//! libraries or GPU are needed.
//!
//! A consumer's `build.rs`:
//!
//! ```no_run
//! use allreduce_build_support::{compile_hip_code_objects, HipOptions};
//!
//! let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap(); // at run time, not env!
//! let root = std::path::Path::new(&manifest).join("../..");
//! let mut opts = HipOptions::new("allreduce", root.join("kernels-hip/allreduce.hip"));
//! opts.include_dirs = vec![root.join("kernels-common/include")];
//! if let Err(e) = compile_hip_code_objects(&opts) {
//!     panic!("{e}");
//! }
//! ```
//!
//! Which targets were built depends on the compiler (gfx950 is optional), so the crate embeds
//! them through a generated list rather than by file name:
//!
//! ```ignore
//! include!(concat!(env!("OUT_DIR"), "/allreduce.hip.rs"));
//! // pub static HIP_CODE_OBJECTS: &[(&str, &[u8])] = &[("gfx90a", ..), ("gfx942", ..), ..];
//! ```
//!
//! and loads the one whose name matches the device's `gcnArchName` (before any `:`), with
//! `hipModuleLoadData`. Each is a plain AMDGPU ELF (code object v5), not an offload bundle.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::{check_inputs, resolve_out_dir, search_path, split_list};

/// Targets always built when neither [`HipOptions::archs`] nor `ALLREDUCE_HIP_ARCHS` says
/// otherwise: MI200 (gfx90a) and MI300X/MI300A/MI325X (gfx942). A compiler that does not
/// know one of them is an error.
pub const DEFAULT_HIP_ARCHS: &[&str] = &["gfx90a", "gfx942"];

/// Added to [`DEFAULT_HIP_ARCHS`] when the compiler knows them: MI350/MI355X (gfx950, LLVM 20
/// and newer).
pub const OPTIONAL_HIP_ARCHS: &[&str] = &["gfx950"];

/// Overrides the target list (every entry then required), e.g. `ALLREDUCE_HIP_ARCHS=gfx942`.
pub const HIP_ARCHS_ENV: &str = "ALLREDUCE_HIP_ARCHS";

/// The virtual environment `scripts/setup-hip.sh` creates at the workspace root, and the
/// compiler wrapper inside it.
pub const HIP_VENV_DIR: &str = ".venv-hip";
const HIP_VENV_COMPILER: &str = "bin/hip-clang";

/// Everything that changes which compiler runs or what it produces.
const HIP_WATCHED_ENV: &[&str] = &["HIP_CLANG", "ROCM_PATH", HIP_ARCHS_ENV];

/// Finds a HIP compiler: `$HIP_CLANG`, then `$ROCM_PATH/llvm/bin/clang++`,
/// `$ROCM_PATH/bin/amdclang++`, `$ROCM_PATH/bin/hipcc`, then `.venv-hip/bin/hip-clang` in the
/// nearest ancestor of `CARGO_MANIFEST_DIR` (the current directory if unset) that has a
/// `.venv-hip`, then `amdclang++` or `hipcc` on `PATH`.
///
/// A bare `clang` on `PATH` is not taken: it may lack the AMDGPU target or predate gfx942;
/// point `HIP_CLANG` at one (e.g. `HIP_CLANG=clang-19`) to use it. The error says what was
/// tried and how to get a compiler.
pub fn find_hip_compiler() -> Result<PathBuf, String> {
    let start = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .or_else(|| env::current_dir().ok());
    find_hip_compiler_with(|k| env::var_os(k), start.as_deref())
}

const HOW_TO_GET_HIP: &str = "to get one: run scripts/setup-hip.sh (a pinned clang 22 from \
    the ziglang pip wheel; no ROCm, root or GPU needed), or install ROCm 6.0 or newer and set \
    ROCM_PATH, or set HIP_CLANG to a clang 17 or newer with the AMDGPU target and lld (e.g. \
    HIP_CLANG=clang-19 after `apt-get install clang-19 lld-19`)";

/// [`find_hip_compiler`] with the environment and the starting directory passed in, for tests.
pub(crate) fn find_hip_compiler_with(
    var: impl Fn(&str) -> Option<OsString>,
    start: Option<&Path>,
) -> Result<PathBuf, String> {
    let var = |k: &str| var(k).filter(|v| !v.is_empty());
    let exe = |name: &str| format!("{name}{}", env::consts::EXE_SUFFIX);
    let mut tried = Vec::new();

    if let Some(v) = var("HIP_CLANG") {
        return crate::explicit_compiler("HIP_CLANG", &v, var("PATH"), HOW_TO_GET_HIP);
    }

    if let Some(rocm) = var("ROCM_PATH") {
        let rocm = PathBuf::from(rocm);
        let candidates = [
            rocm.join("llvm/bin").join(exe("clang++")),
            rocm.join("bin").join(exe("amdclang++")),
            rocm.join("bin").join(exe("hipcc")),
        ];
        if let Some(p) = candidates.iter().find(|p| p.is_file()) {
            return Ok(p.clone());
        }
        tried.push(format!(
            "ROCM_PATH={} (no llvm/bin/clang++, bin/amdclang++ or bin/hipcc)",
            rocm.display()
        ));
    }

    if let Some(venv) = start.and_then(|s| {
        s.ancestors()
            .map(|a| a.join(HIP_VENV_DIR))
            .find(|v| v.is_dir())
    }) {
        let p = venv.join(HIP_VENV_COMPILER);
        if p.is_file() {
            return Ok(p);
        }
        tried.push(format!(
            "{} (no {HIP_VENV_COMPILER} inside)",
            venv.display()
        ));
    } else {
        tried.push(format!(
            "no {HIP_VENV_DIR} above {}",
            start.map_or("?".into(), |s| s.display().to_string())
        ));
    }

    for name in ["amdclang++", "hipcc"] {
        if let Some(p) = search_path(var("PATH"), exe(name)) {
            return Ok(p);
        }
    }
    tried.push("amdclang++ and hipcc on PATH".into());

    Err(format!(
        "no HIP compiler found (HIP_CLANG unset; looked at {}); {HOW_TO_GET_HIP}",
        tried.join(", ")
    ))
}

/// What [`compile_hip_code_objects`] compiles.
pub type HipOptions = crate::KernelOptions;

/// One compiled target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeObject {
    /// The target ID as given (`gfx942`).
    pub arch: String,
    /// `<out_dir>/<name>.<arch>.hsaco` (a `:` in the target ID becomes `_`).
    pub path: PathBuf,
}

/// The device-only flags for one target. Header-free (`-nogpuinc -nogpulib -nostdinc`: no HIP
/// headers, device libraries or libc, see kernels-common's shim.h); code object v5, which every
/// ROCm runtime since 5.x loads (clang 22 defaults to v6); f32 denormals kept, as the host
/// reference computes (HIP clang's default too, said here so a toolchain default cannot change
/// it). FMA contraction is HIP's default, for the reason `compile_fatbin` gives for nvcc.
fn hip_device_args(arch: &str) -> Vec<String> {
    [
        "-x",
        "hip",
        "-std=c++17",
        "--cuda-device-only",
        "--no-gpu-bundle-output",
        "-nogpuinc",
        "-nogpulib",
        "-nostdinc",
        "-mcode-object-version=5",
        "-fno-gpu-flush-denormals-to-zero",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("--offload-arch={arch}")])
    .collect()
}

/// Compiles `opts.source` into one AMDGPU code object per target, `<out_dir>/<name>.<arch>.hsaco`
/// (the targets in parallel), writes `<out_dir>/<name>.hip.rs` listing them for `include!`,
/// and returns them in target order.
///
/// Flags: `-O3` plus [`hip_device_args`]'s. Each output is checked to be an AMDGPU ELF.
pub fn compile_hip_code_objects(opts: &HipOptions) -> Result<Vec<CodeObject>, String> {
    check_inputs(
        &opts.name,
        &opts.source,
        &opts.include_dirs,
        HIP_WATCHED_ENV,
        opts.cargo_directives,
    )?;
    let explicit = match &opts.archs {
        Some(list) => Some(list.clone()),
        None => match env::var(HIP_ARCHS_ENV) {
            Ok(v) if !v.trim().is_empty() => Some(split_list(&v)),
            _ => None,
        },
    };
    if let Some(list) = &explicit {
        check_hip_archs(list)?;
    }
    let out_dir = resolve_out_dir(opts.out_dir.as_deref())?;
    let compiler = match &opts.compiler {
        Some(p) => p.clone(),
        None => find_hip_compiler()?,
    };
    let archs = match explicit {
        Some(list) => list,
        None => {
            let mut list: Vec<String> = DEFAULT_HIP_ARCHS.iter().map(|s| s.to_string()).collect();
            for arch in OPTIONAL_HIP_ARCHS {
                if compiler_knows(&compiler, arch)? {
                    list.push(arch.to_string());
                } else if opts.cargo_directives {
                    println!(
                        "cargo:warning={} does not know {arch}: not built",
                        compiler.display()
                    );
                }
            }
            list
        }
    };

    fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let listing = out_dir.join(format!("{}.hip.rs", opts.name));
    // Stale files must not survive a failed compile and get embedded.
    let _ = fs::remove_file(&listing);

    // Start every target, then collect: two cores build two targets in the time of one.
    let mut jobs: Vec<(CodeObject, Command, Child)> = Vec::new();
    for arch in &archs {
        let path = out_dir.join(format!("{}.{}.hsaco", opts.name, arch.replace(':', "_")));
        let _ = fs::remove_file(&path);
        let mut cmd = Command::new(&compiler);
        cmd.args(hip_device_args(arch)).arg("-O3");
        for dir in &opts.include_dirs {
            cmd.arg("-I").arg(dir);
        }
        cmd.arg("-c").arg("-o").arg(&path).arg(&opts.source);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd
            .spawn()
            .map_err(|e| format!("running {}: {e}", compiler.display()))?;
        let arch = arch.clone();
        jobs.push((CodeObject { arch, path }, cmd, child));
    }

    let mut done = Vec::new();
    let mut failures = Vec::new();
    for (obj, cmd, child) in jobs {
        let output = child
            .wait_with_output()
            .map_err(|e| format!("waiting for {}: {e}", compiler.display()))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            let mut msg = format!(
                "{} failed for {} ({}): {cmd:?}\n{}{stderr}",
                compiler.display(),
                obj.arch,
                output.status,
                String::from_utf8_lossy(&output.stdout)
            );
            if unknown_target(&stderr) {
                msg.push_str(&format!(
                    "\n{} does not know {}: gfx942 needs clang 17 or ROCm 6.0 or newer (Debian's \
                     hipcc 5.2 stops at gfx940), gfx950 clang 20; {HOW_TO_GET_HIP}",
                    compiler.display(),
                    obj.arch
                ));
            }
            failures.push(msg);
            continue;
        }
        if opts.cargo_directives {
            for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
                println!("cargo:warning=hip {}: {line}", obj.arch);
            }
        }
        let checked = match fs::read(&obj.path) {
            Ok(bytes) => {
                check_amdgpu_elf(&bytes).map_err(|e| format!("{}: {e}", obj.path.display()))
            }
            Err(_) => Err(format!(
                "{} succeeded but wrote no {}: {cmd:?}",
                compiler.display(),
                obj.path.display()
            )),
        };
        match checked {
            Ok(()) => done.push(obj),
            Err(e) => failures.push(e),
        }
    }
    if !failures.is_empty() {
        return Err(failures.join("\n\n"));
    }

    write_listing(&listing, &done).map_err(|e| format!("writing {}: {e}", listing.display()))?;
    Ok(done)
}

/// gfx target IDs: `gfx` + hex digits, then optional `:feature+` / `:feature-` parts.
fn check_hip_archs(archs: &[String]) -> Result<(), String> {
    if archs.is_empty() {
        return Err(format!(
            "empty HIP target list (set e.g. {HIP_ARCHS_ENV}=gfx942)"
        ));
    }
    for a in archs {
        let mut parts = a.split(':');
        let proc = parts.next().unwrap_or("");
        let ok_proc = proc
            .strip_prefix("gfx")
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_hexdigit()));
        let ok_features = parts.all(|f| {
            f.len() > 1
                && (f.ends_with('+') || f.ends_with('-'))
                && f[..f.len() - 1]
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        });
        if !ok_proc || !ok_features {
            return Err(format!(
                "bad HIP target {a:?} (want e.g. gfx942 or gfx942:xnack-; set via \
                 {HIP_ARCHS_ENV}=gfx90a,gfx942)"
            ));
        }
    }
    Ok(())
}

/// Does the compiler accept `--offload-arch=arch`? An empty translation unit from stdin, so
/// it costs one driver start.
fn compiler_knows(compiler: &Path, arch: &str) -> Result<bool, String> {
    let status = Command::new(compiler)
        .args(hip_device_args(arch))
        .args(["-fsyntax-only", "-"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("running {}: {e}", compiler.display()))?;
    Ok(status.success())
}

/// The drivers' ways of saying a gfx name is unknown (clang 15-19: "invalid target ID";
/// clang 20+: "unsupported HIP gpu architecture").
fn unknown_target(stderr: &str) -> bool {
    stderr.contains("invalid target ID") || stderr.contains("unsupported HIP gpu architecture")
}

/// An ELF64 little-endian object for EM_AMDGPU (224) under the AMDHSA OS ABI (64).
pub(crate) fn check_amdgpu_elf(bytes: &[u8]) -> Result<(), String> {
    const EM_AMDGPU: u16 = 224;
    const ELFOSABI_AMDGPU_HSA: u8 = 64;
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    if bytes[4] != 2 || bytes[5] != 1 || machine != EM_AMDGPU || bytes[7] != ELFOSABI_AMDGPU_HSA {
        return Err(format!(
            "not an AMDGPU HSA code object (class {}, data {}, machine {machine}, OS ABI {})",
            bytes[4], bytes[5], bytes[7]
        ));
    }
    Ok(())
}

fn write_listing(path: &Path, objs: &[CodeObject]) -> std::io::Result<()> {
    let mut f = fs::File::create(path)?;
    writeln!(
        f,
        "// Generated by allreduce-build-support: one AMDGPU code object per gfx target."
    )?;
    writeln!(f, "pub static HIP_CODE_OBJECTS: &[(&str, &[u8])] = &[")?;
    for o in objs {
        let p = o
            .path
            .to_str()
            .ok_or_else(|| std::io::Error::other(format!("{} is not UTF-8", o.path.display())))?;
        writeln!(f, "    ({:?}, include_bytes!({p:?})),", o.arch)?;
    }
    writeln!(f, "];")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::TempDir;
    use std::collections::HashMap;

    fn find(vars: &[(&str, PathBuf)], start: &Path) -> Result<PathBuf, String> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone().into_os_string()))
            .collect();
        find_hip_compiler_with(|k| map.get(k).cloned(), Some(start))
    }

    /// Every location populated; removing the winner each time walks the search order.
    #[test]
    fn search_order() {
        let t = TempDir::new();
        let explicit = t.touch("explicit/clang");
        let rocm_clang = t.touch("rocm/llvm/bin/clang++");
        let rocm_amdclang = t.touch("rocm/bin/amdclang++");
        let rocm_hipcc = t.touch("rocm/bin/hipcc");
        let venv = t.touch("ws/.venv-hip/bin/hip-clang");
        let path_amdclang = t.touch("pathdir/amdclang++");
        let path_hipcc = t.touch("pathdir/hipcc");
        t.touch("pathdir/clang");
        let start = t.0.join("ws/crates/backend-rocm");
        fs::create_dir_all(&start).unwrap();
        let path = env::join_paths([t.0.join("empty"), t.0.join("pathdir")]).unwrap();
        let mut vars = vec![
            ("HIP_CLANG", explicit.clone()),
            ("ROCM_PATH", t.0.join("rocm")),
            ("PATH", PathBuf::from(path)),
        ];

        assert_eq!(find(&vars, &start).unwrap(), explicit);
        vars.remove(0);
        assert_eq!(find(&vars, &start).unwrap(), rocm_clang);
        fs::remove_file(&rocm_clang).unwrap();
        assert_eq!(find(&vars, &start).unwrap(), rocm_amdclang);
        fs::remove_file(&rocm_amdclang).unwrap();
        assert_eq!(find(&vars, &start).unwrap(), rocm_hipcc);
        vars.remove(0);
        assert_eq!(find(&vars, &start).unwrap(), venv);
        // An empty .venv-hip falls through to PATH (and is named if nothing else is found).
        fs::remove_file(&venv).unwrap();
        assert_eq!(find(&vars, &start).unwrap(), path_amdclang);
        fs::remove_file(&path_amdclang).unwrap();
        assert_eq!(find(&vars, &start).unwrap(), path_hipcc);
        fs::remove_file(&path_hipcc).unwrap();
        // A plain `clang` on PATH is not taken.
        let err = find(&vars, &start).unwrap_err();
        assert!(
            err.contains("hip-clang inside")
                && err.contains("scripts/setup-hip.sh")
                && err.contains("HIP_CLANG"),
            "{err}"
        );
    }

    #[test]
    fn explicit_hip_clang() {
        let t = TempDir::new();
        let on_path = t.touch("bin/clang-19");
        t.touch("rocm/llvm/bin/clang++");
        let vars = [
            ("HIP_CLANG", PathBuf::from("clang-19")),
            ("PATH", t.0.join("bin")),
        ];
        assert_eq!(find(&vars, &t.0).unwrap(), on_path, "a command on PATH");
        let vars = [
            ("HIP_CLANG", t.0.join("nope/clang")),
            ("ROCM_PATH", t.0.join("rocm")),
        ];
        let err = find(&vars, &t.0).unwrap_err();
        assert!(
            err.starts_with("HIP_CLANG=") && err.contains("setup-hip.sh"),
            "a missing explicit compiler is an error, not a fall-through: {err}"
        );
        let vars = [
            ("HIP_CLANG", PathBuf::new()),
            ("ROCM_PATH", t.0.join("rocm")),
        ];
        assert!(
            find(&vars, &t.0).unwrap().ends_with("llvm/bin/clang++"),
            "empty = unset"
        );
    }

    #[test]
    fn target_ids() {
        let ok = |s: &str| check_hip_archs(&split_list(s)).is_ok();
        for good in [
            "gfx942",
            "gfx90a,gfx942",
            "gfx950 gfx1100",
            "gfx942:sramecc+:xnack-",
        ] {
            assert!(ok(good), "{good:?}");
        }
        for bad in [
            "",
            "gfx",
            "sm_90",
            "gfx94g",
            "gfx942:",
            "gfx942:xnack",
            "gfx942:XNACK-",
            "gfx942;rm",
        ] {
            assert!(!ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn elf_check() {
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[7] = 64;
        elf[18] = 224;
        assert!(check_amdgpu_elf(&elf).is_ok());
        elf[18] = 62; // x86-64
        assert!(check_amdgpu_elf(&elf).unwrap_err().contains("machine 62"));
        assert!(check_amdgpu_elf(b"\x7fELF").is_err());
    }

    /// The command line and the generated listing, with a stand-in compiler that records its
    /// arguments and writes a minimal AMDGPU ELF header; it rejects gfx950 like clang 19 does.
    #[cfg(unix)]
    #[test]
    fn compiler_command_line_and_listing() {
        use std::os::unix::fs::PermissionsExt;

        let t = TempDir::new();
        let fake = t.0.join("clang");
        let log = t.0.join("args");
        // 64 bytes: ELF magic, class 2, data 1, version 1, OS ABI 64, ..., e_machine 224.
        let script = format!(
            "#!/bin/sh\n\
             case \"$*\" in *gfx950*) echo \"error: invalid target ID 'gfx950'\" >&2; exit 1;; esac\n\
             case \"$*\" in *-fsyntax-only*) exit 0;; esac\n\
             printf '%s\\n' \"$@\" >> '{}'\n\
             while [ $# -gt 1 ]; do\n\
               [ \"$1\" = -o ] && {{ printf '\\177ELF\\002\\001\\001\\100'; head -c 10 /dev/zero; \
               printf '\\340'; head -c 45 /dev/zero; }} > \"$2\"\n\
               shift\n\
             done\n",
            log.display()
        );
        fs::write(&fake, script).unwrap();
        fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
        let src = t.touch("k/a.hip");
        t.touch("inc/x/y.h");

        let opts = HipOptions {
            name: "k".into(),
            source: src.clone(),
            include_dirs: vec![t.0.join("inc")],
            archs: Some(vec!["gfx90a".into(), "gfx942:xnack-".into()]),
            out_dir: Some(t.0.join("out")),
            compiler: Some(fake.clone()),
            cargo_directives: false,
        };
        let objs = compile_hip_code_objects(&opts).unwrap();
        let paths: Vec<PathBuf> = objs.iter().map(|o| o.path.clone()).collect();
        assert_eq!(
            paths,
            [
                t.0.join("out/k.gfx90a.hsaco"),
                t.0.join("out/k.gfx942_xnack-.hsaco")
            ]
        );
        let args = fs::read_to_string(&log).unwrap();
        let args: Vec<&str> = args.lines().collect();
        for want in [
            "--cuda-device-only",
            "--no-gpu-bundle-output",
            "-nogpuinc",
            "-nogpulib",
            "-nostdinc",
            "-O3",
            "-mcode-object-version=5",
            "-fno-gpu-flush-denormals-to-zero",
            "--offload-arch=gfx90a",
            "--offload-arch=gfx942:xnack-",
        ] {
            assert!(args.contains(&want), "{want} missing from {args:?}");
        }
        assert!(args.windows(2).any(|w| w == ["-x", "hip"]));
        let listing = fs::read_to_string(t.0.join("out/k.hip.rs")).unwrap();
        assert!(
            listing.contains("(\"gfx90a\", include_bytes!(") && listing.contains("gfx942_xnack-"),
            "{listing}"
        );

        // Default targets: gfx950 is optional and this compiler does not know it.
        let defaults = HipOptions {
            archs: None,
            ..opts.clone()
        };
        if env::var_os(HIP_ARCHS_ENV).is_none() {
            let objs = compile_hip_code_objects(&defaults).unwrap();
            let archs: Vec<&str> = objs.iter().map(|o| o.arch.as_str()).collect();
            assert_eq!(archs, DEFAULT_HIP_ARCHS);
        }

        // A required target it does not know fails, and says why.
        let required = HipOptions {
            archs: Some(vec!["gfx950".into()]),
            ..opts
        };
        let err = compile_hip_code_objects(&required).unwrap_err();
        assert!(
            err.contains("does not know gfx950") && err.contains("setup-hip.sh"),
            "{err}"
        );
    }
}
