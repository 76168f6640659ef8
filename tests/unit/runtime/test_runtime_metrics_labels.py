"""vLLM's dashboard works on our /metrics (issue 31 item 8): the vllm:* twins carry the served
`model_name` label (every panel of vLLM's Grafana dashboard filters on it) and the inter-token
latency histogram vllm:time_per_output_token_seconds is there and fed by the engine."""

import torch
from fastapi.testclient import TestClient

from moe_runtime.engine import Engine
from moe_runtime.http.app import create_app
from moe_runtime.http.state import ServerState
from moe_runtime.metrics import Metrics
from moe_runtime.tokenizer import Tokenizer, build_tokenizer_files
from table_model import TableModel

# every series vLLM's Grafana dashboard queries, each with {model_name="$model_name"}: its panels'
# exprs, read from vllm-project/vllm examples/online_serving/prometheus_grafana/grafana.json (the copy
# at commit 004f771; the file is not in the wheel)
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
             "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
             "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
             "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
             "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
             "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
             "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
             "vllm:request_max_num_generation_tokens_sum",
             "vllm:kv_cache_usage_perc"]  # the last: vLLM 0.11.0's name for gpu_cache_usage_perc


def test_dashboard_series_carry_model_name_and_tpot_is_observed(tmp_path):
    build_tokenizer_files(tmp_path, 512, 64)
    tok = Tokenizer(tmp_path)
    m = Metrics()
    eng = Engine(TableModel(tok.vocab_size, seed=4, scale=1.0), "cpu", 2, 8, 64, tok.stop_ids, m)
    eng.start()
    try:
        client = TestClient(create_app(ServerState("tiny-moe", m, eng, tok, ready=True)))
        r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200
        text = client.get("/metrics").text
    finally:
        eng.stop()
    for name in DASHBOARD:
        assert any(line.startswith(name + "{") and 'model_name="tiny-moe"' in line for line in text.splitlines()), name
    # the Finish Reason panel sums by finished_reason; the phase panels rate the sums
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-moe"} 1.0' in text
    assert 'vllm:request_generation_tokens_sum{model_name="tiny-moe"} 6.0' in text
    assert 'vllm:request_prompt_tokens_count{model_name="tiny-moe"} 1.0' in text
    assert 'vllm:request_decode_time_seconds_count{model_name="tiny-moe"} 1.0' in text
    # 6 tokens: 5 gaps between consecutive tokens
    assert 'vllm:time_per_output_token_seconds_count{model_name="tiny-moe"} 5.0' in text
    assert "moe_runtime_time_per_output_token_seconds_count 5.0" in text
