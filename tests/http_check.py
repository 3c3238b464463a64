#!/usr/bin/env python3
"""What tests/http_daemon.sh asks of the bodies curl saved: one field of a JSON body, the
text of a whole response or of a stream of server-sent events (OpenAI chunks or Anthropic
events, checked for their order), a stop string that spans a token boundary, and the slow
clients (a connection that stalls in its headers or body must be closed by kdhttpd).
Prints the answer on stdout; exit 1 with one line on stderr when the body is not what the
API says."""
import json
import socket
import sys
import time


def die(msg):
    print("http_check: " + msg, file=sys.stderr)
    sys.exit(1)


def load(path):
    with open(path, "rb") as f:
        return f.read()


def field(path, dotted):
    """A field by dotted path (numbers index arrays); printed as JSON unless a string."""
    v = json.loads(load(path))
    for k in dotted.split("."):
        v = v[int(k)] if isinstance(v, list) else v[k]
    sys.stdout.write(v if isinstance(v, str) else json.dumps(v))


def text(path):
    """The generated text of a whole response of any of the three endpoints."""
    o = json.loads(load(path))
    if o.get("type") == "message":
        sys.stdout.write("".join(b["text"] for b in o["content"]))
    elif o["object"] == "chat.completion":
        sys.stdout.write(o["choices"][0]["message"]["content"])
    else:
        sys.stdout.write(o["choices"][0]["text"])


def sse(path):
    """The text of a stream; checks the framing and prints 'TEXT' then, on stderr, the
    finish reason and usage."""
    raw = load(path).decode()
    if not raw.endswith("\n\n"):
        die("%s: the stream does not end with a blank line" % path)
    # comment lines (": keep-alive") are no part of an event (the SSE rule); a block of
    # them alone is none
    events = ["\n".join(l for l in e.split("\n") if not l.startswith(":"))
              for e in raw.split("\n\n") if e]
    events = [e for e in events if e]
    out, fin, usage, names = [], None, None, []
    for i, e in enumerate(events):
        lines = e.split("\n")
        name = lines[0][7:] if lines[0].startswith("event: ") else None
        data = [l[6:] for l in lines if l.startswith("data: ")]
        if len(data) != 1:
            die("%s: event %d has %d data lines" % (path, i, len(data)))
        if data[0] == "[DONE]":
            if i != len(events) - 1:
                die("%s: data: [DONE] is not last" % path)
            names.append("[DONE]")
            continue
        o = json.loads(data[0])
        if name is not None:  # Anthropic
            if o["type"] != name:
                die("%s: event %s carries type %s" % (path, name, o["type"]))
            names.append(name)
            if name == "content_block_delta":
                out.append(o["delta"]["text"])
            elif name == "message_delta":
                fin, usage = o["delta"]["stop_reason"], o["usage"]
            elif name == "error":
                die("%s: error event: %s" % (path, o["error"]["message"]))
            continue
        if "error" in o:
            die("%s: error chunk: %s" % (path, o["error"]["message"]))
        names.append("chunk")
        if o.get("usage"):
            usage = o["usage"]
        for c in o["choices"]:
            out.append(c["delta"].get("content") or "" if "delta" in c else c["text"])
            fin = c["finish_reason"] or fin
    if names[0] == "message_start":
        want = ["message_start", "content_block_start", "ping"]
        tail = ["content_block_stop", "message_delta", "message_stop"]
        if names[:3] != want or names[-3:] != tail or \
                any(n != "content_block_delta" for n in names[3:-3]):
            die("%s: Anthropic events out of order: %s" % (path, " ".join(names)))
    elif names[-1] != "[DONE]":
        die("%s: no data: [DONE] at the end" % path)
    sys.stdout.write("".join(out))
    print("finish=%s usage=%s" % (fin, json.dumps(usage)), file=sys.stderr)


def boundary_stop(path):
    """From a completion with logprobs: two ASCII characters that straddle a token
    boundary and occur first there. Prints the stop string, then the text before it."""
    o = json.loads(load(path))["choices"][0]
    t = o["text"].encode()
    offs = o["logprobs"]["text_offset"]
    for b in offs[1:]:
        if 0 < b < len(t) and all(0x20 < t[k] < 0x7f and t[k] != 0x5c for k in (b - 1, b)):
            s = t[b - 1:b + 1]
            if t.find(s) == b - 1:
                sys.stdout.write(s.decode() + "\n" + t[:b - 1].decode("utf-8"))
                return
    die("%s: no token boundary between two ASCII characters in %r" % (path, t))


def slow(port, mode, timeout_s, key):
    """A client that stalls: in its headers ('headers') or its body ('body'). kdhttpd must
    close it after its --timeout; exit 0 when closed within timeout_s, 1 otherwise."""
    s = socket.create_connection(("127.0.0.1", int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
              key.encode() + b"\r\n")
    if mode == "body":
        s.sendall(b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess")
    s.settimeout(float(timeout_s))
    t0 = time.time()
    try:
        while s.recv(4096):
            pass
    except socket.timeout:
        die("slow %s: still open after %s s" % (mode, timeout_s))
    except ConnectionResetError:
        pass
    print("closed after %.1f s" % (time.time() - t0), file=sys.stderr)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"field": field, "text": text, "sse": sse, "boundary_stop": boundary_stop,
     "slow": slow}[cmd](*args)
