# Read a secret: a host file, the parent's environment variable, the home folder's keys.
import os

print("env:", os.environ.get("RELAX_HOSTILE_SECRET"), sorted(os.environ))
for path in ["@SECRET_FILE@", "/root/.netrc", "/root/.ssh/id_rsa", "/etc/shadow", "/proc/1/environ",
             "/proc/self/environ", "@CHECKOUT@/README.md"]:
    try:
        with open(path, "rb") as f:
            print("read", path, f.read(200))
    except OSError as e:
        print("refused", path, type(e).__name__)
