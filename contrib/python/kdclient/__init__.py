"""kdclient: Python binding of libkdclient (ctypes), kdec's client library.

Connect to a running kdecd, submit token prompts, iterate the generated tokens as the
daemon produces them, cancel; tokenize, detokenize and render chat templates locally
with the model's tokenizer (tools included). The shared library is found through
$KDCLIENT_LIB, else the system's libkdclient.so.N (pkg-config kdclient's libdir).

    import kdclient
    tok = kdclient.Tokenizer("model.gguf")
    prompt = tok.encode(tok.chat([{"role": "user", "content": "Hi"}]), special=True)
    text = tok.stream(skip_special=True)
    with kdclient.Client() as c:
        for ev in c.stream(prompt, max_tokens=32, stop=[tok.eot]):
            if ev.token >= 0:
                print(text.push(ev.token), end="", flush=True)
    print(text.finish())
"""
from ._lib import KdError
from .client import Client, Event
from .tokenizer import DecodeStream, Tokenizer

__all__ = ["Client", "DecodeStream", "Event", "KdError", "Tokenizer"]
__version__ = "0.1.0"
