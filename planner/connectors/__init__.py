"""Who enacts the planner's decisions: :class:`~.base.Connector` and its implementations.

- ``none``: nobody (decisions are reported only; replicas are what discovery shows);
- ``launcher``: a Tandem launcher serving ``launcher.scale`` (``tandem up`` grows and shrinks its
  own processes, ``tandem ray up`` its Ray actors);
- ``kubernetes``: the Deployments' scale subresource, through the ``kubernetes`` client.
"""

from .base import Connector, NoConnector

__all__ = ["Connector", "NoConnector"]
