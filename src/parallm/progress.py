"""Progress bars (tqdm) for load and save, shown on global rank 0 only.

Silence them with ``progress=False`` on the call or ``PARALLM_PROGRESS=0`` in the environment. By default a bar
is drawn only when stderr is a terminal (tqdm's ``disable=None``); ``progress=True`` forces it.
"""

from __future__ import annotations

import os


def bar(iterable=None, *, total=None, desc: str, rank: int, progress: bool | None, unit: str = "tensor"):
    if rank != 0 or progress is False or (progress is None and
                                          os.environ.get("PARALLM_PROGRESS", "1").lower() in ("0", "false", "no")):
        return _Silent(iterable)
    import threading

    from tqdm.auto import tqdm
    # tqdm's default lock is a multiprocessing semaphore, which warns ("leaked semaphore") when a rank exits
    # abruptly; bars are drawn by rank 0 only, so a thread lock is enough.
    tqdm.set_lock(threading.RLock())
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False,
                disable=None if progress is None else False)


class _Silent:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        return None

    def close(self):
        return None
