"""Speculative decoding: n-gram lookup (scheduler process); the draft-model, MTP and DSpark proposers and
their shared draft choice (worker processes)."""
