"""Engine integrations (vLLM connector, patches, adapters). Filled in by the integration work."""
