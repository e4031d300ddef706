"""The one validated config of a :class:`~recserve.routing.router.Router`.

It is a section of the cluster spec (``[routing]``), so it is defined with the other
component configs in :mod:`recserve.config.spec` and re-exported here; the policy names
it accepts are :class:`~recserve.routing.choice.ChoiceKind`'s values (a unit test keeps
the two lists equal).
"""

from __future__ import annotations

from recserve.config.spec import ROUTING_POLICIES, RoutingConfig

__all__ = ["ROUTING_POLICIES", "RoutingConfig"]
