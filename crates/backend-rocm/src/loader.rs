//! Opening a vendor library at run time: the candidate list, and one error that names every
//! path tried. Shared by the HIP and RCCL `sys` layers.

use std::path::PathBuf;

/// Where to look for a library: an explicit path from `env_override` if set (and nothing
/// else), else each soname as given (the dynamic loader's search: `LD_LIBRARY_PATH`, the
/// ld.so cache), then under `$ROCM_PATH/lib` and `/opt/rocm/lib`.
pub fn candidates(env_override: &str, sonames: &[&str]) -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os(env_override).filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut out: Vec<PathBuf> = sonames.iter().map(PathBuf::from).collect();
    let mut dirs = Vec::new();
    if let Some(rocm) = std::env::var_os("ROCM_PATH").filter(|p| !p.is_empty()) {
        dirs.push(PathBuf::from(rocm).join("lib"));
    }
    dirs.push(PathBuf::from("/opt/rocm/lib"));
    for d in dirs {
        for s in sonames {
            let p = d.join(s);
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// Open the first candidate that loads. The error lists every candidate with its reason.
pub fn open_first(
    candidates: &[PathBuf],
) -> Result<(libloading::Library, String), Vec<(String, String)>> {
    let mut tried = Vec::new();
    for c in candidates {
        // SAFETY: loading a vendor runtime runs its initialisers, which is what using it
        // means; nothing else of ours runs concurrently with them.
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => return Ok((lib, c.display().to_string())),
            Err(e) => {
                // libloading's message is "dlopen failed"; the loader's reason is its source.
                let why = match std::error::Error::source(&e) {
                    Some(s) => s.to_string(),
                    None => e.to_string(),
                };
                tried.push((c.display().to_string(), why))
            }
        }
    }
    Err(tried)
}

/// "tried a, b, c (a: reason)" — the first reason only: the others are nearly always the
/// same "cannot open shared object file".
pub fn describe_tried(tried: &[(String, String)]) -> String {
    let names: Vec<&str> = tried.iter().map(|(p, _)| p.as_str()).collect();
    match tried.first() {
        Some((_, why)) => format!("tried {} (first failure: {why})", names.join(", ")),
        None => "no candidates".into(),
    }
}

/// Declares a library's function table: a `Lib` struct of `unsafe extern "C" fn` pointers
/// filled by `Lib::from_library` (every symbol must resolve, or the error names the first
/// that does not), and `SYMBOLS`, the names in declaration order.
macro_rules! function_table {
    ($( $(#[$doc:meta])* fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty ; )*) => {
        /// The loaded library and every function this crate calls.
        #[allow(non_snake_case)]
        pub struct Lib {
            _library: libloading::Library,
            /// The path or soname it was opened by.
            pub path: String,
            $( $(#[$doc])* pub $name: unsafe extern "C" fn($($ty),*) -> $ret, )*
        }

        /// Every symbol `Lib` resolves, in declaration order.
        pub const SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl Lib {
            /// Resolve every symbol of `library`.
            ///
            /// # Safety
            /// `library` must be the vendor library whose C signatures the table declares.
            #[allow(non_snake_case)]
            pub unsafe fn from_library(library: libloading::Library, path: String)
                -> Result<Self, String>
            {
                $(
                    let $name = *library
                        .get::<unsafe extern "C" fn($($ty),*) -> $ret>(stringify!($name))
                        .map_err(|e| format!("{path} lacks {}: {e}", stringify!($name)))?;
                )*
                Ok(Lib { _library: library, path, $($name),* })
            }
        }
    };
}

pub(crate) use function_table;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_try_sonames_then_rocm_dirs() {
        let c = candidates("ALLREDUCE_TEST_NO_SUCH_OVERRIDE", &["libx.so", "libx.so.7"]);
        let s: Vec<String> = c.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(&s[..2], &["libx.so", "libx.so.7"]);
        assert!(s.contains(&"/opt/rocm/lib/libx.so.7".to_string()), "{s:?}");
    }

    #[test]
    fn a_missing_library_is_an_error_naming_what_was_tried() {
        let c = vec![
            PathBuf::from("liballreduce_no_such_lib.so.7"),
            PathBuf::from("/nonexistent/liballreduce_no_such_lib.so"),
        ];
        let tried = open_first(&c).expect_err("nothing to open");
        let msg = describe_tried(&tried);
        assert!(msg.contains("liballreduce_no_such_lib.so.7"), "{msg}");
        assert!(
            msg.contains("/nonexistent/liballreduce_no_such_lib.so"),
            "{msg}"
        );
    }
}
