#!/usr/bin/env python3
"""kdec's logits for a GGUF model against an independent implementation of the same
file: Hugging Face transformers' GGUF loading (dequantized to float32, its own
modeling code). Not needed to build or test kdec; needs torch (CPU), transformers
and gguf from pip.

  contrib/gguf_reference.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
      [--kdbench build/kdbench] [--write tests/data/smollm2]

Tokenizes a fixed passage (English prose and some C) with transformers' tokenizer for
that GGUF, runs both, and prints per position the relative L2 error of kdec's logits,
top-1 agreement, and the passage's perplexity both ways. --write stores the compact
reference that tests/test_gguf_model.c checks when the model is present:
  reference.json  tokens, sizes, provenance
  reference.bin   int32 top_ids[T][K], float32 top_logits[T][K], float32 lse[T],
                  float32 next_logit[T] (logit of token t+1 at row t; 0 for the last)
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

PASSAGE = """The lighthouse keeper wrote the weather into a ledger every morning: the
direction of the wind, the height of the swell, and whether the fishing boats had gone
out before dawn. Over forty years the ledger grew into a small library, and the
harbour office began to ask for it whenever a storm was forecast, because the old
pages showed how the bay behaved when the pressure fell quickly.

A short C function that counts the words in a line of text:

static int count_words(const char *s)
{
	int n = 0, in_word = 0;

	for (; *s; s++) {
		if (*s == ' ' || *s == '\\t' || *s == '\\n') {
			in_word = 0;
		} else if (!in_word) {
			in_word = 1;
			n++;
		}
	}
	return n;
}

Readers who try it on an empty string get zero, and a line of spaces also gives zero,
which is what the keeper would have wanted for the days when nothing happened at all.
"""

TOP_K = 20


def log(*a):
    print(*a, file=sys.stderr)


def reference_logits(gguf_path, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long))
    return out.logits[0].float().numpy()


def kdec_logits(kdbench, gguf_path, tokens, vocab):
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        subprocess.run([kdbench, "logits", "--model", gguf_path, "--tokens",
                        ",".join(map(str, tokens)), "--out", f.name], check=True)
        return np.fromfile(f.name, dtype=np.float32).reshape(len(tokens), vocab)


def lse(x):
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def perplexity(logits, tokens):
    nll = lse(logits[:-1]) - logits[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(nll.mean()))


def write_reference(outdir, gguf_path, tokens, ref):
    import torch
    import transformers

    os.makedirs(outdir, exist_ok=True)
    t = len(tokens)
    ids = np.argsort(-ref, axis=1, kind="stable")[:, :TOP_K].astype(np.int32)
    top = np.take_along_axis(ref, ids, axis=1).astype(np.float32)
    nxt = np.zeros(t, dtype=np.float32)
    nxt[:-1] = ref[np.arange(t - 1), tokens[1:]]
    with open(os.path.join(outdir, "reference.bin"), "wb") as f:
        f.write(ids.tobytes())
        f.write(top.tobytes())
        f.write(lse(ref).astype(np.float32).tobytes())
        f.write(nxt.tobytes())
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    meta = {
        "gguf": os.path.basename(gguf_path),
        "gguf_sha256": h.hexdigest(),
        "made_by": "contrib/gguf_reference.py: transformers %s, torch %s, float32"
                   % (transformers.__version__, torch.__version__),
        "top_k": TOP_K,
        "n_tokens": t,
        "vocab": int(ref.shape[1]),
        "perplexity": perplexity(ref, np.array(tokens)),
        "tokens": [int(x) for x in tokens],
    }
    with open(os.path.join(outdir, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    log("wrote %s/reference.{json,bin}" % outdir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--kdbench", default="build/kdbench")
    ap.add_argument("--write", metavar="DIR", help="store the compact reference in DIR")
    ap.add_argument("--no-kdec", action="store_true", help="reference only")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    d, name = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    tokens = tok(PASSAGE, add_special_tokens=False)["input_ids"]
    log("%d tokens" % len(tokens))
    ref = reference_logits(a.gguf, tokens)
    if a.write:
        write_reference(a.write, a.gguf, tokens, ref)
    if a.no_kdec:
        return
    got = kdec_logits(a.kdbench, a.gguf, tokens, ref.shape[1])
    rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    top1 = got.argmax(1) == ref.argmax(1)
    for t in range(len(tokens)):
        print("pos %3d  rel L2 %.3e  top-1 %s" % (t, rel[t], "ok" if top1[t] else "DIFF"))
    toks = np.array(tokens)
    print("positions %d: top-1 agreement %.4f; rel L2 median %.3e, p99 %.3e, max %.3e"
          % (len(tokens), top1.mean(), np.median(rel), np.percentile(rel, 99), rel.max()))
    print("perplexity: transformers %.4f, kdec %.4f" % (perplexity(ref, toks), perplexity(got, toks)))


if __name__ == "__main__":
    main()
