"""Engine integrations: ``patch()`` / ``unpatch()`` / ``verify_patches()`` for vLLM, and the
vLLM connector in :mod:`ucm.integration.vllm` (imported only when used: it imports vLLM)."""
from ucm.integration.patch import patch, unpatch, verify_patches

__all__ = ["patch", "unpatch", "verify_patches"]
