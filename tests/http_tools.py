#!/usr/bin/env python3
"""What tests/http_tools.sh asks: tools through kdhttpd against the same conversation
rendered by libkdclient's Python binding (kdclient.Tokenizer.chat with tools -> ids ->
kdclient.Client.generate, greedy). Args: URL_TOOLS URL_PLAIN KEY SOCKET TOKENIZER_DIR.
Prints 'ok ...' / 'FAIL ...' lines; exit 1 on any failure."""
import json
import sys
import urllib.error
import urllib.request

import kdclient

UT, UN, KEY, SOCK, TOKDIR = sys.argv[1:6]
fails = 0
MAX = 24


def check(cond, what):
    global fails
    print(("ok   " if cond else "FAIL ") + what)
    fails += not cond


def post(url, path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={
        "Authorization": "Bearer " + KEY, "x-api-key": KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def js(text):
    try:
        return json.loads(text)
    except ValueError:
        return {}


def sse(text):
    """data payloads of a stream, [DONE] as the string."""
    out = []
    for ev in text.split("\n\n"):
        for line in ev.split("\n"):
            if line.startswith("data: "):
                out.append("[DONE]" if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather in a city.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = USER + [
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
ANTHROPIC_HISTORY = USER + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                  "content": "18 C, sunny"}]}]

tok = kdclient.Tokenizer(TOKDIR)
eot = tok.token_id("<|im_end|>")
client = kdclient.Client(SOCK)


def reference(messages, tools):
    """prompt ids, and the answer parsed by the family's parser."""
    ids = tok.encode(tok.chat(messages, tools=tools), special=True)
    out = client.generate(ids, max_tokens=MAX, stop=[eot])
    if out and out[-1] == eot:
        out = out[:-1]
    return ids, tok.parse_tool_calls(tok.decode_bytes(out).decode("utf-8", "replace"))


def chat(url, messages, tools=None, **kw):
    body = {"messages": messages, "max_tokens": MAX, "temperature": 0, **kw}
    if tools is not None:
        body["tools"] = tools
    return post(url, "/v1/chat/completions", body)


# (a) tools reach the prompt: token counts and the greedy answer equal the reference's
ids_t, ref_t = reference(USER, TOOLS)
ids_n, _ = reference(USER, None)
st, b = chat(UT, USER, TOOLS)
o = js(b)
check(st == 200, "chat with tools: %d %s" % (st, b[:200]))
check(o.get("usage", {}).get("prompt_tokens") == len(ids_t),
      "prompt_tokens %s == reference render with tools %d" % (o.get("usage"), len(ids_t)))
choice = (o.get("choices") or [{}])[0]
msg = choice.get("message", {})
want_content = ref_t["content"] or (None if ref_t["tool_calls"] else "")
check(msg.get("content") == want_content and len(msg.get("tool_calls", [])) == len(ref_t["tool_calls"]),
      "answer %r / %d calls == reference %r / %d" % (msg.get("content"), len(msg.get("tool_calls", [])),
                                                    want_content, len(ref_t["tool_calls"])))
st, b = chat(UT, USER)
o2 = js(b)
check(st == 200 and o2.get("usage", {}).get("prompt_tokens") == len(ids_n) != len(ids_t),
      "without tools: prompt_tokens %s == %d, not %d" % (o2.get("usage"), len(ids_n), len(ids_t)))
st, b = chat(UT, USER, TOOLS, tool_choice="none")
check(st == 200 and js(b).get("usage", {}).get("prompt_tokens") == len(ids_n),
      "tool_choice none: the tools stay out (%d %s)" % (st, b[:160]))
st, b = chat(UT, USER, TOOLS, stream=True)
ev = sse(b) if st == 200 else []
text = "".join(e["choices"][0]["delta"].get("content") or "" for e in ev[:-1] if e["choices"])
fin = [e["choices"][0]["finish_reason"] for e in ev[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
check(st == 200 and ev and ev[-1] == "[DONE]" and text == (ref_t["content"] or "") and
      fin == [choice.get("finish_reason") or "?"],
      "streamed with tools: %r %s == %r" % (text, fin, ref_t["content"]))

# Anthropic: its tools converted to the same rendering
st, b = post(UT, "/v1/messages", {"messages": USER, "max_tokens": MAX, "temperature": 0,
                                  "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto"}})
o = js(b)
atext = "".join(c.get("text", "") for c in o.get("content", []) if c.get("type") == "text")
check(st == 200 and o.get("usage", {}).get("input_tokens") == len(ids_t) and atext == ref_t["content"],
      "messages with tools: %d input_tokens %s == %d, %r == %r" % (
          st, o.get("usage"), len(ids_t), atext, ref_t["content"]))
st, b = post(UT, "/v1/messages", {"messages": USER, "max_tokens": MAX, "temperature": 0,
                                  "tools": ANTHROPIC_TOOLS, "stream": True})
ev = sse(b) if st == 200 else []
atext = "".join(e["delta"].get("text", "") for e in ev if e.get("type") == "content_block_delta")
check(st == 200 and ev and ev[-1].get("type") == "message_stop" and atext == ref_t["content"],
      "messages streamed with tools: %r == %r" % (atext, ref_t["content"]))

# (b) tool calls and results in the history render as the reference renders them
ids_h, ref_h = reference(HISTORY, TOOLS)
st, b = chat(UT, HISTORY, TOOLS)
o = js(b)
check(st == 200 and o.get("usage", {}).get("prompt_tokens") == len(ids_h) > len(ids_t),
      "history with tool_calls and a tool result: %d %s == %d" % (st, o.get("usage") or b[:200], len(ids_h)))
st, b = post(UT, "/v1/messages", {"messages": ANTHROPIC_HISTORY, "max_tokens": MAX,
                                  "temperature": 0, "tools": ANTHROPIC_TOOLS})
o = js(b)
check(st == 200 and o.get("usage", {}).get("input_tokens") == len(ids_h),
      "Anthropic tool_use / tool_result history: %d %s == %d" % (st, o.get("usage") or b[:200], len(ids_h)))

# (c) refusals: the API's 400 shapes
def refused(url, path, body, want, what, raw=None):
    st, b = post(url, path, body, raw)
    o = js(b)
    if path == "/v1/messages":
        shape = o.get("type") == "error" and o.get("error", {}).get("type") == "invalid_request_error"
        m = o.get("error", {}).get("message", "")
    else:
        shape = o.get("error", {}).get("type") == "invalid_request_error"
        m = o.get("error", {}).get("message", "")
    check(st == 400 and shape and want in m, "%s: %d %s" % (what, st, b[:220]))


C = "/v1/chat/completions"
base = {"messages": USER, "max_tokens": 4}
refused(UN, C, dict(base, tools=TOOLS), "no tool support", "tools on a template without them")
refused(UN, "/v1/messages", dict(base, tools=ANTHROPIC_TOOLS), "no tool support",
        "Anthropic tools on a template without them")
refused(UN, C, dict(base, messages=HISTORY), "no tool support", "a tool history on a template without them")
refused(UT, C, dict(base, tools={"type": "function"}), "tools", "tools not an array")
refused(UT, C, dict(base, tools=[{"type": "function", "function": {"description": "x"}}]), "name",
        "function.name missing")
refused(UT, C, dict(base, tools=[{"type": "function", "function": {"name": 7}}]), "name",
        "function.name a number")
refused(UT, C, dict(base, tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        "parameters", "parameters a string")
refused(UT, C, dict(base, tools=["f"]), "tools[0]", "a tool a string")
refused(UT, C, dict(base, tools=TOOLS, tool_choice="required"), "required", "tool_choice required")
refused(UT, C, dict(base, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "tool_choice", "tool_choice a named function")
refused(UT, C, dict(base, tools=TOOLS, tool_choice=3), "tool_choice", "tool_choice a number")
refused(UT, C, dict(base, messages=USER + [{"role": "tool", "content": "x"}]), "tool_call_id",
        "a tool message without tool_call_id")
refused(UT, C, dict(base, messages=USER + [{"role": "assistant", "content": "", "tool_calls": {"a": 1}}]),
        "tool_calls", "tool_calls not an array")
refused(UT, C, dict(base, messages=USER + [{"role": "assistant", "content": "", "tool_calls": [
    {"id": "c", "type": "function", "function": {"name": "f", "arguments": 5}}]}]), "arguments",
        "arguments a number")
refused(UT, "/v1/messages", dict(base, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}), "any",
        "Anthropic tool_choice any")
refused(UT, "/v1/messages", dict(base, tools=[{"name": "f"}]), "input_schema",
        "Anthropic tool without input_schema")
refused(UT, "/v1/messages", dict(base, messages=USER + [{"role": "assistant", "content": [
    {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]), "input", "tool_use input a string")
refused(UT, "/v1/messages", dict(base, messages=[{"role": "user", "content": [
    {"type": "tool_result", "content": "x"}]}]), "tool_use_id", "tool_result without tool_use_id")

# everyone else still served
st, b = chat(UT, USER, TOOLS)
check(st == 200 and js(b).get("usage", {}).get("prompt_tokens") == len(ids_t), "still serving: %d" % st)
client.close()
tok.close()
sys.exit(1 if fails else 0)
