"""The weight channel: trainer -> rollout/reference engines, versioned (docs/architecture.md,
section 5). Weights never go through Kafka; only their announcements do.

The small interface: the trainer calls ``WeightPublisher.publish(named_tensors,
policy_version)``, which returns once the tensors are copied (announce, broadcast and
checkpoint run in the background); each engine's ``WeightSubscriber`` receives every
version into a receive buffer, verifies its checksum, and hands it to the engine's
``update_weights``, which swaps at its next safe point (or keeps it for ``apply``).

Modules, lowest first: ``layout`` (flat tensor layout, checksum), ``files`` (safetensors),
``rendezvous`` (store, process groups), ``shm`` (the same-host transport), ``announce``
(topic, reader), ``install`` (a version into an engine or module), ``publisher``,
``subscriber``.
"""

from relax.streams.weights.announce import (
    AnnouncementReader,
    ensure_weights_topic,
    newest_rows,
    weights_topic,
)
from relax.streams.weights.files import read_safetensors_flat, write_safetensors
from relax.streams.weights.install import install_weights
from relax.streams.weights.layout import (
    DEFAULT_BUCKET_BYTES,
    ChecksumError,
    TensorEntry,
    build_manifest,
    checksum,
    copy_tensor_,
    dtype_name,
    flatten_into,
    manifest_from_rows,
    manifest_rows,
    plan_buckets,
    total_bytes,
    views,
)
from relax.streams.weights.publisher import PublishStats, WeightPublisher
from relax.streams.weights.rendezvous import (
    CONNECT_S,
    MEMBERSHIP_KEY,
    local_ip_towards,
    parse_rendezvous,
    replay_membership,
)
from relax.streams.weights.server import ServerSubscriber
from relax.streams.weights.subscriber import SubscriberStats, WeightSubscriber

__all__ = [
    "CONNECT_S",
    "DEFAULT_BUCKET_BYTES",
    "MEMBERSHIP_KEY",
    "AnnouncementReader",
    "ChecksumError",
    "PublishStats",
    "ServerSubscriber",
    "SubscriberStats",
    "TensorEntry",
    "WeightPublisher",
    "WeightSubscriber",
    "build_manifest",
    "checksum",
    "copy_tensor_",
    "dtype_name",
    "ensure_weights_topic",
    "flatten_into",
    "install_weights",
    "local_ip_towards",
    "manifest_from_rows",
    "manifest_rows",
    "newest_rows",
    "parse_rendezvous",
    "plan_buckets",
    "read_safetensors_flat",
    "replay_membership",
    "total_bytes",
    "views",
    "weights_topic",
    "write_safetensors",
]
