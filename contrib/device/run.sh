#!/bin/bash
# Runs the GPU checks of a build carried to the GPU machine (docs: DEVICE workflow):
#   device run: bash contrib/device/run.sh   with carry: ["build"]
# The machine lacks libev (kdecd needs it): copy it into build/devlibs beforehand with
#   mkdir -p build/devlibs && cp /lib/x86_64-linux-gnu/libev.so.4 build/devlibs/
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=${KDEC_BUILD_DIR:-build}
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
export LD_LIBRARY_PATH="$PWD/$B/devlibs${nccl:+:$nccl/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export top_srcdir=$PWD top_builddir=$PWD/$B
out=${OUT:-/tmp}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for t in test_cuda_smoke test_golden test_synthetic; do
	"$B/tests/$t" >"$out/$t.log" 2>&1
	rc=$?
	echo "$t: exit $rc ($(tail -n 1 "$out/$t.log"))"
	[ $rc -eq 0 ] || status=1
done
"$B/kdbench" generate --model tests/data/golden/llama3 --prompt 113,124,11,408,469 --max-tokens 32
"$B/kdecd" --model tests/data/golden/llama3 --check || status=1
exit $status
