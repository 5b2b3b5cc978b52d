"""The methods table of docs/speculative-decoding.md, derived from the method records: per method
its spellings, what drafts, its knobs (each option's dict key and CLI flag, with its default) and
whether a server request may pick it. tests/drafters/test_methods.py checks the docs hold
`methods_table(builtin_methods())`."""

from __future__ import annotations

from collections.abc import Iterable

from tokenleap.drafters.cli_flags import option_flag, option_own_flags
from tokenleap.drafters.methods import MethodRecord, field_default, is_per_request
from tokenleap.drafters.registry import all_methods


def _knobs_cell(r: MethodRecord) -> str:
    if r.knobs:
        return r.knobs
    cells = []
    for f in r.option_fields:
        value = field_default(f)
        shown = (
            f"2^{value.bit_length() - 1}"
            if isinstance(value, int) and value >= 1024 and value & (value - 1) == 0
            else str(value)
        )
        default = f" (default {shown})" if value is not None else ""
        server_side = " (not per request)" if r.per_request and not is_per_request(f) else ""
        flags = " or ".join(f"`{flag}`" for flag in (option_flag(r, f.name), *option_own_flags(r, f)))
        cells.append(f"`{f.name}` / {flags}{default}{server_side}")
    return ", ".join(cells) or "none"


def methods_table(records: Iterable[MethodRecord] | None = None) -> str:
    """The markdown table of methods (default: every method); docs/speculative-decoding.md holds
    the built-ins' (`builtin_methods()`)."""
    rows = [
        "| method | what drafts | knobs (dict key / CLI flag) | per request (server) |",
        "| --- | --- | --- | --- |",
    ]
    for r in (all_methods() if records is None else records):
        spelled = f"`{r.name}`" + (f" ({', '.join(f'`{a}`' for a in r.aliases)})" if r.aliases else "")
        if r.name == "chain":
            spelled = "`a+b`, " + spelled
        rows.append(f"| {spelled} | {r.doc or r.help} | {_knobs_cell(r)} | {'yes' if r.per_request else 'no'} |")
    return "\n".join(rows) + "\n"


__all__ = ["methods_table"]
