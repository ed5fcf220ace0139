"""Target: a process whose names carry terminal escapes (issue 17 point 9): its comm (prctl
PR_SET_NAME, 15 bytes) holds a CSI 'clear screen', its hot function's co_name/co_qualname an
OSC 'set title'. Prints 'ready' and spins in that function until killed."""
import ctypes
import types

ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(b"ev\x1b[2Jil"), 0, 0, 0)   # PR_SET_NAME


def spin(n):
    x = 0
    for i in range(n):
        x += i * i
    return x


EVIL = "spin\x1b]0;pwned\x07"
evil = types.FunctionType(spin.__code__.replace(co_name=EVIL, co_qualname=EVIL), globals())
print("ready", flush=True)
while True:
    evil(200_000)
