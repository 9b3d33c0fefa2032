"""Where a decode token's time goes: each kernel family of the decode step timed on its own, against its
byte floor, beside the whole step (issue 7's per-token breakdown).

Each family (e.g. the 28 fused q/k/v launches of one token, each layer with its own weights) is captured
into a CUDA graph of its own and replayed many times between CUDA events, so a family's time includes
the gaps between graph nodes, as in the real step. The whole step (the graph the engine replays per
token) is timed the same way. Floors: the bytes a family must read (its weights, scales, and the KV
bytes at the context) over the measured copy bandwidth.

    python3 scripts/decode_breakdown.py MODEL.nanoqwen [--context 640] [--json out.json]

Needs a GPU (CuPy). Run by scripts/gpu_all.sh (section `breakdown`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

COPY_BW = 4.19e12  # B/s, measured device-to-device copy on the H200 here (../shared/DESIGN.md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=640, help="tokens in the KV cache (512 prompt + 128)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp
    from nanoqwen_engine import Engine

    eng = Engine.load(args.model, device="cuda", max_context=max(4096, args.context + 16), progress=False)
    be = eng.backend
    dev, ks, w, cfg, step = be.dev, be.ks, be.w, be.config, be.step
    L = cfg.n_layers

    # A sequence of `context` tokens in the cache (K/V written by a real prefill), and a page for the
    # token the step decodes at position `context`.
    from nanoqwen_engine.params import SamplingParams
    from nanoqwen_engine.sampler import SamplerState

    seq = be.pool.new_sequence()
    ids = np.random.default_rng(0).integers(0, 150000, size=args.context).astype(np.int32)
    sampler = SamplerState(SamplingParams(temperature=0.0, max_tokens=1).resolve(eng.generation_config),
                           cfg.vocab)
    tok = be.prefill(seq, ids, sampler)
    be.pool.grow(seq, args.context + 1)
    with dev.use():
        step.sync_ctrl(seq, tok)  # ctrl: token, POS = context, SEQ_LEN = context + 1, the page table
    dev.synchronize()

    def nbytes(*names):
        return sum(int(w[n].nbytes) for n in names)

    kv_bytes = 2 * (args.context + 1) * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, fp16, one layer
    fams = {
        "qkv_rope_kv": (
            lambda i: ks.qkv_rope_kv(w[f"{i}.qkv.w"], w[f"{i}.qkv.s"], w[f"{i}.qkv.b"], step.x, w[f"{i}.ln1"],
                                     cfg.rms_eps, step.pos, step.page_table, step.k_cache, step.v_cache, i, step.q),
            lambda i: nbytes(f"{i}.qkv.w", f"{i}.qkv.s", f"{i}.qkv.b"),
        ),
        "attention_decode": (
            lambda i: ks.attention_decode(step.q, step.k_cache, step.v_cache, step.page_table, step.seq_len, i,
                                          step.attn, step.attn_ws),
            lambda i: kv_bytes,
        ),
        "o_proj+residual": (
            lambda i: ks.gemv_int4(w[f"{i}.o.w"], w[f"{i}.o.s"], step.attn, step.y, residual=step.x),
            lambda i: nbytes(f"{i}.o.w", f"{i}.o.s"),
        ),
        "gate_up_silu": (
            lambda i: ks.gate_up_silu(w[f"{i}.gu.w"], w[f"{i}.gu.s"], step.y, w[f"{i}.ln2"], cfg.rms_eps, step.act),
            lambda i: nbytes(f"{i}.gu.w", f"{i}.gu.s"),
        ),
        "down+residual": (
            lambda i: ks.gemv_int4(w[f"{i}.down.w"], w[f"{i}.down.s"], step.act, step.x, residual=step.y),
            lambda i: nbytes(f"{i}.down.w", f"{i}.down.s"),
        ),
    }
    head = {
        "final_norm+lm_head": (lambda: step.launch_head(ks, step.x), nbytes("lm_head", "norm")),
        "embed+argmax": (
            lambda: (ks.embed(w["embed"], step.token, step.x), step.sampler.launch(ks, "greedy", step.logits,
                                                                                  step.token)),
            cfg.hidden * 2,
        ),
    }

    def time_graph(launch, reps):
        with dev.use():
            launch()  # eager once: modules loaded before capture
            dev.synchronize()
            g = dev.capture(launch)
            dev.replay(g)
            dev.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(dev.stream)
            for _ in range(reps):
                dev.replay(g)
            e1.record(dev.stream)
            e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps  # seconds per replay

    rows = []
    for name, (launch, nb) in fams.items():
        t = time_graph(lambda launch=launch: [launch(i) for i in range(L)], args.reps)
        b = sum(nb(i) for i in range(L))
        rows.append((name, L, t, b))
    for name, (launch, b) in head.items():
        rows.append((name, 1, time_graph(launch, args.reps), b))

    # The whole step without `advance` (which would move POS on every replay): what the engine replays
    # per token, minus one tiny kernel.
    def body():
        ks.embed(w["embed"], step.token, step.x)
        for i in range(L):
            step.launch_layer(ks, i)
        step.launch_head(ks, step.x)
        step.sampler.launch(ks, "greedy", step.logits, step.token)

    t_step = time_graph(body, args.reps)
    total_b = sum(r[3] for r in rows)
    gpu = dev.name
    print(f"decode step breakdown, {gpu}, context {args.context}, {time.strftime('%Y-%m-%d')}")
    print(f"{'family':22s} {'launches':>8s} {'us/token':>9s} {'us/launch':>9s} {'MB':>8s} {'floor us':>9s} "
          f"{'% of bw':>7s}")
    recs = []
    for name, n, t, b in rows:
        floor = b / COPY_BW
        print(f"{name:22s} {n:8d} {t * 1e6:9.1f} {t * 1e6 / n:9.2f} {b / 1e6:8.1f} {floor * 1e6:9.1f} "
              f"{100 * floor / t:6.1f}%")
        recs.append({"family": name, "launches": n, "us_per_token": t * 1e6, "bytes": b,
                     "floor_us": floor * 1e6})
    s = sum(r[2] for r in rows)
    print(f"{'sum of families':22s} {sum(r[1] for r in rows):8d} {s * 1e6:9.1f} {'':9s} {total_b / 1e6:8.1f} "
          f"{total_b / COPY_BW * 1e6:9.1f} {100 * total_b / COPY_BW / s:6.1f}%")
    print(f"{'whole step (one graph)':22s} {'':8s} {t_step * 1e6:9.1f} {'':9s} {'':8s} {'':9s} "
          f"{100 * total_b / COPY_BW / t_step:6.1f}%")
    print(f"launcher calls per token: {be.info.get('launcher_calls_per_token')}, "
          f"graph kernel nodes: {be.info.get('graph_kernel_nodes_greedy')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu_name": gpu, "context": args.context, "families": recs, "sum_us": s * 1e6,
                       "step_us": t_step * 1e6, "bytes_per_token": total_b,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    be.pool.free(seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
