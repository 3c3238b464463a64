#!/usr/bin/env python3
# A check of kernels/cuda/moe/moe_qmma.{cuh,cu} without a GPU (written in session 10,
# when none was lent): (1) a model of one warp's mma.m16n8k16 fragments with the split
# activations' layout (mqm_unit, mqm_pack8, mqm_put16) and the conversions' value
# orders (k_dq_e4m3x4, k_dq_i4x8_raw): each lane's D[g][2t] + D[g][2t + 1] must be its
# own chunk's dot products, and the 8 lanes that load B must hit 8 distinct bank
# groups; (2) the two kernels' control flow transliterated lane by lane (items, cursors,
# groups of pairs, staging, reductions, the act layout between the launches, the
# epilogue) against a float64 reference of the experts, fp8 128 x 128 and int4 g32, with
# duplicates, bad ids, idle warps and several units a warp. Not a substitute for
# test_cuda_moe_q on a GPU: barriers, races and registers are not modelled. Keep it in
# step with the kernels. Usage: python3 contrib/check_moe_qmma.py (~40 s).
import math, random
import numpy as np
def model_unit(F, s, blk, u):
    NU = (16 if F == 'fp8' else 32) // 8
    key = ((blk >> 1) & 3) if F == 'int4' else ((blk >> 2) & 1)
    return (s * 8 + blk) * NU + (u ^ key)
def model_pack8(F, v, h):
    out = []
    for pos in range(8):
        i = (pos >> 1) + 4 * (pos & 1) if F == 'int4' else pos
        out.append(v[i] if h == 0 else 0.001 * v[i])  # lo part: tagged copy
    return out  # 8 halves = 4 words (2 halves each)
def model_put16(F, row, k0, v):
    VPC = 16 if F == 'fp8' else 32
    c, gh = k0 // VPC, k0 % VPC // 16
    for h in range(2):
        for uu in range(2):
            row[model_unit(F, c // 4, 2 * (c % 4) + h, 2 * gh + uu)] = model_pack8(F, v[8 * uu:8 * uu + 8], h)
def check(F, K=256):
    VPC = 16 if F == 'fp8' else 32
    S = K // (4 * VPC)
    x = [random.randint(-50, 50) for _ in range(K)]
    W = [[random.randint(-8, 7) for _ in range(K)] for _ in range(16)]
    row = {}
    for k0 in range(0, K, 16):
        model_put16(F, row, k0, x[k0:k0 + 16])
    for s in range(S):
        NG = VPC // 16
        for gr in range(NG):
            D = {}  # lane -> 4
            for lane in range(32): D[lane] = [0, 0, 0, 0]
            for mp in range(4 * gr, 4 * gr + 4, 2):
                A = {}; Bw = {}
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    c = 4 * s + t
                    a = []
                    for r in (g, g + 8):
                        vals = W[r][c * VPC:(c + 1) * VPC]
                        if F == 'fp8':
                            wd = lambda i: [(vals[4*i], vals[4*i+1]), (vals[4*i+2], vals[4*i+3])]
                            a.append(wd(mp) + wd(mp + 1))
                        else:
                            w = mp // 2
                            a.append([(vals[8*w+p], vals[8*w+p+4]) for p in range(4)])
                    A[lane] = a
                    if t == g // 2:
                        u = row[model_unit(F, s, g, mp // 2)]
                        Bw[lane] = [(u[0], u[1]), (u[2], u[3]), (u[4], u[5]), (u[6], u[7])]
                    else:
                        Bw[lane] = [(0, 0)] * 4
                for sub in range(2):  # MMA mp + sub
                    Am = [[0] * 16 for _ in range(16)]; Bm = [[0] * 8 for _ in range(16)]
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        ag, ag8 = A[lane]
                        a0, a2 = ag[2 * sub], ag[2 * sub + 1]
                        a1, a3 = ag8[2 * sub], ag8[2 * sub + 1]
                        Am[g][2*t], Am[g][2*t+1] = a0; Am[g+8][2*t], Am[g+8][2*t+1] = a1
                        Am[g][2*t+8], Am[g][2*t+9] = a2; Am[g+8][2*t+8], Am[g+8][2*t+9] = a3
                        b0, b1 = Bw[lane][2 * sub], Bw[lane][2 * sub + 1]
                        Bm[2*t][g], Bm[2*t+1][g] = b0; Bm[2*t+8][g], Bm[2*t+9][g] = b1
                    Dm = [[sum(Am[r][k] * Bm[k][n] for k in range(16)) for n in range(8)] for r in range(16)]
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for i, (r, n) in enumerate(((g, 2*t), (g, 2*t+1), (g+8, 2*t), (g+8, 2*t+1))):
                            D[lane][i] += Dm[r][n]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                c = 4 * s + t
                ks = range(c * VPC + 16 * gr, c * VPC + 16 * gr + 16)
                for ri, r in enumerate((g, g + 8)):
                    want = sum(W[r][k] * x[k] for k in ks)
                    hi, lo = D[lane][2 * ri], D[lane][2 * ri + 1]
                    assert abs(hi - want) < 1e-6 and abs(lo - 0.001 * want) < 1e-6, (F, s, gr, lane, r, hi, lo, want)
    # factor index used by qm_step: (4 s + t) * NG + gr == k0 / 16
    for s in range(S):
        for t in range(4):
            for gr in range(VPC // 16):
                assert (4*s+t)*(VPC//16)+gr == ((4*s+t)*VPC + 16*gr)//16
    # bank groups of the 8 loading lanes distinct per (s, u)
    for s in range(S):
        for u in range((VPC) // 8):
            banks = {model_unit(F, s, g, u) % 8 for g in range(8)}
            assert len(banks) == 8, (F, s, u, banks)
    print('warp model', F, 'ok')

SMW = 8
def VPCf(F): return 16 if F == 'fp8' else 32
def mqm_unit(F, s, blk, u):
    NU = VPCf(F) // 8
    key = ((blk >> 1) & 3) if F == 'int4' else ((blk >> 2) & 1)
    return (s * 8 + blk) * NU + (u ^ key)
def order(F):  # value index within 8 for position pos
    return [((p >> 1) + 4 * (p & 1)) if F == 'int4' else p for p in range(8)]
def f16(x): return float(np.float16(x))
def put16(F, row, fac, base, fbase, k0, v):
    VPC = VPCf(F); mx = max(abs(a) for a in v)
    m, E = math.frexp(mx) if mx > 0 else (0, 0)
    E = max(-110, min(126, E))
    f = 2.0 ** (15 - E)
    c, gh = k0 // VPC, k0 % VPC // 16
    for h in range(2):
        for uu in range(2):
            vals = []
            for pos in range(8):
                x = v[8 * uu + order(F)[pos]] * f
                hi = f16(x); vals.append(hi if h == 0 else f16(x - hi))
            row[base + mqm_unit(F, c // 4, 2 * (c % 4) + h, 2 * gh + uu)] = vals
    fac[fbase + k0 // 16] = 2.0 ** (E - 15)
def lane_partial(F, wrow, s, t, gr, brow, boff, fac, scale):
    # lane (g, t): chunk c = 4s + t of weight row wrow (values), group gr; B through the
    # loading lanes (g', g'/2 == t): blk 2t + h, units of the chunk; factor at boff/4 + c*NG + gr
    VPC = VPCf(F); NG = VPC // 16; c = 4 * s + t
    tot = 0.0
    for h in range(2):
        for u in range(VPC // 8):
            unit = brow[boff + mqm_unit(F, s, 2 * t + h, u)]
            for pos in range(8):
                q = 8 * u + order(F)[pos]  # value index in chunk
                if q // 16 == gr:
                    tot += wrow[c * VPC + q] * unit[pos]
    return tot * fac[boff // 4 + c * NG + gr] * scale
def plan(ids, n, E):
    idv = [v if 0 <= v < E else -1 for v in ids[:n]]
    used = sorted(set(v for v in idv if v >= 0))
    sorted_pairs = [i for e in used for i in range(n) if idv[i] == e]
    start, cnt = [], []
    for e in used:
        start.append(sum(1 for v in idv if 0 <= v < e)); cnt.append(idv.count(e))
    return used, start, cnt, sorted_pairs, idv
def groups(used, cnt, qp):
    G = []
    for u in range(len(used)):
        for p in range(0, cnt[u], qp): G.append((u, p, min(qp, cnt[u] - p)))
    return G
def run(F, hidden, inter, E, top_k, M, ids, wts, W, S_, x, ctas, qp, NPP=2):
    VPC = VPCf(F); n = M * top_k
    used, start, cnt, srt, idv = plan(ids, n, E)
    pair = lambda G, q, j: srt[start[G[q][0]] + G[q][1] + j]
    # gate/up
    G = groups(used, cnt, qp)
    nc = hidden // VPC; S = nc // 4; NUI = (S + SMW - 1) // SMW; T = inter // 16
    xu, xg = hidden // 4, hidden // 16
    act = {}; afac = {}
    for b in range(ctas):
        items = len(G) * T; lo = items * b // ctas; hi = items * (b + 1) // ctas
        K = (hi - lo) * NUI
        xs = {}; xf = {}
        acc = [[[[0.0] * 4 for _ in range(NPP)] for _ in range(32)] for _ in range(SMW)]
        red = {}
        # consume order: k = 0..K-1, each k all warps (barriers line up)
        cur = [lo, lo // T, lo % T, 0]
        for k in range(K):
            it, q, x0, j = cur
            cur[3] += 1
            if cur[3] == NUI:
                cur[3] = 0; cur[0] += 1; cur[2] += 1
                if cur[2] == T: cur[2] = 0; cur[1] += 1
            f0 = x0 * 16
            same = False
            if it != lo and f0 == 0 and G[q][2] == G[q-1][2]:
                same = all(pair(G, q, jj) // top_k == pair(G, q-1, jj) // top_k for jj in range(G[q][2]))
            if j == 0 and (it == lo or f0 == 0) and not same:
                for i in range(G[q][2] * xg):
                    jj, k0 = i // xg, i % xg * 16
                    tok = pair(G, q, jj) // top_k
                    put16(F, xs, xf, jj * xu, jj * xg, k0, list(x[tok][k0:k0 + 16]))
            u = G[q][0]; e = used[u]; npp = G[q][2]
            for w in range(SMW):
                s = w + SMW * j
                if s < S:
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for p in range(npp):
                            for m in range(2):
                                for r in range(2):
                                    row = f0 + g + 8 * r
                                    c = 4 * s + t
                                    sc = S_[e][m](row, c * VPC)
                                    for gr in range(VPC // 16):
                                        acc[w][lane][p][2*m+r] += lane_partial(F, W[e][m][row], s, t, gr, xs, p * xu, xf, sc)
            if j == NUI - 1:
                buf = (it - lo) & 1
                for w in range(SMW):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        if t == 0:
                            for p in range(npp):
                                for m in range(2):
                                    for r in range(2):
                                        quad = sum(acc[w][4*g+tt][p][2*m+r] for tt in range(4))
                                        red[(buf, p, m, g + 8*r, w)] = quad
                    acc[w] = [[[0.0] * 4 for _ in range(NPP)] for _ in range(32)]
                for jj in range(npp):
                    vt = []
                    for r in range(16):
                        gs = sum(red[(buf, jj, 0, r, w)] for w in range(SMW))
                        us = sum(red[(buf, jj, 1, r, w)] for w in range(SMW))
                        vt.append(gs / (1 + math.exp(-gs)) * us)
                    i = pair(G, q, jj)
                    put16(F, act, afac, i * (inter // 4), i * (inter // 16), f0, vt)
    # down
    Gd = groups(used, cnt, NPP)
    nc = inter // VPC; S = nc // 4; NUI = (S + 2 * SMW - 1) // (2 * SMW)
    out = np.zeros((M, hidden))
    for b in range(hidden // 16):
        c0 = 16 * b; red = {}
        for q in range(len(Gd)):
            for j in range(NUI):
                u = Gd[q][0]; e = used[u]; npp = Gd[q][2]
                for w in range(SMW):
                    s0 = w + 2 * SMW * j
                    for h in range(2):
                        s = s0 + SMW * h
                        if s >= S: break
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            for p in range(npp):
                                i = pair(Gd, q, p)
                                for r in range(2):
                                    row = c0 + g + 8 * r; c = 4 * s + t
                                    sc = S_[e][2](row, c * VPC)
                                    for gr in range(VPC // 16):
                                        red[(i, g + 8*r, w)] = red.get((i, g + 8*r, w), 0.0) + \
                                            lane_partial(F, W[e][2][row], s, t, gr, act, i * (inter // 4), afac, sc)
        for m in range(M):
            for col in range(16):
                a = 0.0
                for i in srt:
                    if i // top_k == m:
                        y = sum(red.get((i, col, w), 0.0) for w in range(SMW))
                        a += y * wts[i]
                out[m, c0 + col] = a
    return out
def reference(F, hidden, inter, E, top_k, M, ids, wts, W, S_, x):
    VPC = VPCf(F)
    out = np.zeros((M, hidden))
    for m in range(M):
        for j in range(top_k):
            i = m * top_k + j; e = ids[i]
            if not (0 <= e < E): continue
            deq = lambda mat, rows, cols: np.array([[W[e][mat][r][k] * S_[e][mat](r, k) for k in range(cols)] for r in range(rows)])
            gw, uw, dw = deq(0, inter, hidden), deq(1, inter, hidden), deq(2, hidden, inter)
            gv, uv = gw @ x[m], uw @ x[m]
            a = gv / (1 + np.exp(-gv)) * uv
            out[m] += wts[i] * (dw @ a)
    return out
def case(F, M, dup, bad, ctas, qp, seed):
    random.seed(seed); np.random.seed(seed)
    hidden, inter, E, top_k = (256, 128, 6, 3) if F == 'int4' else (128, 128, 6, 3)
    W = {}; S_ = {}
    for e in range(E):
        W[e] = []
        for mat in range(3):
            N, K = (inter, hidden) if mat < 2 else (hidden, inter)
            W[e].append(np.random.randint(-8, 8, size=(N, K)).astype(float))
        if F == 'int4':   # g32 scales per (row, k // 32)
            tabs = [np.random.uniform(0.002, 0.006, size=(inter if mat < 2 else hidden, 64)) for mat in range(3)]
            S_[e] = [ (lambda tb: (lambda r, k: tb[r][k // 32]))(tb) for tb in tabs ]
        else:             # 128 x 128 blocks
            tabs = [np.random.uniform(0.002, 0.006, size=(4, 4)) for mat in range(3)]
            S_[e] = [ (lambda tb: (lambda r, k: tb[r // 128][k // 128]))(tb) for tb in tabs ]
    ids = []
    for m in range(M):
        ids += random.sample(range(E), top_k)
    if dup: ids[1] = ids[0]
    if bad: ids[-1] = E + 2
    wts = [random.uniform(0.1, 0.9) for _ in ids]
    x = np.random.uniform(-2, 2, size=(M, hidden))
    got = run(F, hidden, inter, E, top_k, M, ids, wts, W, S_, x, ctas, qp)
    ids_ref = [v if 0 <= v < E else -1 for v in ids]
    want = reference(F, hidden, inter, E, top_k, M, ids_ref, wts, W, S_, x)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(F, 'M', M, 'dup' if dup else '', 'bad' if bad else '', 'ctas', ctas, 'qp', qp, 'rel %.2e' % rel, 'OK' if rel < 1e-5 else 'FAIL')
    failures.append(rel >= 1e-5)
failures = []
random.seed(1)
check('fp8'); check('int4')
for F in ('fp8', 'int4'):
    case(F, 1, False, False, 7, 2, 1)
    case(F, 1, True, True, 5, 2, 2)
    case(F, 3, True, True, 11, 1, 3)
    case(F, 2, False, False, 3, 2, 4)
def case2(F, hidden, inter, M, ctas, seed):
    random.seed(seed); np.random.seed(seed)
    E, top_k = 5, 2
    W = {}; S_ = {}
    for e in range(E):
        W[e] = [np.random.randint(-8, 8, size=((inter, hidden) if mat < 2 else (hidden, inter))).astype(float) for mat in range(3)]
        if F == 'int4':
            tabs = [np.random.uniform(0.002, 0.006, size=(inter if mat < 2 else hidden, 64)) for mat in range(3)]
            S_[e] = [(lambda tb: (lambda r, k: tb[r][k // 32]))(tb) for tb in tabs]
        else:
            tabs = [np.random.uniform(0.002, 0.006, size=(16, 16)) for mat in range(3)]
            S_[e] = [(lambda tb: (lambda r, k: tb[r // 128][k // 128]))(tb) for tb in tabs]
    ids = []
    for m in range(M): ids += random.sample(range(E), top_k)
    wts = [random.uniform(0.1, 0.9) for _ in ids]
    x = np.random.uniform(-2, 2, size=(M, hidden)) * 300.0   # large: the factors matter
    got = run(F, hidden, inter, E, top_k, M, ids, wts, W, S_, x, ctas, 2)
    want = reference(F, hidden, inter, E, top_k, M, ids, wts, W, S_, x)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(F, hidden, inter, 'M', M, 'ctas', ctas, 'rel %.2e' % rel, 'OK' if rel < 1e-5 else 'FAIL')
    failures.append(rel >= 1e-5)
case2('fp8', 640, 256, 2, 9, 5)
case2('int4', 1152, 256, 2, 13, 6)
raise SystemExit(1 if any(failures) else 0)
