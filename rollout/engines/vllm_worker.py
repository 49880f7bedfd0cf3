"""Methods TurnRL adds to vLLM's model workers (vLLM's ``worker_extension_cls``).

vLLM runs the model in worker processes of its own; the engine reaches them only through
``collective_rpc(method_name, args)``. These methods load new weights there: from tensors sent
along with the call (the object-store transport: the engine actor fetched them), from a
safetensors file the worker reads itself (the filesystem transport: the bytes never pass
through the engine core), or from buckets broadcast by the learner (``transport``). vLLM's own
``reload_weights`` maps Hugging Face names onto its fused layers (qkv, gate/up).

This module is imported inside vLLM's processes: it must not import vLLM at module level (the
engine imports it by name) and must stay free of Ray.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch


class TurnRLWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``device``)."""

    def turnrl_load_state(self, state: Mapping[str, torch.Tensor]) -> int:
        """Load a state dict sent with the call; returns the number of tensors loaded."""
        return self._turnrl_load(state.items())

    def turnrl_load_file(self, path: str) -> int:
        """Load a safetensors file this worker can read."""
        from safetensors.torch import load_file

        return self._turnrl_load(load_file(path).items())

    def turnrl_join_broadcast(self, init: Mapping[str, Any]) -> None:
        """Join the learner's weight broadcast group (see ``transport.BroadcastGroup``)."""
        from rollout.engines.transport import BroadcastGroup

        self._turnrl_group = BroadcastGroup.join(init, device=self.device)

    def turnrl_receive_broadcast(self, layout: list[dict[str, Any]]) -> int:
        """Receive one version's buckets from the learner and load them as they arrive."""
        group = getattr(self, "_turnrl_group", None)
        if group is None:
            raise RuntimeError("turnrl_receive_broadcast before turnrl_join_broadcast")
        return self._turnrl_load(group.receive(layout))

    def _turnrl_load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        # vLLM's layerwise reload, not ``model.load_weights``: after the first load vLLM
        # post-processes weights into kernel layouts (the CPU build repacks linear layers and
        # leaves the checkpoint-shaped parameter empty), and the reload path re-runs that
        # processing for each layer it fills.
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, t in named:
                count += 1
                yield name, t.to(self.device)

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        self._turnrl_retie_head()
        return count

    def _turnrl_retie_head(self) -> None:
        """With tied embeddings the checkpoint has no ``lm_head`` and the layerwise reload
        leaves the head's kernel copy (CPU builds pre-pack it) on the old weights: point the
        head at the reloaded embedding again and redo its post-load processing."""
        model = self.model_runner.model
        if not getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
