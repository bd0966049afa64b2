"""What flows: Arrow schemas v1, topic names, validation, policy_version and staleness.

Imports only pyarrow and the standard library (no torch), so every stage and
the CLI can load it instantly; ``tests/schemas`` checks that in a subprocess.
"""

from relax.schemas import topics
from relax.schemas.v1 import (
    DROP_REASONS,
    ERRORS,
    FINISH_REASONS,
    METRICS,
    PROMPTS,
    REF_LOGPROBS,
    REWARDS,
    ROLLOUTS,
    SCHEMA_VERSION,
    SCHEMAS,
    TRAIN_SAMPLES,
    WEIGHTS,
    get_schema,
    schema_name,
)
from relax.schemas.validate import SchemaError, check_schema, validate
from relax.schemas.versions import Admission, admit, in_flight_budget, off_policy_steps, staleness

__all__ = [
    "DROP_REASONS", "ERRORS", "FINISH_REASONS", "METRICS", "PROMPTS", "REF_LOGPROBS", "REWARDS",
    "ROLLOUTS", "SCHEMA_VERSION", "SCHEMAS", "TRAIN_SAMPLES", "WEIGHTS", "Admission", "SchemaError",
    "admit", "check_schema", "get_schema", "in_flight_budget", "off_policy_steps", "schema_name",
    "staleness", "topics", "validate",
]
