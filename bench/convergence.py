"""Convergence under a fail-stop: fault-free vs injected-failure loss curves.

Runs the torch trainer twice on the same data order (micro-batch g of
iteration i is the same packed micro-batch whatever the layout): once
fault-free, once with a rank SIGKILLed mid-run (or a scenario file).  The
failed run recovers online (new generation without the dead rank, state
rebuilt from a surviving replica or the last persistent state) and must
follow the same curve.  Prints the curves' max/mean difference and the
recovery timeline (kill -> detected -> plan -> groups rebuilt -> state moved
-> first iteration done), writes a PNG (and an SVG with labels) of both curves.

    python bench/convergence.py [--tp 1 --pp 2 --dp 2] [--iterations 30]
                                [--kill-rank 1 --kill-at 10] [--scenario FILE] [--out DIR]
                                [--recovery-policy exclude_replica|migrate|shrink_tp]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch


def run(cfg: TrainConfig) -> tuple[list[dict], dict]:
    t0 = time.time()
    if launch(cfg.validate()) != 0:
        sys.exit(f"run failed: {cfg.out_dir}")
    rows = [json.loads(x) for x in Path(cfg.out_dir, "metrics.jsonl").read_text().splitlines()]
    tl = json.loads(Path(cfg.out_dir, "timeline.json").read_text())
    print(f"  {cfg.out_dir}: {len(rows)} iterations in {time.time() - t0:.1f}s", flush=True)
    return rows, tl


# ------------------------------------------------------------------ plots


def write_png(
    path: Path,
    curves: list[tuple[np.ndarray, tuple[int, int, int]]],
    mark_x=None,
    w: int = 800,
    h: int = 500,
) -> None:
    """Line plot as a PNG, no plotting library needed (numpy raster + zlib)."""
    img = np.full((h, w, 3), 255, np.uint8)
    m = 40
    xs_all = np.concatenate([np.arange(len(c)) for c, _, _ in curves])
    ys_all = np.concatenate([c for c, _, _ in curves])
    x0, x1 = 0, max(1, xs_all.max())
    y0, y1 = ys_all.min(), ys_all.max()
    y0, y1 = y0 - 0.05 * (y1 - y0 + 1e-9), y1 + 0.05 * (y1 - y0 + 1e-9)

    def px(x, y):
        return (m + (x - x0) / (x1 - x0) * (w - 2 * m), h - m - (y - y0) / (y1 - y0) * (h - 2 * m))

    def line(a, b, col, width=1):
        n = int(max(abs(b[0] - a[0]), abs(b[1] - a[1]))) + 1
        for t in np.linspace(0, 1, n):
            x, y = a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])
            xi, yi = int(round(x)), int(round(y))
            img[max(0, yi - width + 1) : yi + width, max(0, xi - width + 1) : xi + width] = col

    line((m, h - m), (w - m, h - m), (0, 0, 0))
    line((m, m), (m, h - m), (0, 0, 0))
    if mark_x is not None:
        xm, _ = px(mark_x, y0)
        for yy in range(m, h - m, 8):
            line((xm, yy), (xm, yy + 4), (120, 120, 120))
    for c, col, width in curves:
        pts = [px(i, v) for i, v in enumerate(c)]
        for a, b in zip(pts, pts[1:], strict=False):
            line(a, b, col, width)
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def write_svg(path: Path, a: np.ndarray, b: np.ndarray, mark_x, title: str) -> None:
    w, h, m = 800, 500, 60
    ys = np.concatenate([a, b])
    y0, y1 = ys.min(), ys.max()
    n = max(len(a), len(b)) - 1 or 1

    def pt(i, v):
        return f"{m + i / n * (w - 2 * m):.1f},{h - m - (v - y0) / (y1 - y0 + 1e-12) * (h - 2 * m):.1f}"

    def poly(c, col, dash=""):
        return (
            f'<polyline fill="none" stroke="{col}" stroke-width="2" {dash} points="'
            + " ".join(pt(i, v) for i, v in enumerate(c))
            + '"/>'
        )

    xm = m + mark_x / n * (w - 2 * m) if mark_x is not None else None
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="13">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{w / 2}" y="25" text-anchor="middle" font-size="15">{title}</text>',
        f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
        f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
        f'<text x="{w / 2}" y="{h - 20}" text-anchor="middle">iteration</text>',
        f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">loss</text>',
        f'<text x="{m - 5}" y="{m + 5}" text-anchor="end">{y1:.3f}</text>',
        f'<text x="{m - 5}" y="{h - m}" text-anchor="end">{y0:.3f}</text>',
        f'<text x="{w - m}" y="{h - m + 18}" text-anchor="end">{n}</text>',
        poly(a, "#1f77b4"),
        poly(b, "#d62728", 'stroke-dasharray="6 4"'),
        f'<text x="{w - m - 200}" y="{m + 10}" fill="#1f77b4">fault-free</text>',
        f'<text x="{w - m - 200}" y="{m + 28}" fill="#d62728">with failure (dashed)</text>',
    ]
    if xm is not None:
        svg.append(
            f'<line x1="{xm:.1f}" y1="{m}" x2="{xm:.1f}" y2="{h - m}" stroke="gray" stroke-dasharray="3 5"/>'
        )
        svg.append(f'<text x="{xm + 4:.1f}" y="{m + 50}" fill="gray">failure</text>')
    svg.append("</svg>")
    path.write_text("\n".join(svg))


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--scenario", default="", help="scenario file instead of --kill-rank/--kill-at")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--recovery-policy",
        default="exclude_replica",
        choices=["exclude_replica", "migrate", "shrink_tp"],
        help="the trainer's own plan on a death (no scheduler in this bench)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="resihp-convergence-"))
    base = dict(
        tp=a.tp,
        pp=a.pp,
        dp=a.dp,
        iterations=a.iterations,
        microbatches=a.microbatches,
        schedule=a.schedule,
        telemetry=False,
        dtype=a.dtype,
        num_layers=4,
        token_budget=256,
        pg_timeout_s=60.0,
        device=a.device,
        backend=a.backend,
    )
    print(
        f"convergence bench: TP{a.tp}xPP{a.pp}xDP{a.dp} {a.schedule}, {a.iterations} iterations "
        f"on {a.device} ({a.backend})"
    )
    ref, _ = run(TrainConfig(**base, out_dir=str(out / "fault_free")))
    if a.scenario:
        fail_kw = dict(scenario=a.scenario)
    else:
        fail_kw = dict(kill_rank=a.kill_rank, kill_at_iteration=a.kill_at)
    fail_kw["recovery_policy"] = a.recovery_policy
    got, tl = run(TrainConfig(**base, **fail_kw, out_dir=str(out / "with_failure")))
    la = np.array([r["loss"] for r in ref])
    lb = np.array([r["loss"] for r in got])
    if [r["iteration"] for r in got] != list(range(a.iterations)):
        print("WARNING: failure run did not complete every iteration exactly once")
    n = min(len(la), len(lb))
    d = np.abs(la[:n] - lb[:n])
    print(
        f"\nloss: first {la[0]:.4f}, last fault-free {la[-1]:.4f}, last with failure {lb[-1]:.4f}"
    )
    print(
        f"|difference| max {d.max():.3e}  mean {d.mean():.3e}  (relative max "
        f"{(d / np.abs(la[:n])).max():.3e}) over {n} iterations"
    )
    gens = sorted({r["generation"] for r in got})
    print(f"generations in failure run: {gens}")

    # recovery timeline of the first fail-stop
    if "kill_t" in tl:
        k = tl["kill_t"]
        ev = {
            e["what"]: e["t"]
            for e in tl["events"]
            if e.get("generation", 0) == 0 or e["what"] == "first_iteration_done"
        }
        w1 = tl["workers"].get("1", {})
        steps = [
            ("kill", k),
            ("detected (launcher saw exit)", ev.get("death_detected")),
            ("plan chosen", ev.get("plan_chosen")),
            ("groups rebuilt", w1.get("groups_rebuilt")),
            ("state moved", w1.get("state_moved")),
            ("first iteration done", w1.get("first_iteration_done")),
        ]
        print("\nrecovery timeline (seconds after the kill):")
        for name, t in steps:
            if t is not None:
                print(f"  {name:32} {t - k:8.3f}")
        if "moved" in w1:
            print(f"  state: {w1['moved']}")
        before = [r["iteration_time_s"] for r in got if r["generation"] == 0][2:]
        after = [r["iteration_time_s"] for r in got if r["generation"] > 0][1:]
        if before and after:
            print(
                f"  median iteration (pipeline) time before {np.median(before) * 1e3:.1f} ms, "
                f"after {np.median(after) * 1e3:.1f} ms"
            )
    mark = next((r["iteration"] for r in got if r["generation"] > 0), None)
    write_png(out / "convergence.png", [(la, (31, 119, 180), 5), (lb, (214, 39, 40), 2)], mark)
    write_svg(
        out / "convergence.svg", la, lb, mark, "loss: fault-free vs fail-stop with online recovery"
    )
    (out / "convergence.json").write_text(
        json.dumps(
            {
                "fault_free": la.tolist(),
                "with_failure": lb.tolist(),
                "max_abs_diff": float(d.max()),
                "mean_abs_diff": float(d.mean()),
                "timeline": tl,
            },
            indent=1,
        )
    )
    print(
        f"\nwrote {out / 'convergence.png'} (thick blue: fault-free, thin red: with failure; dashed gray: "
        f"first iteration after recovery), {out / 'convergence.svg'}, {out / 'convergence.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
