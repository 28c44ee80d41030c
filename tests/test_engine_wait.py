"""The engine-wait patch (ucm/integration/vllm/engine_wait.py) on vLLM's real shared-memory
message queue: the reader sleeps instead of spinning while it waits, still gets every message in
order and promptly, and the patch is applied only where the connector asks for it (CPU engines)."""
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import require_vllm_module

pytestmark = [pytest.mark.vllm]
require_vllm_module()

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition  # noqa: E402

import ucm.integration as integ  # noqa: E402
from ucm.integration.vllm.scheduler import quiet_engine_wait  # noqa: E402
from ucm.integration.vllm import engine_wait  # noqa: E402

ORIGINAL = SpinCondition.wait


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("UCM_DISABLE_PATCHES", raising=False)
    integ.unpatch()
    engine_wait._state["poll_s"] = 0.0
    yield
    integ.unpatch()
    engine_wait._state["poll_s"] = 0.0
    assert SpinCondition.wait is ORIGINAL


def _queue_pair():
    """A writer and one local reader of a real MessageQueue (shared-memory ring + zmq)."""
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    t = threading.Thread(target=reader.wait_until_ready)
    t.start()
    writer.wait_until_ready()
    t.join()
    return writer, reader


def _cpu_share_while_waiting(delay: float) -> tuple[float, object, float]:
    """The reader's CPU time over wall time while it waits ``delay`` s for a message that comes
    right after an earlier read (inside vLLM's busy window), the message, and its lateness."""
    writer, reader = _queue_pair()
    writer.enqueue("first")
    assert reader.dequeue() == "first"  # the busy window starts here
    sent = {}

    def later():
        time.sleep(delay)
        sent["t"] = time.monotonic()
        writer.enqueue({"step": 2})

    t = threading.Thread(target=later)
    cpu0, wall0 = time.thread_time(), time.monotonic()
    t.start()
    got = reader.dequeue(timeout=10)
    cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
    t.join()
    return cpu / wall, got, time.monotonic() - sent["t"]


@pytest.mark.serial  # CPU time of a spinning thread: measured alone, not beside other tests
def test_vllm_spins_by_default_and_the_patched_reader_sleeps():
    share, got, _ = _cpu_share_while_waiting(0.4)
    assert got == {"step": 2}
    # vLLM's own wait (sched_yield in a loop) keeps the reader's CPU busy: what the patch removes
    assert share > 0.5, share
    # A poll period of 1 ms (1,000 wake-ups a second): the share left is the cost of the wake-ups,
    # which a slow or loaded machine makes dearer (CI measured 0.22 at 0.2 ms periods), so the
    # period is long enough that only a reader that does not sleep can reach 0.2.
    assert engine_wait.enable(1000)
    assert SpinCondition.wait is engine_wait._quiet_wait
    # Other processes' load only adds to the reader's CPU time (more wake-ups run late, each
    # costing more): the least of up to three waits is the patch's own cost.
    shares = []
    for _ in range(3):
        share, got, late = _cpu_share_while_waiting(0.4)
        assert got == {"step": 2}
        assert late < 0.05  # woken within a few poll periods (1 ms each), not a socket timeout
        shares.append(share)
        if share < 0.2:
            break
    assert min(shares) < 0.2, shares


def test_no_message_is_lost_or_reordered_under_the_patch():
    assert engine_wait.enable(100)
    writer, reader = _queue_pair()
    n = 300
    got = []

    def read():
        for _ in range(n):
            got.append(reader.dequeue(timeout=10))

    t = threading.Thread(target=read)
    t.start()
    for k in range(n):
        if k % 7 == 0:
            time.sleep(0.002 * (k % 3))  # gaps shorter and longer than a poll period
        writer.enqueue(k)
    t.join(timeout=30)
    assert got == list(range(n))


def test_verify_unpatch_and_disable(monkeypatch):
    assert integ.verify_patches()["patches"]["engine_wait"] == {"applied": False, "wanted": False}
    assert engine_wait.enable(100)
    assert integ.verify_patches()["patches"]["engine_wait"] == {"applied": True, "wanted": True}
    state = integ.unpatch()
    assert state["patches"]["engine_wait"]["applied"] is False
    assert SpinCondition.wait is ORIGINAL
    assert not engine_wait.enable(0)  # 0: vLLM's spin
    monkeypatch.setenv("UCM_DISABLE_PATCHES", "1")
    assert not engine_wait.enable(100)
    assert SpinCondition.wait is ORIGINAL


@pytest.mark.parametrize("device,poll_us,applied", [("cpu", 100.0, True), ("cpu", 0.0, False),
                                                    ("cuda", 100.0, False)])
def test_the_connector_applies_it_on_cpu_engines_only(device, poll_us, applied):
    quiet_engine_wait({"connector.engine_poll_us": poll_us},
                      SimpleNamespace(device_config=SimpleNamespace(device_type=device)))
    assert (SpinCondition.wait is engine_wait._quiet_wait) is applied
