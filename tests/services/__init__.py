"""Real services for the distributed tiers' tests: processes started on 127.0.0.1 by the tests
themselves and stopped by their PIDs (never by name: nothing else on the machine is touched).

``require(...)`` decides what a missing service means: a failure when ``UCM_REQUIRE_SERVICES=1``
(CI, where ``.ci/run`` installs them), a skip elsewhere.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import zlib
from typing import Callable, Optional, Sequence

import numpy as np
import pytest


def require(ok: bool, what: str) -> None:
    """Skip (or, with ``UCM_REQUIRE_SERVICES=1``, fail) unless ``ok``; ``what`` says what is missing."""
    if ok:
        return
    if os.environ.get("UCM_REQUIRE_SERVICES") == "1":
        pytest.fail(f"service required (UCM_REQUIRE_SERVICES=1): {what}", pytrace=False)
    # allow_module_level: test modules call require_module(...) at import (a plain skip there is
    # a collection error that stops the whole run, e.g. on the GPU machine without redis-py)
    pytest.skip(f"service not available: {what}", allow_module_level=True)


def require_binary(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"{name} not on PATH (.ci/run installs it)")
    return path


def require_module(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(False, f"python module {name} ({exc})")


def free_port(below: int = 65536) -> int:
    """A port free now on 127.0.0.1, under ``below`` (a Redis Cluster node also uses its port
    + 10000)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below and (below == 65536 or not port_open(port + 10000)):
            return port
    raise RuntimeError(f"no free port below {below}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class Proc:
    """One service process: ``start()`` waits until ``ready()`` holds, ``stop()`` ends it by
    PID (SIGTERM, then SIGKILL), ``kill()`` is a crash (SIGKILL), ``start()`` again restarts
    it with the same command."""

    def __init__(self, cmd: Sequence[str], ready: Callable[[], bool], env: Optional[dict] = None,
                 cwd: Optional[str] = None, log: Optional[str] = None, name: str = ""):
        self.cmd, self.ready, self.cwd, self.log = list(cmd), ready, cwd, log
        self.env = dict(os.environ, **(env or {}))
        self.name = name or os.path.basename(cmd[0])
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 30.0) -> "Proc":
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if self.log:
            out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting"
                                   f"{self._tail()}")
            try:
                if self.ready():
                    return self
            except Exception:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout} s{self._tail()}")

    def _tail(self) -> str:
        if self.log and os.path.exists(self.log):
            with open(self.log, "rb") as f:
                return ":\n" + f.read()[-3000:].decode(errors="replace")
        return ""

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """A crash: SIGKILL, no cleanup."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace: float = 5.0) -> None:
        if not self.alive():
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def rng_per_test(request):
    """A generator seeded by the test's name: the blocks of one test never collide with
    another's on a server the module shares. Modules take it as ``rng``:
    ``from services import rng_per_test as rng``."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


class FakeServer:
    """A TCP server on 127.0.0.1 for the faults no real server makes on demand: it accepts
    connections, then never answers (``"silent"``), closes each at once (``"close"``) or answers
    ``reply`` to the first bytes it receives and closes (``"garbage"``). ``accepted``: the
    connections taken so far. Stop it with :meth:`shutdown`."""

    def __init__(self, mode: str, reply: bytes = b"-ERR this is not the server you want\r\n"):
        if mode not in ("silent", "close", "garbage"):
            raise ValueError(f"mode: 'silent', 'close' or 'garbage', got {mode!r}")
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.mode, self.reply, self.conns, self.accepted, self.stop = mode, reply, [], 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.05)
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.mode == "garbage":
                try:
                    c.recv(65536)
                    c.sendall(self.reply)
                except OSError:
                    pass
            if self.mode == "silent":
                self.conns.append(c)
            else:
                c.close()

    def shutdown(self) -> None:
        self.stop = True
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()
