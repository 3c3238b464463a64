#!/bin/sh
# Fetches cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
# wheels of PyPI; the toolkit here ships neither) into
# ${KDEC_CACHE:-$HOME/.cache/kdec}/cuda-tools and prints their folder. tests/pdl_order.sh
# disassembles the built kernels with them. 13.2 is the oldest release on PyPI; it reads
# the sm_90a code of nvcc 13.0. Run again: it skips a complete install.
set -eu
ver=13.2.86
cache=${KDEC_CACHE:-$HOME/.cache/kdec}
dest=$cache/cuda-tools
bin=$dest/nvidia/cu13/bin

if [ -x "$bin/cuobjdump" ] && [ -x "$bin/nvdisasm" ]; then
	echo "$bin"
	exit 0
fi
command -v python3 >/dev/null || { echo "fetch-cuobjdump: python3 (pip) is needed" >&2; exit 1; }
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.cuda-tools.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --target "$tmp" \
	"nvidia-cuda-cuobjdump==$ver" "nvidia-cuda-nvdisasm==$ver" >&2 ||
	{ echo "fetch-cuobjdump: cannot install the $ver wheels from PyPI" >&2; exit 1; }
chmod +x "$tmp/nvidia/cu13/bin/"*
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "$bin"
