"""The TTFT model of `polarkv replay --engine vllm`, calibrated on the engine it predicts.

Prefill of a request of L prompt tokens of which H are found cached (the engine's own
prefix cache or PolarKV) costs

    a + b * (L - H) + c * (L^2 - H^2)

seconds: a fixed cost per request (scheduling, the API server, the first decode step),
a linear term per computed token (the MLPs, projections), and attention, where each of
the L - H new tokens attends to every token before it (sum over positions H..L ~ (L^2 -
H^2) / 2). a, b, c are fitted by least squares to TTFTs of the same engine measured
with no cache at a few prompt lengths, at the start of the run.

A load from PolarKV adds `load_s_per_token` per token the engine took from PolarKV,
fitted per layout on loads measured before its replay (one engine stores a fresh prompt,
the other loads it: the residual of that TTFT over the modelled prefill of the rest); the
engine's own prefix cache costs nothing extra.

Queueing: each engine serves its requests one after another in arrival order (a request
starts when the previous one's prefill is done), so a burst waits; vLLM batches
prefills, which this leaves out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    """One replayed request, as measured: what the model needs and what it is checked on."""

    arrival_s: float  # when it was sent, since the replay started
    engine: int
    prompt_tokens: int
    cached_tokens: int  # the engine's count: own prefix cache plus PolarKV
    external_share: float  # of cached tokens, the share from PolarKV (the layout's counters)
    ttft_s: float


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a 3x3 system, no numpy needed)."""
    n = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if abs(rows[col][col]) < 1e-300:
            raise ValueError("the calibration points do not determine the model")
        for r in range(n):
            if r != col:
                f = rows[r][col] / rows[col][col]
                rows[r] = [x - f * y for x, y in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] / rows[i][i] for i in range(n)]


def fit_prefill(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(a, b, c) of a + b*L + c*L^2 by least squares over (L, seconds) points. Lengths
    are scaled to thousands of tokens while solving, which keeps the system well posed."""
    if len({n for n, _ in points}) < 3:
        raise ValueError("the prefill fit needs at least three distinct prompt lengths")
    xs = [[1.0, n / 1000, (n / 1000) ** 2] for n, _ in points]
    ata = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
    aty = [sum(x[i] * t for x, (_, t) in zip(xs, points, strict=True)) for i in range(3)]
    a, b, c = _solve(ata, aty)
    return a, b / 1000, c / 1e6


@dataclass(frozen=True)
class TtftModel:
    a: float
    b: float
    c: float
    load_s_per_token: float = 0.0

    def prefill_s(self, prompt: int, cached: int) -> float:
        new = max(0, prompt - cached)
        return max(0.0, self.a + self.b * new + self.c * (prompt**2 - cached**2))

    def service_s(self, r: Served) -> float:
        loaded = r.cached_tokens * r.external_share
        return self.prefill_s(r.prompt_tokens, r.cached_tokens) + self.load_s_per_token * loaded

    def predict(self, served: Sequence[Served]) -> list[float]:
        """Modelled TTFT of each request, in the given order, with queueing per engine."""
        free: dict[int, float] = {}
        out: dict[int, float] = {}
        for i in sorted(range(len(served)), key=lambda i: served[i].arrival_s):
            r = served[i]
            start = max(r.arrival_s, free.get(r.engine, 0.0))
            free[r.engine] = start + self.service_s(r)
            out[i] = free[r.engine] - r.arrival_s
        return [out[i] for i in range(len(served))]

    def with_load(self, loads: Sequence[tuple[int, int, float]]) -> TtftModel:
        """This model with `load_s_per_token` fitted (least squares through the origin)
        to measured loads, (prompt tokens, tokens loaded, TTFT) each: the TTFT that the
        prefill of the rest leaves unexplained, per loaded token."""
        num = den = 0.0
        for prompt, loaded, ttft in loads:
            if loaded > 0:
                num += loaded * (ttft - self.prefill_s(prompt, loaded))
                den += loaded * loaded
        return TtftModel(self.a, self.b, self.c, max(0.0, num / den) if den else 0.0)

    def to_json(self) -> dict[str, float]:
        return {
            "a_s": self.a,
            "b_s_per_token": self.b,
            "c_s_per_token2": self.c,
            "load_s_per_token": self.load_s_per_token,
        }
