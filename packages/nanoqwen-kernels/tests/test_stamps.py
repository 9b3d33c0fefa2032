"""The step timeline's host side (nanoqwen_kernels.stamps): records cut into launches, the per-position
table; and its device side compiled (NQ_STAMPS=1 reads the global timer in every entry; a real build has no
trace of it). The GPU run is scripts/decode_breakdown.py --timeline."""

from __future__ import annotations

import numpy as np
import pytest
from nanoqwen_kernels import stamps
from nanoqwen_kernels.errors import KernelError


def _recs(launches, rng):
    """Start and wait records for launches given as (blocks, start, wait, exit) in us (wait None: no block
    waits), each block jittered inside them."""
    starts, waits = [], []
    for blocks, start, wait, end in launches:
        for _ in range(blocks):
            starts.append(
                [
                    start * 1000 + int(rng.integers(0, 200)),
                    end * 1000 - int(rng.integers(0, 200)),
                    blocks | (int(rng.integers(0, 132)) << 32),
                    0,
                ]
            )
            if wait is not None:
                waits.append([wait * 1000 + int(rng.integers(0, 200)), blocks])
    return np.array(starts, dtype=np.uint64), np.array(waits, dtype=np.uint64).reshape(-1, 2)


def test_records_cut_into_launches_by_grid_size():
    rng = np.random.default_rng()
    spec = [(3, 0, 1, 5), (132, 4, 6, 30), (40, 28, 31, 36), (132, 35, 37, 60)]
    starts, waits = _recs(spec, rng)
    got = stamps.launches(starts, waits)
    assert [x.blocks for x in got] == [3, 132, 40, 132]
    for x, (_, start, wait, end) in zip(got, spec, strict=True):
        assert start * 1000 <= x.first_start <= x.last_start < start * 1000 + 200
        assert wait * 1000 <= x.first_wait <= x.last_wait < wait * 1000 + 200
        assert end * 1000 - 200 < x.last_exit <= end * 1000
    assert got[1].span_us == pytest.approx(26, abs=0.5)
    # a launch without waits (or waits that do not cut): the launches keep their spans, no waits
    spec[1] = (132, 4, None, 30)
    starts, waits = _recs(spec, rng)
    got = stamps.launches(starts, waits)
    assert [x.blocks for x in got] == [3, 132, 40, 132] and all(x.first_wait == 0 for x in got)


def test_interleaved_or_missing_records_are_refused():
    rng = np.random.default_rng()
    starts, _ = _recs([(4, 0, 1, 5), (6, 4, 5, 9)], rng)
    with pytest.raises(KernelError, match="not one launch"):
        stamps.launches(np.concatenate([starts[:3], starts[5:6], starts[3:5], starts[6:]]))  # interleaved
    with pytest.raises(KernelError, match="not one launch"):
        stamps.launches(starts[:-1])  # the last launch lost a block


def test_overflow_is_an_error_not_a_short_read():
    cap = 2
    buf = np.zeros(stamps.HEADER_WORDS + (stamps.RECORD_WORDS + stamps.WAIT_WORDS) * cap, dtype=np.uint64)
    buf[0], buf[1], buf[2] = 3, cap, 1
    with pytest.raises(KernelError, match="overflowed"):
        stamps.read(buf)
    buf[0] = 2
    buf[stamps.HEADER_WORDS + stamps.RECORD_WORDS * cap] = 77  # the first wait record's time
    starts, waits = stamps.read(buf)
    assert starts.shape == (2, stamps.RECORD_WORDS) and waits.shape == (1, stamps.WAIT_WORDS)
    assert int(waits[0, 0]) == 77


def test_step_table_medians_and_overlap_signs():
    """placed > 0 when a launch's blocks start before the previous one's last exit; after = the previous
    exit -> this launch's first return from pdl_wait; tail = its last wait -> its last exit."""
    rng = np.random.default_rng()
    runs = []
    for r in range(5):
        d = r % 2  # replays differ a little: the medians take the middle
        spec = [(2, 0, 1, 3), (8, 2, 3 + d, 10), (4, 9, 10 + d, 14)]
        runs.append(stamps.launches(*_recs(spec, rng)))
    rows = stamps.step_table(runs, ["a", "b", "c"])
    assert [r["name"] for r in rows] == ["a", "b", "c", "step"]
    b, c = rows[1], rows[2]
    assert b["placed_us"] == pytest.approx(1, abs=0.5) and c["placed_us"] == pytest.approx(1, abs=0.5)
    assert b["after_us"] == pytest.approx(0, abs=0.5)
    assert c["tail_us"] == pytest.approx(4, abs=0.5)
    assert rows[-1]["span_us"] == pytest.approx(14, abs=0.5)
    with pytest.raises(KernelError, match="names 2"):
        stamps.step_table(runs, ["a", "b"])


@pytest.mark.parametrize("source", ["gemv_int4.cu", "attention_decode.cu", "head_i8.cu", "sampling.cu"])
def test_stamped_builds_read_the_global_timer_and_real_builds_do_not(source, monkeypatch):
    from test_compile import QWEN25_7B, _functions, _sass

    plain = _functions(_sass(source, QWEN25_7B))
    assert not any("GLOBALTIMER" in body for body in plain.values())
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_STAMPS=1")
    stamped = _functions(_sass(source, QWEN25_7B))
    assert stamped.keys() == plain.keys()
    for name, body in stamped.items():
        # start, exit and the wait (every entry waits)
        assert body.count("GLOBALTIMER") >= 3, f"{source}: {name} is not stamped"
