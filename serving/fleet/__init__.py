"""Fleet policies: cache-affinity routing and budget-based admission across serving clusters."""

from serving.fleet.admission import Admission, Decision, RequestClass
from serving.fleet.routing import Router

__all__ = ["Admission", "Decision", "RequestClass", "Router"]
