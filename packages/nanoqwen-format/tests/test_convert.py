"""convert(): every tensor of the output against the source weights, read and quantized independently here."""

import json
import math
import struct

import nanoqwen_format.converter as convert_mod
import numpy as np
import pytest
from format_testutil import small_config
from nanoqwen_format import NanoqwenFormatError, convert, open_model, quantize_int4
from nanoqwen_format.synthetic import write_hf_checkpoint

STEP = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}


def read_safetensors(folder):
    """name -> float32 array, straight from the files' bytes (bf16 = the top 16 bits of a float32)."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for name, e in json.loads(raw[8:8 + n]).items():
            if name == "__metadata__":
                continue
            a, b = e["data_offsets"]
            x = np.frombuffer(raw[8 + n + a:8 + n + b], STEP[e["dtype"]])
            if e["dtype"] == "BF16":
                x = (x.astype(np.uint32) << 16).view(np.float32)
            out[name] = x.astype(np.float32).reshape(e["shape"])
    return out


def quantize_here(w):
    """The rtn encoder (s = fp16(max|w|/7), q = clamp(rint(w/s))), vectorised differently from the package."""
    n, k = w.shape
    g = w.reshape(n, k // 128, 128)
    s = (np.abs(g).max(axis=2) / np.float32(7)).astype(np.float16)
    sf = s.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(sf > 0, np.clip(np.rint(g / sf), -8, 7), 0)
    return (q + 8).astype(np.uint32).reshape(n, k), s


def pack_here(u):
    """word = sum_i u[k+i] << 8i | u[k+4+i] << (8i+4), from the diagram in FORMAT.md."""
    n, k = u.shape
    v = u.reshape(n, k // 8, 8)
    word = np.zeros((n, k // 8), np.uint32)
    for i in range(4):
        word |= v[:, :, i] << np.uint32(8 * i)
        word |= v[:, :, 4 + i] << np.uint32(8 * i + 4)
    return word


def group_sq_error(w, u, s):
    n, k = w.shape
    d = w.astype(np.float64).reshape(n, k // 128, 128) - s.astype(np.float64)[:, :, None] * (
        u.astype(np.float64).reshape(n, k // 128, 128) - 8)
    return (d * d).sum(axis=2)


def check_file_against_source(path, folder, tied, quantizer="max-exact"):
    """Projections: exactly the package's `quantizer` encoding (the encoders are tested in test_quantize.py),
    packed as pack_here packs it; the rtn encoding also equals quantize_here's, bit for bit, and any other
    one has, group by group, a squared error no larger than rtn's."""
    src = read_safetensors(folder)
    with open_model(path, verify=True) as m:
        assert m.config["tie_word_embeddings"] is tied
        assert ("lm_head.weight" in m.tensor_names) is (not tied)
        checked = 0
        for name, w in src.items():
            if name == "lm_head.weight" and tied:
                continue
            if name.endswith("_proj.weight"):
                u, s = quantize_int4(w, quantizer)
                ru, rs = quantize_here(w)
                if quantizer == "rtn":
                    np.testing.assert_array_equal(u, ru)
                    np.testing.assert_array_equal(s.view(np.uint16), rs.view(np.uint16))
                else:
                    assert np.all(group_sq_error(w, u, s) <= group_sq_error(w, ru, rs) * (1 + 1e-5) + 1e-30)
                pre = name.removesuffix(".weight")
                np.testing.assert_array_equal(m.tensor(f"{pre}.qweight"), pack_here(u.astype(np.uint32)))
                np.testing.assert_array_equal(m.tensor(f"{pre}.scales").view(np.uint16), s.view(np.uint16))
                deq = m.dequantize(name)
                assert deq.shape == w.shape and deq.dtype == np.float32
                np.testing.assert_array_equal(deq, np.repeat(s.astype(np.float32), 128, axis=1) * (u - 8.0))
                checked += 2
            else:
                np.testing.assert_array_equal(m.tensor(name), w.astype(np.float16))
                checked += 1
        assert checked == len(m.tensor_names)
        if tied:
            np.testing.assert_array_equal(m.dequantize("lm_head.weight"), m.dequantize("model.embed_tokens.weight"))
        tok = (folder / "tokenizer.json").read_text(encoding="utf-8")
        assert m.tokenizer_json == tok
        assert m.tokenizer_config == json.loads((folder / "tokenizer_config.json").read_text())
        assert m.generation_config == json.loads((folder / "generation_config.json").read_text())
        assert m.provenance["quantizer"] == quantizer
        errs = m.provenance["quantization_error"]
        assert set(errs) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_untied_bf16_single_file(hf_untied, tmp_path):
    out = tmp_path / "m.nanoqwen"
    summary = convert(hf_untied, out, progress=False)
    assert summary["bytes"] == out.stat().st_size
    check_file_against_source(out, hf_untied, tied=False)
    assert not list(tmp_path.glob(".*tmp"))


def test_rtn_quantizer_writes_the_old_encoding(hf_untied, tmp_path):
    convert(hf_untied, tmp_path / "m.nanoqwen", progress=False, quantizer="rtn")
    check_file_against_source(tmp_path / "m.nanoqwen", hf_untied, tied=False, quantizer="rtn")
    with pytest.raises(NanoqwenFormatError, match="unknown quantizer 'awq'"):
        convert(hf_untied, tmp_path / "n.nanoqwen", progress=False, quantizer="awq")
    assert not (tmp_path / "n.nanoqwen").exists()


def test_tied_bf16_sharded(hf_tied_sharded, tmp_path):
    assert len(list(hf_tied_sharded.glob("model-*.safetensors"))) == 3
    convert(hf_tied_sharded, tmp_path / "m.nanoqwen", progress=False)
    check_file_against_source(tmp_path / "m.nanoqwen", hf_tied_sharded, tied=True)


@pytest.mark.parametrize("dtype,shards", [("float16", 1), ("float32", 2)])
def test_fp16_and_fp32_sources(tmp_path, dtype, shards):
    hf = write_hf_checkpoint(tmp_path / "hf", small_config(num_hidden_layers=1), seed=3, dtype=dtype, shards=shards)
    convert(hf, tmp_path / "m.nanoqwen", progress=False)
    check_file_against_source(tmp_path / "m.nanoqwen", hf, tied=False)


def test_progress_prints_error_table(hf_untied, tmp_path, capsys):
    convert(hf_untied, tmp_path / "m.nanoqwen", progress=True)
    err = capsys.readouterr().err
    for kind in ("q_proj", "down_proj"):
        assert kind in err
    assert "max" in err and "mean" in err


def _copy(folder, dst):
    dst.mkdir()
    for p in folder.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_config(folder, **changes):
    c = json.loads((folder / "config.json").read_text())
    c.update(changes)
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("changes,match", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "not a Qwen2ForCausalLM"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"num_key_value_heads": 2}, "shape"),
    ({"intermediate_size": 500}, "multiple of the quantization group"),
])
def test_refuses_unsupported_configs(hf_untied, tmp_path, changes, match):
    src = _copy(hf_untied, tmp_path / "hf")
    _edit_config(src, **changes)
    with pytest.raises(NanoqwenFormatError, match=match):
        convert(src, tmp_path / "m.nanoqwen", progress=False)
    assert not (tmp_path / "m.nanoqwen").exists()


def test_refuses_other_dtypes_and_missing_pieces(hf_untied, tmp_path):
    src = _copy(hf_untied, tmp_path / "hf")
    raw = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    head["model.norm.weight"]["dtype"] = "I16"  # same byte size, so only the dtype is wrong
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    (src / "model.safetensors").write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(NanoqwenFormatError, match="dtype I16"):
        convert(src, tmp_path / "m.nanoqwen", progress=False)
    (src / "model.safetensors").write_bytes(raw)
    (src / "tokenizer.json").unlink()
    with pytest.raises(NanoqwenFormatError, match="tokenizer.json"):
        convert(src, tmp_path / "m.nanoqwen", progress=False)
    with pytest.raises(NanoqwenFormatError, match="no such folder"):
        convert(tmp_path / "nope", tmp_path / "m.nanoqwen", progress=False)


def test_missing_tensor_is_named(tmp_path):
    config = small_config(num_hidden_layers=1)
    hf = write_hf_checkpoint(tmp_path / "hf", config, seed=1)
    _edit_config(hf, num_hidden_layers=2)  # the checkpoint lacks layer 1
    with pytest.raises(NanoqwenFormatError, match=r"no tensor model\.layers\.1\."):
        convert(hf, tmp_path / "m.nanoqwen", progress=False)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_no_file(hf_untied, tmp_path, monkeypatch, exc):
    out = tmp_path / "m.nanoqwen"
    out.write_bytes(b"previous")
    calls = {"n": 0}
    real = convert_mod.quantize_int4

    def flaky(w, *args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise exc("stop")
        return real(w, *args)

    monkeypatch.setattr(convert_mod, "quantize_int4", flaky)
    with pytest.raises(exc):
        convert(hf_untied, out, progress=False)
    assert out.read_bytes() == b"previous"  # untouched: the new file only ever replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.nanoqwen"]


def test_hub_id_downloads_only_needed_files(hf_untied, tmp_path, monkeypatch):
    import huggingface_hub
    seen = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        seen.update(repo_id=repo_id, allow_patterns=allow_patterns)
        return str(hf_untied)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    convert("Qwen/Qwen2.5-Coder-0.5B-Instruct", tmp_path / "m.nanoqwen", progress=False)
    assert seen["repo_id"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert "*.safetensors" in seen["allow_patterns"] and "*.bin" not in seen["allow_patterns"]
    with open_model(tmp_path / "m.nanoqwen") as m:
        assert m.provenance["source"] == "hf://Qwen/Qwen2.5-Coder-0.5B-Instruct"


def test_hub_failure_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(NanoqwenFormatError, match="cannot fetch Qwen/No-Such-Model"):
        convert("Qwen/No-Such-Model", tmp_path / "m.nanoqwen", progress=False)


def test_chunked_rows_match_whole_tensor(hf_untied, tmp_path, monkeypatch):
    """Row chunks smaller than a tensor must give the same bytes as one chunk."""
    a, b = tmp_path / "a.nanoqwen", tmp_path / "b.nanoqwen"
    convert(hf_untied, a, progress=False)
    monkeypatch.setattr(convert_mod, "CHUNK_BYTES", 3 * 4 * 256)  # 3 rows of K=256 at a time
    convert(hf_untied, b, progress=False)
    with open_model(a) as ma, open_model(b) as mb:
        for name in ma.tensor_names:
            assert np.array_equal(ma.tensor(name), mb.tensor(name)), name
        assert math.prod(ma.tensor("model.embed_tokens.weight").shape) > 3 * 256


def test_convert_name_stays_the_function():
    """`nanoqwen_format.convert` is the function however it was imported (engine uses the submodule path)."""
    import nanoqwen_format
    import nanoqwen_format.convert  # noqa: F401  (the old submodule path, now an alias)
    from nanoqwen_format.convert import convert as via_module

    assert via_module is nanoqwen_format.convert is convert and callable(convert)


def test_fp32_value_outside_float16_is_refused(tmp_path):
    hf = write_hf_checkpoint(tmp_path / "hf", small_config(num_hidden_layers=1), seed=4, dtype="float32")
    path = hf / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8:8 + n])["model.norm.weight"]["data_offsets"][0]
    raw[start:start + 4] = struct.pack("<f", 1e6)  # beyond float16's 65504
    path.write_bytes(bytes(raw))
    with pytest.raises(NanoqwenFormatError, match=r"model\.norm\.weight: values outside the float16 range"):
        convert(hf, tmp_path / "m.nanoqwen", progress=False)
    assert not (tmp_path / "m.nanoqwen").exists()
