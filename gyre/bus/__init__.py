"""The event bus: typed protobuf events on NATS JetStream (streams declared in gyre.bus.subjects)."""

from gyre.bus import subjects
from gyre.bus.nats_bus import Bus, Consumer, ConsumerStats, Handler, Publisher

__all__ = ["Bus", "Consumer", "ConsumerStats", "Handler", "Publisher", "subjects"]
