"""vLLM integration: ``UCMConnector`` (``kv_connector_module_path="ucm.integration.vllm"``).

``UCMConnector`` and ``UCMConnectorMetadata`` are imported on first use (they import vLLM); the
connector's worker paths (``worker_load``, ``worker_save``, ``records``) import
nothing from vLLM and can be used without it.
"""
from __future__ import annotations

__all__ = ["UCMConnector", "UCMConnectorMetadata"]


def __getattr__(name: str):
    if name in __all__:
        from ucm.integration.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
