# Signal the parent: the sandbox's parent, the worker's real pid, a sentinel, every process.
import os
import signal

for pid in [os.getppid(), int("@PID@"), int("@SENTINEL@"), 1]:
    try:
        os.kill(pid, signal.SIGKILL)
        print("sent SIGKILL to", pid)
    except OSError as e:
        print("refused", pid, type(e).__name__)
os.kill(-1, signal.SIGKILL)
