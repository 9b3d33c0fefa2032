"""The batch-1 int8 loop's build per model dims and GPU (cuda/gemv_units.cuh, gemv_a8.cuh, gemv_a8_cluster.cuh):
which defines gemv_int4.cu is compiled with for the B = 1 loop (b1_build_defines, and the decode step's
short-context build, b1_short_defines), and what a launcher reads back from a build (b1_split, b1_clusters, the
a8 image pair). Every choice here was measured on the H200; the comments carry the figures. gemv.py's
GemvKernels launches what these say.
"""

from __future__ import annotations

from .dims import ModelDims
from .errors import KernelError
from .loader import extra_defines

THREADS = 256  # a block of the B = 1 loop (and of the other GEMV entries: gemv.py), common.cuh kThreads
WARPS = THREADS // 32

# The int8 loop's split-K (gemv_units.cuh gemv_split): warps per 2-row unit of down_proj ("i"), the
# NQ_SPLIT_DOWN define; q/k/v, o_proj and gate/up are never split (q/k/v and o_proj in 2 lost on both models,
# the table below; their knobs were removed). The build's value comes from b1_build_defines (the dims and the
# GPU's SM count), a $NANOQWEN_KERNEL_DEFINES knob overrides it; the launcher sizes its grid by the value its
# build was compiled with.
B1_SPLIT_DEFINES = {"i": "NQ_SPLIT_DOWN"}
# Where o_proj's and down_proj's grids (a block per 8 of their hidden / 2 units) leave SMs without a block,
# the int8 loop's build (b1_build_defines) splits down_proj's units over DOWN_SPLIT warps, with a register
# cap (NQ_MINB_DOWN: 4 blocks of 256 threads an SM, 64 registers) so the split grid's 4x blocks are
# resident at once, and lets o_proj release its successor at its entry (NQ_TRIG_O=2, not after its wait):
# gate/up's blocks then take the SMs o_proj leaves empty and load their first weights there.
# H200, decode protocol, int8, ms/token, two rounds each (docs/PERF.md "twenty-second lease"):
#                      unsplit        split 2        split 2, cap 4   split 4, cap 4   q/k/v 2        o_proj 2
#   1.5B's dims (96)   0.756 / 0.757  0.709 / 0.711  0.743 / 0.742    0.683 / 0.681    0.758 / 0.758  0.804 / 0.803
#   7B (224 blocks)    1.516 / 1.515  1.532 / 1.532  1.521 / 1.513    1.532 / 1.528    1.549 / 1.553  1.562 / 1.564
#   then on the 1.5B's dims, down_proj split in 4 (a later call): 0.696 / 0.697; o_proj at its entry 0.678 /
#   0.679; split in 8 0.713 / 0.713; in 4 without the cap 0.699 / 0.699; unsplit 0.756 / 0.755
# (blocks: the unsplit grid on the H200's 132 SMs). Where every SM has a block already the split only adds
# the join, and o_proj's entry trigger lost on the 7B (1.509 -> 1.521, twenty-first lease): the 7B keeps
# one warp a unit and the trigger after the wait.
# In the same small-grid builds gate/up releases its successor after its wait (NQ_TRIG_GU=3), not at its
# entry: real 1.5B 0.6363 / 0.6335 / 0.6335 -> 0.6327 / 0.6328 / 0.6327 ms/token and 0.6341 / 0.6329 / 0.6335 ->
# 0.6310 / 0.6322 / 0.6317 (two calls, every round), the 1.5B's dims five rounds of six (docs/PERF.md,
# twenty-fourth lease).
DOWN_SPLIT = 4
DOWN_SPLIT_MIN_BLOCKS = 4
# Where down_proj is unsplit (every SM has a block: the 7B), clusters of DOWN_CLUSTER blocks share its
# prologue (gemv_a8_cluster.cuh NQ_DOWN_CLUSTER: each block reads and rounds 1 / C of the intermediate and
# stores it into every block of its cluster). H200, decode protocol, ms/token, three interleaved rounds
# (docs/PERF.md, twenty-seventh lease): 7B every block alone 1.4088 / 1.4043 / 1.4086, clusters of 2 1.3686 /
# 1.3719 / 1.3729, of 4 1.3723 / 1.3734 / 1.3747; at 32k 1.951 / 1.955 -> 1.910 (2), 1.921 / 1.919 (4);
# down_proj's family 12.14 -> 11.41 (2) / 11.23 (4) us a launch. 2: it won every round of the protocol.
DOWN_CLUSTER = 2


# The same sharing for the K = hidden kinds (gemv_a8_cluster.cuh stage_x_a8_cluster_norm): q/k/v's and gate/up's
# RMSNorm and rounding, o_proj's rounding, each split over a cluster of blocks (1: none, every build's default).
# Measured on the H200 (decode protocol, ms/token, interleaved rounds; docs/PERF.md, twenty-eighth lease), the 7B
# (448 chunks of x over 256 threads, two a thread): unshared 1.3723 / 1.3746 / 1.3710, q/k/v in 2 1.3684 / 1.3686
# / 1.3684, gate/up in 2 1.3724 / 1.3708 / 1.3679, o_proj in 2 1.3721 / 1.3737 / 1.3724 (its family 3.06 -> 3.26
# us); unshared 1.3701 / 1.3686 / 1.3708, q/k/v and gate/up in 2 1.3665 / 1.3651 / 1.3667 (q/k/v 4.85 -> 4.52 us a
# launch, gate/up 19.19 -> 18.87), q/k/v in 4 1.3754 / 1.3736 / 1.3742, both in 4 1.546 / 1.540 / 1.540. But at
# 32,000 + 128 tokens (the long-context attention build, clusters of 16) both in 2 cost 1.965 / 1.968 against
# 1.909 / 1.910 (q/k/v alone 1.949 / 1.949, gate/up alone 1.924 / 1.923): -3.5 us a token at 640 tokens, +56 at
# 32k. The 1.5B's dims (1,536: at most a chunk a thread), both in 2: 0.5940 / 0.5932 / 0.5944 -> 0.6002 / 0.5999 /
# 0.5999. So the default build does not share them; the short-context build does (b1_short_defines). The defines
# per kind:
B1_CLUSTER_DEFINES = {"i": "NQ_DOWN_CLUSTER", "qkv": "NQ_QKV_CLUSTER", "h": "NQ_O_CLUSTER", "gu": "NQ_GU_CLUSTER"}
# The short-context build's clusters (b1_short_defines): q/k/v's and gate/up's prologue in clusters of 2 where the
# grid is not small (the 7B).
SHORT_CLUSTER = 2


def b1_clusters(build: dict[str, int] | None = None) -> dict[str, int]:
    """Blocks a cluster of each kind's int8 loop shares its prologue over (1: none), in a build given
    b1_build_defines' `build` (and $NANOQWEN_KERNEL_DEFINES over it)."""
    out = {}
    for kind, name in B1_CLUSTER_DEFINES.items():
        value = extra_defines().get(name, (build or {}).get(name, 1))
        if value not in (1, 2, 4, 8):
            raise KernelError(f"{name}={value}: a cluster of 1, 2, 4 or 8 blocks")
        out[kind] = value
    return out


def b1_small_grid(dims: ModelDims, sm_count: int) -> bool:
    """Whether o_proj's and down_proj's unsplit int8-loop grid (a block per 8 units of hidden / 2) is
    smaller than the SM count (the 1.5B on the H200: 96 blocks on 132 SMs; the 7B: 224)."""
    return -(-(dims.hidden // 2) // WARPS) < sm_count


def b1_build_defines(dims: ModelDims, sm_count: int) -> dict[str, int]:
    """The int8 loop's defines for these dims on a GPU of sm_count SMs: q/k/v's settled epilogue inputs (its
    position, page id and bias) read before the launch-overlap wait (NQ_EPI_SETTLED=1) everywhere, and where
    the grid is small (b1_small_grid) down_proj split in DOWN_SPLIT with its register cap, o_proj's trigger
    at its entry and gate/up's after its wait.
    Settled inputs, H200, decode protocol, ms/token, interleaved rounds (docs/PERF.md, twenty-fifth lease):
    the 7B after the sums 1.4559 / 1.4582, q/k/v's before the wait (1) 1.4475 / 1.4470, o_proj's residual too
    (1 | 2 = 3) 1.471 / 1.467 / 1.466 where its sums alone were 1.459, the residual alone (2) 1.4678 / 1.4687;
    the 1.5B's dims after the sums 0.637 / 0.640 / 0.640, with 3 0.627 / 0.626 / 0.630, then 3 against 1
    0.6281 / 0.6327 against 0.6277 / 0.6286. So q/k/v's alone, on both.
    Where down_proj is unsplit (the 7B), its prologue is shared by clusters of DOWN_CLUSTER blocks (q/k/v's and
    gate/up's are not: B1_CLUSTER_DEFINES says why).
    RoPE's sine and cosine computed with q/k/v's settled inputs, before the wait (NQ_ROPE_PRE, the twenty-eighth
    lease: the 1.5B's dims 0.5901 -> 0.5877 ms/token) were removed: the real 1.5B's tier moved with them (15 of
    4,800 positions, worst gap 0.108 against 11 and 0.044 at 4beb75e; docs/PERF.md, twenty-ninth lease)."""
    if b1_small_grid(dims, sm_count):
        return {"NQ_SPLIT_DOWN": DOWN_SPLIT, "NQ_MINB_DOWN": DOWN_SPLIT_MIN_BLOCKS, "NQ_TRIG_O": 2,
                "NQ_TRIG_GU": 3, "NQ_EPI_SETTLED": 1}
    return {"NQ_EPI_SETTLED": 1, "NQ_DOWN_CLUSTER": DOWN_CLUSTER}


def b1_short_defines(dims: ModelDims, sm_count: int) -> dict[str, int]:
    """The int8 loop's defines over b1_build_defines for the decode step's short-context graph (every sequence
    of the step at most attention.SHORT_CONTEXT_TOKENS long; nanoqwen_engine's decode step), or {} where that
    graph runs the default build: q/k/v's and gate/up's prologue shared by clusters of SHORT_CLUSTER blocks
    where the grid is not small (the 7B). They won at 640 tokens and lost at 32k, where the long-context
    attention build's clusters of 16 run beside them (B1_CLUSTER_DEFINES' comment; docs/PERF.md, twenty-eighth
    lease), so only the short-context graph takes them."""
    if b1_small_grid(dims, sm_count):
        return {}
    return {"NQ_QKV_CLUSTER": SHORT_CLUSTER, "NQ_GU_CLUSTER": SHORT_CLUSTER}


# The a8 image pair (gate/up writing down_proj's input already rounded to int8, down_proj copying it as
# it is) or the plain pair (gate/up writing fp16, every down_proj block rounding the intermediate in its
# prologue), per dims: the image pair where down_proj is split (b1_small_grid: 4x the blocks, each of
# which would round the whole intermediate), the plain pair elsewhere. H200, decode protocol, ms/token,
# three interleaved rounds (docs/PERF.md, twenty-fourth lease): 7B image 1.480 / 1.476 / 1.479, plain
# 1.451 / 1.449 / 1.449; real 1.5B image 0.634 / 0.633 / 0.633, plain 0.699 / 0.699 / 0.698. On the 7B the
# image kernel's per-group rounding epilogue costs more (22.8 us a launch in the step's breakdown against
# the plain loop's 19.9) than down_proj's prologue rounding saves.
def b1_a8_image_pair(dims: ModelDims, sm_count: int) -> bool:
    """Whether the int8 loop's gate/up -> down_proj runs as the a8 image pair on these dims."""
    return b1_small_grid(dims, sm_count)


def b1_split(kind: str, build: dict[str, int] | None = None) -> int:
    """Warps per unit of the int8 loop for a matrix kind ("i"; "qkv", "h", "gu": always 1) in a build
    given b1_build_defines' `build` (and $NANOQWEN_KERNEL_DEFINES over it): 1, 2, 4 or 8."""
    if kind not in B1_SPLIT_DEFINES:
        return 1
    name = B1_SPLIT_DEFINES[kind]
    split = extra_defines().get(name, (build or {}).get(name, 1))
    if split not in (1, 2, 4, 8):
        raise KernelError(f"{name}={split}: the warps of a unit must be 1, 2, 4 or 8")
    return split
