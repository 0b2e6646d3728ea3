//! Rendezvous for multi-process groups: the built-in implementation of
//! [`allreduce_core::Bootstrap`].
//!
//! Inference servers (vLLM, SGLang, TensorRT-LLM, mistral.rs) run one process per GPU. Before
//! those processes can build a communicator they must exchange a few bytes (addresses, handles,
//! an NCCL unique id), the way `ncclCommInitRank` needs a unique id handed around by the
//! caller. [`Bootstrap`](allreduce_core::Bootstrap) is that exchange: `all_gather` and
//! `broadcast` of small byte messages. Callers that already have one (MPI, torch.distributed,
//! a key-value store) implement the trait over it; everyone else uses [`TcpBootstrap`].
//!
//! ```no_run
//! use allreduce_core::Bootstrap;
//! use allreduce_bootstrap::TcpBootstrap;
//!
//! // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them, plus
//! // ALLREDUCE_BOOTSTRAP_SECRET (64 hex digits, the same for every rank).
//! let mut boot = TcpBootstrap::from_env()?;
//! let everyone = boot.all_gather(format!("pid {}", std::process::id()).as_bytes())?;
//! let id = boot.broadcast(0, b"an NCCL unique id, say")?;
//! # Ok::<(), allreduce_core::Error>(())
//! ```
//!
//! `examples/torchrun_like.rs` shows a launcher starting the processes.
//!
//! # Configuration
//!
//! [`TcpBootstrapConfig::from_env`] follows torchrun: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` (`LOCAL_RANK` is kept for device selection), plus
//! `ALLREDUCE_BOOTSTRAP_SECRET`, `ALLREDUCE_BOOTSTRAP_TIMEOUT_S` (default 60),
//! `ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE` and `ALLREDUCE_BOOTSTRAP_PORT` (used instead of
//! `MASTER_PORT`, for jobs where torch.distributed already listens there).
//!
//! # Topology
//!
//! A star through rank 0: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank opens
//! one connection to it. In a collective each rank sends its part to rank 0, which answers
//! every rank with the result (all parts, or the root's). The messages are small (addresses,
//! ids; at most `max_message`, 16 MiB by default), so two hops through one process beat the
//! setup cost of a mesh. Rank 0 stops listening as soon as every rank has joined.
//!
//! # Security: the per-group secret
//!
//! Any process on the host can connect to a loopback port, so rank 0 admits only connections
//! that prove they know the group's 32-byte secret, and ranks only trust a rank 0 that proves
//! it too (a process that took the port first cannot pose as rank 0). The secret comes from
//! [`TcpBootstrapConfig::secret`] or, if that is unset, `ALLREDUCE_BOOTSTRAP_SECRET`: a
//! launcher generates one per group (`openssl rand -hex 32`, or [`Secret::generate`]) and
//! gives it to every rank. Without one, [`TcpBootstrap::new`] fails and says how to set it;
//! there is no unauthenticated mode. The secret never travels on the wire.
//!
//! Handshake (HMAC is HMAC-SHA256, from RustCrypto's `hmac` and `sha2`, keyed by the secret;
//! integers are little-endian; `||` is concatenation):
//!
//! 1. rank 0 → rank r, 40 bytes: `"ARBS"`, version `1` (u16), 0 (u16), a 32-byte nonce `Ns`
//!    from `/dev/urandom`.
//! 2. rank r → rank 0, 80 bytes: `"ARBC"`, version (u16), 0 (u16), rank (u32), world size
//!    (u32), its own nonce `Nc` (32 bytes), `HMAC("allreduce-bootstrap/1 client proof" || Ns
//!    || Nc || rank || world)`.
//! 3. rank 0 checks the proof (constant-time comparison) before anything else, then that the
//!    rank is not 0 (rank 0 is itself), the world size, the rank's range and that no other
//!    connection holds the rank. It answers `"ARBA"`, status (u8: 0 accepted, 1 refused), 0
//!    (u8), body length (u16), body: if accepted, `HMAC("allreduce-bootstrap/1 server proof"
//!    || Ns || Nc || rank || world)`, which rank r checks; if refused, the reason (at most 512
//!    bytes), and rank r fails with it at once.
//! 4. When all ranks have joined, rank 0 sends each a `Ready` frame; [`TcpBootstrap::new`]
//!    returns on every rank.
//!
//! Both nonces make every connection's proofs and keys fresh, so a recorded handshake or frame
//! cannot be replayed.
//!
//! # Refused joins
//!
//! A connection that speaks the protocol but is refused is a rank started with the wrong
//! settings: another `WORLD_SIZE`, a `RANK` out of range or given twice (`RANK=0` included:
//! rank 0 is the listener), another build of the protocol, or another secret while claiming a
//! rank this group still waits for. Waiting cannot complete such a group, so rank 0 fails at
//! once with `Error::Bootstrap` naming the connection and the reason, and sends the ranks
//! already admitted a `Fail` frame, so they fail at once too with the same reason; the refused
//! rank has its answer. Ranks that have not connected yet find no rank 0 and wait out their
//! deadline (a launcher such as torchrun stops them when a rank fails). This makes any local
//! process able to stop a group it can reach, which it already can by taking the port first:
//! the secret guards who joins and what is exchanged, not whether the group forms.
//!
//! Connections that are no rank of this group are only dropped and logged with
//! `tracing::warn!`, and rank 0 keeps accepting: garbage (closed unanswered), silence (each
//! handshake runs in its own thread with at most 10 s, so it blocks nobody), or another secret
//! with a claim that does not fit this group (another group's rank on the same port, which is
//! told why). [`TcpBootstrap::refused_connections`] lists them, and a rendezvous that times
//! out repeats the latest in its error.
//!
//! A rank 0 that cannot bind its port because it is taken asks the holder, with a hello
//! claiming rank 0: this group's rank 0 refuses it as "rank 0 given twice" (and fails too),
//! another group's rank 0 refuses its secret, and anything else does not greet like a rank
//! 0; the error says which.
//!
//! # Frames
//!
//! After the handshake every message is a frame:
//!
//! | bytes | field |
//! |---|---|
//! | 1 | kind: 1 `Contrib` (a rank's part), 2 `Reject` (the rank refused its own arguments; payload: why), 3 `Result`, 4 `Fail` (payload: code u8, rank u32, waited ms u64, reason), 5 `Ready` |
//! | 1 | collective: 0 none, 1 all_gather, 2 broadcast |
//! | 2 | reserved, zero |
//! | 4 | broadcast root (u32) |
//! | 8 | sequence number (u64): 0 for `Ready`, then 1, 2, ... one per collective |
//! | 8 | payload length (u64) |
//! | n | payload (an all_gather `Result`: rank count u32, then per rank length u64 and bytes) |
//! | 32 | tag: HMAC over header and payload, keyed per connection and direction |
//!
//! The length is checked against the limit before anything is allocated, the tag before
//! anything is interpreted. Every collective checks the sequence number and the collective
//! (and root): ranks that call different collectives all get `Error::RankMismatch` and stay
//! usable; a frame from another call, a bad tag or an oversized frame from a member breaks the
//! group (`Error::Bootstrap` at rank 0, `Error::Aborted` elsewhere), because its stream can no
//! longer be trusted to be in step. No rank ever returns another call's bytes.
//!
//! # Deadlines
//!
//! The rendezvous and each collective have `timeout` (default 60 s). Every socket read and
//! write re-arms its timeout to what is left, so nothing blocks past the deadline. A rank that
//! never arrives makes rank 0 fail with `Error::Timeout` naming the missing ranks, and rank 0
//! tells the ranks that did arrive, which fail with `Error::Timeout` too (or time out on their
//! own, whichever is first). After a timeout or a lost peer every later call fails with
//! `Error::Aborted`; build a new group.
//!
//! # Why loopback by default
//!
//! Rank 0 listens only if `MASTER_ADDR` resolves to loopback addresses unless
//! `allow_remote` / `ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE=1` says otherwise (and then it binds
//! that address, not every interface). The frames are authenticated, not encrypted: a group
//! confined to one host exposes nothing to the network, which is the common tensor-parallel
//! case (one node, several GPUs). A group spanning hosts opts in on every rank.

mod config;
mod mac;
mod secret;
mod tcp;
mod wire;

pub use config::{
    timeout_from, TcpBootstrapConfig, ALLOW_REMOTE_ENV, MAX_BOOTSTRAP_WORLD, PORT_ENV, TIMEOUT_ENV,
};
pub use secret::{Secret, SECRET_ENV, SECRET_LEN};
pub use tcp::TcpBootstrap;

/// The keyed hash behind the handshake, exposed for tests and for launchers that want to
/// derive per-group secrets from a master key (`mac(master, &[group name])`).
pub mod crypto {
    pub use crate::mac::{mac, sha256, verify, DIGEST_LEN};
}
