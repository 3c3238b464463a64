#!/bin/sh
# test_cuda_golden.sh with forms that are off by default: the bf16 linears of up to 8
# rows on the ring GEMV (KDEC_LINEAR_RING=8: the quantized decode GEMV's kernel on bf16,
# SwiGLU formed in the down projection) and the RMSNorms folded into the GEMVs after them
# (KDEC_NORM_IN_GEMV=1): they hold the references too (the ring measured slower than
# cuBLAS on Llama-3.1-8B, its streaming form 1-5% faster on the MoE models' bf16 steps
# in session 26; kept for the per-shape choice that would use it). KDEC_LINEAR_SMALL_MB=0: the golden models' matrices
# are all small, which would keep them on the GEMV and split-K kernels; the ring kind
# runs once on each of its kernels (KDEC_LINEAR_RING_STREAM 0: the decode GEMV, 2: the
# cluster streaming form wherever it has a plan). test_golden exits 77 where there is
# no GPU or no CUDA build. test_golden sees KDEC_LINEAR_SMALL_MB=0 and has its CPU
# reference round every linear input to bf16, one row or more, as these kernels do.
for s in 0 2; do
	KDEC_TEST_BACKEND=cuda KDEC_LINEAR_RING=8 KDEC_NORM_IN_GEMV=1 KDEC_LINEAR_SMALL_MB=0 \
		KDEC_LINEAR_RING_STREAM=$s "${top_builddir:-.}/tests/test_golden" || exit $?
done
