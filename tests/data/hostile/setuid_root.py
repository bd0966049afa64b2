# Become root: setuid(0), the setuid binaries of /usr, a mount.
import os
import subprocess

try:
    os.setuid(0)
    print("ESCAPED setuid(0)")
except OSError as e:
    print("refused setuid(0)", type(e).__name__)
for cmd in (["su", "-c", "id -u"], ["mount", "-t", "tmpfs", "none", "/usr"], ["id", "-u"]):
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True,
                           timeout=5)
        print(cmd[0], p.returncode, p.stdout.strip(), p.stderr.strip()[:100])
    except OSError as e:
        print(cmd[0], "refused", type(e).__name__)
print("uid", os.getuid(), "euid", os.geteuid())
