"""Every kind of damaged file gets one NanoqwenFormatError naming the problem (test_reader_fuzz.py mutates
files at random and checks that nothing else ever escapes; test_reader_hardening.py has the hostile cases)."""

import json
import struct

import pytest
from click.testing import CliRunner
from format_testutil import split
from nanoqwen_format import NanoqwenFormatError, open_model
from nanoqwen_format.cli import main
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


@pytest.mark.parametrize("kind", sorted(CASES))
def test_inspect_prints_one_line(bare_file, tmp_path, kind):
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(CASES[kind][0](bare_file.read_bytes()))
    r = CliRunner().invoke(main, ["inspect", str(bad), "--verify"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert r.output.count("\n") == 1 and r.output.startswith("error: "), r.output


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
