"""Helpers shared by the engine's test files (conftest.py holds the fixtures)."""

from __future__ import annotations


def pool_idle(pool) -> bool:
    """Every KV page of `pool` is free and no sequence holds any: what a finished or cancelled request
    must leave behind."""
    return pool.n_free == pool.n_pages and not pool.sequences
