"""Prefill/decode disaggregation: the protocol between a prefill and a decode server, and the bootstrap server."""
