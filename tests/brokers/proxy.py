"""A loopback TCP proxy a test can cut, to make a broker unreachable on demand.

It forwards ``127.0.0.1:<port>`` to the broker with two threads per connection.
``cut()`` drops every open connection and refuses new ones (accepts and closes
them at once) until ``restore()``; ``freeze()`` stops passing the broker's
replies to the client (the client's bytes still reach the broker) until
``thaw()``, which is how a lost publisher confirm looks; ``cut_on_next_send()``
cuts everything as soon as the client next sends something (after passing it
on), which is a connection lost in the middle of a batch.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Forwards ``127.0.0.1:port`` (default: a free port) to ``upstream``."""

    def __init__(self, upstream: tuple[str, int], port: int = 0):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = self.listener.getsockname()[1]
        self.connections = 0  # accepted and forwarded, for assertions
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._cut_on_send = False
        self._replies = threading.Event()
        self._replies.set()
        threading.Thread(target=self._accept, daemon=True).start()

    # --- what a test does ------------------------------------------------------

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            self._cut_on_send = False
            sockets, self._open = self._open, set()
        for sock in sockets:
            _close(sock)
        self._replies.set()  # release frozen pumps so their threads end

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def freeze(self) -> None:
        self._replies.clear()

    def thaw(self) -> None:
        self._replies.set()

    def cut_on_next_send(self) -> None:
        self._cut_on_send = True

    def close(self) -> None:
        self.cut()
        _close(self.listener)

    # --- the forwarding --------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self._cut:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
                self.connections += 1
            pair = (client, upstream)
            for src, dst, gate in ((client, upstream, None), (upstream, client, True)):
                threading.Thread(
                    target=self._pump, args=(src, dst, gate, pair), daemon=True
                ).start()

    def _pump(self, src, dst, replies, pair) -> None:
        try:
            while data := src.recv(65536):
                if replies:
                    self._replies.wait()
                    if not self._is_open(pair):
                        break
                dst.sendall(data)
                if not replies and self._cut_on_send:
                    self.cut()
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.difference_update(pair)
            for sock in pair:
                _close(sock)

    def _is_open(self, pair) -> bool:
        with self._lock:
            return pair[0] in self._open


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
