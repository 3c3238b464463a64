#!/usr/bin/env python3
"""Writes tests/data/tokenizer/<family>.json: the ids Hugging Face `tokenizers` gives for
a corpus (below), and `apply_chat_template` texts, for each byte-level BPE family kdec
supports whose vocabulary is at hand (SmolLM2, GPT-2, Llama 3, Qwen2, DeepSeek LLM);
splits.json: the pieces each pre-tokenizer (DeepSeek V3's too) cuts the corpus into,
and NFC pairs; smollm2_greedy.*: transformers' greedy answer of SmolLM2 to one chat
turn (tests/text_daemon.sh). tests/test_tokenizer.c compares libkdclient against them.
Run by hand (about 3 minutes; --no-generate skips the generation):

    pip install tokenizers transformers gguf jinja2
    contrib/fetch-smollm2.sh && contrib/fetch-vocabs.sh
    python3 contrib/make_tokenizer_fixtures.py

The reference tokenizers are built in HF `tokenizers` from each GGUF's vocabulary and
merges with the pre-tokenizer, normalizer and BPE options the family's tokenizer.json
declares. Where llama.cpp ships the family's .inp/.out test pair (ids produced by the
original tokenizer.json), the script checks the rebuilt tokenizer against it first and
stops on any difference. For SmolLM2 it also reports what transformers' own GGUF
conversion (AutoTokenizer.from_pretrained(gguf_file=...)) gets wrong: it drops the
Digits step of SmolLM2's pre-tokenizer."""
import json
import os
import sys
import unicodedata

import gguf
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, Regex

CACHE = os.environ.get("KDEC_CACHE", os.path.expanduser("~/.cache/kdec"))
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "tokenizer")

CORPUS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing spaces   ",
    "  two leading spaces and  two  inside",
    "tabs\tand\t\tmore tabs\t",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline\r\n\r\nbreaks",
    "   \n   \n\t \n ",
    "\n",
    " ",
    "     ",
    "mixed \t \n  \n\n   spacing    here",
    # contractions, both cases
    "it's, don't, we're, they've, I'm, you'll, he'd",
    "IT'S, DON'T, WE'RE, THEY'VE, I'M, YOU'LL, HE'D",
    "It'S wE'Re 'tis ''s",
    # numbers
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 12345678901 123456789012",
    "3.14159 -0.5 +2e10 1,000,000 0x1F 007 99.99%",
    "version 2.0.1, 10:45pm, 2024-06-01",
    "a1b22c333d4444",
    "a  1  22   333",
    # accents, combining marks, scripts
    "café naïve résumé façade Ångström Zürich",
    "e\u0301 a\u0308 n\u0303 combining marks",
    "NFC: A\u0301\u0327 q\u0307\u0323 \u1e0b\u0323 \u1100\u1161\u11a8 \u0958 \u2126 \u212b \u0340 o\u0308\u0304",
    "Привет, мир! Ελληνικά γράμματα",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트입니다",
    "مرحبا بالعالم",
    "हिन्दी देवनागरी",
    "١٢٣ ٤٥٦ ⅷ ½ ²",
    # emoji, ZWJ sequences, flags, skin tones, variation selectors
    "emoji 😀 😂👍🏽",
    "family 👨‍👩‍👧‍👦 and 🏳️‍🌈 and ❤️",
    "flags 🇫🇷🇯🇵",
    "zero\u200bwidth and\u00a0nbsp and\u3000ideographic space",
    # code
    "int main(void)\n{\n\tprintf(\"hi %d\\n\", 42);\n\treturn 0;\n}\n",
    "def f(x):\n    if x > 0:\n        return x ** 2  # square\n    return -x\n",
    "for (i = 0; i < n; i++) { a[i] += b[i] * c; }",
    "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "print('it''s')  ;; ~~~ !!! ??? ... --- ___ ===",
    "   indented with spaces\n\tindented with tab\n",
    "URL: https://example.com/path?q=1&r=two#frag",
    # special tokens written in the text
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>text<|endoftext|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "almost <|im_start and <|im_end |>",
    # long runs
    " " * 40 + "x",
    "a" * 50,
    "\n" * 12,
]

CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "  Tell me a joke.  \n"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi there."}], False),
]

# pre-tokenizers as the families' tokenizer.json files declare them
GPT2_BYTELEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")

FAMILIES = {
    # name: (gguf path, pre-tokenizer, normalizer, ignore_merges, llama.cpp test pair)
    "smollm2": (os.environ.get("KDEC_SMOLLM2_GGUF",
                               os.path.join(CACHE, "SmolLM2-135M-Instruct.Q4_1.gguf")),
                pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), GPT2_BYTELEVEL]),
                None, False, None),
    "gpt2": (os.path.join(CACHE, "vocab", "ggml-vocab-gpt-2.gguf"), GPT2_BYTELEVEL, None, False,
             "ggml-vocab-gpt-2.gguf"),
    "llama3": (os.path.join(CACHE, "vocab", "ggml-vocab-llama-bpe.gguf"),
               pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_RE), "isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
               None, True, "ggml-vocab-llama-bpe.gguf"),
    "qwen2": (os.path.join(CACHE, "vocab", "ggml-vocab-qwen2.gguf"),
              pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_RE), "isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
              normalizers.NFC(), False, "ggml-vocab-qwen2.gguf"),
}

DEEPSEEK3_RES = [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                 "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
                 r"[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_unicode_tables import DEEPSEEK_LLM_LETTERS  # noqa: E402

DEEPSEEK_LLM_RES = ["[\r\n]", "\\s?[" + DEEPSEEK_LLM_LETTERS + "]+", "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
                    "\\s+$", "[一-龥ࠀ-一가-퟿]+", "\\p{N}+"]


def split_sequence(patterns):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in patterns] +
                                   [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# The pre-tokenizers alone (no vocabulary needed): tests/data/tokenizer/splits.json
SPLITTERS = {
    "smollm2": FAMILIES["smollm2"][1],
    "gpt2": GPT2_BYTELEVEL,
    "llama3": FAMILIES["llama3"][1],
    "qwen2": FAMILIES["qwen2"][1],
    "deepseek3": split_sequence(DEEPSEEK3_RES),
    "deepseek_llm": split_sequence(DEEPSEEK_LLM_RES),
}
FAMILIES["deepseek_llm"] = (os.path.join(CACHE, "vocab", "ggml-vocab-deepseek-llm.gguf"),
                            split_sequence(DEEPSEEK_LLM_RES), None, False, "ggml-vocab-deepseek-llm.gguf")

CONTROL, USER_DEFINED = 3, 4


def field(r, key):
    f = r.fields.get(key)
    if f is None:
        return None
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def build(path, pre, norm, ignore_merges):
    r = gguf.GGUFReader(path)
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    if norm is not None:
        tok.normalizer = norm
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)])
    bos = field(r, "tokenizer.ggml.bos_token_id")
    add_bos = field(r, "tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = ignore_merges  # llama.cpp's default: BOS for Llama 3 only
    return tok, r, (bos if add_bos else None), field(r, "tokenizer.chat_template")


def check_llamacpp_pair(tok, name):
    """llama.cpp's .inp/.out: ids from the original tokenizer.json (no BOS)."""
    base = os.path.join(CACHE, "vocab", name)
    if not os.path.exists(base + ".inp"):
        return "no llama.cpp test pair"
    texts = open(base + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outs = open(base + ".out", encoding="utf-8").read().split("\n")
    bad = 0
    for text, want in zip(texts, outs):
        got = tok.encode(text, add_special_tokens=False).ids
        if got != [int(x) for x in want.split()]:
            bad += 1
            print("  differs from llama.cpp's reference: %r: %s vs %s" % (text, got, want), file=sys.stderr)
    if bad:
        sys.exit("%s: the rebuilt reference tokenizer differs on %d of %d strings" % (name, bad, len(texts)))
    return "matches llama.cpp's %d reference strings" % len(texts)


# Meta's Llama 3 Instruct template (the llama-bpe vocabulary file carries none)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def chat_cases(tok, tmpl, bos_text, eos_text):
    """apply_chat_template's text (transformers) for each conversation."""
    if not tmpl:
        return []
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos_text or None,
                                 eos_token=eos_text or None)
    hf.chat_template = tmpl
    return [{"messages": msgs, "add_generation_prompt": gen,
             "text": hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)}
            for msgs, gen in CONVERSATIONS]


def smollm2_transformers_note(path, tok):
    """Where transformers' GGUF conversion disagrees with the rebuilt tokenizer."""
    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - a note only
        return "transformers could not load the GGUF (%s)" % e
    diff = [s for s in CORPUS if hf.encode(s, add_special_tokens=False) != tok.encode(s, add_special_tokens=False).ids]
    return ("transformers' GGUF conversion equals the rebuilt tokenizer on the corpus" if not diff else
            "transformers' GGUF conversion drops SmolLM2's Digits pre-tokenizer step and differs on %d "
            "corpus lines, e.g. %r" % (len(diff), diff[0]))


GREEDY_PROMPT = "Write a haiku about the sea."
GREEDY_MAX_TOKENS = 64


def smollm2_greedy(path, tok, tmpl):
    """transformers' greedy answer of SmolLM2 (weights dequantised from the GGUF) to one
    chat turn, for tests/text_daemon.sh: the prompt ids, the output ids, the text."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.chat_template = tmpl
    prompt = hf.apply_chat_template([{"role": "user", "content": GREEDY_PROMPT}], tokenize=False,
                                    add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    eot = tok.token_to_id("<|im_end|>")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_MAX_TOKENS, do_sample=False,
                             eos_token_id=eot, pad_token_id=eot)[0, len(ids):].tolist()
    answer = tok.decode([i for i in out if i != eot], skip_special_tokens=True)
    with open(os.path.join(OUT, "smollm2_greedy.txt"), "w", encoding="utf-8") as f:
        f.write("# contrib/make_tokenizer_fixtures.py: transformers %s greedy generation, float32\n"
                "# weights dequantised from %s, one user turn in the chat template\n"
                % (__import__("transformers").__version__, os.path.basename(path)))
        f.write("prompt=%s\nmax_tokens=%d\nstop_id=%d\nprompt_ids=%s\noutput_ids=%s\n" % (
            GREEDY_PROMPT, GREEDY_MAX_TOKENS, eot, ",".join(map(str, ids)), ",".join(map(str, out))))
    with open(os.path.join(OUT, "smollm2_greedy.out"), "w", encoding="utf-8") as f:
        f.write(answer + "\n")
    print("smollm2 greedy: %r" % answer)


# NFC's corners: composition through marks of other classes, reordering, blocking,
# Hangul by arithmetic, composition exclusions and singletons, a mark at the start.
NFC_CASES = [
    "\u0327A\u0301", "A\u0327\u0301", "A\u0301\u0327", "a\u0301\u0301", "a\u0308\u0301\u0323",
    "\u1100\u1161", "\u1100\u1161\u11a8", "\uac00\u11a8", "\u1100\u1161\u11a8\u11a8",
    "\u0958\u0929\u0928\u093c", "\u2126\u212a\u212b\u1fbe\u0340\u0341\u0343\u0344",
    "\u0b47\u0b3e \u0b47\u0b57 \u0dd9\u0dcf\u0dca", "\u1026\u102e", "e\u0302\u0301 \u1ec7",
    "\U0001d15e \U0001d160 \U0001109a", "\u0f73\u0f75\u0f81", "\u3099\u304b\u3099",
]


def write_splits():
    """Byte lengths of the pieces each pre-tokenizer cuts every corpus line into."""
    doc = {"reference": "HF tokenizers %s pre_tokenize_str" % __import__("tokenizers").__version__,
           "corpus": CORPUS, "deepseek3_patterns": DEEPSEEK3_RES,
           "deepseek_llm_patterns": DEEPSEEK_LLM_RES, "splits": {},
           "nfc": [[t, unicodedata.normalize("NFC", t)] for t in CORPUS + NFC_CASES]}
    for name, pre in SPLITTERS.items():
        rows = []
        for text in CORPUS:
            rows.append([len(text[a:b].encode("utf-8")) for _, (a, b) in pre.pre_tokenize_str(text)])
        doc["splits"][name] = rows
    with open(os.path.join(OUT, "splits.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print("splits: %d pre-tokenizers x %d lines" % (len(SPLITTERS), len(CORPUS)))


def main():
    os.makedirs(OUT, exist_ok=True)
    write_splits()
    if "--splits-only" in sys.argv:
        return
    for name, (path, pre, norm, ignore_merges, pair) in FAMILIES.items():
        if not os.path.exists(path):
            print("%s: %s missing, skipped (run contrib/fetch-smollm2.sh / fetch-vocabs.sh)" % (name, path))
            continue
        tok, r, bos, tmpl = build(path, pre, norm, ignore_merges)
        note = check_llamacpp_pair(tok, pair) if pair else smollm2_transformers_note(path, tok)
        cases = []
        for text in CORPUS:
            plain = tok.encode(text, add_special_tokens=False).ids
            case = {"text": text, "ids": plain}
            # without KD_TOKENIZE_SPECIAL special tokens are plain text
            tok_split = Tokenizer.from_str(tok.to_str())
            tok_split.encode_special_tokens = True
            nospecial = tok_split.encode(text, add_special_tokens=False).ids
            if nospecial != plain:
                case["ids_no_special"] = nospecial
            if norm is not None and norm.normalize_str(text) != text:
                case["normalized"] = True  # NFC changes it; kdec does not normalise
            cases.append(case)
        tokens = field(r, "tokenizer.ggml.tokens")
        eos = field(r, "tokenizer.ggml.eos_token_id")
        bos_id = field(r, "tokenizer.ggml.bos_token_id")
        if name == "llama3" and not tmpl:
            tmpl = LLAMA3_TEMPLATE
        doc = {
            "family": name,
            "file": os.path.basename(path),
            "reference": "HF tokenizers %s, transformers apply_chat_template; %s" % (
                __import__("tokenizers").__version__, note),
            "bos_added": bos,
            "cases": cases,
            "chat_template": tmpl if name == "llama3" else None,
            "chat": chat_cases(tok, tmpl, tokens[bos_id] if bos_id is not None else "",
                               tokens[eos] if eos is not None else ""),
        }
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=0)
            f.write("\n")
        print("%s: %d cases, %d chats; %s" % (name, len(cases), len(doc["chat"]), note))
        if name == "smollm2" and "--no-generate" not in sys.argv:
            smollm2_greedy(path, tok, tmpl)


if __name__ == "__main__":
    main()
