"""vLLM integration: ``UCMConnector`` (``kv_connector_module_path="ucm.integration.vllm"``).

Importing this package imports vLLM; ``ucm`` itself does not need it.
"""
from ucm.integration.vllm.connector import UCMConnector, UCMConnectorMetadata

__all__ = ["UCMConnector", "UCMConnectorMetadata"]
