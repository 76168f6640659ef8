"""Stop strings over streamed text: what may be sent now, and where the output ends.

Text already sent cannot be taken back, so the longest tail that could still become a stop string
is held until it is known not to match (vLLM holds a fixed `max(len(stop)) - 1` characters:
vllm/v1/engine/detokenizer.py, `BaseIncrementalDetokenizer.update`, v0.11.0; holding only a
real partial match sends the text sooner). Each push scans only the held tail plus the new text.
"""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self.held = ""
        # include mode sends a stop string's start, so the search must look back over what was sent
        self.sent_tail, self.look_back = "", max((len(x) for x in self.stops), default=1) - 1
        self.matched: str | None = None  # the stop string that ended the output (vLLM's stop_reason)

    def push(self, delta: str) -> str:
        """The text that can be sent now; after a match (`matched` set) the output is over."""
        if self.matched is not None:
            return ""
        back = self.sent_tail
        buf = back + self.held + delta
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            self.matched, self.held = s, ""
            return buf[len(back):i + len(s)] if self.include else buf[len(back):i]
        if self.include:  # the start of a stop string is sent anyway (as in vLLM)
            self.sent_tail = buf[-self.look_back:] if self.look_back else ""
            return buf[len(back):]
        keep = partial_suffix(buf, self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of the sequence (no match): the held text is output after all."""
        held, self.held = ("" if self.matched is not None else self.held), ""
        return held


def partial_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
