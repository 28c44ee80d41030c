"""Sparse attention methods built on ucm ops (ESA, GSA, KVStar, Quest, adaptive)."""
