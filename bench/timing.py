"""Latency measurement: warm-up, then per-call samples, interleaved across variants so that drift on a shared
machine hits every variant alike. CPU samples use ``perf_counter``; CUDA samples use CUDA events (the device time
between two events recorded around the call, synchronized after each sample)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass
class Stats:
    """Summary of one variant's per-call samples, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> Stats:
        s = sorted(samples_ms)
        if not s:
            raise ValueError("no samples")

        def q(p: float) -> float:
            return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

        return cls(statistics.median(s), q(0.10), q(0.90), s[0], len(s))

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative spread printed next to each median."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Variant:
    """A callable to time; ``after`` runs untimed after each call (e.g. rolling a cache back)."""

    fn: Callable[[], object]
    after: Callable[[], object] | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call (device time on CUDA)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(variants: dict[str, Variant | Callable[[], object]], *, device: torch.device | str = "cpu",
            warmup: int = 10, rounds: int = 10, per_round: int = 10, budget_s: float | None = None
            ) -> dict[str, Stats]:
    """Time every variant: ``warmup`` untimed calls each, then ``rounds`` rounds in which each variant runs
    ``per_round`` timed calls in turn (the order rotates every round). ``budget_s`` stops early (after at least
    two rounds) when the wall time is spent."""
    device = torch.device(device)
    vs = {k: v if isinstance(v, Variant) else Variant(v) for k, v in variants.items()}
    with torch.no_grad():
        for v in vs.values():
            for _ in range(warmup):
                v.fn()
                if v.after:
                    v.after()
        _sync(device)
        samples: dict[str, list[float]] = {k: [] for k in vs}
        names = list(vs)
        start = time.perf_counter()
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                v = vs[name]
                for _ in range(per_round):
                    samples[name].append(time_call(v.fn, device))
                    if v.after:
                        v.after()
            if budget_s is not None and r >= 1 and time.perf_counter() - start > budget_s:
                break
    return {k: Stats.of(s) for k, s in samples.items()}
