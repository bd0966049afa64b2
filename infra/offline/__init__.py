"""Offline work from a run archive (``relax archive``): training from archived rollouts
and evaluation of a model on held-out prompts (its metrics also serve the eval stage of
a live run). Imports recipe/ only."""
