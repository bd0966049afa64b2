# Connect out: the host's loopback (a port the test listens on, the Kafka port), an outside
# address, and the test's abstract unix socket.
import socket

for host, port in [("127.0.0.1", int("@PORT@")), ("127.0.0.1", 9092), ("::1", int("@PORT@")), ("1.1.1.1", 53),
                   ("8.8.8.8", 443)]:
    try:
        socket.create_connection((host, port), timeout=1).close()
        print("ESCAPED connected", host, port)
    except OSError as e:
        print("refused", host, port, type(e).__name__)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0@ABSTRACT@")
    print("ESCAPED connected to the abstract socket")
except OSError as e:
    print("refused abstract socket", type(e).__name__)
