"""A small interval scheduler: merge overlapping bookings and find free slots in a day."""

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    start: int  # minutes since midnight
    end: int

    def overlaps(self, other: "Interval") -> bool:
        return self.start < other.end and other.start < self.end

    @property
    def length(self) -> int:
        return self.end - self.start


def merge(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping or touching intervals; the result is sorted and disjoint."""
    merged: list[Interval] = []
    for iv in sorted(intervals):
        if merged and iv.start <= merged[-1].end:
            last = merged.pop()
            merged.append(Interval(last.start, max(last.end, iv.end)))
        else:
            merged.append(iv)
    return merged


def free_slots(bookings: list[Interval], day_start: int = 8 * 60, day_end: int = 18 * 60,
               min_length: int = 30) -> list[Interval]:
    """The gaps between bookings inside [day_start, day_end) that last at least min_length minutes."""
    slots = []
    cursor = day_start
    for iv in merge(bookings):
        if iv.start - cursor >= min_length:
            slots.append(Interval(cursor, min(iv.start, day_end)))
        cursor = max(cursor, iv.end)
    if day_end - cursor >= min_length:
        slots.append(Interval(cursor, day_end))
    return slots


def fmt(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


if __name__ == "__main__":
    day = [Interval(9 * 60, 10 * 60), Interval(9 * 60 + 30, 11 * 60), Interval(13 * 60, 14 * 60)]
    for slot in free_slots(day):
        print(fmt(slot.start), "-", fmt(slot.end), f"({slot.length} min)")
