# Type into the caller's terminal (TIOCSTI) through /dev/tty and the standard streams.
import fcntl
import os
import termios

for name in ("/dev/tty", 0, 1, 2):
    try:
        fd = os.open(name, os.O_RDWR) if isinstance(name, str) else name
        fcntl.ioctl(fd, termios.TIOCSTI, b"x")
        print("ESCAPED TIOCSTI", name)
    except OSError as e:
        print("refused", name, type(e).__name__)
