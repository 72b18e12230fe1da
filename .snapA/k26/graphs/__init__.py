from .buckets import Bucket, pick_bucket
from .runner import StepGraphs, StepState

__all__ = ["Bucket", "StepGraphs", "StepState", "pick_bucket"]
