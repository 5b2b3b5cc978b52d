"""Draft heads shipped with tokenleap (package data beside this module): `{target}-{method}/`
holds a head trained by `tokenleap train-drafter` for the registered model `target`, with the
command that made it in its config.json (`tokenleap_training.command`) and README.md.
`speculative_config={"method": "eagle3"}` with no `model` uses the shipped head of the model being run."""

from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parent


def shipped_head(method: str, target_name: str | None) -> Path | None:
    """The shipped head directory for `method` on the registered model `target_name`, if any."""
    if not target_name:
        return None
    folder = HEADS_DIR / f"{target_name}-{method}"
    return folder if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) else None


def shipped_heads() -> list[str]:
    return sorted(p.name for p in HEADS_DIR.iterdir() if p.is_dir() and (p / "config.json").is_file())
