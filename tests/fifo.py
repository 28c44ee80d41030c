"""Calling code that might block forever opening a FIFO, without hanging the test run."""
import os
import threading


def returns_within(fn, fifo: str, seconds: float = 5.0):
    """Run ``fn`` in a thread; True when it returned (or raised) within ``seconds``. A call
    blocked opening the FIFO is released by opening its other end, so nothing is left hanging."""
    done = threading.Event()
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:                  # handed to the caller
            box["error"] = exc
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ok = done.wait(seconds)
    if not ok:
        os.close(os.open(fifo, os.O_WRONLY))          # unblock the reader: it sees end of file
        done.wait(seconds)
    return ok, box
