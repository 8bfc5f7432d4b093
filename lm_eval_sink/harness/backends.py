"""Which lm-eval backends give this project attention access, and the one line that refuses the others."""

from __future__ import annotations

from lm_eval_sink.errors import UserError


class UnsupportedBackend(UserError, ValueError):
    """A sink_strength task was asked of a model backend that exposes no attention."""

    def __str__(self) -> str:  # the one line, also as the last line of a traceback (no hook, no patched CLI)
        return self.line()


def unsupported(task: str, backend: str) -> UnsupportedBackend:
    """The refusal of `task` on `backend` (a --model name)."""
    return UnsupportedBackend(
        f"task {task} needs attention weights, which the {backend} backend does not expose",
        "give that backend pretrained=CHECKPOINT in --model_args (S is then measured with transformers before "
        "the model loads), or run it with --model hf",
    )


def backend_label(lm_class: type) -> str:
    """The --model name of an lm-eval model class (its class name when it is not registered)."""
    from lm_eval.api.registry import model_registry

    target = f"{lm_class.__module__}:{lm_class.__name__}"
    return next((a for a, obj in model_registry.items() if obj is lm_class or obj == target), lm_class.__name__)


def has_attention(lm_class: type | None) -> bool:
    """Whether a model class is lm-eval's HFLM (or a subclass): the only backend whose attention this project reads."""
    return lm_class is not None and any(
        c.__module__ == "lm_eval.models.huggingface" and c.__name__ == "HFLM" for c in lm_class.__mro__
    )
