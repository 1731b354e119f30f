"""Remote dependencies at the socket level: an OpenAI-compatible endpoint (judge, teacher) that closes the
connection before answering, resets it, cuts the body short mid-stream, answers with something that is
not HTTP, trickles bytes past the timeout, or sends JSON of the wrong shape. The client (issue 7's
``OpenAIEngine``, which ``EndpointJudgeBackend`` uses) must retry what is transient within its budget and
end with an ``EndpointError`` that says what happened, never hang and never raise from ``http.client``.

The gaps these tests first found (a body cut short or a reply that is not HTTP escaping unretried,
choices of the wrong shape returned as completions, a trickling server holding an attempt past the
timeout) are fixed in the engine and tested here.
"""

import json
import socket
import struct
import threading
import time

import pytest

from tether.config.rewards import JudgeSamplingConfig
from tether.rewards.judge import EndpointJudgeBackend, PairwiseJudge
from tether.rollout import EndpointError, OpenAIEngine, SamplingParams

FAST = {"backoff": 0.001, "max_retries": 2, "concurrency": 1, "timeout": 0.5}


def ok_body(text: str = "ok") -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]}).encode()


def http(status: int, body: bytes, *, length: int | None = None) -> bytes:
    head = (f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body) if length is None else length}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class RawServer:
    """A loopback HTTP server written on bare sockets, so that it can misbehave mid-stream. ``faults`` is
    consumed one entry per connection; an exhausted list answers normally."""

    def __init__(self, faults: list[str]) -> None:
        self.faults = list(faults)
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            fault = self.faults.pop(0) if self.faults else None
            threading.Thread(target=self._answer, args=(conn, fault), daemon=True).start()

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)

    def _answer(self, conn: socket.socket, fault: str | None) -> None:
        try:
            self._read_request(conn)
            if fault == "close":  # closes without a word
                pass
            elif fault == "reset":  # RST instead of FIN
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif fault == "truncate":  # promises 500 bytes, sends 20, hangs up
                conn.sendall(http(200, ok_body()[:20], length=500))
            elif fault == "not_http":
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            elif fault == "trickle":  # the body one byte every 0.1 s: no single read waits past the timeout
                body = b'{"choices":[{"text":"ok"}]}'
                conn.sendall(http(200, b"")[:-4].replace(b"Length: 0", f"Length: {len(body)}".encode()) + b"\r\n\r\n")
                for byte in body:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.1)
            elif fault == "bad_choices":
                conn.sendall(http(200, json.dumps({"choices": [1, "two"]}).encode()))
            elif fault == "text_not_string":
                conn.sendall(http(200, json.dumps({"choices": [{"text": {"a": 1}, "finish_reason": "stop"}]}).encode()))
            else:
                conn.sendall(http(200, ok_body()))
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture
def raw_server():
    servers = []

    def start(faults):
        servers.append(RawServer(faults))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("fault", ["close", "reset"])
def test_a_connection_dropped_before_the_reply_is_retried(raw_server, fault):
    server = raw_server([fault, fault])
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    assert engine.complete(["x"], SamplingParams()).texts == ["ok"]
    assert engine.stats["retries"] == 2 and server.connections == 3


def test_a_connection_that_keeps_dropping_spends_the_retries_then_fails_clearly(raw_server):
    server = raw_server(["close"] * 10)
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    start = time.monotonic()
    with pytest.raises(EndpointError, match=r"1 of 1 requests failed.*failed after 3 attempts; last error: "
                                            r"RemoteDisconnected"):
        engine.complete(["x"], SamplingParams())
    assert server.connections == 3 and engine.stats["failed"] == 1
    assert time.monotonic() - start < 5


def test_a_judge_over_a_dropping_endpoint_recovers(raw_server, tmp_path):
    server = raw_server(["close", "reset"])
    engine = OpenAIEngine(server.base_url, "judge", cache_dir=tmp_path, **FAST)
    judge = PairwiseJudge(EndpointJudgeBackend(engine, sampling=JudgeSamplingConfig(max_new_tokens=4)), template="compact-pairwise")
    assert judge.compare(["q"], ["a"], ["b"]) == [None]  # "ok" is no verdict: counted, not a crash
    assert judge.take_metrics()["judge/unparseable"] == 2 and engine.stats["retries"] == 2


def test_a_server_that_is_not_there_fails_within_the_budget():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    engine = OpenAIEngine(f"http://127.0.0.1:{port}/v1", "m", **FAST)
    with pytest.raises(EndpointError, match=r"failed after 3 attempts; last error: .*[Rr]efused"):
        engine.complete(["x"], SamplingParams())


def test_a_body_cut_short_mid_stream_is_retried(raw_server):
    server = raw_server(["truncate"])
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    assert engine.complete(["x"], SamplingParams()).texts == ["ok"]


def test_a_reply_that_is_not_http_is_retried(raw_server):
    server = raw_server(["not_http"])
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    assert engine.complete(["x"], SamplingParams()).texts == ["ok"]


@pytest.mark.parametrize("fault", ["bad_choices", "text_not_string"])
def test_json_of_the_wrong_shape_is_a_bad_response(raw_server, fault):
    server = raw_server([fault])
    engine = OpenAIEngine(server.base_url, "m", **FAST)
    assert engine.complete(["x"], SamplingParams()).texts == ["ok"]
    assert engine.stats["bad_responses"] == 1


def test_a_trickling_server_is_cut_off_at_the_timeout(raw_server):
    server = raw_server(["trickle"])
    engine = OpenAIEngine(server.base_url, "m", **{**FAST, "timeout": 0.3, "max_retries": 0})
    start = time.monotonic()
    with pytest.raises(EndpointError):
        engine.complete(["x"], SamplingParams())
    assert time.monotonic() - start < 1.0
