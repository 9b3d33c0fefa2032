"""A file matches docs/FORMAT.md byte for byte: a reader written here from that page alone (struct, json,
zlib; no nanoqwen_format code) parses the header, the whole table and tensors, and agrees with open_model."""

import json
import math
import struct
import zlib

import numpy as np
import pytest
from format_testutil import small_config
from nanoqwen_format import open_model, write_synthetic

QUANT = {"bits": 4, "group_size": 128, "symmetric": True, "zero_point": 8, "scale_dtype": "float16",
         "packing": "valueshuffle-v1"}
ITEM = {"uint32": 4, "float16": 2}


def names_from_section_4(c):
    """FORMAT.md section 4's table, written out again."""
    h, i, nh, nkv, v = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                        c["num_key_value_heads"], c["vocab_size"])
    d = h // nh
    out = [("model.embed_tokens.weight", "float16", [v, h])]

    def proj(name, n, k):
        return [(f"{name}.qweight", "uint32", [n, k // 8]), (f"{name}.scales", "float16", [n, k // 128])]

    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out.append((f"{p}.input_layernorm.weight", "float16", [h]))
        for x, n in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            out += proj(f"{p}.self_attn.{x}_proj", n, h) + [(f"{p}.self_attn.{x}_proj.bias", "float16", [n])]
        out += proj(f"{p}.self_attn.o_proj", h, nh * d)
        out.append((f"{p}.post_attention_layernorm.weight", "float16", [h]))
        out += proj(f"{p}.mlp.gate_proj", i, h) + proj(f"{p}.mlp.up_proj", i, h) + proj(f"{p}.mlp.down_proj", h, i)
    out.append(("model.norm.weight", "float16", [h]))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", "float16", [v, h]))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_file_matches_format_md(tmp_path, tied, seed, rng):
    path = write_synthetic(tmp_path / "m.nanoqwen", small_config(tie_word_embeddings=tied),
                           seed=seed)
    raw = path.read_bytes()
    # 1.1 fixed header
    assert raw[:8] == b"NANOQWEN" and int.from_bytes(raw[:8], "big") == 0x4E414E4F5157454E
    version, flags, n = struct.unpack("<IIQ", raw[8:24])
    assert (version, flags) == (1, 0)
    # 1.2 JSON: UTF-8, maybe space-padded, an object with the seven keys
    text = raw[24:24 + n].decode("utf-8")
    assert text.rstrip(" ") == text.rstrip() and text.lstrip().startswith("{")
    head = json.loads(text)
    assert set(head) >= {"config", "quantization", "tensors", "tokenizer_json", "tokenizer_config",
                         "generation_config", "provenance"}
    assert head["quantization"] == QUANT and head["quantization"]["symmetric"] is True
    assert json.loads(head["tokenizer_json"])["model"]["type"] == "BPE"
    # 1.3 zero padding up to D
    d = (24 + n + 4095) // 4096 * 4096
    assert raw[24 + n:d] == b"\0" * (d - 24 - n)
    # 2 + 4: the table, in section 4's order, increasing offsets, zero gaps, CRCs
    want = names_from_section_4(head["config"])
    table = head["tensors"]
    assert [(t["name"], t["dtype"], t["shape"]) for t in table] == want
    end = d
    for t in table:
        assert set(t) == {"name", "dtype", "shape", "offset", "nbytes", "crc32"}
        assert t["offset"] % 4096 == 0 and t["offset"] >= end
        assert raw[end:t["offset"]].count(0) == t["offset"] - end
        assert t["nbytes"] == math.prod(t["shape"]) * ITEM[t["dtype"]]
        data = raw[t["offset"]:t["offset"] + t["nbytes"]]
        assert len(data) == t["nbytes"] and t["crc32"] == f"{zlib.crc32(data):08x}"
        end = t["offset"] + t["nbytes"]
    assert end == len(raw)
    # 5 + 6: one projection decoded bit by bit from the diagram, one float tensor, against open_model
    by_name = {t["name"]: t for t in table}
    qw, sc = by_name["model.layers.1.mlp.down_proj.qweight"], by_name["model.layers.1.mlp.down_proj.scales"]
    words = struct.unpack_from(f"<{qw['nbytes'] // 4}I", raw, qw["offset"])
    scales = np.frombuffer(raw, "<f2", count=sc["nbytes"] // 2, offset=sc["offset"]).reshape(sc["shape"])
    rows, kw = qw["shape"]
    row = int(rng.integers(rows))
    u = []
    for word in words[row * kw:(row + 1) * kw]:
        nib = [(word >> (4 * j)) & 0xF for j in range(8)]  # bit fields 3..0, 7..4, ..., 31..28
        u += [nib[0], nib[2], nib[4], nib[6], nib[1], nib[3], nib[5], nib[7]]  # u[k+0..3], then u[k+4..7]
    w_row = [float(scales[row, k // 128]) * (u[k] - 8) for k in range(len(u))]
    norm = by_name["model.norm.weight"]
    with open_model(path) as m:
        np.testing.assert_array_equal(m.dequantize("model.layers.1.mlp.down_proj.weight")[row], np.float32(w_row))
        np.testing.assert_array_equal(
            m.tensor("model.norm.weight"), np.frombuffer(raw, "<f2", count=norm["shape"][0], offset=norm["offset"]))
        assert m.config == head["config"] and m.tokenizer_json == head["tokenizer_json"]


def test_worked_word_in_the_file(tmp_path):
    """The FORMAT.md example as bytes: u = 0..7 packs to 40 51 62 73."""
    from nanoqwen_format import pack_valueshuffle
    assert pack_valueshuffle(np.arange(8, dtype=np.uint8)[None]).tobytes().hex() == "40516273"
