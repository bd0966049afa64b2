"""Advantage estimators over outcome rewards, GAE, on-policy distillation and the DAPO
filters.

The package imports nothing itself, so its torch-free names (:mod:`.names`: which
estimators exist and where each runs) load in processes without torch (the driver's
recipe checks); the estimators' table and :func:`~.registry.compute_advantages` are in
:mod:`.registry`.
"""
