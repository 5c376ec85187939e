def time_fn(fn, *, warmup, iters, sync=None, clock=None):
    hoard = []
    while True:
        hoard.append(bytearray(256 * 2**20))
