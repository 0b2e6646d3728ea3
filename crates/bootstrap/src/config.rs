//! How a [`TcpBootstrap`](crate::TcpBootstrap) is configured, by hand or from a torchrun-style
//! environment.

use std::time::Duration;

use allreduce_core::{Error, Result};

use crate::secret::{Secret, SECRET_ENV};

/// Largest group the TCP bootstrap accepts. Rank 0 holds one connection (and, while the group
/// assembles, one handshake thread) per peer, so the bound keeps a mistyped `WORLD_SIZE` from
/// costing thousands of threads.
pub const MAX_BOOTSTRAP_WORLD: usize = 4096;

/// Environment variables read by [`TcpBootstrapConfig::from_env`] besides torchrun's.
pub const TIMEOUT_ENV: &str = "ALLREDUCE_BOOTSTRAP_TIMEOUT_S";
pub const ALLOW_REMOTE_ENV: &str = "ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE";
/// Overrides `MASTER_PORT` for the bootstrap only: torch.distributed (or torchrun's agent
/// store) may already listen on `MASTER_PORT` in the same job.
pub const PORT_ENV: &str = "ALLREDUCE_BOOTSTRAP_PORT";

/// Everything a rank needs to join a group.
#[derive(Clone, Debug)]
pub struct TcpBootstrapConfig {
    pub rank: usize,
    pub world_size: usize,
    /// This process's index on its host (torchrun's `LOCAL_RANK`), for picking a device. The
    /// bootstrap itself does not use it.
    pub local_rank: Option<usize>,
    /// Where rank 0 listens and the others connect: an IP address or a host name
    /// (`MASTER_ADDR`).
    pub master_addr: String,
    pub master_port: u16,
    /// The group's shared key. `None` falls back to `ALLREDUCE_BOOTSTRAP_SECRET` when the
    /// bootstrap is built; with neither, building fails (there is no unauthenticated mode).
    pub secret: Option<Secret>,
    /// Deadline of the rendezvous and, separately, of every collective.
    pub timeout: Duration,
    /// Permit `master_addr` to resolve to a non-loopback address, i.e. rank 0 to listen on a
    /// network interface and the group's traffic to leave the host. Off by default: the
    /// handshake and frames are authenticated but not encrypted, and a port reachable only
    /// from this host is the smaller exposure.
    pub allow_remote: bool,
    /// Largest message (one rank's contribution) in bytes. Frames announcing more are refused
    /// before anything is allocated for them. All ranks must use the same value.
    pub max_message: usize,
}

impl TcpBootstrapConfig {
    pub const DEFAULT_TIMEOUT: Duration = allreduce_core::DEFAULT_TIMEOUT;
    pub const DEFAULT_MAX_MESSAGE: usize = 16 << 20;
    pub const DEFAULT_ADDR: &'static str = "127.0.0.1";

    /// A loopback group: rank 0 listens on 127.0.0.1:`master_port`. Set the secret with
    /// [`TcpBootstrapConfig::secret`] unless `ALLREDUCE_BOOTSTRAP_SECRET` provides it.
    pub fn new(rank: usize, world_size: usize, master_port: u16) -> Self {
        TcpBootstrapConfig {
            rank,
            world_size,
            local_rank: None,
            master_addr: Self::DEFAULT_ADDR.to_string(),
            master_port,
            secret: None,
            timeout: Self::DEFAULT_TIMEOUT,
            allow_remote: false,
            max_message: Self::DEFAULT_MAX_MESSAGE,
        }
    }

    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = addr.into();
        self
    }

    pub fn secret(mut self, secret: Secret) -> Self {
        self.secret = Some(secret);
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn allow_remote(mut self, allow: bool) -> Self {
        self.allow_remote = allow;
        self
    }

    pub fn max_message(mut self, bytes: usize) -> Self {
        self.max_message = bytes;
        self
    }

    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = Some(local_rank);
        self
    }

    /// Reads torchrun's variables: `RANK`, `WORLD_SIZE` (required), `LOCAL_RANK` (optional),
    /// `MASTER_ADDR`, `MASTER_PORT` (required when `WORLD_SIZE` > 1; `ALLREDUCE_BOOTSTRAP_PORT`
    /// overrides the port), plus `ALLREDUCE_BOOTSTRAP_SECRET` (64 hex digits),
    /// `ALLREDUCE_BOOTSTRAP_TIMEOUT_S` (seconds, default 60) and
    /// `ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE` (`1`/`true`/`yes` to permit a non-loopback
    /// `MASTER_ADDR`).
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`TcpBootstrapConfig::from_env`] with the variables read through `var` (for launchers
    /// that hold the environment in a map, and for tests).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let required = |name: &str| {
            get(name).ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "environment variable {name} is not set; a launcher such as torchrun sets \
                     RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process"
                ))
            })
        };
        let number = |name: &str, text: String| {
            text.trim().parse::<usize>().map_err(|_| {
                Error::InvalidConfig(format!(
                    "environment variable {name}={text:?} is not a non-negative integer"
                ))
            })
        };
        let rank = number("RANK", required("RANK")?)?;
        let world_size = number("WORLD_SIZE", required("WORLD_SIZE")?)?;
        let local_rank = get("LOCAL_RANK")
            .map(|v| number("LOCAL_RANK", v))
            .transpose()?;
        // A group of one exchanges nothing, so it needs no address (but accepts one).
        let (master_addr, port_text, port_var) = if world_size > 1 {
            let addr = required("MASTER_ADDR")?;
            match get(PORT_ENV) {
                Some(p) => (addr, p, PORT_ENV),
                None => (addr, required("MASTER_PORT")?, "MASTER_PORT"),
            }
        } else {
            (
                get("MASTER_ADDR").unwrap_or_else(|| Self::DEFAULT_ADDR.to_string()),
                get(PORT_ENV)
                    .or_else(|| get("MASTER_PORT"))
                    .unwrap_or_else(|| "0".into()),
                "MASTER_PORT",
            )
        };
        let master_port = port_text.trim().parse::<u16>().map_err(|_| {
            Error::InvalidConfig(format!(
                "environment variable {port_var}={port_text:?} is not a port number (0-65535)"
            ))
        })?;
        let secret = get(SECRET_ENV).map(|s| Secret::from_hex(&s)).transpose()?;
        let timeout = timeout_from(get(TIMEOUT_ENV))?;
        let allow_remote = match get(ALLOW_REMOTE_ENV) {
            None => false,
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" => false,
                _ => {
                    return Err(Error::InvalidConfig(format!(
                        "environment variable {ALLOW_REMOTE_ENV}={v:?} must be 1 or 0"
                    )))
                }
            },
        };
        let config = TcpBootstrapConfig {
            rank,
            world_size,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
            secret,
            timeout,
            allow_remote,
            max_message: Self::DEFAULT_MAX_MESSAGE,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that need no network (the address is checked when it is resolved).
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 || self.world_size > MAX_BOOTSTRAP_WORLD {
            return Err(Error::InvalidConfig(format!(
                "world size {} is outside 1..={MAX_BOOTSTRAP_WORLD}",
                self.world_size
            )));
        }
        if self.rank >= self.world_size {
            return Err(Error::InvalidConfig(format!(
                "rank {} is outside 0..{} (RANK must be below WORLD_SIZE)",
                self.rank, self.world_size
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "the bootstrap timeout must be positive".into(),
            ));
        }
        if self.max_message == 0 || self.max_message > u32::MAX as usize {
            return Err(Error::InvalidConfig(format!(
                "max_message {} is outside 1..={}",
                self.max_message,
                u32::MAX
            )));
        }
        if self.world_size > 1 && self.master_port == 0 {
            return Err(Error::InvalidConfig(
                "MASTER_PORT must be a fixed port (not 0): every rank has to know it in advance"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// The rendezvous deadline `ALLREDUCE_BOOTSTRAP_TIMEOUT_S` asks for (`text`, the variable's
/// value if set), or [`TcpBootstrapConfig::DEFAULT_TIMEOUT`]: for callers that build a
/// bootstrap from other inputs than the torchrun variables (the C ABI's unique id).
pub fn timeout_from(text: Option<String>) -> Result<Duration> {
    let Some(text) = text else {
        return Ok(TcpBootstrapConfig::DEFAULT_TIMEOUT);
    };
    let secs: f64 = text.trim().parse().map_err(|_| {
        Error::InvalidConfig(format!(
            "environment variable {TIMEOUT_ENV}={text:?} is not a number of seconds"
        ))
    })?;
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            Error::InvalidConfig(format!(
                "environment variable {TIMEOUT_ENV}={text:?} must be a positive number of seconds"
            ))
        })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_torchrun_variables() {
        let c = TcpBootstrapConfig::from_lookup(lookup(TORCHRUN)).unwrap();
        assert_eq!((c.rank, c.world_size, c.local_rank), (2, 4, Some(2)));
        assert_eq!(
            (c.master_addr.as_str(), c.master_port),
            ("localhost", 29500)
        );
        assert!(c.secret.is_none());
        assert!(!c.allow_remote);
        assert_eq!(c.timeout, TcpBootstrapConfig::DEFAULT_TIMEOUT);
    }

    #[test]
    fn reads_allreduce_variables() {
        let secret = "ab".repeat(32);
        let mut vars = TORCHRUN.to_vec();
        vars.extend([
            (SECRET_ENV, secret.as_str()),
            (TIMEOUT_ENV, "2.5"),
            (ALLOW_REMOTE_ENV, "1"),
            (PORT_ENV, "29511"),
        ]);
        let c = TcpBootstrapConfig::from_lookup(lookup(&vars)).unwrap();
        assert_eq!(c.secret, Some(Secret::from_bytes([0xab; 32])));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert!(c.allow_remote);
        assert_eq!(c.master_port, 29511);
    }

    #[test]
    fn missing_and_invalid_variables_are_named() {
        for (drop, want) in [
            ("RANK", "RANK is not set"),
            ("WORLD_SIZE", "WORLD_SIZE is not set"),
            ("MASTER_ADDR", "MASTER_ADDR is not set"),
            ("MASTER_PORT", "MASTER_PORT is not set"),
        ] {
            let vars: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != drop)
                .collect();
            let err = TcpBootstrapConfig::from_lookup(lookup(&vars)).unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
        }
        for (var, value, want) in [
            ("RANK", "two", "RANK=\"two\" is not a non-negative integer"),
            ("RANK", "4", "rank 4 is outside 0..4"),
            ("WORLD_SIZE", "0", "world size 0"),
            ("MASTER_PORT", "70000", "not a port number"),
            ("MASTER_PORT", "0", "fixed port"),
            (TIMEOUT_ENV, "0", "positive"),
            (TIMEOUT_ENV, "-1", "positive"),
            (TIMEOUT_ENV, "soon", "not a number of seconds"),
            (ALLOW_REMOTE_ENV, "maybe", "must be 1 or 0"),
            (SECRET_ENV, "1234", "64 hexadecimal digits"),
        ] {
            let mut vars: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != var)
                .collect();
            vars.push((var, value));
            let err = TcpBootstrapConfig::from_lookup(lookup(&vars)).unwrap_err();
            assert!(err.to_string().contains(want), "{var}={value}: {err}");
        }
    }

    #[test]
    fn a_group_of_one_needs_no_address() {
        let c =
            TcpBootstrapConfig::from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
        assert_eq!(c.world_size, 1);
    }
}
