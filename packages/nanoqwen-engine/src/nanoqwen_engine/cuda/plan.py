"""Upload and memory plans for the GPU backend: pure Python, so CPU tests cover every byte count.

What goes where on the device (one buffer per key; the fused kernels want one matrix per launch):

    file tensors (HF names)                         device buffer (key)     shape / dtype
    model.embed_tokens.weight                       embed                   [V, H] f16
    lm_head.weight (embed when tied)                lm_head                 [V, H] f16
    model.norm.weight                               norm                    [H] f16
    layers.i.input_layernorm.weight                 i.ln1                   [H] f16
    layers.i.post_attention_layernorm.weight        i.ln2                   [H] f16
    layers.i.self_attn.{q,k,v}_proj.qweight         i.qkv.w                 [Nq+2Nkv, H/8] u32  (rows q|k|v)
    layers.i.self_attn.{q,k,v}_proj.scales          i.qkv.s                 [Nq+2Nkv, H/128] f16
    layers.i.self_attn.{q,k,v}_proj.bias            i.qkv.b                 [Nq+2Nkv] f16
    layers.i.self_attn.o_proj.{qweight,scales}      i.o.w / i.o.s           [H, Nq/8] u32 / [H, Nq/128] f16
    layers.i.mlp.{gate,up}_proj.{qweight,scales}    i.gu.w / i.gu.s         [2I, H/8] u32 (rows gate|up)
    layers.i.mlp.down_proj.{qweight,scales}         i.down.w / i.down.s     [H, I/8] u32 / [H, I/128] f16

Concatenating along rows of row-major matrices is placing each part at a byte offset of one buffer, so
the "concatenation" costs nothing: each file tensor is one H2D copy into (key, byte offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kv_pages import PAGE_TOKENS, kv_cache_bytes, pages_for

# Fused groups: device key suffix -> the file's projections, in the row order the kernels expect.
FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gu": ("mlp.gate_proj", "mlp.up_proj"),
}
SINGLE = {"o": "self_attn.o_proj", "down": "mlp.down_proj"}


@dataclass(frozen=True)
class Copy:
    """One H2D copy: the whole file tensor `src` into buffer `key` at byte `offset`."""

    src: str
    key: str
    offset: int
    nbytes: int


@dataclass
class UploadPlan:
    buffers: dict[str, tuple[tuple[int, ...], np.dtype]]  # key -> (shape, dtype) of the device buffer
    copies: list[Copy]
    aliases: dict[str, str]  # key -> key it shares (tied lm_head -> embed)

    @property
    def total_bytes(self) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self.buffers.values())


def _info(tensors: dict[str, tuple[tuple[int, ...], np.dtype]], name: str):
    if name not in tensors:
        raise KeyError(name)
    shape, dtype = tensors[name]
    return tuple(int(x) for x in shape), np.dtype(dtype)


def build_upload_plan(tensors: dict[str, tuple[tuple[int, ...], np.dtype]], n_layers: int,
                      tied: bool) -> UploadPlan:
    """tensors: file tensor name -> (shape, dtype). Raises KeyError naming the first missing tensor."""
    buffers: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    copies: list[Copy] = []

    def single(key: str, name: str) -> None:
        shape, dt = _info(tensors, name)
        buffers[key] = (shape, dt)
        copies.append(Copy(name, key, 0, int(np.prod(shape)) * dt.itemsize))

    def stacked(key: str, names: list[str]) -> None:
        # Row-wise concatenation: all parts share the trailing dims and dtype.
        infos = [_info(tensors, n) for n in names]
        tail, dt = infos[0][0][1:], infos[0][1]
        for n, (s, d) in zip(names, infos, strict=True):
            if s[1:] != tail or d != dt:
                raise ValueError(f"cannot stack {n} {s} {d} under {key}: expected [*, {tail}] {dt}")
        rows = sum(s[0] for s, _ in infos)
        buffers[key] = ((rows, *tail), dt)
        off = 0
        for n, (s, d) in zip(names, infos, strict=True):
            nb = int(np.prod(s)) * d.itemsize
            copies.append(Copy(n, key, off, nb))
            off += nb

    single("embed", "model.embed_tokens.weight")
    aliases = {}
    if tied:
        aliases["lm_head"] = "embed"
    else:
        single("lm_head", "lm_head.weight")
    single("norm", "model.norm.weight")
    for i in range(n_layers):
        p = f"model.layers.{i}."
        single(f"{i}.ln1", p + "input_layernorm.weight")
        single(f"{i}.ln2", p + "post_attention_layernorm.weight")
        for key, projs in FUSED.items():
            stacked(f"{i}.{key}.w", [p + q + ".qweight" for q in projs])
            stacked(f"{i}.{key}.s", [p + q + ".scales" for q in projs])
        stacked(f"{i}.qkv.b", [p + q + ".bias" for q in FUSED["qkv"]])
        for key, proj in SINGLE.items():
            single(f"{i}.{key}.w", p + proj + ".qweight")
            single(f"{i}.{key}.s", p + proj + ".scales")
    return UploadPlan(buffers, copies, aliases)


def chunks(nbytes: int, chunk: int):
    """(offset, length) pieces of at most `chunk` bytes covering [0, nbytes)."""
    off = 0
    while off < nbytes:
        n = min(chunk, nbytes - off)
        yield off, n
        off += n


def kv_page_bytes(n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """K+V bytes one page id costs across all layers (7B: 2*28*4*16*128*2 = 917,504 B = 56 KiB/token)."""
    return kv_cache_bytes(n_layers, 1, n_kv_heads, head_dim)


# Headroom left free after the KV pool when it is sized from free memory: prefill temporaries (a 7B
# prompt of 32k tokens needs [T, 2I] f16 = 2.5 GB for gate/up plus the dequantized weight), cuBLAS
# workspaces and the CUDA context's own growth.
HEADROOM_MIN = 6 << 30
HEADROOM_FRACTION = 0.08
# Without max_context the pool holds up to this many full-length sequences; more is memory nobody asked for.
MAX_FULL_SEQS = 8


@dataclass(frozen=True)
class PoolSize:
    n_pages: int
    max_pages_per_seq: int
    kv_bytes: int


def size_pool(*, n_layers: int, n_kv_heads: int, head_dim: int, max_position: int,
              max_context: int | None, free_bytes: int, total_bytes: int,
              n_pages: int | None = None) -> PoolSize:
    """How many pages to allocate.

    n_pages given: that many; a sequence may grow to max_context (or max_position) tokens.
    max_context given: two sequences of that many tokens fit (several shorter ones share the pool).
    Otherwise: what free memory allows after the headroom, capped at MAX_FULL_SEQS sequences of the
    model's max_position; a sequence may then grow to max_position. Raises ValueError when not even one
    page fits (the caller turns that into its out-of-memory error).
    """
    per_page = kv_page_bytes(n_layers, n_kv_heads, head_dim)
    if n_pages is not None:
        if n_pages < 1:
            raise ValueError(f"n_pages must be >= 1, got {n_pages}")
        if n_pages * per_page > free_bytes:
            raise ValueError(f"{n_pages} KV pages need {n_pages * per_page / 2**30:.2f} GiB, "
                             f"{free_bytes / 2**30:.2f} GiB free")
        per_seq = pages_for(max_context if max_context is not None else max_position)
        return PoolSize(n_pages, min(n_pages, per_seq), n_pages * per_page)
    if max_context is not None:
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        # Two full-length sequences, as the reference backend sizes it: score() or a second request
        # fits beside a live one.
        per_seq = pages_for(max_context)
        n = 2 * per_seq
        if n * per_page > free_bytes:
            raise ValueError(
                f"a KV pool for max_context={max_context} needs {n * per_page / 2**30:.2f} GiB, "
                f"{free_bytes / 2**30:.2f} GiB free"
            )
        return PoolSize(n, per_seq, n * per_page)
    headroom = max(HEADROOM_MIN, int(HEADROOM_FRACTION * total_bytes))
    avail = free_bytes - headroom
    per_seq = pages_for(max_position)
    n = min(avail // per_page, MAX_FULL_SEQS * per_seq)
    if n < 1:
        raise ValueError(
            f"no room for a KV pool: {free_bytes / 2**30:.2f} GiB free, {headroom / 2**30:.2f} GiB headroom"
        )
    return PoolSize(int(n), int(min(n, per_seq)), int(n) * per_page)


# Prefill weights: "int4" dequantizes each INT4 matrix into an fp16 scratch before its GEMM, every pass
# (the 7B: 4.5 GB of INT4 read, 13 GB of fp16 written and read again: ~5.4 ms per prefill at any prompt
# length); "fp16" keeps a dequantized copy of every matrix resident (4x the INT4 bytes: 13 GB for the 7B,
# 2.8 GB for the 1.5B) and prefill multiplies it directly. "auto" takes fp16 when the copy needs at most
# PREFILL_DENSE_FRACTION of the memory free after the upload (an H200 or an 80 GB H100 with the 7B), so
# the KV pool keeps the rest. "fp8" (opt-in, never chosen by auto: it rounds the activations, a numerics
# change) keeps an e4m3 copy (2x the INT4 bytes: 6.5 GB for the 7B) for the FP8 GEMMs (prefill_fp8.py).
PREFILL_WEIGHTS = ("auto", "fp16", "int4", "fp8")
PREFILL_DENSE_FRACTION = 0.25


def choose_prefill_weights(mode: str, dense_bytes: int, free_bytes: int) -> str:
    """"fp16", "int4" or "fp8" for the requested mode (one of PREFILL_WEIGHTS); ValueError when "fp16" or
    "fp8" is asked for and its copy would leave less than HEADROOM_MIN free (the e4m3 copy is half the fp16
    one: dense_bytes / 2)."""
    if mode not in PREFILL_WEIGHTS:
        raise ValueError(f"prefill weights must be one of {PREFILL_WEIGHTS}, got {mode!r}")
    if mode == "int4":
        return "int4"
    if mode == "fp8":
        if dense_bytes // 2 > free_bytes - HEADROOM_MIN:
            raise ValueError(f"the resident fp8 prefill weights need {dense_bytes / 2**31:.2f} GiB, "
                             f"{free_bytes / 2**30:.2f} GiB free (less {HEADROOM_MIN / 2**30:.0f} GiB headroom)")
        return "fp8"
    if mode == "fp16":
        if dense_bytes > free_bytes - HEADROOM_MIN:
            raise ValueError(f"the resident fp16 prefill weights need {dense_bytes / 2**30:.2f} GiB, "
                             f"{free_bytes / 2**30:.2f} GiB free (less {HEADROOM_MIN / 2**30:.0f} GiB headroom)")
        return "fp16"
    return "fp16" if dense_bytes <= PREFILL_DENSE_FRACTION * free_bytes else "int4"


def max_tokens_of(pool: PoolSize) -> int:
    return pool.max_pages_per_seq * PAGE_TOKENS
