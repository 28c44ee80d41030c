"""redis-server (Debian's package) on 127.0.0.1: a standalone server and a 3-master cluster."""
from __future__ import annotations

import os
import subprocess
import time
from typing import Optional

from services import Proc, free_port, port_open, require_binary


def make_certs(d) -> dict:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl), as paths."""
    openssl = require_binary("openssl")
    d = str(d)
    p = {k: os.path.join(d, k) for k in ("ca.key", "ca.crt", "server.key", "server.crt",
                                         "client.key", "client.crt", "san.cnf")}
    with open(p["san.cnf"], "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")

    def run(*args):
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p["ca.key"], "-out", p["ca.crt"],
        "-days", "2", "-subj", "/CN=ucm-test-ca")
    for who in ("server", "client"):
        csr = os.path.join(d, who + ".csr")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", p[who + ".key"], "-out", csr,
            "-subj", f"/CN=ucm-test-{who}")
        run("x509", "-req", "-in", csr, "-CA", p["ca.crt"], "-CAkey", p["ca.key"], "-CAcreateserial",
            "-out", p[who + ".crt"], "-days", "2", "-extfile", p["san.cnf"])
    return p


def redis_server(tmp, port: Optional[int] = None, password: Optional[str] = None,
                 maxmemory: Optional[str] = None, policy: str = "allkeys-lru",
                 extra: tuple = (), name: str = "redis", tls: Optional[dict] = None) -> Proc:
    """A started redis-server (no persistence); ``proc.port``, ``proc.url``. With ``tls`` (from
    :func:`make_certs`): TLS only, client certificates required, ``proc.url`` is rediss://."""
    binary = require_binary("redis-server")
    port = port or free_port(below=55536 if "--cluster-enabled" in extra else 65536)
    d = os.path.join(str(tmp), f"{name}-{port}")
    os.makedirs(d, exist_ok=True)
    cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
           "--dir", d, "--protected-mode", "no"]
    if password:
        cmd += ["--requirepass", password]
    if maxmemory:
        cmd += ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
    if tls:
        cmd[cmd.index("--port") + 1] = "0"
        cmd += ["--tls-port", str(port), "--tls-cert-file", tls["server.crt"], "--tls-key-file",
                tls["server.key"], "--tls-ca-cert-file", tls["ca.crt"], "--tls-auth-clients", "yes"]
    cmd += list(extra)
    proc = Proc(cmd, ready=lambda: _ping(port, password, tls), log=os.path.join(d, "log"), name=name)
    proc.port = port
    proc.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"
    return proc.start()


def _ping(port: int, password: Optional[str] = None, tls: Optional[dict] = None) -> bool:
    if not port_open(port):
        return False
    import redis

    kw = dict(ssl=True, ssl_ca_certs=tls["ca.crt"], ssl_certfile=tls["client.crt"],
              ssl_keyfile=tls["client.key"]) if tls else {}
    r = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=0.5, **kw)
    try:
        return r.ping()
    finally:
        r.close()


class RedisCluster:
    """``n`` masters (no replicas), ``cluster-require-full-coverage no`` so the survivors keep
    serving their slots when one dies."""

    def __init__(self, tmp, n: int = 3):
        self.nodes = [redis_server(tmp, name=f"cluster{i}",
                                   extra=("--cluster-enabled", "yes", "--cluster-config-file",
                                          "nodes.conf", "--cluster-node-timeout", "2000",
                                          "--cluster-require-full-coverage", "no"))
                      for i in range(n)]
        cli = require_binary("redis-cli")
        addrs = [f"127.0.0.1:{p.port}" for p in self.nodes]
        r = subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                            "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if r.returncode:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        self._wait_ok()

    def _wait_ok(self, timeout: float = 30.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for p in self.nodes:
                c = redis.Redis(host="127.0.0.1", port=p.port, socket_timeout=0.5)
                try:
                    info = c.execute_command("CLUSTER INFO")
                    states.append(info.get("cluster_state") if isinstance(info, dict) else _state(info))
                finally:
                    c.close()
            if all(s == "ok" for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"redis cluster not ok after {timeout} s")

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.nodes]

    def stop(self) -> None:
        for p in self.nodes:
            p.stop()


def _state(info) -> str:
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    return "?"
