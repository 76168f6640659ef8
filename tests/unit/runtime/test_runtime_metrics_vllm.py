"""The bundled runtime's /metrics under the names vLLM uses (issue 22): what the operator's HPA/KEDA
objects (vllm:num_requests_waiting, vllm:kv_cache_usage_perc), gateways' endpoint pickers and vLLM
dashboards read. A real server process on a tiny checkpoint (CPU)."""

import asyncio

import httpx
import pytest

from test_runtime_server import Server, make_checkpoint, post  # noqa: F401 - the same real server

from moe_runtime.metrics import Metrics


def test_each_update_reaches_the_vllm_twin():
    m = Metrics("tiny")
    m.queue_depth.set(3)
    m.running.set(2)
    m.kv_usage.set(0.5)
    m.prompt_tokens.inc(7)
    m.generation_tokens.inc()
    m.ttft.observe(0.2)
    m.latency.observe(1.5)
    text = m.render().decode()
    for line in ("vllm:num_requests_waiting 3.0", "moe_runtime_queue_depth 3.0", "vllm:num_requests_running 2.0",
                 "vllm:kv_cache_usage_perc 0.5", "vllm:gpu_cache_usage_perc 0.5", "vllm:prompt_tokens_total 7.0",
                 "moe_runtime_prompt_tokens_total 7.0", "vllm:generation_tokens_total 1.0",
                 "vllm:time_to_first_token_seconds_count 1.0", "vllm:e2e_request_latency_seconds_sum 1.5"):
        if line.startswith("vllm:"):  # the vLLM twins carry vLLM's model_name label
            line = line.replace(" ", '{model_name="tiny"} ', 1)
        assert line in text, line


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_checkpoint(tmp_path_factory.mktemp("srv") / "tiny-ds-nvfp4", "deepseek_v3", "nvfp4", "tiny")
    # a paged KV cache of 8 blocks x 16 tokens: one 128-token sequence fits, two 64-token completions
    # fill it (usage 1.0) and one of them is preempted and recomputed
    s = Server(model, "--max-batch", "2", "--max-queue", "16", "--max-model-len", "128", "--kv-blocks", "8",
               "--block-size", "16", tmp=tmp_path_factory.mktemp("log")).wait_ready()
    yield s
    s.stop()


def _value(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_served_metrics_follow_the_engine(server):
    before = httpx.get(server.url + "/metrics").text
    assert _value(before, "vllm:kv_cache_usage_perc") == 0.0
    r = post(server, "/v1/completions", {"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    after = httpx.get(server.url + "/metrics").text
    assert _value(after, "vllm:generation_tokens_total") - _value(before, "vllm:generation_tokens_total") == 3
    assert _value(after, "vllm:prompt_tokens_total") - _value(before, "vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert _value(after, "vllm:num_requests_waiting") == 0 and _value(after, "vllm:num_requests_running") == 0

    assert _value(after, "moe_runtime_kv_cache_blocks") == 8 and _value(after, "moe_runtime_kv_cache_block_size") == 16

    # while more requests than batch rows run, both rows are taken, the rest wait, and the two running
    # sequences hold every KV block (then one is preempted: vllm:num_preemptions)
    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": "busy", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
            tasks = [asyncio.create_task(c.post(server.url + "/v1/completions", json=body)) for _ in range(4)]
            peak = {"kv": 0.0, "waiting": 0.0, "running": 0.0}
            while not all(t.done() for t in tasks):
                text = (await c.get(server.url + "/metrics")).text
                peak = {"kv": max(peak["kv"], _value(text, "vllm:kv_cache_usage_perc")),
                        "waiting": max(peak["waiting"], _value(text, "vllm:num_requests_waiting")),
                        "running": max(peak["running"], _value(text, "vllm:num_requests_running"))}
                await asyncio.sleep(0.01)
            return peak, [t.result().status_code for t in tasks]
    peak, codes = asyncio.run(burst())
    assert codes == [200] * 4
    assert peak["kv"] == 1.0 and peak["running"] == 2 and peak["waiting"] >= 1, peak
    end = httpx.get(server.url + "/metrics").text
    assert _value(end, "vllm:kv_cache_usage_perc") == 0.0
    assert _value(end, "vllm:num_preemptions_total") >= 1


def test_a_shared_prompt_prefix_shows_as_prefix_cache_hits(server):
    """Two completions of one 70-token prompt through the real server: the second reuses the first's
    full blocks (4 of 16 tokens; its last token is always computed), and /metrics says so."""
    before = httpx.get(server.url + "/metrics").text
    body = {"prompt": [(i * 7 + 3) % 400 + 5 for i in range(70)], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    first = post(server, "/v1/completions", body)
    mid = httpx.get(server.url + "/metrics").text
    second = post(server, "/v1/completions", body)
    after = httpx.get(server.url + "/metrics").text
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    hits = [_value(t, "vllm:prefix_cache_hits_total") for t in (before, mid, after)]
    queries = [_value(t, "moe_runtime_prefix_cache_queries_total") for t in (before, mid, after)]
    computed = [_value(t, "moe_runtime_prefill_computed_tokens_total") for t in (before, mid, after)]
    assert hits[2] - hits[1] == 64 and queries[2] - queries[1] == 70
    assert computed[1] - computed[0] == 70 - (hits[1] - hits[0]) and computed[2] - computed[1] == 6
    assert _value(after, "moe_runtime_prefix_cache_hit_rate") > 0
