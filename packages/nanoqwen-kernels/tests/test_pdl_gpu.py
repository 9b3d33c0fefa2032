"""GPU: programmatic dependent launch keeps every kernel after the one before it.

Each kernel may start while its predecessor drains (pdl.py) and must wait before reading its output
(cuda/common.cuh). A chain of dependent launches, each reading what the previous one wrote, must give the
same bits with PDL as without it, eagerly and replayed from a captured graph: a kernel that read its input
before the wait would see the previous step's value (a large GEMV before it keeps its input stale for
microseconds). The read-modify-write chain of `advance` loses increments if two launches overlap.
"""

import numpy as np
import pytest
from nanoqwen_kernels import loader, pdl
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.gemv import GemvKernels
from nanoqwen_kernels.sampling import SamplingKernels
from refs import pack_valueshuffle, random_int4

pytestmark = pytest.mark.gpu
STEPS = 24


def _load(sources, defines):
    return loader.load_module(sources, defines)


@pytest.fixture
def pdl_switch(monkeypatch):
    """set(on): PDL on or off for the launches that follow (the cached device check is reset)."""

    def set_(on: bool):
        monkeypatch.setenv("NANOQWEN_PDL", "1" if on else "0")
        pdl.supported.cache_clear()

    yield set_
    pdl.supported.cache_clear()


def test_hopper_launches_with_pdl(gpu, pdl_switch):
    pdl_switch(True)
    cc = int(gpu.cuda.Device().compute_capability)
    assert pdl.supported(gpu.cuda.Device().id) == (cc >= 90)
    if cc < 90:
        pytest.skip(f"compute capability {cc}: PDL needs 9.0")


def _chain(cp, g, w, x0, norm_w, graph: bool):
    """x <- W . rmsnorm(x) + x, 2 STEPS times through a scratch y (each launch reads the previous one's
    output)."""
    x = cp.asarray(x0)
    qw, sc = w

    def body():
        for _ in range(STEPS):
            y = g_scratch[0]
            g.gemv_int4(qw, sc, x, y, residual=x, norm_w=norm_w, eps=1e-6)
            g.gemv_int4(qw, sc, y, x, residual=y, norm_w=norm_w, eps=1e-6)

    g_scratch = [cp.empty_like(x)]
    if not graph:
        body()
        cp.cuda.get_current_stream().synchronize()
        return cp.asnumpy(x)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        body()
        gr = stream.end_capture()
        x[...] = cp.asarray(x0)
        gr.launch(stream)
        stream.synchronize()
    return cp.asnumpy(x)


@pytest.mark.parametrize("b", [1, 8])
def test_dependent_gemv_chain_same_bits_with_and_without_pdl(gpu, pdl_switch, rng, b):
    cp = gpu
    d = PRESETS["7b"]
    h = d.hidden
    u, s = random_int4(rng, h, h)
    w = (cp.asarray(pack_valueshuffle(u)), cp.asarray(s))
    norm_w = cp.asarray((1 + 0.1 * rng.standard_normal(h)).astype(np.float16))
    x0 = rng.standard_normal((b, h) if b > 1 else (h,)).astype(np.float16)
    results = {}
    for on in (False, True):
        pdl_switch(on)
        g = GemvKernels(d, _load)
        for graph in (False, True):
            results[(on, graph)] = _chain(cp, g, w, x0, norm_w, graph)
    ref = results[(False, False)]
    assert np.isfinite(ref.astype(np.float32)).all()
    assert not np.array_equal(ref, x0)  # the chain did something
    for key, got in results.items():
        assert np.array_equal(got.view(np.uint16), ref.view(np.uint16)), f"PDL={key[0]} graph={key[1]} differs"


def test_advance_chain_loses_no_increment(gpu, pdl_switch, rng):
    cp = gpu
    pdl_switch(True)
    s = SamplingKernels(PRESETS["tiny"], _load)
    rows = 64
    pos0 = rng.integers(0, 1000, rows).astype(np.int32)
    seq0 = rng.integers(0, 3, rows).astype(np.int32)  # zeros are idle rows: they must stay put
    pos, seq = cp.asarray(pos0), cp.asarray(seq0)
    stream = cp.cuda.Stream(non_blocking=True)
    n = 200
    with stream:
        stream.begin_capture()
        for _ in range(n):
            s.advance(pos, seq)
        gr = stream.end_capture()
        gr.launch(stream)
        for _ in range(n):  # and eagerly
            s.advance(pos, seq)
        stream.synchronize()
    live = seq0 > 0
    np.testing.assert_array_equal(cp.asnumpy(pos), np.where(live, pos0 + 2 * n, pos0))
    np.testing.assert_array_equal(cp.asnumpy(seq), np.where(live, seq0 + 2 * n, seq0))
