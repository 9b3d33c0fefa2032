"""Where a decode step's time goes: each kernel family of the batched decode step timed on its own, against
its byte floor, beside the whole step (the per-token breakdown; --batch B for a step of B sequences).

Each family (e.g. the 28 fused q/k/v launches of one token, each layer with its own weights) is captured
into a CUDA graph of its own and replayed many times between CUDA events, so a family's time includes
the gaps between graph nodes, as in the real step. The whole step (the graph the engine replays per
step) is timed the same way. Floors: the bytes a family must read (its weights and scales once per
step, whatever B; the KV bytes of every sequence at the context) over the measured copy bandwidth.

    python3 scripts/decode_breakdown.py MODEL.nanoqwen [--context 640] [--batch 1] [--json out.json]

--timeline N (kernels built with NANOQWEN_KERNEL_DEFINES=NQ_STAMPS=1): then N replays of the whole step with
every block stamping itself (nanoqwen_kernels.stamps), and per kind of launch (the median over layers and
replays) how long it holds the GPU inside the step, how early its blocks are placed, how long they wait in
pdl_wait and what follows the hand-off: what the per-family graphs above cannot show.

Needs a GPU (CuPy). Run by scripts/gpu_all.sh (section `breakdown`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

COPY_BW = 4.19e12  # B/s, device-to-device copy measured on the H200 (docs/PERF.md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=640, help="tokens in the KV cache (512 prompt + 128)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=1, help="sequences in the step, each at --context tokens")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline", type=int, default=0, help="replays of the stamped step (needs NQ_STAMPS=1)")
    args = ap.parse_args()
    B = args.batch

    import cupy as cp
    from nanoqwen_engine import Engine
    from nanoqwen_engine.kv_pages import pages_for
    from nanoqwen_engine.params import SamplingParams
    from nanoqwen_engine.sampler import SamplerState

    ctx = max(4096, args.context + 16)
    eng = Engine.load(args.model, device="cuda", max_context=ctx, kv_pages=B * pages_for(ctx) + 16,
                      progress=False)
    be = eng.backend
    dev, ks, w, cfg, step = be.dev, be.ks, be.w, be.config, be.step
    L = cfg.n_layers

    # B sequences of `context` tokens in the cache (K/V written by real prefills), each with a page for
    # the token the step decodes at position `context`; the step's rows 0..B-1 hold them.
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0.0).resolve({})
    seqs, toks = [], []
    for _ in range(B):
        seq = be.pool.new_sequence()
        ids = rng.integers(0, cfg.vocab, size=args.context).astype(np.int32)
        tok = be.prefill(seq, ids, SamplerState(greedy, cfg.vocab))
        be.pool.grow(seq, args.context + 1)
        seqs.append(seq)
        toks.append(tok)
    bucket = be.rows.bucket(B)
    with dev.use():
        # rows 0..B-1: the tokens, POS = context, SEQ_LEN = context + 1, the page tables
        step.write_rows(list(range(B)), toks, [args.context] * B, [s.page_table for s in seqs], bucket)
    dev.synchronize()
    v = step.views(bucket)
    # the context range the engine's step takes at this length (decode.py context_span): which decode
    # attention launch the family and the whole step run
    span = step.context_span(args.context + 1)
    attend = step.attention_launcher(ks, span)
    # ... and the GEMV build of q/k/v and gate/up (the short-context build at batch 1 in the short range)
    qkv_rope_kv, gate_up_silu = step.gemv_launchers(ks, span, bucket)

    def nbytes(*arrays):
        return sum(int(a.nbytes) for a in arrays)

    kv_bytes = B * 2 * (args.context + 1) * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, fp16, one layer
    eps = cfg.rms_eps
    # the launches the step makes (decode.py launch_layer): with int8 activations at B = 1 where the kernels
    # choose the image pair (the 1.5B), gate/up writes down_proj's input as an a8 image and down_proj reads it
    # as such (before 2026-12-02 this script always timed the plain pair, which the 7B runs since then)
    image = B == 1 and getattr(ks, "gemv_variant", None) == "a8" and getattr(ks, "a8_image_pair", True)
    fams = {
        "qkv_rope_kv": (
            lambda i: qkv_rope_kv(w.layers[i].qkv.qweight, w.layers[i].qkv.scales, w.layers[i].qkv_bias, v.x,
                                  w.layers[i].in_norm, eps, v.pos, v.table, step.k_cache, step.v_cache, i, v.q,
                                  settled=True),
            lambda i: w.layers[i].qkv.nbytes + nbytes(w.layers[i].qkv_bias),
        ),
        "attention_decode": (
            lambda i: attend(v.q, step.k_cache, step.v_cache, v.table, v.seq_len, i, v.attn, step.attn_ws),
            lambda i: kv_bytes,
        ),
        "o_proj+residual": (
            lambda i: ks.gemv_int4(w.layers[i].o.qweight, w.layers[i].o.scales, v.attn, v.y, residual=v.x),
            lambda i: w.layers[i].o.nbytes,
        ),
        "gate_up_silu": (
            lambda i: gate_up_silu(w.layers[i].gate_up.qweight, w.layers[i].gate_up.scales, v.y,
                                   w.layers[i].post_norm, eps, v.act, a8_image=image),
            lambda i: w.layers[i].gate_up.nbytes,
        ),
        "down+residual": (
            lambda i: ks.gemv_int4(w.layers[i].down.qweight, w.layers[i].down.scales, v.act, v.x, residual=v.y,
                                   x_a8_image=image),
            lambda i: w.layers[i].down.nbytes,
        ),
    }
    head = {
        # the bytes the head's launch reads: the int8 head (q + scales) at B = 1 when loaded so, else fp16
        "final_norm+lm_head": (lambda: step.launch_head(ks, v.x, v.xn, v.logits), nbytes(
            *((w.lm_head_i8.q, w.lm_head_i8.s) if w.lm_head_i8 is not None and B == 1 else (w.lm_head,)),
            w.final_norm)),
        "embed+argmax": (
            lambda: (ks.embed(w.embed, v.tokens, v.x), step.sampler.launch(ks, "greedy", v.logits, v.tokens, 0,
                                                                           bucket)),
            B * cfg.hidden * 2,
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
    # per step, minus one tiny kernel.
    def body():
        ks.embed(w.embed, v.tokens, v.x)
        for i in range(L):
            step.launch_layer(ks, i, v, span)
        step.launch_head(ks, v.x, v.xn, v.logits)
        step.sampler.launch(ks, "greedy", v.logits, v.tokens, 0, bucket)

    t_step = time_graph(body, args.reps)
    total_b = sum(r[3] for r in rows)
    gpu = dev.name
    print(f"decode step breakdown, {gpu}, batch {B}, context {args.context} (range {span or 'short'}), "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'family':22s} {'launches':>8s} {'us/step':>9s} {'us/launch':>9s} {'MB':>8s} {'floor us':>9s} "
          f"{'% of bw':>7s}")
    recs = []
    for name, n, t, b in rows:
        floor = b / COPY_BW
        print(f"{name:22s} {n:8d} {t * 1e6:9.1f} {t * 1e6 / n:9.2f} {b / 1e6:8.1f} {floor * 1e6:9.1f} "
              f"{100 * floor / t:6.1f}%")
        recs.append({"family": name, "launches": n, "us_per_step": t * 1e6, "bytes": b,
                     "floor_us": floor * 1e6})
    s = sum(r[2] for r in rows)
    print(f"{'sum of families':22s} {sum(r[1] for r in rows):8d} {s * 1e6:9.1f} {'':9s} {total_b / 1e6:8.1f} "
          f"{total_b / COPY_BW * 1e6:9.1f} {100 * total_b / COPY_BW / s:6.1f}%")
    print(f"{'whole step (one graph)':22s} {'':8s} {t_step * 1e6:9.1f} {'':9s} {'':8s} {'':9s} "
          f"{100 * total_b / COPY_BW / t_step:6.1f}%")
    print(f"launcher calls per token: {be.info.get('launcher_calls_per_token')}, "
          f"graph kernel nodes: {be.info.get('graph_kernel_nodes_greedy')}")
    timeline = step_timeline(dev, body, L, args.timeline) if args.timeline else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu_name": gpu, "batch": B, "context": args.context, "families": recs, "sum_us": s * 1e6,
                       "a8_image_pair": image, "context_span": span or "short", "step_us": t_step * 1e6, "bytes_per_step": total_b, "timeline": timeline,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    for seq in seqs:
        be.pool.free(seq)
    return 0


LAYER_LAUNCHES = ("qkv_rope_kv", "attention_decode", "o_proj+residual", "gate_up_silu", "down+residual")


def step_timeline(dev, body, n_layers: int, replays: int) -> list[dict]:
    """The stamped step (nanoqwen_kernels.stamps): per kind of launch, medians over layers and replays."""
    import cupy as cp
    from nanoqwen_kernels import stamps

    with dev.use():
        g = dev.capture(body)
        buf = stamps.arm(1 << 20)
        runs = []
        for _ in range(replays + 1):  # the first replay warms up
            stamps.reset(buf)
            cp.cuda.Device().synchronize()
            dev.replay(g)
            cp.cuda.Device().synchronize()
            runs.append(stamps.launches(*stamps.read(buf)))
        stamps.disarm()
    runs = runs[1:]
    n = len(runs[0])
    rest = n - 1 - len(LAYER_LAUNCHES) * n_layers
    if rest < 0:
        raise SystemExit(f"the stamped step has {n} launches, fewer than embed + {n_layers} layers")
    names = ["embed"] + list(LAYER_LAUNCHES) * n_layers + [f"head/sampler {j}" for j in range(rest)]
    per_position = stamps.step_table(runs, names)
    keys = ("span_us", "placed_us", "waited_us", "after_us", "tail_us")
    out = []
    print(f"\nstep timeline ({replays} replays, stamped build; medians over layers and replays, us):")
    print(f"{'launch':22s} {'blocks':>6s} {'span':>7s} {'placed':>7s} {'waited':>7s} {'after':>7s} {'tail':>7s} "
          f"{'x step':>7s}")
    for name in dict.fromkeys(names + ["step"]):
        rows = [r for r in per_position if r["name"] == name]
        agg = {k: float(np.nanmedian([r[k] for r in rows])) if any(r[k] == r[k] for r in rows) else float("nan")
               for k in keys}
        agg.update(name=name, count=len(rows), blocks=rows[0]["blocks"])
        out.append(agg)
        print(f"{name:22s} {agg['blocks']:6d} " + " ".join(f"{agg[k]:7.2f}" for k in keys) + f" {len(rows):7d}")
    return out


if __name__ == "__main__":
    sys.exit(main())
