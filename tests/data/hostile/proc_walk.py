# /proc walk: other processes' command lines and environments, the mounts, init's root.
import os

pids = [p for p in os.listdir("/proc") if p.isdigit()]
print("pids:", pids)
for p in pids:
    for part in ("cmdline", "environ"):
        try:
            with open(f"/proc/{p}/{part}", "rb") as f:
                print(p, part, f.read(300))
        except OSError as e:
            print(p, part, "refused", type(e).__name__)
for path in ("/proc/1/root", "/proc/1/cwd"):
    try:
        print(path, os.listdir(path))
    except OSError as e:
        print(path, "refused", type(e).__name__)
