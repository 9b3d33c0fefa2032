"""Every kind of damaged file gets one NanoqwenFormatError naming the problem; a fuzz of random header and
JSON mutations never gets anything else (and whatever passes validation reads without error)."""

import json
import struct

import numpy as np
import pytest
from format_testutil import small_config, split, write_bare
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanoqwen_format import NanoqwenFormatError, open_model
from nanoqwen_format.layout import expected_tensors


def with_header(raw: bytes, header: dict, json_len: int | None = None) -> bytes:
    """The same file with a new JSON header, space-padded into the old header's room (offsets unchanged)."""
    _, n = split(raw)
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    assert len(text) <= n, "edit made the JSON longer than the room the writer left"
    text += b" " * (n - len(text))
    return raw[:16] + struct.pack("<Q", n if json_len is None else json_len) + text + raw[24 + n:]


def edit_json(fn):
    def mutate(raw):
        h, _ = split(raw)
        fn(h)
        return with_header(raw, h)
    return mutate


def entry(h, suffix):
    return next(e for e in h["tensors"] if e["name"].endswith(suffix))


def overlap(h):
    a, b = h["tensors"][0], h["tensors"][1]
    b["offset"] = a["offset"]


def flip_data_byte(raw):
    h, _ = split(raw)
    e = entry(h, "mlp.up_proj.qweight")
    b = bytearray(raw)
    b[e["offset"] + 5] ^= 0x10
    return bytes(b)


def nonzero_padding(raw):
    _, n = split(raw)
    b = bytearray(raw)
    b[24 + n + 3] = 7
    return bytes(b)


CASES = {
    "bad magic": (lambda r: b"NANOQWEM" + r[8:], "bad magic"),
    "empty file": (lambda r: b"", "too short"),
    "short file": (lambda r: r[:12], "too short"),
    "unknown version": (lambda r: r[:8] + struct.pack("<I", 2) + r[12:], "unknown format version 2"),
    "unknown flags": (lambda r: r[:12] + struct.pack("<I", 1) + r[16:], "unknown flags"),
    "json garbage": (lambda r: with_header(r, {}) .replace(b"{}", b"{x", 1), "not valid JSON"),
    "json not utf-8": (lambda r: r[:24] + b"\xff\xfe" + r[26:], "not valid UTF-8"),
    "json not an object": (lambda r: with_header(r, {}).replace(b"{}", b"[]", 1), "not a JSON object"),
    "header length past EOF": (lambda r: r[:16] + struct.pack("<Q", len(r)) + r[24:], "runs past the end"),
    "tensor past EOF": (lambda r: r[:-10], r"lm_head\.weight: bytes .* run past the end of the file"),
    "overlapping tensors": (edit_json(overlap), "overlap"),
    "misaligned offset": (edit_json(lambda h: entry(h, "model.norm.weight").update(
        offset=entry(h, "model.norm.weight")["offset"] + 16)), "not aligned to 4096"),
    "offset inside header": (edit_json(lambda h: h["tensors"][0].update(offset=0)), "inside the header"),
    "dtype x shape != nbytes": (edit_json(lambda h: entry(h, "layers.0.input_layernorm.weight").update(
        shape=[255])), r"dtype float16 x shape \[255\] = 510 bytes != nbytes 512"),
    "unknown dtype": (edit_json(lambda h: entry(h, "model.norm.weight").update(dtype="bfloat16")), "unknown dtype"),
    "missing tensor": (edit_json(lambda h: h["tensors"].remove(entry(h, "layers.1.mlp.down_proj.scales"))),
                       r"missing tensor model\.layers\.1\.mlp\.down_proj\.scales"),
    "renamed tensor": (edit_json(lambda h: entry(h, "lm_head.weight").update(name="lm_head.extra")),
                       r"missing tensor lm_head\.weight"),
    "unexpected tensor": (edit_json(lambda h: h["tensors"].append(dict(
        h["tensors"][0], name="extra.weight", shape=[0], nbytes=0))), r"unexpected tensor extra\.weight"),
    "duplicate tensor": (edit_json(lambda h: h["tensors"][1].update(name=h["tensors"][0]["name"])), "duplicate"),
    "dims inconsistent with config": (edit_json(lambda h: h["config"].update(num_key_value_heads=2)),
                                      "inconsistent with config"),
    "bad config value": (edit_json(lambda h: h["config"].update(rms_norm_eps=-1.0)), "rms_norm_eps"),
    "config missing a key": (edit_json(lambda h: h["config"].pop("vocab_size")), "vocab_size"),
    "unsupported quantization": (edit_json(lambda h: h["quantization"].update(group_size=64)),
                                 "unsupported quantization"),
    "missing tokenizer": (edit_json(lambda h: h.pop("tokenizer_json")), "tokenizer_json"),
    "bad crc field": (edit_json(lambda h: h["tensors"][0].update(crc32=12345)), "crc32"),
    "nonzero padding": (nonzero_padding, "padding"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_malformed_file_is_named(bare_file, tmp_path, kind):
    mutate, match = CASES[kind]
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(mutate(bare_file.read_bytes()))
    with pytest.raises(NanoqwenFormatError, match=match):
        open_model(bad, verify=True)


def test_crc_mismatch_only_with_verify(bare_file, tmp_path):
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(flip_data_byte(bare_file.read_bytes()))
    with open_model(bad) as m:  # structure is fine; the data is only checked on request
        assert "model.layers.0.mlp.up_proj.qweight" in m.tensor_names
    with pytest.raises(NanoqwenFormatError, match=r"up_proj\.qweight: CRC32 mismatch"):
        open_model(bad, verify=True)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(NanoqwenFormatError, match="cannot open"):
        open_model(tmp_path / "nope.nanoqwen")
    with pytest.raises(NanoqwenFormatError, match="cannot open"):
        open_model(tmp_path)


def test_undamaged_files_open(bare_file, synthetic_file):
    for path in (bare_file, synthetic_file):
        with open_model(path, verify=True) as m:
            assert m.tensor_names == [t.name for t in expected_tensors(m.config)]


# --- fuzz -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory, session_seed):
    """One layer, so each example is quick."""
    path = tmp_path_factory.mktemp("fuzz") / "base.nanoqwen"
    return write_bare(path, small_config(num_hidden_layers=1, vocab_size=256),
                      np.random.default_rng(session_seed)).read_bytes()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _paths(obj, prefix=()):
    """Every (container, key) path in a JSON tree, skipping the big strings' insides."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


def _open_and_use(path, verify):
    """Anything that validates must also read: every tensor view, one dequantize."""
    try:
        m = open_model(path, verify=verify)
    except NanoqwenFormatError:
        return
    with m:
        for name in m.tensor_names:
            m.tensor(name)
        m.dequantize("model.layers.0.mlp.down_proj.weight")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), verify=st.booleans())
def test_fuzz_json_mutations(fuzz_base, tmp_path, data, verify):
    h, n = split(fuzz_base)
    paths = _paths(h)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = h
        for k in path[:-1]:
            parent = parent[k]
        action = data.draw(st.sampled_from(["set", "delete", "int"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "int" and isinstance(parent[path[-1]], int):
            parent[path[-1]] += data.draw(st.sampled_from([-4096, -1, 1, 8, 4096, 2**40]))
        else:
            parent[path[-1]] = data.draw(json_values)
        paths = _paths(h)
        if not paths:
            break
    text = json.dumps(h, ensure_ascii=False, separators=(",", ":")).encode()
    raw = fuzz_base
    if len(text) <= n:
        raw = with_header(fuzz_base, h)
    f = tmp_path / "fuzz.nanoqwen"
    f.write_bytes(raw)
    _open_and_use(f, verify)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), verify=st.booleans())
def test_fuzz_byte_mutations(fuzz_base, tmp_path, data, verify):
    _, n = split(fuzz_base)
    raw = bytearray(fuzz_base)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, 24 + n + 64) | st.integers(0, 40))  # fixed header, JSON, padding
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, len(raw)))
    f = tmp_path / "fuzz.nanoqwen"
    f.write_bytes(bytes(raw[:cut]))
    _open_and_use(f, verify)
