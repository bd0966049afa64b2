"""The broker of a run: the local Apache Kafka that runs, tests and ``relax broker start``
use (start, stop, find, the cluster of three nodes, TLS and SASL certificates) and the
handle that names a running one. The bottom floor of infra/: it imports no other folder
of infra/."""
