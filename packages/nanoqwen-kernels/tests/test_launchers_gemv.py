"""The INT4 GEMV and lm_head launchers on the CPU (test_launchers.py's method): each bad argument is one
KernelError naming it; a good call reaches the launch with the body, grid and arguments its plan says
(half2 loop, tensor-core passes, tile GEMM), and the plans keep their invariants."""

import numpy as np
import pytest
from fakes import Dev, assert_each_refused, dev, load
from nanoqwen_kernels import KernelError, checks
from nanoqwen_kernels.dims import QWEN25_1_5B, QWEN25_7B, TINY
from nanoqwen_kernels.gemv import GemvKernels


def test_gemv_int4_good_call_and_residual_alias(launches):
    d = TINY
    g = GemvKernels(d, load, "default")  # at B = 1 on the half2 loop
    qw, sc = dev((300, d.hidden // 8), np.uint32), dev((300, d.hidden // 128), np.float16)
    x, out = dev((d.hidden,), np.float16), dev((300,), np.float16)
    g.gemv_int4(qw, sc, x, out, residual=out)  # in-place residual is allowed
    fn, grid, args = launches[-1]
    assert fn == "nq_gemv_int4_h" and grid == -(-150 // 8) and int(args[-1]) == 300
    g = GemvKernels(d, load, "mma")  # at B = 1 on the tensor-core core
    qi, si = dev((7, d.intermediate // 8), np.uint32), dev((7, d.intermediate // 128), np.float16)
    g.gemv_int4(qi, si, dev((d.intermediate,), np.float16), dev((7,), np.float16))
    fn, grid, args = launches[-1]
    assert fn == "nq_gemv_int4_i_mma8" and grid == (1, 1)
    assert [int(a) for a in args[-3:]] == [1, 1, d.intermediate // 128]  # B, columns per pass, K whole


@pytest.mark.parametrize("b, entry, passes", [(2, "mma8", 1), (8, "mma8", 1), (9, "mma32", 1), (64, "mma32", 2)])
def test_gemv_int4_batched_launch(launches, b, entry, passes):
    """The "default" variant: B > 1 on gemv_mma's passes."""
    d = TINY
    g = GemvKernels(d, load, "default")
    qw, sc = dev((300, d.hidden // 8), np.uint32), dev((300, d.hidden // 128), np.float16)
    res = dev((b, 300), np.float16)
    g.gemv_int4(qw, sc, dev((b, d.hidden), np.float16), res, residual=res)
    fn, grid, args = launches[-1]
    assert fn == f"nq_gemv_int4_h_{entry}" and grid[1] == passes and int(args[-3]) == b
    assert int(args[-2]) * passes >= b


@pytest.mark.parametrize("b, build", [(2, 8), (8, 8), (9, 16), (17, 32), (33, 64), (64, 64)])
def test_default_batched_launch_is_the_tile_gemm(launches, monkeypatch, b, build):
    """The default variant: B > 1 on the smallest tile build that holds B, P blocks from plan_tiles (a
    function of the matrix only) of 512 multiplying threads + 4 producer warps (the warp-specialized ring),
    dynamic shared memory for that build."""
    from nanoqwen_kernels.tile_plan import TILE_PRODUCERS, TILE_THREADS, plan_tiles, tile_smem

    d = QWEN25_7B
    g = GemvKernels(d, load)
    qw, sc = dev((d.hidden, d.intermediate // 8), np.uint32), dev((d.hidden, d.intermediate // 128), np.float16)
    res = dev((b, d.hidden), np.float16)
    got = []
    monkeypatch.setattr(checks, "launch", lambda fn, grid, block, args, shared_mem=0: got.append(
        (fn, grid, block, shared_mem)))
    g.gemv_int4(qw, sc, dev((b, d.intermediate), np.float16), res, residual=res)
    fn, grid, block, smem = got[-1]
    assert fn == f"nq_gemv_int4_i_tile{build}" and block == TILE_THREADS + 32 * TILE_PRODUCERS == 640
    assert smem == tile_smem(build)
    assert grid == plan_tiles(d.intermediate, d.hidden // 2, 132).blocks


def test_tile_gemm_takes_at_most_64_columns(launches):
    d = TINY
    g = GemvKernels(d, load)
    qw, sc = dev((64, d.hidden // 8), np.uint32), dev((64, d.hidden // 128), np.float16)
    with pytest.raises(KernelError, match="at most 64 columns"):
        g.gemv_int4(qw, sc, dev((65, d.hidden), np.float16), dev((65, 64), np.float16))
    assert not launches


def test_batched_outputs_must_match_the_batch(launches):
    d = TINY
    g = GemvKernels(d, load)
    qw, sc = dev((64, d.hidden // 8), np.uint32), dev((64, d.hidden // 128), np.float16)
    with pytest.raises(KernelError, match=r"out must have shape \(3, 64\)"):
        g.gemv_int4(qw, sc, dev((3, d.hidden), np.float16), dev((64,), np.float16))
    with pytest.raises(KernelError, match=r"x must be \[B, 256\]"):
        g.gemv_int4(qw, sc, dev((3, 2, d.hidden), np.float16), dev((3, 64), np.float16))
    with pytest.raises(KernelError, match=r"residual must have shape \(3, 64\)"):
        g.gemv_int4(qw, sc, dev((3, d.hidden), np.float16), dev((3, 64), np.float16), residual=dev((64,), np.float16))
    assert not launches


@pytest.mark.parametrize(
    "mutate, word",
    [
        (dict(qweight=lambda d: dev((64, d.hidden // 8), np.int32)), "qweight must be uint32"),
        (dict(qweight=lambda d: dev((64, 40), np.uint32)), "neither hidden"),
        (dict(scales=lambda d: dev((64, 3), np.float16)), "scales must be"),
        (dict(scales=lambda d: dev((64, d.hidden // 128), np.float32)), "scales must be float16"),
        (dict(x=lambda d: dev((d.hidden + 8,), np.float16)), r"x must be \[B, 256\]"),
        (dict(out=lambda d: dev((63,), np.float16)), "out must have shape"),
        (dict(residual=lambda d: dev((64,), np.float32)), "residual must be float16"),
        (dict(norm_w=lambda d: dev((5,), np.float16)), "norm_w must have shape"),
        (dict(eps=lambda d: -1.0), "eps"),
        (dict(x=lambda d: np.zeros(d.hidden, np.float16)), "x must be a CuPy array"),
    ],
)
def test_gemv_int4_rejects(launches, mutate, word):
    d = TINY
    args = dict(
        qweight=dev((64, d.hidden // 8), np.uint32),
        scales=dev((64, d.hidden // 128), np.float16),
        x=dev((d.hidden,), np.float16),
        out=dev((64,), np.float16),
        residual=None,
        norm_w=None,
        eps=1e-6,
    )
    for k, f in mutate.items():
        args[k] = f(d)
    with pytest.raises(KernelError, match=word):
        GemvKernels(d, load).gemv_int4(**args)
    assert not launches


def test_gemv_rejects_non_contiguous_misaligned_and_overlap(launches):
    d = TINY
    g = GemvKernels(d, load)
    qw, sc = dev((64, d.hidden // 8), np.uint32), dev((64, d.hidden // 128), np.float16)
    big = dev((2 * d.hidden,), np.float16)
    strided = Dev(big.a[::2])
    with pytest.raises(KernelError, match="x must be C-contiguous"):
        g.gemv_int4(qw, sc, strided, dev((64,), np.float16))
    shifted = Dev(dev((d.hidden + 8,), np.float16).a[1 : d.hidden + 1])
    with pytest.raises(KernelError, match="x must be 16-byte aligned"):
        g.gemv_int4(qw, sc, shifted, dev((64,), np.float16))
    both = dev((d.hidden,), np.float16)
    q2, s2 = dev((d.hidden, d.hidden // 8), np.uint32), dev((d.hidden, d.hidden // 128), np.float16)
    with pytest.raises(KernelError, match="overlap"):
        g.gemv_int4(q2, s2, both, both)
    assert not launches


def _qkv_args(d, b):
    rows = d.qkv_rows
    lead = (b,) if b > 1 else ()
    return dict(
        qweight=dev((rows, d.hidden // 8), np.uint32),
        scales=dev((rows, d.hidden // 128), np.float16),
        bias=dev((rows,), np.float16),
        x=dev((*lead, d.hidden), np.float16),
        norm_w=dev((d.hidden,), np.float16),
        eps=1e-6,
        pos_dev=dev((b,), np.int32),
        page_table=dev((b, 64), np.int32) if b > 1 else dev((64,), np.int32),
        k_cache=dev((2, 4, d.n_kv_heads, 16, 128), np.float16),
        v_cache=dev((2, 4, d.n_kv_heads, 16, 128), np.float16),
        layer=1,
        q_out=dev((*lead, d.q_dim), np.float16),
    )


def test_qkv_rope_kv_checks(launches):
    d = QWEN25_7B
    g = GemvKernels(d, load)
    rows = d.qkv_rows
    good = _qkv_args(d, 1)
    g.qkv_rope_kv(**good)
    fn, grid, args = launches[-1]
    assert fn == "nq_qkv_rope_kv" and int(args[-4]) == 1 and int(args[-3]) == 4 and int(args[8]) == 64
    assert int(args[-1]) == 0  # settled (the B = 1 loop's last argument): off unless promised
    g.qkv_rope_kv(**good, settled=True)
    assert int(launches[-1][2][-1]) == 1
    bad = [
        (
            dict(qweight=dev((rows - 2, d.hidden // 8), np.uint32), scales=dev((rows - 2, 28), np.float16)),
            "rows",
        ),
        (dict(bias=dev((rows - 1,), np.float16)), "bias"),
        (dict(layer=2), "layer"),
        (dict(layer=True), "layer"),
        (dict(k_cache=dev((2, 4, d.n_kv_heads, 8, 128), np.float16)), "k_cache"),
        (dict(v_cache=dev((2, 5, d.n_kv_heads, 16, 128), np.float16)), "v_cache"),
        (dict(pos_dev=dev((2,), np.int32)), "pos_dev"),
        (dict(page_table=dev((4,), np.int64)), "page_table"),
        (dict(q_out=dev((d.q_dim,), np.float32)), "q_out"),
    ]
    assert_each_refused(g.qkv_rope_kv, good, bad)


def test_qkv_rope_kv_batched_checks(launches):
    d = QWEN25_7B
    g = GemvKernels(d, load)
    good = _qkv_args(d, 5)
    g.qkv_rope_kv(**good)
    (norm, _, nargs), (fn, grid, args) = launches[-2:]
    # the tile GEMM takes x normalised, laid out in its stage layout (NQ_TILE_X_PREPERM) for 8 columns
    assert norm == "nq_norm_cols_wg_h" and nargs[1] is good["norm_w"] and int(nargs[-1]) == 8
    assert fn == "nq_qkv_rope_kv_tile8" and int(args[6]) == 64 and int(args[-3]) == 5
    bad = [
        (dict(pos_dev=dev((1,), np.int32)), r"pos_dev must have shape \(5,\)"),
        (dict(page_table=dev((64,), np.int32)), r"page_table must be int32 \[5, max_pages\]"),
        (dict(page_table=dev((4, 64), np.int32)), "page_table"),
        (dict(q_out=dev((4, d.q_dim), np.float16)), "q_out must have shape"),
    ]
    assert_each_refused(g.qkv_rope_kv, good, bad)


def test_gate_up_and_fp16_checks(launches):
    d = TINY
    g = GemvKernels(d, load, "mma")
    qw, sc = dev((2 * d.intermediate, d.hidden // 8), np.uint32), dev((2 * d.intermediate, 2), np.float16)
    g.gate_up_silu(
        qw,
        sc,
        dev((d.hidden,), np.float16),
        dev((d.hidden,), np.float16),
        1e-6,
        dev((d.intermediate,), np.float16),
    )
    assert launches[-1][0] == "nq_gate_up_silu_mma8"  # "mma": gate/up on tensor cores at B = 1
    with pytest.raises(KernelError, match="2 x intermediate"):
        g.gate_up_silu(
            dev((d.intermediate, d.hidden // 8), np.uint32),
            dev((d.intermediate, 2), np.float16),
            dev((d.hidden,), np.float16),
            None,
            1e-6,
            dev((d.intermediate,), np.float16),
        )
    g.gemv_fp16(dev((1001, d.hidden), np.float16), dev((d.hidden,), np.float16), dev((1001,), np.float32))
    assert launches[-1][0] == "nq_gemv_fp16" and int(launches[-1][2][-1]) == 1001
    gm = GemvKernels(d, load, "default", "mma")  # the lm_head's gemv_mma body at B > 1
    gm.gemv_fp16(dev((1001, d.hidden), np.float16), dev((3, d.hidden), np.float16), dev((3, 1001), np.float32))
    assert launches[-1][0] == "nq_gemv_fp16_mma8" and int(launches[-1][2][-3]) == 3
    with pytest.raises(KernelError, match="out must be float32"):
        g.gemv_fp16(dev((10, d.hidden), np.float16), dev((d.hidden,), np.float16), dev((10,), np.float16))
    with pytest.raises(KernelError, match="w must be"):
        g.gemv_fp16(
            dev((10, d.hidden + 128), np.float16), dev((d.hidden,), np.float16), dev((10,), np.float32)
        )


def test_gemv_plan_examples():
    """The 7B's matrices: x of a pass in shared memory whole when it fits; else restaged per tile (few
    tiles) or more passes (many tiles)."""
    from nanoqwen_kernels.gemv import X_SMEM_BUDGET, plan_gemv

    h, i = QWEN25_7B.hidden, QWEN25_7B.intermediate
    p = plan_gemv(1, i, 224, 132)  # down_proj at B = 1: 38 KB of x, staged once
    assert (p.build, p.passes, p.pass_cols, p.slice_groups) == (8, 1, 1, i // 128)
    p = plan_gemv(32, i, 224, 132)  # down_proj at B = 32: one pass, K in slices of a multiple of 8 groups
    assert (p.build, p.passes, p.pass_cols) == (32, 1, 32) and p.slice_groups % 8 == 0
    assert p.smem <= X_SMEM_BUDGET
    p = plan_gemv(32, h, 2368, 132)  # gate/up at B = 32: two passes of 16 columns, K whole
    assert (p.build, p.passes, p.pass_cols, p.slice_groups) == (32, 2, 16, h // 128)
    p = plan_gemv(64, h, 2368, 132)
    assert (p.passes, p.pass_cols, p.slice_groups) == (3, 22, h // 128)
    p = plan_gemv(8, h, 224, 132)
    assert (p.build, p.passes, p.pass_cols, p.slice_groups) == (8, 1, 8, h // 128)


@pytest.mark.parametrize("k", [256, 1536, 3584, 8960, 18944])
@pytest.mark.parametrize("tiles", [1, 224, 2368, 9504])
def test_gemv_plan_invariants(k, tiles):
    from nanoqwen_kernels.gemv import MMA_BUILDS, X_SMEM_BUDGET, plan_gemv

    for b in range(1, 65):
        p = plan_gemv(b, k, tiles, 132)
        assert p.build in MMA_BUILDS and p.pass_cols <= p.build
        assert p.passes * p.pass_cols >= b > (p.passes - 1) * p.pass_cols  # every pass has columns
        assert p.smem <= X_SMEM_BUDGET
        assert p.slice_groups == k // 128 or p.slice_groups % 8 == 0  # sliced: the same sums' order


def test_tile_knobs_size_the_launch(launches, monkeypatch):
    """NQ_TILE_PRODUCERS / NQ_TILE_STAGES ($NANOQWEN_KERNEL_DEFINES) reach the launch's block and shared
    memory; a build whose stages would not fit the cap gets fewer (gemm_tiles.cuh tile_stages)."""
    from nanoqwen_kernels import tile_plan

    assert tile_plan.tile_threads() == tile_plan.TILE_THREADS + 32 * tile_plan.TILE_PRODUCERS == 640
    assert [tile_plan.tile_stages(c) for c in (8, 16, 32, 64)] == [5, 5, 4, 3]
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_TILE_PRODUCERS=2,NQ_TILE_STAGES=4")
    assert tile_plan.tile_threads() == 576
    assert [tile_plan.tile_stages(c) for c in (8, 16, 32, 64)] == [4, 4, 4, 3]
    assert all(tile_plan.tile_smem(c) <= tile_plan.TILE_SMEM_CAP for c in (8, 16, 32, 64))


@pytest.mark.parametrize("b, build", [(3, 8), (40, 64)])
def test_x_is_laid_out_for_qkv_and_gate_up_only(launches, monkeypatch, b, build):
    """NQ_TILE_X_PREPERM (default 1; $NANOQWEN_KERNEL_DEFINES): gate/up (with its norm or without)
    goes through nq_norm_cols_wg_h with the build's column count and reads what it wrote; o_proj with a norm
    keeps the plain RMSNorm and its x layout."""
    d = QWEN25_7B
    g = GemvKernels(d, load)
    got = []
    monkeypatch.setattr(checks, "launch", lambda fn, grid, block, args, shared_mem=0: got.append((fn, grid, args)))
    qw, sc = dev((2 * d.intermediate, d.hidden // 8), np.uint32), dev((2 * d.intermediate, d.hidden // 128), np.float16)
    x, out = dev((b, d.hidden), np.float16), dev((b, d.intermediate), np.float16)
    for norm_w in (dev((d.hidden,), np.float16), None):
        got.clear()
        g.gate_up_silu(qw, sc, x, norm_w, 1e-6, out)
        (fn0, grid0, args0), (fn1, _, args1) = got
        assert fn0 == "nq_norm_cols_wg_h" and grid0 == b and int(args0[-1]) == build
        assert (args0[1] is norm_w) if norm_w is not None else (args0[1] is checks.NULL)
        assert fn1 == f"nq_gate_up_silu_tile{build}" and args1[2] is args0[3]  # reads what the norm wrote
    got.clear()
    qh, sh = dev((d.hidden, d.hidden // 8), np.uint32), dev((d.hidden, d.hidden // 128), np.float16)
    res = dev((b, d.hidden), np.float16)
    g.gemv_int4(qh, sh, x, res, residual=res, norm_w=dev((d.hidden,), np.float16))
    # o_proj at B <= 8 runs on the tensor-core core (its own norm), above on the tile GEMM
    want = ["nq_gemv_int4_h_mma8"] if b <= 8 else ["nq_norm_cols_h", f"nq_gemv_int4_h_tile{build}"]
    assert [f for f, _, _ in got] == want


def test_x_preperm_off_gives_gate_up_the_plain_norm(launches, monkeypatch):
    """NQ_TILE_X_PREPERM=0 (the A/B knob's other side): gate/up goes back to the plain RMSNorm and x layout."""
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_TILE_X_PREPERM=0")
    d = QWEN25_7B
    g = GemvKernels(d, load)
    got = []
    monkeypatch.setattr(checks, "launch", lambda fn, grid, block, args, shared_mem=0: got.append((fn, grid, args)))
    qw, sc = dev((2 * d.intermediate, d.hidden // 8), np.uint32), dev((2 * d.intermediate, d.hidden // 128), np.float16)
    x, out = dev((5, d.hidden), np.float16), dev((5, d.intermediate), np.float16)
    g.gate_up_silu(qw, sc, x, dev((d.hidden,), np.float16), 1e-6, out)
    assert [f for f, _, _ in got] == ["nq_norm_cols_h", "nq_gate_up_silu_tile8"]


@pytest.mark.parametrize("env, b, want", [
    (None, 8, "nq_gemv_int4_h_mma8"), (None, 9, "nq_gemv_int4_h_tile16"), ("", 8, "nq_gemv_int4_h_tile8"),
    ("h,i", 2, "nq_gemv_int4_h_mma8"),
])
def test_small_batches_of_o_proj_run_on_the_core(launches, monkeypatch, env, b, want):
    """tile_core_kinds(): o_proj (kind "h") at B <= 8 on the tensor-core core by default, on the tile GEMM
    above 8 or when $NANOQWEN_TILE_CORE_KINDS is empty; an unknown kind is refused."""
    if env is not None:
        monkeypatch.setenv("NANOQWEN_TILE_CORE_KINDS", env)
    d = QWEN25_7B
    g = GemvKernels(d, load)
    qh, sh = dev((d.hidden, d.hidden // 8), np.uint32), dev((d.hidden, d.hidden // 128), np.float16)
    x, out = dev((b, d.hidden), np.float16), dev((b, d.hidden), np.float16)
    g.gemv_int4(qh, sh, x, out)
    assert launches[-1][0] == want
    monkeypatch.setenv("NANOQWEN_TILE_CORE_KINDS", "h,lm_head")
    with pytest.raises(KernelError, match="NANOQWEN_TILE_CORE_KINDS"):
        GemvKernels(d, load)


@pytest.mark.parametrize("dims, defines, per_block", [
    (QWEN25_7B, "", {"h": 8, "i": 8}),  # 224 blocks for down_proj unsplit: every SM has one
    (QWEN25_1_5B, "", {"h": 8, "i": 2}),  # 96 blocks unsplit on 132 SMs: down_proj split in 4
    (QWEN25_7B, "NQ_SPLIT_DOWN=4", {"h": 8, "i": 2}),
    (QWEN25_1_5B, "NQ_SPLIT_DOWN=1", {"h": 8, "i": 8}),
])
def test_int8_loop_split_sizes_the_grid(launches, monkeypatch, dims, defines, per_block):
    """The int8 loop's split units (NQ_SPLIT_*): a block of 8 warps runs 8 / split units at once, so the
    grid is the units over that (even_grid's cap aside). The split is the build's: b1_build_defines (down_proj
    split in 4 where its unsplit grid leaves SMs empty), a knob in $NANOQWEN_KERNEL_DEFINES over it, both
    read when the kernels are built, not per launch; gate/up is never split."""
    from nanoqwen_kernels.gemv_b1 import b1_build_defines, b1_small_grid, b1_split

    d = dims
    built = []
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", defines)
    g = GemvKernels(d, lambda sources, defs: built.append(defs) or load(sources, defs), "a8")
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "")  # the launches below keep the build's plan
    int4 = next(defs for defs in built if defs.get("NQ_HIDDEN") == d.hidden and "NQ_SPLIT_DOWN" in defs) \
        if b1_small_grid(d, 132) else None
    assert (int4 is not None) == (d is QWEN25_1_5B)  # the defines reach the int4 build
    if int4 is not None:  # with o_proj's trigger at its entry and gate/up's after its wait
        assert int4["NQ_TRIG_O"] == 2 and int4["NQ_MINB_DOWN"] == 4 and int4["NQ_TRIG_GU"] == 3
    # q/k/v's settled inputs before the wait on every dims' int8 build
    assert b1_build_defines(d, 132)["NQ_EPI_SETTLED"] == 1
    assert any(defs.get("NQ_HIDDEN") == d.hidden and defs.get("NQ_EPI_SETTLED") == 1 for defs in built)
    # the a8 image pair where down_proj is split (the 1.5B), the plain pair elsewhere (the 7B)
    assert g.a8_image_pair == (d is QWEN25_1_5B)
    assert b1_split("gu") == 1
    units = d.hidden // 2
    for kind, k in (("h", d.hidden), ("i", d.intermediate)):
        g.gemv_int4(dev((d.hidden, k // 8), np.uint32), dev((d.hidden, k // 128), np.float16),
                    dev((k,), np.float16), dev((d.hidden,), np.float16))
        fn, grid, _ = launches[-1]
        assert fn == f"nq_gemv_int4_{kind}_a8" and grid == min(132 * 4, -(-units // per_block[kind]))
    # down_proj on an a8 image: the same plan as its plain entry
    g.gemv_int4(dev((d.hidden, d.intermediate // 8), np.uint32), dev((d.hidden, d.intermediate // 128), np.float16),
                dev((d.intermediate,), np.float16), dev((d.hidden,), np.float16), x_a8_image=True)
    fn, grid, _ = launches[-1]
    assert fn == "nq_gemv_int4_i_a8x" and grid == min(132 * 4, -(-units // per_block["i"]))


@pytest.mark.parametrize("dims, defines, cluster", [
    (QWEN25_7B, "", 2),  # the 7B's build: down_proj unsplit, its prologue shared by clusters of DOWN_CLUSTER
    (QWEN25_7B, "NQ_DOWN_CLUSTER=4", 4),
    (QWEN25_7B, "NQ_DOWN_CLUSTER=1", 1),
    (QWEN25_7B, "NQ_SPLIT_DOWN=2", 1),  # a split down_proj never shares its prologue
    (QWEN25_1_5B, "", 1),  # split in 4 (its small grid)
    (QWEN25_1_5B, "NQ_SPLIT_DOWN=1,NQ_DOWN_CLUSTER=2", 2),
])
def test_int8_down_proj_launches_in_clusters(launches, monkeypatch, dims, defines, cluster):
    """down_proj's prologue shared by a thread-block cluster (gemv_a8_cluster.cuh NQ_DOWN_CLUSTER, the build's
    value, b1_build_defines on the 7B): its launch carries the cluster (C, 1, 1) over a grid of whole clusters;
    o_proj, the a8 image's down_proj and a split down_proj launch without one."""
    from nanoqwen_kernels.gemv_b1 import DOWN_CLUSTER

    assert DOWN_CLUSTER == 2
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", defines)
    g = GemvKernels(dims, load, "a8")
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "")
    d = dims
    for kind, k in (("h", d.hidden), ("i", d.intermediate)):
        g.gemv_int4(dev((d.hidden, k // 8), np.uint32), dev((d.hidden, k // 128), np.float16),
                    dev((k,), np.float16), dev((d.hidden,), np.float16))
        fn, grid, _ = launches[-1]
        want = cluster if kind == "i" else 1
        assert launches.clusters[-1] == ((want, 1, 1) if want > 1 else None), (kind, launches.clusters[-1])
        assert grid % want == 0 and grid >= want
    g.gemv_int4(dev((d.hidden, d.intermediate // 8), np.uint32), dev((d.hidden, d.intermediate // 128), np.float16),
                dev((d.intermediate,), np.float16), dev((d.hidden,), np.float16), x_a8_image=True)
    assert launches[-1][0] == "nq_gemv_int4_i_a8x" and launches.clusters[-1] is None


@pytest.mark.parametrize("dims, defines, short, want", [
    (QWEN25_7B, "", False, {"qkv": 1, "h": 1, "gu": 1}),  # the default build shares none (gemv_b1.B1_CLUSTER_DEFINES)
    (QWEN25_7B, "", True, {"qkv": 2, "h": 1, "gu": 2}),  # the 7B's short-context build (gemv_b1.b1_short_defines)
    (QWEN25_7B, "NQ_QKV_CLUSTER=1,NQ_GU_CLUSTER=1", True, {"qkv": 1, "h": 1, "gu": 1}),  # the A/B's other side
    (QWEN25_7B, "NQ_QKV_CLUSTER=2,NQ_GU_CLUSTER=2", False, {"qkv": 2, "h": 1, "gu": 2}),
    (QWEN25_1_5B, "", False, {"qkv": 1, "h": 1, "gu": 1}),
    (QWEN25_1_5B, "", True, {"qkv": 1, "h": 1, "gu": 1}),  # a small grid: the short build is the default one
    (QWEN25_1_5B, "NQ_QKV_CLUSTER=2", False, {"qkv": 2, "h": 1, "gu": 1}),
    (QWEN25_7B, "NQ_QKV_CLUSTER=2,NQ_O_CLUSTER=4,NQ_GU_CLUSTER=8", False, {"qkv": 2, "h": 4, "gu": 8}),
])
def test_int8_hidden_kinds_launch_in_clusters(launches, monkeypatch, dims, defines, short, want):
    """q/k/v, o_proj and gate/up with their prologue shared by a cluster (NQ_QKV_CLUSTER, NQ_O_CLUSTER,
    NQ_GU_CLUSTER; the 7B's short-context build sets the first and the last): each launch carries its kind's
    cluster over a grid of whole clusters; the a8 image's gate/up never does."""
    from nanoqwen_kernels.gemv_b1 import b1_short_defines

    assert bool(b1_short_defines(dims, 132)) == (dims is QWEN25_7B)
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", defines)
    g = GemvKernels(dims, load, "a8", short_context=short)
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "")
    d = dims
    H = d.hidden
    g.gemv_int4(dev((H, H // 8), np.uint32), dev((H, H // 128), np.float16), dev((H,), np.float16),
                dev((H,), np.float16))
    got = {"h": (launches[-1], launches.clusters[-1])}
    g.gate_up_silu(dev((2 * d.intermediate, H // 8), np.uint32), dev((2 * d.intermediate, H // 128), np.float16),
                   dev((H,), np.float16), dev((H,), np.float16), 1e-6, dev((d.intermediate,), np.float16))
    got["gu"] = (launches[-1], launches.clusters[-1])
    rows = d.qkv_rows
    kc = dev((1, 4, d.n_kv_heads, 16, 128), np.float16)
    g.qkv_rope_kv(dev((rows, H // 8), np.uint32), dev((rows, H // 128), np.float16), dev((rows,), np.float16),
                  dev((H,), np.float16), dev((H,), np.float16), 1e-6, dev((1,), np.int32), dev((4,), np.int32),
                  kc, dev((1, 4, d.n_kv_heads, 16, 128), np.float16), 0, dev((d.q_dim,), np.float16))
    got["qkv"] = (launches[-1], launches.clusters[-1])
    for kind, ((fn, grid, _), cluster) in got.items():
        c = want[kind]
        assert cluster == ((c, 1, 1) if c > 1 else None), (kind, fn, cluster)
        assert grid % c == 0 and grid >= c, (kind, grid)
    g.gate_up_silu(dev((2 * d.intermediate, H // 8), np.uint32), dev((2 * d.intermediate, H // 128), np.float16),
                   dev((H,), np.float16), dev((H,), np.float16), 1e-6, dev((d.intermediate,), np.float16),
                   a8_image=True)
    assert launches[-1][0] == "nq_gate_up_silu_a8x" and launches.clusters[-1] is None


def test_short_context_build_serves_one_sequence(launches):
    """The short-context build differs from the default one only in its B = 1 loop: it keeps no tile GEMM state
    and refuses a batch with one clear error (the decode step launches the default build for batches)."""
    d = QWEN25_7B
    g = GemvKernels(d, load, "a8", short_context=True)
    assert not g._tiles
    H = d.hidden
    w, s = dev((H, H // 8), np.uint32), dev((H, H // 128), np.float16)
    g.gemv_int4(w, s, dev((H,), np.float16), dev((H,), np.float16))
    assert launches[-1][0] == "nq_gemv_int4_h_a8"
    with pytest.raises(KernelError, match="short-context GEMV build runs one sequence"):
        g.gemv_int4(w, s, dev((2, H), np.float16), dev((2, H), np.float16))


@pytest.mark.parametrize("name", ["NQ_QKV_CLUSTER", "NQ_O_CLUSTER", "NQ_GU_CLUSTER"])
@pytest.mark.parametrize("value", ["3", "16", "0"])
def test_int8_hidden_cluster_sizes(launches, monkeypatch, name, value):
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", f"{name}={value}")
    with pytest.raises(KernelError, match=name):
        GemvKernels(QWEN25_7B, load, "a8")


@pytest.mark.parametrize("value", ["3", "16", "3,NQ_SPLIT_DOWN=2"])
def test_int8_down_proj_cluster_sizes(launches, monkeypatch, value):
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", f"NQ_DOWN_CLUSTER={value}")
    with pytest.raises(KernelError, match="NQ_DOWN_CLUSTER"):
        GemvKernels(QWEN25_7B, load, "a8")


@pytest.mark.parametrize("value", ["3", "16", "0"])
def test_int8_loop_split_must_divide_the_block(launches, monkeypatch, value):
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", f"NQ_SPLIT_DOWN={value}")
    with pytest.raises(KernelError, match="NQ_SPLIT_DOWN"):
        GemvKernels(QWEN25_7B, load, "a8")
