"""Draw the engine and worker lanes of a few decode steps, sync above async, as SVG.

    python benchmarks/trace_picture.py [--out docs/trace_sync_vs_async.svg]

Also writes each mode's full Chrome/Perfetto trace to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from common import RESULTS, random_prompts

from forerun import LLM, SamplingParams
from forerun.trace import ENGINE_LANE, WORKER_LANE, Span

COLORS = {"schedule": "#4e79a7", "update": "#59a14f", "output": "#8cd17d",
          "prepare": "#f28e2b", "forward": "#e15759", "sample": "#b07aa1"}


def capture(mode: str, dtype: str, n: int) -> list[Span]:
    trace = RESULTS / f"trace_{'async' if mode == 'on' else 'sync'}.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    llm = LLM(dtype=dtype, async_scheduling=mode, kv_cache_memory_bytes=256 << 20,
              max_model_len=512, trace_file=str(trace))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(rng, n, 32), params, use_tqdm=False)  # warm-up
    tracer = llm.llm_engine.tracer
    tracer.spans.clear()
    llm.generate(random_prompts(rng, n, 32), params, use_tqdm=False)
    spans = list(tracer.spans)
    llm.shutdown()
    return spans


Window = tuple[list[Span], float, float]


def steps_window(spans: list[Span], first: int, count: int) -> Window:
    """Spans from the start of forward ``first`` to the end of forward ``first+count``."""
    fwd = sorted((s for s in spans if s.name == "forward"), key=lambda s: s.start)
    t0, t1 = fwd[first].start, fwd[min(first + count, len(fwd) - 1)].end
    return [s for s in spans if s.end > t0 and s.start < t1 and s.name in COLORS], t0, t1


def boundary_window(spans: list[Span], step_index: int, width_ms: float) -> Window:
    """A few milliseconds around the end of one step's sampling on the worker."""
    samples = sorted((s for s in spans if s.name == "sample"), key=lambda s: s.start)
    t0 = samples[step_index].start - 0.3e-3
    t1 = t0 + width_ms * 1e-3
    return [s for s in spans if s.end > t0 and s.start < t1 and s.name in COLORS], t0, t1


def svg(panels: list[tuple[str, Window]], width: int = 1000) -> str:
    lane_h, gap, left = 26, 70, 150
    height = len(panels) * (2 * lane_h + gap) + 40
    span_ms = max(t1 - t0 for _, (_, t0, t1) in panels) * 1e3
    scale = (width - left - 20) / span_ms
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    y = 20
    for title, (spans, t0, t1) in panels:
        out.append(f'<text x="10" y="{y}" font-weight="bold">{title}</text>')
        for i, lane in enumerate((ENGINE_LANE, WORKER_LANE)):
            ly = y + 10 + i * lane_h
            out.append(f'<text x="10" y="{ly + 17}">{lane}</text>')
            for s in spans:
                if s.lane != lane:
                    continue
                start, end = max(s.start, t0), min(s.end, t1)
                x = left + (start - t0) * 1e3 * scale
                w = max((end - start) * 1e3 * scale, 1.0)
                out.append(f'<rect x="{x:.1f}" y="{ly}" width="{w:.1f}" height="{lane_h - 4}" '
                           f'fill="{COLORS[s.name]}"><title>{s.name} step {s.step} '
                           f'{(s.end - s.start) * 1e3:.2f} ms</title></rect>')
        y += 2 * lane_h + gap
    x = left
    for name, color in COLORS.items():
        out.append(f'<rect x="{x}" y="{height - 22}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{x + 16}" y="{height - 12}">{name}</text>')
        x += 90
    out.append(f'<text x="{width - 160}" y="{height - 12}">scale: {span_ms:.1f} ms wide</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent.parent / "docs" /
                                         "trace_sync_vs_async.svg"))
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, zoom = [], []
    for mode, title in (("off", "sync (--no-async-scheduling)"), ("on", "async (default)")):
        spans = capture(mode, args.dtype, args.num_prompts)
        steps.append((f"{title}: five decode steps", steps_window(spans, 8, 5)))
        zoom.append((f"{title}: one step boundary", boundary_window(spans, 10, 4.0)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg(steps))
    zoom_out = out.with_name(out.stem + "_boundary.svg")
    zoom_out.write_text(svg(zoom))
    print(f"wrote {out} and {zoom_out}")


if __name__ == "__main__":
    main()
