"""The overnight window: "HH:MM-HH:MM", possibly across midnight (read by the recipe check and by job control)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from .errors import BadInput


@dataclass(frozen=True)
class Window:
    start: dt.time
    end: dt.time

    def contains(self, now: dt.datetime) -> bool:
        t = now.time()
        if self.start < self.end:
            return self.start <= t < self.end
        # across midnight
        return t >= self.start or t < self.end

    def seconds_until_start(self, now: dt.datetime) -> float:
        return 0.0 if self.contains(now) else _seconds_until(now, self.start)

    def seconds_until_end(self, now: dt.datetime) -> float:
        return _seconds_until(now, self.end) if self.contains(now) else 0.0


def _seconds_until(now: dt.datetime, at: dt.time) -> float:
    target = now.replace(hour=at.hour, minute=at.minute, second=0, microsecond=0)
    if target <= now:
        target += dt.timedelta(days=1)
    return (target - now).total_seconds()


def parse_window(text: str) -> Window:
    """ "HH:MM-HH:MM" (the end may be earlier than the start: the window crosses midnight)."""
    try:
        start, end = (dt.time.fromisoformat(part.strip()) for part in text.split("-"))
    except ValueError:
        raise BadInput(f'overnight.window: {text!r} is not HH:MM-HH:MM, e.g. "01:00-06:00"') from None
    if start == end:
        raise BadInput(f"overnight.window: {text!r} starts and ends at the same time; leave it unset for no window")
    return Window(start, end)
