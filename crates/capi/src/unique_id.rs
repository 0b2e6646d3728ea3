//! `ar_unique_id_t`: what `ar_comm_init_rank` needs to find the group's other processes, as
//! NCCL's unique id is. It holds the port rank 0 will listen on (loopback) and the group's
//! bootstrap secret, so every process that has it can join and nothing else can.

use std::ffi::c_char;
use std::net::{Ipv4Addr, TcpListener};

use allreduce::Error;
use allreduce_bootstrap::{Secret, TcpBootstrap, TcpBootstrapConfig, SECRET_LEN, TIMEOUT_ENV};

use crate::call::{self, Failure};
use crate::codes::ar_result_t;

/// Bytes in an `ar_unique_id_t` (NCCL's `NCCL_UNIQUE_ID_BYTES`).
pub const AR_UNIQUE_ID_BYTES: usize = 128;

/// The rendezvous of a group with one process per rank. Made once, by
/// `ar_get_unique_id` on one process, and handed as plain bytes to every process of the
/// group (through MPI, torch.distributed, a file, ...). It contains the group's secret: give
/// it to the group's processes only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ar_unique_id_t {
    pub internal: [c_char; AR_UNIQUE_ID_BYTES],
}

const MAGIC: &[u8; 4] = b"ARID";
const VERSION: u8 = 1;
const PORT_AT: usize = 6;
const SECRET_AT: usize = 8;

/// What an id carries.
pub struct Rendezvous {
    pub port: u16,
    pub secret: Secret,
}

impl Rendezvous {
    fn encode(&self) -> ar_unique_id_t {
        let mut bytes = [0u8; AR_UNIQUE_ID_BYTES];
        bytes[..4].copy_from_slice(MAGIC);
        bytes[4] = VERSION;
        bytes[PORT_AT..PORT_AT + 2].copy_from_slice(&self.port.to_le_bytes());
        bytes[SECRET_AT..SECRET_AT + SECRET_LEN].copy_from_slice(self.secret.as_bytes());
        ar_unique_id_t {
            internal: bytes.map(|b| b as c_char),
        }
    }

    pub fn decode(id: &ar_unique_id_t) -> Result<Self, Failure> {
        let bytes = id.internal.map(|c| c as u8);
        if &bytes[..4] != MAGIC || bytes[4] != VERSION {
            return Err(Error::InvalidArgument(
                "the ar_unique_id_t was not made by ar_get_unique_id of this library version"
                    .into(),
            )
            .into());
        }
        let port = u16::from_le_bytes([bytes[PORT_AT], bytes[PORT_AT + 1]]);
        let mut secret = [0u8; SECRET_LEN];
        secret.copy_from_slice(&bytes[SECRET_AT..SECRET_AT + SECRET_LEN]);
        Ok(Rendezvous {
            port,
            secret: Secret::from_bytes(secret),
        })
    }

    /// Join the group as `rank` of `world` (every rank waits for all the others, up to the
    /// bootstrap's deadline).
    /// This rank's end of the rendezvous, waiting at most `ALLREDUCE_BOOTSTRAP_TIMEOUT_S`
    /// (60 s by default) for the others, as `ar_comm_init_env` does.
    pub fn join(&self, rank: usize, world: usize) -> Result<TcpBootstrap, Failure> {
        let timeout = allreduce_bootstrap::timeout_from(std::env::var(TIMEOUT_ENV).ok())?;
        let config = TcpBootstrapConfig::new(rank, world, self.port)
            .secret(self.secret.clone())
            .timeout(timeout);
        Ok(TcpBootstrap::new(config)?)
    }
}

/// A port free now on loopback. Rank 0 binds it again when it joins; in between another
/// program could take it, and rank 0's join then fails (`AR_BOOTSTRAP_ERROR`) rather than
/// admitting it, since joining needs the secret.
fn free_port() -> Result<u16, Failure> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| Error::Bootstrap {
        detail: format!("no free loopback port for the rendezvous: {e}"),
    })?;
    let port = listener
        .local_addr()
        .map_err(|e| Error::Bootstrap {
            detail: format!("no local address for the rendezvous port: {e}"),
        })?
        .port();
    Ok(port)
}

/// Make a new group's id (NCCL's `ncclGetUniqueId`): call it on one process, then give the
/// bytes to every process of the group before they call `ar_comm_init_rank`. The group meets
/// on this host's loopback interface; a group spanning hosts uses `ar_comm_init_env`. Each
/// call makes a fresh secret. Thread-safe.
///
/// # Safety
/// `id` must be null (refused) or point to writable memory for one `ar_unique_id_t`.
#[no_mangle]
pub unsafe extern "C" fn ar_get_unique_id(id: *mut ar_unique_id_t) -> ar_result_t {
    call::run(|| {
        if id.is_null() {
            return Err(Failure::usage("id is null"));
        }
        let rendezvous = Rendezvous {
            port: free_port()?,
            secret: Secret::generate()?,
        };
        // SAFETY: checked non-null above; the caller promises it is writable.
        unsafe { call::write_out(id, "id", rendezvous.encode()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_round_trips_and_a_foreign_one_is_refused() {
        let mut id = ar_unique_id_t {
            internal: [0; AR_UNIQUE_ID_BYTES],
        };
        // SAFETY: `id` is a valid, writable id.
        assert_eq!(
            unsafe { ar_get_unique_id(&mut id) },
            ar_result_t::AR_SUCCESS
        );
        let r = Rendezvous::decode(&id).unwrap();
        assert_ne!(r.port, 0);
        let mut other = id;
        // SAFETY: as above.
        assert_eq!(
            unsafe { ar_get_unique_id(&mut other) },
            ar_result_t::AR_SUCCESS
        );
        assert_ne!(
            Rendezvous::decode(&other).unwrap().secret,
            r.secret,
            "every id has its own secret"
        );
        let zero = ar_unique_id_t {
            internal: [0; AR_UNIQUE_ID_BYTES],
        };
        let e = Rendezvous::decode(&zero).err().unwrap();
        assert_eq!(e.code, ar_result_t::AR_INVALID_ARGUMENT);
        // SAFETY: null is refused before any write.
        let code = unsafe { ar_get_unique_id(std::ptr::null_mut()) };
        assert_eq!(code, ar_result_t::AR_INVALID_USAGE);
    }
}
