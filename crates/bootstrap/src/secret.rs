//! The per-group secret and the operating system's random bytes.

use std::fmt;
use std::io::Read;

use allreduce_core::{Error, Result};

/// Bytes in a [`Secret`].
pub const SECRET_LEN: usize = 32;

/// The environment variable a launcher sets, to the same value for every rank of a group:
/// 64 hexadecimal digits (32 bytes).
pub const SECRET_ENV: &str = "ALLREDUCE_BOOTSTRAP_SECRET";

/// The 32-byte key every rank of a group shares. Rank 0 admits a connection only if it proves
/// knowledge of this key (see the crate documentation); it never travels on the wire.
///
/// `Debug` prints a fingerprint, never the key, so logging a configuration leaks nothing.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; SECRET_LEN]);

impl Secret {
    pub fn from_bytes(bytes: [u8; SECRET_LEN]) -> Self {
        Secret(bytes)
    }

    /// A fresh secret from the operating system's random source (what a launcher does once per
    /// group before starting the ranks).
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; SECRET_LEN];
        random_bytes(&mut bytes)?;
        Ok(Secret(bytes))
    }

    /// Parses 64 hexadecimal digits (either case; surrounding whitespace is ignored, so
    /// `$(openssl rand -hex 32)` and a file with a trailing newline both work).
    pub fn from_hex(text: &str) -> Result<Self> {
        let text = text.trim();
        let bad = |why: &str| {
            Error::InvalidConfig(format!(
                "{SECRET_ENV} must be {} hexadecimal digits ({SECRET_LEN} bytes), e.g. from \
                 `openssl rand -hex 32`; {why}",
                2 * SECRET_LEN
            ))
        };
        if text.len() != 2 * SECRET_LEN {
            return Err(bad(&format!("got {} characters", text.len())));
        }
        let mut bytes = [0u8; SECRET_LEN];
        for (i, pair) in text.as_bytes().chunks_exact(2).enumerate() {
            let digit = |c: u8| (c as char).to_digit(16);
            match (digit(pair[0]), digit(pair[1])) {
                (Some(h), Some(l)) => bytes[i] = (h * 16 + l) as u8,
                _ => return Err(bad("found a character that is not a hexadecimal digit")),
            }
        }
        Ok(Secret(bytes))
    }

    /// The 64-digit lowercase hexadecimal form [`Secret::from_hex`] reads, for handing to ranks
    /// through [`SECRET_ENV`].
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn as_bytes(&self) -> &[u8; SECRET_LEN] {
        &self.0
    }

    /// A short public identifier of the key (a hash of it), for comparing configurations in
    /// logs without revealing the key.
    pub fn fingerprint(&self) -> String {
        let h = crate::mac::sha256(&self.0);
        h[..4].iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(fingerprint {})", self.fingerprint())
    }
}

/// Fills `buf` from `/dev/urandom` (nonces and generated secrets must be unpredictable; std
/// has no public CSPRNG and the crate takes no dependency for one).
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::Bootstrap {
            detail: format!("cannot read random bytes from /dev/urandom: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        let s = Secret::generate().unwrap();
        assert_eq!(Secret::from_hex(&s.to_hex()).unwrap(), s);
        assert_eq!(
            Secret::from_hex(&format!(" {}\n", s.to_hex().to_uppercase())).unwrap(),
            s
        );
        assert!(Secret::from_hex("abcd").is_err());
        let bad = "g".repeat(64);
        let err = Secret::from_hex(&bad).unwrap_err().to_string();
        assert!(err.contains("hexadecimal"), "{err}");
        // Multi-byte characters must not be split into pairs of bytes and accepted.
        assert!(Secret::from_hex(&"é".repeat(32)).is_err());
    }

    #[test]
    fn debug_does_not_print_the_key() {
        let s = Secret::from_bytes([0xab; 32]);
        let shown = format!("{s:?}");
        assert!(!shown.contains("abab"), "{shown}");
        assert!(shown.contains(&s.fingerprint()));
    }

    #[test]
    fn generated_secrets_differ() {
        assert_ne!(Secret::generate().unwrap(), Secret::generate().unwrap());
    }
}
