"""Running ``tether serve``: the request-size guard (ASGI middleware), sockets, a server in a thread
(:class:`BackgroundServer`), a child process (:class:`ServerProcess`) and :func:`serve` itself."""

# no `from __future__ import annotations`: kept as the app module (FastAPI reads annotations there)
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tether.serve.app import create_app
from tether.serve.scheduler import ServeBudget

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 1 << 20
LISTENING = "tether serve: listening on "
LOOPBACK = ("127.0.0.1", "localhost", "::1")


# ---- running it ---------------------------------------------------------------------------------------


def bind_socket(host: str = DEFAULT_HOST, port: int = 0) -> socket.socket:
    """A listening TCP socket; port 0 takes a free one (read it back with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


class BackgroundServer:
    """An app under uvicorn in a thread of this process on a free loopback port (tests, notebooks).

    >>> with BackgroundServer(create_app(model, tok)) as server:   # doctest: +SKIP
    ...     OpenAIEngine(server.base_url, "tether")
    """

    def __init__(self, app: Any, host: str = DEFAULT_HOST, port: int = 0) -> None:
        import uvicorn

        self.socket = bind_socket(host, port)
        self.port = self.socket.getsockname()[1]
        self.base_url = _url(host, self.port)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def start(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServerProcess:
    """``tether serve MODEL`` as a child process on a free loopback port, stopped by :meth:`stop`.

    The child's output goes to ``log_path`` (a temporary file by default); :meth:`start` waits until
    the server answers ``/v1/models`` and fails with the log's tail if the child dies first.
    """

    def __init__(self, model: str | Path, *, host: str = DEFAULT_HOST, model_name: str | None = None,
                 api_key_env: str | None = None, log_path: str | Path | None = None,
                 extra_args: Sequence[str] = (), startup_timeout: float = 180.0) -> None:
        self.model, self.host, self.model_name = str(model), host, model_name or Path(str(model)).name
        self.api_key_env, self.extra_args, self.startup_timeout = api_key_env, list(extra_args), startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def start(self) -> "ServerProcess":
        import tempfile

        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="tether-serve-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "tether.cli", "serve", self.model, "--host", self.host, "--port", "0",
                   "--model-name", self.model_name, *self.extra_args]
        if self.api_key_env:
            command += ["--api-key-env", self.api_key_env]
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        self.base_url = self._wait_for_url()
        self._wait_ready()
        return self

    def _tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
        return text[-2000:]

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            for line in self._tail().splitlines():
                if line.startswith(LISTENING):
                    return line[len(LISTENING):].split()[0]
            if self.process.poll() is not None:
                raise RuntimeError(f"tether serve exited with code {self.process.returncode}:\n{self._tail()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tether serve did not start within {self.startup_timeout:.0f}s:\n{self._tail()}")

    def _wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + self.startup_timeout
        headers = {}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        while time.monotonic() < deadline:
            try:
                request = urllib.request.Request(f"{self.base_url}/models", headers=headers)
                with urllib.request.urlopen(request, timeout=2):
                    return
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"tether serve exited with code {self.process.returncode}:\n"
                                       f"{self._tail()}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tether serve did not answer within {self.startup_timeout:.0f}s:\n{self._tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(model: str, *, host: str = DEFAULT_HOST, port: int = 8000, model_name: str | None = None,
          api_key_env: str | None = None, insecure_no_api_key: bool = False, device: str = "cpu",
          dtype: str = "float32", threads: int | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
          budget: ServeBudget | None = None, max_tokens_default: int = 64) -> None:
    """Load ``model`` and serve it until interrupted (what ``tether serve`` runs). A host other than the
    loopback needs an API key, or ``insecure_no_api_key`` said out loud."""
    import torch
    import uvicorn

    from tether.models import load_model

    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {api_key_env}: the environment variable is not set or empty")
    elif host not in LOOPBACK:
        if not insecure_no_api_key:
            raise ValueError(f"refusing to serve on {host} without an API key: anyone who can reach it could use "
                             "it; set --api-key-env VAR, or pass --insecure-no-api-key")
        log.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    if threads:
        torch.set_num_threads(threads)
    policy, tokenizer = load_model(model, device=device, dtype=dtype)
    app = create_app(policy, tokenizer, model_name=model_name or Path(model).name, api_key=api_key,
                     max_request_bytes=max_request_bytes, budget=budget, max_tokens_default=max_tokens_default)
    sock = bind_socket(host, port)
    print(f"{LISTENING}{_url(host, sock.getsockname()[1])} (model {model_name or Path(model).name})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
