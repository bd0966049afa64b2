# Exhaust file descriptors.
files = []
try:
    while True:
        files.append(open("/dev/null"))  # noqa: SIM115 (kept open on purpose)
except OSError as e:
    print("open refused after", len(files), type(e).__name__)
