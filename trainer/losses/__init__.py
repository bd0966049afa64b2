"""Policy and value losses, their aggregation and KL estimators.

The package imports nothing itself, so its torch-free settings (:mod:`.config`) load in
processes without torch (the driver, the reward stage); the registries and the trainer's
entry points (``POLICY_LOSSES``, ``compute_policy_loss``, ``compute_value_loss``) are in
:mod:`.registry`.
"""
