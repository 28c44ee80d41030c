"""Package-level behaviour: import, native engine checks (missing, stale, required), CLI."""
import os
import shutil
import subprocess
import sys

import pytest

import ucm
from conftest import REPO, run_python

# The editable install's meta-path finder maps ucm._native to the checkout; drop it so the copied
# tree is imported exactly as it lies on disk.
PROBE = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]; import ucm; from ucm.fast import native; print(native.status()); print(ucm.backend_info()['ops']['copy_segments']['selected'])"


def _copy_tree(tmp_path, with_extension=True):
    """A real copy of the package (and native sources) in tmp_path, optionally without the .so."""
    dst = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", *([] if with_extension else ["_native*.so"]))
    shutil.copytree(os.path.join(REPO, "ucm"), dst / "ucm", ignore=ignore)
    shutil.copytree(os.path.join(REPO, "native"), dst / "native",
                    ignore=shutil.ignore_patterns("build", "__pycache__"))
    return dst


def _run_in(tree, env=None):
    # the copied tree first; entries already on PYTHONPATH stay (dependencies installed beside
    # the interpreter's site-packages, as on the GPU machine, e.g. cffi's backend)
    path = os.pathsep.join([str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                          if p and os.path.abspath(p) != os.path.abspath(REPO)])
    return run_python(PROBE, env={"PYTHONPATH": path, **(env or {})}, cwd=str(tree))


def test_public_api():
    for name in ucm.__all__:
        assert hasattr(ucm, name), name
    assert ucm.__version__


def test_missing_extension_falls_back_with_one_warning(tmp_path):
    tree = _copy_tree(tmp_path, with_extension=False)
    r = _run_in(tree, env={"PYTHONWARNINGS": "always"})
    assert r.returncode == 0, r.stderr
    assert str(tree) in r.stdout or "not built" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "reference"
    assert r.stderr.count("native engine unavailable") == 1


def test_missing_extension_with_require_native_fails(tmp_path):
    tree = _copy_tree(tmp_path, with_extension=False)
    r = _run_in(tree, env={"UCM_REQUIRE_NATIVE": "1"})
    assert r.returncode != 0
    assert "UCM_REQUIRE_NATIVE=1" in r.stderr and "not built" in r.stderr


def test_stale_extension_is_detected(tmp_path):
    tree = _copy_tree(tmp_path)
    with open(tree / "native" / "ucm_native.c", "a") as f:
        f.write("\n/* edited after the build */\n")
    r = _run_in(tree, env={"PYTHONWARNINGS": "always"})
    assert r.returncode == 0, r.stderr
    assert "stale extension" in r.stdout and r.stdout.strip().splitlines()[-1] == "reference"
    r = _run_in(tree, env={"UCM_REQUIRE_NATIVE": "1"})
    assert r.returncode != 0 and "stale extension" in r.stderr


def test_current_extension_is_used(tmp_path):
    r = _run_in(_copy_tree(tmp_path), env={"UCM_REQUIRE_NATIVE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "native"


def test_cli_commands():
    for args in (["info"], ["info", "--json"], ["config", "--preset", "low_memory"],
                 ["config", "--markdown"], ["demo", "--hashing-only", "--tokens", "4096"]):
        r = subprocess.run([sys.executable, "-m", "ucm", *args], capture_output=True, text=True)
        assert r.returncode == 0, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "ucm", "config", "--preset", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "'preset'" in r.stderr


def test_version_is_written_once_and_printed():
    r = subprocess.run([sys.executable, "-m", "ucm", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"ucm {ucm.__version__}"
    from importlib.metadata import PackageNotFoundError, version

    try:  # (a source tree used without installing it has no metadata)
        assert version("ucm") == ucm.__version__  # pyproject.toml reads ucm/VERSION
    except PackageNotFoundError:
        pass
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        assert ucm.__version__ not in f.read()


def test_sdist_and_wheel_build_and_the_wheel_imports_with_its_native_engine(tmp_path):
    """``python -m build`` makes the sdist, then the wheel from the sdist (so the sdist holds
    every file the native build needs); the wheel, installed alone into an empty folder, imports
    with a current native engine. (No isolation: the build requirements come from this
    environment, so the test needs no package index.)"""
    pytest.importorskip("build", reason="python -m build: the test extra installs it")
    dist = tmp_path / "dist"
    src = tmp_path / "src"  # a clean copy of the tracked files: no build products of the checkout
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(os.path.dirname(src / name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), src / name)
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sdists, wheels = list(dist.glob("ucm-*.tar.gz")), list(dist.glob("ucm-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, os.listdir(dist)
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                        "--target", str(target), str(wheels[0])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_python(PROBE + "; print(ucm.__file__)", env={"PYTHONPATH": str(target), "UCM_REQUIRE_NATIVE": "1"},
                   cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()
    assert out[-2] == "native" and out[-1].startswith(str(target)), out
