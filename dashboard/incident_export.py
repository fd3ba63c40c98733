"""Incident report exports: one assembled incident as Markdown, self-contained HTML or JSON.

``python -m dashboard report export`` and the Incidents page's download write these; the
incident itself is assembled by :mod:`dashboard.incidents`.  Untrusted text (actor names,
comments, notes) is escaped in both Markdown and HTML.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from dashboard import figures
from dashboard.incidents import (
    Incident,
    _fmt_s,
    _iso,
    evidence_facts,
    incident_figure,
    plan_state_rows,
)
from resihp.schemas import AdaptationPlan


def to_json(inc: Incident) -> str:
    return json.dumps(inc.to_dict(), indent=2, default=str, allow_nan=False)


def _answering_plan(inc: Incident) -> tuple[AdaptationPlan | None, str]:
    """The plan that answered the incident, and its state in words: the first one applied
    (a later plan lists this failure too when it replaces the plans before it, and the one
    applied is later superseded: neither is what answered it), else the newest snapshot."""
    applied = next((p for p in inc.plans if p.state == "applied"), None)
    if applied is None:
        last = inc.plans[-1] if inc.plans else None
        return last, (last.state if last else "")
    later = [p for p in inc.plans if p.plan_id == applied.plan_id and p.state == "superseded"]
    note = f"applied, later {later[-1].note or 'superseded'}" if later else "applied"
    return applied, note


def _predicted(plan: AdaptationPlan) -> str:
    return (
        f"Predicted iteration time {figures.predicted_text(plan.predicted_before_s)} -> "
        f"{figures.predicted_text(plan.predicted_after_s)}."
    )


def throughput_notes(inc: Incident) -> list[str]:
    """How each throughput figure was obtained, in words (the figures use different rules)."""
    b = inc.throughput_basis
    if not b:
        return []
    clock = b["trainer_s_per_wall_s"]
    scaled = (
        f", at {clock:.2f} trainer seconds per wall second as before the onset"
        if abs(clock - 1.0) > 0.05
        else ""
    )
    after = (
        f"median of {b['after_iterations']} iterations after {b['after_from']}"
        + (
            f", up to the onset of the next failure ({b['after_until_report']})"
            if b.get("after_until_report")
            else ""
        )
        if b["after_from"]
        else "none yet (neither recovered nor a plan applied)"
    )
    return [
        f"before: median of the {b['before_iterations']} iterations before the onset",
        f"during: {b['during_samples']:.1f} samples completed from the onset to "
        f"{b['during_ends_at']} ({_iso(b['during_to_s'])}) over {b['during_wall_s']:.3f} s "
        f"of wall time{scaled}; time without progress (a hang) counts",
        f"after: {after}",
    ]


def _md(text: Any) -> str:
    """Untrusted text (actor names, comments, notes, reasons) in a Markdown line or table
    cell: HTML-escaped, since Markdown renderers pass raw HTML through (a ``<script>`` or
    ``<img onerror>`` in a comment ran in whoever opened the report), with ``|`` and line
    breaks defused so it stays one cell."""
    return html.escape(str(text), quote=False).replace("|", "/").replace("\n", " ")


def _fence(body: str) -> str:
    """A code fence longer than any backtick run in ``body``, so it cannot be closed early."""
    run = max((len(m) for m in re.findall(r"`+", body)), default=0)
    return "`" * max(3, run + 1)


def to_markdown(inc: Incident) -> str:
    f = inc.failure
    out = [
        f"# Incident {inc.incident_id} ({inc.job_id})",
        "",
        f"**{f.kind}** on ranks {f.ranks[:32]} (nodes {f.nodes[:32]}), detected at iteration "
        f"{f.iteration}; status **{inc.status}**.",
        "",
        "## Recovery timeline",
        "",
        "| phase | at (UTC) | since previous | since failure | detail |",
        "|---|---|---|---|---|",
    ]
    for r in inc.phase_rows():
        out.append(
            f"| {r['phase']} | {r['at'] or 'not reached'} | {_fmt_s(r['since_previous_s'])} | "
            f"{_fmt_s(r['since_failure_s'])} | {_md(r['detail'])} |"
        )
    tp = inc.throughput
    out += [
        "",
        "## Throughput (samples/s)",
        "",
        "| before | during | after |",
        "|---|---|---|",
        "| "
        + " | ".join(
            "-" if tp.get(k) is None else f"{tp[k]:.3f}" for k in ("before", "during", "after")
        )
        + " |",
        "",
        *[f"- {line}" for line in throughput_notes(inc)],
        "",
        "## Evidence",
        "",
        *[f"- **{_md(label)}**: {_md(text)}" for label, text in evidence_facts(f)],
        "",
    ]
    ev = json.dumps({"severity": f.severity, "links": f.links, **f.evidence}, indent=2, default=str)
    out += [_fence(ev) + "json", ev, _fence(ev), ""]
    plan, state = _answering_plan(inc)
    out += ["## Plan", ""]
    if plan is None:
        out.append("No plan was proposed.")
    else:
        out += [
            f"Plan {plan.plan_id} (policy {plan.policy}, proposed with the scheduler in "
            f"{plan.mode} mode): state **{state}**. {_md(plan.reason)}",
            "",
            _predicted(plan) + (f" Note: {_md(plan.note)}" if plan.note else ""),
            "",
            "| what | before | after |",
            "|---|---|---|",
        ]
        for r in figures.plan_diff_rows(plan.before, plan.after):
            mark = " **changed**" if r["changed"] else ""
            out.append(f"| {_md(r['what'])}{mark} | {_md(r['before'])} | {_md(r['after'])} |")
        out += ["", "Plan states:", ""]
        for p, what in plan_state_rows(inc.plans):
            out.append(
                f"- {_iso(p.updated_at_s or p.created_at_s)} plan {p.plan_id}: {_md(what)}"
                + (f" ({_md(p.note)})" if p.note else "")
            )
    out += ["", "## Operator actions", ""]
    if not inc.actions:
        out.append("None.")
    else:
        out += [
            "| " + " | ".join(_ACTION_HEADERS) + " |",
            "|" + "---|" * len(_ACTION_HEADERS),
        ]
        for a in inc.action_rows():
            out.append("| " + " | ".join(_md(a[k]) for k in _ACTION_KEYS) + " |")
    out.append("")
    return "\n".join(out)


_ACTION_KEYS = ("at", "action", "plan_id", "actor", "override", "comment", "verdict")
_ACTION_HEADERS = ("at (UTC)", "action", "plan", "actor", "override", "comment", "verdict")

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:0.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;font-size:14px}
th{background:#f3f3f3} .changed{background:#fff3cd} pre{background:#f7f7f7;padding:1em;overflow:auto}
.status{font-weight:bold} .refused{background:#f8d7da}
"""


def _table(headers: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    h = "".join(f"<th>{html.escape(x)}</th>" for x in headers)
    body = []
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>")
    return f"<table><thead><tr>{h}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def to_html(inc: Incident) -> str:
    """A self-contained page: plotly.js is inlined, so it opens offline."""
    f = inc.failure
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>Incident {esc(inc.incident_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Incident {esc(inc.incident_id)} <small>({esc(inc.job_id)})</small></h1>",
        f"<p><b>{esc(f.kind)}</b> on ranks {esc(str(f.ranks[:32]))} (nodes {esc(str(f.nodes[:32]))}), "
        f"detected at iteration {f.iteration}. Status: <span class='status'>{esc(inc.status)}</span></p>",
        "<h2 id='timeline'>Recovery timeline</h2>",
        _table(
            ["phase", "at (UTC)", "since previous", "since failure", "detail"],
            [
                [
                    r["phase"],
                    r["at"] or "not reached",
                    _fmt_s(r["since_previous_s"]),
                    _fmt_s(r["since_failure_s"]),
                    r["detail"],
                ]
                for r in inc.phase_rows()
            ],
        ),
        "<h2>Throughput (samples/s)</h2>",
        _table(
            ["before", "during", "after"],
            [
                [
                    "-" if inc.throughput.get(k) is None else f"{inc.throughput[k]:.3f}"
                    for k in ("before", "during", "after")
                ]
            ],
        ),
        "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in throughput_notes(inc)) + "</ul>",
        incident_figure(inc).to_html(include_plotlyjs=True, full_html=False),
        "<h2>Evidence</h2>",
        _table(["fact", "value"], [[label, text] for label, text in evidence_facts(f)]),
        f"<pre>{esc(json.dumps({'severity': f.severity, 'links': f.links, **f.evidence}, indent=2, default=str))}</pre>",
        "<h2>Plan</h2>",
    ]
    plan, state = _answering_plan(inc)
    if plan is None:
        parts.append("<p>No plan was proposed.</p>")
    else:
        diff = figures.plan_diff_rows(plan.before, plan.after)
        parts += [
            f"<p>Plan {plan.plan_id} (policy {esc(plan.policy)}, proposed with the scheduler in "
            f"{esc(plan.mode)} mode): state <b>{esc(state)}</b>. "
            f"{esc(plan.reason)}<br>{esc(_predicted(plan))} {esc(plan.note)}</p>",
            _table(
                ["what", "before", "after"],
                [[r["what"], r["before"], r["after"]] for r in diff],
                ["changed" if r["changed"] else "" for r in diff],
            ),
            _table(
                ["at (UTC)", "plan", "state", "note"],
                [
                    [_iso(p.updated_at_s or p.created_at_s), p.plan_id, what, p.note]
                    for p, what in plan_state_rows(inc.plans)
                ],
            ),
        ]
    parts.append("<h2>Operator actions</h2>")
    if rows := inc.action_rows():
        parts.append(
            _table(
                list(_ACTION_HEADERS),
                [[a[k] for k in _ACTION_KEYS] for a in rows],
                ["refused" if a["result"] == "refused" else "" for a in rows],
            )
        )
    else:
        parts.append("<p>None.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


FORMATS = {"json": to_json, "md": to_markdown, "html": to_html}


def export(inc: Incident, fmt: str) -> str:
    try:
        return FORMATS[fmt](inc)
    except KeyError:
        raise ValueError(f"format: must be one of {sorted(FORMATS)}, got {fmt!r}") from None
