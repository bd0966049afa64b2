# Take the host's memory: one huge allocation, then one that grows.
try:
    huge = bytearray(8 << 30)
    print("ESCAPED 8 GiB allocated", flush=True)
except MemoryError:
    print("8 GiB refused", flush=True)
chunks = []
try:
    while True:
        chunks.append(bytearray(64 << 20))
except MemoryError:
    print("stopped at", len(chunks) * 64, "MiB")
