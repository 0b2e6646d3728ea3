//! HMAC-SHA256 for the handshake's proofs, the per-connection keys and the frame tags, over
//! RustCrypto's `hmac` and `sha2` (docs/decisions.md says why not our own).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Bytes in a tag (a SHA-256 digest).
pub const DIGEST_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

fn keyed(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length (longer ones are hashed first), so this cannot fail.
    let mut h = <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC accepts any key length");
    for part in parts {
        h.update(part);
    }
    h
}

/// `HMAC-SHA256(key, parts[0] || parts[1] || ...)`.
pub fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; DIGEST_LEN] {
    keyed(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` is `mac(key, parts)`. The comparison takes the same time wherever the tags
/// differ, so a peer cannot learn a valid tag byte by byte from response times.
pub fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    keyed(key, parts).verify_slice(tag).is_ok()
}

/// The SHA-256 digest of `data`.
pub fn sha256(data: &[u8]) -> [u8; DIGEST_LEN] {
    use sha2::Digest;
    Sha256::digest(data).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn sha256_standard_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn hmac_rfc4231_vectors() {
        // Test case 1.
        assert_eq!(
            hex(&mac(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2: a key shorter than the block, the message in two parts.
        assert_eq!(
            hex(&mac(b"Jefe", &[b"what do ya want ", b"for nothing?"])),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block is hashed first.
        assert_eq!(
            hex(&mac(
                &[0xaa; 131],
                &[b"Test Using Larger Than Block-Size Key - Hash Key First"]
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn verify_accepts_only_the_tag() {
        let tag = mac(b"key", &[b"head", b"payload"]);
        assert!(verify(b"key", &[b"headpay", b"load"], &tag));
        let mut bad = tag;
        bad[31] ^= 1;
        assert!(!verify(b"key", &[b"head", b"payload"], &bad));
        assert!(!verify(b"other", &[b"head", b"payload"], &tag));
        assert!(!verify(b"key", &[b"head", b"payload"], &tag[..31]));
        assert!(!verify(b"key", &[b"head", b"payload"], &[]));
    }
}
