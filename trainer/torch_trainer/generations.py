"""Generations: which ranks run which layout, written to the rendezvous store, and when each took.

Generation g is ``gen/<g>`` in the launcher's TCPStore (members, layout, the layout
before it, the reason, whether it switches at an iteration boundary); workers report
back under ``timeline/<g>/...`` when they rebuilt their groups, moved their state and
completed the generation's first iteration.  A generation that completed an iteration
confirms the plan it came from (or publishes its layout); ``timeline.json`` is written
from these keys when the job ends.
"""

from __future__ import annotations

import json
import os
import time

import redis

from resihp.plans import write_layout
from resihp.topology import Layout

from .config import TrainConfig
from .parallel import UnsupportedLayout


def initial_layout(cfg: TrainConfig) -> Layout:
    return Layout.uniform(
        cfg.tp,
        cfg.pp,
        cfg.dp,
        cfg.num_layers,
        cfg.microbatches,
        devices_per_node=cfg.devices_per_node,
        schedule=cfg.schedule,
    )


class Generations:
    """Write, switch to and confirm generations (a :class:`~.launcher.JobLauncher` part)."""

    def _event(self, what: str, **kw) -> None:
        self.events.append({"what": what, "t": time.time(), "generation": self.gen, **kw})

    def _write_gen(
        self, members: list[int], layout: Layout, reason: str, boundary: bool = False
    ) -> None:
        # boundary=True: members switch after a committed iteration (a plan);
        # False: members abandon the running iteration (a failure).
        # until a generation trained an iteration, every generation (a retry after a
        # failed start too) resumes from the checkpoint: nobody holds state yet
        if self.resume_step is not None and any(
            self.store.check([f"timeline/{g}/first_iteration_done/{r}"])
            for g in range(self.gen)
            for r in self._members(g)
        ):
            self.resume_step = None  # the workers hold the state now
        resuming = self.resume_step is not None
        desc = {
            "members": members,
            "layout": layout.to_dict(),
            "prev_layout": self.layout.to_dict() if self.gen > 0 or resuming else None,
            "reason": reason,
            "boundary": boundary,
        }
        if resuming:
            desc["resume_step"] = self.resume_step
        self.store.set(f"gen/{self.gen}", json.dumps(desc))
        self.gen_layouts[self.gen] = layout
        self._event(
            "generation_written",
            members=members,
            reason=reason,
            layout=layout.summary(),
            **({"resume_step": self.resume_step} if resuming else {}),
        )

    def _new_generation(
        self,
        layout: Layout,
        reason: str,
        plan=None,
        boundary: bool = False,
        publish_now: bool = True,
        retry: bool = False,
    ) -> None:
        """Switch the workers to ``layout``.  ``publish_now``: write it to Redis at once (the
        members all run already), so the collector judges the first iteration's telemetry
        under it (written only after that iteration, it was dead-lettered as coming from
        ranks and replicas the old layout did not have); a generation with restarted ranks
        is published once it ran an iteration, as their heartbeats only start then.
        ``retry``: the same layout again after a generation failed without a death (same
        id, nothing new to publish)."""
        members = self._alive()
        if not members:
            raise UnsupportedLayout("no rank is left alive to run it")
        if retry:  # the failed generation will never complete an iteration: its plan moves on
            self.pending_confirm = [e for e in self.pending_confirm if e[0] != self.gen]
        else:
            self.fail_streak = 0
            if layout.layout_id <= self.max_layout_id:
                # every layout the job runs gets its own id: a plan made for an older layout
                # (the trainer moved on alone meanwhile) carries an id already used, and
                # whoever keys on the id (the detector's re-warm) took the switch for none
                layout = layout.copy()
                layout.layout_id = self.max_layout_id + 1
            self.max_layout_id = layout.layout_id
        self.gen += 1
        self._write_gen(members, layout, reason, boundary)
        self.layout = layout
        self.cur_plan = plan
        if plan is not None:
            self.follower.applied.add(plan.plan_id)
        if not retry and publish_now and self.client is not None and self.layout_published:
            try:
                write_layout(self.client, self.keys, layout)
                self.published = layout
                self._published_ids.add(layout.layout_id)
            except redis.RedisError as e:  # confirmed (and written) after its first iteration
                print(
                    f"[launcher] could not publish layout {layout.layout_id} yet: {e}", flush=True
                )
        self.pending_confirm.append((self.gen, plan, layout))

    def _started(self, gen: int) -> bool:
        """Some member of ``gen`` moved its state into its layout."""
        return any(
            self.store.check([f"timeline/{gen}/state_moved/{r}"]) for r in self._members(gen)
        )

    def _members(self, gen: int) -> list[int]:
        key = f"gen/{gen}"
        if not self.store.check([key]):
            return []
        return json.loads(self.store.get(key))["members"]

    def _progress(self) -> int:
        key = "progress/iteration"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def _job_time(self) -> float:
        """The job clock of scenario ``at_s`` events: seconds since the first generation
        started training (``job/t0``, set by the first worker to get there), 0 before."""
        if self._t0 is None:
            if not self.store.check(["job/t0"]):
                return 0.0
            self._t0 = float(self.store.get("job/t0"))
        return time.time() - self._t0

    def _confirm(self) -> None:
        if self._to_refuse:
            self._send_refusals()
        still = []
        for plan, layout, comment in self._to_confirm:
            try:
                self.follower.confirm_applied(plan, layout, comment=comment)
            except redis.RedisError:
                still.append((plan, layout, comment))
        self._to_confirm = still
        still = []
        for gen, plan, layout in self.pending_confirm:
            members = self._members(gen)
            done = any(
                self.store.check([f"timeline/{gen}/first_iteration_done/{r}"]) for r in members
            )
            if not done:
                still.append((gen, plan, layout))
                continue
            if gen not in self._done_gens:  # when it happened, whenever Redis hears of it
                self._done_gens.add(gen)
                self._event("first_iteration_done", of_generation=gen)
                self.last_good = layout
                if gen == self.gen:
                    self.fail_streak = 0
                if plan is not None and self.cur_plan is plan:
                    self.cur_plan = None
            if self.client is not None:
                try:
                    if plan is not None:
                        self.follower.confirm_applied(plan, layout, comment=f"generation {gen}")
                    else:
                        write_layout(self.client, self.keys, layout)
                except redis.RedisError as e:
                    self._redis_warn.warning(
                        "[launcher] cannot confirm generation %d yet (%s); retrying", gen, e
                    )
                    still.append((gen, plan, layout))  # trains on; told once Redis answers
                    continue
                self.published = layout
                self._published_ids.add(layout.layout_id)
        self.pending_confirm = still

    def _write_timeline(self) -> None:
        out = {"events": self.events, "workers": {}}
        try:
            if self.store.check(["timeline/kill"]):
                out["kill_t"] = float(self.store.get("timeline/kill"))
            if self.store.check(["job/t0"]):
                out["job_t0"] = float(self.store.get("job/t0"))
            for g in range(self.gen + 1):
                members = self._members(g)
                for ev in ("groups_rebuilt", "state_moved", "first_iteration_done"):
                    ts = [
                        float(self.store.get(f"timeline/{g}/{ev}/{r}"))
                        for r in members
                        if self.store.check([f"timeline/{g}/{ev}/{r}"])
                    ]
                    if ts:
                        out["workers"].setdefault(str(g), {})[ev] = max(ts)
                moved = [
                    json.loads(self.store.get(f"moved/{g}/{r}"))
                    for r in members
                    if self.store.check([f"moved/{g}/{r}"])
                ]
                if moved:
                    out["workers"].setdefault(str(g), {})["moved"] = {
                        **{k: moved[0][k] for k in ("kept", "from_replica", "from_disk")},
                        "bytes_sent": sum(m["bytes_sent"] for m in moved),
                    }
        except Exception as e:  # noqa: BLE001 - the timeline is a report; never fail the job for it
            out["error"] = repr(e)
        with open(os.path.join(self.cfg.out_dir, "timeline.json"), "w") as f:
            json.dump(out, f, indent=1)
