"""lm-eval drives `moe-runtime serve` unchanged (issue 31 item 4): its `local-completions` model on a
multiple-choice task (loglikelihood requests: echo + logprobs) and its `local-chat-completions` model
on a generate_until task, both tasks written here with local data (no hub access).

The reference is transformers, not this server: the tiny Qwen3-MoE checkpoint (bf16 weights, served
in fp32) is loaded by `AutoModelForCausalLM`, and every loglikelihood lm-eval got must be the
continuation's log-probability under transformers' forward; every generation, transformers' greedy
`generate` from the same chat prompt, cut at the task's stop string.
"""

import json
import os

import pytest
import torch

from test_runtime_server import Server, make_checkpoint  # noqa: F401 - the same real server

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

MC_DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "moon", "red wall"], "answer": 0},
    {"question": "Numbers: 1 2 3", "choices": [" 4 5", " cat", " 10 100"], "answer": 0},
    {"question": "def main(): return", "choices": [" 0", " hello world", " 3.14"], "answer": 0},
]
GEN_DOCS = [{"question": "Say hello", "answer": "hello"}, {"question": "Count: 1 2", "answer": "3"}]
MAX_GEN = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmeval")
    model = make_checkpoint(tmp / "tiny-qwen3", "qwen3_moe", "bf16", "tiny")
    s = Server(model, "--dtype", "float32", "--served-model-name", "tiny", "--max-batch", "4",
               "--enable-tokenizer-info-endpoint", tmp=tmp).wait_ready()
    yield s, model, tmp
    s.stop()


@pytest.fixture(scope="module")
def hf(served):
    _, model, _ = served
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return m, transformers.AutoTokenizer.from_pretrained(model)


def _tasks(tmp):
    (tmp / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (tmp / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {MAX_GEN}
metric_list:
  - metric: exact_match
""")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tmp), include_defaults=False)  # indexing the built-in tasks takes 16 s


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")


def _loglikelihood(m, context_ids, continuation_ids):
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0].float(), -1)
    n = len(context_ids)
    return sum(float(lp[n - 1 + i, t]) for i, t in enumerate(continuation_ids))


def test_local_completions_multiple_choice_matches_transformers(served, hf):
    s, model, tmp = served
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions")(model="tiny", base_url=s.url + "/v1/completions", tokenizer=str(model),
                                        tokenizer_backend="huggingface", num_concurrent=1, max_retries=1,
                                        batch_size=2)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=_tasks(tmp), log_samples=True,
                                  bootstrap_iters=0)
    assert 0.0 <= out["results"]["tiny_mc"]["acc,none"] <= 1.0
    samples = out["samples"]["tiny_mc"]
    assert len(samples) == len(MC_DOCS)
    m, _ = hf
    for smp in samples:
        assert len(smp["resps"]) == 3
        for (ctx, cont), resp in zip(smp["arguments"], smp["resps"]):
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
            ll, greedy = resp[0]
            assert ll == pytest.approx(_loglikelihood(m, ctx_ids, cont_ids), abs=2e-3), (ctx, cont)
            assert ll < 0 and isinstance(greedy, bool)


def test_local_completions_finds_the_servers_tokenizer(served, hf):
    """No tokenizer given: lm-eval's auto backend finds /tokenizer_info and /tokenize (vLLM's, with
    --enable-tokenizer-info-endpoint) and tokenizes through the server, as transformers does."""
    s, model, _ = served
    from lm_eval.api.registry import get_model
    from lm_eval.api.instance import Instance

    lm = get_model("local-completions")(model="tiny", base_url=s.url + "/v1/completions", num_concurrent=1,
                                        max_retries=1)
    assert lm.tokenizer_backend == "remote"
    m, tok = hf
    ctx, cont = "The quick brown fox", " jumps over"
    assert lm.tok_encode(ctx) == tok(ctx, add_special_tokens=False).input_ids
    (ll, _), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)])
    ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
    assert ll == pytest.approx(_loglikelihood(m, ctx_ids, cont_ids), abs=2e-3)


def test_local_chat_completions_generate_until_matches_transformers(served, hf):
    s, model, tmp = served
    from lm_eval.api.registry import get_model

    lm = get_model("local-chat-completions")(model="tiny", base_url=s.url + "/v1/chat/completions",
                                             num_concurrent=1, max_retries=1)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_gen"], task_manager=_tasks(tmp), log_samples=True,
                                  apply_chat_template=True, bootstrap_iters=0)
    samples = out["samples"]["tiny_gen"]
    assert len(samples) == len(GEN_DOCS) and "exact_match,none" in out["results"]["tiny_gen"]
    m, tok = hf
    for smp, doc in zip(sorted(samples, key=lambda x: x["doc_id"]), GEN_DOCS):
        got = smp["resps"][0][0]
        prompt = tok.apply_chat_template([{"role": "user", "content": doc["question"]}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = m.generate(ids, max_new_tokens=MAX_GEN, do_sample=False)[0, ids.shape[1]:]
        want = tok.decode(gen, skip_special_tokens=True).split("\n\n")[0]
        assert got == want, (doc, got, want)
