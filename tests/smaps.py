"""Test helper: the VmFlags of the mapping that holds an address (/proc/self/smaps), to tell
whether a buffer was madvised for transparent huge pages ("hg")."""

from __future__ import annotations

from pathlib import Path


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (empty when none does)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []
