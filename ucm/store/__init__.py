"""KV storage tiers behind one async API (lookup / load / dump / wait / commit)."""
