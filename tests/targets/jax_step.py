"""Target: a jitted step (dense layer + attention block from two other files) in a loop.

argv: [--grow]  With --grow the loop calls the step with a new batch size every ~0.5 s from
grow() (a new shape: a recompilation charged to that call site). Prints "ready" after the first
compile; SIGTERM/SIGUSR1 stop the loop cleanly (no syscall in the hot loop: see docs/decisions.md on the
injection regression); prints "steps=N" at the end.
"""
import signal
import sys
import time

import jax
import jax.numpy as jnp

try:
    from . import jax_attention, jax_dense
except ImportError:
    import jax_attention
    import jax_dense

D = 64
_stop = False


def params(d=D):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    return {"w": jax.random.normal(k[0], (d, d)) / d ** 0.5, "b": jnp.zeros((d,)),
            "wq": jax.random.normal(k[1], (d, d)) / d ** 0.5, "wk": jax.random.normal(k[2], (d, d)) / d ** 0.5,
            "wv": jax.random.normal(k[3], (d, d)) / d ** 0.5}


@jax.jit
def step(p, x):
    h = jax_dense.dense(x, p["w"], p["b"])
    return jax_attention.attention(h, p["wq"], p["wk"], p["wv"]).sum()


def run_step(p, x):
    return step(p, x).block_until_ready()  # STEP_CALL


def grow(p, n):
    return step(p, jnp.ones((n, p["w"].shape[0]))).block_until_ready()  # GROW_CALL


def main():
    def on_stop(*_):
        global _stop
        _stop = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGUSR1, on_stop)
    do_grow = "--grow" in sys.argv
    p = params()
    x = jnp.ones((128, D))
    run_step(p, x)
    print("ready", flush=True)
    steps, n, last = 0, 128, time.monotonic()
    while not _stop:
        run_step(p, x)
        steps += 1
        if do_grow and steps % 200 == 0 and time.monotonic() - last > 0.5:
            n += 8
            grow(p, n)
            last = time.monotonic()
    print(f"steps={steps}", flush=True)


if __name__ == "__main__":
    main()
