"""Schemas v1: field docs, validation errors that name field and row, light imports."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pytest

from relax.schemas import SCHEMAS, SchemaError, get_schema, topics, validate
from relax.schemas.v1 import ROLLOUTS

from testdata import rollout_rows


def test_import_schemas_does_not_import_torch():
    code = ("import sys, relax.schemas, relax.schemas.versions, relax.schemas.topics;"
            "bad=[m for m in ('torch','transformers','ray','faust') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_field_is_documented():
    for name, schema in SCHEMAS.items():
        assert schema.metadata[b"relax.schema"].decode() == name
        assert schema.metadata[b"relax.version"] == b"1"
        for f in schema:
            assert f.metadata and f.metadata.get(b"doc"), f"{name}.{f.name} has no doc"


def test_unknown_schema_lists_valid_names():
    with pytest.raises(KeyError, match="rollouts"):
        get_schema("rollout")


def _batch(rows):
    return pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS)


def test_valid_rollouts_pass():
    validate(_batch(rollout_rows(8)), "rollouts")


@pytest.mark.parametrize("field,value,expected", [
    ("loss_mask", [1, 1, 1], "same length as response_ids"),
    ("logprobs", [0.0], "same length as response_ids"),
    ("finish_reason", "eos", "one of"),
    ("policy_version_end", -1, "policy_version_end >= policy_version_start"),
    ("sample_index", 7, "sample_index < group_size"),
    ("token_policy_versions", [0, 0], "same length as response_ids"),
])
def test_validator_names_field_and_row(field, value, expected):
    rows = rollout_rows(6)
    rows[4][field] = value
    with pytest.raises(SchemaError) as e:
        validate(_batch(rows), "rollouts")
    assert e.value.field == field and e.value.row == 4
    assert expected in str(e.value) and "row 4" in str(e.value)


def test_validator_rejects_mask_values_and_negative_tokens():
    rows = rollout_rows(3, tokens=4)
    rows[2]["loss_mask"] = [1, 0, 2, 1]
    with pytest.raises(SchemaError, match="row 2 field 'loss_mask'.*0 or 1"):
        validate(_batch(rows), "rollouts")
    rows = rollout_rows(3, tokens=4)
    rows[1]["response_ids"] = [1, -5, 2, 3]
    with pytest.raises(SchemaError, match="row 1 field 'response_ids'"):
        validate(_batch(rows), "rollouts")


def test_validator_rejects_nulls_and_wrong_types():
    rows = rollout_rows(3)
    rows[1]["group_id"] = None
    with pytest.raises(SchemaError, match="row 1 field 'group_id'.*not nullable"):
        validate(_batch(rows), "rollouts")
    t = pa.table({"rollout_id": ["a"], "group_id": [1]})
    with pytest.raises(SchemaError, match="field 'group_id'|no such field"):
        validate(t, "rollouts")


def test_validator_rejects_extra_field():
    b = _batch(rollout_rows(2))
    b = b.append_column("extra", pa.array([1, 2]))
    with pytest.raises(SchemaError, match="'extra'"):
        validate(b, "rollouts")


def test_topic_names():
    assert topics.run_topic("exp1", "rollouts") == "exp1.rollouts"
    assert topics.errors_topic("exp1.rollouts") == "exp1.rollouts.errors"
    assert topics.schema_for_topic("exp1.rollouts.errors") == "errors"
    assert topics.schema_for_topic("prompts.gsm8k") == "prompts"
    assert topics.schema_for_topic("exp1.train_samples") == "train_samples"
    assert topics.reward_group("exp1", "gsm8k") == "exp1.reward.gsm8k"
    assert topics.run_of("exp1.rewards.errors") == "exp1"
    with pytest.raises(ValueError, match="run name"):
        topics.run_topic("bad.name", "rollouts")
    with pytest.raises(ValueError, match="valid"):
        topics.run_topic("exp", "rollout")
