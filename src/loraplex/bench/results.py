"""One benchmark run's timings, and what the report says of them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RunResult:
    """Timings of one system on one workload. Times are seconds from the run's start, when every
    request was queued (offline: all arrive at once), so a request's TTFT includes its wait."""
    system: str
    popularity: str
    max_batch: int | None            # None: as many sequences as fit
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    first_token_s: list[float]       # per request
    last_token_s: list[float]
    output_lens: list[int]
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        ttft = np.asarray(self.first_token_s) * 1e3
        multi = [(last - first) / (n - 1) * 1e3 for first, last, n
                 in zip(self.first_token_s, self.last_token_s, self.output_lens) if n > 1]
        tpot = np.asarray(multi) if multi else np.asarray([float("nan")])
        return dict(
            system=self.system, popularity=self.popularity,
            max_batch=self.max_batch if self.max_batch is not None else "unlimited",
            requests=self.num_requests, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            seconds=round(self.seconds, 3),
            tokens_per_s=self.output_tokens / self.seconds,
            total_tokens_per_s=(self.prompt_tokens + self.output_tokens) / self.seconds,
            requests_per_s=self.num_requests / self.seconds,
            ttft_ms_p50=float(np.percentile(ttft, 50)), ttft_ms_p99=float(np.percentile(ttft, 99)),
            tpot_ms_p50=float(np.percentile(tpot, 50)), tpot_ms_p99=float(np.percentile(tpot, 99)),
            **self.extra)

    def to_dict(self) -> dict:
        return asdict(self)


def check_complete(result: RunResult, expected_lens: list[int]) -> None:
    """Every request produced exactly its output length (a benchmark that drops work proves nothing)."""
    if result.output_lens != list(expected_lens):
        bad = [i for i, (a, b) in enumerate(zip(result.output_lens, expected_lens)) if a != b]
        raise RuntimeError(f"{result.system}: {len(bad)} request(s) produced the wrong number of tokens, "
                           f"e.g. request {bad[0] if bad else '?'}")
    if sum(expected_lens) != result.output_tokens:
        raise RuntimeError(f"{result.system}: counted {result.output_tokens} output tokens, expected "
                           f"{sum(expected_lens)}")
