"""Hostile files, one test each: huge shapes, long shape lists, huge
declared headers, NaN/Infinity and duplicate keys in the JSON, config values the engine cannot use, files
that are not regular files. Each is refused with one NanoqwenFormatError naming the problem, and
`inspect` prints that one line.

Cases that could hang or exhaust memory run in a child process (format_isolated) with a deadline and an
address-space limit, so a regression fails the test instead of stalling the suite."""

import os
import struct
import tracemalloc

import pytest
from click.testing import CliRunner
from format_isolated import run_one
from format_testutil import relayout, split
from nanoqwen_format import NanoqwenFormatError, open_model
from nanoqwen_format.cli import main


def damaged(tmp_path, raw: bytes, name="bad.nanoqwen"):
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def with_edit(raw, fn, text_edit=None):
    h, _ = split(raw)
    fn(h)
    return relayout(raw, h, text_edit)


def norm_entry(h):
    return next(e for e in h["tensors"] if e["name"] == "model.norm.weight")


def assert_refused(path, match):
    with pytest.raises(NanoqwenFormatError, match=match) as info:
        open_model(path, verify=True)
    assert "\n" not in str(info.value)
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: "), r.output


# --- shapes and integers are bounded before anything is computed with them -----------------------------


def test_shape_whose_product_has_thousands_of_digits(bare_file, tmp_path):
    """The product of 250 dims of 2^62 has ~4,700 digits, past Python's int-to-str limit: a message quoting
    it would raise ValueError. The rank is refused first."""
    raw = with_edit(bare_file.read_bytes(), lambda h: norm_entry(h).update(shape=[2**62] * 250))
    assert_refused(damaged(tmp_path, raw), r"model\.norm\.weight: shape .*dimensions")


def test_huge_dimension(bare_file, tmp_path):
    raw = with_edit(bare_file.read_bytes(), lambda h: norm_entry(h).update(shape=[2**200]))
    assert_refused(damaged(tmp_path, raw), r"model\.norm\.weight: shape")


def test_huge_offset_and_nbytes(bare_file, tmp_path):
    raw = with_edit(bare_file.read_bytes(), lambda h: norm_entry(h).update(offset=2**4000))
    assert_refused(damaged(tmp_path, raw), r"model\.norm\.weight: offset")


def test_long_shape_list_is_refused_before_any_product(bare_file, tmp_path):
    """[2**62] * 100000 (a 2.1 MB header): its product takes minutes to compute, so the rank is refused
    before any product is taken."""
    raw = with_edit(bare_file.read_bytes(), lambda h: norm_entry(h).update(shape=[2**62] * 100_000))
    path = damaged(tmp_path, raw)
    assert len(raw) > 2_000_000
    assert run_one(path, timeout=20) == {"ok": True, "accepted": False, "verify_accepted": False}
    assert_refused(path, "dimensions")


# --- the JSON header: bounded, read without a copy, strict ---------------------------------------------


def _declare_header(raw: bytes, json_len: int) -> bytes:
    return raw[:16] + struct.pack("<Q", json_len) + raw[24:]


def test_sparse_file_declaring_a_1gib_header(bare_file, tmp_path):
    """4 KiB of data, 1 GiB declared: refused from the 24-byte fixed header, in a child limited to 1 GiB
    of address space (reading the declared header would need more)."""
    path = tmp_path / "sparse.nanoqwen"
    path.write_bytes(_declare_header(bare_file.read_bytes()[:4096], 1 << 30))
    os.truncate(path, 24 + (1 << 30) + 4096)  # sparse: the rest is a hole
    assert run_one(path, timeout=20) == {"ok": True, "accepted": False, "verify_accepted": False}
    assert_refused(path, r"JSON header length 1073741824 exceeds")


def test_zero_filled_header_under_the_bound_is_refused_without_a_copy(bare_file, tmp_path):
    """A declared length under the bound, but a hole where the JSON should be: refused at its first byte
    with no copy of the 32 MiB (Python allocations peak below 1 MiB)."""
    path = tmp_path / "hole.nanoqwen"
    path.write_bytes(_declare_header(bare_file.read_bytes()[:24], 32 << 20))
    os.truncate(path, 24 + (32 << 20) + 4096)
    tracemalloc.start()
    try:
        with pytest.raises(NanoqwenFormatError, match="JSON header"):
            open_model(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"reading a refused header allocated {peak} bytes"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
def test_nan_and_infinity_are_refused(bare_file, tmp_path, literal):
    raw = with_edit(bare_file.read_bytes(), lambda h: h["provenance"].update(x=12345),
                    lambda t: t.replace(b'"x":12345', b'"x":' + literal, 1))
    assert literal in raw
    assert_refused(damaged(tmp_path, raw), "NaN or Infinity|not a finite number")


@pytest.mark.parametrize("where", ["top", "config", "entry"])
def test_duplicate_keys_are_refused(bare_file, tmp_path, where):
    """{"tensors": "bogus", ...valid...}: json.loads keeps the last key, so a header could read differently
    to another reader."""
    edit = {"top": lambda t: t.replace(b"{", b'{"tensors":"bogus",', 1),
            "config": lambda t: t.replace(b'"config":{', b'"config":{"hidden_size":1,', 1),
            "entry": lambda t: t.replace(b'{"name":', b'{"dtype":"bogus","name":', 1)}[where]
    raw = with_edit(bare_file.read_bytes(), lambda h: None, edit)
    assert_refused(damaged(tmp_path, raw), "duplicate key")


def test_file_that_is_not_a_regular_file(tmp_path):
    """A plain open of a FIFO waits for a writer for ever; a directory is no model either."""
    fifo = tmp_path / "pipe.nanoqwen"
    os.mkfifo(fifo)
    answer = run_one(fifo, timeout=20)
    assert answer == {"ok": True, "accepted": False, "verify_accepted": False}, answer
    assert_refused(fifo, "not a regular file")
    with pytest.raises(NanoqwenFormatError, match="not a regular file"):
        open_model(tmp_path)


# --- the config, tokenizer_config and generation_config values the engine relies on -------------------

ENGINE_FIELDS = [
    ("config", "eos_token_id", "abc"), ("config", "eos_token_id", [None]), ("config", "eos_token_id", [1.5]),
    ("config", "eos_token_id", True), ("config", "eos_token_id", -1), ("config", "eos_token_id", {}),
    ("config", "max_position_embeddings", "x"), ("config", "max_position_embeddings", 0),
    ("config", "max_position_embeddings", 2.5), ("config", "max_position_embeddings", True),
    ("config", "rope_theta", 10**400), ("config", "rms_norm_eps", 10**400), ("config", "rope_theta", "1e6"),
    ("config", "head_dim", "128"), ("config", "hidden_act", "gelu"), ("config", "hidden_act", 5),
    ("config", "model_type", "llama"), ("config", "rope_scaling", {"type": "yarn", "factor": 4.0}),
    ("config", "use_sliding_window", True), ("config", "use_sliding_window", "no"),
    ("tokenizer_config", "chat_template", 5), ("tokenizer_config", "chat_template", []),
    ("tokenizer_config", "chat_template", [{"name": "default"}]),
    ("tokenizer_config", "chat_template", [{"name": "default", "template": 7}]),
    ("generation_config", "temperature", "0.7"), ("generation_config", "temperature", -0.5),
    ("generation_config", "temperature", None), ("generation_config", "temperature", 10**400),
    ("generation_config", "top_p", 0), ("generation_config", "top_p", 1.5), ("generation_config", "top_p", "x"),
    ("generation_config", "top_k", -1), ("generation_config", "top_k", 2.5), ("generation_config", "top_k", True),
    ("generation_config", "min_p", 2), ("generation_config", "repetition_penalty", 0),
    ("generation_config", "repetition_penalty", "x"), ("generation_config", "max_new_tokens", 0),
    ("generation_config", "max_new_tokens", "x"), ("generation_config", "do_sample", "yes"),
    ("generation_config", "eos_token_id", ["a"]),
]


@pytest.mark.parametrize("section,key,value", ENGINE_FIELDS, ids=[f"{s}.{k}={v!r}"[:60] for s, k, v in ENGINE_FIELDS])
def test_engine_fields_are_checked_at_open(bare_file, tmp_path, section, key, value):
    raw = with_edit(bare_file.read_bytes(), lambda h: h[section].update({key: value}))
    assert_refused(damaged(tmp_path, raw), f"{section}: {key}")


GOOD_FIELDS = [
    ("config", "eos_token_id", None), ("config", "eos_token_id", [151645, 151643]), ("config", "eos_token_id", 0),
    ("config", "max_position_embeddings", 131072), ("config", "rope_scaling", None),
    ("config", "use_sliding_window", False), ("config", "head_dim", 128),
    ("tokenizer_config", "chat_template", "{{ messages }}"), ("tokenizer_config", "chat_template", None),
    ("tokenizer_config", "chat_template", [{"name": "default", "template": "{{ messages }}"}]),
    ("generation_config", "temperature", 0), ("generation_config", "top_k", None),
    ("generation_config", "top_p", 1), ("generation_config", "repetition_penalty", 1.05),
    ("generation_config", "max_new_tokens", 2048), ("generation_config", "do_sample", False),
]


@pytest.mark.parametrize("section,key,value", GOOD_FIELDS, ids=[f"{s}.{k}={v!r}"[:60] for s, k, v in GOOD_FIELDS])
def test_valid_engine_fields_still_open(bare_file, tmp_path, section, key, value):
    raw = with_edit(bare_file.read_bytes(), lambda h: h[section].update({key: value}))
    with open_model(damaged(tmp_path, raw), verify=True) as m:
        assert getattr(m, section)[key] == value


def test_inspect_prints_odd_informative_fields(bare_file, tmp_path):
    """Keys the reader does not need (architectures, provenance) may hold anything; inspect still prints."""
    def odd(h):
        h["config"]["architectures"] = 5
        h["provenance"].update(quantization_error={"q_proj": 5, "k_proj": {"max_abs": "x"}}, created=[1])
    path = damaged(tmp_path, with_edit(bare_file.read_bytes(), odd))
    r = CliRunner().invoke(main, ["inspect", str(path), "--verify"])
    assert r.exit_code == 0, r.output
    assert "valid, CRCs verified" in r.output and "layers" in r.output
