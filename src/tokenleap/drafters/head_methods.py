"""The draft-head methods' records: EAGLE-3 (`eagle3`), EAGLE-1/2 (`eagle`), MiMo's MTP layers
(`mtp`) and Medusa (`medusa`). One module for the family: the heads (`tokenleap.heads`) and their
drafters (`head_drafter.py`) load only when a drafter is made (their factories import them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenleap.config import MAX_DRAFT_TOKENS
from tokenleap.drafters.base import Drafter
from tokenleap.drafters.methods import MODEL_FLAGS, MethodRecord, option, options_of
from tokenleap.errors import TokenleapError

if TYPE_CHECKING:
    from tokenleap.drafters.spec import SpecConfig

MAX_TREE_TOPK = 16


def _topk(help: str) -> Any:
    return option(1, help=help, flags=("--spec-tree-topk",), per_request=False, renamed_from=("eagle_tree_topk",))


@dataclass(frozen=True)
class HeadOptions:
    """An EAGLE-1/2 head's options: its directory and the draft's shape (a chain, or a tree whose
    node count is the draft budget, num_speculative_tokens)."""

    model: str | None = option(None, help="the head directory", flags=MODEL_FLAGS, per_request=False)
    tree_topk: int = _topk("1 drafts chains, k > 1 EAGLE-2 dynamic trees expanding k children of k nodes per depth")
    tree_depth: int = option(
        6,
        help="tree depth (the node count is the draft budget, --draft-max)",
        flags=("--spec-tree-depth",),
        per_request=False,
        renamed_from=("eagle_tree_depth",),
    )

    def __post_init__(self) -> None:
        if not 1 <= self.tree_topk <= MAX_TREE_TOPK or not 1 <= self.tree_depth <= MAX_DRAFT_TOKENS:
            raise TokenleapError(
                f"need tree_topk in [1, {MAX_TREE_TOPK}] and tree_depth in [1, {MAX_DRAFT_TOKENS}], "
                f"got {self.tree_topk} and {self.tree_depth}"
            )


@dataclass(frozen=True)
class Eagle3Options(HeadOptions):
    """An EAGLE-3 head's options (no directory: the head shipped for the target)."""

    model: str | None = option(
        None, help="the head directory (default: the head shipped for the target)", flags=MODEL_FLAGS, per_request=False
    )


@dataclass(frozen=True)
class MtpOptions(HeadOptions):
    """MTP layers' options (no folder: the target's own)."""

    model: str | None = option(
        None, help="a folder holding the MTP layers (default: the target's own)", flags=MODEL_FLAGS, per_request=False
    )


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa heads' options: their directory and the candidates per head (1: a chain)."""

    model: str | None = option(None, help="the Medusa heads directory", flags=MODEL_FLAGS, per_request=False)
    tree_topk: int = _topk("1 drafts chains, k > 1 a tree over each head's top-k tokens")

    def __post_init__(self) -> None:
        if not 1 <= self.tree_topk <= MAX_TREE_TOPK:
            raise TokenleapError(f"need tree_topk in [1, {MAX_TREE_TOPK}], got {self.tree_topk}")


def _eagle_head(config: SpecConfig, *, target: Any, heads: dict[tuple[Path, int], Any] | None = None,
            target_name: str | None = None, **_: Any) -> Drafter:
    from tokenleap.drafters.head_drafter import HeadDrafter, TreeShape
    from tokenleap.heads.base import measure_step_cost
    from tokenleap.heads.loader import load_eagle3

    opts = options_of(config, config.method, HeadOptions)  # eagle3 or eagle
    if not opts.model:  # the head shipped for this model (tokenleap/heads)
        from tokenleap.heads.shipped import shipped_head, shipped_heads

        path = shipped_head("eagle3", target_name)
        if path is None:
            have = ", ".join(shipped_heads()) or "none"
            raise TokenleapError(
                f"no EAGLE-3 head ships for model {target_name!r} (shipped: {have}): train one with "
                f"`tokenleap train-drafter -o DIR` and pass speculative_config['model'] = DIR (CLI: --model-draft DIR)"
            )
        opts = dataclasses.replace(opts, model=str(path))
    heads = heads if heads is not None else {}
    key = (Path(str(opts.model)).expanduser().resolve(), id(target))
    if key not in heads:  # one copy of a head's weights (and its measured step cost) per registry and target
        head = load_eagle3(str(opts.model), target)
        heads[key] = (head, measure_step_cost(head))
    head, step = heads[key]
    tree = TreeShape(opts.tree_topk, opts.tree_depth)
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

    opts = options_of(config, "mtp", MtpOptions)
    folder = opts.model or (str(target_path) if target_path is not None and Path(target_path).is_dir() else None)
    if folder is None:
        raise TokenleapError(
            "method 'mtp' reads the MTP layers of the target's Hugging Face folder; this target is not one "
            "(a GGUF file's nextn tensors are not read): pass speculative_config['model'] = a folder holding them"
        )
    heads = heads if heads is not None else {}
    key = (Path(folder).expanduser().resolve(), id(target))
    if key not in heads:
        head = load_mtp(folder, target)
        heads[key] = (head, measure_step_cost(head))
    head, step = heads[key]
    tree = TreeShape(opts.tree_topk, opts.tree_depth)
    return HeadDrafter(head, tree, relative_draft_cost=step / tree.topk)


def _medusa(config: SpecConfig, *, target: Any, **_: Any) -> Drafter:
    from tokenleap.drafters.head_drafter import MedusaDrafter
    from tokenleap.heads.medusa import load_medusa

    opts = options_of(config, "medusa", MedusaOptions)
    return MedusaDrafter(load_medusa(str(opts.model), target), topk=opts.tree_topk)


def _eagle_heads(registry: Any) -> dict[str, Any]:
    return {"heads": {}}  # eagle3 and eagle: one copy of a head per registry and target


def _mtp_heads(registry: Any) -> dict[str, Any]:
    return {"heads": {}}


_HEADS_DOC = ("an EAGLE-3 (or EAGLE-1/2) head over the target's hidden states: chains, or EAGLE-2 dynamic trees")
EAGLE3 = MethodRecord(
    "eagle3", _eagle_head, "an EAGLE-3 head over the target's hidden states (default: the head shipped for the target)",
    options=Eagle3Options, aliases=("draft-eagle3", "eagle-3"), per_request=False, shared=_eagle_heads,
    doc=f"{_HEADS_DOC}; without `model` the head shipped for the target",
)
EAGLE = MethodRecord(  # EAGLE-1/2 heads, same loader (it tells the layouts apart)
    "eagle", _eagle_head, "an EAGLE-1/2 head over the target's hidden states",
    options=HeadOptions, per_request=False, needs_model="an EAGLE head directory", shared=_eagle_heads, doc=_HEADS_DOC,
)
MEDUSA = MethodRecord("medusa", _medusa, "Medusa heads: chains or trees", options=MedusaOptions, per_request=False,
                      needs_model="Medusa heads directory")
MTP = MethodRecord(  # MiMo MTP layers (model None: the target's own folder)
    "mtp", _mtp, "the target checkpoint's own MTP layer (MiMo), chains or trees", options=MtpOptions,
    aliases=("mimo_mtp", "mimo-mtp", "deepseek_mtp", "draft-mtp"), shared=_mtp_heads,
)
