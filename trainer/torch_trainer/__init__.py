"""Real hybrid-parallel trainer (TP x PP x DP) on torch.distributed for the ResiHP stack.

``python -m trainer torch ...`` calls :func:`main`.  See ``launcher`` (worker
generations and plan application), ``worker`` (one rank), ``engine`` (one
iteration), ``model`` (LLaMA-style decoder with TP and ZB weight-gradient
deferral), ``parallel`` (groups and §7 P2P rule), ``state`` (optimizer-state
moves and persistent checkpoints), ``telemetry`` (producer hookup).

The optimizer is AdamW with global gradient-norm clipping (``--grad-clip-norm``,
default 1.0 as in LLaMA training; 0 turns it off): the norm is reduced over the
whole job on the iteration's commit all-reduce, so it costs no extra collective,
and it stays right after a reconfiguration (each stage counted once, TP shards
once each).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from .config import config_from_args
    from .launcher import launch

    try:
        cfg = config_from_args(argv)
        if cfg.scenario:
            from resihp.scenario import load_scenario

            load_scenario(cfg.scenario).check(cfg.world_size, cfg.devices_per_node)
    except ValueError as e:
        # one whole line, out before the exit code is (resihp up quotes the log's last line)
        print(f"error: {e}", flush=True)
        return 2
    return launch(cfg)
