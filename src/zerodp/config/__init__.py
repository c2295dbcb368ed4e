"""Typed zerodp configuration: DeepSpeed's JSON keys, validated, with errors that name the key.

`load_config` is the one entry point: a dict or a JSON file in, a `Config` out, or a `ConfigError` with
one line per problem. Validation runs locally and identically on every rank, before any collective: a
typo never hangs a job. This face names what the rest of zerodp and its users read; the schema is
schema.py (the top-level `Config` and its smaller sections), zero_optimization.py, optimizer.py,
scheduler.py and monitor.py (a section each), keys.py (the keys that have no effect here or are
refused: docs/DEEPSPEED.md), auto.py ("auto" values) and base.py (what every section shares).
"""

from zerodp.config.base import ConfigError
from zerodp.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zerodp.config.optimizer import OptimizerConfig
from zerodp.config.scheduler import SchedulerConfig
from zerodp.config.schema import (
    ActivationCheckpointingConfig,
    BatchSizes,
    BF16Config,
    CheckpointConfig,
    Config,
    DataTypesConfig,
    FP16Config,
    HybridEngineConfig,
    NonFiniteConfig,
    ParallelWriteConfig,
    Said,
    load_config,
    read_config_file,
)
from zerodp.config.zero_optimization import (
    REDUCE_BUCKET_SIZE,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)

__all__ = [
    "Config", "ConfigError", "load_config", "read_config_file", "BatchSizes", "Said",
    "FP16Config", "BF16Config", "DataTypesConfig", "ZeroConfig", "REDUCE_BUCKET_SIZE",
    "OffloadOptimizerConfig", "OffloadParamConfig", "NonFiniteConfig", "CheckpointConfig",
    "ParallelWriteConfig", "ActivationCheckpointingConfig", "HybridEngineConfig", "OptimizerConfig",
    "SchedulerConfig", "TensorBoardConfig", "CSVConfig", "WandbConfig", "CometConfig",
    "CommsLoggerConfig", "FlopsProfilerConfig",
]
