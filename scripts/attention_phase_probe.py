"""Where a decode-attention block's time goes: the phases of nq_attention_decode, stamped on the device.

    PYTHONPATH=packages/nanoqwen-kernels/src python scripts/attention_phase_probe.py [--ctx 640,32768] [--dims 7b,1.5b]

A diagnostic, not a benchmark. It builds the kernel with NQ_ATTN_PHASES=1 (attention_decode.cu: thread 0 or
consumer 0's lane 0 of every block writes the SM's clock64 at each phase into the module's nq_attn_phases),
replays a CUDA graph of calls over layers larger than twice the L2 (bench_attention.py's method, so each call
follows another as in the step), and reads the last call's records. Per phase, over the blocks that hold
pages: the median and the latest time since the block's start (us, at the device's clock rate), and the call
time of the stamped build. $NANOQWEN_KERNEL_DEFINES adds defines (the phases build is always one of them), so
run each variant in its own process. A timing is a measurement, never an assertion.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["NANOQWEN_KERNEL_DEFINES"] = ",".join(
    x for x in (os.environ.get("NANOQWEN_KERNEL_DEFINES", ""), "NQ_ATTN_PHASES=1") if x
)

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from nanoqwen_kernels.attention import AttentionKernels  # noqa: E402
from nanoqwen_kernels.dims import PRESETS  # noqa: E402
from nanoqwen_kernels.loader import load_module  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/nanoqwen-kernels/bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_split_probe import one_sequence  # noqa: E402
from bench_attention import time_graph  # noqa: E402

PHASES = {1: "producer waited", 2: "last copy issued", 3: "consumer 0 waited", 4: "consumer 0 done",
          5: "roles done", 8: "fold's cluster wait passed", 9: "pushes issued", 6: "fold inputs in", 7: "end"}
WORDS = 16  # per block: attention_decode.cu NQ_PHASE's record


def phase_buffer(module) -> int:
    addr = module.global_address("nq_attn_phases")
    if addr is None:
        raise SystemExit("the module has no nq_attn_phases (not the NQ_ATTN_PHASES=1 build)")
    return addr


def probe(name: str, ctx: int) -> None:
    d = PRESETS[name]
    modules = []

    def load(sources, defines):
        modules.append(load_module(sources, defines))
        return modules[-1]

    ak = AttentionKernels(d, load)
    one = one_sequence(d, ctx)
    k, v, table, seq, q, n_layers = one["k"], one["v"], one["table"], one["seq"], one["q"], one["n_layers"]
    out = cp.full((1, d.n_heads * 128), np.nan, cp.float16)
    ws = ak.new_workspace(1)
    t = time_graph(lambda i: ak.attention_decode(q, k, v, table, seq, i % n_layers, out, ws), 4 * n_layers)
    addr = phase_buffer(modules[0])
    c, n = ak.clusters(1)
    blocks = d.n_kv_heads * c * n
    host = np.zeros(1024 * WORDS, np.uint64)
    cp.cuda.runtime.memcpy(addr, host.ctypes.data, host.nbytes, cp.cuda.runtime.memcpyHostToDevice)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # one more call alone after a call, as in the graph: its records are the ones read
        ak.attention_decode(q, k, v, table, seq, 0, out, ws)
        ak.attention_decode(q, k, v, table, seq, 1, out, ws)
    stream.synchronize()
    cp.cuda.runtime.memcpy(host.ctypes.data, addr, host.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
    rec = host.reshape(1024, WORDS)[:blocks].astype(np.int64)
    active = rec[:, 3 + 5] != 0
    mhz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] / 1e3
    start_ns = rec[active, 0] - rec[active, 0].min()
    print(f"\n{name} ctx {ctx}: grid C={c} n={n} ({blocks} blocks, {int(active.sum())} with pages), stamped call "
          f"{t * 1e6:.2f} us; block starts spread {start_ns.max() / 1e3:.2f} us")
    g = rec[active, 1] - rec[active, 0]
    cyc = rec[active, 3 + 7] - rec[active, 3]
    ok = g > 0
    if ok.any():  # the SM clock under load is below the rated one: convert at the measured rate
        mhz = float(np.median(cyc[ok] / g[ok]) * 1e3)
        print(f"  clock {mhz:.0f} MHz, measured against the global timer over start -> end")
    print("| phase | median us since start | latest |")
    print("| --- | --- | --- |")
    for i, label in PHASES.items():
        x = rec[active, 3 + i]
        have = x != 0
        dt = (x[have] - rec[active, 3][have]) / mhz
        if dt.size:
            print(f"| {i} {label} | {np.median(dt):.2f} | {dt.max():.2f} |")


def main() -> int:
    ctxs = [640, 1024, 16384, 32768]
    names = ["7b", "1.5b"]
    if "--ctx" in sys.argv:
        ctxs = [int(x) for x in sys.argv[sys.argv.index("--ctx") + 1].split(",")]
    if "--dims" in sys.argv:
        names = sys.argv[sys.argv.index("--dims") + 1].split(",")
    print(f"defines: {os.environ['NANOQWEN_KERNEL_DEFINES']}")
    for name in names:
        for ctx in ctxs:
            probe(name, ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
