"""What every vLLM engine this project builds runs inside its workers: methods vLLM calls by name.

`EngineWorkerExtension` (`worker_extension_cls=WORKER_EXTENSION`) is reached through `LLM.collective_rpc` in every
process mode; it inherits `engine_capture.SinkCaptureMixin` (vLLM takes one). Imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any

from lm_eval_sink.harness.engine_capture import SinkCaptureMixin
from lm_eval_sink.harness.engine_decision import WORKER_EXTENSION

__all__ = ["WORKER_EXTENSION", "EngineWorkerExtension"]


def _cuda() -> Any:
    """torch.cuda where this worker has used CUDA, else None (a CPU worker)."""
    import torch

    return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class EngineWorkerExtension(SinkCaptureMixin):
    """The named calls of this project into each vLLM worker: the resident engine's, and Sink Strength's."""

    def reset_accelerator_peak(self) -> None:
        """The CUDA peak counters of this worker start again (nothing on a CPU)."""
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()

    def accelerator_peak(self) -> dict[str, int]:
        """The peak memory allocated on this worker's GPU since the reset: {"cuda:N": bytes}, empty on a CPU."""
        cuda = _cuda()
        if cuda is None:
            return {}
        device = cuda.current_device()
        return {f"cuda:{device}": int(cuda.max_memory_allocated(device))}

    def weight_storage(self) -> dict[str, int | str]:
        """How many model tensors this worker holds, their bytes, and a digest of each one's name, shape, dtype, device
        and storage address: `reload_weights` copies into these tensors, so after a swap the digest is the build's (on
        vLLM's CPU build, without the linear weights packed into oneDNN handles)."""
        import hashlib

        worker: Any = self
        model = worker.get_model()
        tensors = [*model.named_parameters(), *model.named_buffers()]
        digest = hashlib.sha256()
        for name, t in tensors:
            digest.update(f"{name} {tuple(t.shape)} {t.dtype} {t.device} {t.data_ptr()}\n".encode())
        return {
            "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "storage": digest.hexdigest(),
        }

    def reseed(self) -> None:
        """The seed a fresh engine's worker sets, so sampling after a weight swap starts as on a fresh engine."""
        from vllm.utils.torch_utils import set_random_seed

        worker: Any = self
        set_random_seed(worker.model_config.seed, worker.parallel_config.data_parallel_index)
