"""relax: RL post-training for LLMs as a dataflow of Arrow record batches on Kafka topics.

The repository root is this package; each top-level folder is a subpackage:
``relax.schemas`` (what flows), ``relax.streams`` (how it moves),
``relax.producers`` (data into the bus), ``relax.consumers`` (one stage per
module), ``relax.trainer`` (losses, back ends, the loop) and ``relax.infra``
(broker, launch, CLI). See docs/architecture.md.
"""

__version__ = "0.1.0"
