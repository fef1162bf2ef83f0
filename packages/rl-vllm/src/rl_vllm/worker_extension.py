"""Methods added to vLLM's own worker class (`worker_extension_cls`), reached by `collective_rpc`.

They run in the process that holds the model (the Ray actor itself for the in-process engine,
vLLM's engine-core process for `AsyncLLM`), once per tensor-parallel rank.

Weights arrive as full Hugging Face tensors by name and go through vLLM's in-place reload:
`initialize_layerwise_reload` restores every layer's checkpoint-format parameters, the model's
own `load_weights` maps and shards the names (q/k/v into the fused qkv projection, this rank's
slice), and a layer is re-processed into its kernel format (e.g. the packed oneDNN weights of
the CPU backend, which drop the plain parameter) as soon as all its weights are in. One update
session may span many buckets, so a layer whose weights straddle two buckets is still
processed exactly once, with all of them.

Payloads (weights, CUDA IPC handles, layouts) arrive pickled (`rl_vllm.refit.to_payload`):
`AsyncLLM` forwards RPC arguments to its engine-core process with msgspec, which rebuilds
tensors only for typed arguments and cannot carry the rebuild functions of IPC handles.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_core.interfaces import WeightBucket
from rl_vllm.refit import (
    IpcBucket,
    Payload,
    WeightBroadcastGroup,
    WeightLayout,
    from_payload,
    tensors_from_ipc_handles,
)


class WeightSyncExtension:
    """Mixed into vLLM's worker: `self` is a `vllm.v1.worker.gpu_worker.Worker` (or its CPU subclass)."""

    # Attributes of vLLM's worker that these methods use.
    vllm_config: Any
    model_runner: Any
    device: torch.device

    def _rl_model(self) -> Any:
        return self.model_runner.get_model()

    def rl_start_weight_update(self) -> bool:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_rl_updating", False):
            raise RuntimeError("a weight update is already in progress on this worker")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._rl_model())
        self._rl_updating = True
        self._rl_loaded: set[str] = set()
        return True

    def rl_load_weights(self, payload: Payload) -> int:
        """Load a bucket of full tensors (inside a started update); returns how many."""
        weights: WeightBucket = from_payload(payload)
        return self._rl_load(weights)

    def _rl_load(self, weights: WeightBucket) -> int:
        from vllm.config import set_current_vllm_config

        if not getattr(self, "_rl_updating", False):
            raise RuntimeError("rl_load_weights outside a weight update: call rl_start_weight_update first")
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self._rl_model().load_weights((name, tensor.to(self.device)) for name, tensor in weights.items())
        self._rl_loaded.update(weights)
        return len(weights)

    def rl_finish_weight_update(self) -> int:
        """Process the layers still waiting (attention, partially sized ones); returns the
        number of tensors loaded in this update."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not getattr(self, "_rl_updating", False):
            raise RuntimeError("rl_finish_weight_update without rl_start_weight_update")
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self._rl_model(), self.vllm_config.model_config)
        self._rl_updating = False
        return len(self._rl_loaded)

    def rl_load_weights_from_ipc(self, payload: Payload) -> int:
        """Load a bucket exported by the trainer process on this GPU (CUDA IPC)."""
        handles: IpcBucket = from_payload(payload)
        tensors = tensors_from_ipc_handles(handles, self.device)
        count = self._rl_load(tensors)
        # The views must not outlive this call: the sender may free its tensors afterwards.
        del tensors
        torch.cuda.synchronize(self.device)
        return count

    def rl_init_weight_broadcast(
        self, address: str, port: int, world_size: int, rank: int, backend: str
    ) -> bool:
        self._rl_broadcast = WeightBroadcastGroup(
            address, port, rank, world_size, backend="nccl" if backend == "nccl" else "gloo"
        )
        return True

    def rl_receive_weight_broadcast(self, payload: Payload) -> int:
        """Receive one broadcast bucket (its layout announced by the driver) and load it."""
        layout: WeightLayout = from_payload(payload)
        group: WeightBroadcastGroup | None = getattr(self, "_rl_broadcast", None)
        if group is None:
            raise RuntimeError("no weight broadcast group: call rl_init_weight_broadcast first")
        return self._rl_load(group.receive(layout, self.device))
