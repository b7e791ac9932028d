"""Real server processes for tests and benchmarks: ``kvstore serve`` and stock ``mlx_lm.server``.

Each runs on a free loopback port with its output in a log file, and counts as
started when ``GET /health`` answers 200. :meth:`ServerProcess.stop` sends
SIGTERM, on which ``kvstore serve`` writes its queued saves and closes the
store (a restart then finds them); :meth:`ServerProcess.kill` is SIGKILL.
Nothing here needs the ``openai`` client; it speaks HTTP with the standard library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore.testing.redis_servers import ServerError, free_port

__all__ = ["ServerProcess", "ServerError"]

_READY_TIMEOUT = 120.0


class ServerProcess:
    """One HTTP server process (see the module docstring).

    Args:
        argv: the command, without ``--port`` (added here).
        log: where its stdout and stderr go.
        env: extra environment variables.
    """

    def __init__(
        self, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.argv = [*argv, "--port", str(self.port), "--host", "127.0.0.1"]
        self.log = Path(log)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def kvstore(
        cls,
        model: str | Path,
        store: str,
        *args: str,
        log: Path,
        env: Mapping[str, str] | None = None,
    ) -> ServerProcess:
        """``kvstore serve --store STORE --model MODEL ARGS...`` (mlx-lm options in ARGS)."""
        argv = [sys.executable, "-m", "kvstore.cli", "serve", "--store", store]
        return cls([*argv, "--model", str(model), *args], log, env)

    @classmethod
    def stock(
        cls, model: str | Path, *args: str, log: Path, env: Mapping[str, str] | None = None
    ) -> ServerProcess:
        """mlx-lm's own ``mlx_lm server --model MODEL ARGS...``."""
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), *args]
        return cls(argv, log, env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API base (``openai.OpenAI(base_url=...)``)."""
        return f"{self.url}/v1"

    def start(self, timeout: float = _READY_TIMEOUT) -> ServerProcess:
        """Start the process and wait until it answers ``/health``."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> ServerProcess:
        """Start the process without waiting (several servers start at once this way)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        return self

    def wait_ready(self, timeout: float = _READY_TIMEOUT) -> ServerProcess:
        """Wait until the launched process answers ``/health`` with 200.

        Raises:
            ServerError: it exited, or did not answer in time (its log's tail is in
                the message).
        """
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.argv[:5]} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            status, _ = self.get("/health", timeout=1.0)
            if status == 200:
                return self
            time.sleep(0.1)
        self.kill()
        raise ServerError(
            f"{self.argv[:5]} did not answer /health in {timeout} s:\n{self.log_tail()}"
        )

    @staticmethod
    def start_all(*servers: ServerProcess, timeout: float = _READY_TIMEOUT) -> None:
        """Launch every server, then wait for each (their starts overlap)."""
        for server in servers:
            server.launch()
        try:
            for server in servers:
                server.wait_ready(timeout)
        except BaseException:
            for server in servers:
                server.kill()
            raise

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        """``(status, body)`` of ``GET path``; status 0 when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return 0, b""

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
        """``(status, parsed JSON or raw bytes)`` of ``POST path`` with a JSON body."""
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw, status = response.read(), response.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return 0, b""
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def stats(self) -> dict[str, Any]:
        """``GET /v1/kvstore/stats`` (``kvstore serve`` only)."""
        status, body = self.get("/v1/kvstore/stats")
        if status != 200:
            raise ServerError(f"/v1/kvstore/stats answered {status}: {body[:200]!r}")
        return dict(json.loads(body))

    def wait_saved(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the save queue is empty; returns the stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["writer"]["pending"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait (SIGKILL after ``timeout``); the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
