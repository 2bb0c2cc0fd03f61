"""A minimal RESP client for the benches' Python drivers (`script_calls.py`,
`plain_drivers.py`, `calendar_cost.py`): standard library only, loopback only."""
import socket
import struct


def enc(*args):
    """One command in RESP: each argument a bulk string (str, int or bytes)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a.encode() if isinstance(a, str) else str(a).encode() if isinstance(a, int) else a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def d(*xs):
    """Little-endian doubles, as `src/store/redis/script/record.rs` packs a script's records."""
    return struct.pack("<%dd" % len(xs), *xs)


class Conn:
    """One connection to 127.0.0.1:`port` (database `db` when given), with replies read in
    order, so that commands can be pipelined by sending several and reading as many."""

    def __init__(self, port, db=None):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        if db is not None:
            self.cmd("SELECT", str(db))

    def _fill(self, n):
        while len(self.buf) < n:
            self.buf += self.s.recv(1 << 20)

    def reply(self):
        while b"\r\n" not in self.buf:
            self.buf += self.s.recv(1 << 20)
        line, self.buf = self.buf.split(b"\r\n", 1)
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise RuntimeError(rest)
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            self._fill(n + 2)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        return [self.reply() for _ in range(int(rest))]

    def cmd(self, *args):
        self.s.sendall(enc(*args))
        return self.reply()
