# Fill the disk: one big file, then many small ones, in the scratch folder.
total = 0
try:
    with open("big", "wb") as f:
        while True:
            f.write(b"x" * (1 << 20))
            total += 1 << 20
except OSError as e:
    print("big file stopped:", type(e).__name__)
i = 0
try:
    while True:
        with open(f"small{i}", "wb") as f:
            f.write(b"y" * 65536)
        total += 65536
        i += 1
except OSError as e:
    print("small files stopped:", type(e).__name__)
print("bytes written:", total)
