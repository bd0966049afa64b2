# Reach the framework: import relax (to write a reward row) or the venv's packages.
import sys

sys.path[:0] = ["@CHECKOUT@", "@CHECKOUT@/.venv/lib/python3.11/site-packages"]
for name in ("relax", "kafka", "numpy", "torch"):
    try:
        __import__(name)
        print("ESCAPED imported", name)
    except ImportError as e:
        print("refused", name, type(e).__name__)
