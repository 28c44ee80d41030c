"""Administration of ``posix`` roots (what ``ucm store`` runs): usage per space and namespace,
listing, a block's header, verification of every block's checksums (bad ones quarantined),
garbage collection and clearing a namespace.

A root is only touched once its ``.ucm/ROOT`` marker is there: a directory ucm did not make is
refused with a clear error, never initialised. Changes (quarantine, collection, clearing) happen
under the root's lock and keep its ``usage`` count exact, so running stores see a consistent
budget; a store reading a block being cleared sees a miss.
"""
from __future__ import annotations

import os
import re
import time
from typing import Callable, Iterable, Optional

import numpy as np

from ucm.ops import checksum_units
from ucm.store import format as fmt
from ucm.store.base import Stats
from ucm.store.posix_root import MARKER, META, SUFFIX, Perms, RootDir

Progress = Optional[Callable[[int], None]]


def _is_root(path: str) -> bool:
    marker = os.path.join(path, META, "ROOT")
    try:
        st = os.lstat(marker)
        if not os.path.isfile(marker) or os.path.islink(marker) or st.st_size > 64:
            return False
        with open(marker, "rb") as f:
            return f.read(64) == MARKER
    except OSError:
        return False


class Root:
    """An administrator's handle on one root (no space of its own). ``write``: take part in the
    root's locking (needed to quarantine, collect or clear); else read only."""

    def __init__(self, path: str, write: bool = False, stale_s: float = 600.0):
        if not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
            raise ValueError(f"root {path!r} is not a directory path (an empty path would mean "
                             f"the working directory)")
        path = os.path.realpath(os.path.expanduser(os.fspath(path)))
        if not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a directory")
        if not _is_root(path):
            raise ValueError(f"{path!r} is not a ucm root (no {META}/ROOT marker): ucm store "
                             f"commands only act on directories a ucm store made")
        self.path = path
        self.stats = Stats()
        self._root = RootDir(path, 1 << 62, 0, None, Perms(None, not write), not write, stale_s,
                           self.stats)

    def close(self) -> None:
        self._root.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading ----------------------------------------------------------------------------
    def blocks(self) -> list:
        """Published blocks: ``(space, id hex, bytes, mtime, path)``, quarantine excluded."""
        files, _ = self._root.scan()
        return sorted((rel.split("/")[0], name[:-len(SUFFIX)], size, mtime,
                       os.path.join(self.path, rel, name))
                      for mtime, size, rel, name in files if not rel.startswith(META))

    def header(self, path: str) -> dict:
        with open(path, "rb", opener=_no_follow) as f:
            raw = np.frombuffer(f.read(fmt.ALIGN), dtype=np.uint8)
            size = os.fstat(f.fileno()).st_size
        out = fmt.describe(raw)
        if out["valid"]:
            out["size_ok"] = size == out["header_bytes"] + out["block_bytes"]
        out["file_bytes"] = size
        out.pop("shard_checksums", None)
        return out

    def du(self) -> dict:
        """Bytes and blocks per space (with the namespace, codec and geometry its blocks'
        headers name), temporaries, quarantine, and the usage count stores keep."""
        files, temps = self._root.scan()
        spaces: dict = {}
        q_n = q_bytes = 0
        for _, size, rel, name in files:
            if rel.startswith(META):
                q_n, q_bytes = q_n + 1, q_bytes + size
                continue
            sp = spaces.setdefault(rel.split("/")[0], {"blocks": 0, "bytes": 0, "sample": None})
            sp["blocks"] += 1
            sp["bytes"] += size
            sp["sample"] = sp["sample"] or os.path.join(self.path, rel, name)
        for name, sp in spaces.items():
            try:
                h = self.header(sp.pop("sample"))
                sp.update({k: h.get(k) for k in ("namespace", "codec", "block_bytes",
                                                   "shard_bytes")})
            except OSError:
                pass
        if self._root.quarantine is None:      # read only: count the quarantine by name
            qdir = os.path.join(self.path, META, "quarantine")
            for e in (os.scandir(qdir) if os.path.isdir(qdir) else ()):
                if e.is_file(follow_symlinks=False):
                    q_n, q_bytes = q_n + 1, q_bytes + e.stat(follow_symlinks=False).st_size
        usage = None
        if self._root.usagefd is not None:
            usage = self._root.read_usage()
        total = sum(s["bytes"] for s in spaces.values()) + q_bytes + sum(t[0] for t in temps)
        return {"root": self.path, "bytes": total, "usage_count": usage,
                "blocks": sum(s["blocks"] for s in spaces.values()), "spaces": spaces,
                "temporary": {"files": len(temps), "bytes": sum(t[0] for t in temps)},
                "quarantine": {"files": q_n, "bytes": q_bytes}}

    def find(self, block_id: str) -> list:
        block_id = _hex32(block_id, "block id")
        return [b for b in self.blocks() if b[1] == block_id]

    # -- checking and changing --------------------------------------------------------------
    def _need_write(self, what: str) -> None:
        if self._root.lockfd is None:
            raise ValueError(f"{what} changes the root: open it with write=True")

    def verify_block(self, path: str) -> str:
        """'' when the block file is sound (header, size, every shard's checksum), else why."""
        with open(path, "rb", opener=_no_follow) as f:
            data = np.frombuffer(f.read(), dtype=np.uint8)
        h = fmt.describe(data[:fmt.ALIGN])
        if not h["valid"]:
            return h["reason"]
        if data.nbytes != h["header_bytes"] + h["block_bytes"]:
            return f"{data.nbytes} bytes, the header says {h['header_bytes'] + h['block_bytes']}"
        if h["shards"] * h["shard_bytes"] != h["block_bytes"]:
            return "geometry inconsistent"
        payload = np.ascontiguousarray(data[h["header_bytes"]:])
        got = checksum_units(payload, h["shard_bytes"]) if h["block_bytes"] else []
        for k, (have, want) in enumerate(zip(got, h["shard_checksums"])):
            if int(have) != int(want):
                return f"shard {k} checksum mismatch"
        return ""

    def verify(self, quarantine: bool = True, progress: Progress = None) -> dict:
        """Check every block; damaged ones are moved to the quarantine (``quarantine``)."""
        if quarantine:
            self._need_write("verify with quarantine")
        bad = []
        checked = 0
        for space, hexid, _, _, path in self.blocks():
            try:
                why = self.verify_block(path)
            except FileNotFoundError:       # evicted meanwhile
                why = None
            except OSError as exc:
                why = f"unreadable: {exc.strerror or exc}"
            if why is not None:
                checked += 1
                if why:
                    bad.append({"space": space, "id": hexid, "reason": why})
                    if quarantine:
                        self._quarantine(path)
            if progress:
                progress(1)
        return {"checked": checked, "bad": bad, "quarantined": len(bad) if quarantine else 0}

    def _quarantine(self, path: str) -> None:
        r = self._root
        name = os.path.basename(path)
        rel = os.path.relpath(os.path.dirname(path), self.path)
        with r.locked():
            dfd = r.dir_beneath(rel)
            if dfd is None:
                return
            try:
                os.rename(name, f"{name}.{os.getpid()}.{time.time():.0f}", src_dir_fd=dfd,
                          dst_dir_fd=r.quarantine)
            except OSError:
                pass
            finally:
                os.close(dfd)

    def gc(self, target_bytes: Optional[int] = None) -> int:
        """Remove dead writers' temporaries and old quarantined files, evict least recently used
        blocks down to ``target_bytes`` (None: no eviction); returns the bytes in use."""
        self._need_write("gc")
        if target_bytes is not None and (isinstance(target_bytes, bool) or not isinstance(
                target_bytes, int) or target_bytes < 0):
            raise ValueError(f"gc target: expected a number of bytes >= 0 (0 evicts every "
                             f"block), got {target_bytes!r}")
        with self._root.locked():
            return self._root.gc_locked(target_bytes)

    def clear(self, namespaces: Iterable[str], progress: Progress = None) -> dict:
        """Delete every block whose header names one of ``namespaces`` (hex digests)."""
        self._need_write("clear")
        wanted = {_hex32(n, "namespace") for n in namespaces}
        if not wanted:
            raise ValueError("clear: name at least one namespace")
        r = self._root
        removed = freed = 0
        by_space: dict = {}
        for b in self.blocks():
            by_space.setdefault(b[0], []).append(b)
        for space, blocks in by_space.items():
            try:
                ns = self.header(blocks[0][4]).get("namespace")
            except OSError:
                ns = None
            if ns not in wanted:
                continue
            here = 0
            with r.locked():
                for _, _, size, _, path in blocks:
                    try:
                        h = self.header(path)
                        if h.get("namespace") not in wanted:
                            continue
                        os.unlink(path)
                    except OSError:
                        continue
                    removed, here = removed + 1, here + size
                    if progress:
                        progress(1)
                r.write_usage(max(0, r.usage_locked() - here))
            freed += here
        return {"removed": removed, "bytes": freed}


def _hex32(text, what: str) -> str:
    """``text`` as 32 lower-case hex digits (a namespace digest or a block id), else ValueError."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9a-fA-F]{32}", text.strip()):
        raise ValueError(f"{what} {text!r}: expected 32 hex digits (as `ucm store du` and "
                         f"`ucm store ls` show them)")
    return text.strip().lower()


def _no_follow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
