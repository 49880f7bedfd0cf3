"""Learner: advantage estimators, losses, the DeepSpeed learner and weight publishing.

Owns the pure maths of credit assignment (``learner.advantages``, ``learner.losses``), the
DeepSpeed training worker (``learner.worker``), the weight sync that pushes each new version
to the engines and model scorers (``learner.weights``), and
policy bootstrap (a tiny local model and tokenizer, warm-started by SFT).
May import envs/, rollout/, rewards/, replay/. Never cluster/ or services/.
"""
