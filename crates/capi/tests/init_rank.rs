//! One rank per process: `ar_get_unique_id` + `ar_comm_init_rank`, and `ar_comm_init_env`
//! over torchrun's variables in child processes. No GPU backend runs here, so each rank
//! asks for the host backend, which refuses groups of one process per rank only after the
//! rendezvous: its "in-process groups only" shows that the ranks met.

use std::ffi::{c_int, CStr};
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Command, Stdio};
use std::ptr;

use allreduce_bootstrap::Secret;
use allreduce_c::*;

const HOST: c_int = ar_backend_t::AR_BACKEND_HOST as c_int;
const MET: &str = "runs in-process groups only";

fn last_error() -> String {
    // SAFETY: ar_last_error returns a valid C string.
    unsafe { CStr::from_ptr(ar_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn ranks_meet_through_a_unique_id() {
    let mut id = ar_unique_id_t {
        internal: [0; AR_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is writable.
    assert_eq!(
        unsafe { ar_get_unique_id(&mut id) },
        ar_result_t::AR_SUCCESS
    );
    let results: Vec<(ar_result_t, String, bool)> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let mut comm = ptr::null_mut();
                    // SAFETY: `comm` is writable; no config.
                    let code =
                        unsafe { ar_comm_init_rank(&mut comm, HOST, 2, id, rank, 0, ptr::null()) };
                    (code, last_error(), comm.is_null())
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (rank, (code, text, untouched)) in results.into_iter().enumerate() {
        assert_eq!(code, ar_result_t::AR_INVALID_CONFIG, "rank {rank}: {text}");
        assert!(text.contains(MET), "rank {rank}: {text}");
        assert!(untouched, "nothing written on failure");
    }
}

#[test]
fn init_rank_refuses_bad_arguments_before_waiting() {
    use ar_result_t::*;
    let mut id = ar_unique_id_t {
        internal: [0; AR_UNIQUE_ID_BYTES],
    };
    let mut comm = ptr::null_mut();
    let init = |comm: *mut ar_comm_t, id, backend, n, rank, device| {
        // SAFETY: `comm` is null (refused) or writable.
        unsafe { ar_comm_init_rank(comm, backend, n, id, rank, device, ptr::null()) }
    };
    // A zeroed id was not made by ar_get_unique_id.
    assert_eq!(init(&mut comm, id, HOST, 2, 0, 0), AR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("ar_get_unique_id"),
        "{}",
        last_error()
    );
    // SAFETY: writable.
    assert_eq!(unsafe { ar_get_unique_id(&mut id) }, AR_SUCCESS);
    assert_eq!(init(&mut comm, id, HOST, 2, 2, 0), AR_INVALID_CONFIG);
    assert!(
        last_error().contains("rank 2 is outside 0..2"),
        "{}",
        last_error()
    );
    assert_eq!(init(&mut comm, id, HOST, 0, 0, 0), AR_INVALID_CONFIG);
    assert_eq!(init(&mut comm, id, HOST, 2, -1, 0), AR_INVALID_ARGUMENT);
    assert_eq!(init(&mut comm, id, HOST, 2, 0, -3), AR_INVALID_ARGUMENT);
    assert_eq!(init(&mut comm, id, 5, 2, 0, 0), AR_INVALID_ARGUMENT);
    assert_eq!(init(ptr::null_mut(), id, HOST, 2, 0, 0), AR_INVALID_USAGE);
    // A group of one needs no peer: the host backend refuses it at once.
    assert_eq!(init(&mut comm, id, HOST, 1, 0, 0), AR_INVALID_CONFIG);
    assert!(last_error().contains(MET), "{}", last_error());
    assert!(comm.is_null());
}

/// The body of the child processes below (ignored when the suite runs by itself): build a
/// rank from the environment and check the code and message the parent asked for.
#[test]
#[ignore = "run by init_env_* in a child process with its own environment"]
fn env_child() {
    let want_code: c_int = std::env::var("CAPI_TEST_WANT_CODE")
        .unwrap()
        .parse()
        .unwrap();
    let want_text = std::env::var("CAPI_TEST_WANT_TEXT").unwrap();
    let mut comm = ptr::null_mut();
    // SAFETY: `comm` is writable; no config.
    let code = unsafe { ar_comm_init_env(&mut comm, HOST, -1, ptr::null()) };
    let text = last_error();
    assert_eq!(code as c_int, want_code, "{text}");
    assert!(text.contains(&want_text), "{text:?} lacks {want_text:?}");
}

fn child(env: &[(&str, String)], want: ar_result_t, text: &str) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "env_child", "--test-threads=1"]);
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(var);
    }
    cmd.env_remove("ALLREDUCE_BOOTSTRAP_SECRET");
    cmd.env_remove("ALLREDUCE_BOOTSTRAP_PORT");
    cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    cmd.env("CAPI_TEST_WANT_CODE", (want as c_int).to_string());
    cmd.env("CAPI_TEST_WANT_TEXT", text);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

fn wait(c: std::process::Child) {
    let out = c.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "child failed: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn init_env_meets_through_torchrun_variables() {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let secret = Secret::generate().unwrap().to_hex();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let env = [
                ("RANK", rank.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("WORLD_SIZE", "2".to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.to_string()),
                ("ALLREDUCE_BOOTSTRAP_SECRET", secret.clone()),
                ("ALLREDUCE_BOOTSTRAP_TIMEOUT_S", "30".to_string()),
            ];
            child(&env, ar_result_t::AR_INVALID_CONFIG, MET)
        })
        .collect();
    children.into_iter().for_each(wait);
}

#[test]
fn init_env_names_a_missing_variable() {
    let env = [("WORLD_SIZE", "2".to_string())];
    wait(child(
        &env,
        ar_result_t::AR_INVALID_CONFIG,
        "RANK is not set",
    ));
}

/// Mistakes of a torchrun-style launch, which the bootstrap refuses: every process fails at
/// once with `AR_BOOTSTRAP_ERROR` and the reason, well before the 30 s rendezvous deadline.
#[test]
fn init_env_ranks_that_disagree_fail_at_once_with_the_reason() {
    let secret = Secret::generate().unwrap().to_hex();
    // (rank, WORLD_SIZE) of the second process, and what both must say.
    for ((rank, world), why) in [
        ((1, 3), "rank 1 has WORLD_SIZE 3, rank 0 has 2"),
        ((0, 2), "rank 0 given twice"),
    ] {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = |rank: usize, world: usize| {
            [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.to_string()),
                ("ALLREDUCE_BOOTSTRAP_SECRET", secret.clone()),
                ("ALLREDUCE_BOOTSTRAP_TIMEOUT_S", "30".to_string()),
            ]
        };
        let start = std::time::Instant::now();
        let children = [
            child(&env(0, 2), ar_result_t::AR_BOOTSTRAP_ERROR, why),
            child(&env(rank, world), ar_result_t::AR_BOOTSTRAP_ERROR, why),
        ];
        children.into_iter().for_each(wait);
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "{why}: {:?}",
            start.elapsed()
        );
    }
}
