#!/usr/bin/env python3
"""The real `openai` and `anthropic` Python packages against kdhttpd (run by
tests/http_clients.sh inside a throwaway venv): chat, completion and messages, each
streamed and not, greedy, must give the text kdrun printed for the same prompt; their
error classes for a wrong key and a refused field. Prints one line per failure; exit 1
on any.
Usage: http_clients.py URL KEY MODEL PROMPT MAX_TOKENS CHAT_FILE COMPLETION_FILE"""
import sys

import anthropic
import openai

url, key, model, prompt, max_tokens, chat_file, cmpl_file = sys.argv[1:8]
max_tokens = int(max_tokens)
want_chat = open(chat_file, "rb").read().decode("utf-8")
want_cmpl = open(cmpl_file, "rb").read().decode("utf-8")
fails = 0


def check(name, got, want):
    global fails
    if got != want:
        fails += 1
        print("FAIL: %s: %r, kdrun %r" % (name, got, want))


oa = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
msgs = [{"role": "user", "content": prompt}]
r = oa.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                               temperature=0)
check("openai chat", r.choices[0].message.content, want_chat)
check("openai chat usage", r.usage.completion_tokens > 0, True)
parts, usage = [], None
for ch in oa.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                                     temperature=0, stream=True,
                                     stream_options={"include_usage": True}):
    if ch.usage:
        usage = ch.usage
    for c in ch.choices:
        parts.append(c.delta.content or "")
check("openai chat stream", "".join(parts), want_chat)
check("openai chat stream usage", usage is not None and usage.prompt_tokens > 0, True)

# ignore_eos (vLLM's field): kdrun --text without --chat stops only at max_tokens
r = oa.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                          extra_body={"ignore_eos": True})
check("openai completion", r.choices[0].text, want_cmpl)
parts = [c.text for ch in oa.completions.create(model=model, prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
         for c in ch.choices]
check("openai completion stream", "".join(parts), want_cmpl)

ac = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=300)
# temperature through extra_body: newer packages no longer take it as an argument
greedy = {"temperature": 0}
m = ac.messages.create(model=model, max_tokens=max_tokens, messages=msgs, extra_body=greedy)
check("anthropic messages", "".join(b.text for b in m.content), want_chat)
check("anthropic stop_reason", m.stop_reason in ("end_turn", "max_tokens"), True)
with ac.messages.stream(model=model, max_tokens=max_tokens, messages=msgs,
                        extra_body=greedy) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
check("anthropic stream", text, want_chat)
check("anthropic stream usage", final.usage.output_tokens > 0, True)

# the error classes the packages raise for kdhttpd's statuses and shapes
try:
    oa.chat.completions.create(model=model, messages=msgs, max_tokens=4, n=2)
    check("openai n=2 refused", False, True)
except openai.BadRequestError as e:
    check("openai n=2 message", "n = 1" in str(e), True)
try:
    openai.OpenAI(base_url=url + "/v1", api_key=key + "x", max_retries=0).models.list()
    check("openai wrong key refused", False, True)
except openai.AuthenticationError:
    pass
try:
    anthropic.Anthropic(base_url=url, api_key=key + "x", max_retries=0).messages.create(
        model=model, max_tokens=4, messages=msgs)
    check("anthropic wrong key refused", False, True)
except anthropic.AuthenticationError:
    pass
try:
    ac.messages.create(model=model, max_tokens=4, messages=msgs,
                       tools=[{"name": "f", "input_schema": {"type": "object"}}])
    check("anthropic tools refused", False, True)
except anthropic.BadRequestError as e:
    check("anthropic tools message", "no tool support" in str(e), True)
print("http_clients.py: %s, %d failures" % (model, fails))
sys.exit(1 if fails else 0)
