"""The sampling settings table: the same ranges as SamplingParams, one parser for flags and /set."""

from __future__ import annotations

import math

import click
import pytest
from nanoqwen_cli import options
from nanoqwen_engine import InvalidRequestError, SamplingParams
from nanoqwen_engine import params as engine_params


def test_seed_convention_is_the_engines():
    assert options.RANDOM_SEED == engine_params.RANDOM_SEED
    assert options.MAX_SEED == engine_params.MAX_SEED


def test_every_setting_is_a_sampling_params_field():
    for s in options.SAMPLING:
        assert s.field in SamplingParams.__dataclass_fields__, s.field


@pytest.mark.parametrize("name", ["temperature", "top-p", "--top-k", "-t", "repetition_penalty", "-n"])
def test_find_setting_takes_any_spelling(name):
    assert options.find_setting(name) is not None


def test_what_the_table_accepts_the_engine_accepts(rng):
    """Values drawn around each range's edges: the CLI refuses exactly what SamplingParams refuses."""
    for s in options.SAMPLING:
        for value in [*rng.uniform(-3, 3, 8), 0.0, 1.0, -1.0, math.nan, math.inf, 2.0**64]:
            text = (
                str(int(value)) if isinstance(s.type, click.IntRange) and math.isfinite(value) else str(value)
            )
            try:
                parsed = s.parse(text)
            except click.BadParameter:
                cli_ok = False
            else:
                cli_ok = True
            try:
                engine_value = int(text) if isinstance(s.type, click.IntRange) else float(text)
                SamplingParams(**{s.field: engine_value})
                engine_ok = True
            except (InvalidRequestError, ValueError, OverflowError):
                engine_ok = False
            assert cli_ok == engine_ok, (s.field, text)
            if cli_ok and parsed is not None:
                SamplingParams(**{s.field: parsed})
