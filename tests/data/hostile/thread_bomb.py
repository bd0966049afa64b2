# Thread bomb: start threads until refused, then keep them.
import threading
import time

n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        n += 1
except RuntimeError as e:
    print("threads refused after", n, e, flush=True)
