"""The model's tokenizer, run in this process: encode, decode, chat templates, tools."""
import ctypes
import json

from . import _lib
from ._lib import lib, check


def _err():
    return lib.kd_tokenizer_error().decode("utf-8", "replace")


def _text(v):
    return None if v is None else (v if isinstance(v, bytes) else str(v).encode("utf-8"))


class DecodeStream:
    """Incremental decoding for streaming: push(id) returns the text that id completes
    (a character cut between tokens waits for its end), finish() what is held (an
    incomplete tail as U+FFFD). Keep the Tokenizer open while the stream lives."""

    def __init__(self, tok, skip_special=False):
        self._tok = tok  # the stream reads the tokenizer: keep it alive
        self._s = ctypes.c_void_p()
        flags = _lib.KD_DECODE_SKIP_SPECIAL if skip_special else 0
        check(lib.kd_tokenizer_stream_create(ctypes.byref(self._s), tok._t, flags),
              "kd_tokenizer_stream_create", _err)

    def _take(self, rc, what, p, n):
        check(rc, what, _err)
        return ctypes.string_at(p.value, n.value).decode("utf-8") if n.value else ""

    def push(self, token):
        p, n = ctypes.c_void_p(), ctypes.c_size_t()
        return self._take(lib.kd_tokenizer_stream_push(self._s, token, ctypes.byref(p), ctypes.byref(n)),
                          "kd_tokenizer_stream_push", p, n)

    def finish(self):
        p, n = ctypes.c_void_p(), ctypes.c_size_t()
        return self._take(lib.kd_tokenizer_stream_finish(self._s, ctypes.byref(p), ctypes.byref(n)),
                          "kd_tokenizer_stream_finish", p, n)

    def close(self):
        if self._s:
            lib.kd_tokenizer_stream_destroy(self._s)
            self._s = ctypes.c_void_p()

    def __del__(self):
        self.close()


class Tokenizer:
    """Tokenizer(path): a GGUF file or a Hugging Face directory (tokenizer.json)."""

    def __init__(self, path):
        self._t = ctypes.c_void_p()
        check(lib.kd_tokenizer_open(ctypes.byref(self._t), str(path).encode()), "kd_tokenizer_open", _err)

    def close(self):
        if self._t:
            lib.kd_tokenizer_close(self._t)
            self._t = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    n_vocab = property(lambda self: lib.kd_tokenizer_n_vocab(self._t))
    bos = property(lambda self: lib.kd_tokenizer_bos(self._t))
    eos = property(lambda self: lib.kd_tokenizer_eos(self._t))
    eot = property(lambda self: lib.kd_tokenizer_eot(self._t), doc="end of turn (else eos)")
    supports_tools = property(lambda self: bool(lib.kd_tokenizer_supports_tools(self._t)))

    def token_id(self, text):
        """The id of the token whose text this is, or -1."""
        return lib.kd_tokenizer_token_id(self._t, _text(text))

    def encode(self, text, add_special=False, special=False):
        """Token ids of text (str or bytes). add_special: BOS where the model adds it;
        special: special tokens written in the text become their ids (chat texts)."""
        b = _text(text)
        flags = (_lib.KD_TOKENIZE_ADD_SPECIAL if add_special else 0) | (_lib.KD_TOKENIZE_SPECIAL if special else 0)
        n = check(lib.kd_tokenizer_encode(self._t, b, len(b), flags, None, 0), "kd_tokenizer_encode", _err)
        ids = (ctypes.c_int32 * max(n, 1))()
        n = check(lib.kd_tokenizer_encode(self._t, b, len(b), flags, ids, n), "kd_tokenizer_encode", _err)
        return list(ids[:n])

    def decode_bytes(self, ids, skip_special=False):
        arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
        flags = _lib.KD_DECODE_SKIP_SPECIAL if skip_special else 0
        n = check(lib.kd_tokenizer_decode(self._t, arr, len(ids), flags, None, 0), "kd_tokenizer_decode", _err)
        buf = ctypes.create_string_buffer(n + 1)
        check(lib.kd_tokenizer_decode(self._t, arr, len(ids), flags, buf, n), "kd_tokenizer_decode", _err)
        return buf.raw[:n]

    def decode(self, ids, skip_special=False):
        """Text of ids; bytes that are not UTF-8 (a character cut between ids) become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    def stream(self, skip_special=False):
        """A DecodeStream: text as whole UTF-8 characters, one token at a time."""
        return DecodeStream(self, skip_special)

    def chat(self, messages, add_generation_prompt=True, tools=None):
        """The conversation in the model's chat template, as apply_chat_template renders it.
        messages: dicts with role, content and, for tools, tool_calls (the OpenAI list),
        tool_call_id, name; tools: the OpenAI tools list. Encode with special=True."""
        keep = []
        arr = (_lib.ChatMessage * max(len(messages), 1))()
        for i, m in enumerate(messages):
            calls = m.get("tool_calls")
            fields = [_text(m.get("role")), _text(m.get("content")),
                      _text(json.dumps(calls)) if calls is not None else None,
                      _text(m.get("tool_call_id")), _text(m.get("name"))]
            keep.append(fields)
            arr[i] = _lib.ChatMessage(*fields)
        tj = _text(json.dumps(tools)) if tools is not None else None
        gen = 1 if add_generation_prompt else 0
        n = check(lib.kd_tokenizer_chat_tools(self._t, arr, len(messages), tj, gen, None, 0),
                  "kd_tokenizer_chat", _err)
        buf = ctypes.create_string_buffer(n + 1)
        check(lib.kd_tokenizer_chat_tools(self._t, arr, len(messages), tj, gen, buf, n + 1),
              "kd_tokenizer_chat", _err)
        return buf.raw[:n].decode("utf-8", "replace")

    def parse_tool_calls(self, text):
        """{"content": str, "tool_calls": [{"id", "name", "arguments": JSON text}]} of a
        generated text in the family's call format."""
        b = _text(text)
        out = ctypes.c_void_p()
        check(lib.kd_tokenizer_parse_tool_calls(self._t, b, len(b), ctypes.byref(out)),
              "kd_tokenizer_parse_tool_calls", _err)
        try:
            return json.loads(ctypes.string_at(out.value).decode("utf-8"))
        finally:
            lib.kd_tool_calls_free(out)
