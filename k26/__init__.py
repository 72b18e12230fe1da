"""k26: Kimi K2.6 inference with DDTree speculative decoding."""

from .chat import ChatFormat, Message, ToolCall
from .chat_parser import ChatParser
from .checkpoint_index import CheckpointError
from .config import ConfigError, ModelConfig
from .engine import LLM
from .outputs import RequestOutput, SpecStats
from .sampling import SamplingParams
from .spec.step import SpecConfig
from .tokenizer import Tokenizer

__all__ = [
    "LLM",
    "ChatFormat",
    "ChatParser",
    "CheckpointError",
    "ConfigError",
    "Message",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "Tokenizer",
    "ToolCall",
]
__version__ = "0.1.0"
