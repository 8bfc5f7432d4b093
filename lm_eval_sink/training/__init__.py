"""Training-time tools: Sink Strength during training and head-selective sink protection."""

from lm_eval_sink.training.callback import SinkStrengthCallback
from lm_eval_sink.training.protection import ProtectionPlan, ProtectSettings, SinkProtection, select_sink_heads

__all__ = ["ProtectSettings", "ProtectionPlan", "SinkProtection", "SinkStrengthCallback", "select_sink_heads"]
