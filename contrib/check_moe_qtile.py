#!/usr/bin/env python3
"""A symbolic model of kernels/cuda/moe/moe_qtile.cu's index arithmetic, for checking a
change to it on a machine without a GPU (it is not the kernel: each formula is copied
here by hand, so keep the two in step).

Modelled: the loaders (a thread's global source and shared-memory place of each 16-byte
unit of weights and split x, with their swizzles), each lane's fragments (bf16 16
bytes as 4 pairs; fp8 16 bytes as 8 bf16 pairs; int4 word t of group G as 4 pairs in
ex_int4_bf16x8_perm's order, x chunks in split_perm_pos's), mma.sync m16n8k16's fragment
layout, the scale each partial sum is multiplied by (fp8: its slab; int4: its group),
the epilogue's (weight row, expert row) of each accumulator, the passes an expert's
CTAs take (xt_splits). Checked: every accumulator gets each k of its own weight row and
expert row exactly once per x part (hi, lo), under the scale of that k; the shared-memory
reads of a slab are free of bank conflicts; every pass of an expert runs in exactly one
of its CTAs. Not modelled: the values (the conversions are moe_grouped.cuh's, shared
with expert_mma_kernel), the pipeline's barriers, timing.

Usage: python3 contrib/check_moe_qtile.py (exit 1 on any error; ~40 s).
"""
import sys
from collections import defaultdict

XT_ROWS=128; XT_SB=64; GLU_FEATS=64
def xpos(j): return j ^ (((j >> 3) & 1) << 1)
def wpos(F, r, c): return c ^ ((r >> 1) & 3) if F=='int4' else c

def cfg(F, W=False):
    # W: the wide passes (64 expert rows, int4 32), else 16
    SLAB = 128 if F=='int4' else 64 if F=='fp8' else 32
    XROW = SLAB*4; UPR = XROW//16; XSTRIDE = XROW+16
    XROWS = 16 if not W else 32 if F=='int4' else 64
    W_BYTES = XT_ROWS*XT_SB; X_BYTES = XROWS*XSTRIDE
    return dict(SLAB=SLAB, XROW=XROW, UPR=UPR, XSTRIDE=XSTRIDE, W_BYTES=W_BYTES, X_BYTES=X_BYTES,
                XROWS=XROWS, NT=XROWS//8, XPT=XROWS*UPR//128)

def xt_row(GLU, r, f0):
    if GLU: return ((r>>4)&1, f0 + 16*(r>>5) + (r&15))
    return (2, f0 + r)

def run(F, GLU, K, N, f0, src_rows, slab_i, W):
    C = cfg(F, W)
    smem = {}  # byte offset -> symbol
    k0 = slab_i*C['SLAB']
    # weight loader: thread tid, j: row (tid>>2)+32j, unit tid&3
    for tid in range(128):
        wmat, wfeat = xt_row(GLU, tid>>2, f0)
        wstep = 16 if GLU else 32
        rb = K//2 if F=='int4' else K if F=='fp8' else 2*K
        wsrc = wfeat*rb + 16*(tid&3)        # byte offset in matrix wmat (as the kernel forms it)
        for j in range(4):
            r = (tid>>2) + 32*j
            m2, f2r = xt_row(GLU, r, f0)
            off = wsrc + (wstep*j)*rb + slab_i*XT_SB
            f2 = off // rb
            assert m2 == wmat and f2 == f2r, (r, m2, f2, wmat, f2r)
            dst = r*XT_SB + 16*wpos(F, r, tid&3)
            ok = wfeat + wstep*j < N
            for b in range(16):
                byte = off % rb + b   # byte within weight row
                if F=='fp8': sym = ('w', m2, f2, byte) if ok else ('z',)
                elif F=='bf16': sym = ('w', m2, f2, byte//2) if ok else ('z',)   # read at even bytes
                else: sym = ('w', m2, f2, 2*byte) if ok else ('z',)   # low nibble k, high k+1
                assert dst+b not in smem
                smem[dst+b] = sym
    # x loader
    for tid in range(128):
        for j in range(C['XPT']):
            u = tid + j*128; m = u // C['UPR']; q = u % C['UPR']
            src = src_rows[m] if m < len(src_rows) else -1
            dst = C['W_BYTES'] + m*C['XSTRIDE'] + 16*xpos(q)
            # global split row: bytes k0*4 + 16 q: chunk cc = (k0*4+16q)//32 in absolute, part = (16q//16)%2
            gbyte = k0*4 + 16*q
            cc = gbyte // 32; part = (gbyte // 16) % 2
            for b in range(0,16,2):
                # position b//2 of the chunk; int4 keeps values 0 2 4 6 1 3 5 7 there
                # (split_perm_pos), the others in order
                kk = cc*8 + ([0, 2, 4, 6, 1, 3, 5, 7][b//2] if F == 'int4' else b//2)
                sym = ('x', src, kk, 'hi' if part==0 else 'lo') if src >= 0 else ('z',)
                assert dst+b not in smem
                smem[dst+b] = sym
    return smem, C

def rd_w(F, smem, off, nbytes):
    return [smem[off+i] for i in range(nbytes)]

def fp8_pairs(bytes16):
    # 16 weight bytes -> 8 bf16 pairs in byte order: pair q = bytes 2q, 2q+1
    return [(bytes16[2*q], bytes16[2*q+1]) for q in range(8)]

def int4_pairs(bytes4):
    # a word of 8 nibbles (value v at nibble v: byte v//2, low nibble first) as
    # ex_int4_bf16x8_perm's pairs: (0, 2), (4, 6), (1, 3), (5, 7)
    def val(v):
        s = bytes4[v // 2]
        return ('z',) if s[0] == 'z' else ('w', s[1], s[2], s[3] + (v & 1))
    return [(val(a), val(b)) for a, b in ((0, 2), (4, 6), (1, 3), (5, 7))]

def xpair(x16, q):
    # 16 bytes of x (8 bf16): pair q = bf16 2q, 2q+1
    return (x16[2*q], x16[2*q+1])

def mma(lanes_A, lanes_B):
    # lanes_A[lane] = [a0,a1,a2,a3] each a pair (lo k, hi k) of symbols; lanes_B[lane] = [b0,b1]
    # returns per lane list of 4 accumulators, each a list of (wsym, xsym) products
    A = [[None]*16 for _ in range(16)]; B = [[None]*8 for _ in range(16)]
    for lane in range(32):
        g, t = lane>>2, lane&3
        a = lanes_A[lane]
        A[g][2*t], A[g][2*t+1] = a[0]; A[g+8][2*t], A[g+8][2*t+1] = a[1]
        A[g][2*t+8], A[g][2*t+9] = a[2]; A[g+8][2*t+8], A[g+8][2*t+9] = a[3]
        b = lanes_B[lane]
        B[2*t][g], B[2*t+1][g] = b[0]; B[2*t+8][g], B[2*t+9][g] = b[1]
    out = []
    for lane in range(32):
        g, t = lane>>2, lane&3
        cs = []
        for (i, j) in [(g, 2*t), (g, 2*t+1), (g+8, 2*t), (g+8, 2*t+1)]:
            cs.append([(A[i][kk], B[kk][j]) for kk in range(16)])
        out.append(cs)
    return out

def check(F, GLU, K, N, f0, rows_src, rows, W):
    # accumulate symbolic products per (warp, lane, mt, nt, c) with scale tag
    acc = defaultdict(list)
    C = cfg(F, W)
    assert rows <= C['XROWS']
    nst = K // C['SLAB']
    for si in range(nst):
        smem, C = run(F, GLU, K, N, f0, rows_src, si, W)
        k0 = si*C['SLAB']
        NT = (rows + 7) // 8    # the n8 tiles the pass's rows fill
        for warp in range(4):
            if F=='fp8':
                pa={}; pb={}
                for lane in range(32):
                    g,t=lane>>2,lane&3
                    for mt in range(2):
                        r = warp*32+mt*16+g
                        pa[lane,mt] = fp8_pairs(rd_w(F, smem, r*XT_SB+16*t, 16))
                        pb[lane,mt] = fp8_pairs(rd_w(F, smem, (r+8)*XT_SB+16*t, 16))
                for nt in range(NT):
                    xh={}; xl={}
                    for lane in range(32):
                        g,t=lane>>2,lane&3
                        xr = C['W_BYTES'] + (8*nt+g)*C['XSTRIDE']
                        h0=[smem[xr+16*xpos(4*t)+b] for b in range(0,16,2)]
                        l0=[smem[xr+16*xpos(4*t+1)+b] for b in range(0,16,2)]
                        h1=[smem[xr+16*xpos(4*t+2)+b] for b in range(0,16,2)]
                        l1=[smem[xr+16*xpos(4*t+3)+b] for b in range(0,16,2)]
                        xh[lane]=[xpair(h0,q) for q in range(4)]+[xpair(h1,q) for q in range(4)]
                        xl[lane]=[xpair(l0,q) for q in range(4)]+[xpair(l1,q) for q in range(4)]
                    for mt in range(2):
                        for s in range(4):
                            for X in (xh, xl):
                                LA=[[pa[l,mt][2*s], pb[l,mt][2*s], pa[l,mt][2*s+1], pb[l,mt][2*s+1]] for l in range(32)]
                                LB=[[X[l][2*s], X[l][2*s+1]] for l in range(32)]
                                res = mma(LA, LB)
                                for lane in range(32):
                                    for c in range(4):
                                        for prod in res[lane][c]:
                                            acc[warp,lane,mt,nt,c].append((prod, ('slab', si, mt, c>>1)))
            elif F=='bf16':
                pa={}; pb={}
                for lane in range(32):
                    g,t=lane>>2,lane&3
                    for mt in range(2):
                        r = warp*32+mt*16+g
                        va = rd_w(F, smem, r*XT_SB+16*t, 16)[0::2]
                        vb = rd_w(F, smem, (r+8)*XT_SB+16*t, 16)[0::2]
                        pa[lane,mt] = [(va[2*q], va[2*q+1]) for q in range(4)]
                        pb[lane,mt] = [(vb[2*q], vb[2*q+1]) for q in range(4)]
                for nt in range(NT):
                    xh={}; xl={}
                    for lane in range(32):
                        g,t=lane>>2,lane&3
                        xr = C['W_BYTES'] + (8*nt+g)*C['XSTRIDE']
                        h=[smem[xr+16*xpos(2*t)+b] for b in range(0,16,2)]
                        l=[smem[xr+16*xpos(2*t+1)+b] for b in range(0,16,2)]
                        xh[lane]=[xpair(h,q) for q in range(4)]; xl[lane]=[xpair(l,q) for q in range(4)]
                    for mt in range(2):
                        for X in (xh, xl):
                            for st in range(2):
                                LA=[[pa[l,mt][2*st], pb[l,mt][2*st], pa[l,mt][2*st+1], pb[l,mt][2*st+1]] for l in range(32)]
                                LB=[[X[l][2*st], X[l][2*st+1]] for l in range(32)]
                                res=mma(LA, LB)
                                for lane in range(32):
                                    for c in range(4):
                                        for prod in res[lane][c]:
                                            acc[warp,lane,mt,nt,c].append((prod, ('none',)))
            else:
                wa={}; wb={}
                for lane in range(32):
                    g,t=lane>>2,lane&3; rot=(g>>1)&3
                    for mt in range(2):
                        r = warp*32+mt*16+g
                        for G in range(4):
                            wa[lane,mt,G] = rd_w(F, smem, r*XT_SB+16*(G^rot)+4*t, 4)
                            wb[lane,mt,G] = rd_w(F, smem, (r+8)*XT_SB+16*(G^rot)+4*t, 4)
                for G in range(4):
                    for nt in range(NT):
                        xh={}; xl={}
                        for lane in range(32):
                            g,t=lane>>2,lane&3
                            xr = C['W_BYTES'] + (8*nt+g)*C['XSTRIDE']
                            h=[smem[xr+16*xpos(8*G+2*t)+b] for b in range(0,16,2)]
                            l=[smem[xr+16*xpos(8*G+2*t+1)+b] for b in range(0,16,2)]
                            xh[lane]=[xpair(h,q) for q in range(4)]; xl[lane]=[xpair(l,q) for q in range(4)]
                        for mt in range(2):
                            for X in (xh, xl):
                                for st in range(2):
                                    LA=[]
                                    for l in range(32):
                                        pa=int4_pairs(wa[l,mt,G]); pb=int4_pairs(wb[l,mt,G])
                                        LA.append([pa[2*st], pb[2*st], pa[2*st+1], pb[2*st+1]])
                                    LB=[[X[l][2*st], X[l][2*st+1]] for l in range(32)]
                                    res=mma(LA, LB)
                                    for lane in range(32):
                                        for c in range(4):
                                            for prod in res[lane][c]:
                                                acc[warp,lane,mt,nt,c].append((prod, ('grp', si, G, mt, c>>1)))
    # verify
    errors = 0; checked = 0
    for warp in range(4):
        for lane in range(32):
            g,t=lane>>2,lane&3
            for nt in range(C['NT']):
                for c in range(4):
                    m = 8*nt+2*t+(c&1)
                    for mt in range(2):
                        if GLU: mat, feat = mt, f0+16*warp+g+8*(c>>1)
                        else: mat, feat = 2, f0+32*warp+16*mt+g+8*(c>>1)
                        prods = acc.get((warp,lane,mt,nt,c), [])
                        if m >= rows or feat >= N:
                            continue
                        seen = defaultdict(int)
                        for (w, x), tag in prods:
                            if w[0]=='z' or x[0]=='z': continue
                            _, wm, wf, wk = w; _, xs, xk, part = x
                            if (wm, wf) != (mat, feat) or xs != rows_src[m] or wk != xk:
                                errors += 1; continue
                            # scale tag: fp8 per slab (k in slab), int4 per group
                            if tag[0]=='slab' and wk // 64 != tag[1]: errors += 1
                            if tag[0]=='grp' and wk // 32 != tag[1]*4 + tag[2]: errors += 1
                            seen[wk, part] += 1
                        # also any product with mismatched k (nonzero both) is an error: counted above
                        for k in range(K):
                            for part in ('hi','lo'):
                                if seen.get((k,part),0) != 1: errors += 1
                        checked += 1
    return errors, checked

def ways(addrs, width):
    """Bank conflict ways of one shared load: the most distinct 4-byte words a bank
    serves in one phase (16-byte loads: 8 lanes a phase, 8-byte: 16, 4-byte: 32)."""
    # addrs per lane (byte); width bytes; phases: 128-bit: 8 lanes, 64-bit: 16, 32-bit: 32
    per = {16: 8, 8: 16, 4: 32}[width]
    worst = 1
    for p0 in range(0, 32, per):
        banks = {}
        for l in range(p0, p0+per):
            for w in range(width//4):
                word = addrs[l]//4 + w
                banks.setdefault(word % 32, set()).add(word)
        worst = max(worst, max(len(v) for v in banks.values()))
    return worst
def bank_check():
    """The worst bank-conflict ways over a slab's shared loads (warp 0; the others the
    same at 32-row offsets): fp8 weights 16 bytes a lane, int4 4 bytes a lane of each
    group, x 16 bytes (hi or lo) a lane, int4 scales 8 (bf16) or 16 (fp32) bytes."""
    worst = 1
    for nt in range(8):     # bf16: x units 2t + h (weights as fp8's)
        for h in range(2):
            a = [(8*nt + (l>>2))*cfg('bf16')['XSTRIDE'] + 16*xpos(2*(l&3) + h) for l in range(32)]
            worst = max(worst, ways(a, 16))
    for F in ('fp8', 'int4'):
        XSTRIDE = cfg(F)['XSTRIDE']
        for mt in range(2):
            if F == 'fp8':
                a = [(mt*16 + (l>>2))*XT_SB + 16*(l&3) for l in range(32)]
                worst = max(worst, ways(a, 16))
            else:
                for G in range(4):
                    a = [(mt*16 + (l>>2))*XT_SB + 16*(G ^ (((l>>2)>>1)&3)) + 4*(l&3) for l in range(32)]
                    worst = max(worst, ways(a, 4))
                for h in range(2):
                    a = [(mt*16 + (l>>2) + 8*h)*16 for l in range(32)]
                    worst = max(worst, ways(a, 8), ways(a, 16))
        for nt in range(8 if F == 'fp8' else 4):     # the widest pass's n8 tiles
            if F == 'fp8':
                for i in range(4):
                    a = [(8*nt + (l>>2))*XSTRIDE + 16*xpos(4*(l&3) + i) for l in range(32)]
                    worst = max(worst, ways(a, 16))
            else:
                for G in range(4):
                    for h in range(2):
                        a = [(8*nt + (l>>2))*XSTRIDE + 16*xpos(8*G + 2*(l&3) + h) for l in range(32)]
                        worst = max(worst, ways(a, 16))
    return worst


def xt_splits(M, R, max_used, split=0):
    # the host's rule (moe_qtile.cu's xt_splits)
    want = split if split > 0 else min(8, max(1, (M + R - 1)//R))
    return min(want, 65535 // max(max_used, 1))


def split_check():
    """Each used expert's passes over the CTAs of grid.y = max_used * splits: block y takes
    expert y // splits from row (y % splits) * R in steps of splits * R. Every pass start
    of every expert exactly once, none past its rows; grid.y within 65535."""
    err = 0
    for R in (16, 32, 64):
        for M in (1, 2, 8, 64, 65, 130, 256, 511, 2048, 4096):
            for max_used, split in ((1, 0), (8, 0), (128, 0), (384, 0), (4096, 0),
                                    (128, 1), (128, 3), (4096, 64), (64, 64)):
                S = xt_splits(M, R, max_used, split)
                err += S < 1 or max_used * S > 65535
                for n in (1, R - 1, R, R + 1, 3*R + 2, M):
                    starts = []
                    for y in range(S):      # one expert's CTAs
                        first = y * R
                        if first >= n:
                            continue        # the early return
                        starts += list(range(first, n, S * R))
                    err += sorted(starts) != list(range(0, n, R))
    return err


if __name__ == '__main__':
    tot = 0
    for F in ('bf16', 'fp8', 'int4'):
        for GLU in (True, False):
            K = {'int4': 256, 'fp8': 128, 'bf16': 64}[F]    # two slabs
            # (N, the CTA's first feature, expert rows, wide): a full tile, a tile past
            # N, a pass of 16 rows, one of 9 (two n8 tiles, the second part-filled); wide
            # passes full and part-filled
            wr = 32 if F == 'int4' else 64
            cases = ((200, 0, 5, False), (100, 64, 16, False), (130, 0, 9, False),
                     (200, 0, wr, True), (100, 64, wr - 23, True)) if GLU else \
                    ((256, 0, 5, False), (200, 128, 16, False), (130, 0, 9, False),
                     (256, 0, wr, True), (200, 128, wr - 23, True))
            for N, f0, rows, W in cases:
                src = [(37*i + 5) % 97 for i in range(rows)]
                e, n = check(F, GLU, K, N, f0, src, rows, W)
                print(F, 'gate/up' if GLU else 'down', 'K', K, 'N', N, 'f0', f0, 'rows', rows,
                      'wide' if W else 'narrow', 'errors', e, 'accumulators', n)
                tot += e
    w = bank_check()
    print('slab reads: at most %d-way bank conflicts' % w)
    se = split_check()
    print('passes over split CTAs: errors', se)
    sys.exit(1 if tot or w > 1 or se else 0)
