"""The torch trainer's checkpoint directory: its layout on disk, which step a restarted job
resumes, and whether the checkpoints are this job's.

Shared by the trainer (which writes and reads them, with torch) and ``resihp up`` (which
decides, before anything starts, whether ``--resume`` has something to carry on): the
format is a contract between them, so it lives in the core and needs no torch.

    <ckpt_dir>/job.json                       the job that wrote them (ckpt_manifest)
    <ckpt_dir>/step_000042/layout.json        the layout step 42 was saved under
    <ckpt_dir>/step_000042/rank_00003.pt      rank 3's state after 42 optimizer steps

A step is complete when every rank its layout gives work saved a readable file; the
newest complete step is what a restarted job resumes.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from resihp.topology import Layout, LayoutError

MANIFEST = "job.json"
STEP_LAYOUT = "layout.json"


def step_dir(ckpt_dir, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:06d}"


def ckpt_path(ckpt_dir, step: int, rank: int) -> Path:
    return step_dir(ckpt_dir, step) / f"rank_{rank:05d}.pt"


def working_coords(layout: Layout) -> dict[int, tuple[int, int, int]]:
    """rank -> (dp, stage, tp_index) for the ranks of replicas that run micro-batches:
    the ranks that hold model state."""
    return {r: c for r, c in layout.coords().items() if layout.microbatches[c[0]] > 0}


def _readable(path: Path) -> bool:
    # torch.save writes a zip archive: one cut short (a crash or a full disk before
    # the data reached the disk) has no end-of-archive record, found without reading it all
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def latest_complete_ckpt(ckpt_dir) -> tuple[int, Layout] | None:
    """The newest step every working rank of its layout saved readably, with that layout;
    None if there is none.  A step some rank had not finished saving when the job
    stopped, or whose file is cut short, is passed over for the one before it."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    steps = []
    for d in root.glob("step_*"):
        try:
            steps.append(int(d.name[5:]))
        except ValueError:
            continue
    for step in sorted(steps, reverse=True):
        try:
            layout = Layout.from_json((step_dir(root, step) / STEP_LAYOUT).read_text())
        except (OSError, ValueError, LayoutError):
            continue
        if all(_readable(ckpt_path(root, step, r)) for r in working_coords(layout)):
            return step, layout
    return None


def check_manifest(ckpt_dir, want: dict) -> str | None:
    """Why the checkpoints in ``ckpt_dir`` are not those of the job ``want`` describes
    (None: they are, or no manifest was written yet)."""
    p = Path(ckpt_dir) / MANIFEST
    if not p.exists():
        return None
    try:
        have = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        return f"{p} cannot be read ({e})"
    diff = [f"{k} {have.get(k)!r} there, {v!r} here" for k, v in want.items() if have.get(k) != v]
    return f"they were written by another job ({'; '.join(diff)})" if diff else None
