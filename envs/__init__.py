"""Environments: tasks, tools and the text worlds agents act in.

Owns the environment interface (``envs.base``), the tool-call protocol (``envs.toolcalls``),
the registry of environment types (``envs.registry``) and the built-in environments.
May import: the standard library, numpy, pydantic, bm25s, bfcl_eval (``envs.bfcl``). Never rollout/, rewards/,
learner/, replay/, cluster/ or services/ (data flows envs -> rollout -> ...), and never Ray.
"""
