"""tokenize_worker.LongEncoder: the child process gives exactly the in-process ids, a killed child
is replaced at the next call, and the server sends only long texts there."""

import os
import signal
from concurrent.futures.process import BrokenProcessPool

import pytest

from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.tokenize_worker import LONG_TEXT_CHARS, LongEncoder
from moe_runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tokw") / "q", "qwen3_moe", "bf16", "tiny")


@pytest.fixture
def enc(model):
    e = LongEncoder(model / "tokenizer.json")
    yield e
    e.close()


def test_child_ids_equal_in_process_ids(model, enc):
    tok = Tokenizer(model)
    text = ("Grüße, 世界! <|im_end|> tabs\tand  double  spaces\n\n" * 9000)[: LONG_TEXT_CHARS + 777]
    got = enc.encode(text)
    assert got.typecode == "I" and got.tolist() == tok.encode(text)
    assert enc.encode("").tolist() == []


def test_a_killed_child_is_replaced(enc):
    assert enc.encode("hello world").tolist()
    (pid,) = list(enc._pool._processes)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(BrokenProcessPool):
        for _ in range(50):  # the pool notices the dead child at the next submit
            enc.encode("hello again")
    assert enc.encode("hello world").tolist()  # a new child


def test_server_sends_only_long_texts_to_the_child(model):
    import asyncio

    from moe_runtime.metrics import Metrics
    from moe_runtime.http.app import create_app
    from moe_runtime.http.state import ServerState

    calls = []

    class Spy(LongEncoder):
        def encode(self, text, add_special_tokens=False):
            calls.append(len(text))
            return super().encode(text, add_special_tokens)

    state = ServerState(model_name="m", metrics=Metrics(), tokenizer=Tokenizer(model), long_encoder=Spy(model / "tokenizer.json"))
    try:
        import httpx

        app = create_app(state)

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                short = await c.post("/tokenize", json={"prompt": "hello world"})
                long = await c.post("/tokenize", json={"prompt": "hello world " * (LONG_TEXT_CHARS // 12 + 1)})
                return short, long

        short, long = asyncio.run(go())
        assert short.status_code == 200 and long.status_code == 200, (short.text, long.text[:200])
        assert calls == [len("hello world " * (LONG_TEXT_CHARS // 12 + 1))]
        assert long.json()["tokens"] == Tokenizer(model).encode("hello world " * (LONG_TEXT_CHARS // 12 + 1))
    finally:
        state.long_encoder.close()


def test_the_child_leaves_when_its_parent_is_killed(model, tmp_path):
    """A server killed with SIGKILL (tests, OOM) must not leave its tokenizer child behind."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    code = ("import sys, time; sys.path[:0] = sys.argv[2:]; from moe_runtime.tokenize_worker import LongEncoder; "
            "e = LongEncoder(sys.argv[1]); e.encode('hi'); print(list(e._pool._processes)[0], flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(model / "tokenizer.json"),
                          *(str(root / s) for s in ("operator", "runtime", "kernels"))], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    p.kill()
    p.wait()
    t0 = time.time()
    while Path(f"/proc/{child}").exists() and time.time() - t0 < 15:
        try:
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z", \
        f"tokenizer child {child} outlived its killed parent"
