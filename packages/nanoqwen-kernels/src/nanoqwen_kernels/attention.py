"""Paged decode attention over a batch: launcher for cuda/attention_decode.cu.

`AttentionKernels(dims, load_module).attention_decode(q[B, n_heads*128], k_cache, v_cache,
page_table[B, max_pages], seq_len_dev[B], layer, out[B, n_heads*128], workspace)` launches one kernel
(splits in thread-block clusters that combine through distributed shared memory) on the current CuPy
stream and never synchronises; lengths and page tables are read on
the device, so a captured CUDA graph serves every token of a batch of that size. A 1-D q/out is the
batch of one. Every bad argument is one KernelError naming it (checks.py), before anything reaches the GPU.
"""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .dims import HEAD_DIM, PAGE_TOKENS, ModelDims
from .errors import KernelError
from .loader import Define

MAX_BATCH = 64  # the largest batch a default workspace serves (the engine's max_batch)
DECODE_SOURCES = ["attention_decode.cu"]
DECODE_STAGES = 8  # ring slots of 8 KiB (K+V page): 64 KiB in flight per SM (Little's law needs ~32 KB)
# Consumer variants: "fma" = fp32 dot products on CUDA cores; "mma" = mma.sync m16n8k16 on tensor cores (fp16
# in, fp32 accumulate, P rounded to fp16 as FlashAttention does); 4 consumer warps each. Default "mma":
# measured against "fma" in the engine on the H200 (docs/PERF.md, 2026-11-30 fifth lease): 7B decode at depth
# 0 2.07 -> 2.01 ms/token, bench_batch steps at B = 8 / 32 / 64 3.16 / 4.96 / 8.37 -> 3.08 / 4.73 / 8.10 ms.
# "fma" stays as the numerically tighter body (every variant passes the same GPU tests; bench_attention.py runs
# each variant in its own process). The consumer count is the variant's: a NQ_DECODE_CONSUMERS knob through
# $NANOQWEN_KERNEL_DEFINES would disagree with the launch's threads and shared memory sized here.
# Removed as measured slower everywhere (issue 15: fewer variants, fewer paths to test): "mma8", the tensor-core
# body on 8 consumer warps. H200, us a call in isolation, 7B at 640 / 1,024 tokens: 4.50 / 5.14 against 4.19 /
# 4.54 for 4 warps (the short-context launch, one cluster), 38.1 against 26.0 at 32k (twenty-third lease); in the
# decode protocol 7B 1.368-1.370 against 1.347-1.349 ms/token, the 1.5B's dims 0.588-0.591 against 0.586
# (docs/PERF.md, thirty-second lease).
VARIANTS = {"fma": (0, 4), "mma": (1, 4)}
DEFAULT_VARIANT = "mma"
# The kernel's splits sit in clusters of <= CLUSTER_MAX blocks that combine through distributed shared
# memory: a sequence of <= 1,024 tokens in one cluster writes its output directly; longer ones spread over
# several clusters, the last to finish folding their partials through the workspace. It replaced a split
# kernel + combine kernel pair (2026-12-01, docs/PERF.md: 7B batch 1, context 640 8.56 -> 7.24 us per call).
CLUSTER_MAX = 8  # the portable cluster size
# The long-context build: clusters of up to 16 blocks (a non-portable size, allowed per function, placed with
# the "spread" scheduling policy), so a long sequence streams over more blocks with fewer clusters to fold
# (7B at batch 1: 3 clusters of 16, 192 blocks, instead of 5 of 8). In isolation (H200, docs/PERF.md
# twenty-fourth lease) 7B 23.4 us at 32k against 25.7; in the step at short context it loses (a cluster
# of 16 waits for 16 free slots in one GPC while the previous kernel holds the SMs), so the engine launches
# it only for long contexts (nanoqwen_engine's decode step, LONG_CONTEXT_TOKENS).
LONG_CLUSTER_MAX = 16
CLUSTER_MAXES = (CLUSTER_MAX, LONG_CLUSTER_MAX)
# The short-context launch: one cluster per (sequence, KV head). A sequence of at most SHORT_CONTEXT_TOKENS (the
# kernel's NQ_DECODE_MIN_CLUSTER_PAGES pages) is read by its first cluster alone in any grid, so the default
# grid's other clusters (7B at batch 1: 4 of 5, 128 of 160 blocks) only start, wait and leave; this grid
# launches none of them (launched from the default build it gave the default grid's outputs bit for bit at
# those lengths; its own build, SHORT_PAIR below, regroups the softmax). Longer sequences are still right on
# it, one cluster streaming every page (slower). The decode step launches it from a graph of its own while
# every sequence of its batch is this short (nanoqwen_engine's decode step, SHORT_CONTEXT_TOKENS there).
SHORT_CONTEXT_TOKENS = 64 * PAGE_TOKENS  # NQ_DECODE_MIN_CLUSTER_PAGES (attention_decode.cu) x 16
# The short-context launch's build: its consumer warps take their pages two at a time (NQ_DECODE_PAIR,
# attention_decode_ring.cuh mma_page_step<2>). H200, decode protocol (512-token prompt + 128), ms/token, three
# interleaved rounds (docs/PERF.md, thirtieth lease): 7B 1.3731 / 1.3674 / 1.3691 -> 1.3504 / 1.3522 / 1.3495,
# the 1.5B's dims 0.5973 / 0.5912 / 0.5912 -> 0.5895 / 0.5904 / 0.5897, the real 1.5B 0.5871 / 0.5891 / 0.5910 ->
# 0.5836 / 0.5806 / 0.5822 (every build paired in that call, the short range's the only one the protocol runs).
# In isolation the paired build is slower (7B 4.19 -> 4.28 us at 640 tokens, 4.50 -> 4.66 at 1,024): the gain is
# the step's, and about a third of it came back with the unpaired build held to one block an SM (7B 1.3627 /
# 1.3639 / 1.3615), which the pair's registers (153 -> 173) also force: where its blocks sit beside the other
# kernels' is part of it (inferred, not traced). The default and long builds stay unpaired: at one block an
# SM their several-cluster grids no longer fit on the device at once (no flagged fold) and a 32k call took
# 46.8 us against 24.9 (7B, C = 8, n = 5).
SHORT_PAIR = True
# cuda.h CUfunction_attribute: non-portable cluster sizes allowed, and the cluster scheduling policy (1 = spread)
FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
FUNC_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15
CLUSTER_SCHEDULING_POLICY_SPREAD = 1
TICKET_WORDS = 1024  # the workspace's first words: the one-kernel build's ticket counters (kTicketWords)
# The several-cluster fold's flagged words (attention_decode.cu, NQ_ATTN_LL_FOLD): a (sequence, cluster, head)
# row of 128 acc + m + l values, each one 8-byte word (value, flag): kLlRow words = 2 * LL_ROW floats.
LL_ROW = HEAD_DIM + 2


def decode_splits(dims: ModelDims, batch: int, sms: int) -> int:
    """Splits over pages per (sequence, KV head) so that n_kv_heads x splits x batch blocks cover the `sms`
    SMs at least once: at batch 1 every SM streams one slice of the one sequence (7B on 132 SMs: 33
    splits per KV head); a large batch has blocks enough with one split each."""
    return max(1, -(-sms // (dims.n_kv_heads * batch)))


def decode_clusters(dims: ModelDims, batch: int, sms: int, cluster_max: int = CLUSTER_MAX) -> tuple[int, int]:
    """(cluster size C, clusters per (sequence, KV head)): the split count of
    decode_splits, in clusters of at most cluster_max blocks (7B on 132 SMs: (8, 5) at batch 1, (5, 1) at
    8, (1, 1) from 33; the long build (16, 3) at batch 1)."""
    s = decode_splits(dims, batch, sms)
    c = min(cluster_max, s)
    return c, -(-s // c)


def _variant(variant: str) -> tuple[int, int]:
    if variant not in VARIANTS:
        raise KernelError(f"unknown attention_decode variant {variant!r}; one of {sorted(VARIANTS)}")
    return VARIANTS[variant]


def decode_defines(dims: ModelDims, variant: str = DEFAULT_VARIANT, cluster_max: int = CLUSTER_MAX,
                   pair: bool = False) -> dict[str, Define]:
    mma, consumers = _variant(variant)
    if cluster_max not in CLUSTER_MAXES:
        raise KernelError(f"decode attention clusters of up to {cluster_max}: one of {CLUSTER_MAXES}")
    extra = {} if cluster_max == CLUSTER_MAX else {"NQ_DECODE_CLUSTER_MAX": cluster_max}
    return {
        **dims.defines(),
        "NQ_DECODE_STAGES": DECODE_STAGES,
        "NQ_DECODE_MMA": mma,
        "NQ_DECODE_CONSUMERS": consumers,
        **({"NQ_DECODE_PAIR": 1} if pair else {}),
        **extra,
    }


def decode_smem_bytes(dims: ModelDims, variant: str = DEFAULT_VARIANT) -> int:
    """Dynamic shared memory of nq_attention_decode; mirrors kSmemBytes in attention_decode.cu."""
    consumers = _variant(variant)[1]
    g = dims.n_heads // dims.n_kv_heads
    ring = DECODE_STAGES * 2 * PAGE_TOKENS * HEAD_DIM * 2  # [stages][K|V][16][128] fp16
    merge = consumers * g * HEAD_DIM * 4 + 2 * consumers * 8 * 4  # acc + (m, l)
    pbuf = consumers * 16 * 8 * 4
    return ring + merge + pbuf + 2 * DECODE_STAGES * 8  # + full/empty mbarriers


def decode_workspace_floats(dims: ModelDims, batch: int, sms: int, cluster_max: int = CLUSTER_MAX) -> int:
    """float32 elements a batch of `batch` needs: the ticket words, then either fold's partials: the
    ticket fold's acc [B, clusters, heads, 128] and (m, l) per rank [B, clusters, C, heads, 2], or the
    flagged fold's words [B, clusters, heads, 130] (8 bytes each), whichever is larger."""
    c, n = decode_clusters(dims, batch, sms, cluster_max)
    return TICKET_WORDS + batch * n * dims.n_heads * max(HEAD_DIM + 2 * c, 2 * LL_ROW)


class AttentionKernels:
    """The decode attention build for one ModelDims. `load_module(sources, defines)` is the loader's;
    `sms` the device's SM count (asked of the current device when None); cluster_max: CLUSTER_MAX, or
    LONG_CLUSTER_MAX for the long-context build (its function allows non-portable cluster sizes and asks
    for the spread scheduling policy); max_clusters: clusters per (sequence, KV head) at most (1: the
    short-context launch, SHORT_CONTEXT_TOKENS), None for as many as decode_clusters gives; pair: the
    consumers take their pages two at a time (NQ_DECODE_PAIR; the short-context launch's build, SHORT_PAIR)."""

    def __init__(self, dims: ModelDims, load_module, variant: str = DEFAULT_VARIANT, sms: int | None = None,
                 cluster_max: int = CLUSTER_MAX, max_clusters: int | None = None, pair: bool = False):
        if max_clusters is not None and max_clusters < 1:
            raise KernelError(f"max_clusters={max_clusters}: at least 1 cluster per sequence and KV head")
        if dims.n_heads // dims.n_kv_heads > 8:
            raise KernelError(
                f"unsupported GQA group {dims.n_heads // dims.n_kv_heads}: attention_decode handles <= 8"
            )
        self.dims = dims
        self.variant = variant
        self.threads = 32 * (1 + _variant(variant)[1])  # 1 producer warp + the consumer warps
        self.smem_bytes = decode_smem_bytes(dims, variant)
        self._sms = sms
        self._flagged: dict[int, bool] = {}
        self.cluster_max = cluster_max
        self.max_clusters = max_clusters
        self.pair = pair
        mod = load_module(DECODE_SOURCES, decode_defines(dims, variant, cluster_max, pair))
        self._fn = mod.get_function("nq_attention_decode", max_dynamic_smem=self.smem_bytes)
        if cluster_max > CLUSTER_MAX:
            ck.set_function_attribute(self._fn, FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            ck.set_function_attribute(self._fn, FUNC_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                                      CLUSTER_SCHEDULING_POLICY_SPREAD)

    @property
    def sms(self) -> int:
        """SMs the split and cluster counts are sized for (asked of the device on first use, so a CPU can
        build the launcher for its argument checks)."""
        if self._sms is None:
            self._sms = ck.sm_count()
        return self._sms

    def clusters(self, batch: int) -> tuple[int, int]:
        """(cluster size, clusters per (sequence, KV head)) a batch of `batch` sequences launches with."""
        c, n = decode_clusters(self.dims, batch, self.sms, self.cluster_max)
        return c, n if self.max_clusters is None else min(n, self.max_clusters)

    def flagged_fold(self, batch: int) -> bool:
        """Whether a batch of `batch` may fold its clusters through flagged words (cluster 0 polls the
        others' partials): only where the launch has several clusters per sequence and every cluster of the
        grid fits on the device at once (cuOccupancyMaxActiveClusters), so a polling cluster never waits on
        one that cannot be placed. Else the ticket fold (the last cluster to finish folds). Asked once a
        batch size."""
        if batch not in self._flagged:
            c, n = self.clusters(batch)
            grid = (self.dims.n_kv_heads, c * n, batch)
            self._flagged[batch] = n > 1 and self.dims.n_kv_heads * n * batch <= ck.max_active_clusters(
                self._fn, grid, (self.threads, 1, 1), self.smem_bytes, (1, c, 1))
        return self._flagged[batch]

    def workspace_floats(self, max_batch: int = MAX_BATCH) -> int:
        """float32 elements a workspace needs to serve every batch size 1..max_batch, for either build (one
        workspace serves both: every call leaves its tickets at 0 and no word flagged)."""
        return max(decode_workspace_floats(self.dims, b, self.sms, cm)
                   for b in range(1, max_batch + 1) for cm in CLUSTER_MAXES)

    def new_workspace(self, max_batch: int = MAX_BATCH):
        """A float32 workspace for batches of up to max_batch sequences (allocate once, reuse every token).
        Zeroed: its first TICKET_WORDS are the kernel's ticket counters, which start at 0 (and every call
        leaves them 0); after them no word may hold the flagged fold's flag (every call clears what it
        raised)."""
        return ck.cupy_module().zeros(self.workspace_floats(max_batch), dtype=np.float32)

    def attention_decode(self, q, k_cache, v_cache, page_table, seq_len_dev, layer, out, workspace) -> None:
        """out[b, h] = softmax(q[b, h] K_b^T / sqrt(128)) V_b over positions < seq_len_dev[b] of sequence
        b's pages (page_table[b]) in one layer; a row with seq_len 0 (padding) gives 0.

        q, out: fp16 [B, n_heads*128] (or [n_heads*128], B = 1); k/v_cache: fp16 [n_layers, n_pages,
        n_kv, 16, 128]; page_table: int32 [B, max_pages] (or [max_pages] for B = 1); seq_len_dev: int32
        [B] (device); workspace: float32, zeroed, of at least decode_workspace_floats(dims, B, sms) elements
        (new_workspace; its first TICKET_WORDS must be 0 and no word after them may hold the flagged fold's
        flag, as every call leaves them; NaN poison is fine).
        seq_len is clamped to max_pages*16 on the device.
        Launch overlap: the lengths, the page tables and every page but each sequence's newest (the page of
        position seq_len - 1) are read before the wait for the previous kernel (NQ_ATTN_EARLY_PAGES, default
        1; NQ_ATTN_EARLY_PAGES=0 in $NANOQWEN_KERNEL_DEFINES waits first), so only the newest token's
        K/V and q may come from the kernel just before this one (the decode step's q/k/v kernel); anything
        else must have been written earlier (a previous step, the host).
        """
        d = self.dims
        ck.check_array("q", q, np.float16)
        width = d.n_heads * HEAD_DIM
        B = ck.batch_rows("q", q, width)
        ck.check_array("out", out, np.float16, shape=tuple(q.shape))
        layer, n_pages = ck.check_kv_cache(d, k_cache, v_cache, layer)
        one_table = B == 1 and getattr(page_table, "ndim", None) == 1  # batch of one: a 1-D table too
        ck.check_page_table(page_table, rows=None if one_table else B)
        max_pages = int(page_table.shape[-1])
        ck.check_array("seq_len_dev", seq_len_dev, np.int32, shape=(B,))
        ck.check_array("workspace", workspace, np.float32,
                    min_size=decode_workspace_floats(d, B, self.sms, self.cluster_max))
        if max_pages * PAGE_TOKENS >= 2**31:
            raise KernelError(f"page_table has {max_pages} pages per sequence: too many for int32 positions")
        if B > 65535:
            raise KernelError(f"q has {B} rows; a launch takes at most 65535 sequences (grid.z)")
        c, n = self.clusters(B)
        if n > 1 and B * d.n_kv_heads * c > TICKET_WORDS:
            raise KernelError(f"a batch of {B} needs {B * d.n_kv_heads * c} tickets; the workspace has "
                              f"{TICKET_WORDS}")
        ck.launch(
            self._fn,
            (d.n_kv_heads, c * n, B),
            (self.threads, 1, 1),
            (q, k_cache, v_cache, page_table, seq_len_dev, np.int32(layer), np.int32(n_pages),
             np.int32(max_pages), np.int32(c), np.int32(n), np.int32(self.flagged_fold(B)), workspace, out),
            shared_mem=self.smem_bytes,
            cluster=(1, c, 1),
        )
