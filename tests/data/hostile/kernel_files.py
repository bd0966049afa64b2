# Reach the kernel: raw memory, the kernel log, sysctls, the host name.
import socket

for path, mode in [("/dev/mem", "rb"), ("/dev/kmsg", "rb"), ("/proc/kcore", "rb"),
                   ("/sys/kernel/notes", "rb"), ("/proc/sys/kernel/hostname", "w")]:
    try:
        with open(path, mode) as f:
            f.write("pwned") if "w" in mode else f.read(16)
        print("ESCAPED", mode, path)
    except OSError as e:
        print("refused", path, type(e).__name__)
try:
    socket.sethostname("pwned")
    print("ESCAPED sethostname")
except OSError as e:
    print("refused sethostname", type(e).__name__)
