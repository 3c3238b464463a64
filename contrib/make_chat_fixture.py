#!/usr/bin/env python3
"""tests/data/tokenizer/<family>_chat.json: transformers' apply_chat_template texts of a
model family's chat template for a set of conversations, the reference of
kd_tokenizer_chat's renderer of that family (tests/test_tokenizer.c).

    python3 contrib/make_chat_fixture.py llama3_1 TEMPLATE.jinja > tests/data/tokenizer/llama3_1_chat.json
    python3 contrib/make_chat_fixture.py deepseek2 TEMPLATE.jinja > tests/data/tokenizer/deepseek2_chat.json

TEMPLATE.jinja: the "chat_template" string of the model's tokenizer_config.json (Llama
3.1 or 3.3 Instruct; DeepSeek LLM Chat or DeepSeek-V2(-Lite)-Chat), written to a file
(kdec does not ship it). The fixture keeps only the rendered texts and the strings kdec
recognises the template by."""
import json
import sys

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

COMMON = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}], True),
    ([{"role": "system", "content": "  \n padded system \t"}, {"role": "user", "content": "\n  trim me  \n"}], True),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": "and 3+3?"}], True),
    ([{"role": "user", "content": "no prompt"}], False),
    ([{"role": "user", "content": "first"}, {"role": "system", "content": " a later system turn "}], True),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}], True),
]
FAMILIES = {
    "llama3_1": {
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
        "markers": "<|start_header_id|> ... Cutting Knowledge",
        "conversations": COMMON + [
            ([{"role": "user", "content": "run it"},
              {"role": "tool", "content": "{\"exit\": 0, \"out\": \"a\\\\b <c&d>\"}\nline\ttab \u00e9 \u4e2d "
                                          "\U0001f600 \x01\x1f\x7f"}], True),
            ([{"role": "user", "content": "look"}, {"role": "ipython", "content": "  kept as is  "}], True),
        ],
    },
    "deepseek2": {
        "bos": "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "eos": "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "markers": "'User: ' ... 'Assistant: ' ... eos_token",
        "conversations": COMMON + [
            ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "  a  "},
              {"role": "tool", "content": "dropped"}, {"role": "user", "content": "\u4e2d\u6587 \U0001f600"}], True),
            ([{"role": "assistant", "content": "starts"}], False),
        ],
    },
}


def main():
    fam = FAMILIES[sys.argv[1]]
    tmpl = open(sys.argv[2], encoding="utf-8").read()
    chats = []
    for msgs, gen in fam["conversations"]:
        out = render_jinja_template([msgs], chat_template=tmpl, add_generation_prompt=gen,
                                    bos_token=fam["bos"], eos_token=fam["eos"])[0][0]
        chats.append({"messages": msgs, "add_generation_prompt": gen, "text": out})
    doc = {
        "family": sys.argv[1] + " chat",
        "reference": "transformers %s render_jinja_template of the model's chat_template"
                     % transformers.__version__,
        "chat_template": "markers of the template kdec recognises: " + fam["markers"],
        "chat": chats,
    }
    json.dump(doc, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
