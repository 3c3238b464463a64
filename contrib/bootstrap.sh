#!/bin/sh
# Installs what kdec needs to build (Debian 12, as root; elsewhere it prints the apt
# command), then configures and builds into build/ (or $KDEC_BUILD_DIR).
# Extra arguments go to ./configure, e.g. --enable-werror or --without-cuda.
set -eu
cd "$(dirname "$0")/.."
src=$(pwd)
build=${KDEC_BUILD_DIR:-$src/build}

pkgs="build-essential autoconf automake libtool pkg-config liburing-dev libev-dev
libzstd-dev libjansson-dev libmicrohttpd-dev clang libclang-rt-14-dev
curl python3-venv"
missing=
for p in $pkgs; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "bootstrap: missing packages:$missing" >&2
		echo "bootstrap: run as root, or: sudo apt-get install -y$missing" >&2
		exit 1
	fi
	echo "bootstrap: installing$missing" >&2
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q >/dev/null
	# shellcheck disable=SC2086
	apt-get install -y -q --no-install-recommends $missing >/dev/null
fi

[ -x "$src/configure" ] && [ "$src/configure" -nt "$src/configure.ac" ] || "$src/autogen.sh" >/dev/null 2>&1 || "$src/autogen.sh"
mkdir -p "$build"
cd "$build"
if [ ! -f Makefile ] || [ "$#" -gt 0 ]; then
	"$src/configure" -q "$@"
fi
make -s -j"$(nproc)"
echo "bootstrap: built in $build" >&2
