"""The sglang Engine (engines/base.py ImageEngine): its rows are engines/sglang/plan.py's."""

from __future__ import annotations

from ..base import ImageEngine
from . import command, plan, startup, vocab

ENGINE = ImageEngine(vocab, command, plan, startup, fallbacks=plan.FALLBACKS)
