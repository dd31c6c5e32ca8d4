"""What ``generate`` returns: the tokens after the prompt and how the time was spent (:class:`Generation`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class Generation:
    """Tokens generated after the prompt, and how the time was spent."""

    mode: str
    tokens: list[int]
    prefill_s: float
    decode_s: float
    draft_s: float = 0.0
    verify_s: float = 0.0
    verifications: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    compile_s: float = 0.0
    """``compile=True``: the first compiled step's time, compiling included (0 when an earlier call compiled)."""

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Mean drafts accepted per verification (the dense model's own next token not counted)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        drafted = sum(self.draft_lengths)
        return sum(self.accepted) / drafted if drafted else float("nan")

    def to_dict(self) -> dict:
        """JSON-ready: a rate with nothing to count (no verification, no decode time) is ``None``, as strict JSON
        has no NaN."""
        data = asdict(self)
        rates = dict(
            decode_tokens_per_s=self.decode_tokens_per_s,
            mean_accepted=self.mean_accepted,
            acceptance_rate=self.acceptance_rate,
        )
        data.update({name: None if math.isnan(value) else value for name, value in rates.items()})
        return data
