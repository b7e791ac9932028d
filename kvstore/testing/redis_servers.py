"""Real ``redis-server`` processes for tests and benchmarks: one server, or a 3-node cluster.

Each runs on a free loopback port in a directory of its own, without
persistence unless asked (``appendonly=True`` makes every write durable, so
a server killed with SIGKILL and restarted on the same port still has its
data). Nothing here talks Redis beyond ``PING`` and ``CLUSTER INFO``, sent
over a plain socket, so it works without redis-py.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["redis_binaries", "RedisServer", "RedisClusterServers", "ServerError"]

_READY_TIMEOUT = 15.0


class ServerError(RuntimeError):
    """A test server did not start (its log's tail is in the message)."""


def redis_binaries() -> tuple[str, str] | None:
    """Paths of ``redis-server`` and ``redis-cli``, or ``None`` when either is missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A loopback port nobody listens on (and, for a cluster node, its bus port +10000 too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster or (port < 55535 and _port_free(port + 10000)):
            return port
    raise ServerError("no free loopback port found")


def _ask(port: int, command: bytes, timeout: float = 1.0) -> bytes:
    """Send one inline command; the reply's payload (b'' when nothing answers)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(command + b"\r\n")
            reply = b""
            while True:
                data = s.recv(65536)
                if not data:
                    return reply
                reply += data
                head, sep, body = reply.partition(b"\r\n")
                if sep and (not head.startswith(b"$") or len(body) >= int(head[1:]) + 2):
                    return reply
    except (OSError, ValueError):
        return b""


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port`` in ``root``.

    Args:
        root: a directory for its files (log, AOF, cluster config).
        port: the port; a free one when ``None``.
        appendonly: persist every write (``appendfsync always``).
        cluster: start as a cluster node (``--cluster-enabled yes``).
        args: more ``redis-server`` arguments (``["--maxmemory", "2mb"]``).
    """

    def __init__(
        self,
        root: Path,
        *,
        port: int | None = None,
        appendonly: bool = False,
        cluster: bool = False,
        args: Sequence[str] = (),
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster)
        self.appendonly = appendonly
        self.cluster = cluster
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        binaries = redis_binaries()
        if binaries is None:
            raise ServerError("redis-server and redis-cli are not installed")
        cmd = [
            binaries[0],
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.root),
            "--logfile", str(self.root / "redis.log"),
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.appendonly:
            cmd += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            cmd += ["--appendonly", "no"]
        if self.cluster:
            cmd += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.root / "nodes.conf"),
                "--cluster-node-timeout", "3000",
            ]  # fmt: skip
        return cmd + self.args

    def start(self) -> RedisServer:
        """Start and wait until it answers PING."""
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"redis-server exited at start:\n{self.log_tail()}")
            if _ask(self.port, b"PING").startswith(b"+PONG"):
                return self
            time.sleep(0.02)
        self.stop()
        raise ServerError(
            f"redis-server did not answer within {_READY_TIMEOUT}s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.root / "redis.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot exit
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """``nodes`` cluster-enabled servers joined by ``redis-cli --cluster create``, no replicas."""

    def __init__(self, root: Path, nodes: int = 3) -> None:
        self.servers = [RedisServer(Path(root) / f"node{i}", cluster=True) for i in range(nodes)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self) -> RedisClusterServers:
        try:
            for server in self.servers:
                server.start()
            binaries = redis_binaries()
            assert binaries is not None
            create = [binaries[1], "--cluster", "create"]
            create += [f"127.0.0.1:{s.port}" for s in self.servers]
            create += ["--cluster-replicas", "0", "--cluster-yes"]
            out = subprocess.run(create, capture_output=True, text=True, timeout=60)
            if out.returncode:
                raise ServerError(f"redis-cli --cluster create failed:\n{out.stdout}{out.stderr}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            infos = [_ask(s.port, b"CLUSTER INFO") for s in self.servers]
            if all(b"cluster_state:ok" in i and b"cluster_slots_ok:16384" in i for i in infos):
                return
            time.sleep(0.05)
        raise ServerError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
