//! The bytes on the wire: handshake messages, authenticated frames, and socket IO bounded by a
//! deadline. The layout is documented in the crate root.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::mac::{self, DIGEST_LEN};
use crate::secret::{random_bytes, Secret};

pub const VERSION: u16 = 1;
pub const NONCE_LEN: usize = 32;

pub const SERVER_HELLO_MAGIC: &[u8; 4] = b"ARBS";
pub const CLIENT_HELLO_MAGIC: &[u8; 4] = b"ARBC";
pub const SERVER_REPLY_MAGIC: &[u8; 4] = b"ARBA";

/// magic, version, reserved, server nonce.
pub const SERVER_HELLO_LEN: usize = 4 + 2 + 2 + NONCE_LEN;
/// magic, version, reserved, rank, world, client nonce, MAC.
pub const CLIENT_HELLO_LEN: usize = 4 + 2 + 2 + 4 + 4 + NONCE_LEN + DIGEST_LEN;
/// magic, status, reserved, body length; then the body.
pub const SERVER_REPLY_HEAD_LEN: usize = 4 + 1 + 1 + 2;
/// Longest refusal reason rank 0 sends (and a client reads).
pub const MAX_REASON: usize = 512;

pub const STATUS_ACCEPTED: u8 = 0;
pub const STATUS_REFUSED: u8 = 1;

/// kind, op, reserved, root, sequence number, payload length.
pub const FRAME_HEADER_LEN: usize = 1 + 1 + 2 + 4 + 8 + 8;
/// Payload bound of frames that carry only a reason (Reject, Fail, Ready).
pub const MAX_CONTROL_PAYLOAD: u64 = 8192;

// Domain separation: each MAC and key has its own label, so no value computed for one purpose
// (say a client's proof) is valid for another (the server's proof, a frame tag).
const LABEL_CLIENT: &[u8] = b"allreduce-bootstrap/1 client proof";
const LABEL_SERVER: &[u8] = b"allreduce-bootstrap/1 server proof";
const LABEL_TO_ROOT: &[u8] = b"allreduce-bootstrap/1 key to rank 0";
const LABEL_FROM_ROOT: &[u8] = b"allreduce-bootstrap/1 key from rank 0";

/// Why a read or write did not complete.
#[derive(Debug)]
pub enum IoFail {
    TimedOut,
    /// The peer closed or reset the connection.
    Closed,
    Other(io::Error),
}

impl std::fmt::Display for IoFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoFail::TimedOut => write!(f, "timed out"),
            IoFail::Closed => write!(f, "connection closed by the peer"),
            IoFail::Other(e) => write!(f, "{e}"),
        }
    }
}

fn classify(e: io::Error) -> IoFail {
    use io::ErrorKind::*;
    match e.kind() {
        WouldBlock | TimedOut => IoFail::TimedOut,
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof | NotConnected => {
            IoFail::Closed
        }
        _ => IoFail::Other(e),
    }
}

fn remaining(deadline: Instant) -> Result<Duration, IoFail> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(IoFail::TimedOut)
    } else {
        Ok(left)
    }
}

/// `read_exact` that gives up at `deadline`. The socket timeout is re-armed before every
/// `read`, so a peer trickling bytes cannot stretch the wait past the deadline.
pub fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), IoFail> {
    let mut done = 0;
    while done < buf.len() {
        s.set_read_timeout(Some(remaining(deadline)?))
            .map_err(IoFail::Other)?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(IoFail::Closed),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(e)),
        }
    }
    Ok(())
}

/// `write_all` that gives up at `deadline` (in chunks, re-arming the socket timeout).
pub fn write_all_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> Result<(), IoFail> {
    const CHUNK: usize = 1 << 20;
    let mut done = 0;
    while done < buf.len() {
        s.set_write_timeout(Some(remaining(deadline)?))
            .map_err(IoFail::Other)?;
        let end = (done + CHUNK).min(buf.len());
        match s.write(&buf[done..end]) {
            Ok(0) => return Err(IoFail::Closed),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(e)),
        }
    }
    Ok(())
}

pub fn nonce() -> allreduce_core::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    random_bytes(&mut n)?;
    Ok(n)
}

/// What both sides of one connection's handshake know once the hellos are exchanged.
pub struct Transcript {
    pub server_nonce: [u8; NONCE_LEN],
    pub client_nonce: [u8; NONCE_LEN],
    pub rank: u32,
    pub world: u32,
}

impl Transcript {
    fn mac(&self, secret: &Secret, label: &[u8]) -> [u8; DIGEST_LEN] {
        let (rank, world) = (self.rank.to_le_bytes(), self.world.to_le_bytes());
        let parts = [label, &self.server_nonce, &self.client_nonce, &rank, &world];
        mac::mac(secret.as_bytes(), &parts)
    }
    fn verify(&self, secret: &Secret, label: &[u8], proof: &[u8]) -> bool {
        let (rank, world) = (self.rank.to_le_bytes(), self.world.to_le_bytes());
        let parts = [label, &self.server_nonce, &self.client_nonce, &rank, &world];
        mac::verify(secret.as_bytes(), &parts, proof)
    }
    pub fn client_proof(&self, secret: &Secret) -> [u8; DIGEST_LEN] {
        self.mac(secret, LABEL_CLIENT)
    }
    pub fn server_proof(&self, secret: &Secret) -> [u8; DIGEST_LEN] {
        self.mac(secret, LABEL_SERVER)
    }
    /// Whether a rank's proof shows it knows the secret (compared in constant time).
    pub fn client_proof_ok(&self, secret: &Secret, proof: &[u8]) -> bool {
        self.verify(secret, LABEL_CLIENT, proof)
    }
    /// Whether rank 0's proof shows it knows the secret (compared in constant time).
    pub fn server_proof_ok(&self, secret: &Secret, proof: &[u8]) -> bool {
        self.verify(secret, LABEL_SERVER, proof)
    }
    /// Keys of the frames sent to rank 0 and from rank 0 on this connection. Fresh per
    /// connection (both nonces go in), so frames cannot be replayed into another connection.
    pub fn keys(&self, secret: &Secret) -> ([u8; DIGEST_LEN], [u8; DIGEST_LEN]) {
        (
            self.mac(secret, LABEL_TO_ROOT),
            self.mac(secret, LABEL_FROM_ROOT),
        )
    }
}

pub fn server_hello(nonce: &[u8; NONCE_LEN]) -> [u8; SERVER_HELLO_LEN] {
    let mut m = [0u8; SERVER_HELLO_LEN];
    m[..4].copy_from_slice(SERVER_HELLO_MAGIC);
    m[4..6].copy_from_slice(&VERSION.to_le_bytes());
    m[8..].copy_from_slice(nonce);
    m
}

/// The server hello's version and nonce, or why it is not one.
pub fn parse_server_hello(m: &[u8; SERVER_HELLO_LEN]) -> Result<[u8; NONCE_LEN], String> {
    if &m[..4] != SERVER_HELLO_MAGIC {
        return Err("it did not greet like an allreduce bootstrap rank 0 (bad magic)".into());
    }
    let version = u16::from_le_bytes([m[4], m[5]]);
    if version != VERSION {
        return Err(format!(
            "it speaks bootstrap protocol version {version}, this rank {VERSION}"
        ));
    }
    Ok(m[8..].try_into().expect("nonce"))
}

pub fn client_hello(t: &Transcript, proof: &[u8; DIGEST_LEN]) -> [u8; CLIENT_HELLO_LEN] {
    let mut m = [0u8; CLIENT_HELLO_LEN];
    m[..4].copy_from_slice(CLIENT_HELLO_MAGIC);
    m[4..6].copy_from_slice(&VERSION.to_le_bytes());
    m[8..12].copy_from_slice(&t.rank.to_le_bytes());
    m[12..16].copy_from_slice(&t.world.to_le_bytes());
    m[16..16 + NONCE_LEN].copy_from_slice(&t.client_nonce);
    m[16 + NONCE_LEN..].copy_from_slice(proof);
    m
}

pub struct ClientHello {
    pub version: u16,
    pub rank: u32,
    pub world: u32,
    pub nonce: [u8; NONCE_LEN],
    pub proof: [u8; DIGEST_LEN],
}

/// `None` if the magic is wrong: not a bootstrap client, not worth an answer.
pub fn parse_client_hello(m: &[u8; CLIENT_HELLO_LEN]) -> Option<ClientHello> {
    if &m[..4] != CLIENT_HELLO_MAGIC {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes(m[i..i + 4].try_into().expect("4 bytes"));
    Some(ClientHello {
        version: u16::from_le_bytes([m[4], m[5]]),
        rank: u32_at(8),
        world: u32_at(12),
        nonce: m[16..16 + NONCE_LEN].try_into().expect("nonce"),
        proof: m[16 + NONCE_LEN..].try_into().expect("proof"),
    })
}

pub fn server_reply(status: u8, body: &[u8]) -> Vec<u8> {
    let body = &body[..body.len().min(MAX_REASON)];
    let mut m = Vec::with_capacity(SERVER_REPLY_HEAD_LEN + body.len());
    m.extend_from_slice(SERVER_REPLY_MAGIC);
    m.push(status);
    m.push(0);
    m.extend_from_slice(&(body.len() as u16).to_le_bytes());
    m.extend_from_slice(body);
    m
}

/// What a frame is. Clients send `Contrib` or `Reject`; rank 0 sends the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A rank's part of a collective.
    Contrib = 1,
    /// A rank refused its own arguments (payload: the reason); it takes part in the
    /// collective's accounting without data.
    Reject = 2,
    /// Rank 0's answer: the gathered or broadcast bytes.
    Result = 3,
    /// Rank 0's answer when the collective failed (payload: [`Failure`]).
    Fail = 4,
    /// Every rank has joined (sequence number 0).
    Ready = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Contrib,
            2 => Kind::Reject,
            3 => Kind::Result,
            4 => Kind::Fail,
            5 => Kind::Ready,
            _ => return None,
        })
    }
}

/// Which collective a frame belongs to, so ranks that call different ones are told so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    None = 0,
    AllGather = 1,
    Broadcast = 2,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            0 => Op::None,
            1 => Op::AllGather,
            2 => Op::Broadcast,
            _ => return None,
        })
    }
}

#[derive(Debug)]
pub struct Frame {
    pub kind: Kind,
    pub op: Op,
    pub root: u32,
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// Why a frame was not accepted.
#[derive(Debug)]
pub enum RecvFail {
    Io(IoFail),
    /// The bytes arrived but are not a valid frame (the reason says how).
    Malformed(String),
}

impl std::fmt::Display for RecvFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecvFail::Io(e) => write!(f, "{e}"),
            RecvFail::Malformed(why) => write!(f, "malformed frame: {why}"),
        }
    }
}

/// An authenticated connection between rank 0 and one other rank.
pub struct Link {
    pub stream: TcpStream,
    send_key: [u8; DIGEST_LEN],
    recv_key: [u8; DIGEST_LEN],
}

impl Link {
    pub fn new(stream: TcpStream, send_key: [u8; DIGEST_LEN], recv_key: [u8; DIGEST_LEN]) -> Self {
        Link {
            stream,
            send_key,
            recv_key,
        }
    }

    fn header(kind: Kind, op: Op, root: u32, seq: u64, len: u64) -> [u8; FRAME_HEADER_LEN] {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[0] = kind as u8;
        h[1] = op as u8;
        h[4..8].copy_from_slice(&root.to_le_bytes());
        h[8..16].copy_from_slice(&seq.to_le_bytes());
        h[16..24].copy_from_slice(&len.to_le_bytes());
        h
    }

    fn tag(key: &[u8; DIGEST_LEN], header: &[u8], payload: &[u8]) -> [u8; DIGEST_LEN] {
        mac::mac(key, &[header, payload])
    }

    /// Header, payload and tag in one write (one segment for small frames; TCP_NODELAY is on).
    pub fn send(
        &mut self,
        kind: Kind,
        op: Op,
        root: u32,
        seq: u64,
        payload: &[u8],
        deadline: Instant,
    ) -> Result<(), IoFail> {
        let header = Self::header(kind, op, root, seq, payload.len() as u64);
        let tag = Self::tag(&self.send_key, &header, payload);
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + payload.len() + DIGEST_LEN);
        frame.extend_from_slice(&header);
        frame.extend_from_slice(payload);
        frame.extend_from_slice(&tag);
        write_all_by(&mut self.stream, &frame, deadline)
    }

    /// Reads one frame of at most `max_payload` bytes of payload. The length is checked before
    /// anything is allocated, and the tag before anything is interpreted.
    pub fn recv(&mut self, max_payload: u64, deadline: Instant) -> Result<Frame, RecvFail> {
        let mut header = [0u8; FRAME_HEADER_LEN];
        read_exact_by(&mut self.stream, &mut header, deadline).map_err(RecvFail::Io)?;
        let len = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        if len > max_payload {
            return Err(RecvFail::Malformed(format!(
                "it announces {len} bytes of payload, above the limit of {max_payload} \
                 (do the ranks use the same max_message?)"
            )));
        }
        let mut payload = vec![0u8; len as usize];
        read_exact_by(&mut self.stream, &mut payload, deadline).map_err(RecvFail::Io)?;
        let mut tag = [0u8; DIGEST_LEN];
        read_exact_by(&mut self.stream, &mut tag, deadline).map_err(RecvFail::Io)?;
        if !mac::verify(&self.recv_key, &[&header, &payload], &tag) {
            return Err(RecvFail::Malformed(
                "its authentication tag is wrong (altered in transit or not from the peer)".into(),
            ));
        }
        let kind = Kind::from_u8(header[0])
            .ok_or_else(|| RecvFail::Malformed(format!("unknown kind {}", header[0])))?;
        let op = Op::from_u8(header[1])
            .ok_or_else(|| RecvFail::Malformed(format!("unknown collective {}", header[1])))?;
        if header[2..4] != [0, 0] {
            return Err(RecvFail::Malformed("reserved bytes are not zero".into()));
        }
        Ok(Frame {
            kind,
            op,
            root: u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")),
            seq: u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")),
            payload,
        })
    }

    /// Whether rank 0 has sent something unasked (only a `Fail` after the group broke) or
    /// closed the connection, checked without blocking before a rank starts a collective.
    pub fn pending(&mut self) -> io::Result<bool> {
        self.stream.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        let r = self.stream.peek(&mut b);
        self.stream.set_nonblocking(false)?;
        match r {
            Ok(_) => Ok(true), // data, or 0 bytes: end of stream
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(_) => Ok(true), // reset: the next read reports it
        }
    }
}

/// Why rank 0 failed a collective, as it tells the other ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailCode {
    Timeout = 1,
    Mismatch = 2,
    PeerRejected = 3,
    Aborted = 4,
    /// Rank 0 refused a joining rank while the group assembled, so it cannot form.
    Refused = 5,
}

#[derive(Debug)]
pub struct Failure {
    pub code: FailCode,
    /// The rank the failure is about (the late, rejecting or lost one), if any.
    pub rank: u32,
    pub waited: Duration,
    pub reason: String,
}

impl Failure {
    pub fn encode(&self) -> Vec<u8> {
        let reason = truncate(&self.reason, MAX_CONTROL_PAYLOAD as usize - 13);
        let mut p = Vec::with_capacity(13 + reason.len());
        p.push(self.code as u8);
        p.extend_from_slice(&self.rank.to_le_bytes());
        p.extend_from_slice(&(self.waited.as_millis() as u64).to_le_bytes());
        p.extend_from_slice(reason.as_bytes());
        p
    }

    pub fn decode(p: &[u8]) -> Option<Failure> {
        if p.len() < 13 {
            return None;
        }
        let code = match p[0] {
            1 => FailCode::Timeout,
            2 => FailCode::Mismatch,
            3 => FailCode::PeerRejected,
            4 => FailCode::Aborted,
            5 => FailCode::Refused,
            _ => return None,
        };
        Some(Failure {
            code,
            rank: u32::from_le_bytes(p[1..5].try_into().ok()?),
            waited: Duration::from_millis(u64::from_le_bytes(p[5..13].try_into().ok()?)),
            reason: String::from_utf8_lossy(&p[13..]).into_owned(),
        })
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// All-gather result: rank count (u32), then per rank its length (u64) and bytes.
pub fn encode_gathered(parts: &[&[u8]]) -> Vec<u8> {
    let total: usize = parts.iter().map(|p| 8 + p.len()).sum();
    let mut out = Vec::with_capacity(4 + total);
    out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

pub fn decode_gathered(mut p: &[u8], world: usize) -> Result<Vec<Vec<u8>>, String> {
    let take = |p: &mut &[u8], n: usize| -> Result<Vec<u8>, String> {
        if p.len() < n {
            return Err("the gathered result is truncated".into());
        }
        let (head, rest) = p.split_at(n);
        *p = rest;
        Ok(head.to_vec())
    };
    let count = u32::from_le_bytes(take(&mut p, 4)?.try_into().expect("4 bytes")) as usize;
    if count != world {
        return Err(format!(
            "the gathered result holds {count} messages for {world} ranks"
        ));
    }
    let mut parts = Vec::with_capacity(world);
    for _ in 0..world {
        let len = u64::from_le_bytes(take(&mut p, 8)?.try_into().expect("8 bytes"));
        let len = usize::try_from(len).map_err(|_| "a length does not fit in memory")?;
        parts.push(take(&mut p, len)?);
    }
    if !p.is_empty() {
        return Err(format!("{} bytes follow the gathered messages", p.len()));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_round_trip_and_malformed() {
        let parts: [&[u8]; 3] = [b"a", b"", b"ccc"];
        let enc = encode_gathered(&parts);
        assert_eq!(
            decode_gathered(&enc, 3).unwrap(),
            vec![b"a".to_vec(), vec![], b"ccc".to_vec()]
        );
        assert!(decode_gathered(&enc, 2).is_err());
        assert!(decode_gathered(&enc[..enc.len() - 1], 3).is_err());
        let mut long = enc.clone();
        long.push(0);
        assert!(decode_gathered(&long, 3).is_err());
        // A huge announced length is an error, not an allocation.
        let mut huge = 1u32.to_le_bytes().to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_gathered(&huge, 1).is_err());
    }

    #[test]
    fn failure_round_trip() {
        let f = Failure {
            code: FailCode::PeerRejected,
            rank: 3,
            waited: Duration::from_millis(1500),
            reason: "é".repeat(10_000),
        };
        let g = Failure::decode(&f.encode()).unwrap();
        assert_eq!((g.code, g.rank, g.waited), (f.code, 3, f.waited));
        assert!(g.reason.len() <= MAX_CONTROL_PAYLOAD as usize);
        assert!(Failure::decode(&[9; 13]).is_none());
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("héllo", 3), "hé");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
