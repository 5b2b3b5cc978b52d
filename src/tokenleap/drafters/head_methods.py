"""The draft-head methods' records: EAGLE-3 (`eagle3`), EAGLE-1/2 (`eagle`), MiMo's MTP layers
(`mtp`) and Medusa (`medusa`). One module for the family: the heads (`tokenleap.heads`) and their
drafters (`head_drafter.py`) load only when a drafter is made (their factories import them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenleap.drafters.base import Drafter
from tokenleap.drafters.methods import MethodRecord
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.config import SpecConfig

_TREE_KNOBS = "`eagle_tree_topk` / `--spec-tree-topk` (1 = chain), `eagle_tree_depth` / `--spec-tree-depth`"


def _eagle3(config: SpecConfig, *, target: Any, heads: dict[tuple[Path, int], Any] | None = None,
            target_name: str | None = None, **_: Any) -> Drafter:
    from tokenleap.drafters.head_drafter import HeadDrafter, TreeShape
    from tokenleap.heads.base import measure_step_cost
    from tokenleap.heads.loader import load_eagle3

    if not config.model:  # the head shipped for this model (tokenleap/heads)
        from tokenleap.heads.shipped import shipped_head, shipped_heads

        path = shipped_head("eagle3", target_name)
        if path is None:
            have = ", ".join(shipped_heads()) or "none"
            raise TokenleapError(
                f"no EAGLE-3 head ships for model {target_name!r} (shipped: {have}): train one with "
                f"`tokenleap train-drafter -o DIR` and pass speculative_config['model'] = DIR (CLI: --model-draft DIR)"
            )
        config = dataclasses.replace(config, model=str(path))
    heads = heads if heads is not None else {}
    key = (Path(str(config.model)).expanduser().resolve(), id(target))
    if key not in heads:  # one copy of a head's weights (and its measured step cost) per registry and target
        head = load_eagle3(str(config.model), target)
        heads[key] = (head, measure_step_cost(head))
    head, step = heads[key]
    tree = TreeShape(config.eagle_tree_topk, config.eagle_tree_depth)
    # per draft token: a chain runs one head step per token; a tree one step (of k rows, about the
    # cost of one row on this CPU) per depth for up to k nodes
    per_token = step / tree.topk
    return HeadDrafter(head, tree, relative_draft_cost=per_token)


def _mtp(config: SpecConfig, *, target: Any, target_path: Any = None, heads: dict[tuple[Path, int], Any] | None = None,
         **_: Any) -> Drafter:
    """A checkpoint's own MTP layer (MiMo) drafting for it: the target's folder unless `model` names one."""
    from tokenleap.drafters.head_drafter import HeadDrafter, TreeShape
    from tokenleap.heads.base import measure_step_cost
    from tokenleap.heads.mtp import load_mtp

    folder = config.model or (str(target_path) if target_path is not None and Path(target_path).is_dir() else None)
    if folder is None:
        raise TokenleapError("method 'mtp' reads the MTP layers of the target's Hugging Face folder; this target is not one "
                             "(a GGUF file's nextn tensors are not read): pass speculative_config['model'] = a folder holding them")
    heads = heads if heads is not None else {}
    key = (Path(folder).expanduser().resolve(), id(target))
    if key not in heads:
        head = load_mtp(folder, target)
        heads[key] = (head, measure_step_cost(head))
    head, step = heads[key]
    tree = TreeShape(config.eagle_tree_topk, config.eagle_tree_depth)
    return HeadDrafter(head, tree, relative_draft_cost=step / tree.topk)


def _medusa(config: SpecConfig, *, target: Any, **_: Any) -> Drafter:
    from tokenleap.drafters.head_drafter import MedusaDrafter
    from tokenleap.heads.medusa import load_medusa

    return MedusaDrafter(load_medusa(str(config.model), target), topk=config.eagle_tree_topk)


def _eagle_heads(registry: Any) -> dict[str, Any]:
    return {"heads": {}}  # eagle3 and eagle: one copy of a head per registry and target


def _mtp_heads(registry: Any) -> dict[str, Any]:
    return {"heads": {}}


_HEADS_DOC = ("an EAGLE-3 (or EAGLE-1/2) head over the target's hidden states: chains, or EAGLE-2 dynamic trees")
EAGLE3 = MethodRecord(
    "eagle3", _eagle3, "an EAGLE-3 head over the target's hidden states (default: the head shipped for the target)",
    fields=("model", "eagle_tree_topk", "eagle_tree_depth"), aliases=("draft-eagle3", "eagle-3"), per_request=False, shared=_eagle_heads,
    doc=f"{_HEADS_DOC}; without `model` the head shipped for the target",
    knobs=f"`model` / `--model-draft` (head directory), {_TREE_KNOBS}",
)
EAGLE = MethodRecord(  # EAGLE-1/2 heads, same loader (it tells the layouts apart)
    "eagle", _eagle3, "an EAGLE-1/2 head over the target's hidden states",
    fields=("model", "eagle_tree_topk", "eagle_tree_depth"), per_request=False, needs_model="an EAGLE head directory", shared=_eagle_heads,
    doc=_HEADS_DOC, knobs=f"`model` / `--model-draft` (head directory), {_TREE_KNOBS}",
)
MEDUSA = MethodRecord(
    "medusa", _medusa, "Medusa heads: chains or trees", fields=("model", "eagle_tree_topk"), per_request=False,
    needs_model="Medusa heads directory", knobs="`model` / `--model-draft` (heads directory), `eagle_tree_topk` / `--spec-tree-topk` (1 = chain)",
)
MTP = MethodRecord(  # MiMo MTP layers (model None: the target's own folder)
    "mtp", _mtp, "the target checkpoint's own MTP layer (MiMo), chains or trees", fields=("model", "eagle_tree_topk", "eagle_tree_depth"),
    aliases=("mimo_mtp", "mimo-mtp", "deepseek_mtp"), shared=_mtp_heads,
    knobs="`model` (default: the target's folder), `eagle_tree_topk`, `eagle_tree_depth`",
)
