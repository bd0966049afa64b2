"""Looking at a run: the monitor's snapshot of a run read from its metrics topic, the
dashboard page (its HTML in ``static/``), the CPU timeline and the run report. Read-only
views, on the bottom floor of infra/: it imports no other folder of infra/."""
