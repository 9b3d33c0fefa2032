"""convert() of GGUF files: each tensor type against ggml-org's own dequantizer, the names, the config, the
tokenizer rebuilt from GGUF metadata against the shipped tokenizer.json, and bad files -> one clear error.

The GGUFs are written here with gguf.GGUFWriter (gguf_testutil.py), random weights from a seeded rng
whose seed is printed on failure."""

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from format_testutil import small_config
from gguf import GGMLQuantizationType as T
from gguf_testutil import (
    CORPUS,
    TYPES,
    add_tokenizer,
    small_vocab,
    vocab_from_tokenizer_json,
    write_gguf,
)
from nanoqwen_format import NanoqwenFormatError, convert, open_model
from nanoqwen_format.cli import main
from nanoqwen_format.gguf_import import read_gguf, tokenizer_json
from nanoqwen_format.quantize import quantize_int4
from nanoqwen_format.safetensors_io import SafetensorsWriter
from nanoqwen_format.synthetic import shipped_tokenizer
from nanoqwen_format.valueshuffle import pack_valueshuffle
from tokenizers import Tokenizer  # a test-only dependency (noxfile's format session installs it)


@pytest.fixture(scope="session")
def shipped():
    return shipped_tokenizer()  # (tokenizer.json text, tokenizer_config, generation_config)


@pytest.fixture(scope="session")
def config():
    return small_config()  # hidden 256, intermediate 512, 2 layers, 2 heads / 1 KV head, vocab 2048


@pytest.fixture(scope="session")
def vocab(shipped, config):
    return small_vocab(config["vocab_size"], shipped[0])


@pytest.fixture
def rng(request):
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"{request.node.name}: rng seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _check_against_source(path, expected, config, tied):
    """Every tensor of the .nanoqwen at path against the GGUF's dequantized values: float16 tensors are the
    values rounded to float16; projections are the package's INT4 quantization of them, packed."""
    with open_model(path, verify=True) as m:
        assert m.config["tie_word_embeddings"] is tied
        assert ("lm_head.weight" in m.tensor_names) is (not tied)
        for name, w in expected.items():
            if name.endswith(".weight") and (".self_attn." in name or ".mlp." in name):
                pre = name.removesuffix(".weight")
                u, scales = quantize_int4(w)
                assert np.array_equal(m.tensor(f"{pre}.qweight"), pack_valueshuffle(u)), name
                assert np.array_equal(m.tensor(f"{pre}.scales"), scales), name
            else:
                assert np.array_equal(m.tensor(name), w.astype(np.float16)), name
        return m.header


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_type_converts_to_the_dequantized_source(tmp_path, rng, config, vocab, qtype):
    src = tmp_path / "m.gguf"
    expected = write_gguf(src, config, qtype, rng, vocab=vocab)
    out = tmp_path / "m.nanoqwen"
    summary = convert(src, out, progress=False)
    assert summary["path"] == str(out)
    head = _check_against_source(out, expected, config, tied=False)
    c = head["config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert c[key] == config[key], key
    assert c["rope_theta"] == pytest.approx(config["rope_theta"]) and c["rms_norm_eps"] == pytest.approx(1e-6)
    assert c["architectures"] == ["Qwen2ForCausalLM"]
    prov = head["provenance"]
    assert prov["source_format"] == "gguf" and prov["source"] == str(src.resolve())
    n_2d = 2 + 7 * config["num_hidden_layers"]  # embedding, lm_head, 7 projections per layer
    n_1d = 1 + 5 * config["num_hidden_layers"]  # final norm; 2 norms and 3 biases per layer
    want = {"F32": n_1d} if qtype != T.F32 else {"F32": n_1d + n_2d}
    if qtype != T.F32:
        want[qtype.name] = n_2d
    assert prov["gguf"]["tensor_types"] == want
    assert sorted(prov["source_dtypes"]) == sorted(want)


def test_q4_k_m_like_mix_tied(tmp_path, rng, config, vocab):
    """llama.cpp's Q4_K_M layout (Q6_K for v_proj and down_proj, Q4_K elsewhere, F32 norms), no output
    tensor: the model is tied."""
    def pick(name):
        return T.Q6_K if name.endswith(("v_proj.weight", "down_proj.weight")) else T.Q4_K

    src = tmp_path / "mix.gguf"
    expected = write_gguf(src, config, pick, rng, tied=True, vocab=vocab)
    out = tmp_path / "mix.nanoqwen"
    convert(src, out, progress=False)
    head = _check_against_source(out, expected, config, tied=True)
    assert head["provenance"]["gguf"]["tensor_types"] == {"F32": 11, "Q4_K": 11, "Q6_K": 4}


def test_same_file_as_from_a_hf_folder_of_the_dequantized_weights(tmp_path, rng, config, vocab, shipped):
    """The GGUF path is the converter's path: a Hugging Face folder holding the GGUF's dequantized weights
    (float32 safetensors, the GGUF's tokenizer, config and generation config) converts to the same tensors."""
    src = tmp_path / "m.gguf"
    expected = write_gguf(src, config, T.Q5_K, rng, vocab=vocab)
    a = tmp_path / "a.nanoqwen"
    convert(src, a, progress=False)
    folder = tmp_path / "hf"
    folder.mkdir()
    with open_model(a) as m:
        (folder / "config.json").write_text(json.dumps(m.config))
        (folder / "tokenizer.json").write_text(m.tokenizer_json)
        (folder / "tokenizer_config.json").write_text(json.dumps(m.tokenizer_config))
        (folder / "generation_config.json").write_text(json.dumps(m.generation_config))
    w = SafetensorsWriter(folder / "model.safetensors", [(k, v.shape) for k, v in expected.items()], "float32")
    for v in expected.values():
        w.write(v)
    w.close()
    b = tmp_path / "b.nanoqwen"
    convert(folder, b, progress=False)
    with open_model(a) as ma, open_model(b) as mb:
        assert ma.tensor_names == mb.tensor_names
        for name in ma.tensor_names:
            assert np.array_equal(ma.tensor(name), mb.tensor(name)), name
        assert ma.header["quantization"] == mb.header["quantization"]
        assert ma.tokenizer_json == mb.tokenizer_json and ma.config == mb.config


def test_tokenizer_config_and_generation_config(tmp_path, rng, config, vocab, shipped):
    src = tmp_path / "m.gguf"
    write_gguf(src, config, T.F16, rng, vocab=vocab, template="{% for m in messages %}{{ m.content }}{% endfor %}")
    out = tmp_path / "m.nanoqwen"
    convert(src, out, progress=False)
    tokens = vocab[0]
    with open_model(out) as m:
        tc, gc = m.tokenizer_config, m.generation_config
        assert tc["chat_template"] == "{% for m in messages %}{{ m.content }}{% endfor %}"
        assert tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>"
        assert tc["add_bos_token"] is False
        # the stop ids: the GGUF's eos and <|endoftext|>, as Qwen's own generation_config lists both
        assert gc["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
        # sampling defaults: Qwen2.5-Coder-Instruct's, from the shipped generation_config.json
        for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
            assert gc[key] == shipped[2][key], key
        assert "Qwen2.5-Coder-7B-Instruct" in m.provenance["generation_config_source"]
        built = json.loads(m.tokenizer_json)
        assert [a["content"] for a in built["added_tokens"]] == tokens[-3:]
        assert len(built["model"]["vocab"]) == len(tokens) - 3


def test_sampling_keys_of_the_gguf_win(tmp_path, rng, config, vocab):
    src = tmp_path / "m.gguf"
    write_gguf(src, config, T.F16, rng, vocab=vocab,
               extra=lambda w: (w.add_float32("general.sampling.temp", 0.25), w.add_int32("general.sampling.top_k", 7)))
    out = tmp_path / "m.nanoqwen"
    convert(src, out, progress=False)
    with open_model(out) as m:
        assert m.generation_config["temperature"] == pytest.approx(0.25)
        assert m.generation_config["top_k"] == 7
        assert "general.sampling" in m.provenance["generation_config_source"]


def test_inspect_says_the_weights_were_quantized_twice(tmp_path, rng, config, vocab):
    src = tmp_path / "m.gguf"
    write_gguf(src, config, T.Q8_0, rng, vocab=vocab)
    out = tmp_path / "m.nanoqwen"
    r = CliRunner().invoke(main, [str(src), "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.strip().startswith("source"))
    assert "GGUF" in line and "Q8_0 x16" in line and "F32 x11" in line and "quantized twice" in line


# -- the tokenizer built from GGUF metadata against the shipped tokenizer.json --

QWEN_VOCAB = 152064  # the 7B's embedding rows: ids past the tokenizer's 151665 are [PADn] in a GGUF


@pytest.fixture(scope="session")
def full_vocab_gguf(tmp_path_factory, shipped):
    """A GGUF holding only tokenizer fields, taken from the shipped tokenizer.json as llama.cpp writes
    them (reading its 300k strings back takes the gguf reader ~10 s: once per session)."""
    import gguf

    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    tokens, types, merges = vocab_from_tokenizer_json(shipped[0], QWEN_VOCAB)
    add_tokenizer(w, tokens, types, merges, eos=151645, bos=151643, pad=151643)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, _ = read_gguf(path)
    return path, tokenizer_json(meta, path)


def _random_texts(rng, n: int) -> list[str]:
    """Random strings over code-ish ASCII, Latin-1, CJK, emoji, combining marks, whitespace and the
    special-token markup, glued from random pieces."""
    pieces = [" ", "  ", "\n", "\r\n", "\t", "    ", "'s", "'LL", "123", "4.5e-6", "_x", "->", "::", "{}", "();",
              "<|im_start|>", "<|im_end|>", "<|fim_middle|>", "<tool_call>", "<|endoftext|>", "<|", "|>"]
    ranges = [(0x20, 0x7E), (0xA0, 0xFF), (0x0300, 0x036F), (0x0400, 0x04FF), (0x0590, 0x06FF),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF), (0x2000, 0x206F)]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(int(rng.integers(1, 60))):
            if rng.random() < 0.25:
                parts.append(pieces[int(rng.integers(len(pieces)))])
            else:
                lo, hi = ranges[int(rng.integers(len(ranges)))]
                parts.append("".join(chr(int(c)) for c in rng.integers(lo, hi + 1, size=int(rng.integers(1, 8)))))
        out.append("".join(parts))
    return out


def test_gguf_tokenizer_encodes_like_the_shipped_one(full_vocab_gguf, shipped, rng):
    _, built = full_vocab_gguf
    ours, ref = Tokenizer.from_str(built), Tokenizer.from_str(shipped[0])
    texts = json.loads(CORPUS.read_text(encoding="utf-8")) + _random_texts(rng, 200)
    assert len(texts) > 200
    for text in texts:
        want = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False).ids == want, repr(text[:80])
        # (skip_special_tokens=True would differ: see test_gguf_tokenizer_has_the_shipped_vocabulary)
        assert ours.decode(want, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False)
    joined = "\n".join(texts)
    assert ours.encode(joined).ids == ref.encode(joined).ids
    # the special markup is parsed into single ids
    ids = ours.encode("<|im_start|>user\n<|fim_prefix|>x<|im_end|>").ids
    assert ids[0] == 151644 and 151659 in ids and ids[-1] == 151645


def test_gguf_tokenizer_has_the_shipped_vocabulary(full_vocab_gguf, shipped):
    """Same BPE vocabulary and merges; added tokens with the same ids and text. `special` differs only where
    GGUF cannot say: llama.cpp marks every <|...|> token CONTROL (the FIM and repo tokens are not special
    in Qwen's file)."""
    _, built = full_vocab_gguf
    a, b = json.loads(built), json.loads(shipped[0])
    assert a["model"]["vocab"] == b["model"]["vocab"]
    assert [list(m) for m in a["model"]["merges"]] == [list(m) for m in b["model"]["merges"]]
    assert a["pre_tokenizer"] == b["pre_tokenizer"] and a["normalizer"] == b["normalizer"]
    assert a["decoder"] == b["decoder"]
    assert [(t["id"], t["content"]) for t in a["added_tokens"]] == [(t["id"], t["content"]) for t in b["added_tokens"]]
    differ = {t["content"] for t, u in zip(a["added_tokens"], b["added_tokens"], strict=True) if t["special"] != u["special"]}
    assert differ == {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


# -- bad input: one NanoqwenFormatError line, no output left behind --

def _fails(src, tmp_path, *words):
    out = tmp_path / "out.nanoqwen"
    with pytest.raises(NanoqwenFormatError) as e:
        convert(src, out, progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.nanoqwen")] == []
    return msg


@pytest.fixture(scope="session")
def good_gguf(tmp_path_factory, config, vocab):
    path = tmp_path_factory.mktemp("good") / "good.gguf"
    write_gguf(path, config, T.Q4_K, np.random.default_rng(5), vocab=vocab)
    return path


@pytest.mark.parametrize("frac", [0.0, 0.001, 0.02, 0.3, 0.6, 0.999])
def test_truncated_gguf(tmp_path, good_gguf, frac):
    raw = good_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(raw[:int(len(raw) * frac)])
    msg = _fails(bad, tmp_path, "cut.gguf")
    assert "truncated" in msg or "not a GGUF" in msg


def test_garbage_after_the_magic(tmp_path, rng):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _fails(bad, tmp_path, "junk.gguf", "GGUF")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a model")
    _fails(bad, tmp_path, "not a GGUF")
    _fails(tmp_path / "missing.gguf", tmp_path, "no such file")


def test_other_architecture(tmp_path, rng, config, vocab):
    src = tmp_path / "llama.gguf"
    write_gguf(src, config, T.F16, rng, vocab=vocab, arch="llama")
    _fails(src, tmp_path, "'llama'", "qwen2")


def test_unsupported_tensor_type(tmp_path, rng, config, vocab):
    src = tmp_path / "f64.gguf"  # a tied model plus an F64 output.weight (no dequantizer for F64)
    shape = (config["vocab_size"], config["hidden_size"])
    write_gguf(src, config, T.F16, rng, vocab=vocab, tied=True,
               extra=lambda w: w.add_tensor("output.weight", np.zeros(shape, np.float64)))
    _fails(src, tmp_path, "output.weight", "F64")


def test_tensor_a_qwen2_does_not_have(tmp_path, rng, config, vocab):
    src = tmp_path / "extra.gguf"
    write_gguf(src, config, T.F16, rng, vocab=vocab,
               extra=lambda w: w.add_tensor("blk.0.attn_qkv.weight", np.zeros((4, 256), np.float32)))
    _fails(src, tmp_path, "blk.0.attn_qkv.weight")


def test_missing_metadata_and_mismatched_vocab(tmp_path, rng, config, vocab):
    src = tmp_path / "nokey.gguf"
    write_gguf(src, config, T.F16, rng, vocab=vocab, skip_keys=("feed_forward_length",))
    _fails(src, tmp_path, "qwen2.feed_forward_length")
    src = tmp_path / "short.gguf"
    tokens, types, merges = vocab
    write_gguf(src, config, T.F16, rng, vocab=(tokens[:-4] + tokens[-3:], types[:-4] + types[-3:], merges))
    _fails(src, tmp_path, "2047", "2048")
    src = tmp_path / "notok.gguf"
    write_gguf(src, config, T.F16, rng, vocab=None)
    _fails(src, tmp_path, "tokenizer.ggml.tokens")


def test_not_qwen2_tokenizer(tmp_path, rng, config):
    import gguf

    src = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2")
    add_tokenizer(w, ["a", "b"], [1, 1], [], model="llama", pre="default")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, _ = read_gguf(src)
    with pytest.raises(NanoqwenFormatError, match="'llama'"):
        tokenizer_json(meta, src)


def test_without_the_gguf_package(tmp_path, good_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    monkeypatch.setitem(sys.modules, "gguf.quants", None)
    _fails(good_gguf, tmp_path, "pip install 'nanoqwen-format[gguf]'")


def test_cli_bad_gguf_is_one_line(tmp_path, good_gguf):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good_gguf.read_bytes()[:5000])
    r = CliRunner().invoke(main, [str(bad), "-o", str(tmp_path / "o.nanoqwen"), "--quiet"])
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cut.gguf" in lines[0], r.output

