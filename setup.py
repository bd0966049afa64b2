"""Packages of relax, found rather than listed: the repository root is the ``relax``
package and each folder under it with an ``__init__.py`` (tests/ and benchmarks/ aside)
is a subpackage (``relax.streams`` is streams/, ...). Everything else is in
pyproject.toml."""

from setuptools import find_packages, setup

SUBPACKAGES = find_packages(".", exclude=["tests", "tests.*", "benchmarks", "benchmarks.*",
                                          "build", "build.*"])

setup(packages=["relax", *(f"relax.{p}" for p in SUBPACKAGES)])
