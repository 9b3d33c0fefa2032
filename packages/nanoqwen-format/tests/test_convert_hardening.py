"""Hostile converter inputs, one test each: malformed config.json
and safetensors headers, lying tensor offsets, embedded files the reader would refuse, and output paths
that would destroy inputs or leave things behind. Each is one NanoqwenFormatError (one line from the
CLI), and nothing is written or left behind."""

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import nanoqwen_format.converter as convert_mod
import pytest
from click.testing import CliRunner
from nanoqwen_format import NanoqwenFormatError, convert, open_model
from nanoqwen_format.cli import main
from nanoqwen_format.layout import MAGIC, MAX_JSON
from nanoqwen_format.writer import NanoqwenWriter


def linked_copy(src, dst, *replace):
    """dst/ with a symlink to each file of src/, except `replace` (real copies, to be edited)."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name in replace:
            (dst / p.name).write_bytes(p.read_bytes())
        else:
            (dst / p.name).symlink_to(p)
    return dst


def refused(src, out, match):
    """`nanoqwen-convert SRC -o OUT` refuses with one line matching `match` (the CLI turns exactly the
    NanoqwenFormatError of convert() into that line; anything else would escape as r.exception); no output."""
    r = CliRunner().invoke(main, [str(src), "-o", str(out), "--quiet"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert r.output.count("\n") == 1 and r.output.startswith("error: "), r.output
    assert re.search(match, r.output), r.output
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def convert_refused(src, out, match):
    """convert(src, out) raises one NanoqwenFormatError matching `match` (the API's side of refused())."""
    with pytest.raises(NanoqwenFormatError, match=match):
        convert(src, out, progress=False)


# --- config.json --------------------------------------------------------------------------------------


def _config(hf):
    return json.loads((hf / "config.json").read_text())


CONFIGS = {
    "list": (lambda c: "[]", "config.json must be a JSON object"),
    "string": (lambda c: '"x"', "config.json must be a JSON object"),
    "architectures int": (lambda c: json.dumps({**c, "architectures": 5}), "architectures"),
    "architectures of ints": (lambda c: json.dumps({**c, "architectures": [5]}), "architectures"),
    "hidden_size string": (lambda c: json.dumps({**c, "hidden_size": "256"}), "hidden_size"),
    "hidden_act int": (lambda c: json.dumps({**c, "hidden_act": 5}), "hidden_act"),
    "NaN": (lambda c: json.dumps({**c, "rms_norm_eps": float("nan")}), "NaN"),
    "duplicate key": (lambda c: json.dumps(c).replace("{", '{"hidden_size": 1,', 1), "duplicate key"),
    "not UTF-8": (lambda c: b"\xff\xfe{}", "UTF-8"),
    "eos string": (lambda c: json.dumps({**c, "eos_token_id": "abc"}), "eos_token_id"),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_malformed_config_json(hf_untied, tmp_path, kind):
    make, match = CONFIGS[kind]
    src = linked_copy(hf_untied, tmp_path / "hf", "config.json")
    text = make(_config(hf_untied))
    (src / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(src, tmp_path / "m.nanoqwen", match)


def test_config_json_that_is_a_folder(hf_untied, tmp_path):
    src = linked_copy(hf_untied, tmp_path / "hf")
    (src / "config.json").unlink()
    (src / "config.json").mkdir()
    refused(src, tmp_path / "m.nanoqwen", "config.json")


# --- safetensors headers ------------------------------------------------------------------------------


def _st_header(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), n


def _st_with(raw, header=None, text=None):
    """The safetensors bytes with a new header (offsets are relative to the data, so any length works)."""
    _, n = _st_header(raw)
    if text is None:
        text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def _names(h, *suffixes):
    return [next(k for k in h if k.endswith(s)) for s in suffixes]


def _alias(h):
    a, b = _names(h, "layers.0.input_layernorm.weight", "layers.1.input_layernorm.weight")
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _shift_into_next(h):
    a, = _names(h, "layers.0.input_layernorm.weight")
    h[a]["data_offsets"] = [o + 4 for o in h[a]["data_offsets"]]


def _last(h):
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])


SAFETENSORS = {
    "missing data_offsets": (lambda h: h["model.norm.weight"].pop("data_offsets"), "data_offsets"),
    "missing shape": (lambda h: h["model.norm.weight"].pop("shape"), "shape"),
    "string offsets": (lambda h: h["model.norm.weight"].update(data_offsets=["0", "512"]), "data_offsets"),
    "three offsets": (lambda h: h["model.norm.weight"]["data_offsets"].append(7), "data_offsets"),
    "offsets before the data": (lambda h: h["model.norm.weight"].update(
        data_offsets=[-8, h["model.norm.weight"]["data_offsets"][1] - h["model.norm.weight"]["data_offsets"][0] - 8]),
        "data_offsets"),
    "aliasing tensors": (_alias, "overlap"),
    "offsets shifted into the next tensor": (_shift_into_next, "overlap"),
    "size is not shape x dtype": (lambda h: h["model.norm.weight"].update(shape=[255]), "data_offsets"),
    "out of bounds": (lambda h: h[_last(h)]["data_offsets"].__setitem__(1, h[_last(h)]["data_offsets"][1] + 2),
                      "data_offsets"),
    "extra key": (lambda h: h["model.norm.weight"].update(extra=1), "keys"),
    "shape not a list": (lambda h: h["model.norm.weight"].update(shape=256), "shape"),
    "long shape": (lambda h: h["model.norm.weight"].update(shape=[2**62] * 100), "shape"),
    "metadata not an object": (lambda h: h.update(__metadata__=5), "__metadata__"),
    "entry not an object": (lambda h: h.update({"model.norm.weight": [1, 2]}), "model.norm.weight"),
}


def refused_safetensors(hf, tmp_path, rewrite, match):
    """The checkpoint with model.safetensors replaced by rewrite(its bytes) is refused, the error naming
    the file and then `match`."""
    src = linked_copy(hf, tmp_path / "hf", "model.safetensors")
    path = src / "model.safetensors"
    path.write_bytes(rewrite(path.read_bytes()))
    refused(src, tmp_path / "m.nanoqwen", f"model.safetensors.*{match}")


@pytest.mark.parametrize("kind", sorted(SAFETENSORS))
def test_malformed_safetensors_header(hf_untied, tmp_path, kind):
    edit, match = SAFETENSORS[kind]

    def rewrite(raw):
        h, _ = _st_header(raw)
        edit(h)
        return _st_with(raw, h)

    refused_safetensors(hf_untied, tmp_path, rewrite, match)


TEXT_HEADERS = {
    "list header": (lambda t: b"[]", "not a JSON object"),
    "NaN": (lambda t: t.replace(b'"__metadata__":{', b'"__metadata__":{"x":NaN,', 1), "NaN"),
    "duplicate key": (lambda t: t.replace(b"{", b'{"model.norm.weight":{},', 1), "duplicate key"),
    "not JSON": (lambda t: b"{" + t[2:], "not valid JSON"),
}


@pytest.mark.parametrize("kind", sorted(TEXT_HEADERS))
def test_malformed_safetensors_header_text(hf_untied, tmp_path, kind):
    edit, match = TEXT_HEADERS[kind]

    def rewrite(raw):
        _, n = _st_header(raw)
        return _st_with(raw, text=edit(raw[8:8 + n]))

    refused_safetensors(hf_untied, tmp_path, rewrite, match)


def test_safetensors_header_length_past_the_end(hf_untied, tmp_path):
    refused_safetensors(hf_untied, tmp_path, lambda raw: struct.pack("<Q", len(raw)) + raw[8:], "header length")


def test_index_naming_a_file_outside_the_folder(hf_tied_sharded, tmp_path):
    src = linked_copy(hf_tied_sharded, tmp_path / "hf", "model.safetensors.index.json")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(src, tmp_path / "m.nanoqwen", "index.json")


# --- embedded files are checked as the reader checks them --------------------------------------------

EMBEDDED = {
    "generation_config list": ("generation_config.json", "[1, 2]", "generation_config"),
    "generation_config int": ("generation_config.json", "7", "generation_config"),
    "generation_config bad temperature": ("generation_config.json", '{"temperature": "hot"}', "temperature"),
    "tokenizer_config list": ("tokenizer_config.json", "[]", "tokenizer_config"),
    "tokenizer_config bad template": ("tokenizer_config.json", '{"chat_template": 5}', "chat_template"),
    "tokenizer not JSON": ("tokenizer.json", "this is not JSON", "tokenizer.json"),
    "tokenizer not an object": ("tokenizer.json", "[1, 2]", "tokenizer.json"),
}


@pytest.mark.parametrize("kind", sorted(EMBEDDED))
def test_embedded_files_are_validated(hf_untied, tmp_path, kind):
    name, text, match = EMBEDDED[kind]
    src = linked_copy(hf_untied, tmp_path / "hf", name)
    (src / name).write_text(text)
    refused(src, tmp_path / "m.nanoqwen", match)


def test_writer_refuses_what_the_reader_would(tmp_path):
    from format_testutil import small_config
    from nanoqwen_format.layout import expected_tensors
    config = small_config(num_hidden_layers=1, vocab_size=256)
    specs = expected_tensors(config)
    kw = dict(tokenizer_json="{}", tokenizer_config={}, generation_config={}, provenance={})
    with pytest.raises(NanoqwenFormatError, match="tokenizer_config"):
        NanoqwenWriter(tmp_path / "a.nanoqwen", config, specs, **{**kw, "tokenizer_config": []})
    with pytest.raises(NanoqwenFormatError, match="generation_config: top_p"):
        NanoqwenWriter(tmp_path / "a.nanoqwen", config, specs, **{**kw, "generation_config": {"top_p": 2}})
    with pytest.raises(NanoqwenFormatError, match="provenance"):
        NanoqwenWriter(tmp_path / "a.nanoqwen", config, specs, **{**kw, "provenance": {"x": float("nan")}})
    with pytest.raises(NanoqwenFormatError, match="MiB"):
        NanoqwenWriter(tmp_path / "a.nanoqwen", config, specs, **{**kw, "tokenizer_json": "x" * MAX_JSON})
    assert list(tmp_path.iterdir()) == []


# --- output paths -------------------------------------------------------------------------------------


def test_output_over_an_input_is_refused(hf_untied, tmp_path):
    real = linked_copy(hf_untied, tmp_path / "real", *[p.name for p in hf_untied.iterdir()])
    src = linked_copy(real, tmp_path / "hf", "model.safetensors")
    before = (src / "model.safetensors").read_bytes()
    refused_over = [src / "model.safetensors", src / "m.nanoqwen", src / "sub" / "m.nanoqwen"]
    (tmp_path / "link.nanoqwen").symlink_to(src / "model.safetensors")
    for out in refused_over:
        convert_refused(src, out, "source")
    convert_refused(src, tmp_path / "link.nanoqwen", "source")
    convert_refused(src, real / "tokenizer.json", "source")  # the symlinked tokenizer's target
    assert (src / "model.safetensors").read_bytes() == before
    assert not (src / "m.nanoqwen").exists() and not (src / "sub").exists()


def test_output_that_is_not_a_regular_file(hf_untied, tmp_path):
    fifo = tmp_path / "pipe.nanoqwen"
    os.mkfifo(fifo)
    convert_refused(hf_untied, fifo, "not a regular file")
    assert fifo.is_fifo()
    (tmp_path / "dir.nanoqwen").mkdir()
    convert_refused(hf_untied, tmp_path / "dir.nanoqwen", "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.nanoqwen", "pipe.nanoqwen"]


def _failing_quantize(monkeypatch, seen=None, fail_at=3):
    """quantize_int4 that records the output folder's names and raises on call `fail_at` (0: never)."""
    real, calls = convert_mod.quantize_int4, {"n": 0}

    def hooked(w, *args):  # args: the converter's quantizer name and importance weights
        calls["n"] += 1
        if seen is not None:
            seen["names"] = sorted(p.name for p in seen["folder"].iterdir())
        if calls["n"] == fail_at:
            raise RuntimeError("stop")
        return real(w, *args)

    monkeypatch.setattr(convert_mod, "quantize_int4", hooked)


def test_missing_parents_are_removed_when_the_conversion_fails(hf_untied, tmp_path, monkeypatch):
    _failing_quantize(monkeypatch)
    with pytest.raises(RuntimeError):
        convert(hf_untied, tmp_path / "a" / "b" / "m.nanoqwen", progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    convert(hf_untied, tmp_path / "a" / "b" / "m.nanoqwen", progress=False)  # created when it succeeds
    open_model(tmp_path / "a" / "b" / "m.nanoqwen").close()


def test_longest_valid_name_converts(hf_untied, tmp_path, monkeypatch):
    out = tmp_path / ("m" * 241 + ".nanoqwen")  # 250 bytes; the temporary name must fit NAME_MAX too
    seen = {"folder": tmp_path}
    _failing_quantize(monkeypatch, seen, fail_at=0)
    convert(hf_untied, out, progress=False)
    open_model(out, verify=True).close()
    tmp_names = [n for n in seen["names"] if n.endswith(".tmp")]
    assert len(tmp_names) == 1 and len(tmp_names[0].encode()) <= 255
    convert_refused(hf_untied, tmp_path / ("m" * 247 + ".nanoqwen"), "name")


def test_temporary_name_is_not_doubled(hf_untied, tmp_path, monkeypatch):
    """A caller that writes to its own `.NAME.PID.tmp` (and renames it later) gets no `..NAME.PID.tmp.PID.tmp`."""
    out = tmp_path / f".m.nanoqwen.{os.getpid()}.tmp"
    seen = {"folder": tmp_path}
    _failing_quantize(monkeypatch, seen, fail_at=0)
    convert(hf_untied, out, progress=False)
    open_model(out).close()
    assert not [n for n in seen["names"] if n.startswith("..") or n.count(".tmp") > 1], seen["names"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_are_swept(hf_untied, tmp_path):
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [f".m.nanoqwen.{dead}.tmp", f"..old.nanoqwen.{dead}.tmp.{dead}.tmp", f".x.nanoqwen.{dead}.tmp"]
        (tmp_path / stale[0]).write_bytes(MAGIC + bytes(100))
        (tmp_path / stale[1]).write_bytes(bytes(8192))  # an earlier writer's: zeros until the header is written
        (tmp_path / stale[2]).write_bytes(b"")
        kept = [f".m.nanoqwen.{live.pid}.tmp", f".notes.{dead}.tmp", "notes.txt"]
        (tmp_path / kept[0]).write_bytes(MAGIC)
        (tmp_path / kept[1]).write_bytes(b"somebody else's file")
        (tmp_path / kept[2]).write_bytes(b"")
        convert(hf_untied, tmp_path / "m.nanoqwen", progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "m.nanoqwen"])
    finally:
        live.kill()
        live.wait()


KILLED_RUN = """
import sys, time, pathlib
import nanoqwen_format.converter as c
real = c.quantize_int4
def hang(w, *args):
    pathlib.Path(sys.argv[3]).write_text("started")
    time.sleep(600)
c.quantize_int4 = hang
c.convert(sys.argv[1], sys.argv[2], progress=False)
"""


def test_sigkill_leaves_a_temporary_that_the_next_run_sweeps(hf_untied, tmp_path):
    out, marker = tmp_path / "out" / "m.nanoqwen", tmp_path / "started"
    out.parent.mkdir()
    p = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(hf_untied), str(out), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the conversion never started"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert [q.name for q in out.parent.iterdir()] == [f".m.nanoqwen.{p.pid}.tmp"]
    convert(hf_untied, out, progress=False)
    assert [q.name for q in out.parent.iterdir()] == ["m.nanoqwen"]


def test_output_that_is_a_symlink_loop(hf_untied, tmp_path):
    loop = tmp_path / "loop.nanoqwen"
    loop.symlink_to(loop)
    convert_refused(hf_untied, loop, "loop.nanoqwen|symbolic")
    assert loop.is_symlink()
