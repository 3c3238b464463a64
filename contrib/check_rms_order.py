#!/usr/bin/env python3
"""A model of the order in which kernels/cuda/ops/rmsnorm_rs.cuh's k_rms_rs_cta adds a
row's squares, against rmsnorm.cu's block kernel (256 threads, thread t summing
elements t, t + 256, ... in turn, an xor-shuffle tree a warp, the 8 warps' sums in
order): the kernels that fold the norm into their x staging (the quantized GEMV, 128
threads; the streaming form, 256) must get the same fp64 sum, hence the same rs, so
their outputs match the norm kernel's bit for bit. Each formula is copied here by hand
from the header (keep the two in step); Python floats are IEEE doubles and each square
of an fp32 value is exact in them, as on the GPU.

Checked: for rows past the warp order's 1024 values (whole and partial chunks of 16 x
256, widths of the supported models), both CTA sizes give the block kernel's sum to
the last bit; the butterfly leaves one value in every lane. A mutation (a chunk's
values added in another order) is caught on a row made for it.

Usage: python3 contrib/check_rms_order.py (exit 1 on any difference; a few seconds).
"""
import random
import struct
import sys

BLOCK, CHUNK = 256, 16


def f32(v):
    return struct.unpack('f', struct.pack('f', v))[0]


def xor_tree(lanes):
    v = list(lanes)
    o = 16
    while o:
        v = [v[l] + v[l ^ o] for l in range(32)]
        o //= 2
    assert all(x == v[0] for x in v), 'the butterfly left lanes apart'
    return v[0]


def block_kernel(x):
    dim, parts = len(x), []
    for w in range(BLOCK // 32):
        lanes = []
        for l in range(32):
            ss = 0.0
            for i in range(w * 32 + l, dim, BLOCK):
                ss += x[i] * x[i]
            lanes.append(ss)
        parts.append(xor_tree(lanes))
    s = 0.0
    for p in parts:
        s += p
    return s


def rs_cta(x, threads, mutate=False):
    dim, vt, nw = len(x), BLOCK // threads, threads // 32
    part = [None] * (BLOCK // 32)
    for warp in range(nw):
        ss = [[0.0] * 32 for _ in range(vt)]
        for c0 in range(0, dim, CHUNK * BLOCK):
            for l in range(32):
                for j in range(vt):
                    ks = range(CHUNK)[::-1] if mutate and c0 == 0 else range(CHUNK)
                    for k in ks:
                        i = c0 + (warp + j * nw) * 32 + l + k * BLOCK
                        v = x[i] if i < dim else 0.0
                        ss[j][l] += v * v
        for j in range(vt):
            part[warp + j * nw] = xor_tree(ss[j])
    s = 0.0
    for p in part:
        s += p
    return s


def main():
    rnd = random.Random(18)
    bad = 0
    for dim in (1056, 2048, 4096, 5120, 7168, 5000, 16384):
        x = [f32(rnd.gauss(0, 1) * 10 ** rnd.uniform(-3, 3)) for _ in range(dim)]
        ref = block_kernel(x)
        for threads in (128, 256):
            got = rs_cta(x, threads)
            if got != ref:
                print(f'dim {dim}, {threads} threads: {got!r} != {ref!r}')
                bad += 1
    # a row whose sum depends on the order: 1, then fifteen squares of 2^-54 that vanish
    # one at a time after it but add up to 2^-50 before it
    x = [0.0] * 4096
    x[0] = 1.0
    for k in range(1, CHUNK):
        x[k * BLOCK] = 2.0 ** -27
    if rs_cta(x, 128, mutate=True) == block_kernel(x):
        print('a chunk added backwards went unnoticed: the check is too weak')
        bad += 1
    print('rms order: ' + ('ok' if not bad else f'{bad} differences'))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
