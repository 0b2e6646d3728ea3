//! [`TcpBootstrap`]: rendezvous through rank 0 and star-shaped collectives.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use allreduce_core::{Bootstrap, Error, Result};

use crate::config::TcpBootstrapConfig;
use crate::secret::{Secret, SECRET_ENV};
use crate::wire::{
    self, FailCode, Failure, Frame, IoFail, Kind, Link, Op, RecvFail, Transcript, CLIENT_HELLO_LEN,
    MAX_CONTROL_PAYLOAD, MAX_REASON, SERVER_HELLO_LEN, SERVER_REPLY_HEAD_LEN, STATUS_ACCEPTED,
    STATUS_REFUSED,
};

/// Longest a connection may take over its handshake (within the group's deadline). A
/// legitimate rank answers at once; the bound frees the handshake thread of a silent stray.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// Handshakes rank 0 runs at once beyond the expected ranks; more connections are closed
/// unanswered (the sender retries if it is a rank).
const EXTRA_HANDSHAKES: usize = 64;
/// How long rank 0 spends telling the other ranks that a collective failed.
const NOTICE_LIMIT: Duration = Duration::from_secs(1);
/// How long a rank 0 that cannot bind its port spends asking the port's holder who it is.
const PROBE_LIMIT: Duration = Duration::from_secs(2);
/// Refusals a rank 0 that times out repeats in its error (the latest ones).
const REFUSALS_REPORTED: usize = 3;
/// How often rank 0's accept loop looks at the clock and the finished handshakes.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Extra time a rank waits for rank 0's answer beyond its own deadline. Only rank 0 knows
/// which rank is late, so when both deadlines pass together its report (naming the rank)
/// should arrive before the waiting rank gives up with a vaguer error.
const VERDICT_GRACE: Duration = Duration::from_millis(250);

/// A rank of a multi-process group, connected to the others through rank 0 over TCP.
///
/// Built by [`TcpBootstrap::new`] or [`TcpBootstrap::from_env`], which return once every rank
/// has joined (or fail at the deadline). See the crate documentation for the protocol.
pub struct TcpBootstrap {
    rank: usize,
    world: usize,
    local_rank: Option<usize>,
    addr: Option<SocketAddr>,
    timeout: Duration,
    max_message: usize,
    role: Role,
    /// Number of the last collective started; frames carry it.
    seq: u64,
    /// Set when the group broke (a lost rank, a timeout, a protocol violation): every later
    /// call fails with `Error::Aborted` carrying this reason.
    broken: Option<String>,
    refused: Vec<String>,
}

enum Role {
    Alone,
    /// Rank 0: the link to rank r is `links[r - 1]`.
    Root {
        links: Vec<Link>,
    },
    Member {
        link: Link,
    },
}

impl std::fmt::Debug for TcpBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("addr", &self.addr)
            .field("seq", &self.seq)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

fn bootstrap_err(detail: impl Into<String>) -> Error {
    Error::Bootstrap {
        detail: detail.into(),
    }
}

impl TcpBootstrap {
    /// [`TcpBootstrapConfig::from_env`], then [`TcpBootstrap::new`].
    pub fn from_env() -> Result<Self> {
        Self::new(TcpBootstrapConfig::from_env()?)
    }

    /// Joins the group: rank 0 listens and admits the other ranks; the others connect
    /// (retrying while rank 0 is not up yet). Returns when all `world_size` ranks have joined;
    /// fails with `Error::Timeout` if that has not happened within `config.timeout`.
    pub fn new(config: TcpBootstrapConfig) -> Result<Self> {
        config.validate()?;
        let start = Instant::now();
        let deadline = start + config.timeout;
        let mut me = TcpBootstrap {
            rank: config.rank,
            world: config.world_size,
            local_rank: config.local_rank,
            addr: None,
            timeout: config.timeout,
            max_message: config.max_message,
            role: Role::Alone,
            seq: 0,
            broken: None,
            refused: Vec::new(),
        };
        if config.world_size == 1 {
            return Ok(me);
        }
        let secret = match (&config.secret, std::env::var(SECRET_ENV)) {
            (Some(s), _) => s.clone(),
            (None, Ok(hex)) if !hex.trim().is_empty() => Secret::from_hex(&hex)?,
            (None, _) => {
                return Err(Error::InvalidConfig(format!(
                    "no bootstrap secret: give every rank of the group the same 32-byte key, \
                     either as {SECRET_ENV} (64 hex digits; e.g. run \
                     `export {SECRET_ENV}=$(openssl rand -hex 32)` before the launcher starts \
                     the ranks) or with TcpBootstrapConfig::secret (Secret::generate in the \
                     launcher). The bootstrap does not run unauthenticated: any local process \
                     could otherwise join the group or impersonate rank 0"
                )))
            }
        };
        let addrs = resolve(&config)?;
        tracing::debug!(
            rank = config.rank,
            world = config.world_size,
            addr = ?addrs,
            secret = ?secret,
            "bootstrap: joining"
        );
        if config.rank == 0 {
            let (links, refused, addr) = rendezvous(&config, &secret, &addrs, deadline)?;
            me.addr = Some(addr);
            me.refused = refused;
            me.role = Role::Root { links };
        } else {
            let (link, addr) = join(&config, &secret, &addrs, start, deadline)?;
            me.addr = Some(addr);
            me.role = Role::Member { link };
        }
        tracing::debug!(
            rank = me.rank,
            elapsed = ?start.elapsed(),
            "bootstrap: group assembled"
        );
        Ok(me)
    }

    pub fn local_rank(&self) -> Option<usize> {
        self.local_rank
    }

    /// Rank 0's address (where it listened, or where this rank connected); `None` for a group
    /// of one.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// On rank 0, one line per connection refused while the group assembled (who, and why);
    /// each was also logged with `tracing::warn!`. Empty on the other ranks.
    pub fn refused_connections(&self) -> &[String] {
        &self.refused
    }

    /// The number of collectives this rank has started.
    pub fn calls(&self) -> u64 {
        self.seq
    }

    fn collective(&mut self, op: Op, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        if let Some(reason) = &self.broken {
            return Err(Error::Aborted {
                reason: reason.clone(),
            });
        }
        self.seq += 1;
        let seq = self.seq;
        let deadline = Instant::now() + self.timeout;
        // Broadcast: only the root's bytes travel (and count against the limit).
        let data = if op == Op::Broadcast && root != self.rank {
            &[][..]
        } else {
            data
        };
        // A rank that refuses its own arguments still takes part (with a Reject frame), so the
        // others fail at once with PeerRejected instead of timing out, and the group stays in
        // step for the next call.
        let local_reject = if data.len() > self.max_message {
            Some(Error::InvalidConfig(format!(
                "bootstrap message of {} bytes exceeds max_message ({} bytes)",
                data.len(),
                self.max_message
            )))
        } else if root >= self.world {
            Some(Error::InvalidConfig(format!(
                "broadcast root {root} is outside the group of {} ranks",
                self.world
            )))
        } else {
            None
        };
        let result = match &mut self.role {
            Role::Alone => match local_reject {
                Some(e) => Err(e),
                None => Ok(match op {
                    Op::AllGather => wire::encode_gathered(&[data]),
                    _ => data.to_vec(),
                }),
            },
            Role::Root { links } => root_collective(
                links,
                self.world,
                self.max_message,
                seq,
                op,
                root,
                data,
                local_reject,
                deadline,
            ),
            Role::Member { link } => member_collective(
                link,
                self.rank,
                self.world,
                self.max_message,
                seq,
                op,
                root,
                data,
                local_reject,
                deadline,
                self.timeout,
            ),
        };
        if let Err(e) = &result {
            if !e.is_rejection() && !matches!(e, Error::InvalidConfig(_)) {
                self.broken = Some(format!("an earlier bootstrap call ({seq}) failed: {e}"));
            }
        }
        result
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let bytes = self.collective(Op::AllGather, 0, data)?;
        wire::decode_gathered(&bytes, self.world).map_err(|why| {
            let e = bootstrap_err(format!("call {}: {why}", self.seq));
            self.broken = Some(e.to_string());
            e
        })
    }

    /// Star-shaped: the root's bytes go to rank 0, which sends them to every rank; the other
    /// ranks send empty messages, so rank 0 can check that all called the same collective.
    fn broadcast(&mut self, root: usize, data: &[u8]) -> Result<Vec<u8>> {
        self.collective(Op::Broadcast, root, data)
    }
}

/// Resolves `MASTER_ADDR` and enforces the loopback default.
fn resolve(config: &TcpBootstrapConfig) -> Result<Vec<SocketAddr>> {
    let host = config.master_addr.as_str();
    let addrs: Vec<SocketAddr> = (host, config.master_port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::InvalidConfig(format!(
                "cannot resolve MASTER_ADDR {host:?} (port {}): {e}",
                config.master_port
            ))
        })?
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidConfig(format!(
            "MASTER_ADDR {host:?} resolves to no address"
        )));
    }
    if !config.allow_remote {
        if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback()) {
            return Err(Error::InvalidConfig(format!(
                "MASTER_ADDR {host:?} resolves to {}, which is not a loopback address; the \
                 bootstrap stays on this host unless told otherwise, because its traffic is \
                 authenticated but not encrypted. For a group spanning hosts set \
                 ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE=1 on every rank (or \
                 TcpBootstrapConfig::allow_remote(true))",
                a.ip()
            )));
        }
    }
    Ok(addrs)
}

/// What a handshake thread reports to rank 0's accept loop.
enum Outcome {
    Joined(usize, Link),
    Refused(SocketAddr, Refusal),
}

/// Why rank 0 refused a connection, and whether the group can still form.
struct Refusal {
    why: String,
    /// A rank of this group that rank 0 cannot admit (another world size, secret, or a rank
    /// out of range or taken): every rank must be told at once, since waiting cannot help.
    /// Connections that never spoke the protocol (a port scanner, a health check) are not.
    fatal: bool,
}

impl Refusal {
    fn stray(why: impl Into<String>) -> Self {
        Refusal {
            why: why.into(),
            fatal: false,
        }
    }
}

/// Rank 0: listen, admit ranks 1..world, tell them all the group is complete.
fn rendezvous(
    config: &TcpBootstrapConfig,
    secret: &Secret,
    addrs: &[SocketAddr],
    deadline: Instant,
) -> Result<(Vec<Link>, Vec<String>, SocketAddr)> {
    let start = Instant::now();
    // The first address that binds: "localhost" may resolve to ::1 first on a host without
    // IPv6; the other ranks try every address in the same order.
    let mut failures = Vec::new();
    let listener = addrs
        .iter()
        .find_map(|&addr| match TcpListener::bind(addr) {
            Ok(l) => Some(l),
            Err(e) => {
                let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                    format!(" ({})", who_holds(config, secret, addr, deadline))
                } else {
                    String::new()
                };
                failures.push(format!("{addr}: {e}{hint}"));
                None
            }
        })
        .ok_or_else(|| bootstrap_err(format!("rank 0 cannot listen: {}", failures.join("; "))))?;
    let addr = listener
        .local_addr()
        .map_err(|e| bootstrap_err(format!("rank 0's listener has no address: {e}")))?;
    // Non-blocking, so the loop below can watch the deadline between connections.
    listener
        .set_nonblocking(true)
        .map_err(|e| bootstrap_err(format!("rank 0 cannot configure its listener: {e}")))?;
    let world = config.world_size;
    let claimed = Arc::new(Mutex::new(vec![false; world]));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel::<Outcome>();
    let mut links: Vec<Option<Link>> = (1..world).map(|_| None).collect();
    let mut joined = 0;
    let mut refused = Vec::new();
    let mut refuse = |peer: SocketAddr, why: String| {
        tracing::warn!(%peer, reason = %why, "bootstrap: rank 0 refused a connection");
        refused.push(format!("{peer}: {why}"));
    };
    while joined < world - 1 {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..world).filter(|r| links[r - 1].is_none()).collect();
            let mut waiting_for = format!(
                "ranks {missing:?} to join the bootstrap at {addr} ({} of {world} ranks joined)",
                joined + 1
            );
            if refused.is_empty() {
                // Nothing reached this port for them: the usual causes are on their side.
                waiting_for += "; no connection claimed them: are they running, with the \
                                same MASTER_ADDR and MASTER_PORT (or ALLREDUCE_BOOTSTRAP_PORT)?";
            } else {
                let latest = &refused[refused.len().saturating_sub(REFUSALS_REPORTED)..];
                waiting_for += &format!("; refused meanwhile: {}", latest.join("; "));
            }
            let mut live: Vec<Link> = links.into_iter().flatten().collect();
            notify(
                &mut live,
                0,
                Failure {
                    code: FailCode::Timeout,
                    rank: missing[0] as u32,
                    waited: start.elapsed(),
                    reason: waiting_for.clone(),
                },
            );
            return Err(Error::Timeout {
                rank: 0,
                call: 0,
                waited: start.elapsed(),
                waiting_for,
            });
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                if in_flight.load(Ordering::SeqCst) >= world + EXTRA_HANDSHAKES {
                    refuse(peer, "too many handshakes in progress".into());
                    continue;
                }
                in_flight.fetch_add(1, Ordering::SeqCst);
                let (secret, claimed, counter, tx) = (
                    secret.clone(),
                    claimed.clone(),
                    in_flight.clone(),
                    tx.clone(),
                );
                let hs_deadline = deadline.min(Instant::now() + HANDSHAKE_LIMIT);
                // One thread per handshake: a silent or slow connection holds only its own
                // thread, never the accept loop or another rank's handshake.
                let spawned = std::thread::Builder::new()
                    .name("bootstrap-handshake".into())
                    .spawn(move || {
                        let outcome = match admit(stream, &secret, world, &claimed, hs_deadline) {
                            Ok((rank, link)) => Outcome::Joined(rank, link),
                            Err(refusal) => Outcome::Refused(peer, refusal),
                        };
                        // The loop may be gone (deadline passed); the link then just closes.
                        let _ = tx.send(outcome);
                        // After the send: once the count is zero, every outcome is queued,
                        // which a failing rank 0 relies on to tell every admitted rank.
                        counter.fetch_sub(1, Ordering::SeqCst);
                    });
                if let Err(e) = spawned {
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    refuse(peer, format!("cannot start a handshake thread: {e}"));
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!(error = %e, "bootstrap: rank 0 accept failed"),
        }
        let wait = ACCEPT_POLL.min(deadline.saturating_duration_since(now));
        match rx.recv_timeout(wait) {
            Ok(Outcome::Joined(rank, link)) => {
                tracing::debug!(rank, "bootstrap: rank joined");
                links[rank - 1] = Some(link);
                joined += 1;
            }
            Ok(Outcome::Refused(peer, Refusal { why, fatal: false })) => refuse(peer, why),
            Ok(Outcome::Refused(peer, Refusal { why, fatal: true })) => {
                refuse(peer, why.clone());
                // Ranks admitted meanwhile are told too, rather than left to find the
                // connection closed: wait (briefly, a silent stray may never finish) for the
                // handshakes in flight.
                let settle = Instant::now() + NOTICE_LIMIT;
                loop {
                    // Read before draining: a count of zero means every outcome is queued.
                    let settled = in_flight.load(Ordering::SeqCst) == 0 || Instant::now() >= settle;
                    while let Ok(outcome) = rx.try_recv() {
                        if let Outcome::Joined(rank, link) = outcome {
                            links[rank - 1] = Some(link);
                        }
                    }
                    if settled {
                        break;
                    }
                    std::thread::sleep(ACCEPT_POLL);
                }
                let reason = format!(
                    "rank 0 refused a joining process ({peer}): {why}; the group cannot form"
                );
                let mut live: Vec<Link> = links.into_iter().flatten().collect();
                notify(
                    &mut live,
                    0,
                    Failure {
                        code: FailCode::Refused,
                        rank: 0,
                        waited: start.elapsed(),
                        reason: reason.clone(),
                    },
                );
                return Err(bootstrap_err(reason));
            }
            Err(_) => {}
        }
    }
    // Everyone is here: stop listening, so nothing can connect to this port any more.
    drop(listener);
    let mut links: Vec<Link> = links.into_iter().map(|l| l.expect("joined")).collect();
    // The last rank may have joined just before the deadline: sending takes a moment more.
    let send_by = deadline.max(Instant::now() + NOTICE_LIMIT);
    for (i, link) in links.iter_mut().enumerate() {
        if let Err(e) = link.send(Kind::Ready, Op::None, 0, 0, &[], send_by) {
            let reason = format!("rank {} left right after joining: {e}", i + 1);
            notify(
                &mut links,
                0,
                Failure {
                    code: FailCode::Aborted,
                    rank: (i + 1) as u32,
                    waited: Duration::ZERO,
                    reason: reason.clone(),
                },
            );
            return Err(bootstrap_err(reason));
        }
    }
    Ok((links, refused, addr))
}

/// Rank 0's side of one connection's handshake. Returns the rank and its link, or why the
/// connection was refused (it is then closed; only connections that spoke the protocol get
/// the reason).
fn admit(
    mut stream: TcpStream,
    secret: &Secret,
    world: usize,
    claimed: &Mutex<Vec<bool>>,
    deadline: Instant,
) -> std::result::Result<(usize, Link), Refusal> {
    // Accepted sockets may inherit the listener's non-blocking mode on some platforms.
    stream
        .set_nonblocking(false)
        .and_then(|_| stream.set_nodelay(true))
        .map_err(|e| Refusal::stray(format!("cannot configure the socket: {e}")))?;
    let server_nonce = wire::nonce().map_err(|e| Refusal::stray(e.to_string()))?;
    wire::write_all_by(&mut stream, &wire::server_hello(&server_nonce), deadline)
        .map_err(|e| Refusal::stray(format!("sending the greeting: {e}")))?;
    let mut hello = [0u8; CLIENT_HELLO_LEN];
    wire::read_exact_by(&mut stream, &mut hello, deadline).map_err(|e| {
        Refusal::stray(format!("no complete hello ({CLIENT_HELLO_LEN} bytes): {e}"))
    })?;
    let hello = wire::parse_client_hello(&hello).ok_or_else(|| {
        Refusal::stray("not a bootstrap client (bad magic); closed without an answer")
    })?;
    // From here the peer speaks the protocol: it is a rank started for some group, and is
    // told why it is refused. Whether the refusal stops this group is decided per reason.
    let mut reply_refusal = |why: String, fatal: bool| {
        let reply = wire::server_reply(STATUS_REFUSED, why.as_bytes());
        let _ = wire::write_all_by(&mut stream, &reply, deadline);
        Refusal { why, fatal }
    };
    let claims_a_rank_here =
        hello.world as usize == world && (1..world).contains(&(hello.rank as usize));
    if hello.version != wire::VERSION {
        return Err(reply_refusal(
            format!(
                "rank {} speaks bootstrap protocol version {} (rank 0 speaks {}): the ranks \
                 run different builds of the library",
                hello.rank,
                hello.version,
                wire::VERSION
            ),
            claims_a_rank_here,
        ));
    }
    let t = Transcript {
        server_nonce,
        client_nonce: hello.nonce,
        rank: hello.rank,
        world: hello.world,
    };
    // Check the proof before anything else, so nothing about the group is revealed to a
    // connection that does not know the secret.
    if !t.client_proof_ok(secret, &hello.proof) {
        // A claim that fits this group (its world size, a rank still to come) is taken for
        // one of its ranks given another secret, which stops the group; one that does not
        // fit is most likely another group's process on the same port, which does not.
        return Err(reply_refusal(
            format!(
                "authentication failed for a connection claiming rank {} of {}: its secret \
                 differs from rank 0's (is {SECRET_ENV} the same for every rank, and is this \
                 port this group's?)",
                hello.rank, hello.world
            ),
            claims_a_rank_here,
        ));
    }
    let rank = hello.rank as usize;
    if rank == 0 {
        return Err(reply_refusal(
            "rank 0 given twice: this group's rank 0 already listens here, and another \
             process of the group claims rank 0 too (two processes with RANK=0?)"
                .into(),
            true,
        ));
    }
    if hello.world as usize != world {
        return Err(reply_refusal(
            format!(
                "rank {rank} has WORLD_SIZE {}, rank 0 has {world}",
                hello.world
            ),
            true,
        ));
    }
    if rank >= world {
        return Err(reply_refusal(
            format!("rank {rank} is not a rank rank 0 expects (1..{world})"),
            true,
        ));
    }
    {
        let mut claimed = claimed.lock().unwrap_or_else(|p| p.into_inner());
        if claimed[rank] {
            drop(claimed);
            return Err(reply_refusal(
                format!(
                    "rank {rank} given twice: it has already joined (two processes with \
                     RANK={rank}?)"
                ),
                true,
            ));
        }
        claimed[rank] = true;
    }
    let reply = wire::server_reply(STATUS_ACCEPTED, &t.server_proof(secret));
    if let Err(e) = wire::write_all_by(&mut stream, &reply, deadline) {
        claimed.lock().unwrap_or_else(|p| p.into_inner())[rank] = false;
        return Err(Refusal::stray(format!(
            "rank {rank} left during its handshake: {e}"
        )));
    }
    let (to_root, from_root) = t.keys(secret);
    Ok((rank, Link::new(stream, from_root, to_root)))
}

/// Ranks 1..world: connect to rank 0 (retrying until it listens), prove the secret, check
/// rank 0's proof, wait until the group is complete.
fn join(
    config: &TcpBootstrapConfig,
    secret: &Secret,
    addrs: &[SocketAddr],
    start: Instant,
    deadline: Instant,
) -> Result<(Link, SocketAddr)> {
    let mut backoff = Duration::from_millis(10);
    let mut last_error = String::from("no attempt finished");
    loop {
        for &addr in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let stream = match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => s,
                Err(e) => {
                    last_error = format!("connecting to {addr}: {e}");
                    continue;
                }
            };
            match handshake(stream, config, secret, deadline) {
                Ok(mut link) => {
                    return wait_ready(&mut link, config.rank, start, deadline + VERDICT_GRACE)
                        .map(|()| (link, addr))
                }
                Err(Attempt::Retry(why)) => last_error = format!("{addr}: {why}"),
                Err(fatal) => return Err(fatal.into_error(config)),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                rank: config.rank,
                call: 0,
                waited: start.elapsed(),
                waiting_for: format!(
                    "rank 0 to admit it at {}:{} (last attempt: {last_error}); is rank 0 \
                     running with the same MASTER_ADDR and MASTER_PORT, or did it stop \
                     after refusing another rank?",
                    config.master_addr, config.master_port
                ),
            });
        }
        std::thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(250));
    }
}

enum Attempt {
    /// Rank 0 may not be up yet, or was busy: try again.
    Retry(String),
    /// Rank 0 answered and refused this rank, for the reason it gave.
    Refused(String),
    /// What listens there is no bootstrap rank 0 (the reason says how it showed).
    Foreign(String),
    Fatal(Error),
}

impl Attempt {
    /// The error a joining rank reports for an attempt that cannot succeed by retrying.
    fn into_error(self, config: &TcpBootstrapConfig) -> Error {
        let at = |why: String| {
            bootstrap_err(format!(
                "rank {} joining at {}:{}: {why}",
                config.rank, config.master_addr, config.master_port
            ))
        };
        match self {
            Attempt::Retry(why) => at(why),
            Attempt::Refused(why) => at(format!("rank 0 refused it: {why}")),
            Attempt::Foreign(why) => {
                at(format!("the process listening there is not rank 0: {why}"))
            }
            Attempt::Fatal(e) => e,
        }
    }
}

fn handshake(
    mut stream: TcpStream,
    config: &TcpBootstrapConfig,
    secret: &Secret,
    deadline: Instant,
) -> std::result::Result<Link, Attempt> {
    let fatal = |why: String| {
        Attempt::Fatal(bootstrap_err(format!(
            "rank {} joining at {}:{}: {why}",
            config.rank, config.master_addr, config.master_port
        )))
    };
    stream
        .set_nodelay(true)
        .map_err(|e| Attempt::Retry(format!("configuring the socket: {e}")))?;
    let mut greeting = [0u8; SERVER_HELLO_LEN];
    // Closed before a greeting: rank 0 was over its handshake limit, or the port is being
    // torn down and rebound. Worth another try.
    wire::read_exact_by(&mut stream, &mut greeting, deadline)
        .map_err(|e| Attempt::Retry(format!("no greeting from rank 0: {e}")))?;
    let server_nonce = wire::parse_server_hello(&greeting).map_err(Attempt::Foreign)?;
    let t = Transcript {
        server_nonce,
        client_nonce: wire::nonce().map_err(Attempt::Fatal)?,
        rank: config.rank as u32,
        world: config.world_size as u32,
    };
    let hello = wire::client_hello(&t, &t.client_proof(secret));
    wire::write_all_by(&mut stream, &hello, deadline)
        .map_err(|e| fatal(format!("sending the hello: {e}")))?;
    let mut head = [0u8; SERVER_REPLY_HEAD_LEN];
    wire::read_exact_by(&mut stream, &mut head, deadline)
        .map_err(|e| fatal(format!("no answer to the hello: {e}")))?;
    if &head[..4] != wire::SERVER_REPLY_MAGIC {
        return Err(fatal("rank 0 answered the hello with garbage".into()));
    }
    let len = u16::from_le_bytes([head[6], head[7]]) as usize;
    if len > MAX_REASON {
        return Err(fatal(format!("rank 0's answer announces {len} bytes")));
    }
    let mut body = vec![0u8; len];
    wire::read_exact_by(&mut stream, &mut body, deadline)
        .map_err(|e| fatal(format!("reading rank 0's answer: {e}")))?;
    match head[4] {
        STATUS_ACCEPTED => {
            // Mutual authentication: a process that took the port first (another job, or a
            // hostile one) cannot pose as rank 0 without the secret.
            if !t.server_proof_ok(secret, &body) {
                return Err(fatal(
                    "the process listening there does not know the group's secret, so it is \
                     not this group's rank 0 (another job on the same port?)"
                        .into(),
                ));
            }
            let (to_root, from_root) = t.keys(secret);
            Ok(Link::new(stream, to_root, from_root))
        }
        STATUS_REFUSED => Err(Attempt::Refused(
            String::from_utf8_lossy(&body).into_owned(),
        )),
        s => Err(fatal(format!("rank 0 answered with unknown status {s}"))),
    }
}

fn wait_ready(link: &mut Link, rank: usize, start: Instant, deadline: Instant) -> Result<()> {
    match link.recv(MAX_CONTROL_PAYLOAD, deadline) {
        Ok(Frame {
            kind: Kind::Ready,
            seq: 0,
            ..
        }) => Ok(()),
        Ok(Frame {
            kind: Kind::Fail,
            payload,
            ..
        }) => Err(failure_error(&payload, rank, 0)),
        Ok(f) => Err(bootstrap_err(format!(
            "rank {rank}: rank 0 sent {:?} (call {}) instead of the group-complete notice",
            f.kind, f.seq
        ))),
        Err(RecvFail::Io(IoFail::TimedOut)) => Err(Error::Timeout {
            rank,
            call: 0,
            waited: start.elapsed(),
            waiting_for: "rank 0 to report the group complete (other ranks have not joined)".into(),
        }),
        Err(e) => Err(bootstrap_err(format!(
            "rank {rank} waiting for the group to assemble: {e}"
        ))),
    }
}

/// The error a rank reports for rank 0's `Fail` frame.
fn failure_error(payload: &[u8], rank: usize, call: u64) -> Error {
    let Some(f) = Failure::decode(payload) else {
        return bootstrap_err(format!(
            "call {call}: rank 0 reported a failure this rank cannot decode"
        ));
    };
    match f.code {
        FailCode::Timeout => Error::Timeout {
            rank,
            call,
            waited: f.waited,
            waiting_for: format!("{} (as rank 0 reports)", f.reason),
        },
        FailCode::Mismatch => Error::RankMismatch {
            what: "bootstrap collective",
            call,
            detail: f.reason,
        },
        FailCode::PeerRejected => Error::PeerRejected {
            rank: f.rank as usize,
            call,
            reason: f.reason,
        },
        FailCode::Aborted => Error::Aborted {
            reason: format!("rank 0 reports: {}", f.reason),
        },
        FailCode::Refused => bootstrap_err(format!("rank {rank}: rank 0 reports: {}", f.reason)),
    }
}

/// Rank 0 cannot listen because `addr` is taken: ask the holder, as a joining rank 0 would,
/// so the error can say whether it is this group's rank 0 (RANK=0 given twice), another
/// group's, or no bootstrap at all. The probe claims rank 0, which no rank 0 admits.
fn who_holds(
    config: &TcpBootstrapConfig,
    secret: &Secret,
    addr: SocketAddr,
    deadline: Instant,
) -> String {
    const NOT_A_BOOTSTRAP: &str = "torch.distributed or torchrun's store may hold MASTER_PORT; \
        give the bootstrap its own with ALLREDUCE_BOOTSTRAP_PORT";
    let deadline = deadline.min(Instant::now() + PROBE_LIMIT);
    let left = deadline.saturating_duration_since(Instant::now());
    let attempt = match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
        Ok(stream) => handshake(stream, config, secret, deadline),
        Err(e) => Err(Attempt::Retry(format!("connecting to it: {e}"))),
    };
    match attempt {
        Err(Attempt::Refused(why)) if why.starts_with("rank 0 given twice") => format!(
            "rank 0 given twice: this group's rank 0 already listens there, so this process \
             must not be rank 0 too (two processes with RANK=0?); it answered: {why}"
        ),
        Err(Attempt::Refused(why)) => format!(
            "another allreduce bootstrap group's rank 0 listens there and refused this \
             process ({why}); give this group its own MASTER_PORT or ALLREDUCE_BOOTSTRAP_PORT"
        ),
        Err(Attempt::Foreign(why)) => {
            format!("the port's holder is not an allreduce bootstrap ({why}): {NOT_A_BOOTSTRAP}")
        }
        _ => format!("another process uses this port: {NOT_A_BOOTSTRAP}"),
    }
}

/// Best effort: tell every live link about a failure, within a short deadline of its own.
fn notify(links: &mut [Link], seq: u64, failure: Failure) {
    let payload = failure.encode();
    let deadline = Instant::now() + NOTICE_LIMIT;
    for link in links {
        let _ = link.send(Kind::Fail, Op::None, 0, seq, &payload, deadline);
    }
}

fn describe(op: Op, root: u32) -> String {
    match op {
        Op::AllGather => "all_gather".into(),
        Op::Broadcast => format!("broadcast(root {root})"),
        Op::None => "nothing".into(),
    }
}

#[allow(clippy::too_many_arguments)]
fn root_collective(
    links: &mut [Link],
    world: usize,
    max_message: usize,
    seq: u64,
    op: Op,
    root: usize,
    data: &[u8],
    local_reject: Option<Error>,
    deadline: Instant,
) -> Result<Vec<u8>> {
    let start = Instant::now();
    let root32 = root.min(u32::MAX as usize) as u32;
    // Each rank's part: Ok(bytes) or Err(its reason for rejecting). Rank 0's own first.
    let mut parts: Vec<std::result::Result<Vec<u8>, String>> = Vec::with_capacity(world);
    parts.push(match &local_reject {
        Some(e) => Err(e.to_string()),
        None => Ok(Vec::new()), // rank 0's bytes are borrowed from `data` below
    });
    let mut mismatch: Option<String> = None;
    let limit = (max_message as u64).max(MAX_CONTROL_PAYLOAD);
    for r in 1..world {
        let frame = match links[r - 1].recv(limit, deadline) {
            Ok(f) => f,
            Err(e) => {
                let (failure, err) = match e {
                    RecvFail::Io(IoFail::TimedOut) => {
                        let waiting_for = format!("rank {r}'s part of bootstrap call {seq}");
                        (
                            Failure {
                                code: FailCode::Timeout,
                                rank: r as u32,
                                waited: start.elapsed(),
                                reason: waiting_for.clone(),
                            },
                            Error::Timeout {
                                rank: 0,
                                call: seq,
                                waited: start.elapsed(),
                                waiting_for,
                            },
                        )
                    }
                    other => {
                        let reason = format!("lost rank {r} in bootstrap call {seq}: {other}");
                        (
                            Failure {
                                code: FailCode::Aborted,
                                rank: r as u32,
                                waited: start.elapsed(),
                                reason: reason.clone(),
                            },
                            bootstrap_err(reason),
                        )
                    }
                };
                tracing::warn!(rank = r, call = seq, error = %err, "bootstrap: collective failed");
                notify(links, seq, failure);
                return Err(err);
            }
        };
        // A frame from another call means the stream is out of step: nothing after it can be
        // trusted to belong to this call, so the group is abandoned.
        let out_of_step = if frame.seq != seq {
            Some(format!(
                "rank {r} sent call {}, rank 0 is at call {seq}",
                frame.seq
            ))
        } else if !matches!(frame.kind, Kind::Contrib | Kind::Reject) {
            Some(format!("rank {r} sent a {:?} frame", frame.kind))
        } else {
            None
        };
        if let Some(reason) = out_of_step {
            let reason = format!("protocol violation in bootstrap call {seq}: {reason}");
            tracing::warn!(rank = r, %reason, "bootstrap: collective failed");
            notify(
                links,
                seq,
                Failure {
                    code: FailCode::Aborted,
                    rank: r as u32,
                    waited: start.elapsed(),
                    reason: reason.clone(),
                },
            );
            return Err(bootstrap_err(reason));
        }
        if mismatch.is_none() && (frame.op != op || frame.root != root32) {
            mismatch = Some(format!(
                "rank 0 called {}, rank {r} called {}",
                describe(op, root32),
                describe(frame.op, frame.root)
            ));
        }
        parts.push(match frame.kind {
            Kind::Reject => Err(String::from_utf8_lossy(&frame.payload).into_owned()),
            _ => Ok(frame.payload),
        });
    }
    let fail_all = |links: &mut [Link], failure: Failure| {
        // Not fatal to the group: every rank read this call's frames, so all stay in step.
        notify(links, seq, failure);
    };
    if let Some(detail) = mismatch {
        fail_all(
            links,
            Failure {
                code: FailCode::Mismatch,
                rank: 0,
                waited: Duration::ZERO,
                reason: detail.clone(),
            },
        );
        return Err(Error::RankMismatch {
            what: "bootstrap collective",
            call: seq,
            detail,
        });
    }
    if let Some((r, reason)) = parts
        .iter()
        .enumerate()
        .find_map(|(r, p)| p.as_ref().err().map(|why| (r, why.clone())))
    {
        fail_all(
            links,
            Failure {
                code: FailCode::PeerRejected,
                rank: r as u32,
                waited: Duration::ZERO,
                reason: reason.clone(),
            },
        );
        return Err(local_reject.unwrap_or(Error::PeerRejected {
            rank: r,
            call: seq,
            reason,
        }));
    }
    let result = match op {
        Op::AllGather => {
            let views: Vec<&[u8]> = parts
                .iter()
                .enumerate()
                .map(|(r, p)| {
                    if r == 0 {
                        data
                    } else {
                        p.as_deref().expect("no rejection")
                    }
                })
                .collect();
            wire::encode_gathered(&views)
        }
        _ if root == 0 => data.to_vec(),
        _ => parts[root].as_ref().expect("no rejection").clone(),
    };
    let mut lost = None;
    for (i, link) in links.iter_mut().enumerate() {
        if let Err(e) = link.send(Kind::Result, op, root32, seq, &result, deadline) {
            lost.get_or_insert(format!(
                "lost rank {} sending the result of bootstrap call {seq}: {e}",
                i + 1
            ));
        }
    }
    if let Some(reason) = lost {
        // The ranks that got the result continue; they learn of the loss at their next call.
        tracing::warn!(%reason, "bootstrap: collective failed");
        notify(
            links,
            seq + 1,
            Failure {
                code: FailCode::Aborted,
                rank: 0,
                waited: Duration::ZERO,
                reason: reason.clone(),
            },
        );
        return Err(bootstrap_err(reason));
    }
    Ok(result)
}

#[allow(clippy::too_many_arguments)]
fn member_collective(
    link: &mut Link,
    rank: usize,
    world: usize,
    max_message: usize,
    seq: u64,
    op: Op,
    root: usize,
    data: &[u8],
    local_reject: Option<Error>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let start = Instant::now();
    // Rank 0 sends unasked only when the group broke (or it closed the connection): report
    // that now rather than after sending this call's part into a dead connection.
    if link.pending().unwrap_or(true) {
        return match link.recv(MAX_CONTROL_PAYLOAD, deadline) {
            Ok(Frame {
                kind: Kind::Fail,
                payload,
                ..
            }) => Err(failure_error(&payload, rank, seq)),
            Ok(f) => Err(bootstrap_err(format!(
                "rank {rank}: rank 0 sent {:?} (call {}) before call {seq}",
                f.kind, f.seq
            ))),
            Err(e) => Err(bootstrap_err(format!(
                "rank {rank} lost its connection to rank 0 before call {seq}: {e}"
            ))),
        };
    }
    let root32 = root.min(u32::MAX as usize) as u32;
    let sent = match &local_reject {
        Some(e) => {
            let reason = e.to_string();
            let reason = wire::truncate(&reason, MAX_CONTROL_PAYLOAD as usize);
            link.send(Kind::Reject, op, root32, seq, reason.as_bytes(), deadline)
        }
        None => link.send(Kind::Contrib, op, root32, seq, data, deadline),
    };
    let io_error = |timed_out: bool, detail: String, what: &str| {
        if timed_out {
            Error::Timeout {
                rank,
                call: seq,
                waited: start.elapsed(),
                waiting_for: format!(
                    "rank 0 {what} (rank 0 or another rank is late; limit {timeout:?})"
                ),
            }
        } else {
            bootstrap_err(format!(
                "rank {rank} lost its connection to rank 0 in call {seq}: {detail}"
            ))
        }
    };
    if let Err(e) = sent {
        return Err(io_error(
            matches!(e, IoFail::TimedOut),
            e.to_string(),
            "to take this rank's part",
        ));
    }
    let limit = match op {
        Op::AllGather => 4 + world as u64 * (8 + max_message as u64),
        _ => max_message as u64,
    }
    .max(MAX_CONTROL_PAYLOAD);
    let frame = link.recv(limit, deadline + VERDICT_GRACE).map_err(|e| {
        io_error(
            matches!(e, RecvFail::Io(IoFail::TimedOut)),
            e.to_string(),
            "to send the result",
        )
    })?;
    if frame.seq != seq {
        return Err(bootstrap_err(format!(
            "protocol violation: rank {rank} is at call {seq} but rank 0 answered call {}",
            frame.seq
        )));
    }
    match frame.kind {
        Kind::Fail => {
            let e = failure_error(&frame.payload, rank, seq);
            Err(match (local_reject, &e) {
                // This rank's own refusal is the more useful error for its caller.
                (Some(mine), Error::PeerRejected { .. }) => mine,
                _ => e,
            })
        }
        Kind::Result if local_reject.is_none() && frame.op == op && frame.root == root32 => {
            Ok(frame.payload)
        }
        k => Err(bootstrap_err(format!(
            "protocol violation: rank 0 answered call {seq} ({}) with a {k:?} frame for {}",
            describe(op, root32),
            describe(frame.op, frame.root)
        ))),
    }
}

#[cfg(test)]
mod tests {
    //! Protocol-level cases that need a hand-made peer (threads as ranks). The process-level
    //! tests are in `tests/processes.rs`.

    use std::io::{Read, Write};
    use std::thread::JoinHandle;

    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    struct Setup {
        port: u16,
        world: usize,
        secret: Secret,
        timeout: Duration,
        max_message: usize,
    }

    impl Setup {
        fn new(world: usize) -> Self {
            Setup {
                port: free_port(),
                world,
                secret: Secret::generate().unwrap(),
                timeout: Duration::from_secs(5),
                max_message: TcpBootstrapConfig::DEFAULT_MAX_MESSAGE,
            }
        }

        fn config(&self, rank: usize) -> TcpBootstrapConfig {
            TcpBootstrapConfig::new(rank, self.world, self.port)
                .secret(self.secret.clone())
                .timeout(self.timeout)
                .max_message(self.max_message)
        }

        /// Rank `rank` in a thread, running `f` on its bootstrap.
        fn spawn<T: Send + 'static>(
            &self,
            rank: usize,
            f: impl FnOnce(&mut TcpBootstrap) -> Result<T> + Send + 'static,
        ) -> JoinHandle<Result<T>> {
            let config = self.config(rank);
            std::thread::spawn(move || f(&mut TcpBootstrap::new(config)?))
        }

        /// A hand-made rank: connects (retrying), runs the handshake, returns the link before
        /// the group is complete.
        fn raw_join(&self, rank: usize, world: usize) -> std::result::Result<Link, Attempt> {
            self.raw_join_with(rank, world, &self.secret)
        }

        /// [`Setup::raw_join`] with the given secret.
        fn raw_join_with(
            &self,
            rank: usize,
            world: usize,
            secret: &Secret,
        ) -> std::result::Result<Link, Attempt> {
            let config = TcpBootstrapConfig::new(rank, world, self.port)
                .secret(secret.clone())
                .timeout(self.timeout);
            let deadline = Instant::now() + self.timeout;
            let stream = loop {
                match TcpStream::connect(("127.0.0.1", self.port)) {
                    Ok(s) => break s,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => panic!("rank 0 never listened: {e}"),
                }
            };
            handshake(stream, &config, secret, deadline)
        }

        fn raw_member(&self, rank: usize) -> Link {
            let mut link = self.raw_join(rank, self.world).ok().expect("admitted");
            wait_ready(
                &mut link,
                rank,
                Instant::now(),
                Instant::now() + self.timeout,
            )
            .unwrap();
            link
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn threads_all_gather_and_broadcast() {
        let s = Setup::new(4);
        let ranks: Vec<_> = (0..4)
            .map(|r| {
                s.spawn(r, move |b| {
                    let all = b.all_gather(&vec![r as u8; r])?;
                    let one = b.broadcast(2, format!("from {r}").as_bytes())?;
                    Ok((all, one))
                })
            })
            .collect();
        for h in ranks {
            let (all, one) = h.join().unwrap().unwrap();
            assert_eq!(all, (0..4).map(|r| vec![r as u8; r]).collect::<Vec<_>>());
            assert_eq!(one, b"from 2");
        }
    }

    #[test]
    fn a_group_of_one_needs_no_network_or_secret() {
        let mut b = TcpBootstrap::new(TcpBootstrapConfig::new(0, 1, 0)).unwrap();
        assert_eq!(b.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
        assert_eq!(b.broadcast(0, b"y").unwrap(), b"y");
        assert!(matches!(b.broadcast(1, b"y"), Err(Error::InvalidConfig(_))));
        assert!(b.addr().is_none());
    }

    #[test]
    fn no_secret_is_refused() {
        if std::env::var_os(SECRET_ENV).is_some() {
            return; // the fallback would find one
        }
        let err = TcpBootstrap::new(TcpBootstrapConfig::new(1, 2, 1)).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
        assert!(err.to_string().contains(SECRET_ENV), "{err}");
    }

    #[test]
    fn non_loopback_needs_the_opt_in() {
        for addr in ["0.0.0.0", "192.0.2.1"] {
            let config = TcpBootstrapConfig::new(0, 2, 1)
                .master_addr(addr)
                .secret(Secret::from_bytes([1; 32]));
            let err = TcpBootstrap::new(config).unwrap_err().to_string();
            assert!(err.contains("not a loopback address"), "{err}");
            assert!(err.contains("ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE=1"), "{err}");
        }
    }

    fn refusal(attempt: std::result::Result<Link, Attempt>) -> String {
        match attempt {
            Err(Attempt::Refused(why)) => why,
            Err(Attempt::Retry(why)) => panic!("retry: {why}"),
            Err(Attempt::Foreign(why)) => panic!("foreign: {why}"),
            Err(Attempt::Fatal(e)) => panic!("fatal: {e}"),
            Ok(_) => panic!("admitted"),
        }
    }

    #[test]
    fn a_refused_rank_stops_the_group_on_every_side_at_once() {
        let other = Secret::generate().unwrap();
        type Mistake = fn(&Setup, &Secret) -> std::result::Result<Link, Attempt>;
        let mistakes: [(Mistake, &str); 5] = [
            (|s, _| s.raw_join(1, 3), "rank 1 given twice"),
            (
                |s, _| s.raw_join(2, 4),
                "rank 2 has WORLD_SIZE 4, rank 0 has 3",
            ),
            (|s, _| s.raw_join(3, 3), "rank 3 is not a rank"),
            (|s, _| s.raw_join(0, 3), "rank 0 given twice"),
            (
                |s, other| s.raw_join_with(2, 3, other),
                "authentication failed for a connection claiming rank 2 of 3",
            ),
        ];
        for (mistake, why) in mistakes {
            let s = Setup::new(3);
            let root = s.spawn(0, |_| Ok(()));
            // Rank 1 is admitted (the group is not complete yet).
            let mut first = s.raw_join(1, 3).ok().expect("admitted");
            let t = Instant::now();
            // The refused process is told why.
            let told = refusal(mistake(&s, &other));
            assert!(told.contains(why), "{told}");
            // Rank 0 fails at once, naming the process and the reason.
            let e = root.join().unwrap().unwrap_err();
            assert!(
                matches!(&e, Error::Bootstrap { detail }
                    if detail.contains(why) && detail.contains("cannot form")),
                "{e}"
            );
            // The rank already admitted is told too, not left waiting for the deadline.
            let e1 = wait_ready(&mut first, 1, Instant::now(), soon()).unwrap_err();
            assert!(
                matches!(&e1, Error::Bootstrap { detail } if detail.contains(why)),
                "{e1}"
            );
            assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        }
    }

    #[test]
    fn strays_do_not_disturb_the_group() {
        let s = Setup::new(3);
        let root = s.spawn(0, |b| Ok(b.refused_connections().to_vec()));
        let mut first = s.raw_join(1, 3).ok().expect("admitted");
        // Another group's process on this port: another secret and a claim that does not fit
        // this group. Told why, but the group goes on.
        let other = Secret::generate().unwrap();
        let told = refusal(s.raw_join_with(2, 5, &other));
        assert!(told.contains("authentication failed"), "{told}");
        // Garbage: closed unanswered.
        let mut garbage = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
        garbage.write_all(&[0xff; CLIENT_HELLO_LEN]).unwrap();
        // The real rank 2 completes the group.
        let rank2 = s.spawn(2, |b| Ok(b.rank()));
        wait_ready(&mut first, 1, Instant::now(), soon()).unwrap();
        assert_eq!(rank2.join().unwrap().unwrap(), 2);
        let refused = root.join().unwrap().unwrap();
        assert_eq!(refused.len(), 2, "{refused:?}");
    }

    #[test]
    fn a_second_rank_0_learns_that_rank_0_is_taken() {
        let s = Setup::new(2);
        let first = s.spawn(0, |_| Ok(()));
        // Wait until the first rank 0 listens (it greets).
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", s.port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "rank 0 never listened"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let t = Instant::now();
        let second = TcpBootstrap::new(s.config(0)).unwrap_err().to_string();
        assert!(second.contains("rank 0 given twice"), "{second}");
        let first = first.join().unwrap().unwrap_err().to_string();
        assert!(first.contains("rank 0 given twice"), "{first}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn a_rank_0_on_another_groups_port_is_told_so_and_leaves_it_alone() {
        let s = Setup::new(2);
        let theirs = s.spawn(0, |b| b.all_gather(b"0"));
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", s.port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "rank 0 never listened"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let mine = TcpBootstrapConfig::new(0, 2, s.port)
            .secret(Secret::generate().unwrap())
            .timeout(s.timeout);
        let e = TcpBootstrap::new(mine).unwrap_err().to_string();
        assert!(e.contains("another allreduce bootstrap group"), "{e}");
        // The group that holds the port still forms.
        let rank1 = s.spawn(1, |b| b.all_gather(b"1"));
        assert_eq!(
            rank1.join().unwrap().unwrap(),
            vec![b"0".to_vec(), b"1".to_vec()]
        );
        assert_eq!(theirs.join().unwrap().unwrap().len(), 2);
    }

    #[test]
    fn a_rank_0_whose_port_is_held_by_something_else_says_so() {
        let s = Setup::new(2);
        let listener = TcpListener::bind(("127.0.0.1", s.port)).unwrap();
        let other = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n".repeat(2).as_slice());
        });
        let e = TcpBootstrap::new(s.config(0)).unwrap_err().to_string();
        assert!(e.contains("not an allreduce bootstrap"), "{e}");
        assert!(e.contains("ALLREDUCE_BOOTSTRAP_PORT"), "{e}");
        other.join().unwrap();
    }

    #[test]
    fn a_timeout_names_the_connections_refused_meanwhile() {
        let mut s = Setup::new(2);
        s.timeout = Duration::from_millis(600);
        let root = s.spawn(0, |_| Ok(()));
        let other = Secret::generate().unwrap();
        let _ = refusal(s.raw_join_with(1, 7, &other));
        let e = root.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("waiting for ranks [1]"), "{e}");
        assert!(
            e.contains("refused meanwhile") && e.contains("authentication failed"),
            "{e}"
        );
    }

    #[test]
    fn an_impostor_rank_0_is_detected() {
        let s = Setup::new(2);
        let listener = TcpListener::bind(("127.0.0.1", s.port)).unwrap();
        // Greets correctly and "accepts" with a made-up proof.
        let fake = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            c.write_all(&wire::server_hello(&[7; 32])).unwrap();
            let mut hello = [0u8; CLIENT_HELLO_LEN];
            c.read_exact(&mut hello).unwrap();
            c.write_all(&wire::server_reply(STATUS_ACCEPTED, &[9; 32]))
                .unwrap();
        });
        let err = TcpBootstrap::new(s.config(1)).unwrap_err().to_string();
        assert!(err.contains("does not know the group's secret"), "{err}");
        fake.join().unwrap();
    }

    #[test]
    fn a_frame_from_another_call_breaks_the_group_for_everyone() {
        let s = Setup::new(3);
        let root = s.spawn(0, |b| {
            let e = b.all_gather(b"0").unwrap_err();
            Ok((e, b.all_gather(b"0").unwrap_err()))
        });
        let rank1 = s.spawn(1, |b| Ok(b.all_gather(b"1").unwrap_err()));
        let mut raw = s.raw_member(2);
        raw.send(Kind::Contrib, Op::AllGather, 0, 7, b"2", soon())
            .unwrap();
        let (e, later) = root.join().unwrap().unwrap();
        assert!(
            matches!(&e, Error::Bootstrap { detail } if detail.contains("rank 2 sent call 7")),
            "{e}"
        );
        assert!(matches!(later, Error::Aborted { .. }), "{later}");
        let e1 = rank1.join().unwrap().unwrap();
        assert!(
            matches!(&e1, Error::Aborted { reason } if reason.contains("call 7")),
            "{e1}"
        );
        // The hand-made rank is told too, and never sees anyone's data.
        let f = raw.recv(MAX_CONTROL_PAYLOAD, soon()).unwrap();
        assert_eq!(f.kind, Kind::Fail);
    }

    #[test]
    fn an_oversized_or_forged_frame_is_refused_without_reading_it() {
        for forged in [false, true] {
            let mut s = Setup::new(2);
            s.max_message = 1024;
            let root = s.spawn(0, |b| Ok(b.all_gather(b"0").unwrap_err()));
            let mut raw = s.raw_member(1);
            if forged {
                // Right layout, wrong key.
                let mut liar = Link::new(raw.stream.try_clone().unwrap(), [3; 32], [3; 32]);
                liar.send(Kind::Contrib, Op::AllGather, 0, 1, b"1", soon())
                    .unwrap();
            } else {
                // A header announcing 1 TiB, and nothing after it.
                let mut header = [0u8; wire::FRAME_HEADER_LEN];
                header[0] = Kind::Contrib as u8;
                header[1] = Op::AllGather as u8;
                header[8] = 1;
                header[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
                raw.stream.write_all(&header).unwrap();
            }
            let e = root.join().unwrap().unwrap();
            let want = if forged {
                "authentication tag is wrong"
            } else {
                "above the limit of 8192"
            };
            assert!(
                matches!(&e, Error::Bootstrap { detail } if detail.contains(want)),
                "{e}"
            );
        }
    }

    #[test]
    fn a_rank_refusing_its_own_arguments_fails_the_call_not_the_group() {
        let mut s = Setup::new(3);
        s.max_message = 16;
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(r, move |b| {
                    let big = if r == 1 { vec![0; 100] } else { vec![1; 4] };
                    let first = b.all_gather(&big).unwrap_err();
                    // Every rank names a root outside the group.
                    let second = b.broadcast(5, b"x").unwrap_err();
                    let third = b.all_gather(&[r as u8])?;
                    // Non-roots' bytes are ignored, so they do not count against the limit.
                    let mine: &[u8] = if r == 0 { b"ok" } else { &[0; 100] };
                    assert_eq!(b.broadcast(0, mine)?, b"ok");
                    Ok((first, second, third))
                })
            })
            .collect();
        for (r, h) in ranks.into_iter().enumerate() {
            let (first, second, third) = h.join().unwrap().unwrap();
            if r == 1 {
                assert!(matches!(first, Error::InvalidConfig(_)), "{first}");
            } else {
                assert!(
                    matches!(
                        first,
                        Error::PeerRejected {
                            rank: 1,
                            call: 1,
                            ..
                        }
                    ),
                    "{first}"
                );
            }
            assert!(matches!(second, Error::InvalidConfig(_)), "{second}");
            assert_eq!(third, vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_rank_that_joins_but_never_calls_times_out_the_call() {
        let mut s = Setup::new(3);
        s.timeout = Duration::from_millis(700);
        let callers: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(r, |b| {
                    let t = Instant::now();
                    let e = b.all_gather(b"x").unwrap_err();
                    let took = t.elapsed();
                    Ok((e, took, b.all_gather(b"x").unwrap_err()))
                })
            })
            .collect();
        let idle = s.spawn(2, |_| {
            std::thread::sleep(Duration::from_millis(1500));
            Ok(())
        });
        for (r, h) in callers.into_iter().enumerate() {
            let (e, took, later) = h.join().unwrap().unwrap();
            match &e {
                Error::Timeout {
                    rank,
                    call: 1,
                    waiting_for,
                    ..
                } => {
                    assert_eq!(*rank, r);
                    assert!(waiting_for.contains("rank 2's part"), "{e}");
                }
                _ => panic!("rank {r}: {e}"),
            }
            assert!(took < Duration::from_millis(700 + 600), "{took:?}");
            assert!(matches!(later, Error::Aborted { .. }), "{later}");
        }
        idle.join().unwrap().unwrap();
    }
}
