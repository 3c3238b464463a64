#!/usr/bin/env python3
"""Writes tests/data/tokenizer/bytes512/: a byte-level BPE tokenizer (tokenizer.json,
tokenizer_config.json with a ChatML template) whose 512 ids fit the tiny golden models'
vocabulary, so that kdhttpd and kdrun --text can drive them: ids 0-255 the bytes (GPT-2's
byte-to-unicode mapping, no merges), 256-258 <|im_start|> <|im_end|> <|endoftext|>, 259-511
two-letter tokens that only decoding meets (the random models generate them)."""
import json
import os
import string
import sys


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def main(out):
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    letters = string.ascii_lowercase
    i = 259
    for a in letters:
        for b in letters:
            if i == 512:
                break
            vocab[a + b] = i
            i += 1
    special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    added = [{"id": 256 + k, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for k, s in enumerate(special)]
    tok = {"version": "1.0", "added_tokens": added, "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                             "trim_offsets": True, "use_regex": True},
           "post_processor": None, "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    tmpl = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    cfg = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
           "chat_template": tmpl}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False, indent=0)
        f.write("\n")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         os.path.join(os.path.dirname(__file__), "data", "tokenizer", "bytes512"))
