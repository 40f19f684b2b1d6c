"""Helpers shared by the benchmarks: random prompts, timing, tables, JSON."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def random_prompts(rng: random.Random, n: int, length: int, vocab: int = 49152
                   ) -> list[dict[str, list[int]]]:
    """Fresh random token-id prompts (no prefix-cache hits between runs)."""
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]}
            for _ in range(n)]


def mean_tpot_ms(outputs: list[Any]) -> float:
    """Mean time per output token after the first, over requests with two or more tokens."""
    per_req = []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m and m.first_token_time and m.last_token_time and n > 1:
            per_req.append((m.last_token_time - m.first_token_time) / (n - 1))
    return 1e3 * statistics.mean(per_req) if per_req else float("nan")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(name: str, data: Any, path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    return out
