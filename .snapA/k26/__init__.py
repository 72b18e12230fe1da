"""k26: Kimi K2.6 inference with DDTree speculative decoding."""

from .config import ConfigError, ModelConfig
from .decode import RequestOutput, SpecStats
from .engine import LLM
from .loader import CheckpointError
from .sampling import SamplingParams
from .spec.step import SpecConfig
from .tokenizer import Message, Tokenizer

__all__ = [
    "LLM",
    "CheckpointError",
    "ConfigError",
    "Message",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "Tokenizer",
]
__version__ = "0.1.0"
