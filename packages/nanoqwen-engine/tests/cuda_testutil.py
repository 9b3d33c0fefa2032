"""Helpers of the CudaBackend tests (test_cuda_plumbing.py, test_cuda_graphs.py, test_cuda_prefill.py): a
backend on the host stand-ins (device.HostDevice + host_kernels.HostKernels) or on the GPU, greedy
generation, and the near-tie rule by which two greedy runs may differ.

Greedy tokens of a sequence alone and inside a batch (or prefilled another way) are compared exactly,
except where the reference run's own logits had a near-tie at the first divergence (the other run may sum
in another order: a tie within NEAR_TIE of the top logit can flip; anything else fails).
"""

from __future__ import annotations

import numpy as np
from nanoqwen_engine.config import ModelConfig
from nanoqwen_engine.cuda import CudaBackend
from nanoqwen_engine.cuda.device import HostDevice
from nanoqwen_engine.cuda.host_kernels import HostKernels
from nanoqwen_engine.cuda.load import decode_activations_plan
from nanoqwen_engine.params import SamplingParams
from nanoqwen_engine.sampler import SamplerState
from nanoqwen_engine.validation import EPS
from nanoqwen_format import open_model

GREEDY = SamplingParams(temperature=0).resolve({})
# Batch invariance (a sequence gets the same greedy tokens alone as in a batch, but for near-ties) is a
# property of fp16 decode activations: with int8 (the default) a lone sequence's GEMVs multiply its
# activation rounded to int8 while a batch's tile GEMM multiplies fp16, so the two may part wherever a
# logit gap is within int8's rounding noise (docs/INTERFACES.md). Tests of row bookkeeping against
# sequences run alone ask for fp16; the int8 path has its own tests (test_int8_decode_activations_*).
BATCH_INVARIANT = {"decode_activations": "fp16"}
NEAR_TIE = 2e-3  # relative gap between the two largest logits below which a greedy flip is a near-tie


def open_file(path):
    nq = open_model(path)
    return nq, ModelConfig.from_hf(nq.config, nq.generation_config)


def make_backend(path, kind="host", decode_mode="graph", **kw):
    nq, cfg = open_file(path)
    if kind == "host":
        dev = HostDevice()
        # the variant KernelSet would get: int8 activations (the default) -> "a8", fp16 -> the half2 loop
        variant = decode_activations_plan(kw.get("decode_activations"), None)[1]
        kw.update(device=dev, kernels=HostKernels(cfg, dev, variant))
    be = CudaBackend.create(nq, cfg, progress=False, decode_mode=decode_mode, **kw)
    be._nq = nq  # keep the mmap alive
    return be


def generate(be, ids, n, params=GREEDY, seq=None, logits=None):
    """Prefill ids, then n - 1 decode steps as a batch of one; `logits` collects last_logits()[0] per token."""
    seq = seq or be.pool.new_sequence()
    st = SamplerState(params, be.config.vocab)
    out = [be.prefill(seq, np.asarray(ids), st)]
    if logits is not None:
        logits.append(be.last_logits()[0].copy())
    for _ in range(n - 1):
        out.append(be.decode([seq], [out[-1]], [st])[0])
        if logits is not None:
            logits.append(be.last_logits()[0].copy())
    return out, seq


def near_tie(be, logits: np.ndarray, token: int) -> tuple[bool, float]:
    """Whether `token` is within a near-tie of logits' top (and the gap): a relative gap under NEAR_TIE, or,
    when `be` decodes with int8 activations, a gap under validation.EPS["int8"] logits (int8's measured
    rounding noise: two int8 runs that part by an fp16 rounding, in their prefill say, can flip a token at
    a wider gap than fp16's; the host stand-in did, at a relative gap of 3.2e-3, in CI on 2026-12-02)."""
    top = float(np.max(logits))
    gap = top - float(logits[token])
    if be is not None and be.info.get("decode_activations") == "int8":
        return gap < EPS["int8"], gap
    return gap / max(abs(top), 1e-6) < NEAR_TIE, gap


def same_or_near_tie(got: list[int], want: list[int], want_logits: list[np.ndarray], what: str, be=None) -> None:
    """got == want, or they first differ where want's own logits had a near-tie (near_tie; see the module
    doc): the runner-up of want's token is judged, with `be`'s decode activations deciding the bound."""
    if got == want:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    runner_up = int(np.argsort(want_logits[i])[-2])
    ok, gap = near_tie(be, want_logits[i], runner_up)
    assert ok, f"{what}: token {i} differs ({got[i]} vs {want[i]}) at a logit gap of {gap:.3g}"


def run_alone(be, prompts, n, params=GREEDY):
    """Each prompt generated alone (batch of one); (tokens, per-token logits) per prompt."""
    res = []
    for p in prompts:
        lg: list[np.ndarray] = []
        toks, s = generate(be, p, n, params, logits=lg)
        be.pool.free(s)
        res.append((toks, lg))
    return res
