"""Mooncake Store on 127.0.0.1: a ``mooncake_master`` and a separate ``mooncake_client`` storage
node that lends it memory (the binaries of the ``mooncake-transfer-engine`` wheel; protocol tcp).

Every Mooncake process gets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` and logs to its log file
(``--logtostderr``: glog would otherwise write files under /tmp). The master's RPC and metrics
ports and the storage node's service port are bound to 127.0.0.1; Mooncake 0.3.13 still opens the
built-in HTTP metadata server and every transfer engine's RPC and TCP-transport ports on all
interfaces (``metadata="p2p"`` does without the HTTP server).
"""
from __future__ import annotations

import os
import shutil

from services import Proc, free_port, port_open, require, require_module


def _binary(name: str) -> str:
    """The wheel's own binary (the console scripts of the same names exec it)."""
    pkg = require_module("mooncake")
    path = os.path.join(os.path.dirname(pkg.__file__), name)
    if not os.access(path, os.X_OK):
        path = shutil.which(name)
    require(path is not None, f"{name} (pip install mooncake-transfer-engine-non-cuda)")
    return path


ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


class MooncakeService:
    """``master``: the master's address (``store.mooncake.masters``); ``metadata_server``: the
    master's built-in HTTP metadata server (``metadata="http"``) or ``P2PHANDSHAKE``
    (``metadata="p2p"``: none). ``kill_master()``/``start_master()`` crash and restart the
    master on the same ports; the storage node mounts its memory again by itself."""

    def __init__(self, tmp, segment: str = "256MB", metadata: str = "http", name: str = "mooncake"):
        require_module("mooncake.store")
        self.dir = os.path.join(str(tmp), f"{name}-{os.getpid()}-{free_port()}")
        os.makedirs(self.dir, exist_ok=True)
        self.rpc_port, self.metrics_port, self.node_port = free_port(), free_port(), free_port()
        self.master = f"127.0.0.1:{self.rpc_port}"
        cmd = [_binary("mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--logtostderr"]
        ready = [self.rpc_port]
        if metadata == "http":
            self.http_port = free_port()
            self.metadata_server = f"http://127.0.0.1:{self.http_port}/metadata"
            cmd += ["--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={self.http_port}"]
            ready.append(self.http_port)
        elif metadata == "p2p":
            self.http_port = None
            self.metadata_server = "P2PHANDSHAKE"
        else:
            raise ValueError(f"metadata: 'http' or 'p2p', got {metadata!r}")
        self.master_proc = Proc(cmd, ready=lambda: all(port_open(p) for p in ready), env=ENV,
                                log=os.path.join(self.dir, "master.log"), name=f"{name}-master")
        self.node = Proc([_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.node_port}",
                          f"--master_server_address={self.master}",
                          f"--metadata_server={self.metadata_server}",
                          f"--global_segment_size={segment}", "--protocol=tcp", "--logtostderr"],
                         ready=lambda: port_open(self.node_port), env=ENV,
                         log=os.path.join(self.dir, "node.log"), name=f"{name}-node")
        self.master_proc.start()
        try:
            self.node.start()
        except BaseException:
            self.master_proc.stop()
            raise

    def kill_master(self) -> None:
        self.master_proc.kill()

    def start_master(self) -> None:
        self.master_proc.start()

    def client(self, local_buffer: int = 16 << 20):
        """A raw ``MooncakeDistributedStore`` of this store (tests write under the tier's keys)."""
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        from mooncake.store import MooncakeDistributedStore

        c = MooncakeDistributedStore()
        rc = c.setup("127.0.0.1", self.metadata_server, 0, local_buffer, "tcp", "", self.master)
        if rc != 0:
            raise RuntimeError(f"mooncake client setup failed: {rc}")
        return c

    def log_tail(self, n: int = 3000) -> str:
        out = []
        for p in (self.master_proc, self.node):
            if p.log and os.path.exists(p.log):
                with open(p.log, "rb") as f:
                    out.append(f"--- {p.name}\n" + f.read()[-n:].decode(errors="replace"))
        return "\n".join(out)

    def stop(self) -> None:
        self.node.stop()
        self.master_proc.stop()

