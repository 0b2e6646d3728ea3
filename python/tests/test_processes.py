"""One process per rank: ``get_unique_id`` + ``Communicator.init_rank`` in spawned processes,
``Communicator.from_env`` in subprocesses with torchrun's variables, and
``from_process_group`` over a stand-in ``torch.distributed``. CI has no GPU backend, so the
ranks ask for the host backend, which refuses groups of one process per rank only after the
rendezvous: its "in-process groups only" on every rank shows that the ranks met. Every child
is joined with a timeout and killed if still running, so a hang fails in seconds."""

import json
import multiprocessing
import os
import queue
import re
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import allreduce
from allreduce import Communicator, _lib

HEADER = Path(__file__).resolve().parents[2] / "crates" / "capi" / "include" / "allreduce.h"
MET = "in-process groups only"
WAIT = 20.0  # seconds a test waits for its ranks' verdicts: well under the 60 s rendezvous


def _init_rank_child(results, unique_id, world, rank):
    """A spawned rank: report (rank, exception class, message, seconds) to the parent."""
    start = time.monotonic()
    try:
        Communicator.init_rank(unique_id, world, rank, backend="host", timeout=2).close()
        results.put((rank, None, "built a group", time.monotonic() - start))
    except allreduce.Error as e:
        results.put((rank, type(e).__name__, e.message, time.monotonic() - start))


def spawn_ranks(args, want):
    """Start one spawned process per ``(unique_id, world, rank)``; return the verdicts of the
    ranks in ``want`` by rank (a rank missing after ``WAIT`` is missing from the result).
    Every process still running afterwards is killed: a rank that waits for a peer which
    was refused would otherwise wait out the rendezvous deadline."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_init_rank_child, args=(results, *a), daemon=True)
             for a in args]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + WAIT
    try:
        while not set(want) <= set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, *verdict = results.get(timeout=left)
            except queue.Empty:
                break
            got[rank] = tuple(verdict)
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return got


def test_get_unique_id_gives_the_headers_size_and_a_new_group_each_time():
    size = re.search(r"#define AR_UNIQUE_ID_BYTES (\d+)", HEADER.read_text())
    assert int(size[1]) == _lib.UNIQUE_ID_BYTES
    a, b = allreduce.get_unique_id(), allreduce.get_unique_id()
    assert type(a) is bytes and len(a) == _lib.UNIQUE_ID_BYTES
    assert a != b


def test_two_processes_meet_through_a_unique_id():
    uid = allreduce.get_unique_id()
    got = spawn_ranks([(uid, 2, 0), (uid, 2, 1)], want=[0, 1])
    for rank in (0, 1):
        assert rank in got, f"rank {rank} never answered"
        cls, message, _ = got[rank]
        assert cls == "InvalidConfig", (rank, cls, message)
        assert MET in message, (rank, message)


def test_a_rank_with_another_world_size_stops_both_at_once():
    # Rank 0 expects 2 ranks and refuses rank 1's claim of 3; the group cannot form, so rank 0
    # fails at once too, with the same reason, instead of waiting out the 60 s rendezvous.
    uid = allreduce.get_unique_id()
    got = spawn_ranks([(uid, 2, 0), (uid, 3, 1)], want=[0, 1])
    for rank in (0, 1):
        assert rank in got, f"rank {rank} did not fail in time"
        cls, message, seconds = got[rank]
        assert cls == "BootstrapError", (rank, cls, message)
        assert "WORLD_SIZE 3, rank 0 has 2" in message, (rank, message)
        assert seconds < 10, (rank, seconds)
    assert "cannot form" in got[0][1], got[0]


def test_an_id_not_made_by_get_unique_id_is_refused_before_the_rendezvous():
    start = time.monotonic()
    with pytest.raises(allreduce.InvalidArgument, match="ar_get_unique_id"):
        Communicator.init_rank(bytes(_lib.UNIQUE_ID_BYTES), 2, 1, backend="host")
    assert time.monotonic() - start < 5


def test_a_group_of_one_needs_no_peer_and_the_host_backend_refuses_it():
    with pytest.raises(allreduce.InvalidConfig, match=MET):
        Communicator.init_rank(allreduce.get_unique_id(), 1, 0, backend="host")


# A subprocess rank: from_env on the host backend, its verdict as JSON on stdout.
ENV_CHILD = """
import json, time, allreduce
start = time.monotonic()
try:
    allreduce.Communicator.from_env(backend="host", timeout=2).close()
    verdict = [None, "built a group"]
except allreduce.Error as e:
    verdict = [type(e).__name__, e.message]
print(json.dumps(verdict + [time.monotonic() - start]))
"""

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "ALLREDUCE_BOOTSTRAP_SECRET", "ALLREDUCE_BOOTSTRAP_PORT",
                 "ALLREDUCE_BOOTSTRAP_TIMEOUT_S", "ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_ranks(envs):
    """Run one ``from_env`` subprocess per environment; each rank's (class, message,
    seconds), or None for a rank killed after ``WAIT``."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    procs = [subprocess.Popen([sys.executable, "-c", ENV_CHILD], env={**base, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    verdicts = []
    deadline = time.monotonic() + WAIT
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            verdicts.append(None)
            continue
        assert p.returncode == 0, err
        verdicts.append(tuple(json.loads(out.strip().splitlines()[-1])))
    return verdicts


def torchrun_env(rank, world, port, secret, deadline_s):
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "ALLREDUCE_BOOTSTRAP_SECRET": secret,
            "ALLREDUCE_BOOTSTRAP_TIMEOUT_S": str(deadline_s)}


def test_two_processes_meet_through_torchrun_variables():
    port, secret = free_port(), os.urandom(32).hex()
    verdicts = env_ranks([torchrun_env(r, 2, port, secret, 15) for r in range(2)])
    for rank, v in enumerate(verdicts):
        assert v is not None, f"rank {rank} hung"
        assert v[0] == "InvalidConfig" and MET in v[1], (rank, v)


@pytest.mark.parametrize("case", ["world", "secret", "rank 0 twice"])
def test_ranks_that_disagree_fail_at_once_on_both_sides(case):
    # A rendezvous deadline of 30 s, beyond WAIT: a rank that waited it out would be killed
    # and fail the test. Every side fails at once with the reason, through ar_comm_init_env.
    port, secret = free_port(), os.urandom(32).hex()
    rank1, world1, secret1 = {"world": (1, 3, secret),
                              "secret": (1, 2, os.urandom(32).hex()),
                              "rank 0 twice": (0, 2, secret)}[case]
    envs = [torchrun_env(0, 2, port, secret, 30),
            torchrun_env(rank1, world1, port, secret1, 30)]
    why = {"world": "WORLD_SIZE 3, rank 0 has 2", "secret": "authentication failed",
           "rank 0 twice": "rank 0 given twice"}[case]
    for rank, v in enumerate(env_ranks(envs)):
        assert v is not None, f"process {rank} waited for the deadline"
        assert v[0] == "BootstrapError", (rank, v)
        assert why in v[1], (rank, v)
        assert v[2] < 10, (rank, v)


def test_from_env_names_a_missing_variable():
    (v,) = env_ranks([{"WORLD_SIZE": "2"}])
    assert v is not None and v[0] == "InvalidConfig" and "RANK is not set" in v[1], v


@pytest.fixture
def no_c(monkeypatch):
    """Makes any call into the library fail the test: validation must come first."""
    def called(*_):
        raise AssertionError("the library was called")
    monkeypatch.setattr(_lib, "lib", called)


UID = bytes(_lib.UNIQUE_ID_BYTES)


@pytest.mark.parametrize("args, kwargs, exc, text", [
    ((UID, 2, 2), {}, ValueError, "rank 2 is outside 0..2"),
    ((UID, 2, -1), {}, ValueError, "rank -1 is outside 0..2"),
    ((UID, 0, 0), {}, ValueError, "world size 0"),
    ((UID[:-1], 2, 0), {}, ValueError, "unique_id has 127 bytes"),
    ((UID + b"x", 2, 0), {}, ValueError, "unique_id has 129 bytes"),
    ((UID.hex(), 2, 0), {}, TypeError, "unique_id is a str"),
    ((UID, "2", 0), {}, TypeError, "world is a str"),
    ((UID, 2, 1.0), {}, TypeError, "rank is a float"),
    ((UID, 2, True), {}, TypeError, "rank is a bool"),
    ((UID, 2, 0), {"backend": "nccl"}, ValueError, "backend 'nccl'"),
    ((UID, 2, 0), {"device": -1}, ValueError, "device -1"),
    ((UID, 2, 0), {"device": "cuda:0"}, TypeError, "device is a str"),
    ((UID, 2, 0), {"timeout": 0}, ValueError, "timeout 0"),
    ((UID, 2, 0), {"max_bytes": 0}, ValueError, "max_bytes 0"),
])
def test_init_rank_checks_its_arguments_before_calling_c(no_c, args, kwargs, exc, text):
    with pytest.raises(exc, match=re.escape(text)) as info:
        Communicator.init_rank(*args, **kwargs)
    assert isinstance(info.value, allreduce.Error)


@pytest.mark.parametrize("kwargs, exc", [
    ({"backend": "gloo"}, ValueError), ({"device": -2}, ValueError),
    ({"device": 1.5}, TypeError), ({"timeout": -1}, ValueError),
])
def test_from_env_checks_its_arguments_before_calling_c(no_c, kwargs, exc):
    with pytest.raises(exc) as info:
        Communicator.from_env(**kwargs)
    assert isinstance(info.value, allreduce.Error)


def test_from_process_group_without_torch_says_so(monkeypatch):
    # None in sys.modules makes the import fail whether or not torch is installed.
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(allreduce.InvalidUsage, match="needs torch.distributed"):
        Communicator.from_process_group(backend="host")


def stand_in_dist(monkeypatch, initialized, rank=0, world=1):
    """A stand-in ``torch.distributed`` for one rank; records the broadcasts."""
    dist = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: initialized,
        group=types.SimpleNamespace(WORLD="world"),
        get_rank=lambda group: rank, get_world_size=lambda group: world,
        get_process_group_ranks=lambda group: [5, 6][:world], broadcasts=[])

    def broadcast_object_list(objs, src, group):
        dist.broadcasts.append((list(objs), src, group))
    dist.broadcast_object_list = broadcast_object_list
    torch = types.SimpleNamespace(distributed=dist)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    return dist


def test_from_process_group_needs_an_initialized_group(monkeypatch):
    stand_in_dist(monkeypatch, initialized=False)
    with pytest.raises(allreduce.InvalidUsage, match="not initialized"):
        Communicator.from_process_group(backend="host")


def test_from_process_group_broadcasts_rank_0s_id(monkeypatch):
    # One rank: the host backend refuses at once, after rank 0 made and broadcast the id.
    dist = stand_in_dist(monkeypatch, initialized=True)
    with pytest.raises(allreduce.InvalidConfig, match=MET):
        Communicator.from_process_group(backend="host")
    ((objs, src, group),) = dist.broadcasts
    assert src == 5 and group == "world"
    assert type(objs[0]) is bytes and len(objs[0]) == _lib.UNIQUE_ID_BYTES


def test_from_process_group_fails_on_a_rank_that_got_no_id(monkeypatch):
    # Rank 1's stand-in broadcast leaves what rank 0 would send: here, rank 0's failure.
    dist = stand_in_dist(monkeypatch, initialized=True, rank=1, world=2)

    def broadcast_object_list(objs, src, group):
        objs[0] = "LibraryNotFound: no library"
    dist.broadcast_object_list = broadcast_object_list
    with pytest.raises(allreduce.BootstrapError, match="rank 0 could not make"):
        Communicator.from_process_group(backend="host")
