"""Every kernel source compiles with NVRTC for sm_90a (no GPU needed) for the 7B, 1.5B and tiny dims, and
the SASS holds what the designs rely on."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import PRESETS, QWEN25_7B

SOURCES = sorted(p.name for p in loader.CUDA_DIR.glob("*.cu"))
DIMS = PRESETS


def _defines(source: str, dims):
    if source.startswith("attention_decode"):  # the decode attention build adds its split/stage constants
        from nanoqwen_kernels.attention import decode_defines

        return decode_defines(dims)
    return dims.defines()


@pytest.mark.parametrize("dims_name", sorted(DIMS))
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_sm90a(source, dims_name):
    cubin = loader.compile_cubin([source], _defines(source, DIMS[dims_name]), "sm_90a")
    assert cubin[:4] == b"\x7fELF" and loader._elf_size(cubin) == len(cubin)


@pytest.mark.parametrize("dims_name", sorted(DIMS))
def test_long_context_decode_attention_compiles(dims_name):
    """The decode attention build with clusters of up to 16 (the engine's long-context step)."""
    from nanoqwen_kernels.attention import LONG_CLUSTER_MAX, decode_defines

    defines = decode_defines(DIMS[dims_name], cluster_max=LONG_CLUSTER_MAX)
    assert defines["NQ_DECODE_CLUSTER_MAX"] == 16 and "NQ_DECODE_CLUSTER_MAX" not in decode_defines(DIMS[dims_name])
    cubin = loader.compile_cubin(["attention_decode.cu"], defines, "sm_90a")
    assert cubin[:4] == b"\x7fELF" and loader._elf_size(cubin) == len(cubin)


@pytest.mark.parametrize("dims_name", sorted(DIMS))
def test_short_context_decode_attention_compiles(dims_name):
    """The short-context launch's build (consumers taking pages two at a time, NQ_DECODE_PAIR) compiles, and
    to another program than the default build's (the define reaches the consumer loop)."""
    from nanoqwen_kernels.attention import decode_defines

    cubins = [loader.compile_cubin(["attention_decode.cu"], decode_defines(DIMS[dims_name], pair=p), "sm_90a")
              for p in (False, True)]
    assert all(c[:4] == b"\x7fELF" and loader._elf_size(c) == len(c) for c in cubins)
    assert cubins[0] != cubins[1]


def _tool(name: str) -> str:
    """cuobjdump/nvdisasm from the NVIDIA wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) or PATH."""
    site = Path(loader.__file__).resolve().parents[1]
    roots = [Path(p) for p in sys.path if p] + [site, Path(sys.prefix)]
    for root in roots:
        for cand in sorted((root / "nvidia").glob(f"*/bin/{name}")) if (root / "nvidia").is_dir() else []:
            return str(cand)
    found = shutil.which(name)
    if not found:
        pytest.fail(
            f"{name} not found: install nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (the kernels "
            "nox session's SASS check needs both)"
        )
    return found


def _sass(source: str, dims) -> str:
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    cubin = loader.compile_cubin([source], _defines(source, dims), "sm_90a")
    path = Path(os.environ["NANOQWEN_KERNEL_CACHE"]) / f"sass-{source}-{dims.hidden}.cubin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cubin)
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(
        [cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _functions(sass: str) -> dict[str, str]:
    parts = sass.split("Function : ")[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


GEMV_KINDS = ("nq_gemv_int4_h", "nq_gemv_int4_i", "nq_qkv_rope_kv", "nq_gate_up_silu")


@pytest.mark.parametrize("dims_name", ["7b", "1.5b"])
def test_gemv_int4_sass(dims_name):
    """Every INT4 GEMV entry: the half2 loop (B = 1), the tensor-core builds for 8 and 32 columns, and the
    tile GEMM for 8, 16, 32 and 64 columns with its input RMSNorms (plain, and into the tile's x layout)."""
    funcs = _functions(_sass("gemv_int4.cu", DIMS[dims_name]))
    tiles = {f"{k}_tile{c}" for k in GEMV_KINDS for c in (8, 16, 32, 64)}
    gemvs = {f"{k}{suffix}" for k in GEMV_KINDS for suffix in ("", "_mma8", "_mma32")}
    a8 = {f"{k}_a8" for k in GEMV_KINDS} | {"nq_gate_up_silu_a8x", "nq_gemv_int4_i_a8x"}
    helpers = {"nq_norm_cols_h", "nq_norm_cols_i", "nq_norm_cols_wg_h"}
    assert set(funcs) == gemvs | helpers | tiles | a8
    for name in a8:
        body = funcs[name]
        # the int8-activation loop: byte products by dp4a (IDP), weights by 16-byte no-allocate loads, x
        # rounded to int8 by an add of 1.5 * 2^23 (no F2I conversion in the staging)
        # (>= 32: a unit's 2 rows x 2 pieces x 8 dp4a at the 1.5B's K = 1536, where one loop body with the
        # next unit prefetched serves every unit; the 7B's builds hold two copies of a longer body)
        assert body.count("IDP.4A") >= 32, f"{name}: expected the dp4a dot product"
        assert "LDG.E.NA" in body and ".128" in body, f"{name}: expected 16-byte no-allocate weight loads"
        if not name.startswith("nq_qkv_rope_kv"):  # (its RoPE epilogue's sincosf converts)
            assert "F2I" not in body, f"{name}: a conversion instruction in the rounding"
            assert "STL" not in body and "LDL" not in body, f"{name}: local-memory spill"
    for name in tiles:
        body = funcs[name]
        cols = int(name.rsplit("_tile", 1)[1])
        # the warp-specialized ring (gemm_tiles.cuh): weights, scales and x reach
        # shared memory by cp.async (weights with the L2::256B hint) whose completion arrives on the stage's
        # mbarrier, consumers wait on it; the products are warpgroup MMAs m64 x cols x 16 with A from the
        # prmt-unpacked words
        assert "LDGSTS.E.BYPASS.LTC256B.128" in body, f"{name}: expected cp.async weight copies with L2::256B"
        assert "ARRIVES.LDGSTSBAR" in body and "SYNCS.PHASECHK" in body, f"{name}: expected the mbarrier ring"
        assert f"HGMMA.64x{cols}x16.F32" in body and body.count("PRMT") >= 16, f"{name}: expected the wgmma core"
        # ptxas did not serialize the wgmmas (a wait after each: it does when A registers run short)
        assert body.count("WARPGROUP.DEPBAR") <= 4, f"{name}: serialized wgmmas"
        # no spills (the q/k/v entries keep sincosf's local array, see below)
        if not name.startswith("nq_qkv_rope_kv"):
            spills = body.count("STL ") + body.count("LDL ")
            assert spills == 0, f"{name}: local-memory spill ({spills} instructions)"
    for name in helpers:
        assert "STL" not in funcs[name] and "LDL" not in funcs[name], f"{name}: local-memory spill"
    for name, body in ((n, funcs[n]) for n in gemvs):
        # the ValueShuffle unpack is byte permutes, not shift-and-mask per nibble
        assert body.count("PRMT") >= 16, f"{name}: expected the prmt unpack"
        # weights: 16-byte non-coherent loads that do not allocate in L1
        assert "LDG.E.NA" in body and ".128" in body, f"{name}: expected 16-byte no-allocate weight loads"
        if "_mma" in name:
            assert "HMMA.16816.F32" in body, f"{name}: expected the tensor-core dot product"
            assert "LDGSTS" in body, f"{name}: expected cp.async staging of x"
        # no register spills. The q/k/v entries are exempt: sincosf's slow-path argument reduction keeps a
        # small local array (cuobjdump -res-usage: STACK 32); it runs only for |angle| > ~1e5 rad
        # (beyond pos 32k * inv_freq 1.0) and only in the epilogue, never in the K loop
        if not name.startswith("nq_qkv_rope_kv"):
            assert "STL" not in body and "LDL" not in body, f"{name}: local-memory spill"


def test_gemv_fp16_sass():
    funcs = _functions(_sass("gemv_fp16.cu", QWEN25_7B))
    assert set(funcs) == {"nq_gemv_fp16", "nq_gemv_fp16_mma8", "nq_gemv_fp16_mma32"}
    for name, body in funcs.items():
        assert "LDG.E.NA" in body and ".128" in body, f"{name}: expected 16-byte no-allocate loads"
        assert "STL" not in body and "LDL" not in body, f"{name}: local-memory spill"
        if "_mma" in name:
            assert "HMMA.16816.F32" in body, f"{name}: expected the tensor-core dot product"


def test_head_i8_sass():
    """The int8 lm_head: 16-byte no-allocate weight loads, bytes turned into floats by byte permutes (no
    I2F, an eighth of the FFMA rate), no spill, and its first unit's weights issued before the wait."""
    funcs = _functions(_sass("head_i8.cu", QWEN25_7B))
    assert set(funcs) == {"nq_gemv_head_i8", "nq_quantize_head_i8", "nq_dequantize_head_i8"}
    body = funcs["nq_gemv_head_i8"]
    assert "LDG.E.NA" in body and ".128" in body
    per_lane = QWEN25_7B.hidden // 16 // 32  # 16-byte pieces of a row per lane
    assert "I2F" not in body and body.count("PRMT") >= 2 * 16 * per_lane  # a permute per weight of 2 rows
    assert "STL" not in body and "LDL" not in body
    wait = body.find("ACQBULK")
    assert len([ln for ln in body[:wait].splitlines() if "LDG.E.NA" in ln]) == 2 * per_lane


def test_every_kernel_entry_is_named_nq():
    """Kernel entries carry the nq_ prefix, so a profiler's kernel list finds the code."""

    entry = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+?)(?:##\w+)*\(')
    found = 0
    for path in sorted(loader.CUDA_DIR.glob("*.cu")):
        for name in entry.findall(path.read_text()):
            found += 1
            assert name.startswith("nq_"), f"{path.name}: kernel {name} lacks the nq_ prefix"
    assert found >= 12


# global-memory instructions (loads, stores, cp.async, atomics, bulk copies)
_GLOBAL_MEM = re.compile(r"\b(LDG|STG|LDGSTS|ATOMG|ATOM|RED|REDG|ST|LD|UBLKCP|UTMALDG|UTMASTG)\b")


# the B = 1 entries (the half2 loop, and the int8-activation loop "_a8") that load their first weights
# before the wait
_PRELOADING_GEMV = {f"{k}{s}" for k in ("nq_gemv_int4_h", "nq_gemv_int4_i", "nq_qkv_rope_kv", "nq_gate_up_silu")
                    for s in ("", "_a8")} | {"nq_gate_up_silu_a8x", "nq_gemv_int4_i_a8x"}
_PRELOADING = _PRELOADING_GEMV | {"nq_gemv_head_i8"}  # + the int8 lm_head's loop (head_i8.cu)
# a load of weights (16-byte, no L1 allocation) or of scales (fp16, read-only): what may go before the wait
_WEIGHT_LOAD = re.compile(r"\bLDG\.E\.(NA\.[A-Z0-9.]*128|U16\.CONSTANT)\b")
# a 32-bit load of control data (q/k/v's settled position and page id)
_CONTROL_LOAD = re.compile(r"\bLDG\.E(\.CONSTANT)? ")


def _check_waits(funcs: dict[str, str]) -> None:
    assert funcs
    for name, body in funcs.items():
        wait = body.find("ACQBULK")
        assert wait >= 0, f"{name}: no griddepcontrol.wait"
        early = _GLOBAL_MEM.findall(body[:wait])
        if name == "nq_attention_decode":
            # early pages (attention_decode.cu NQ_ATTN_EARLY_PAGES, the default): the settled pages are
            # copied before the producer's wait; its own check (_check_attention_early_pages) says what else
            _check_attention_early_pages(body)
            continue
        if "_tile" in name:
            # the tile GEMM's producer warps issue the cp.async copies of the first stage's weights before
            # the wait (gemm_tiles.cuh): weights are never written during a step. Only those: no plain load,
            # store or atomic (x, the outputs, the tickets) before it
            early = [op for op in early if op != "LDGSTS"]
        if name in _PRELOADING:
            # the B = 1 loops load a warp's first chunk of weights and scales before the wait (gemv_units.cuh,
            # NQ_GEMV_PRELOAD): weight and scale loads only, at most 4 pieces + 4 scales of each of the 2
            # rows. Checked by kind, not only counted: a build of a fused kernel (docs/PERF.md, seventeenth
            # lease) had ptxas schedule its x loads, non-coherent ones of a const __restrict__ argument, above
            # griddepcontrol.wait; the wait's memory clobber does not hold those back
            lines = [ln for ln in body[:wait].splitlines() if re.search(r"\bLDG\b", ln)]
            # + the first unit's settled epilogue inputs (gemv_epilogues.cuh QkvEpi, gemv_units.cuh EpiPre): q/k/v's
            # position and page id (two 32-bit loads; its bias, 2 x fp16, is a weight load)
            ctl = [ln for ln in lines if not _WEIGHT_LOAD.search(ln)]
            if name.startswith("nq_qkv_rope_kv"):
                assert len(ctl) <= 2 and all(_CONTROL_LOAD.search(ln) for ln in ctl), f"{name}: {ctl}"
            else:
                assert not ctl, f"{name}: {ctl}"
            lines = [ln for ln in lines if ln not in ctl]
            # + the norm's weights of the int8 prologue (gemv_a8.cuh NQ_NORM_EARLY: <= 2 pieces a thread)
            assert len(lines) <= 16 + 2 + 2, f"{name}: {len(lines)} loads before the wait"
            for ln in lines:
                assert _WEIGHT_LOAD.search(ln), f"{name}: a load before the wait that is not weights: {ln.strip()}"
            early = [op for op in early if op != "LDG"]
        assert not early, f"{name}: global memory access before griddepcontrol.wait: {early[:4]}"


def test_only_the_int8_loop_releases_the_next_kernel_early():
    """The B = 1 int8-activation entries let the next kernel launch early (griddepcontrol.launch_dependents
    = PREEXIT; gemv_units.cuh gemv_trigger_mode): gate/up at its entry, before its wait (ACQBULK), the others
    right after it; the half2 entries leave it to their blocks' exits. On the H200 the after-the-wait
    trigger won on the int8 loop and lost on the 1.5B's half2 loop (docs/PERF.md, twenty-first lease)."""
    funcs = _functions(_sass("gemv_int4.cu", QWEN25_7B))
    int8 = sorted(n for n in _PRELOADING_GEMV if n.endswith(("_a8", "_a8x")))
    half2 = sorted(n for n in _PRELOADING_GEMV if n not in int8)
    assert len(int8) == 6 and len(half2) == 4
    for name in int8:
        body = funcs[name]
        assert body.count("PREEXIT") == 1, f"{name}: expected one griddepcontrol.launch_dependents"
        before_wait = body.index("PREEXIT") < body.index("ACQBULK")
        assert before_wait == name.startswith("nq_gate_up_silu"), \
            f"{name}: the trigger is {'before' if before_wait else 'after'} the wait"
    for name in half2:
        assert "PREEXIT" not in funcs[name], f"{name}: the half2 loop must not release its successor early"


@pytest.mark.parametrize("dims_name", ["7b", "1.5b", "tiny"])
def test_int8_loop_split_units_meet_at_a_named_barrier(monkeypatch, dims_name):
    """A split build of the int8 loop (gemv_units.cuh gemv_split, NQ_SPLIT_DOWN): down_proj's warps of a unit
    meet at a named barrier of 32 x split threads (bar.sync id, count: never the block's barrier 0, so the
    block's other units run on); the other entries, never split, hold none."""
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_SPLIT_DOWN=2")
    funcs = _functions(_sass("gemv_int4.cu", DIMS[dims_name]))
    splits = {"nq_gemv_int4_i_a8": 2, "nq_gemv_int4_i_a8x": 2, "nq_gemv_int4_h_a8": 1, "nq_qkv_rope_kv_a8": 1,
              "nq_gate_up_silu_a8": 1, "nq_gate_up_silu_a8x": 1, "nq_gemv_int4_h": 1}
    for name, split in splits.items():
        named = set(re.findall(r"BAR\.SYNC(?:\.DEFER_BLOCKING)? R\d+, (0x[0-9a-f]+)", funcs[name]))
        assert named == ({hex(32 * split)} if split > 1 else set()), f"{name}: named barriers {named}"


@pytest.mark.parametrize("dims_name", ["7b", "tiny"])
def test_int8_down_proj_prologue_shared_by_a_cluster(monkeypatch, dims_name):
    """down_proj's prologue shared by a thread-block cluster (gemv_a8_cluster.cuh, NQ_DOWN_CLUSTER; the 7B's
    build, gemv_b1.b1_build_defines): the block arms its receive mbarrier and arrives at the cluster barrier
    before griddepcontrol.wait, reads nothing but weights there, pushes its share of the rounded x with
    st.async (no fence and no second cluster barrier: each block waits on its own mbarrier) and spills
    nothing; no other entry holds a cluster instruction."""
    from nanoqwen_kernels.gemv_b1 import DOWN_CLUSTER, b1_build_defines

    assert b1_build_defines(QWEN25_7B, 132)["NQ_DOWN_CLUSTER"] == DOWN_CLUSTER > 1
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_SPLIT_DOWN=1,NQ_DOWN_CLUSTER=2")
    funcs = _functions(_sass("gemv_int4.cu", DIMS[dims_name]))
    body = funcs["nq_gemv_int4_i_a8"]
    wait = body.find("ACQBULK")
    assert 0 <= body.find("SYNCS.ARRIVE") < wait and 0 <= body.find("UCGABAR_ARV") < wait
    assert body.count("UCGABAR_ARV") == 1 and "MEMBAR" not in body
    assert "STAS" in body and "SYNCS.PHASECHK" in body
    assert "STL" not in body and "LDL" not in body
    _check_waits({"nq_gemv_int4_i_a8": body})
    for name in ("nq_gemv_int4_h_a8", "nq_gemv_int4_i_a8x"):  # (q/k/v's and gate/up's: their own test below)
        assert "UCGABAR" not in funcs[name] and "STAS" not in funcs[name], name


@pytest.mark.parametrize("dims_name", ["7b", "tiny"])
def test_int8_hidden_prologues_shared_by_a_cluster(monkeypatch, dims_name):
    """q/k/v's, o_proj's and gate/up's prologue shared by a cluster (gemv_a8_cluster.cuh
    stage_x_a8_cluster_norm: NQ_QKV_CLUSTER, NQ_O_CLUSTER, NQ_GU_CLUSTER): as down_proj's, each entry arms its
    receive mbarrier and arrives at the cluster barrier once, before griddepcontrol.wait, reads nothing but
    weights (and q/k/v's settled inputs) there, pushes with st.async, needs no fence and spills nothing.
    The default builds share none of them (gemv_b1.B1_CLUSTER_DEFINES says why; the 7B's short-context build shares
    q/k/v's and gate/up's, gemv_b1.b1_short_defines)."""
    from nanoqwen_kernels.gemv_b1 import b1_build_defines

    build = b1_build_defines(QWEN25_7B, 132)
    small = b1_build_defines(DIMS["1.5b"], 132)
    for name in ("NQ_QKV_CLUSTER", "NQ_O_CLUSTER", "NQ_GU_CLUSTER"):
        assert name not in build and name not in small
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_QKV_CLUSTER=2,NQ_O_CLUSTER=2,NQ_GU_CLUSTER=2")
    funcs = _functions(_sass("gemv_int4.cu", DIMS[dims_name]))
    names = ("nq_gemv_int4_h_a8", "nq_qkv_rope_kv_a8", "nq_gate_up_silu_a8")
    for name in names:
        body = funcs[name]
        wait = body.find("ACQBULK")
        assert 0 <= body.find("SYNCS.ARRIVE") < wait and 0 <= body.find("UCGABAR_ARV") < wait, name
        assert body.count("UCGABAR_ARV") == 1 and "MEMBAR" not in body, name
        assert "STAS" in body and "SYNCS.PHASECHK" in body, name
        if name != "nq_qkv_rope_kv_a8":  # q/k/v's precise sincosf keeps its large-angle path's array in local
            assert "STL" not in body and "LDL" not in body, name  # memory in every build: not a spill
    _check_waits({name: funcs[name] for name in names})
    for name in ("nq_gemv_int4_h", "nq_qkv_rope_kv", "nq_gate_up_silu", "nq_gate_up_silu_a8x"):
        assert "UCGABAR" not in funcs[name] and "STAS" not in funcs[name], name


def _attention_early_ops(body: str) -> list[str]:
    return [m.group(0) for m in re.finditer(r"\bACQBULK\b|\bUBLKCP\b|\bLDG\.E\.128\b|\bSTG\b", body)]


def _check_attention_early_pages(body: str) -> None:
    """Decode attention with early pages (NQ_ATTN_EARLY_PAGES=1, the default) waits per role: the producer
    copies the settled pages (UBLKCP) before its wait and the rest after; the consumers load q (16-byte
    loads) only after theirs; nothing is stored before the first wait."""
    seq = _attention_early_ops(body)
    first_wait = seq.index("ACQBULK")
    assert "STG" not in seq[:first_wait], "a store before the wait"
    waits = [i for i, op in enumerate(seq) if op == "ACQBULK"]
    assert len(waits) >= 3, "expected a wait per role (idle rows, consumers, producer)"
    copies = [i for i, op in enumerate(seq) if op == "UBLKCP"]
    assert any(i < waits[-1] for i in copies) and any(i > waits[-1] for i in copies), \
        "expected page copies both before the producer's wait and after it"
    q_loads = [i for i, op in enumerate(seq) if op == "LDG.E.128"]
    assert q_loads and all(any(w < i for w in waits) for i in q_loads), "q loaded before any wait"
    # before the first wait: the length and page-table reads (plain 4-byte loads) and the page copies only
    early = _GLOBAL_MEM.findall(body[: body.find("ACQBULK")])
    assert set(early) <= {"LDG", "UBLKCP"}, f"unexpected global access before the wait: {sorted(set(early))}"


def test_attention_decode_copies_settled_pages_early(monkeypatch):
    """The default build copies the settled pages before its wait (_check_attention_early_pages, at every
    model's dims); NQ_ATTN_EARLY_PAGES=0 (the A/B knob's other side): one wait precedes every load and
    copy."""
    for dims in (QWEN25_7B, PRESETS["1.5b"], PRESETS["tiny"]):
        _check_attention_early_pages(_functions(_sass("attention_decode.cu", dims))["nq_attention_decode"])
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_ATTN_EARLY_PAGES=0")
    plain = _functions(_sass("attention_decode.cu", QWEN25_7B))["nq_attention_decode"]
    assert plain.count("ACQBULK") == 1
    assert not _GLOBAL_MEM.findall(plain[: plain.find("ACQBULK")])


# the cluster fold's SASS: barrier.cluster.arrive = UCGABAR_ARV (with .release: MEMBAR.ALL.GPU before it),
# barrier.cluster.wait = UCGABAR_WAIT (+ CCTL.IVALL, the acquire), ld/st.shared::cluster on a mapa address
# = LD.E / ST.E on a generic address (the kernel's own global accesses are LDG / STG), st.async = STAS (.64),
# mbarrier.init = SYNCS.EXCH.64, arrive(.expect_tx) = SYNCS.ARRIVE.TRANS64, try_wait = SYNCS.PHASECHK
_CLUSTER_OPS = re.compile(
    r"\b(UCGABAR_ARV|UCGABAR_WAIT|MEMBAR\.ALL\.GPU|LD\.E|ST\.E|STAS(?:\.64|\.128)?|SYNCS\.EXCH\.64|"
    r"SYNCS\.ARRIVE\.TRANS64|SYNCS\.PHASECHK)\b"
)


def _cluster_ops(body: str) -> list[str]:
    return [m.group(1) for m in _CLUSTER_OPS.finditer(body)]


def _full_arrives(ops: list[str]) -> list[int]:
    """Indices of the release arrivals (a full cluster barrier's half: UCGABAR_ARV right after the GPU-scope
    fence of .release)."""
    return [i for i, op in enumerate(ops) if op == "UCGABAR_ARV" and i and ops[i - 1] == "MEMBAR.ALL.GPU"]


def test_attention_decode_fold():
    """Decode attention's cluster fold pushes with st.async (attention_decode.cu): no full cluster barrier.
    Each block initialises and arms its receive mbarrier, then arrives (relaxed: no fence) before anything
    else and before the pdl wait; every remote store is a 16- or 8-byte st.async (STAS.128 / .64), issued
    after a cluster wait (every block has started, its mbarrier armed); after the last one the block waits on
    its own receive mbarrier; no DSMEM load or plain remote store (at the 7B, 1.5B and tiny dims)."""
    for dims in (QWEN25_7B, PRESETS["1.5b"], PRESETS["tiny"]):
        body = _functions(_sass("attention_decode.cu", dims))["nq_attention_decode"]
        _check_attention_early_pages(body)
        ops = _cluster_ops(body)
        assert not _full_arrives(ops), f"{dims.hidden}: a full cluster barrier in the fold"
        assert not {"LD.E", "ST.E"} & set(ops), f"{dims.hidden}: a DSMEM load or plain remote store"
        assert ops.count("UCGABAR_ARV") == 1, f"{dims.hidden}: expected the one relaxed arrival"
        arv = ops.index("UCGABAR_ARV")
        assert ops[:arv] == ["SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64"], (
            f"{dims.hidden}: the receive barrier is not initialised and armed before the arrival: {ops[:arv]}"
        )
        assert body.find("UCGABAR_ARV") < body.find("ACQBULK"), f"{dims.hidden}: arrival after the pdl wait"
        stores = [i for i, op in enumerate(ops) if op.startswith("STAS")]
        waits = [i for i, op in enumerate(ops) if op == "UCGABAR_WAIT"]
        assert {ops[i] for i in stores} == {"STAS.128", "STAS.64"}, f"{dims.hidden}: pushes not 16 / 8 bytes"
        assert all(any(w < i for w in waits) for i in stores), f"{dims.hidden}: an st.async before a wait"
        assert "SYNCS.PHASECHK" in ops[stores[-1] :], f"{dims.hidden}: no receive wait after the pushes"


@pytest.mark.parametrize("source", SOURCES)
def test_every_kernel_waits_for_its_predecessor_before_touching_memory(source):
    """Every kernel is launched with programmatic dependent launch (pdl.py), so its blocks may be placed
    before the previous kernel's writes are visible: each entry must wait (griddepcontrol.wait = ACQBULK)
    before any global load, store or atomic."""
    _check_waits(_functions(_sass(source, QWEN25_7B)))


def test_settled_epilogue_inputs_go_before_the_wait(monkeypatch):
    """The int8 loop's builds (gemv_b1.b1_build_defines: NQ_EPI_SETTLED=1) read q/k/v's first unit's position and
    page id before griddepcontrol.wait (two 32-bit loads; its bias is a weight load); the default build (0)
    reads neither there, and no other entry reads anything but weights there."""
    from nanoqwen_kernels.dims import QWEN25_1_5B
    from nanoqwen_kernels.gemv_b1 import b1_build_defines

    defines = b1_build_defines(QWEN25_1_5B, 132)
    assert defines["NQ_EPI_SETTLED"] == 1
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", ",".join(f"{k}={v}" for k, v in defines.items()))
    early = _functions(_sass("gemv_int4.cu", QWEN25_1_5B))
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "")
    late = _functions(_sass("gemv_int4.cu", QWEN25_1_5B))

    def before_wait(body: str) -> int:
        return len([ln for ln in body[: body.find("ACQBULK")].splitlines() if _CONTROL_LOAD.search(ln)])

    _check_waits({k: v for k, v in early.items() if k.endswith(("_a8", "_a8x"))})
    assert before_wait(early["nq_qkv_rope_kv_a8"]) == 2 and before_wait(late["nq_qkv_rope_kv_a8"]) == 0


def test_tile_entries_copy_x_as_laid_out(monkeypatch):
    """The tile GEMM's x copies (gemm_tiles.cuh): every tile entry compiles to the wgmma ring without spills
    or serialized wgmmas and waits before touching x. The q/k/v and gate/up entries read x laid out by
    nq_norm_cols_wg_h (NQ_TILE_X_PREPERM, default 1) in 16-byte chunks: with NQ_TILE_X_PREPERM=0 they get the
    4-byte copies back and lose the 16-byte ones. o_proj / down copy 4 bytes (issue_x) and are the same code
    either way."""
    funcs = _functions(_sass("gemv_int4.cu", QWEN25_7B))
    _check_waits(funcs)
    monkeypatch.setenv("NANOQWEN_KERNEL_DEFINES", "NQ_TILE_X_PREPERM=0")
    plain = _functions(_sass("gemv_int4.cu", QWEN25_7B))
    _check_waits(plain)
    four = re.compile(r"(@!?P\d+ )?LDGSTS\.E ")  # 4-byte copies: x (issue_x) and the scales
    sixteen = re.compile(r"(@!?P\d+ )?LDGSTS\.E\.BYPASS\.128 ")  # 16-byte copies without the L2 hint: x
    for c in (8, 16, 32, 64):
        for kind in GEMV_KINDS:
            name = f"{kind}_tile{c}"
            body = funcs[name]
            assert f"HGMMA.64x{c}x16.F32" in body and body.count("WARPGROUP.DEPBAR") <= 4, name
            if kind != "nq_qkv_rope_kv":
                assert "STL " not in body and "LDL " not in body, name
            if kind in ("nq_qkv_rope_kv", "nq_gate_up_silu"):
                assert len(four.findall(body)) < len(four.findall(plain[name])), f"{name}: 4-byte x copies left"
                assert sixteen.search(body) and not sixteen.search(plain[name]), f"{name}: no 16-byte x copies"
            else:
                assert body == plain[name], f"{name}: o_proj / down should not depend on NQ_TILE_X_PREPERM"
    assert "STL" not in funcs["nq_norm_cols_wg_h"] and "LDL" not in funcs["nq_norm_cols_wg_h"]
    assert "nq_norm_cols_wg_h" not in plain


def test_odd_group_count_build_releases_its_scale_stores():
    """Dims whose K has an odd number of 128-groups (test shapes: test_gemv_gpu.py's odd-group test) take
    the producers' plain scale path: every tile entry still builds, waits before touching memory, and
    adds a plain mbarrier arrival per step (it releases the plain stores; the cp.async arrival orders only
    the copies) to the preset builds' one."""
    from nanoqwen_kernels.dims import ModelDims

    odd = ModelDims(hidden=384, intermediate=640, n_heads=2, n_kv_heads=1, head_dim=128, vocab=1000,
                    n_layers=1, rope_theta=1e6)
    funcs = _functions(_sass("gemv_int4.cu", odd))
    even = _functions(_sass("gemv_int4.cu", PRESETS["tiny"]))
    _check_waits(funcs)
    for c in (8, 64):
        name = f"nq_gate_up_silu_tile{c}"
        arrivals = [len(re.findall(r"SYNCS\.ARRIVE\.TRANS64", f[name])) for f in (funcs, even)]
        assert "ARRIVES.LDGSTSBAR" in funcs[name] and arrivals[0] > arrivals[1], (name, arrivals)


def test_attention_prefill_wg_sass():
    """The wgmma build: per key tile 8 HGMMA 64x64 for S (B = K, K-major) and 4 HGMMA 64x128 with the
    transposed B (V read MN-major) for P V, no mma.sync and no ldmatrix (K and V never pass through
    registers), K/V copied with LDGSTS, nothing spilled."""
    funcs = _functions(_sass("attention_prefill.cu", QWEN25_7B))
    body = funcs["nq_attention_prefill_wg"]
    assert len(re.findall(r"HGMMA\.64x64x16\.F32 ", body)) == 8
    assert len(re.findall(r"HGMMA\.64x128x16\.F32 .*tnspB", body)) == 4
    assert "HMMA" not in body and "LDSM" not in body
    assert "LDGSTS" in body and "STL" not in body and "LDL" not in body


@pytest.mark.parametrize("width", [256, 128, 64])
def test_gemm_int4_prefill_sass(width):
    """The fused INT4 GEMM's build per tile width: 8 HGMMA m64 x width x 16 (a stage's 4, in each of the two
    fragment sets of the unrolled loop) of which only each stage's last one waits on the group's scoreboard
    (ptxas did not serialize the wgmmas: a wgmma waited after each one would be 8 gsb0), the consumers'
    wait leaving one stage in flight, setmaxnreg both ways, copies by LDGSTS, nothing spilled."""
    body = _functions(_sass("gemm_int4_prefill.cu", QWEN25_7B))[f"nq_gemm_int4_wg_n{width}"]
    hgmma = re.findall(rf"HGMMA\.64x{width}x16\.F32 [^;]*", body)
    assert len(hgmma) == 8
    assert sum("gsb0" in h for h in hgmma) == 2
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in body
    assert "USETMAXREG" in body or "SETMAXREG" in body
    assert "LDGSTS" in body and "STL" not in body and "LDL" not in body


@pytest.mark.parametrize("width", [128, 64])
def test_gemm_fp8_prefill_sass(width):
    """The FP8 GEMM per tile width, plain and SiLU builds: a stage's 4 e4m3 QGMMA m64 x width x 32, only the
    last one on the group's scoreboard (ptxas did not serialize them: it would wait after every one),
    setmaxnreg both ways, every copy on the TMA unit (tensor boxes and bulk copies), nothing spilled."""
    funcs = _functions(_sass("gemm_fp8_prefill.cu", QWEN25_7B))
    for name in (f"nq_gemm_fp8_wg_n{width}", f"nq_gemm_fp8_wg_silu_n{width}"):
        body = funcs[name]
        q = re.findall(rf"QGMMA\.64x{width}x32\.F32\.E4M3\.E4M3 [^;]*", body)
        assert len(q) == 4 and sum("gsb0" in h for h in q) == 1, name
        assert "USETMAXREG" in body or "SETMAXREG" in body
        assert "UTMALDG" in body and "UBLKCP" in body
        assert "STL" not in body and "LDL" not in body and "LDGSTS" not in body
