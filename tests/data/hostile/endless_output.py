# Endless output on stdout and stderr.
import sys

while True:
    sys.stdout.write("x" * 65536)
    sys.stderr.write("y" * 65536)
