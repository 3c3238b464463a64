#!/usr/bin/env python3
"""What K_CUDA_LINEAR_Q_LT8 (kernels/cuda/linear/linear_qlt8.cu) does to x, on the CPU.

The fp8 tensor-core GEMM multiplies e4m3 activations. One e4m3 value per element keeps
4 significant bits; the kernel splits x into two e4m3 rows per 128-value block
(x ~ s1 q1 + s2 q2, q2 the e4m3 of what q1 leaves). This prints the worst relative L2
error per row of x and of y = x @ w^T (w exact) for: x rounded to f16 (the tile and GEMV
kinds), to bf16 (the dense path), one e4m3 row, and the split, on Gaussian activations,
Gaussian with rare 60x outliers, and log-normal magnitudes. Needs numpy and ml_dtypes
(pip; not used by kdec itself). Usage: python3 contrib/device/lt8_split_emu.py
"""
import numpy as np
import ml_dtypes

E4M3 = ml_dtypes.float8_e4m3fn


def e4m3(v):
    return v.astype(E4M3).astype(np.float32)


def block_scale(b):
    a = np.abs(b).max(-1, keepdims=True)
    return np.where(a > 0, a / np.float32(448), np.float32(1)).astype(np.float32)


def split(x):
    """The split as lq8_split_kernel computes it; returns (one row, both rows)."""
    m, k = x.shape
    b = x.reshape(m, k // 128, 128)
    s1 = block_scale(b)
    hi = e4m3(b / s1) * s1
    r = b - hi
    s2 = block_scale(r)
    lo = e4m3(r / s2) * s2
    return hi.reshape(m, k), (hi + lo).reshape(m, k)


def worst_rel(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.sqrt(((a - b) ** 2).sum(1) / (b ** 2).sum(1)).max())


def main():
    rng = np.random.default_rng(1)
    m, k, n = 64, 4096, 512
    gens = {
        "gaussian": lambda: rng.standard_normal((m, k)),
        "outliers": lambda: rng.standard_normal((m, k)) * np.where(rng.random((m, k)) < 0.002, 60, 1),
        "log-normal": lambda: rng.standard_normal((m, k)) * np.exp(1.5 * rng.standard_normal((m, k))),
    }
    w = rng.standard_normal((n, k)).astype(np.float32)
    print(f"M {m} K {k} N {n}: worst row relative L2 error of x | of y = x @ w^T")
    print(f"{'x':<11} {'f16':>9} {'bf16':>9} {'e4m3':>9} {'split':>9} | {'f16':>9} {'bf16':>9} {'e4m3':>9} {'split':>9}")
    for name, gen in gens.items():
        x = gen().astype(np.float32)
        one, two = split(x)
        forms = [x.astype(np.float16).astype(np.float32),
                 x.astype(ml_dtypes.bfloat16).astype(np.float32), one, two]
        y = x.astype(np.float64) @ w.T.astype(np.float64)
        ex = [worst_rel(f, x) for f in forms]
        ey = [worst_rel(f.astype(np.float64) @ w.T.astype(np.float64), y) for f in forms]
        print(f"{name:<11} " + " ".join(f"{e:9.2e}" for e in ex) + " | " +
              " ".join(f"{e:9.2e}" for e in ey))


if __name__ == "__main__":
    main()
