"""A connection to kdecd: submit prompts, iterate their tokens, cancel."""
import collections
import ctypes

from . import _lib
from ._lib import lib, check

Event = collections.namedtuple("Event", "id token index final stop error message logprob")
Event.__doc__ = """One token (or a final event without one: token -1) of request id.
stop: None until final, then "length", "stop_token", "cancelled" or "error" (error the
negative errno, message the daemon's reason). logprob: with logprobs=True, else None."""


class Client:
    """Client(socket_path=None, spin_us=0): connects to kdecd (the default socket when
    None). One thread at a time may submit and one receive (as libkdclient). Close it
    (or use `with`): the daemon cancels what is still running."""

    def __init__(self, socket_path=None, spin_us=0):
        self._c = ctypes.c_void_p()
        opts = _lib.ConnectOpts(socket_path.encode() if socket_path else None, 0, spin_us)
        check(lib.kd_connect(ctypes.byref(self._c), ctypes.byref(opts)), "kd_connect",
              lambda: lib.kd_connect_error(None).decode("utf-8", "replace"))
        self._pending = collections.defaultdict(collections.deque)  # id -> events read early
        self._events = (_lib.CEvent * 64)()

    def close(self):
        if self._c:
            lib.kd_close(self._c)
            self._c = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _handle(self):
        if not self._c:
            raise _lib.KdError(9, "kdclient: the connection is closed")
        return self._c

    def submit(self, prompt, max_tokens=16, temperature=0.0, top_k=0, top_p=0.0, min_p=0.0, seed=0,
               repetition_penalty=0.0, presence_penalty=0.0, frequency_penalty=0.0, logprobs=False,
               stop=(), session=None, priority=0):
        """Queues a request (prompt: token ids); returns its id. Greedy by default."""
        ids = list(prompt)
        stops = list(stop)
        if len(stops) > _lib.KD_MAX_STOP:
            raise ValueError("kdclient: %d stop tokens, at most %d" % (len(stops), _lib.KD_MAX_STOP))
        arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
        sarr = (ctypes.c_int32 * max(len(stops), 1))(*stops)
        s = _lib.Sampling(temperature, top_k, top_p, seed, min_p, repetition_penalty, presence_penalty,
                          frequency_penalty, 1 if logprobs else 0, 0)
        r = _lib.Request(arr, len(ids), max_tokens, s, sarr if stops else None, len(stops),
                         session.encode() if session else None, priority, 0)
        rid = ctypes.c_uint64()
        check(lib.kd_submit(self._handle(), ctypes.byref(r), ctypes.byref(rid)), "kd_submit")
        return rid.value

    def cancel(self, request_id):
        """Asks the daemon to stop the request; its final event says "cancelled" (unless it
        finished first)."""
        check(lib.kd_cancel(self._handle(), request_id), "kd_cancel")

    def _convert(self, ev):
        final = bool(ev.flags & _lib.KD_EVENT_FINAL)
        msg = None
        if final and ev.stop == 4:
            buf = ctypes.create_string_buffer(256)
            lib.kd_event_message(ctypes.byref(ev), buf, len(buf))
            msg = buf.value.decode("utf-8", "replace")
        return Event(ev.id, ev.token, ev.index, final, _lib.STOP_NAMES.get(ev.stop, ev.stop) if final else None,
                     ev.error, msg, ev.logprob if ev.flags & _lib.KD_EVENT_LOGPROB else None)

    def events(self, request_id, timeout_ms=-1):
        """The request's events in order, the final one last (events of other requests
        read meanwhile are kept for their own iterators). timeout_ms bounds each wait;
        TimeoutError when it passes."""
        queue = self._pending[request_id]
        while True:
            while queue:
                ev = queue.popleft()
                yield ev
                if ev.final:
                    self._pending.pop(request_id, None)
                    return
            n = check(lib.kd_wait(self._handle(), self._events, len(self._events), timeout_ms), "kd_wait")
            if n == 0:
                raise TimeoutError("kdclient: no event for request %d in %d ms" % (request_id, timeout_ms))
            for i in range(n):
                ev = self._convert(self._events[i])
                self._pending[ev.id].append(ev)

    def tokens(self, request_id, timeout_ms=-1):
        """The generated token ids of the request as they come (KdError if it failed)."""
        for ev in self.events(request_id, timeout_ms):
            if ev.token >= 0:
                yield ev.token
            if ev.final and ev.stop == "error":
                raise _lib.KdError(-ev.error, "kdecd: " + (ev.message or "request failed"))

    def stream(self, prompt, **kw):
        """submit + events: the events of one new request."""
        return self.events(self.submit(prompt, **kw))

    def generate(self, prompt, **kw):
        """submit + tokens, collected: the list of generated ids."""
        return list(self.tokens(self.submit(prompt, **kw)))
