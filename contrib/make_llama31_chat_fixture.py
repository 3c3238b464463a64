#!/usr/bin/env python3
"""tests/data/tokenizer/llama3_1_chat.json: transformers' apply_chat_template texts of a
Llama 3.1 Instruct chat template for a set of conversations, the reference of
kd_tokenizer_chat's Llama 3.1-3.3 renderer (tests/test_tokenizer.c).

    python3 contrib/make_llama31_chat_fixture.py TEMPLATE.jinja > tests/data/tokenizer/llama3_1_chat.json

TEMPLATE.jinja: the "chat_template" string of a Llama 3.1 (or 3.3) Instruct model's
tokenizer_config.json, written to a file (kdec does not ship it). The fixture keeps only
the rendered texts and the two strings kdec recognises the template by."""
import json
import sys

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

BOS = "<|begin_of_text|>"
CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}], True),
    ([{"role": "system", "content": "  \n padded system \t"}, {"role": "user", "content": "\n  trim me  \n"}], True),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "and 3+3?"}], True),
    ([{"role": "user", "content": "no prompt"}], False),
    ([{"role": "user", "content": "run it"},
      {"role": "tool", "content": "{\"exit\": 0, \"out\": \"a\\\\b <c&d>\"}\nline\ttab \u00e9 \u4e2d \U0001f600 \x01\x1f\x7f"}], True),
    ([{"role": "user", "content": "look"}, {"role": "ipython", "content": "  kept as is  "}], True),
    ([{"role": "user", "content": "first"}, {"role": "system", "content": " a later system turn "}], True),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}], True),
]


def main():
    tmpl = open(sys.argv[1], encoding="utf-8").read()
    chats = []
    for msgs, gen in CONVERSATIONS:
        out = render_jinja_template([msgs], chat_template=tmpl, add_generation_prompt=gen,
                                    bos_token=BOS, eos_token="<|eot_id|>")[0][0]
        chats.append({"messages": msgs, "add_generation_prompt": gen, "text": out})
    doc = {
        "family": "llama3.1 chat",
        "reference": "transformers %s render_jinja_template of a Llama 3.1 Instruct chat_template"
                     % transformers.__version__,
        "chat_template": "markers of the Llama 3.1 template kdec recognises: "
                         "<|start_header_id|> ... Cutting Knowledge",
        "chat": chats,
    }
    json.dump(doc, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
