"""``python -m trainer sim``: run the cluster simulator against Redis (or check its health)."""

from __future__ import annotations

import argparse
import logging
import sys

from resihp import entry

from .config import SimConfig

SERVICE = "trainer sim"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer sim",
        description="Simulated TP x PP x DP training job that emits real telemetry and follows plans.",
    )
    SimConfig.add_arguments(p)
    entry.add_entry_arguments(p, "trainer")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    entry.setup_logging(args.log_level)
    cfg = entry.load_config(SERVICE, lambda: SimConfig.from_args(args))
    if cfg is None:
        return 2
    if args.check_health:
        return entry.health_exit_code(cfg.redis_url, cfg.job_id, "trainer")

    from resihp.redis_client import connect

    try:
        client = connect(cfg.redis_url)
    except ValueError as e:  # a URL redis-py takes but we refuse (a db that is no number)
        print(f"{SERVICE}: bad setting: redis_url: {e}", file=sys.stderr)
        return 2
    # A wrong password is said once (exit 2) before anything starts.  A Redis that
    # cannot be reached yet is no reason to wait: the simulator trains on, queues its
    # telemetry and registers the job once Redis answers.
    entry.try_redis(client.ping, SERVICE, client)

    from resihp.scenario import ScenarioError, load_scenario

    from .service import SimTrainer

    scenario = None
    if cfg.scenario:
        try:
            scenario = load_scenario(cfg.scenario)
            tp, dp, pp = cfg.parallel()
            scenario.check(tp * dp * pp + cfg.spare_devices, cfg.devices_per_node)
        except ScenarioError as e:
            print(f"{SERVICE}: bad scenario: {e}", file=sys.stderr)
            return 2
    try:
        trainer = SimTrainer(cfg, client, scenario=scenario)
    except OSError as e:  # --truth-out became unwritable since it was checked
        print(f"{SERVICE}: cannot open --truth-out {cfg.truth_out}: {e.strerror}", file=sys.stderr)
        return 2
    stop = entry.stop_on_signals()
    logging.getLogger("trainer.sim").info(
        "simulating %s %s on %d ranks (speed %s)",
        cfg.model,
        trainer.sim.layout.summary(),
        trainer.sim.layout.world_size,
        cfg.speed,
    )
    return trainer.run(stop)
