"""The int8-activation GEMV loop's numbers in numpy: how it rounds an activation (round_a8) and the "a8 image"
that gate/up hands down_proj already rounded (a8_image, a8_image_values). The twins of cuda/gemv_a8.cuh and
cuda/gemv_a8_image.cuh that the GPU tests compare against and the engine's host stand-ins compute with.
"""

from __future__ import annotations

import numpy as np

from .errors import KernelError

A8_BLOCK = 16  # k per int8 scale of the int8-activation loop (half of a 16-byte piece of a weight row)
A8_PIECE = 32  # k per piece: the image's layout unit (two scales)
A8_ACC_START = 0x04B40000  # kA8AccStart: a block's dp4a accumulator starts here (16 x it = the bits of 1.5 * 2^23)


def _round_blocks(x: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """x (fp16 values) rounded as the int8 loop rounds it, per A8_BLOCK k: (x_int float32 [..., K/A8_BLOCK,
    A8_BLOCK], amax float32 [..., K/A8_BLOCK, 1]); x_int = rint(x * (127 / amax)) in float32 (ties to even,
    as the kernel's magic-number rounding), 0 where amax is 0."""
    xf = np.asarray(x, dtype=np.float16).astype(np.float32)
    k = xf.shape[-1]
    if k % A8_PIECE:
        raise KernelError(f"{what}: K = {k} is not a multiple of {A8_PIECE}")
    g = xf.reshape(*xf.shape[:-1], k // A8_BLOCK, A8_BLOCK)
    amax = np.abs(g).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    return np.rint((g * inv.astype(np.float32)).astype(np.float32)), amax


def round_a8(x: np.ndarray) -> np.ndarray:
    """What the int8-activation loop ("a8") multiplies the weights with, as float32 [..., K]: x (the staged
    fp16 activation, normed when the GEMV norms) rounded to int8 per A8_BLOCK k with one scale each,
    scale = amax / 127 and x_int = rint(x * (127 / amax)) in float32 (ties to even, as the kernel's
    __float2int_rn), 0 where amax is 0. The kernel then sums q * x_int exactly and multiplies by scale
    times the weights' group scale in fp32."""
    q, amax = _round_blocks(x, "round_a8")
    return (q * (amax / np.float32(127)).astype(np.float32)).astype(np.float32).reshape(np.shape(x))


def a8_image_bytes(k: int) -> int:
    """Bytes of the a8 image of an activation of K values: K of int8, then 8 per A8_BLOCK (K * 3 / 2)."""
    return k + 8 * (k // A8_BLOCK)


def a8_image(x: np.ndarray) -> np.ndarray:
    """The "a8 image" of one activation x [K] (fp16 values): what nq_gate_up_silu_a8x writes for down_proj
    and nq_gemv_int4_i_a8x stages as it is, uint8 [a8_image_bytes(K)]: K bytes of int8 x laid out
    [2][K/32][16] (byte i of half h of piece u is x_int[32u + 16h + i]), then per A8_BLOCK b = 2u + h (half
    h of piece u) an int32 pair {float bits of scale_b / 16, A8_ACC_START - 8 sum x_int} (the accumulator's
    start), little-endian. The rounding is round_a8's."""
    qf, amax = _round_blocks(np.reshape(x, -1), "a8_image")
    q, amax = qf.astype(np.int32), amax[:, 0]
    k = q.size
    xq = q.astype(np.int8).reshape(k // A8_PIECE, 2, 16).transpose(1, 0, 2).reshape(-1).view(np.uint8)
    meta = np.empty((k // A8_BLOCK, 2), dtype=np.int32)
    meta[:, 0] = ((amax / np.float32(127)).astype(np.float32) * np.float32(0.0625)).astype(np.float32).view(np.int32)
    meta[:, 1] = A8_ACC_START - 8 * q.sum(axis=1)
    return np.concatenate([xq, meta.reshape(-1).view(np.uint8)])


def a8_image_values(img: np.ndarray, k: int) -> np.ndarray:
    """The activation an a8 image stands for, float32 [K] (equal to round_a8 of the x it was made from)."""
    b = np.asarray(img, dtype=np.uint8).reshape(-1)
    if k % A8_PIECE or b.shape[0] < a8_image_bytes(k):
        raise KernelError(f"a8_image_values: {b.shape[0]} bytes cannot hold the image of K = {k}")
    q = b[:k].view(np.int8).reshape(2, k // A8_PIECE, 16).transpose(1, 0, 2).reshape(k // A8_BLOCK, A8_BLOCK)
    meta = b[k:a8_image_bytes(k)].view(np.int32).reshape(k // A8_BLOCK, 2)
    scale = meta[:, 0].view(np.float32) * np.float32(16)
    return (q.astype(np.float32) * scale[:, None]).astype(np.float32).reshape(k)
