"""Clients of recserve's own services, routed by :mod:`recserve.routing` (core: the
cascade, the gateway and the benchmarks call rankers through these, never by importing
a server package)."""

from recserve.client.generation import GeneratedChunk, GenerationClient
from recserve.client.ranking import EmbedResult, RankingClient, RankingClientStats, RankResult
from recserve.client.rec import Recommendation, RecClient, StageReport, SyncRecClient

__all__ = ["EmbedResult", "GeneratedChunk", "GenerationClient", "RankResult", "RankingClient", "RankingClientStats", "RecClient", "Recommendation", "StageReport", "SyncRecClient"]
