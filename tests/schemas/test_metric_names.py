"""Every metric relax writes is named in README.md's metrics table (issue 16): each name
of ``schemas/metric_names.py`` here; every name a real run writes in the tiny e2e run
(``tests/e2e/test_pipeline.py``), through :func:`readme_metric_names`."""

from __future__ import annotations

from testdata import documented, readme_metric_names

from relax.schemas import metric_names as M


def test_every_metric_name_constant_is_in_the_readme_table():
    names = readme_metric_names()
    consts = {v for k, v in vars(M).items()  # *_COMPONENT: a component's name, not a metric
              if k.isupper() and isinstance(v, str) and not k.endswith("_COMPONENT")}
    missing = sorted(n for n in consts if not documented(n, names))
    assert not missing, f"README.md's metrics table lacks {missing}"
