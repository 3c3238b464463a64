#!/bin/sh
# Fetches the vocabulary-only GGUF files of GPT-2, Llama 3, Qwen2 and DeepSeek LLM that llama.cpp keeps
# for its tokenizer tests, out of the PyPI sdist of llama-cpp-python 0.3.36 (77 MB), into
# ${KDEC_CACHE:-$HOME/.cache/kdec}/vocab/ for tests/test_tokenizer. URL and sha256 from
# PyPI's JSON API; files appear atomically; a second run skips what is there.
set -eu
cache=${KDEC_CACHE:-$HOME/.cache/kdec}/vocab
names="gpt-2 llama-bpe qwen2 deepseek-llm"

have=1
for n in $names; do [ -s "$cache/ggml-vocab-$n.gguf" ] || have=0; done
if [ $have = 1 ]; then
	echo "$cache"
	exit 0
fi
command -v python3 >/dev/null || { echo "fetch-vocabs: python3 is needed to fetch and unpack the sdist" >&2; exit 1; }
mkdir -p "$cache"
python3 - "$cache" $names <<'PY'
import hashlib, json, os, sys, tarfile, tempfile, urllib.parse, urllib.request

cache, names = sys.argv[1], sys.argv[2:]
api = "https://pypi.org/pypi/llama-cpp-python/json"  # its "releases" lists every version's files
try:
    meta = json.load(urllib.request.urlopen(api, timeout=30))
    files = meta["releases"]["0.3.36"]
    sdist = next(u for u in files if u["packagetype"] == "sdist")
    with tempfile.TemporaryFile(dir=cache) as f:
        h = hashlib.sha256()
        with urllib.request.urlopen(urllib.parse.urljoin(api, sdist["url"]), timeout=60) as r:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
        if h.hexdigest() != sdist["digests"]["sha256"]:
            sys.exit("fetch-vocabs: %s: sha256 mismatch" % sdist["filename"])
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r:gz") as tar:
            for m in tar:
                base = os.path.basename(m.name)
                if not m.isfile() or "/vendor/llama.cpp/models/" not in m.name or \
                        not any(base.startswith("ggml-vocab-%s.gguf" % n) for n in names):
                    continue
                fd, tmp = tempfile.mkstemp(dir=cache, prefix=".vocab-")
                with os.fdopen(fd, "wb") as out:
                    out.write(tar.extractfile(m).read())
                os.chmod(tmp, 0o644)
                os.rename(tmp, os.path.join(cache, base))
except (OSError, ValueError, KeyError, StopIteration, tarfile.TarError) as e:
    sys.exit("fetch-vocabs: cannot fetch llama-cpp-python 0.3.36 from PyPI (%s: %s)" % (type(e).__name__, e))
PY
echo "$cache"
