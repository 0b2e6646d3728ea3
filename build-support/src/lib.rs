//! Build-script helpers for the GPU backends: find `nvcc` and compile one `.cu` file into one
//! fatbin that the crate embeds; find a HIP clang and compile one `.hip` file into one AMDGPU
//! code object per gfx target ([`compile_hip_code_objects`], module docs in `hip.rs`).
//!
//! A consumer's `build.rs`:
//!
//! ```no_run
//! use allreduce_build_support::{compile_fatbin, FatbinOptions};
//!
//! let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap(); // at run time, not env!
//! let root = std::path::Path::new(&manifest).join("../..");
//! let mut opts = FatbinOptions::new("allreduce", root.join("kernels-cuda/allreduce.cu"));
//! opts.include_dirs = vec![root.join("kernels-common/include"), root.join("kernels-cuda")];
//! if let Err(e) = compile_fatbin(&opts) {
//!     panic!("{e}");
//! }
//! ```
//!
//! and the crate embeds the result, whose name is always `<OUT_DIR>/<name>.fatbin`:
//!
//! ```ignore
//! static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/allreduce.fatbin"));
//! ```
//!
//! The fatbin holds SASS only, one cubin per architecture: the driver loads the matching one
//! without a JIT, and a missing architecture fails loudly at module load instead of silently
//! JIT-compiling PTX from a newer toolkit than the driver understands.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

mod hip;

pub use hip::{
    compile_hip_code_objects, find_hip_compiler, CodeObject, HipOptions, DEFAULT_HIP_ARCHS,
    HIP_ARCHS_ENV, HIP_VENV_DIR, OPTIONAL_HIP_ARCHS,
};

/// Architectures compiled when neither [`FatbinOptions::archs`] nor `ALLREDUCE_CUDA_ARCHS`
/// says otherwise: A100, H100/H200, B200.
pub const DEFAULT_ARCHS: &[&str] = &["sm_80", "sm_90", "sm_100"];

/// Overrides the architecture list, e.g. `ALLREDUCE_CUDA_ARCHS=sm_90` for a faster build.
pub const ARCHS_ENV: &str = "ALLREDUCE_CUDA_ARCHS";

/// The virtual environment `scripts/setup-cuda.sh` creates at the workspace root.
pub const VENV_DIR: &str = ".venv-cuda";

/// Everything that changes which nvcc runs or what it produces. NVCC_CCBIN and the
/// NVCC_*_FLAGS variables are read by nvcc itself.
const WATCHED_ENV: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    ARCHS_ENV,
    "NVCC_CCBIN",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
];

/// Finds nvcc: `$NVCC`, then `$CUDA_HOME/bin/nvcc`, `$CUDA_PATH/bin/nvcc`, then the
/// `.venv-cuda` of the nearest ancestor of `CARGO_MANIFEST_DIR` (the current directory if
/// unset) that has one, then `nvcc` on `PATH`.
///
/// The error says what was tried and how to get an nvcc.
pub fn find_nvcc() -> Result<PathBuf, String> {
    let start = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .or_else(|| env::current_dir().ok());
    find_nvcc_with(|k| env::var_os(k), start.as_deref())
}

fn nvcc_file_name() -> String {
    format!("nvcc{}", env::consts::EXE_SUFFIX)
}

/// [`find_nvcc`] with the environment and the starting directory passed in, for tests.
fn find_nvcc_with(
    var: impl Fn(&str) -> Option<OsString>,
    start: Option<&Path>,
) -> Result<PathBuf, String> {
    let var = |k: &str| var(k).filter(|v| !v.is_empty());
    let exe = nvcc_file_name();
    let mut tried = Vec::new();

    if let Some(v) = var("NVCC") {
        return explicit_compiler("NVCC", &v, var("PATH"), HOW_TO_GET_NVCC);
    }

    for key in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = var(key) {
            let p = Path::new(&dir).join("bin").join(&exe);
            if p.is_file() {
                return Ok(p);
            }
            tried.push(format!("{key}/bin: {}", p.display()));
        }
    }

    if let Some(venv) =
        start.and_then(|s| s.ancestors().map(|a| a.join(VENV_DIR)).find(|v| v.is_dir()))
    {
        if let Some(p) = venv_nvcc(&venv, &exe) {
            return Ok(p);
        }
        tried.push(format!(
            "{} (no nvidia/cu13/bin/{exe} inside)",
            venv.display()
        ));
    } else {
        tried.push(format!(
            "no {VENV_DIR} above {}",
            start.map_or("?".into(), |s| s.display().to_string())
        ));
    }

    if let Some(p) = search_path(var("PATH"), &exe) {
        return Ok(p);
    }
    tried.push("PATH".into());

    Err(format!(
        "nvcc not found (NVCC unset; looked at {}); {}",
        tried.join(", "),
        HOW_TO_GET_NVCC
    ))
}

const HOW_TO_GET_NVCC: &str = "to get one: install a CUDA toolkit (12.8 or newer) and set \
    CUDA_HOME, or run scripts/setup-cuda.sh (pinned CUDA 13.0 pip wheels, no GPU needed), or \
    set NVCC=/path/to/nvcc";

/// `<venv>/lib/python3.*/site-packages/nvidia/cu13/bin/nvcc`, newest Python first (`lib64`
/// only if `lib` has none: it is usually a symlink to `lib`).
fn venv_nvcc(venv: &Path, exe: &str) -> Option<PathBuf> {
    ["lib", "lib64"].iter().find_map(|lib| {
        let mut pythons: Vec<PathBuf> = fs::read_dir(venv.join(lib))
            .ok()?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        pythons
            .into_iter()
            .rev()
            .map(|py| py.join("site-packages/nvidia/cu13/bin").join(exe))
            .find(|p| p.is_file())
    })
}

/// A compiler named by a variable (`NVCC`, `HIP_CLANG`): a file, or a bare command on `PATH`.
/// One that does not exist is a mistake to report, not a hint to look elsewhere.
pub(crate) fn explicit_compiler(
    name: &str,
    value: &OsString,
    path: Option<OsString>,
    how_to_get: &str,
) -> Result<PathBuf, String> {
    let p = PathBuf::from(value);
    if p.is_file() {
        return Ok(p);
    }
    if p.components().count() == 1 {
        if let Some(found) = search_path(path, value) {
            return Ok(found);
        }
    }
    Err(format!(
        "{name}={} is not a file (nor a command on PATH); {how_to_get}",
        p.display()
    ))
}

pub(crate) fn search_path(path: Option<OsString>, exe: impl AsRef<Path>) -> Option<PathBuf> {
    env::split_paths(&path?)
        .map(|d| d.join(exe.as_ref()))
        .find(|p| p.is_file())
}

/// What a kernel compile takes, for either vendor: [`compile_fatbin`] (nvcc) and
/// [`compile_hip_code_objects`] (a HIP clang). The vendors differ in how they are driven, not
/// in what they are asked.
#[derive(Clone, Debug, Default)]
pub struct KernelOptions {
    /// File stem of the outputs: `<out_dir>/<name>.fatbin` (CUDA), or
    /// `<out_dir>/<name>.<arch>.hsaco` and `<out_dir>/<name>.hip.rs` (HIP).
    pub name: String,
    /// The one translation unit; it `#include`s everything else. (nvcc cannot put several
    /// sources into one `--fatbin` without relocatable device code, which we do not want.)
    pub source: PathBuf,
    /// `-I` directories. Every file under them is watched for changes.
    pub include_dirs: Vec<PathBuf>,
    /// Targets, all required. CUDA: `sm_XX` names (or bare `XX`); `None`:
    /// `ALLREDUCE_CUDA_ARCHS` (comma or space separated), else [`DEFAULT_ARCHS`]. HIP: gfx
    /// target IDs (`gfx942`, or with features `gfx942:xnack-`); `None`: `ALLREDUCE_HIP_ARCHS`,
    /// else [`DEFAULT_HIP_ARCHS`] plus those of [`OPTIONAL_HIP_ARCHS`] the compiler knows.
    pub archs: Option<Vec<String>>,
    /// `None`: `OUT_DIR` (set by cargo for build scripts).
    pub out_dir: Option<PathBuf>,
    /// `None`: [`find_nvcc`] or [`find_hip_compiler`].
    pub compiler: Option<PathBuf>,
    /// Print `cargo:rerun-if-*` and `cargo:warning` lines; on in build scripts, off in tests.
    pub cargo_directives: bool,
}

impl KernelOptions {
    /// Options for a build script: default targets, `OUT_DIR`, the compiler found on this
    /// machine, cargo directives on.
    pub fn new(name: impl Into<String>, source: impl Into<PathBuf>) -> Self {
        KernelOptions {
            name: name.into(),
            source: source.into(),
            cargo_directives: true,
            ..Default::default()
        }
    }
}

/// What [`compile_fatbin`] compiles.
pub type FatbinOptions = KernelOptions;

/// Compiles `opts.source` into `<out_dir>/<name>.fatbin` and returns that path.
///
/// Flags: `-O3 -std=c++17 -Xptxas -O3`, with `-prec-div=true -ftz=false` so f32 arithmetic
/// is IEEE (denormals kept), as the host reference computes it. FMA contraction stays on
/// (nvcc's default): the exact kernels only add, so there is nothing to contract, and code
/// that multiplies and must match the host bit for bit (the codecs) spells its rounding out
/// with `__fmul_rn`/`__fdiv_rn`/`__fadd_rn`, which are never contracted.
pub fn compile_fatbin(opts: &FatbinOptions) -> Result<PathBuf, String> {
    check_inputs(
        &opts.name,
        &opts.source,
        &opts.include_dirs,
        WATCHED_ENV,
        opts.cargo_directives,
    )?;
    let archs = match &opts.archs {
        Some(list) => list.clone(),
        None => match env::var(ARCHS_ENV) {
            Ok(v) if !v.trim().is_empty() => split_list(&v),
            _ => DEFAULT_ARCHS.iter().map(|s| s.to_string()).collect(),
        },
    };
    let gencodes = gencode_args(&archs)?;
    let out_dir = resolve_out_dir(opts.out_dir.as_deref())?;
    let nvcc = match &opts.compiler {
        Some(p) => p.clone(),
        None => find_nvcc()?,
    };

    fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let out = out_dir.join(format!("{}.fatbin", opts.name));
    // A stale file must not survive a failed compile and get embedded.
    let _ = fs::remove_file(&out);

    let mut cmd = Command::new(&nvcc);
    cmd.args(["--fatbin", "-O3", "-std=c++17", "-Xptxas", "-O3"])
        .args(["-prec-div=true", "-ftz=false"])
        .args(gencodes);
    for dir in &opts.include_dirs {
        cmd.arg("-I").arg(dir);
    }
    cmd.arg("-o").arg(&out).arg(&opts.source);

    let output = cmd
        .output()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!(
            "nvcc failed ({}): {cmd:?}\n{}{stderr}",
            output.status,
            String::from_utf8_lossy(&output.stdout)
        ));
    }
    if opts.cargo_directives {
        for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
            println!("cargo:warning=nvcc: {line}");
        }
    }
    match fs::metadata(&out) {
        Ok(m) if m.len() > 0 => Ok(out),
        _ => Err(format!(
            "nvcc succeeded but wrote no {}: {cmd:?}",
            out.display()
        )),
    }
}

/// What every compile does first: prints the `cargo:rerun-if-*` lines for the source, every
/// file under the include directories and `watched_env`; checks that the include directories
/// and the source exist and that `name` is a plain file stem.
fn check_inputs(
    name: &str,
    source: &Path,
    include_dirs: &[PathBuf],
    watched_env: &[&str],
    cargo_directives: bool,
) -> Result<(), String> {
    if cargo_directives {
        for key in watched_env {
            println!("cargo:rerun-if-env-changed={key}");
        }
        println!("cargo:rerun-if-changed={}", source.display());
    }
    let mut watched = Vec::new();
    for dir in include_dirs {
        if !dir.is_dir() {
            return Err(format!(
                "include directory {} does not exist",
                dir.display()
            ));
        }
        walk_files(dir, &mut watched).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    }
    if cargo_directives {
        watched.sort();
        for f in &watched {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }

    if name.is_empty() || name.contains(['/', '\\']) {
        return Err(format!("output name {name:?} must be a plain file stem"));
    }
    if !source.is_file() {
        return Err(format!("kernel source {} does not exist", source.display()));
    }
    Ok(())
}

/// `out_dir`, else `OUT_DIR` (set by cargo for build scripts).
fn resolve_out_dir(out_dir: Option<&Path>) -> Result<PathBuf, String> {
    match out_dir {
        Some(d) => Ok(d.to_path_buf()),
        None => env::var_os("OUT_DIR")
            .map(PathBuf::from)
            .ok_or_else(|| "OUT_DIR is not set (not in a build script?)".to_string()),
    }
}

fn split_list(s: &str) -> Vec<String> {
    s.split([',', ' ', ';'])
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

/// `sm_90` (or `90`, `sm_90a`) -> `-gencode arch=compute_90,code=sm_90`.
fn gencode_args(archs: &[String]) -> Result<Vec<String>, String> {
    if archs.is_empty() {
        return Err("empty CUDA architecture list".into());
    }
    let mut args = Vec::new();
    for a in archs {
        let a = a.trim();
        let num = a.strip_prefix("sm_").unwrap_or(a);
        let digits = num.trim_end_matches(['a', 'f']);
        if digits.is_empty()
            || !digits.bytes().all(|b| b.is_ascii_digit())
            || num.len() > digits.len() + 1
        {
            return Err(format!(
                "bad CUDA architecture {a:?} (want e.g. sm_90; set via {ARCHS_ENV}=sm_80,sm_90)"
            ));
        }
        args.push("-gencode".to_string());
        args.push(format!("arch=compute_{num},code=sm_{num}"));
    }
    Ok(args)
}

fn walk_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            walk_files(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    pub(crate) struct TempDir(pub(crate) PathBuf);

    impl TempDir {
        pub(crate) fn new() -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let p = env::temp_dir().join(format!("ar-build-support-{}-{n}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }

        /// Creates an empty file at `rel` (and its parents) and returns its path.
        pub(crate) fn touch(&self, rel: &str) -> PathBuf {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, b"").unwrap();
            p
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn find(vars: &[(&str, PathBuf)], start: &Path) -> Result<PathBuf, String> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone().into_os_string()))
            .collect();
        find_nvcc_with(|k| map.get(k).cloned(), Some(start))
    }

    const VENV_NVCC: &str = "ws/.venv-cuda/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc";

    /// Every location populated; removing the winner each time walks the search order.
    #[test]
    fn search_order() {
        let t = TempDir::new();
        let explicit = t.touch("explicit/nvcc");
        let home = t.touch("home/bin/nvcc");
        let cuda_path = t.touch("cudapath/bin/nvcc");
        let venv = t.touch(VENV_NVCC);
        let on_path = t.touch("pathdir/nvcc");
        let start = t.0.join("ws/crates/backend-cuda");
        fs::create_dir_all(&start).unwrap();
        let path = env::join_paths([t.0.join("empty"), t.0.join("pathdir")]).unwrap();
        let mut vars = vec![
            ("NVCC", explicit.clone()),
            ("CUDA_HOME", t.0.join("home")),
            ("CUDA_PATH", t.0.join("cudapath")),
            ("PATH", PathBuf::from(path)),
        ];

        assert_eq!(find(&vars, &start).unwrap(), explicit);
        vars.remove(0);
        assert_eq!(find(&vars, &start).unwrap(), home);
        vars.remove(0);
        assert_eq!(find(&vars, &start).unwrap(), cuda_path);
        vars.remove(0);
        assert_eq!(find(&vars, &start).unwrap(), venv);
        assert_eq!(
            find(&vars, &t.0.join("ws")).unwrap(),
            venv,
            "the root itself counts"
        );
        fs::remove_file(&venv).unwrap();
        assert_eq!(find(&vars, &start).unwrap(), on_path);
        fs::remove_file(&on_path).unwrap();
        let err = find(&vars, &start).unwrap_err();
        assert!(
            err.contains("scripts/setup-cuda.sh") && err.contains("NVCC="),
            "{err}"
        );
    }

    #[test]
    fn toolkit_dir_without_nvcc_falls_through() {
        let t = TempDir::new();
        fs::create_dir_all(t.0.join("home/bin")).unwrap();
        let cuda_path = t.touch("cudapath/bin/nvcc");
        let vars = [
            ("CUDA_HOME", t.0.join("home")),
            ("CUDA_PATH", t.0.join("cudapath")),
        ];
        assert_eq!(find(&vars, &t.0).unwrap(), cuda_path);
    }

    #[test]
    fn empty_variables_count_as_unset() {
        let t = TempDir::new();
        let home = t.touch("home/bin/nvcc");
        let vars = [("NVCC", PathBuf::new()), ("CUDA_HOME", t.0.join("home"))];
        assert_eq!(find(&vars, &t.0).unwrap(), home);
    }

    #[test]
    fn explicit_nvcc_that_is_missing_is_an_error() {
        let t = TempDir::new();
        t.touch("home/bin/nvcc");
        let vars = [
            ("NVCC", t.0.join("nope/nvcc")),
            ("CUDA_HOME", t.0.join("home")),
        ];
        let err = find(&vars, &t.0).unwrap_err();
        assert!(
            err.starts_with("NVCC=") && err.contains("setup-cuda.sh"),
            "{err}"
        );
    }

    #[test]
    fn explicit_nvcc_may_name_a_command_on_path() {
        let t = TempDir::new();
        let on_path = t.touch("bin/nvcc-13");
        let vars = [
            ("NVCC", PathBuf::from("nvcc-13")),
            ("PATH", t.0.join("bin")),
        ];
        assert_eq!(find(&vars, &t.0).unwrap(), on_path);
    }

    #[test]
    fn nearest_venv_wins_and_an_empty_one_is_reported() {
        let t = TempDir::new();
        let outer = t.touch(VENV_NVCC);
        fs::create_dir_all(t.0.join("ws/inner/.venv-cuda/lib/python3.12")).unwrap();
        let start = t.0.join("ws/inner/crate");
        fs::create_dir_all(&start).unwrap();
        // The nearest .venv-cuda is the one that counts, even when it is broken: the error
        // then points at it rather than silently using an older one further up.
        let err = find(&[], &start).unwrap_err();
        assert!(err.contains("inner/.venv-cuda"), "{err}");
        assert_eq!(find(&[], &t.0.join("ws/crate")).unwrap(), outer);
    }

    #[test]
    fn arch_lists() {
        let g = |s: &str| gencode_args(&split_list(s));
        assert_eq!(
            g("sm_80,sm_90").unwrap(),
            [
                "-gencode",
                "arch=compute_80,code=sm_80",
                "-gencode",
                "arch=compute_90,code=sm_90"
            ]
        );
        assert_eq!(g("90a").unwrap()[1], "arch=compute_90a,code=sm_90a");
        assert_eq!(g(" sm_100 ").unwrap()[1], "arch=compute_100,code=sm_100");
        for bad in ["", "sm_", "compute_90", "sm_9x", "sm_90aa", "90;rm -rf"] {
            assert!(g(bad).is_err(), "{bad:?}");
        }
    }

    /// The command line, checked with a stand-in nvcc that records its arguments.
    #[cfg(unix)]
    #[test]
    fn nvcc_command_line() {
        use std::os::unix::fs::PermissionsExt;

        let t = TempDir::new();
        let fake = t.0.join("nvcc");
        let log = t.0.join("args");
        let script = format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{}'\n\
             while [ $# -gt 1 ]; do [ \"$1\" = -o ] && printf x > \"$2\"; shift; done\n",
            log.display()
        );
        fs::write(&fake, script).unwrap();
        fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
        let src = t.touch("k/a.cu");
        t.touch("inc/x/y.h");

        let opts = FatbinOptions {
            name: "k".into(),
            source: src.clone(),
            include_dirs: vec![t.0.join("inc")],
            archs: Some(vec!["sm_90".into()]),
            out_dir: Some(t.0.join("out")),
            compiler: Some(fake),
            cargo_directives: false,
        };
        let out = compile_fatbin(&opts).unwrap();
        assert_eq!(out, t.0.join("out/k.fatbin"));
        let args = fs::read_to_string(&log).unwrap();
        let args: Vec<&str> = args.lines().collect();
        for want in [
            "--fatbin",
            "-O3",
            "-std=c++17",
            "-prec-div=true",
            "-ftz=false",
        ] {
            assert!(args.contains(&want), "{want} missing from {args:?}");
        }
        assert!(args.windows(2).any(|w| w == ["-Xptxas", "-O3"]));
        assert!(args
            .windows(2)
            .any(|w| w == ["-gencode", "arch=compute_90,code=sm_90"]));
        assert_eq!(args.last(), Some(&src.to_str().unwrap()));

        let missing = FatbinOptions {
            include_dirs: vec![t.0.join("nope")],
            ..opts
        };
        assert!(compile_fatbin(&missing).unwrap_err().contains("nope"));
    }
}
