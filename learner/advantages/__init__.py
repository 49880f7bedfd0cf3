"""Turn-level advantage estimators: pure functions over a flat batch of turns.

Owns the turn batch (``batch``), the estimator configs (``config``, pydantic only), the
estimators (``outcome``: grpo, rloo; ``ig``: igpo, a2tgpo, prm; ``matchtir``; ``anchors``:
gigpo, hgpo), how configured reward sources combine (``sources``), the registry (``registry``),
the learner's assembly of a claimed batch's advantages and loss mask (``assemble``) and the
checking tool (``tool``). No Ray, Redis or I/O
outside ``tool``. May import numpy and rollout/ (the trajectory schema).

Names are exported lazily so that ``import learner.advantages.config`` (done by every
config module) does not import numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from learner.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from learner.advantages.batch import (
        AdvantageResult,
        TurnBatch,
        anchor_hash,
        turn_batch_from_trajectories,
    )
    from learner.advantages.config import EstimatorConfig
    from learner.advantages.registry import (
        ESTIMATORS,
        compute_advantages,
        missing_fields,
        read_sources,
        required_fields,
    )

_EXPORTS = {
    "AdvantageResult": "learner.advantages.batch",
    "TurnBatch": "learner.advantages.batch",
    "anchor_hash": "learner.advantages.batch",
    "turn_batch_from_trajectories": "learner.advantages.batch",
    "EstimatorConfig": "learner.advantages.config",
    "ESTIMATORS": "learner.advantages.registry",
    "compute_advantages": "learner.advantages.registry",
    "missing_fields": "learner.advantages.registry",
    "read_sources": "learner.advantages.registry",
    "required_fields": "learner.advantages.registry",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
