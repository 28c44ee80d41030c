"""SGLang's storage tests run on ucm's own virtualenv (torch 2.13, CPU build) with SGLang 0.5.23
and the modules its mem_cache imports on ``PYTHONPATH`` (``scripts/install_sglang.sh``), and one
named stand-in for torchvision (``torchvision_standin.py`` says why).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchvision_standin  # noqa: E402

torchvision_standin.install()
