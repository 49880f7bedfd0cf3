"""BFCL v4 (the Berkeley Function Calling Leaderboard) as an environment, scored by its checker.

The tasks, possible answers, executable multi-turn APIs and checkers all come from the
``bfcl-eval`` wheel (pinned in requirements-test.lock and installed without its declared
requirements; ``docs/envs.md`` says why).
``data`` loads categories into tasks (splits by a hash of the task id, functions as OpenAI
tools, gold calls), ``official`` calls bfcl_eval's own checkers, ``worker`` is the child
process that runs BFCL's API classes and checkers, ``process`` drives it from the parent,
``env`` plays episodes and ``source`` is the task source the registry builds.
"""
