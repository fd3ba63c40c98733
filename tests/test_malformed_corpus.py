"""Every case of the malformed-input corpus (tests/malformed_corpus.py) driven through the
real services on a real Redis: each is dead-lettered or refused with its reason, no
service loop raises, and valid telemetry written after the corpus still makes a record."""

from __future__ import annotations

import json
import time

import pytest
from malformed_corpus import (
    ACTIONS,
    CASES,
    FAILURES,
    ITERATIONS,
    LIVENESS,
    TELEMETRY,
    corpus_layout,
)

from collector.config import CollectorConfig
from collector.service import CollectorService
from collector.synth import iteration_rows
from detector.config import DetectorConfig
from detector.service import DetectorService
from resihp.keys import JobKeys
from resihp.schemas import IterationRecord
from resihp.wire import decode_entry, encode_entry
from scheduler.config import SchedulerConfig
from scheduler.service import SchedulerService

JOB = "corpus"
KEYS = JobKeys(JOB)


def _reasons(r, since: int) -> list[str]:
    return [f[b"reason"].decode() for _id, f in r.xrange(KEYS.deadletter)][since:]


@pytest.mark.redis
def test_every_malformed_input_is_refused_with_its_reason_and_nothing_crashes(r):
    assert len(CASES) >= 40
    assert {s for _n, s, _f, _w in CASES} == {TELEMETRY, LIVENESS, ITERATIONS, FAILURES, ACTIONS}
    lay = corpus_layout()
    r.set(KEYS.layout, json.dumps(lay.to_dict()))
    collector = CollectorService(CollectorConfig(job_id=JOB, block_ms=1), r)
    detector = DetectorService(DetectorConfig(job_id=JOB, block_ms=1), r)
    scheduler = SchedulerService(SchedulerConfig(job_id=JOB, model="llama2-13b", block_ms=1), r)
    by_stream = {
        TELEMETRY: (KEYS.telemetry, collector),
        LIVENESS: (KEYS.liveness, detector),
        ITERATIONS: (KEYS.iterations, detector),
        FAILURES: (KEYS.failures, scheduler),
        ACTIONS: (KEYS.actions, scheduler),
    }
    for svc in (collector, detector, scheduler):
        svc.run_once()
    missed = []
    for name, stream, fields, words in CASES:
        key, svc = by_stream[stream]
        before = r.xlen(KEYS.deadletter)
        r.xadd(key, fields)
        for _ in range(20):  # a service loop that raises fails the test here
            svc.run_once()
            if r.xlen(KEYS.deadletter) > before:
                break
        got = _reasons(r, before)
        if not any(words.lower() in why.lower() for why in got):
            missed.append((name, words, got))
    assert not missed, "\n".join(f"{n}: wanted {w!r}, got {g}" for n, w, g in missed)
    # the forged liveness and failure reports moved no failure counter
    assert r.xlen(KEYS.failures) == 5  # the corpus's own five, nothing the detector made
    # valid telemetry behind the corpus still flows into a record
    t0 = time.time()
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(lay, 0, t0_s=t0)))
    r.xadd(KEYS.telemetry, encode_entry(None, iteration_rows(lay, 1, t0_s=t0 + 2)))
    deadline = time.monotonic() + 20
    recs = []
    while not recs and time.monotonic() < deadline:
        collector.run_once()
        for _id, f in r.xrange(KEYS.iterations):
            good, _bad = decode_entry(f)
            recs += [m for m in good if isinstance(m, IterationRecord) and m.iteration == 0]
    assert recs and recs[0].complete
