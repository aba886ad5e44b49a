"""The engine: scheduling, batching and running requests step by step.

    Sequence → Scheduler (+ BlockManager, AdapterCache) → ModelRunner (+ CUDA graphs) → sampler
"""
from .async_engine import AsyncEngine, EngineDeadError
from .block_manager import BlockManager
from .engine import Engine
from .outputs import RequestMetrics, RequestOutput
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from .sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["AsyncEngine", "BlockManager", "Engine", "EngineDeadError", "FinishReason", "RequestMetrics",
           "RequestOutput", "ScheduledChunk", "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus"]
