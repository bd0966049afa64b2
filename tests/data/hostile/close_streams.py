# Close stdout and stderr, then run for ever: nothing left for the parent to read.
import os
import time

os.close(1)
os.close(2)
while True:
    time.sleep(1)
