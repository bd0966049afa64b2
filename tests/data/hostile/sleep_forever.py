# Sleep for ever, ignoring the polite signals, with a detached daemon that outlives it.
import os
import signal
import subprocess
import time

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        subprocess.Popen(["sleep", "@MARKER@"], start_new_session=True)
        time.sleep(10 ** 6)
    os._exit(0)
time.sleep(10 ** 6)
