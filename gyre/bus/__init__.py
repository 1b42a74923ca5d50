"""The event bus: typed protobuf events on NATS JetStream (streams declared in gyre.bus.subjects)."""

from gyre.bus import subjects
from gyre.bus.consumer import Consumer, ConsumerStats, Handler
from gyre.bus.nats_bus import Bus
from gyre.bus.publisher import Publisher
from gyre.bus.reader import StoredMessage, stream_filters

__all__ = [
    "Bus",
    "Consumer",
    "ConsumerStats",
    "Handler",
    "Publisher",
    "StoredMessage",
    "stream_filters",
    "subjects",
]
