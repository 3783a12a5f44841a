"""PreciseTimer: a Linux timerfd, so that the ticker wakes within microseconds of a due time.

trio sleeps in ``epoll_wait``, whose timeout is whole milliseconds, and CPython rounds
it up: a task sleeping until a millisecond boundary wakes 0 to 1 ms after it (0.5 ms
on average, measured 0.6 ms at p50 from due to the ticker's wake-up). The wheel releases
entries at their due *millisecond*, so that rounding was most of a message's lateness
before the broker. A timerfd (``timerfd_create(2)``) armed with the remaining time in
nanoseconds becomes readable at that instant (plus the kernel's timer slack, 50 µs),
and trio waits for it like any descriptor. Python 3.11 has no ``os.timerfd_create``
(3.13 does), hence ctypes. Where there is none (not Linux), ``PreciseTimer.open``
returns None and the ticker sleeps on trio's deadline as before.

The timer is armed relative to now, so it follows trio's clock only when that clock
runs at the speed of CLOCK_MONOTONIC: the server's wiring opts in; tests with trio's
MockClock do not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import trio

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class PreciseTimer:
    """One timerfd; ``await sleep(seconds)`` wakes after that long, to the microsecond."""

    def __init__(self, fd: int, settime) -> None:
        self.fd = fd
        self._settime = settime
        self._spec = _Itimerspec()

    @classmethod
    def open(cls) -> PreciseTimer | None:
        """A new timer, or None where timerfd is not available."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            create, settime = libc.timerfd_create, libc.timerfd_settime
        except (OSError, AttributeError):
            return None
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            return None
        return cls(fd, settime)

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (> 0). Cancellable like any trio sleep; raises OSError if
        the kernel refuses to arm the timer.

        The expiration is never read: arming the timer resets its count of unread
        expirations (``timerfd_setup`` sets ``ticks = 0`` in the kernel; the tests check
        it), so an earlier sleep that fired, or was cancelled after it fired, cannot
        make this one readable early. That saves a read — and, before a sleep, an
        exception from reading an empty timer — on every wake-up of the ticker."""
        nanoseconds = max(1, int(seconds * 1e9))  # 0 would disarm the timer
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(nanoseconds, 1_000_000_000)
        if self._settime(self.fd, 0, ctypes.byref(self._spec), None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_settime: {os.strerror(errno)}")
        await trio.lowlevel.wait_readable(self.fd)

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.fd)
        os.close(self.fd)
