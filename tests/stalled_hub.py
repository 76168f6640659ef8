"""A hub that never answers (issue 27 item 6): it accepts connections and sends nothing while
stalled. `release()` answers every held and later request with a 404, so clients stuck on it end
(tests must not leave threads blocked on it)."""

from __future__ import annotations

import socket
import threading

ANSWER = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"


class StalledHub:
    def __init__(self):
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(256)
        self.url = f"http://127.0.0.1:{self._srv.getsockname()[1]}"
        self.connections = 0
        self._held: list[socket.socket] = []
        self._stalled = True
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                if self._stalled:
                    self._held.append(conn)
                    continue
            self._answer(conn)

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        try:
            conn.sendall(ANSWER)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def release(self) -> None:
        with self._lock:
            self._stalled = False
            held, self._held = self._held, []
        for conn in held:
            self._answer(conn)

    def close(self) -> None:
        self.release()
        self._srv.close()
