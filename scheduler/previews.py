"""Override previews: what an operator's override would do, answered before it is sent.

The dashboard pushes an :class:`~resihp.schemas.OverridePreviewRequest` onto
``keys.override_previews``; each scheduler step pops up to :data:`PER_STEP` of them and
sets the :class:`~resihp.schemas.OverridePreviewReply` under
``keys.override_preview(request_id)`` with a TTL.  The reply comes from the code that
decides the override itself (``PlanBook.preview`` -> ``PlanBook.override_draft`` -> the
service's ``_replan``: the planner and predictor, memory caps and post-conditions), with
the plan book untouched, so the prediction the operator reads is the one the plan will
carry.  A request that does not parse is dead-lettered with the reason; one older than
:data:`MAX_AGE_S` is dropped (its page gave up waiting).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from resihp import bus
from resihp.schemas import OverridePreviewReply, OverridePreviewRequest, SchemaError
from resihp.wire import decode_json

if TYPE_CHECKING:
    from scheduler.service import SchedulerService

log = logging.getLogger(__name__)

#: Previews answered per scheduler step at most (each one plans).
PER_STEP = 2
#: How long a reply stays readable (seconds).
REPLY_TTL_S = 60
#: A request older than this is nobody's any more: dropped unanswered.
MAX_AGE_S = 30.0


def preview_override(svc: SchedulerService, req: OverridePreviewRequest) -> OverridePreviewReply:
    """The plan an override of ``req.plan_id`` would make, or why it would be refused."""
    t0 = time.monotonic()
    plan = svc.book.plans.get(req.plan_id)
    draft, note = svc.book.preview(
        req.plan_id, req.override, lambda p, ov: svc._replan(p, ov, "preview of an override")
    )
    if draft is None:
        before = plan.predicted_before_s if plan is not None else -1.0
        return OverridePreviewReply(
            request_id=req.request_id,
            plan_id=req.plan_id,
            ok=False,
            answered_at_s=time.time(),
            predicted_before_s=before,
            note=note,
            planning_s=round(time.monotonic() - t0, 4),
        )
    return OverridePreviewReply(
        request_id=req.request_id,
        plan_id=req.plan_id,
        ok=True,
        answered_at_s=time.time(),
        predicted_before_s=draft.predicted_before_s,
        predicted_after_s=draft.predicted_after_s,
        after=draft.after,
        note=note,
        planning_s=round(time.monotonic() - t0, 4),
    )


def _request(svc: SchedulerService, raw: bytes) -> OverridePreviewRequest | None:
    try:
        req = decode_json(raw)
        if not isinstance(req, OverridePreviewRequest):
            raise SchemaError(f"not an override preview request: {type(req).__name__}")
    except SchemaError as e:
        bus.dead_letter(
            svc.client, svc.keys, svc.keys.override_previews, svc.config.consumer, str(e), raw
        )
        return None
    return req


def handle(svc: SchedulerService) -> int:
    """Answer up to :data:`PER_STEP` waiting previews; -> how many were answered."""
    n = 0
    for _ in range(PER_STEP):
        raw = svc.client.lpop(svc.keys.override_previews)
        if raw is None:
            break
        req = _request(svc, raw)
        if req is None or time.time() - req.at_s > MAX_AGE_S:
            continue
        try:
            reply = preview_override(svc, req)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:  # noqa: BLE001 - a preview must not stop the service
            log.exception("override preview %s failed", req.request_id)
            reply = OverridePreviewReply(
                request_id=req.request_id,
                plan_id=req.plan_id,
                ok=False,
                answered_at_s=time.time(),
                note=f"the scheduler could not plan it: {e!r}"[:500],
            )
        svc.client.set(svc.keys.override_preview(req.request_id), reply.to_json(), ex=REPLY_TTL_S)
        n += 1
    return n
