"""The TCP link to ranks on other hosts admits only peers holding the run's secret."""

from __future__ import annotations

import socket

import pytest
import zmq

from pocketllm.errors import InvalidRequestError
from pocketllm.proto import codec
from pocketllm.proto.messages import Ping, WorkerReady, WorkerCapabilities
from pocketllm.remote import RemoteRanks, SchedulerLink, read_secret

SECRET = b"0123456789abcdef-run-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def link():
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ranks = RemoteRanks(ctx, endpoint, SECRET, ranks=[1])
    yield ctx, endpoint, ranks
    ranks.close()
    ctx.destroy(linger=0)


def ready_msg() -> bytes:
    caps = WorkerCapabilities(device="cpu", dtype="float32", architecture="x", block_size=16,
                              num_kv_blocks=1, max_num_seqs=1, max_model_len=8, vocab_size=8)
    return codec.encode(WorkerReady(rank=1, capabilities=caps))


def test_rank_with_the_secret_is_heard_and_gets_plans(link):
    ctx, endpoint, ranks = link
    peer = SchedulerLink(ctx, endpoint, SECRET, rank=1)
    peer.send(ready_msg())
    assert ranks.sock.poll(5000)
    rank, data = ranks.recv()
    assert rank == 1 and isinstance(codec.decoder_for("scheduler").decode(data), WorkerReady)
    ranks.send_all(b"plan-bytes")
    assert peer.recv() == b"plan-bytes"


@pytest.mark.parametrize("keys", ["none", "wrong-secret"])
def test_peer_without_the_secret_cannot_inject(link, keys):
    ctx, endpoint, ranks = link
    if keys == "none":
        intruder = ctx.socket(zmq.DEALER)
        intruder.identity = b"rank1"
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(endpoint)
        intruder.send(ready_msg())
    else:
        intruder = SchedulerLink(ctx, endpoint, b"another-secret-of-16+bytes", rank=1)
        intruder.send(ready_msg())
    assert not ranks.sock.poll(1500)  # nothing gets through
    assert ranks.last_heard == {}


def test_secret_required_and_long_enough(tmp_path, monkeypatch):
    monkeypatch.delenv("POCKETLLM_RUN_SECRET", raising=False)
    with pytest.raises(InvalidRequestError):
        read_secret(None)
    short = tmp_path / "s"
    short.write_bytes(b"short")
    with pytest.raises(InvalidRequestError):
        read_secret(str(short))
    good = tmp_path / "g"
    good.write_bytes(SECRET + b"\n")
    assert read_secret(str(good)) == SECRET
    monkeypatch.setenv("POCKETLLM_RUN_SECRET", SECRET.decode())
    assert read_secret(None) == SECRET


def test_heartbeat_silence_is_reported(link, monkeypatch):
    ctx, endpoint, ranks = link
    import pocketllm.remote as remote

    peer = SchedulerLink(ctx, endpoint, SECRET, rank=1)
    peer.send(codec.encode(Ping()))
    assert ranks.sock.poll(5000)
    ranks.recv()
    assert ranks.tick() is None
    monkeypatch.setattr(remote, "HEARTBEAT_TIMEOUT_S", 0.0)
    assert ranks.tick() == 1
