#!/usr/bin/env python3
"""Writes the GGUF fixtures test_gguf reads (run by hand; the outputs are committed).

  tests/data/gguf/dequant.gguf  for each type kdec loads, a tensor 'q.<TYPE>' of 3 or 5
                                rows and beside it 'ref.<TYPE>' (F32): the same values
                                dequantized by the gguf package's numpy code (gguf.quants),
                                the oracle test_gguf compares gguf_dequant against.
  tests/data/gguf/meta.gguf     one key of every metadata value type, arrays of each
                                element type (strings included) and two small tensors;
                                small, so test_gguf can try every prefix of it.
  tests/fuzz/corpus/gguf/types.gguf  a fuzz seed: one block of each loadable type plus
                                a Q3_K one, no alignment key.

Needs: pip install gguf numpy (written against gguf 0.19). Deterministic (fixed seed).
Usage: python3 tests/make_gguf_fixtures.py [outdir]
"""
import os
import sys

import numpy as np
from gguf import GGUFWriter, GGUFValueType as VT, GGMLQuantizationType as TT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "data", "gguf")
rng = np.random.default_rng(20261129)


def finite_halves(n, lo, hi):
    """n random float16 values in [lo, hi) as raw bytes (scales of a quantized block)."""
    return rng.uniform(lo, hi, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)


def kquant_blocks(qtype, n_blocks):
    """Random K-quant blocks (gguf.quants cannot quantize K types): random quant bits and
    scales, with the f16 super-block scales set to finite values so nothing is inf/NaN."""
    _, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype in (TT.Q4_K, TT.Q5_K):		# d, dmin lead the block
        b[:, 0:2] = finite_halves(n_blocks, -0.02, 0.02)
        b[:, 2:4] = finite_halves(n_blocks, 0.0, 0.01)
    elif qtype == TT.Q6_K:			# d closes it
        b[:, size - 2:size] = finite_halves(n_blocks, -0.01, 0.01)
    return b


def values(n):
    x = rng.standard_normal(n).astype(np.float32)
    x[::7] *= 30.0		# some spread, so the block scales differ
    return x


def special_floats():
    """Values that exercise F16/BF16 corners: zeros, subnormals, limits, inf."""
    return np.array([0.0, -0.0, 1.0, -2.5, 65504.0, -65504.0, 6.1035e-05, 5.96e-08, -5.96e-08,
                     3.0e-06, np.inf, -np.inf, 1e-40, 3.4e38, 0.33333334, -7.0e-3],
                    dtype=np.float32)


def tensor_pair(w, qtype, rows, row_len):
    n = rows * row_len
    if qtype in (TT.Q4_K, TT.Q5_K, TT.Q6_K):
        be, _ = GGML_QUANT_SIZES[qtype]
        q = kquant_blocks(qtype, n // be).reshape(rows, -1)
    else:
        x = values(n)
        if qtype in (TT.F16, TT.BF16):
            x[:16] = special_floats()
        x = x.reshape(rows, row_len)
        with np.errstate(over="ignore"):	# 3.4e38 becomes inf in F16, on purpose
            q = x.astype(np.float16) if qtype == TT.F16 else quantize(x, qtype)
        if qtype == TT.F32:
            q = x
    ref = dequantize(q, qtype).astype(np.float32).reshape(rows, row_len)
    if qtype in (TT.F32, TT.F16):
        w.add_tensor("q." + qtype.name, q)
    else:
        w.add_tensor("q." + qtype.name, q, raw_dtype=qtype)
    w.add_tensor("ref." + qtype.name, ref)


def write_dequant():
    w = GGUFWriter(os.path.join(OUT, "dequant.gguf"), "kdec-test")
    for qtype, rows, row_len in ((TT.F32, 3, 40), (TT.F16, 5, 40), (TT.BF16, 3, 40),
                                 (TT.Q8_0, 5, 64), (TT.Q4_0, 3, 96), (TT.Q4_1, 5, 64),
                                 (TT.Q4_K, 3, 512), (TT.Q5_K, 5, 256), (TT.Q6_K, 3, 512)):
        tensor_pair(w, qtype, rows, row_len)
    finish(w)


def write_meta():
    w = GGUFWriter(os.path.join(OUT, "meta.gguf"), "kdec-test")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.15625)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_uint64("t.u64", 18000000000000000000)
    w.add_int64("t.i64", -9000000000000000000)
    w.add_float64("t.f64", -1.0e300)
    w.add_key_value("t.arr_str", ["", "a", "<|im_start|>", "Ġthe", "é"], VT.ARRAY, VT.STRING)
    w.add_key_value("t.arr_i32", [1, -2, 2147483647], VT.ARRAY, VT.INT32)
    w.add_key_value("t.arr_u8", [0, 255], VT.ARRAY, VT.UINT8)
    w.add_key_value("t.arr_u64", [18000000000000000000, 5], VT.ARRAY, VT.UINT64)
    w.add_key_value("t.arr_f32", [0.5, -1.25], VT.ARRAY, VT.FLOAT32)
    w.add_key_value("t.arr_f64", [1.0e-300], VT.ARRAY, VT.FLOAT64)
    w.add_key_value("t.arr_bool", [True, False, True], VT.ARRAY, VT.BOOL)
    w.add_custom_alignment(64)	# writes general.alignment (u32) and pads to it
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b.q8", quantize(values(32).reshape(1, 32), TT.Q8_0), raw_dtype=TT.Q8_0)
    finish(w)


def write_fuzz_seed():
    w = GGUFWriter(os.path.join(os.path.dirname(__file__), "fuzz", "corpus", "gguf",
                                "types.gguf"), "llama")
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "a", "b"], VT.ARRAY, VT.STRING)
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    for qtype in (TT.F32, TT.F16, TT.BF16, TT.Q8_0, TT.Q4_0, TT.Q4_1):
        x = values(32).reshape(1, 32)
        if qtype == TT.F32:
            w.add_tensor("w." + qtype.name, x)
        elif qtype == TT.F16:
            w.add_tensor("w." + qtype.name, x.astype(np.float16))
        else:
            w.add_tensor("w." + qtype.name, quantize(x, qtype), raw_dtype=qtype)
    for qtype in (TT.Q4_K, TT.Q5_K, TT.Q6_K, TT.Q3_K):
        w.add_tensor("w." + qtype.name, kquant_blocks(qtype, 1), raw_dtype=qtype)
    finish(w)


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    write_dequant()
    write_meta()
    write_fuzz_seed()
