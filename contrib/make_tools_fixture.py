#!/usr/bin/env python3
"""tests/data/tokenizer/<family>_tools.json: transformers' texts of a model family's real
chat template rendering conversations with tools (tool definitions, assistant tool
calls, tool results), the reference of kd_tokenizer_chat_tools (tests/test_tools.c).

    python3 contrib/make_tools_fixture.py llama3_1 TEMPLATE.jinja > tests/data/tokenizer/llama3_1_tools.json
    python3 contrib/make_tools_fixture.py qwen2_5 TEMPLATE.jinja > tests/data/tokenizer/qwen2_5_tools.json
    python3 contrib/make_tools_fixture.py qwen3 TEMPLATE.jinja > tests/data/tokenizer/qwen3_tools.json
    python3 contrib/make_tools_fixture.py kimi_k2 TEMPLATE.jinja > tests/data/tokenizer/kimi_k2_tools.json
    python3 contrib/make_tools_fixture.py deepseek_v3 TEMPLATE.jinja > tests/data/tokenizer/deepseek_v3_tools.json

TEMPLATE.jinja: the model's "chat_template" (Llama 3.1 8B Instruct, Qwen2.5 Instruct, Qwen3, Kimi-K2-Instruct,
DeepSeek-V3.1), e.g. from llama.cpp's models/templates (bundled in the llama-cpp-python
sdist); kdec does not ship it. The fixture keeps the inputs, the rendered texts and only
the strings of the template kdec recognises the family by (each checked to be in it)."""
import re
import json
import sys

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1},
        "scale": {"type": "number", "default": 0.5, "maximum": 1e+20, "minimum": -2.5e-07},
        "strict": {"type": "boolean", "default": False}, "x": {"default": None}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web \u2014 \u4e2d\u6587 ok\ttab \\ \u00e9",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                   "required": ["q"]}}}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def conversations(single_call):
    """(messages, tools, add_generation_prompt, extra template variables)"""
    two = [call("call_a", "get_weather", {"city": "Paris", "unit": "celsius"})]
    if not single_call:
        two.append(call("call_b", "search", {"q": "paris \"events\"", "n": 3}))
    out = [
        ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER], True),
        ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  Weather in Paris?  "}],
         [WEATHER, SEARCH], True),
        ([{"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": "", "tool_calls": [call("call_a", "get_weather", {"city": "Paris"})]},
          {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "{\"temp\": 21, \"sky\": \"clear\"}"}],
         [WEATHER], True),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan my evening in Paris"},
          {"role": "assistant", "content": "", "tool_calls": two}]
         + [{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
             "content": "result of " + c["function"]["name"]} for c in two]
         + [{"role": "assistant", "content": "It is 21C; there is a concert."},
            {"role": "user", "content": "thanks \u00e9\u4e2d"}], [WEATHER, SEARCH], True),
        ([{"role": "user", "content": "hi"}], [SEARCH], False),
        ([{"role": "user", "content": "no tools here"}, {"role": "assistant", "content": "ok"},
          {"role": "user", "content": "again"}], None, True),
        ([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
          {"role": "user", "content": "q2"},
          {"role": "assistant", "content": "", "tool_calls": [call("c9", "search", {"q": "x"})]},
          {"role": "tool", "tool_call_id": "c9", "name": "search", "content": "found"},
          {"role": "assistant", "content": "<think>\n\nr2 </think>\n A2"}], [SEARCH], False),
    ]
    return out


FAMILIES = {
    "llama3_1": {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "single_call": True,
                 "markers": ["<|start_header_id|>", "Cutting Knowledge", "tools_in_user_message"]},
    "qwen2_5": {"bos": None, "eos": "<|im_end|>", "single_call": False,
                "markers": ["<|im_start|>", "<tools>", "<tool_call>",
                            re.compile(r"<\|im_start\|>system\\n[^'\"{<]+<\|im_end\|>")]},
    "qwen3": {"bos": None, "eos": "<|im_end|>", "single_call": False,
              "markers": ["<|im_start|>", "<tools>", "<tool_call>", "reasoning_content"]},
    "kimi_k2": {"bos": "[BOS]", "eos": "[EOS]", "single_call": False, "mutable": True,
                "markers": ["<|im_middle|>", "tool_response_queue", "<|tool_calls_section_begin|>",
                            re.compile(r"<\|im_system\|>system<\|im_middle\|>[^'\"{<]+<\|im_end\|>")]},
    "deepseek_v3": {"bos": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                    "eos": "<\uff5cend\u2581of\u2581sentence\uff5c>", "single_call": False,
                    "markers": ["<\uff5cUser\uff5c>", "is_last_user", "<think></think>",
                                "tool['function']['name'] + '<\uff5ctool\u2581sep\uff5c>'"]},
}


def markers(fam, tmpl):
    """The recognised strings, each found in the template (a pattern: its match)."""
    out = []
    for m in fam["markers"]:
        found = m.search(tmpl).group(0) if hasattr(m, "search") else (m if m in tmpl else None)
        if not found:
            sys.exit("marker %r not in the template: not this family's template" % m)
        out.append(found)
    return "markers of the template kdec recognises: " + " ... ".join(out)


def mutable_sandbox():
    """Kimi-K2's template appends to a list (its queue of tool call ids), which
    transformers' ImmutableSandboxedEnvironment refuses; render it in jinja2's plain
    sandbox with transformers' own settings and filters otherwise."""
    import jinja2.sandbox
    from transformers.utils import chat_template_utils as ctu
    ctu.ImmutableSandboxedEnvironment = jinja2.sandbox.SandboxedEnvironment
    ctu._compile_jinja_template.cache_clear()


def main():
    name = sys.argv[1]
    fam = FAMILIES[name]
    tmpl = open(sys.argv[2], encoding="utf-8").read()
    note = ""
    if fam.get("mutable"):
        mutable_sandbox()
        note = " (jinja2 SandboxedEnvironment: the template appends to a list)"
    chats = []
    for msgs, tools, gen in conversations(fam["single_call"]):
        out = render_jinja_template([msgs], tools=tools, chat_template=tmpl, add_generation_prompt=gen,
                                    bos_token=fam["bos"], eos_token=fam["eos"])[0][0]
        chats.append({"messages": msgs, "tools": tools, "add_generation_prompt": gen, "text": out})
    doc = {
        "family": name + " tools",
        "reference": "transformers %s render_jinja_template of the model's chat_template, with tools"
                     % transformers.__version__ + note,
        "chat_template": markers(fam, tmpl),
        "chat": chats,
    }
    json.dump(doc, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
