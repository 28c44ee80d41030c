"""Real processes against one shared posix directory: SIGKILL during dumps, and four processes
dumping and loading overlapping blocks under a small byte budget."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import store_worker as w  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_worker.py")


def _published(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".blk")]


def _ucm_bytes(root):
    """Bytes of every file ucm keeps in a root: published blocks, temporaries, quarantine."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if f.endswith(".blk") or ".blk." in f)


def _temporaries(root):
    """{writer name: its temporaries} for every writer directory and every temporary file."""
    out = {d: [] for d in os.listdir(os.path.join(root, ".ucm", "tmp"))}
    for d, _, fs in os.walk(root):
        for f in fs:
            if ".blk.tmp." in f:
                out.setdefault(f.split(".blk.tmp.")[1].rsplit(".", 1)[0], []).append(f)
    return out


def test_sigkill_during_dumps_never_exposes_partial_blocks(tmp_path):
    """Writers SIGKILLed at random moments under a 2 MiB budget: a fresh reader sees only whole,
    exact blocks, removes the dead writers' temporaries at open, and disk use stays within the
    budget plus the one batch a writer may hold unreserved."""
    root = str(tmp_path)
    file_bytes = 4096 + w.BLOCK
    budget = 2 << 20
    batch = 5 * file_bytes  # a writer's largest batch
    rng = np.random.default_rng(2024)
    trials, published_total, killed_mid_write, peak = 40, 0, 0, 0
    for trial in range(trials):
        p = subprocess.Popen([sys.executable, WORKER, "writer", root, str(trial), str(budget)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        time.sleep(float(rng.uniform(0.0, 0.25)))  # a random moment inside the dump loop
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.returncode == -signal.SIGKILL
        left = _temporaries(root)
        dead = [d for d in left if f"-{p.pid}-" in d]
        assert len(dead) == 1
        killed_mid_write += bool(left[dead[0]])
        used = _ucm_bytes(root)
        peak = max(peak, used)
        assert used <= budget + batch, (trial, used)
        # a fresh reader: every block lookup reports must load and be exactly what was dumped
        s = w.store(root, budget)
        assert not [d for d in _temporaries(root) if f"-{p.pid}-" in d]  # reaped at open
        keys = np.arange(w.POOL)
        present = np.array(s.lookup(w.ids_of(keys)))
        visible = keys[present]
        if len(visible):
            dst = np.zeros((len(visible), w.BLOCK), np.uint8)
            r = s.wait(s.load(w.ids_of(visible), 0, dst))
            assert r.all_ok, (trial, r.errors)
            assert np.array_equal(dst, w.content(visible)), trial
        assert s.stats()["posix"]["quarantined"] == 0
        assert s.usage() == _ucm_bytes(root) <= budget
        published_total += len(visible)
        s.close()
    assert _temporaries(root) == {}  # nothing of any writer is left
    # the writers really were killed mid-write (their temp files were left), and really published
    assert published_total > 20 and killed_mid_write >= 5, (published_total, killed_mid_write)
    print(f"SIGKILL: {trials} writers, {killed_mid_write} killed with temporaries, peak "
          f"{peak} bytes of ucm files for a {budget}-byte budget, {_ucm_bytes(root)} bytes after")


def test_four_processes_share_a_directory_within_budget(tmp_path):
    root = str(tmp_path)
    file_bytes = 4096 + w.BLOCK
    budget = 24 * file_bytes  # 60 shared keys do not fit: GC runs all the time
    w.store(root, budget).close()  # create the layout
    samples, stop = [], threading.Event()

    def monitor():
        lockfd = os.open(os.path.join(root, ".ucm", "lock"), os.O_RDWR)
        while not stop.is_set():
            fcntl.flock(lockfd, fcntl.LOCK_EX)  # a consistent snapshot between publishes
            try:
                total = 0
                for path in _published(root):
                    try:
                        total += os.path.getsize(path)
                    except FileNotFoundError:
                        pass
                samples.append(total)
            finally:
                fcntl.flock(lockfd, fcntl.LOCK_UN)
            time.sleep(0.01)
        os.close(lockfd)

    mon = threading.Thread(target=monitor)
    mon.start()
    procs = [subprocess.Popen([sys.executable, WORKER, "mixed", root, str(seed), "60", str(budget)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    stop.set()
    mon.join()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    counts = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(c["bad_bytes"] == 0 and c["failed_other"] == 0 and c["quarantined"] == 0 for c in counts), counts
    assert sum(c["loaded"] for c in counts) > 100 and sum(c["missed"] for c in counts) > 0
    assert len(samples) > 20 and max(samples) <= budget + file_bytes, (max(samples), budget)
    assert max(samples) > budget // 2  # the budget was really under pressure


def test_processes_opening_an_empty_root_at_once_all_succeed(tmp_path):
    """An engine's scheduler and workers open the same new root at the same moment: whichever
    makes it, the others take it as ucm's (none sees a half-made root as a foreign directory)."""
    for trial in range(5):
        root = tmp_path / f"r{trial}"
        root.mkdir()
        code = ("import sys; sys.path.insert(0, %r); import store_worker as w; "
                "s = w.store(%r); print(s.space); s.close()" % (os.path.dirname(WORKER), str(root)))
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
        assert len({o.strip() for o, _ in outs}) == 1
