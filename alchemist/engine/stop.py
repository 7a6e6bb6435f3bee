"""When a request is done: stop tokens, stop strings, max_tokens and the context length.

After each sampled token the checker extends the request's text (incrementally detokenized) and decides, in
vLLM's order: a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``; its text is not added) ends
with "stop"; then a stop string found in the text ends with "stop" and cuts the text just before it (OpenAI does
not include it); then ``max_tokens`` or a full context ends with "length". While a request with stop strings
runs, the last ``max(len(stop)) - 1`` characters are held back from streaming, since a stop string may be
starting there.
"""

from __future__ import annotations

from alchemist.engine.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token_id: int) -> str | None:
        """Adds ``token_id``'s text to ``seq`` (already appended to its ids); returns a finish reason or None."""
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self._add_text(seq, seq.detokenizer.flush())  # a character still held back by the detokenizer
            return "stop"
        if self._add_text(seq, seq.detokenizer.add(token_id)):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "stop" if self._add_text(seq, seq.detokenizer.flush()) else "length"
        return None

    @staticmethod
    def hold_back(seq: Sequence) -> int:
        """Characters to keep from streaming while ``seq`` runs."""
        return max(map(len, seq.params.stop), default=1) - 1

    def _add_text(self, seq: Sequence, delta: str) -> bool:
        """Appends ``delta``; True (and the text cut before it) when a stop string now appears."""
        if not delta:
            return False
        old_len = len(seq.text)
        seq.add_text(delta)
        stops = seq.params.stop
        if not stops:
            return False
        # A new match must end inside the delta, so it starts at most len(stop) - 1 characters before it.
        start = max(0, old_len - self.hold_back(seq))
        found = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
        if not found:
            return False
        seq.truncate_text(min(found))
        return True
