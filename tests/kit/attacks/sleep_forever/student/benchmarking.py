import time


def time_fn(fn, *, warmup, iters, sync=None, clock=None):
    while True:
        time.sleep(3600)
