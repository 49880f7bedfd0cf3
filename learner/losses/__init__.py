"""Policy losses: PPO-clip with truncated importance sampling, and trajectory balance.

Owns the loss inputs (``inputs``), the configs (``config``, pydantic only), the PPO loss
(``ppo``), trajectory balance with its learned log Z (``trajectory_balance``) and the
registry (``registry``). Pure torch functions: no Ray, no I/O, no distributed calls.

Names are exported lazily so that ``import learner.losses.config`` (done by every config
module) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from learner.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from learner.losses.config import LossConfig
    from learner.losses.inputs import LossInputs
    from learner.losses.registry import LOSSES, policy_loss
    from learner.losses.trajectory_balance import LogZ, log_rewards, make_log_z

_EXPORTS = {
    "LossConfig": "learner.losses.config",
    "LossInputs": "learner.losses.inputs",
    "LOSSES": "learner.losses.registry",
    "policy_loss": "learner.losses.registry",
    "LogZ": "learner.losses.trajectory_balance",
    "make_log_z": "learner.losses.trajectory_balance",
    "log_rewards": "learner.losses.trajectory_balance",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
