"""The serving engine: requests, continuous-batching scheduler, executors, sampling."""

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.request import Request, RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "SamplingParams"]
