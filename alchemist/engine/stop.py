"""When a request is done: stop tokens, stop strings, max_tokens and the context length.

After each sampled token the checker extends the request's text (incrementally detokenized) and decides, in
vLLM's order: a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``; its text is not added) ends
with "stop"; then a stop string found in the text ends with "stop" and cuts the text just before it (OpenAI does
not include it); then ``max_tokens`` or a full context ends with "length". While a request with stop strings
runs, the last ``max(len(stop)) - 1`` characters are held back from streaming, since a stop string may be
starting there.

``min_tokens`` (vLLM's semantics, stop strings included): until the request has that many output tokens, the
token just sampled counted, neither a stop token nor a stop string ends it; an EOS is then an ordinary token, as
with ``ignore_eos``. Unlike vLLM, which masks EOS and ``stop_token_ids`` out of the logits, they may still be
sampled; a stop string completed before then is not looked for again. Only ``max_tokens`` and the context end it
early.
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
        may_stop = seq.num_output_tokens >= params.min_tokens
        is_eos = not params.ignore_eos and token_id in self.eos_token_ids
        if may_stop and (token_id in params.stop_token_ids or is_eos):
            self._add_text(seq, seq.detokenizer.flush())  # a character still held back by the detokenizer
            return "stop"
        if self._add_text(seq, seq.detokenizer.add(token_id), may_stop):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "stop" if self._add_text(seq, seq.detokenizer.flush()) else "length"
        return None

    @staticmethod
    def hold_back(seq: Sequence) -> int:
        """Characters to keep from streaming while ``seq`` runs."""
        return max(map(len, seq.params.stop), default=1) - 1

    def _add_text(self, seq: Sequence, delta: str, may_stop: bool = True) -> bool:
        """Appends ``delta``; True (and the text cut before it) when a stop string now appears and ``may_stop``."""
        if not delta:
            return False
        old_len = len(seq.text)
        seq.add_text(delta)
        stops = seq.params.stop
        if not stops or not may_stop:
            return False
        # A new match must end inside the delta, so it starts at most len(stop) - 1 characters before it.
        start = max(0, old_len - self.hold_back(seq))
        found = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
        if not found:
            return False
        seq.truncate_text(min(found))
        return True
