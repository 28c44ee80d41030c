"""Blend: reuse the KV of text chunks at any position (non-prefix reuse with selective
recompute). ``ucm.blend.ops`` holds the validated ops (RoPE delta rotation, KV deviation)."""
