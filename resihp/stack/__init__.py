"""Bring-up and operator tooling: ``resihp up``, ``resihp status``, the ``--all-jobs`` watcher.

The ``resihp`` command (:mod:`resihp.stack.cli`), the launcher that starts a stack and
stops it cleanly (:mod:`resihp.stack.launcher`), the status report
(:mod:`resihp.stack.status`), what a crashed stack left running
(:mod:`resihp.stack.processes`) and the watcher that runs one service process for every
job in a Redis (:mod:`resihp.stack.jobwatch`).  It builds on the core (``resihp``); no
module of the core and no service's logic imports it: only the services' ``__main__``
entry points do, for ``--all-jobs``.
"""
