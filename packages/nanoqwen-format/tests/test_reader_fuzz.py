"""A time-bounded mutation fuzz of the reader over real small .nanoqwen files, each case run in a child
process (format_isolated: a deadline per case, an address-space limit), asserting that only
NanoqwenFormatError ever escapes open_model (plain and verify=True), the tensor reads, the dequantization
and inspect's text of an accepted file.

Cases are drawn from the test's seed (the `seed` fixture: printed on failure, `--seed` replays): case i of
a run is a function of (seed, i) alone. NANOQWEN_FUZZ_SECONDS sets the budget (default 30 s, on two
children in parallel); the run's case count is printed in pytest's summary.

Mutations: bytes of the fixed header, JSON, padding and data set or flipped; the file cut or extended
(also sparse, to gigabytes); the JSON length field set to edge values; JSON values replaced anywhere
(edge integers, huge and long shapes, NaN, long strings, deep nesting), keys deleted, integers nudged,
tensor entries swapped, the fields the engine reads set to wrong types; and text edits json.dumps cannot
make (duplicate keys, NaN/Infinity literals, NUL and invalid UTF-8 bytes). JSON edits are written either
in place (padded or overflowing into the data) or with the data section moved so the offsets stay right.
"""

import copy
import json
import os
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np
import pytest
from format_isolated import Isolated
from format_testutil import relayout, small_config, split, write_bare
from nanoqwen_format import write_synthetic

BUDGET_S = float(os.environ.get("NANOQWEN_FUZZ_SECONDS", "30"))
CASE_TIMEOUT_S = 30  # one case takes well under a second; this only separates a hang from a slow machine
WORKERS = 2

ENGINE_KEYS = {
    "config": ["eos_token_id", "max_position_embeddings", "rope_theta", "rms_norm_eps", "hidden_act",
               "model_type", "rope_scaling", "use_sliding_window", "head_dim", "tie_word_embeddings",
               "hidden_size", "num_key_value_heads", "vocab_size"],
    "tokenizer_config": ["chat_template", "eos_token", "bos_token"],
    "generation_config": ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
                          "do_sample", "eos_token_id"],
}
SECTIONS = ["config", "quantization", "tensors", "tokenizer_config", "generation_config", "provenance", None]


@pytest.fixture(scope="module")
def bases(tmp_path_factory, session_seed):
    """Real small files: bare untied and tied (stand-in tokenizer, quick), and one with the real tokenizer
    and chat template (a 6 MB header)."""
    d = tmp_path_factory.mktemp("fuzz_bases")
    rng = np.random.default_rng(session_seed)
    files = [write_bare(d / "untied.nanoqwen", small_config(num_hidden_layers=1, vocab_size=256), rng),
             write_bare(d / "tied.nanoqwen", small_config(num_hidden_layers=1, vocab_size=256,
                                                          tie_word_embeddings=True), rng),
             write_synthetic(d / "real.nanoqwen", small_config(num_hidden_layers=1, vocab_size=256),
                             seed=session_seed)]
    return [(f.read_bytes(), *split(f.read_bytes())) for f in files]


# --- mutations: each takes (rng, raw, header, json_len) and returns (file bytes, description) ---------


def random_value(rng):
    kind = int(rng.integers(14))
    if kind == 0:
        return int(rng.choice([0, -1, 1, 7, 4096, 2**31, 2**32 - 1, 2**62, 2**63, 2**64, -(2**63)]))
    if kind == 1:
        return 10 ** int(rng.integers(20, 4000))
    if kind == 2:
        return float(rng.choice([0.0, -0.0, 0.5, -1.5, 1e-300, 1e308, -1e308, 5e-324]))
    if kind == 3:
        return "x" * int(rng.choice([0, 1, 8, 100_000]))
    if kind == 4:
        return [2**62] * int(rng.choice([0, 1, 3, 9, 250, 100_000]))
    if kind == 5:
        return [int(x) for x in rng.integers(-5, 1 << 20, size=int(rng.integers(0, 4)))]
    if kind == 6:
        return bool(rng.integers(2))
    if kind == 7:
        return None
    if kind == 8:
        return {}
    if kind == 9:
        return {"name": "default", "template": 5} if rng.integers(2) else [{"name": "default"}]
    if kind == 10:
        return [None, "a", 1.5]
    if kind == 11:
        return "\u0000\ud7ff\U0010ffff"
    if kind == 12:
        return {"a": [1, {"b": None}]}
    return -int(rng.integers(1, 1 << 40))


def _paths(obj, prefix=()):
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    out = []
    for k, v in items:
        out.append((*prefix, k))
        if len(out) < 5000:
            out.extend(_paths(v, (*prefix, k)))
    return out


def _pick_path(rng, h):
    section = SECTIONS[int(rng.integers(len(SECTIONS)))]
    if section is None or section not in h:
        return (list(h)[int(rng.integers(len(h)))],) if h else None
    paths = [(section, *p) for p in _paths(h[section])] or [(section,)]
    return paths[int(rng.integers(len(paths)))]


def _parent(h, path):
    for k in path[:-1]:
        h = h[k]
    return h


def json_edit(rng, h):
    """Edit the parsed header in place; returns a description."""
    op = int(rng.integers(5))
    path = _pick_path(rng, h)
    if path is None:
        return "empty header"
    parent = _parent(h, path)
    if op == 0:
        parent[path[-1]] = v = random_value(rng)
        return f"set {path} = {str(v)[:40]}"
    if op == 1:
        del parent[path[-1]]
        return f"delete {path}"
    if op == 2:
        ints = [(p, v) for p in [path, *(_pick_path(rng, h) for _ in range(20))] if p is not None
                and isinstance(v := _parent(h, p)[p[-1]], int) and not isinstance(v, bool)]
        if ints:
            p, v = ints[0]
            delta = int(rng.choice([-4096, -8, -1, 1, 2, 8, 4096, 2**40, 2**62]))
            _parent(h, p)[p[-1]] = v + delta
            return f"nudge {p} by {delta}"
    if op == 3 and isinstance(h.get("tensors"), list) and len(h["tensors"]) > 1:
        a, b = (int(i) for i in rng.choice(len(h["tensors"]), size=2, replace=False))
        ea, eb = h["tensors"][a], h["tensors"][b]
        if isinstance(ea, dict) and isinstance(eb, dict):
            key = str(rng.choice(["offset", "shape", "name", "nbytes", "dtype", "crc32"]))
            if key in ea and key in eb:
                ea[key], eb[key] = eb[key], ea[key]
                return f"swap {key} of entries {a} and {b}"
    section = str(rng.choice(list(ENGINE_KEYS)))
    if isinstance(h.get(section), dict):
        key = str(rng.choice(ENGINE_KEYS[section]))
        h[section][key] = v = random_value(rng)
        return f"engine field {section}.{key} = {str(v)[:40]}"
    return "no-op"


def text_edit(rng, text: bytes) -> tuple[bytes, str]:
    op = int(rng.integers(5))
    pos = int(rng.integers(len(text)))
    if op == 0:
        i = text.find(b"{", pos)
        i = i if i >= 0 else text.find(b"{")
        key = bytes(rng.choice([b"tensors", b"config", b"name", b"offset", b"hidden_size", b"temperature"]))
        return text[:i + 1] + b'"' + key + b'":0,' + text[i + 1:], f"duplicate key {key!r} at {i}"
    if op == 1:
        digits = [i for i in range(pos, min(len(text), pos + 4000)) if 48 <= text[i] <= 57]
        if digits:
            i = digits[0]
            j = i
            while j < len(text) and (48 <= text[j] <= 57 or text[j] in b".eE-+"):
                j += 1
            lit = bytes(rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999"]))
            return text[:i] + lit + text[j:], f"number at {i} -> {lit!r}"
    if op == 2:
        junk = bytes(rng.choice([b"\0", b"\xff", b"\xc3", b"\xed\xa0\x80", b"}", b"]", b'"']))
        return text[:pos] + junk + text[pos:], f"insert {junk!r} at {pos}"
    if op == 3:
        depth = int(rng.choice([100, 5000, 200_000]))
        i = text.find(b":", pos)
        if i >= 0:
            end = text.find(b",", i)
            end = end if end >= 0 else i + 1
            return text[:i + 1] + b"[" * depth + b"]" * depth + text[end:], f"nest {depth} deep at {i}"
    return text[:pos] + text[pos + 1:], f"delete byte {pos}"


def mutate(rng, raw: bytes, header: dict, n: int) -> tuple[bytes, str]:
    kind = int(rng.integers(9))
    data_start = (24 + n + 4095) // 4096 * 4096
    if kind <= 1:  # JSON value edits (the most interesting layer), sometimes several
        h = copy.deepcopy(header)
        what = [json_edit(rng, h) for _ in range(int(rng.integers(1, 4)))]
        if rng.integers(3):
            return relayout(raw, h), "json (moved data): " + "; ".join(what)
        text = json.dumps(h, ensure_ascii=False, separators=(",", ":")).encode()
        text += b" " * max(0, n - len(text))
        return raw[:16] + struct.pack("<Q", len(text)) + text + raw[24 + len(text):], "json (in place): " + "; ".join(what)
    if kind == 2:  # text edits json.dumps cannot make
        what = []

        def edit(text):
            for _ in range(int(rng.integers(1, 3))):
                text, w = text_edit(rng, text)
                what.append(w)
            return text
        return relayout(raw, header, edit), "text: " + "; ".join(what)
    if kind == 3:  # bytes set or flipped anywhere before the end of the first tensors
        b = bytearray(raw)
        what = []
        for _ in range(int(rng.integers(1, 9))):
            region = int(rng.integers(4))
            lo, hi = [(0, 24), (24, 24 + n), (24 + n, data_start), (data_start, len(raw))][region]
            if hi > lo:
                i = int(rng.integers(lo, hi))
                b[i] = int(rng.integers(256)) if rng.integers(2) else b[i] ^ (1 << int(rng.integers(8)))
                what.append(i)
        return bytes(b), f"bytes at {what}"
    if kind == 4:  # cut
        cut = int(rng.choice([rng.integers(0, 25), rng.integers(24, data_start + 1), rng.integers(0, len(raw)),
                              len(raw) - int(rng.integers(1, 9))]))
        return raw[:max(cut, 0)], f"cut at {cut}"
    if kind == 5:  # extend (a sparse extension happens in write_case)
        extra = bytes(int(rng.integers(1, 8192))) if rng.integers(2) else rng.bytes(int(rng.integers(1, 8192)))
        return raw + extra, f"extend by {len(extra)} bytes"
    if kind == 6:  # the JSON length field
        v = int(rng.choice([0, 1, n - 1, n + 1, n + 4096, data_start - 24, 16 << 20, (16 << 20) + 1, 2**30,
                            len(raw) - 24, len(raw), 2**63, 2**64 - 1, int(rng.integers(0, 2**62))]))
        return raw[:16] + struct.pack("<Q", max(0, min(v, 2**64 - 1))) + raw[24:], f"json length {v}"
    if kind == 7:  # version and flags
        return raw[:8] + struct.pack("<II", int(rng.choice([0, 1, 2])), int(rng.choice([0, 0, 1, 2**31]))) + raw[16:], \
            "version/flags"
    h = copy.deepcopy(header)
    if rng.integers(2):  # the fields the engine reads, the likeliest to slip through
        section = str(rng.choice(list(ENGINE_KEYS)))
        key = str(rng.choice(ENGINE_KEYS[section]))
        h[section][key] = v = random_value(rng)
        return relayout(raw, h), f"engine field {section}.{key} = {str(v)[:40]}"
    entry = h["tensors"][int(rng.integers(len(h["tensors"])))]  # the table: shapes, offsets, sizes
    key = str(rng.choice(["shape", "shape", "offset", "nbytes", "dtype", "name", "crc32"]))
    entry[key] = v = random_value(rng)
    return relayout(raw, h), f"table field {entry.get('name')!s:.40}.{key} = {str(v)[:40]}"


def write_case(rng, path, data: bytes):
    path.write_bytes(data)
    if rng.integers(20) == 0:  # sparse: the file claims gigabytes it does not hold
        os.truncate(path, len(data) + int(rng.choice([4096, 1 << 30, 3 << 30])))


# --- the run -------------------------------------------------------------------------------------------


def _worker(w, seed, bases, workdir, stop_at, results, lock):
    counts, kinds = Counter(), Counter()
    with closing(Isolated()) as child:
        i = w
        while time.monotonic() < stop_at:
            rng = np.random.default_rng([seed, i])
            raw, header, n = bases[0 if rng.integers(10) < 5 else 1 if rng.integers(10) < 9 else 2]
            data, what = mutate(rng, raw, header, n)
            path = workdir / f"case-{i}.nanoqwen"
            write_case(rng, path, data)
            answer = child.run(path, CASE_TIMEOUT_S)
            counts["cases"] += 1
            kinds[what.split(":")[0].split(" ")[0]] += 1
            if not answer.get("ok"):
                with lock:
                    results["failures"].append((i, what, answer, path))
                return counts, kinds
            counts["accepted"] += answer["accepted"]
            counts["verify_accepted"] += answer["verify_accepted"]
            path.unlink()
            i += WORKERS
    return counts, kinds


def test_reader_fuzz_only_format_errors_escape(bases, tmp_path, seed, fuzz_report):
    results, lock = {"failures": []}, threading.Lock()
    start = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = [pool.submit(_worker, w, seed, bases, tmp_path, start + BUDGET_S, results, lock)
                   for w in range(WORKERS)]
        outcomes = [f.result() for f in futures]
    counts = sum((c for c, _ in outcomes), Counter())
    kinds = sum((k for _, k in outcomes), Counter())
    line = (f"reader fuzz: {counts['cases']} cases in {time.monotonic() - start:.0f} s on {WORKERS} children "
            f"(seed {seed}), {counts['accepted']} opened, {counts['verify_accepted']} passed verify, "
            f"{len(results['failures'])} escapes; by mutation: {dict(sorted(kinds.items()))}")
    print(line)
    fuzz_report(line)
    for i, what, answer, path in results["failures"]:
        pytest.fail(f"case {i} ({what}), kept at {path}: {answer.get('error')} [{answer.get('where', '')}]")
    assert counts["cases"] >= 20, "the fuzz ran too few cases to mean anything"
    assert counts["accepted"] < counts["cases"], "no mutation was refused: the mutations do not bite"
