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
``subscriber``. The package itself imports nothing: the driver loads
:mod:`.shm_folders` (where the same-host files live) without torch.
"""
