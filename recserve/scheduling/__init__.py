"""scheduling layer (see docs/architecture.md §2, §6): one scheduler core with pluggable policies.

- :class:`Scheduler` — the synchronous state machine (``add / schedule / complete /
  resolve / fail / cancel / next_wakeup / stats``), EDF within priority classes, admission,
  deadline drops, metrics;
- policies — :class:`DynamicBatchPolicy` (ranker stages), :class:`FeatureParallelPolicy`
  (lookup client), built by :func:`make_policy` from a :class:`PolicyKind`; new ones
  (continuous decode) subclass :class:`Policy` and call :func:`register_policy`;
- :class:`ServingLoop` — the asyncio driver that runs batches on a coroutine runner or
  an executor and resolves callers' futures and streams.
"""

from recserve.scheduling.admission import AdmissionConfig
from recserve.scheduling.core import Scheduler
from recserve.scheduling.dynamic import DynamicBatchConfig, DynamicBatchPolicy
from recserve.scheduling.feature_parallel import FeatureParallelConfig, FeatureParallelPolicy
from recserve.scheduling.loop import ItemStream, ServingLoop
from recserve.scheduling.metrics import DropReason, SchedulerStats, SummaryStats
from recserve.scheduling.policy_base import Policy, PolicyKind, SchedulerView, make_policy, register_policy
from recserve.scheduling.slo import SloControlConfig, SloController
from recserve.scheduling.types import (
    Batch,
    Continue,
    Done,
    Failed,
    Handle,
    ItemListener,
    ItemStatus,
    Outcome,
    Preempted,
    Priority,
    WorkItem,
)

__all__ = [
    "AdmissionConfig", "Batch", "Continue", "Done", "DropReason", "DynamicBatchConfig", "DynamicBatchPolicy",
    "Failed", "FeatureParallelConfig", "FeatureParallelPolicy", "Handle", "ItemListener", "ItemStatus", "ItemStream",
    "Outcome", "Policy", "PolicyKind", "Preempted", "Priority", "Scheduler", "SchedulerStats", "SchedulerView",
    "ServingLoop", "SloControlConfig", "SloController", "SummaryStats", "WorkItem", "make_policy", "register_policy",
]
