"""Alchemist's configuration tree: one dataclass per component, each checked when it is built (root.py).

Bad values raise ``ValueError`` (``FieldError``) naming the field; the command line names the flag instead. Values
that depend on the loaded model (``EngineConfig.max_model_len`` and ``num_kv_blocks`` when left at None) are filled
in by ``EngineConfig.resolve`` once the model's config is known.

    config = EngineConfig(max_num_seqs=32, dtype="bfloat16")
"""

from alchemist.config.engine import DEFAULT_MAX_MODEL_LEN, DEVICE_CHOICES, DTYPE_CHOICES, EngineConfig
from alchemist.config.fields import FieldError
from alchemist.config.record import EVICT_PRIORITIES, RECORD_DTYPES, RECORD_POLICIES, RecordConfig, check_budgets
from alchemist.config.root import Config
from alchemist.config.scale import ScaleConfig
from alchemist.config.server import ACCESS_CHOICES, ServerConfig, is_loopback
from alchemist.config.training import OnlineConfig, TrainerConfig

__all__ = [
    "ACCESS_CHOICES", "DEFAULT_MAX_MODEL_LEN", "DEVICE_CHOICES", "DTYPE_CHOICES", "EVICT_PRIORITIES", "RECORD_DTYPES",
    "RECORD_POLICIES", "Config", "EngineConfig", "FieldError", "OnlineConfig", "RecordConfig", "ScaleConfig",
    "ServerConfig", "TrainerConfig", "check_budgets", "is_loopback",
]  # fmt: skip
