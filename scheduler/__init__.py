"""ResiHP scheduler: turns failure reports into adaptation plans (TP -> PP -> DP) and runs their lifecycle.

Pure planners live in ``tp``, ``pp``, ``dp`` and ``planner``; ``lifecycle``
is the plan state machine; ``service`` connects them to Redis; ``policies``
holds ResiHP and the baselines; ``simulate`` runs a policy over a failure
scenario on the analytical timeline.
"""
