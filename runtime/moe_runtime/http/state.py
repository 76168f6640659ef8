"""What the HTTP layer is given: its settings (from the serve flags) and the serving state that
serve fills in while it loads (engine, tokenizer, ready/draining)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerOptions:
    """HTTP-layer settings from the serve flags (flags.server_options), given to ServerState."""

    api_key: str | None = None  # Bearer token for /v1/*, /tokenize, /detokenize (None: open)
    max_body_bytes: int = 32 * 1024 * 1024
    tokenizer_info: bool = False  # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint; off there too)


@dataclass
class ServerState:
    model_name: str
    metrics: Any
    engine: Any = None
    tokenizer: Any = None
    ready: bool = False
    draining: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    options: ServerOptions = field(default_factory=ServerOptions)
    long_encoder: Any = None  # tokenize_worker.LongEncoder (serve sets it): long texts off the GIL

    def __post_init__(self) -> None:
        self.metrics.bind_model(self.model_name)  # vLLM's model_name label on the vllm:* twins
