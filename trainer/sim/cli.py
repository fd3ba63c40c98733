"""``python -m trainer sim``: run the cluster simulator against Redis (or check its health)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from .config import SimConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer sim",
        description="Simulated TP x PP x DP training job that emits real telemetry and follows plans.",
    )
    SimConfig.add_arguments(p)
    p.add_argument(
        "--check-health",
        action="store_true",
        help="exit 0 if the trainer's health key is present and ok, 1 otherwise",
    )
    p.add_argument("--log-level", default=os.environ.get("RESIHP_LOG_LEVEL", "INFO"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        cfg = SimConfig.from_args(args)
    except ValueError as e:
        print(f"trainer sim: bad setting: {e}", file=sys.stderr)
        return 2

    from resihp.bus import Health
    from resihp.keys import JobKeys
    from resihp.redis_client import connect

    client = connect(cfg.redis_url)
    if args.check_health:
        return 0 if Health.check(client, JobKeys(cfg.job_id), "trainer") else 1

    from resihp.scenario import ScenarioError, load_scenario

    from .service import SimTrainer

    scenario = None
    if cfg.scenario:
        try:
            scenario = load_scenario(cfg.scenario)
            tp, dp, pp = cfg.parallel()
            scenario.check(tp * dp * pp + cfg.spare_devices, cfg.devices_per_node)
        except ScenarioError as e:
            print(f"trainer sim: bad scenario: {e}", file=sys.stderr)
            return 2
    trainer = SimTrainer(cfg, client, scenario=scenario)
    stop = threading.Event()

    def _stop(*_):
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    logging.getLogger("trainer.sim").info(
        "simulating %s %s on %d ranks (speed %s)",
        cfg.model,
        trainer.sim.layout.summary(),
        trainer.sim.layout.world_size,
        cfg.speed,
    )
    return trainer.run(stop)
