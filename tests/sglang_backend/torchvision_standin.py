"""A named stand-in for ``torchvision`` in SGLang's storage tests and benchmark.

``sglang.srt.mem_cache.memory_pool`` imports ``sglang.srt.configs``, whose multimodal configs
import ``torchvision.transforms`` at module level for image preprocessing. PyPI's torchvision for
x86_64 is a CUDA build that cannot load beside ucm's CPU torch ("operator torchvision::nms does
not exist"), and a torch build it can load beside costs about 5.5 GB of CUDA libraries (a CI
run with that virtualenv ran out of disk). Nothing under test touches images, so every
``torchvision.*`` module here is an empty module whose names can be looked up but never called:
a call raises, so a storage path that did reach image code would fail, not pass. SGLang's own
classes under test (device and host pools, ``HiCacheStorage``, the backend factory) are real.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Unavailable:
    """A torchvision name: attribute chains resolve (module-level defaults such as
    ``InterpolationMode.BICUBIC``), calls raise."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in SGLang's storage tests "
                           "(tests/sglang_backend/torchvision_standin.py); image code must not run here")


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        if spec.name == "torchvision":
            # transformers reads the version of whatever find_spec finds; below every
            # threshold it checks, so it keeps to its PIL image paths.
            module.__version__ = "0.0+ucm.standin"
        return module

    def exec_module(self, module):
        pass


def install():
    """Put the stand-in in place unless a working torchvision imports."""
    try:
        import torchvision  # noqa: F401  (a working torchvision is used as it is)
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _TorchvisionStandIn())
