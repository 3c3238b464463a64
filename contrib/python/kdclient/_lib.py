"""The C library and its structs as ctypes sees them (client/kdclient.h)."""
import ctypes
import ctypes.util
import os

c_char_p, c_int, c_uint, c_size_t = ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
c_int32, c_uint32, c_uint64, c_float = ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float

KD_MAX_STOP = 8
KD_EVENT_FINAL = 1
KD_EVENT_LOGPROB = 2
KD_TOKENIZE_ADD_SPECIAL = 1
KD_TOKENIZE_SPECIAL = 2
KD_DECODE_SKIP_SPECIAL = 1
STOP_NAMES = {0: None, 1: "length", 2: "stop_token", 3: "cancelled", 4: "error"}


class ConnectOpts(ctypes.Structure):
    _fields_ = [("socket_path", c_char_p), ("flags", c_uint), ("spin_us", c_uint)]


class Sampling(ctypes.Structure):
    _fields_ = [("temperature", c_float), ("top_k", c_int), ("top_p", c_float), ("seed", c_uint64),
                ("min_p", c_float), ("repetition_penalty", c_float), ("presence_penalty", c_float),
                ("frequency_penalty", c_float), ("logprobs", c_int), ("top_logprobs", c_int)]


class Request(ctypes.Structure):
    _fields_ = [("prompt", ctypes.POINTER(c_int32)), ("n_prompt", c_uint32), ("max_tokens", c_uint32),
                ("sampling", Sampling), ("stop", ctypes.POINTER(c_int32)), ("n_stop", c_uint32),
                ("session", c_char_p), ("priority", c_int), ("flags", c_uint32),
                ("reserved", c_uint64 * 4)]


class CEvent(ctypes.Structure):
    _fields_ = [("id", c_uint64), ("token", c_int32), ("index", c_uint32), ("flags", c_uint32),
                ("stop", c_int), ("error", c_int), ("detail", c_uint32), ("detail_arg", c_uint32 * 3),
                ("logprob", c_float), ("top_logprob", c_float), ("top_token", c_int32),
                ("t_submit_ns", c_uint64), ("t_pickup_ns", c_uint64), ("t_publish_ns", c_uint64),
                ("t_receive_ns", c_uint64), ("cached_tokens", c_uint32)]


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", c_char_p), ("content", c_char_p), ("tool_calls_json", c_char_p),
                ("tool_call_id", c_char_p), ("name", c_char_p)]


class KdError(OSError):
    """A libkdclient call failed: errno is the error number, the message the library's."""


def _load():
    path = os.environ.get("KDCLIENT_LIB")
    names = [path] if path else [ctypes.util.find_library("kdclient"), "libkdclient.so.4",
                                 "libkdclient.so"]
    errors = []
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise ImportError("kdclient: libkdclient not found (set KDCLIENT_LIB to libkdclient.so): "
                      + "; ".join(errors or ["not on the library path"]))


lib = _load()
P = ctypes.POINTER
_protos = {
    "kd_version": (c_char_p, []),
    "kd_strerror": (c_char_p, [c_int]),
    "kd_connect": (c_int, [P(ctypes.c_void_p), P(ConnectOpts)]),
    "kd_connect_error": (c_char_p, [ctypes.c_void_p]),
    "kd_close": (None, [ctypes.c_void_p]),
    "kd_submit": (c_int, [ctypes.c_void_p, P(Request), P(c_uint64)]),
    "kd_cancel": (c_int, [ctypes.c_void_p, c_uint64]),
    "kd_wait": (c_int, [ctypes.c_void_p, P(CEvent), c_int, c_int]),
    "kd_event_message": (None, [P(CEvent), c_char_p, c_size_t]),
    "kd_tokenizer_open": (c_int, [P(ctypes.c_void_p), c_char_p]),
    "kd_tokenizer_close": (None, [ctypes.c_void_p]),
    "kd_tokenizer_error": (c_char_p, []),
    "kd_tokenizer_encode": (ctypes.c_long, [ctypes.c_void_p, c_char_p, c_size_t, c_uint, P(c_int32), c_size_t]),
    "kd_tokenizer_decode": (ctypes.c_long, [ctypes.c_void_p, P(c_int32), c_size_t, c_uint, c_char_p, c_size_t]),
    "kd_tokenizer_n_vocab": (c_int32, [ctypes.c_void_p]),
    "kd_tokenizer_bos": (c_int32, [ctypes.c_void_p]),
    "kd_tokenizer_eos": (c_int32, [ctypes.c_void_p]),
    "kd_tokenizer_eot": (c_int32, [ctypes.c_void_p]),
    "kd_tokenizer_token_id": (c_int32, [ctypes.c_void_p, c_char_p]),
    "kd_tokenizer_stream_create": (c_int, [P(ctypes.c_void_p), ctypes.c_void_p, c_uint]),
    "kd_tokenizer_stream_push": (c_int, [ctypes.c_void_p, c_int32, P(ctypes.c_void_p), P(c_size_t)]),
    "kd_tokenizer_stream_finish": (c_int, [ctypes.c_void_p, P(ctypes.c_void_p), P(c_size_t)]),
    "kd_tokenizer_stream_destroy": (None, [ctypes.c_void_p]),
    "kd_tokenizer_chat_tools": (ctypes.c_long, [ctypes.c_void_p, P(ChatMessage), c_size_t, c_char_p, c_int,
                                                c_char_p, c_size_t]),
    "kd_tokenizer_supports_tools": (c_int, [ctypes.c_void_p]),
    "kd_tokenizer_parse_tool_calls": (c_int, [ctypes.c_void_p, c_char_p, c_size_t, P(ctypes.c_void_p)]),
    "kd_tool_calls_free": (None, [ctypes.c_void_p]),
}
for _name, (_res, _args) in _protos.items():
    _f = getattr(lib, _name)
    _f.restype, _f.argtypes = _res, _args


def check(rc, what, message=None):
    """rc < 0 raises KdError(-rc, 'what: message'); else rc."""
    if rc < 0:
        msg = message() if message else lib.kd_strerror(rc).decode("utf-8", "replace")
        raise KdError(-rc, "%s: %s" % (what, msg))
    return rc
