"""Target: the main thread blocked in time.sleep; SIGUSR1 ends it."""
import signal
import time


class Stop(Exception):
    pass


def on_usr1(_sig, _frame):
    raise Stop


def main():
    signal.signal(signal.SIGUSR1, on_usr1)
    try:
        print("ready", flush=True)     # inside the try: a SIGUSR1 sent right after "ready" is caught
        while True:
            time.sleep(3600)
    except Stop:
        print("stopped", flush=True)


if __name__ == "__main__":
    main()
