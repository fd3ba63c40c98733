"""Collector service: two-level heartbeat liveness (§5.1) and per-iteration records
assembled from trainer telemetry.  See collector.service for the wiring and
resihp.liveness / resihp.assembly for the pure logic."""
