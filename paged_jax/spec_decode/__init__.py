"""Speculative decoding: the proposer contract (proposer.py), n-gram lookup, draft models."""
