"""Redis ACL users of a deployment: each part's commands and key patterns, and sealed actions.

Without ACL users (``resihp up``'s embedded Redis, ``docker-compose.yml``) whoever can write
to Redis can do anything there, including send an operator action under any actor name: the
``actor`` of an ``OperatorAction`` is a claim. With them (``docker-compose.acl.yml``, Redis
>= 7.0 for read-only key patterns) every part authenticates as its own user
(``REDIS_USERNAME`` / ``REDIS_PASSWORD``, ``resihp.redis_client.connect``):

* :func:`users` lists the users and what each may do; the key patterns come from
  :class:`resihp.keys.JobKeys` (a job id replaced by ``*``), so a renamed key moves its
  pattern. ``~`` patterns may be read and written, ``%R~`` patterns only read.
* :func:`render` writes a Redis ACL file (``python -m resihp.acl render``) with the
  passwords' SHA-256 digests, from the environment (:data:`PASSWORD_ENV`,
  ``RESIHP_REDIS_OPERATORS``).
* Sealed actions: :func:`publish_action` sends an action together with a seal, the digest
  of the action under ``keys.action_seal(user, action_id)``, in one transaction. Only that
  user's key pattern reaches its seals, so a scheduler run with ``sealed_actions``
  (:func:`refusal`) knows which user sent an action and refuses one whose actor that user
  may not speak for: an operator's CLI user acts only as itself, the dashboard's user for
  the operators its login admits (it vouches for them), the trainer's only confirms plans.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from dataclasses import dataclass

from resihp import keys as K
from resihp.keys import DEFAULT_STREAM_MAXLEN, JobKeys, entry_seq
from resihp.redis_client import check_username
from resihp.schemas import OperatorAction
from resihp.wire import encode_one

#: How long a seal outlives its action: a scheduler down longer refuses the action.
SEAL_TTL_S = 7 * 86400
#: Actions an operator (a CLI user, the dashboard's operators) takes; the trainer's are
#: ``applied`` and ``failed``.
OPERATOR_ACTIONS = ("acknowledge", "override", "reject", "hold", "set_mode")
TRAINER_ACTIONS = ("applied", "failed")

SERVICES = ("collector", "detector", "scheduler", "dashboard", "trainer")
#: The Redis user of each service.
SERVICE_USERS = {s: f"resihp-{s}" for s in SERVICES}
ADMIN_USER = "resihp-admin"
#: Environment variable holding each user's password for :func:`render` (the admin's is the
#: deployment's ``REDIS_PASSWORD``).
PASSWORD_ENV = {
    **{SERVICE_USERS[s]: f"RESIHP_REDIS_PASSWORD_{s.upper()}" for s in SERVICES},
    ADMIN_USER: "REDIS_PASSWORD",
}
#: ``name:password`` pairs, whitespace-separated: one CLI user per operator.
OPERATORS_ENV = "RESIHP_REDIS_OPERATORS"
MIN_PASSWORD_CHARS = 16

_J = JobKeys("ACLJOB")


def _pattern(key: str) -> str:
    """A key of the sentinel job as a pattern over every job (``{ACLJOB}`` -> ``{*}``;
    a sharded job's ``{JOB/sK.N}`` tag matches too)."""
    return key.replace("{ACLJOB}", "{*}")


def _job(*names: str) -> list[str]:
    return [_pattern(getattr(_J, n)) for n in names]


def _seq(*names: str) -> list[str]:
    """The consumer-group sequence hashes (``keys.entry_seq``) of streams a service reads
    through its groups: it raises them on every read."""
    return [_pattern(entry_seq(getattr(_J, n), "*")) for n in names]


def _own(service: str) -> list[str]:
    """A service's health and lease keys in every job, and its ``--all-jobs`` watchers'."""
    return [
        _pattern(_J.health(service, "*")),
        _pattern(_J.lease(service, "*")),
        K.watcher_health_pattern(service),
    ]


def _seals(user: str) -> str:
    return _pattern(_J.action_seal(user, "*"))


#: Commands that read (every user has them, on its readable keys).
READ_COMMANDS = (
    "ping hello auth select client|setname client|getname client|id acl|whoami time "
    "multi exec discard watch unwatch scan type exists ttl pttl get mget strlen "
    "hget hgetall hmget hkeys hlen hexists smembers sismember scard zscore zrange zcard "
    "xrange xrevrange xlen xread xinfo|stream xinfo|groups xpending"
).split()
#: Commands that write a stream through a consumer group (read, ack, reclaim, trim), and
#: raise the group's sequence hash (``bus.StreamConsumer``'s script: HSET, EXPIRE).
GROUP_COMMANDS = (
    "xreadgroup xack xautoclaim xclaim xgroup|create xgroup|createconsumer xgroup|setid hset expire"
).split()
#: The ``--all-jobs`` watchers' leases (Lua scripts run with the caller's ACL).
WATCHER_COMMANDS = ("evalsha eval script|load script|exists set del pexpire").split()


@dataclass(frozen=True)
class AclUser:
    """One Redis user: ``commands`` beyond :data:`READ_COMMANDS`, key patterns it may read
    and write (``keys``) and only read (``read_keys``)."""

    name: str
    why: str
    commands: tuple[str, ...]
    keys: tuple[str, ...]
    read_keys: tuple[str, ...] = ()

    def rule(self, password_sha256: str) -> str:
        """The user's line in a Redis ACL file (Redis >= 7.0)."""
        parts = ["user", self.name, "reset", "on", f"#{password_sha256}"]
        parts += [f"~{k}" for k in self.keys] + [f"%R~{k}" for k in self.read_keys]
        parts += ["resetchannels", "-@all"]
        cmds = (*READ_COMMANDS, *self.commands) if self.name != ADMIN_USER else ()
        parts += [f"+{c}" for c in dict.fromkeys(cmds)]
        if self.name == ADMIN_USER:
            parts[parts.index("-@all")] = "+@all"
            parts += ["~*", "&*"]
        return " ".join(parts)


def operator_user(name: str) -> AclUser:
    """An operator's CLI user (``resihp act``, ``resihp status``, ``resihp config``): reads
    everything of every job, writes only actions, its own seals and the detector's
    runtime settings."""
    check_username(name, "operator")
    if name.startswith("resihp-") or name == "default":
        raise ValueError(f"operator {name!r}: names 'default' and 'resihp-*' are the stack's")
    return AclUser(
        name,
        f"operator {name}: resihp act (as {name} only), resihp status, resihp config",
        ("xadd", "set", "hset"),
        (*_job("actions", "detector_config"), _seals(name)),
        (f"{K.PREFIX}:*",),
    )


def users() -> list[AclUser]:
    """The stack's users (operators' CLI users come from :func:`operator_user`)."""
    u = SERVICE_USERS
    watcher = (*GROUP_COMMANDS, *WATCHER_COMMANDS)
    return [
        AclUser(
            u["trainer"],
            "trainer ranks and node agents: telemetry, layout, job state; reads plans, "
            "confirms them (sealed)",
            ("xadd", "set", "del", "sadd", "hset", "hincrby", "expire", "incr"),
            (
                *_job("telemetry", "layout", "layouts", "job_state", "actions", "counters"),
                *_job("agents_left"),  # a rank's agent says it leaves on purpose
                _pattern(_J.health("trainer", "*")),
                K.JOBS_SET,
                _seals(u["trainer"]),
            ),
            (f"{K.PREFIX}:*",),
        ),
        AclUser(
            u["collector"],
            "collector: reads telemetry (its group, trims it), writes records, liveness, "
            "heartbeat times; CLIENT LIST for node agents",
            ("xadd", "xtrim", "hset", "hdel", "hincrby", "sadd", "client|list", *watcher),
            (
                K.JOBS_SET,  # lists a job again after Redis lost its data
                *_job("telemetry", "iterations", "liveness", "node_heartbeat", "counters"),
                *_job("layout_predictions"),  # each layout's healthy time, predicted once
                *_seq("telemetry"),
                *_job("deadletter"),
                _pattern(_J.partials(0))[: -len("0")] + "*",
                *_own("collector"),
            ),
            (f"{K.PREFIX}:*",),
        ),
        AclUser(
            u["detector"],
            "detector: reads records and liveness (its groups), writes failure reports and "
            "device health",
            ("xadd", "hset", "hsetnx", "hdel", "hincrby", *watcher),
            (
                *_job("iterations", "liveness", "failures", "device_health", "counters"),
                *_job("detector_config", "deadletter"),
                *_seq("iterations", "liveness"),
                *_own("detector"),
            ),
            (f"{K.PREFIX}:*",),
        ),
        AclUser(
            u["scheduler"],
            "scheduler: reads failure reports and actions (its groups, seals), writes plans "
            "and the audit log",
            ("xadd", "hset", "hdel", "hincrby", "incr", "incrby", "zadd", "zremrangebyrank")
            + ("lpop", "set", "expire")  # answers override previews
            + watcher,
            (
                *_job("failures", "actions", "plans", "plan_state", "plan_seq", "audit"),
                *_job("scheduler_handled", "scheduler_speeds", "scheduler_config"),
                *_job("counters", "deadletter", "override_previews"),
                _pattern(_J.override_preview("*")),
                *_seq("failures", "actions"),
                *_own("scheduler"),
            ),
            (f"{K.PREFIX}:*",),
        ),
        AclUser(
            u["dashboard"],
            "dashboard: reads everything; sends its operators' actions (sealed), keeps its "
            "login sessions",
            ("xadd", "set", "del", "hset", "hincrby", "expire", "rpush", "ltrim"),
            (
                *_job("actions", "counters", "override_previews"),
                _pattern(_J.health("dashboard", "*")),
                _seals(u["dashboard"]),
                K.dashboard_session("*"),
            ),
            (f"{K.PREFIX}:*",),
        ),
        AclUser(ADMIN_USER, "administration: redis-cli, the health check, repairs", (), ()),
    ]


def _sha(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def _check_password(who: str, password: str, where: str) -> str:
    if len(password) < MIN_PASSWORD_CHARS or any(c.isspace() for c in password):
        raise ValueError(
            f"{where}: the password of {who} must be at least {MIN_PASSWORD_CHARS} characters "
            "without spaces"
        )
    return password


def parse_operators(text: str) -> dict[str, str]:
    """``"alice:PASSWORD bob:PASSWORD"`` -> {name: password}; ValueError says what is wrong."""
    out: dict[str, str] = {}
    for item in text.split():
        name, colon, password = item.partition(":")
        if not colon:
            raise ValueError(f"{OPERATORS_ENV}: {name!r} needs a password (name:password)")
        operator_user(name)
        if name in out:
            raise ValueError(f"{OPERATORS_ENV}: operator {name!r} is given twice")
        out[name] = _check_password(name, password, OPERATORS_ENV)
    return out


def render(env: dict[str, str] | None = None) -> str:
    """The ACL file for ``env`` (default: the process's environment): every user of
    :func:`users` with the password of its :data:`PASSWORD_ENV` variable (ValueError naming
    it when unset or too short), one CLI user per ``RESIHP_REDIS_OPERATORS`` entry, and the
    ``default`` user off (an unauthenticated connection can do nothing)."""
    env = os.environ if env is None else env
    lines = ["user default reset off"]  # an ACL file has no comments
    for user in users():
        var = PASSWORD_ENV[user.name]
        password = _check_password(user.name, env.get(var, ""), var)
        lines.append(user.rule(_sha(password)))
    for name, password in parse_operators(env.get(OPERATORS_ENV, "")).items():
        user = operator_user(name)
        lines.append(user.rule(_sha(password)))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ sealed actions
def whoami(client) -> str:
    """The Redis user ``client`` is authenticated as (``default`` without ACL users)."""
    got = client.acl_whoami()
    return got.decode() if isinstance(got, bytes) else str(got)


def action_digest(action: OperatorAction) -> str:
    return hashlib.sha256(action.to_json().encode()).hexdigest()


def publish_action(
    client, keys: JobKeys, action: OperatorAction, maxlen: int = DEFAULT_STREAM_MAXLEN
) -> bytes:
    """Send ``action`` on ``keys.actions``; a client of an ACL user of its own also names
    itself (``action.via``) and seals it, in the same transaction. -> the entry id."""
    user = whoami(client)
    if user == "default":
        return client.xadd(keys.actions, encode_one(action), maxlen=maxlen, approximate=True)
    action.via = user
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.action_seal(user, action.action_id), action_digest(action), ex=SEAL_TTL_S)
    pipe.xadd(keys.actions, encode_one(action), maxlen=maxlen, approximate=True)
    return pipe.execute()[1]


def refusal(client, keys: JobKeys, action: OperatorAction) -> str:
    """Why a scheduler that requires seals refuses ``action`` ("" when it may act on it):
    no seal from the user it names, a seal of other content, or an actor or action that
    user may not send."""
    via = action.via
    if not via:
        return "not sealed: this deployment takes actions only from a Redis user of its own"
    try:
        check_username(via, "via")
    except ValueError as e:
        return str(e)
    raw = client.get(keys.action_seal(via, action.action_id))
    digest = raw.decode() if isinstance(raw, bytes) else raw
    if digest != action_digest(action):
        return f"no seal of Redis user {via} matches it"
    if via == SERVICE_USERS["trainer"]:
        if action.action not in TRAINER_ACTIONS:
            return f"Redis user {via} (the trainer) may only send {' / '.join(TRAINER_ACTIONS)}"
        return ""
    if action.action not in OPERATOR_ACTIONS:
        return f"Redis user {via} may not send {action.action} (the trainer's)"
    if via == SERVICE_USERS["dashboard"]:
        return ""  # the dashboard vouches for the operators its login admits
    if action.actor != via:
        return f"Redis user {via} may act only as {via}, not as {action.actor!r}"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m resihp.acl", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    out = sub.add_parser("render", help="write the ACL file from the environment's passwords")
    out.add_argument("--out", default="-", help="file to write (default: standard output)")
    args = ap.parse_args(argv)
    try:
        text = render()
    except ValueError as e:
        print(f"acl: {e}", file=sys.stderr)
        return 2
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    # password digests only: readable by the redis container's own user
    fd = os.open(args.out + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(args.out + ".tmp", args.out)
    print(
        f"acl: wrote {len(users()) + len(parse_operators(os.environ.get(OPERATORS_ENV, '')))} "
        f"users to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
