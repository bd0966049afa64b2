"""``key=value``: the one grammar of every command's settings. A recipe override
(``relax train RECIPE trainer.optim.lr=2e-5``), a stage setting (``relax stage rollout
--set engine=hf``) and a reward option (``relax reward attach --option k=v``) are read
alike: a dotted key and a YAML value (``2e-5`` a float, ``[a, b]`` a list, ``true`` a
bool, anything else text).

Pure functions over the YAML tree (dicts and lists); :mod:`relax.infra.recipe.recipe` applies
them before validating.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


def set_dotted(tree: dict, path: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``path = "a.b.c"`` (creating dicts); a number
    indexes a list (``rewards.0.workers=2``).

    Raises:
        ValueError: a step of the path is not a section, or a list index is out of range.
    """
    keys = path.split(".")
    node: Any = tree
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not k.isdigit() or int(k) >= len(node):
                raise ValueError(f"override {path!r}: {k!r} is not an index of the "
                                 f"{len(node)} entries of {'.'.join(keys[:i])}")
            k = int(k)
        elif not isinstance(node, dict):
            raise ValueError(f"override {path!r}: {keys[i - 1]!r} is not a section")  # noqa: TRY004 (a bad override: callers report ValueError)
        if last:
            node[k] = value
            return
        nxt = node[k] if isinstance(node, list) else node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        node = nxt


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=1e-5"`` -> ``("a.b", 1e-05)`` (the value is read as YAML).

    Raises:
        ValueError: without ``=``, with an empty key, or a value that is not YAML.
    """
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"override {text!r}: expected key=value (e.g. trainer.steps=3)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: the value is not YAML "
                         f"({' '.join(str(e).split())})") from None
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d*\.?\d+([eE][-+]?\d+)?", value):
        value = float(value)  # YAML 1.1 reads 2e-5 as a string
    return key.strip(), value


def parse_settings(items: list[str] | None, into: dict | None = None) -> dict:
    """``["a.b=1", "c=x", ...]`` applied in order onto ``into`` (a new dict if None) by
    :func:`parse_override` and :func:`set_dotted`; returns it.

    Raises:
        ValueError: an item :func:`parse_override` or :func:`set_dotted` refuses.
    """
    out = {} if into is None else into
    for item in items or []:
        set_dotted(out, *parse_override(item))
    return out
