"""Synthetic Qwen2 models for tests and benchmarks: tiny configs, random HF checkpoints, random .nanoqwen.

Weight scales (chosen so a random model behaves like a trained one where the tests look: greedy top-2 logit
margins well above fp16 noise, residual stream in the tens through 28 layers in fp16):

    projections  W [N, K]: rms 1/sqrt(K)  -> each projection keeps rms(out) ~ rms(in) ~ 1 after a norm
    norm weights         : 1 + N(0, 0.1^2)
    q/k/v biases         : N(0, 0.1^2)
    embed_tokens, lm_head: rms LOGIT_STD/sqrt(H) -> logits of rms ~LOGIT_STD, since the final norm
                           hands lm_head a vector of rms ~1 (write_synthetic: within a factor sqrt(2),
                           see _sign_uniform_fp16_chunks)

Every block adds ~1 rms to the residual stream (attention ~1, MLP ~0.6), a random walk: after 28 layers it
has rms ~6 and a max of a few tens. test_synthetic.py checks this with a float64 forward. Measured
(2026-11-30, write_synthetic, seed 3, 32 random tokens, tiny dims H 256):

    2 layers, vocab 152064 : max |activation| 7.8, residual rms 1.3, logit std 6.1, top-2 margin median 1.0
                             (tied 3.9), 10th percentile 0.27 (tied 0.30)
    28 layers, vocab 8192  : max |activation| 23, residual rms 5.3, logit std 6.2, margin median 1.9
                             (tied 1.2), 10th percentile 0.52 (tied 0.13)

against fp16 noise of ~1e-2 in a logit. For the 7B shape write_synthetic's embed/lm_head rms rounds to
2^-4 * 1.53 = 0.095, so logits have std ~5.7.
"""

import json
import math
from functools import cache
from pathlib import Path

import numpy as np

from .errors import NanoqwenFormatError
from .layout import GROUP, expected_tensors, source_tensors, validate_config
from .safetensors_io import SafetensorsWriter
from .writer import NanoqwenWriter

DATA = Path(__file__).parent / "data" / "qwen2.5-coder-7b-instruct"
LOGIT_STD = 5.0
NORM_STD = 0.1
BIAS_STD = 0.1
CHUNK = 16 << 20  # values generated per step: bounded memory for 7B shapes
Q_RMS = math.sqrt(17.5)  # rms of _qweight_chunks' q: mean(q^2) = 2 * (1 + 4 + ... + 49) / 16


def _load_json(name: str):
    return json.loads((DATA / name).read_text())


def qwen7b_config() -> dict:
    """The shipped Qwen2.5-Coder-7B-Instruct config.json."""
    return _load_json("config.json")


def shipped_tokenizer() -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config, generation_config) of Qwen2.5-Coder-7B-Instruct."""
    return ((DATA / "tokenizer.json").read_text(encoding="utf-8"), _load_json("tokenizer_config.json"),
            _load_json("generation_config.json"))


def tiny_config(**overrides) -> dict:
    """A real-looking Qwen2 config from the 7B one, tiny: hidden 256, intermediate 512, 2 layers, 2 heads,
    1 KV head (head_dim 128), the real vocab 152064. Overrides (e.g. tie_word_embeddings=True,
    num_hidden_layers=28, vocab_size=1024) win."""
    config = qwen7b_config()
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=152064, tie_word_embeddings=False)
    config.update(overrides)
    if "max_window_layers" not in overrides:
        config["max_window_layers"] = config["num_hidden_layers"]
    return validate_config(config)


@cache
def _normal_table() -> np.ndarray:
    """65536 standard-normal values (float32, fixed): a random uint16 indexes it, ~5x faster than
    Generator.standard_normal on the 2-core CI machine, so a 7B-shaped model is written in seconds."""
    return np.sort(np.random.default_rng(0x9E3779B9).standard_normal(65536)).astype(np.float32)


def _rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(seed))  # SFC64: ~5x the raw throughput of PCG64 here


def _normal_chunks(rng, shape, std: float, mean: float = 0.0, dtype=np.float32):
    """Chunks of whole rows, N(mean, std^2) in `dtype`, CHUNK values at most each (1-D: one chunk).

    The table is scaled and cast once, so each chunk is one gather (no float32 intermediates)."""
    rows = shape[0]
    cols = math.prod(shape[1:])
    step = max(1, CHUNK // max(cols, 1)) if len(shape) > 1 else rows
    table = (_normal_table() * np.float32(std) + np.float32(mean)).astype(dtype)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = (r1 - r0) * cols
        idx = rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]
        yield table[idx].reshape((r1 - r0, *shape[1:]))


def _sign_uniform_fp16_chunks(rng, shape, rms: float):
    """float16 chunks of +-[1, 2) * 2^e (random sign and mantissa, fixed exponent), e the power of two that
    brings the rms (sqrt(7/3) * 2^e) nearest to `rms`, so within a factor sqrt(2) of it.

    Why: pure bit operations on random words, ~10x the speed of the table gather on the 2-core machine
    here (13 s -> ~1 s for a 7B model's embed_tokens + lm_head); products with many such weights are
    Gaussian anyway (lm_head sums H of them per logit)."""
    e = round(math.log2(rms / math.sqrt(7 / 3)))
    if not -14 <= e <= 15:
        raise NanoqwenFormatError(f"synthetic rms {rms} is outside float16's normal range")
    exponent = np.uint16((e + 15) << 10)
    rows, cols = shape
    step = max(1, CHUNK // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = (r1 - r0) * cols
        bits = rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]
        bits &= np.uint16(0x83FF)  # keep sign (bit 15) and mantissa (bits 0..9)
        bits |= exponent
        yield bits.view(np.float16).reshape(r1 - r0, cols)


def _std(kind: str, shape, config) -> tuple[float, float]:
    """(mean, std) of a float tensor of this kind (module docstring)."""
    if kind == "norm":
        return 1.0, NORM_STD
    if kind == "bias":
        return 0.0, BIAS_STD
    if kind in ("embed", "lm_head"):
        return 0.0, LOGIT_STD / math.sqrt(config["hidden_size"])
    return 0.0, 1.0 / math.sqrt(shape[1])


def write_hf_checkpoint(dst, config: dict, seed: int = 0, dtype: str = "bfloat16", shards: int = 1) -> Path:
    """A synthetic Hugging Face Qwen2ForCausalLM folder with random weights, written tensor by tensor.

    config.json, generation_config.json, tokenizer.json, tokenizer_config.json and either model.safetensors
    or model-0000i-of-0000n.safetensors + model.safetensors.index.json (a tied model has no lm_head.weight).
    """
    config = validate_config(dict(config))
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = source_tensors(config)
    if not 1 <= shards <= len(tensors):
        raise NanoqwenFormatError(f"shards must be in 1..{len(tensors)}, got {shards}")
    config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tok_json, tok_config, gen_config = shipped_tokenizer()
    (dst / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
    # Split into `shards` runs of tensors of roughly equal bytes, in file order, as HF does.
    sizes = np.cumsum([math.prod(t.shape) for t in tensors])
    cuts = [int(np.searchsorted(sizes, sizes[-1] * j / shards, side="left")) + 1 for j in range(1, shards)]
    groups = np.split(np.arange(len(tensors)), sorted(set(min(c, len(tensors) - 1) for c in cuts)))
    shards = len(groups)
    rng = _rng(seed)
    weight_map, total = {}, 0
    for j, group in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        specs = [(tensors[i].hf_name, tensors[i].shape) for i in group]
        w = SafetensorsWriter(dst / fname, specs, dtype)
        try:
            for i in group:
                t = tensors[i]
                mean, std = _std(t.kind, t.shape, config)
                for chunk in _normal_chunks(rng, t.shape, std, mean):
                    w.write(chunk)
                weight_map[t.hf_name] = fname
        finally:
            w.close()
        total += w.total
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


def _qweight_chunks(rng, n: int, k: int):
    """Random ValueShuffle words uint32 [n, k/8] with a symmetric q: from a random nibble r, q = r - 7 for
    r < 8 (-7..0) and q = r - 8 for r >= 8 (0..7), so q is uniform on -7..7 except 0, which is twice as
    likely; mean 0, mean q^2 = 140/8. In stored form u = q + 8 = r + 1 when r's top bit is clear, else r:
    u = w + ((~w >> 3) & 0x11111111) on whole words (r + 1 <= 8 never carries out of its nibble).

    Why symmetric: raw random nibbles give q uniform in -8..7, mean -0.5. That bias is the same in every
    row, so each projection adds a common-mode term ~ sum(x) to all outputs; RMSNorm turns a common mode
    into an all-ones input, whose sum is ~K times larger, and the residual stream blew up (rms ~250 after
    28 layers of the tiny shape; test_synthetic.py)."""
    step = max(1, CHUNK // (k // 8))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        count = (r1 - r0) * (k // 8)
        w = rng.bit_generator.random_raw((count + 1) // 2).view(np.uint32)[:count]
        low = np.invert(w)
        low >>= np.uint32(3)
        low &= np.uint32(0x11111111)  # 1 in each nibble whose top bit was clear
        w += low
        yield w.reshape(r1 - r0, k // 8)


def write_synthetic(dst, config: dict, seed: int = 0, provenance: dict | None = None) -> Path:
    """A random .nanoqwen of any Qwen2 shape, straight to disk (no HF checkpoint), streaming.

    INT4 projections get random symmetric q (_qweight_chunks) and scales s = 1/(sqrt(17.5) sqrt(K)) x U(0.75, 1.25), so the
    dequantized weights have rms ~1/sqrt(K) like write_hf_checkpoint's; float tensors follow _std
    (embed_tokens and lm_head: +-[1, 2) * 2^e with a random sign and mantissa, for speed).
    The shipped Qwen2.5-Coder tokenizer, tokenizer_config and generation_config make it self-contained.
    """
    config = validate_config(dict(config))
    tok_json, tok_config, gen_config = shipped_tokenizer()
    from . import __version__
    prov = {"converter": f"nanoqwen-format {__version__}", "source": "synthetic", "seed": seed}
    prov.update(provenance or {})
    rng = _rng(seed)
    with NanoqwenWriter(dst, config, expected_tensors(config), tokenizer_json=tok_json,
                        tokenizer_config=tok_config, generation_config=gen_config, provenance=prov) as w:
        for t in source_tensors(config):
            if t.quantized:
                n, k = t.shape
                pre = t.hf_name.removesuffix(".weight")
                w.write_tensor(f"{pre}.qweight", _qweight_chunks(rng, n, k))
                base = 1.0 / (Q_RMS * math.sqrt(k))
                scales = (base * (0.75 + 0.5 * rng.random((n, k // GROUP), dtype=np.float32))).astype(np.float16)
                w.write_tensor(f"{pre}.scales", [scales])
            else:
                mean, std = _std(t.kind, t.shape, config)
                if t.kind in ("embed", "lm_head"):
                    w.write_tensor(t.hf_name, _sign_uniform_fp16_chunks(rng, t.shape, std))
                else:
                    w.write_tensor(t.hf_name, _normal_chunks(rng, t.shape, std, mean, np.float16))
    return Path(dst)
