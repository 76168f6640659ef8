"""The OpenAI wire format this server speaks: request bodies (pydantic), the error shape
({"error": {"message", "type", "param", "code"}}) and the refusal of parameters it does not
implement (400 naming them, never silently ignored)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine import SamplingParams

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings / stop token ids per request
MAX_BATCH_PROMPTS = 256  # prompts in one /v1/completions request (a batch of lm-eval requests)
MAX_LOGPROBS = 20

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
          499: "client_closed_request", 500: "server_error", 503: "unavailable"}


def error(status: int, message: str, type_: str | None = None, code: str | int | None = None,
          headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_ or ERROR_TYPES.get(status, "server_error" if status >= 500
                                                                       else "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)



# ---------------------------------------------------------------------------------------- bodies

# Parameters of the OpenAI API this server does not implement, with the values that mean "not
# used" (accepted). Anything else set is refused with 400 naming the parameter, never ignored.
_UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "best_of": (None, 1),
    "suffix": (None, ""), "echo": (None, False), "audio": (None,),  # echo: chat's (completions has it) "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    # vLLM's extra fields (protocol.py ChatCompletionRequest / CompletionRequest, v0.11.0), accepted at
    # the values that change nothing here (clients written for vLLM send its defaults)
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "include_reasoning": (None, True), "documents": (None,), "chat_template": (None,),
    "mm_processor_kwargs": (None, {}), "structured_outputs": (None,), "structural_tag": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "priority": (None, 0),
    "logits_processors": (None, []), "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None, {}),
}


class StreamOptions(BaseModel):
    """vLLM's StreamOptions (protocol.py, v0.11.0): include_usage defaults to true once stream_options
    is sent; continuous_usage_stats puts the running usage on every chunk."""
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = True
    continuous_usage_stats: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with completions' echo (refusal)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM: the matched stop string ends the text
    skip_special_tokens: bool = True  # vLLM: special tokens left out of the text
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    min_tokens: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    user: str | None = None
    request_id: str | None = Field(default=None, max_length=256)  # vLLM: the response id's suffix
    # vLLM's prompt_logprobs (protocol.py CompletionRequest / ChatCompletionRequest, v0.11.0): each
    # prompt token's logprob and the k most likely there; -1 (the whole vocabulary) is not served
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    def max_new(self, default_max: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default_max

    def top_logprobs_k(self) -> int | None:  # None: no logprobs asked (the subclasses' fields)
        return None

    def prompt_logprobs_k(self) -> int | None:
        return self.prompt_logprobs

    def sampling(self, default_max: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_new(default_max), temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            ignore_eos=self.ignore_eos, top_k=max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens, logprobs=self.top_logprobs_k(), prompt_logprobs=self.prompt_logprobs_k())

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in (self.stop or []) if s]


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion, with its logprobs when logprobs is set
    add_special_tokens: bool = True  # vLLM's CompletionRequest default (the tokenizer's BOS template)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            if len(v) > MAX_BATCH_PROMPTS:
                raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts in one request")
            if any(not p for p in v):
                raise ValueError("prompt must not be empty")
            if len({type(p) for p in v}) != 1:
                raise ValueError("a batched prompt is all strings or all token-id lists")
        return v

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (vLLM generates one token and drops it:
        protocol.py CompletionRequest.to_sampling_params echo_without_generation, v0.11.0)."""
        return self.echo and self.max_tokens == 0

    def prompt_logprobs_k(self) -> int | None:
        # echo scores the prompt with logprobs' k unless prompt_logprobs says (to_sampling_params, v0.11.0)
        return self.prompt_logprobs if self.prompt_logprobs is not None or not self.echo else self.logprobs

    def max_new(self, default_max: int) -> int:
        return 1 if self.echo_only else super().max_new(default_max)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
                    raise ValueError(f"content part type {part.get('type')!r} is not supported "
                                     "(this server takes text parts only)")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise ValueError("tool_calls are not supported by this server")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: the text parts
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat fields (vllm/entrypoints/openai/protocol.py ChatCompletionRequest, v0.11.0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # vLLM's chat default: the template writes the special tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            return None  # refused in refusal
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's TokenizeCompletionRequest / TokenizeChatRequest fields (protocol.py, v0.11.0); None:
    # true for a prompt, false for messages, as there
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def bad_unicode(obj: Any, path: str = "") -> str | None:
    """The first string (by path) that is not valid Unicode (a lone surrogate from a \\ud800 escape)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        if (bad := bad_unicode(v, f"{path}.{k}" if path else str(k))) is not None:
            return bad
    return None


def refusal(body: Sampling, vocab: int) -> JSONResponse | None:
    """400 for what is set but not implemented, unknown, or inconsistent; None when acceptable."""
    extra = body.model_extra or {}
    unimpl = [k for k, v in extra.items() if k in _UNIMPLEMENTED and v not in _UNIMPLEMENTED[k]]
    if unimpl:
        return error(400, f"parameter(s) not supported by this server: {', '.join(unimpl)}", param=unimpl[0],
                     code="unsupported_parameter")
    unknown = [k for k in extra if k not in _UNIMPLEMENTED]
    if unknown:
        return error(400, f"unknown parameter(s): {', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
    if (bad := bad_unicode(body.model_dump())) is not None:
        return error(400, f"invalid Unicode in {bad} (a lone surrogate)", param=bad)
    if body.stream_options is not None and not body.stream:
        return error(400, "stream_options is only allowed with stream=true", param="stream_options")
    if body.max_tokens == 0 and not (isinstance(body, CompletionRequest) and body.echo):
        return error(400, "max_tokens must be at least 1 (0 only with echo=true on /v1/completions)",
                     param="max_tokens")
    if body.stream and body.prompt_logprobs:  # vLLM's check_logprobs (protocol.py, v0.11.0)
        return error(400, "prompt_logprobs are not available when stream=true", param="prompt_logprobs")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        return error(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    bad_ids = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
    if bad_ids:
        return error(400, f"stop_token_ids must be in [0, {vocab}); got {bad_ids[0]}", param="stop_token_ids")
    return None


# Output length against the context, as vLLM's OpenAI server decides it (v0.11.0:
# vllm/entrypoints/openai/serving_engine.py OpenAIServing._validate_input refuses an asked max_tokens
# that does not fit; vllm/entrypoints/utils.py get_max_tokens gives the rest of the context otherwise).

def context_overflow(prompt_n: int, asked: int | None, max_len: int | None) -> str | None:
    """vLLM's 400 message when the prompt alone, or prompt + asked max_tokens, exceed the context
    (None: it fits); the wording of OpenAIServing._validate_input (serving_engine.py, v0.11.0)."""
    if max_len is None:
        return None
    if prompt_n >= max_len:  # a completion needs one position after the prompt
        return (f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{prompt_n} input tokens. Please reduce the length of the input messages.")
    if asked is None or prompt_n + asked <= max_len:
        return None
    return (f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum context "
            f"length is {max_len} tokens and your request has {prompt_n} input tokens "
            f"({asked} > {max_len} - {prompt_n}).")


def default_max_tokens(chat: bool, prompt_n: int, max_len: int | None) -> int:
    """Unasked: the rest of the context for chat (vLLM), OpenAI's 16 for completions, within it."""
    rest = max(max_len - prompt_n, 1) if max_len is not None else None
    if chat:
        return rest if rest is not None else 256
    return min(16, rest) if rest is not None else 16

