//! How a launcher starts a multi-process group, and what each process does.
//!
//! Run it as the launcher (it starts N copies of itself, like `torchrun --nproc-per-node N`):
//!
//! ```sh
//! cargo run -p allreduce-bootstrap --example torchrun_like -- 4
//! ```
//!
//! The launcher does what torchrun does, plus one thing torchrun does not:
//!
//! 1. picks a free loopback port for rank 0 (`MASTER_ADDR=127.0.0.1`, `MASTER_PORT`);
//! 2. generates one 32-byte secret for the group and hands it to every process as
//!    `ALLREDUCE_BOOTSTRAP_SECRET` (64 hex digits), so only these processes can join;
//! 3. starts process r with `RANK=r`, `WORLD_SIZE=N`, `LOCAL_RANK=r`, and waits for all.
//!
//! Each process (the "worker" branch below) calls `TcpBootstrap::from_env()`, which returns
//! once all N have met at rank 0, then all-gathers its host name and process id and
//! broadcasts a value from rank 0 (where an NCCL unique id would go).
//!
//! Under torchrun itself the worker branch runs unchanged; only the secret must come from
//! outside, since torchrun does not make one:
//!
//! ```sh
//! cargo build -p allreduce-bootstrap --example torchrun_like
//! export ALLREDUCE_BOOTSTRAP_SECRET=$(openssl rand -hex 32)
//! torchrun --standalone --nproc-per-node 4 --no-python target/debug/examples/torchrun_like
//! ```
//!
//! If torch.distributed already listens on `MASTER_PORT` in the same job, give the bootstrap
//! its own port with `ALLREDUCE_BOOTSTRAP_PORT`. For ranks on several hosts, set
//! `ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE=1` on every rank (the bootstrap stays on loopback
//! otherwise).

use std::process::{Command, ExitCode};

use allreduce_bootstrap::{Secret, TcpBootstrap, SECRET_ENV};
use allreduce_core::Bootstrap;

fn main() -> ExitCode {
    if std::env::var_os("RANK").is_some() {
        worker()
    } else {
        launcher()
    }
}

fn launcher() -> ExitCode {
    let world: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 4,
        Some(Ok(n)) if n >= 1 => n,
        _ => {
            eprintln!("usage: torchrun_like [NUMBER_OF_PROCESSES]");
            return ExitCode::from(2);
        }
    };
    // A port the OS says is free now. (A real launcher might fix one; torchrun's default is
    // 29500.)
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let secret = Secret::generate().expect("random bytes from /dev/urandom");
    let exe = std::env::current_exe().expect("the path of this program");
    println!("launcher: starting {world} processes, rendezvous at 127.0.0.1:{port}");
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(SECRET_ENV, secret.to_hex())
                .spawn()
                .expect("start a process")
        })
        .collect();
    let mut failed = 0;
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait().expect("wait for a process");
        if !status.success() {
            eprintln!("launcher: rank {rank} exited with {status}");
            failed += 1;
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown-host".into())
}

fn worker() -> ExitCode {
    let mut boot = match TcpBootstrap::from_env() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("rank {:?}: {e}", std::env::var("RANK").ok());
            return ExitCode::FAILURE;
        }
    };
    let me = format!("{} pid {}", hostname(), std::process::id());
    let everyone = match boot.all_gather(me.as_bytes()) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("rank {}: all_gather failed: {e}", boot.rank());
            return ExitCode::FAILURE;
        }
    };
    // Where a GPU backend would broadcast its NCCL unique id.
    let token = match boot.broadcast(
        0,
        format!("token from pid {}", std::process::id()).as_bytes(),
    ) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("rank {}: broadcast failed: {e}", boot.rank());
            return ExitCode::FAILURE;
        }
    };
    if boot.rank() == 0 {
        for (rank, who) in everyone.iter().enumerate() {
            println!("rank {rank}: {}", String::from_utf8_lossy(who));
        }
    }
    println!(
        "rank {} (local rank {:?}) received {:?}",
        boot.rank(),
        boot.local_rank(),
        String::from_utf8_lossy(&token)
    );
    ExitCode::SUCCESS
}
