"""``Support``: whether a kernel takes a problem, and if not, why -- the planner's answers, and
what ``fusedattn.explain`` prints."""

from __future__ import annotations

from typing import NamedTuple


class Support(NamedTuple):
    ok: bool
    reason: str = ""  # why not, where ``ok`` is False; what was checked, where it is True

    def __bool__(self) -> bool:  # a NamedTuple is a non-empty tuple, always truthy otherwise
        return self.ok


TAKEN = Support(True)


def refused(reason: str) -> Support:
    return Support(False, reason)
