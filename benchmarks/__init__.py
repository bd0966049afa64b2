"""relax's benchmarks: each module measures one property of the product and writes its
figures to ``benchmarks/results/<name>.json``; ``results_md.py`` renders them into
``RESULTS.md``, and ``JOURNAL.md`` keeps the dated history. Run one as
``python -m relax.benchmarks.<name>`` (or ``python benchmarks/<name>.py``) from a checkout
with ``make install`` done; :mod:`relax.benchmarks.harness` is what they share. Not part
of the wheel (``setup.py`` leaves ``benchmarks/`` out)."""
