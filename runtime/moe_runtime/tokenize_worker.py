"""Long texts tokenized in a child process, so the server's GIL is never held for long.

The tokenizers library releases the GIL while it tokenizes, but not while it turns the result into
Python objects: for a 10 MB prompt (3.6M tokens) `Encoding.ids` holds it ~0.14 s and dropping the
Encoding (3.6M Rust strings) ~0.5 s, on an idle core (measured, bench/README.md "GIL during
/tokenize"); the event loop, /health included, stops meanwhile. Here a child process tokenizes and
sends the ids back as packed uint32 bytes, which the parent copies without making an object per
token. Short texts stay in the server's threads (a round trip to the child costs more than their
GIL time).

This module imports only the tokenizers library: it is what the spawned child imports.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from pathlib import Path

LONG_TEXT_CHARS = 256 * 1024  # ~90k tokens: ~15 ms of GIL in-process, the point where the child pays off

_tok = None


def _init(path: str, parent: int, text: str | None = None) -> None:
    global _tok
    from tokenizers import Tokenizer

    _tok = Tokenizer.from_str(text) if text else Tokenizer.from_file(path)
    # a parent killed with SIGKILL never tells its pool to stop, and the worker holds both ends of
    # its own call queue (no EOF): leave when re-parented
    threading.Thread(target=_exit_with, args=(parent,), name="parent-watch", daemon=True).start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _encode(text: str, add_special_tokens: bool = False) -> bytes:
    return array("I", _tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids).tobytes()


class LongEncoder:
    """`encode(text) -> array('I')` in one child process (started at the first long text; blocking,
    call it from a worker thread). A child that died is replaced at the next call."""

    def __init__(self, tokenizer_json: str | Path, text: str | None = None):
        """`text`: the tokenizer as the server encodes (Tokenizer.to_str: the BOS/EOS tokenizer_config.json
        adds included); else tokenizer.json as it is on disk."""
        self.path = str(tokenizer_json)
        self.text = text
        self._pool = None
        self._lock = threading.Lock()

    def _executor(self):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_init,
                                                 initargs=(self.path, os.getpid(), self.text))
            return self._pool

    def encode(self, text: str, add_special_tokens: bool = False) -> array:
        from concurrent.futures.process import BrokenProcessPool

        pool = self._executor()
        try:
            data = pool.submit(_encode, text, add_special_tokens).result()
        except BrokenProcessPool:  # the child was killed (OOM, say): the next call starts another
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            raise
        ids = array("I")
        ids.frombytes(data)
        return ids

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
