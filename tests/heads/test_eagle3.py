"""EAGLE-3 heads: a random-weight head written in exactly the EAGLE / SpecForge layout (and the
speculators spelling) for the tiny target; our forward against an independent slow reference;
chain and tree drafts through the engine give the plain greedy output; the head's KV rolls back;
bad checkpoints fail with clear errors."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tokenleap import LLM, SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import Draft, DraftRequest
from tokenleap.drafters.head_drafter import HeadDrafter, TreeShape
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.heads.base import DraftHead
from tokenleap.heads.loader import load_eagle3
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, make_generator
from tokenleap.tokenizer import Tokenizer
from tokenleap.verify.tree import check_parents, tree_depths

H, HEADS, KVH, HD, INTER = 64, 4, 2, 32, 128
VOCAB, DRAFT_VOCAB = 256, 96
AUX = [0, 1, 1]  # the tiny target has 2 layers: inputs of layers 0 (embedding), 1, 1
TINY = {"H": H, "HEADS": HEADS, "KVH": KVH, "HD": HD, "INTER": INTER, "VOCAB": VOCAB}
SMOLLM2 = {"H": 576, "HEADS": 9, "KVH": 3, "HD": 64, "INTER": 1536, "VOCAB": 49152}


def head_tensors(
    seed: int = 0, draft_vocab: int = DRAFT_VOCAB, d2t: bool = True, dims: dict[str, int] = TINY
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, HEADS, KVH, HD, INTER, VOCAB = (dims[k] for k in ("H", "HEADS", "KVH", "HD", "INTER", "VOCAB"))  # noqa: N806

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    p = "midlayer."
    t = {
        "fc.weight": rnd(H, 3 * H, std=(3 * H) ** -0.5),
        p + "input_layernorm.weight": 1 + rnd(H, std=0.1),
        p + "hidden_norm.weight": 1 + rnd(H, std=0.1),
        p + "self_attn.q_proj.weight": rnd(HEADS * HD, 2 * H, std=(2 * H) ** -0.5),
        p + "self_attn.k_proj.weight": rnd(KVH * HD, 2 * H, std=(2 * H) ** -0.5),
        p + "self_attn.v_proj.weight": rnd(KVH * HD, 2 * H, std=(2 * H) ** -0.5),
        p + "self_attn.o_proj.weight": rnd(H, HEADS * HD, std=(HEADS * HD) ** -0.5),
        p + "post_attention_layernorm.weight": 1 + rnd(H, std=0.1),
        p + "mlp.gate_proj.weight": rnd(INTER, H, std=H**-0.5),
        p + "mlp.up_proj.weight": rnd(INTER, H, std=H**-0.5),
        p + "mlp.down_proj.weight": rnd(H, INTER, std=INTER**-0.5),
        "norm.weight": 1 + rnd(H, std=0.1),
        "lm_head.weight": rnd(draft_vocab, H, std=H**-0.5 * 3),
    }
    if d2t:
        used = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values
        t["d2t"] = used - torch.arange(draft_vocab)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[used] = True
        t["t2d"] = t2d
    return t


def write_head(
    folder: Path,
    *,
    aux: list[int] = AUX,
    speculators: bool = False,
    dims: dict[str, int] = TINY,
    nbr: bool = False,
    **kw: object,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(dims=dims, **kw)  # type: ignore[arg-type]
    H, HEADS, KVH, HD, INTER, VOCAB = (dims[k] for k in ("H", "HEADS", "KVH", "HD", "INTER", "VOCAB"))  # noqa: N806
    layer = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
             "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KVH, "head_dim": HD,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128, "hidden_act": "silu",
             "vocab_size": VOCAB, "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]), "num_hidden_layers": 1,
             "tie_word_embeddings": False, "norm_before_residual": nbr}
    if speculators:
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": layer["draft_vocab_size"],
            "norm_before_residual": nbr, "target_hidden_size": H, "eagle_aux_hidden_state_layer_ids": aux
        }
        tensors = {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in tensors.items()
        }
    else:
        config = {**layer, "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("eagle3") / "head")


# --------------------------------------------------------------------------- slow reference


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rope(x: torch.Tensor, pos: int) -> torch.Tensor:  # x [heads, hd]
    half = HD // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = (pos * inv).float()
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    return x * cos + torch.cat([-x[:, half:], x[:, :half]], dim=-1) * sin


def reference_head(
    t: dict[str, torch.Tensor], feats: list[torch.Tensor], tok_emb: list[torch.Tensor], nbr: bool = False
) -> list[torch.Tensor]:
    """Head outputs h_i (pre-norm) for each position i, full causal attention from scratch,
    one position at a time (no cache): feats[i] = g_i, tok_emb[i] = embedding of x_{i+1}."""
    p = "midlayer."
    ks, vs, outs = [], [], []
    for i, (g, e) in enumerate(zip(feats, tok_emb)):
        x = torch.cat([_rms(e, t[p + "input_layernorm.weight"]), _rms(g, t[p + "hidden_norm.weight"])])
        q = _rope((t[p + "self_attn.q_proj.weight"] @ x).view(HEADS, HD), i)
        ks.append(_rope((t[p + "self_attn.k_proj.weight"] @ x).view(KVH, HD), i))
        vs.append((t[p + "self_attn.v_proj.weight"] @ x).view(KVH, HD))
        heads = []
        for hh in range(HEADS):
            kvh = hh // (HEADS // KVH)
            scores = torch.stack([q[hh] @ k[kvh] for k in ks]) / math.sqrt(HD)
            w = scores.softmax(0)
            heads.append(sum(wj * v[kvh] for wj, v in zip(w, vs)))
        residual = _rms(g, t[p + "hidden_norm.weight"]) if nbr else g
        h = residual + t[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
        m = _rms(h, t[p + "post_attention_layernorm.weight"])
        h = h + t[p + "mlp.down_proj.weight"] @ (
            F.silu(t[p + "mlp.gate_proj.weight"] @ m) * (t[p + "mlp.up_proj.weight"] @ m)
        )
        outs.append(h)
    return outs


def reference_chain(target: LlamaModel, t: dict[str, torch.Tensor], tokens: list[int], k: int) -> list[int]:
    """k draft tokens after `tokens`, recomputing everything from scratch at every step."""
    out = target.forward(
        torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), target.new_kv_cache(), return_hidden=(0,)
    )
    embed = target.embed.float()
    aux = torch.cat([embed[torch.tensor(tokens[:-1])], out.hidden_states[0], out.hidden_states[0]], dim=-1)
    feats = list(aux @ t["fc.weight"].T)
    seq = list(tokens)
    used = torch.arange(t["lm_head.weight"].shape[0]) + t["d2t"]
    drafted: list[int] = []
    for _ in range(k):
        hs = reference_head(t, feats, [embed[x] for x in seq[1:]])
        tok = int(used[int((t["lm_head.weight"] @ _rms(hs[-1], t["norm.weight"])).argmax())])
        drafted.append(tok)
        feats.append(hs[-1])
        seq.append(tok)
    return drafted


def _begin(drafter: HeadDrafter, rid: str = "r") -> None:
    drafter.begin(DraftRequest(rid, [1], SamplingParams(temperature=0.0), make_generator(None)))


def _observe_prompt(drafter: HeadDrafter, target: LlamaModel, tokens: list[int], rid: str = "r") -> None:
    out = target.forward(
        torch.tensor(tokens), torch.arange(len(tokens)), target.new_kv_cache(), return_hidden=drafter.hidden_layers
    )
    drafter.observe(rid, 0, tokens, out.hidden_states)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("use_kernels", [True, False])
def test_head_chain_matches_slow_reference(
    tiny_model_factory: Callable[..., LlamaModel], head_dir: Path, use_kernels: bool
) -> None:
    tiny_model = tiny_model_factory(use_kernels=use_kernels)
    head = load_eagle3(head_dir, tiny_model)
    t = head_tensors()
    drafter = HeadDrafter(head)
    assert drafter.name == "eagle3"  # named for what it runs (the head's kind)
    prompt = [5, 17, 99, 3, 42, 7, 200, 11]
    _begin(drafter)
    _observe_prompt(drafter, tiny_model, prompt[:-1])
    got = drafter.propose("r", prompt, 5).tokens
    assert got == reference_chain(tiny_model, t, prompt, 5)
    # the head's hidden output too, not only its argmax
    g = head.fuse(
        head.aux_from(
            prompt[:-1],
            tiny_model.forward(
                torch.tensor(prompt[:-1]), torch.arange(7), tiny_model.new_kv_cache(), return_hidden=(0,)
            ).hidden_states,
        )
    )
    from tokenleap.heads.base import HeadKV

    kv = HeadKV(KVH, HD)
    ours = head.layer(g, head.embed_tokens(prompt[1:]), torch.arange(7), kv, torch.ones(7, 7, dtype=torch.bool).tril())
    ref = reference_head(t, list(g), [tiny_model.embed.float()[x] for x in prompt[1:]])
    torch.testing.assert_close(ours, torch.stack(ref), rtol=1e-4, atol=1e-4)


def test_kv_rollback_draft_reject_redraft_equals_fresh_head(tiny_model: LlamaModel, head_dir: Path) -> None:
    head = load_eagle3(head_dir, tiny_model)
    prompt = [9, 8, 7, 100, 101, 102, 55]
    kv = tiny_model.new_kv_cache()
    out = tiny_model.forward(torch.tensor(prompt), torch.arange(len(prompt)), kv, return_hidden=head.hidden_layers)
    a = HeadDrafter(head)
    _begin(a)
    a.observe("r", 0, prompt, out.hidden_states)
    x = prompt + [33]
    first = a.propose("r", x, 6).tokens
    assert len(first) == 6
    # the target "rejects" after one token: commit x[-1] and a different second token
    accepted = [first[0]]
    bonus = (first[1] + 1) % VOCAB
    step = tiny_model.forward(torch.tensor([x[-1], *accepted]), torch.arange(len(prompt), len(prompt) + 2), kv,
                              return_hidden=head.hidden_layers)
    a.observe("r", len(prompt), [x[-1], *accepted], step.hidden_states)
    again = a.propose("r", x + accepted + [bonus], 6).tokens
    # a fresh head over the same accepted prefix, fed in one go
    b = HeadDrafter(head)
    _begin(b, "s")
    full = x + accepted
    _observe_prompt(b, tiny_model, full, "s")
    assert again == b.propose("s", full + [bonus], 6).tokens
    # and a rollback of the context (the engine undid a step): state rebuilt from the prefix
    assert a.propose("r", x, 6).tokens == first


def test_tree_is_well_formed_and_contains_the_chain(tiny_model: LlamaModel, head_dir: Path) -> None:
    head = load_eagle3(head_dir, tiny_model)
    prompt = [4, 44, 144, 14, 41, 114]
    chain, tree = HeadDrafter(head), HeadDrafter(head, TreeShape(topk=3, depth=4))
    for d in (chain, tree):
        _begin(d)
        _observe_prompt(d, tiny_model, prompt[:-1])
    c = chain.propose("r", prompt, 4).tokens
    draft = tree.propose("r", prompt, 12)
    assert draft.parents is not None and len(draft) == 12
    check_parents(draft.parents, 12)
    assert max(tree_depths(draft.parents)) <= 4
    # the first root path is the greedy chain as far as it was kept
    path, cur = [], -1
    for i, p in enumerate(draft.parents):
        if p == cur:
            path.append(draft.tokens[i])
            cur = i
    assert path and path == c[: len(path)]


@pytest.mark.parametrize("topk", [1, 3])
def test_engine_greedy_output_equals_plain(
    tiny_model: LlamaModel, tokenizer: Tokenizer, head_dir: Path, topk: int
) -> None:
    registry = default_registry()
    spec = SpecConfig(method="eagle3", model=str(head_dir), num_speculative_tokens=8, tree_topk=topk, tree_depth=4,
                      adaptive=False)
    drafter = registry.create("eagle3", spec, target=tiny_model)
    plain = Engine(tiny_model, tokenizer)
    fast = Engine(tiny_model, tokenizer, spec=spec, drafter=drafter)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120] * 3]
    reqs_p = [plain.add_request(p, params) for p in prompts]
    reqs_f = [fast.add_request(p, params) for p in prompts]
    for r in reqs_p:
        plain.run(r)
    for r in reqs_f:  # stepped together: the batched path
        fast.start(r)
    while not all(r.finished for r in reqs_f):
        fast.step_batch([r for r in reqs_f if not r.finished])
    for r in reqs_f:
        fast.finish(r)
    for a, b in zip(reqs_p, reqs_f):
        assert a.output_ids == b.output_ids
        assert b.metrics.spec.num_drafts > 0
    # sampled request (trees reduce to their first path): runs and keeps its length
    r = fast.add_request(prompts[0], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True))
    fast.run(r)
    assert len(r.output_ids) == 20


def test_speculators_layout_loads_the_same_head(tiny_model: LlamaModel, head_dir: Path, tmp_path: Path) -> None:
    spec_dir = write_head(tmp_path / "spec", speculators=True)
    prompt = [7, 77, 177, 17, 71]
    drafts = []
    for folder in (head_dir, spec_dir):
        d = HeadDrafter(load_eagle3(folder, tiny_model))
        _begin(d)
        _observe_prompt(d, tiny_model, prompt[:-1])
        drafts.append(d.propose("r", prompt, 4).tokens)
    assert drafts[0] == drafts[1]


def test_bad_checkpoints_fail_clearly(tiny_model: LlamaModel, tmp_path: Path) -> None:
    with pytest.raises(TokenleapError, match="aux layer ids"):
        load_eagle3(write_head(tmp_path / "a", aux=[0, 1, 2]), tiny_model)
    with pytest.raises(TokenleapError, match="no d2t"):
        load_eagle3(write_head(tmp_path / "b", d2t=False), tiny_model)
    bad = write_head(tmp_path / "c")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 128
    cfg["target_hidden_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenleapError, match="target hidden size"):
        load_eagle3(bad, tiny_model)
    odd = write_head(tmp_path / "e")
    cfg = json.loads((odd / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenleapError, match="multiple of num_key_value_heads"):
        load_eagle3(odd, tiny_model)
    with pytest.raises(TokenleapError, match="not a directory"):
        load_eagle3(tmp_path / "missing", tiny_model)
    with pytest.raises(TokenleapError, match="needs an EAGLE head"):
        SpecConfig(method="eagle")  # eagle3 without a model means the head shipped for the target
    with pytest.raises(TokenleapError, match="no EAGLE-3 head ships for model 'tiny'"):
        default_registry().create("eagle3", SpecConfig(method="eagle3"), target=tiny_model, target_name="tiny")
    # a full draft vocabulary needs no d2t
    load_eagle3(write_head(tmp_path / "d", d2t=False, draft_vocab=VOCAB), tiny_model)


@pytest.mark.slow
def test_real_model_greedy_output_equals_plain(llm: LLM, tmp_path: Path) -> None:
    """A random head shaped for SmolLM2-135M (aux layers 2, 15, 27, 2048-token draft vocabulary):
    chain and tree drafts through the real bf16 model give the plain greedy output."""
    head_dir = write_head(tmp_path / "smol", aux=[2, 15, 27], dims=SMOLLM2, draft_vocab=2048)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = Engine(llm.model, llm.tokenizer)
    want = plain.run(plain.add_request(ids, params)).output_ids
    for topk in (1, 4):
        spec = SpecConfig(method="eagle3", model=str(head_dir), num_speculative_tokens=6, tree_topk=topk, tree_depth=3,
                          adaptive=False)
        drafter = default_registry().create("eagle3", spec, target=llm.model)
        assert drafter.head.hidden_layers == (1, 14, 26)
        fast = Engine(llm.model, llm.tokenizer, spec=spec, drafter=drafter)
        req = fast.run(fast.add_request(ids, params))
        assert req.output_ids == want and req.metrics.spec.num_drafts > 0


@pytest.mark.slow
def test_shipped_head_drafts_the_default_model_losslessly(llm: LLM) -> None:
    """The head in tokenleap/heads (trained on a GPU by benchmarks/gpu_head.py) loads with no path,
    keeps greedy output identical to plain decoding and has most of its drafts accepted (a broken
    head, wrong aux layers or a bad d2t map would accept next to none)."""
    from tokenleap.heads.shipped import shipped_head

    assert shipped_head("eagle3", "smollm2-135m-instruct") is not None
    spec = SpecConfig(method="eagle3", num_speculative_tokens=5, adaptive=False)
    drafter = default_registry().create("eagle3", spec, target=llm.model, target_name="smollm2-135m-instruct")
    fast = Engine(llm.model, llm.tokenizer, spec=spec, drafter=drafter)
    plain = Engine(llm.model, llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    tokens = forwards = 0
    for q in ("What are the benefits of regular exercise?", "Write a short poem about autumn leaves."):
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        want = plain.run(plain.add_request(ids, params)).output_ids
        req = fast.run(fast.add_request(ids, params))
        assert req.output_ids == want
        tokens += req.metrics.num_decode_tokens
        forwards += req.metrics.num_forward_passes
    assert tokens / forwards > 1.6, tokens / forwards


class OracleEagle(HeadDrafter):
    """Runs the head as usual (state sync, KV rebuild) but proposes the known plain answer: a
    chain of the next 3 true tokens, or a tree whose first branch is a decoy. Keeps each
    request's final state, so that the features the engine fed can be checked."""

    def __init__(self, head: DraftHead, prompt_len: int, answer: list[int], tree: bool) -> None:
        super().__init__(head)
        self.prompt_len, self.answer, self.tree_mode = prompt_len, answer, tree
        self.final: dict[str, object] = {}

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> Draft:
        assert len(super().propose(request_id, tokens, max_tokens)) > 0
        done = len(tokens) - self.prompt_len
        truth = self.answer[done : done + 3]
        if len(truth) < 3:
            return super().propose(request_id, tokens, max_tokens)
        if not self.tree_mode:
            return Draft(truth)
        decoy = (truth[0] + 1) % VOCAB
        return Draft([decoy, truth[1], truth[0], truth[1], truth[2]], [-1, 0, -1, 2, 3])

    def end(self, request_id: str) -> None:
        self.final[request_id] = self._states.get(request_id)
        super().end(request_id)


@pytest.mark.parametrize("tree", [False, True])
def test_engine_feeds_the_accepted_positions_true_features(
    tiny_model: LlamaModel, tokenizer: Tokenizer, head_dir: Path, tree: bool
) -> None:
    head = load_eagle3(head_dir, tiny_model)
    prompt = [12, 34, 56, 78, 90, 21, 43]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = Engine(tiny_model, tokenizer)
    answer = plain.run(plain.add_request(prompt, params)).output_ids
    drafter = OracleEagle(head, len(prompt), answer, tree)
    spec = SpecConfig(method="custom", drafter=drafter, num_speculative_tokens=6, adaptive=False)
    engine = Engine(tiny_model, tokenizer, spec=spec, drafter=drafter)
    req = engine.run(engine.add_request(prompt, params))
    assert req.output_ids == answer
    assert req.metrics.spec.num_accepted_tokens >= 20  # the oracle's tokens were accepted, several per step
    st = drafter.final[req.request_id]
    seq = prompt + answer
    n = len(st.feat_tokens)
    assert st.feat_tokens == seq[:n] and n >= len(seq) - 4
    out = tiny_model.forward(
        torch.tensor(seq[:n]), torch.arange(n), tiny_model.new_kv_cache(), return_hidden=head.hidden_layers
    )
    fresh = head.fuse(head.aux_from(seq[:n], out.hidden_states))
    torch.testing.assert_close(st.feature_rows(0, n), fresh, rtol=1e-4, atol=1e-4)


def test_controller_counts_the_drafters_own_cost() -> None:
    from tokenleap.engine.speculation import CostCurve, DraftController

    curve = CostCurve(tuple(1.0 + 0.01 * k for k in range(17)))
    free = DraftController(curve, cap=16, accepted=8.0, trials=10.0)
    costly = DraftController(curve, cap=16, accepted=8.0, trials=10.0, draft_cost=0.1)
    assert costly.choose(16) < free.choose(16)


@pytest.mark.parametrize("speculators", [False, True])
def test_norm_before_residual_matches_reference(tiny_model: LlamaModel, tmp_path: Path, speculators: bool) -> None:
    head = load_eagle3(write_head(tmp_path / "nbr", nbr=True, speculators=speculators), tiny_model)
    assert head.config.norm_before_residual
    from tokenleap.heads.base import HeadKV

    g = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    toks = [3, 30, 130, 230, 31]
    ours = head.layer(
        g, head.embed_tokens(toks), torch.arange(5), HeadKV(KVH, HD), torch.ones(5, 5, dtype=torch.bool).tril()
    )
    ref = reference_head(head_tensors(), list(g), [tiny_model.embed.float()[x] for x in toks], nbr=True)
    torch.testing.assert_close(ours, torch.stack(ref), rtol=1e-4, atol=1e-4)


def test_chain_with_a_model_free_drafter_gives_plain_output(
    tiny_model: LlamaModel, tokenizer: Tokenizer, head_dir: Path
) -> None:
    spec = SpecConfig(method="suffix+eagle3", model=str(head_dir), num_speculative_tokens=6, adaptive=False)
    registry = default_registry()
    drafter = registry.create(spec.method, spec, target=tiny_model)
    assert drafter.needs_hidden_states and drafter.hidden_layers == (0,)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    plain = Engine(tiny_model, tokenizer)
    want = plain.run(plain.add_request(prompt, params)).output_ids
    fast = Engine(tiny_model, tokenizer, spec=spec, drafter=drafter)
    req = fast.run(fast.add_request(prompt, params))
    assert req.output_ids == want and req.metrics.spec.num_drafts > 0


def test_cli_flags_and_clear_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tokenleap.cli import _spec_dict, build_parser, main

    args = build_parser().parse_args(
        [
            "generate", "hi", "--spec-type", "draft-eagle3", "-md", "/h", "--spec-tree-topk", "4", "--spec-tree-depth",
            "3", "--draft-max", "12"
        ]
    )
    spec = SpecConfig.from_dict(_spec_dict(args))
    assert spec is not None and (spec.method, spec.model, spec.tree_topk, spec.tree_depth) == ("eagle3", "/h", 4, 3)
    # the default model's shipped head needs no path (a model without one: test_bad_checkpoints_fail_clearly)
    assert main(["generate", "hi", "--spec-type", "eagle3", "-n", "4", "--temperature", "0"]) == 0
    capsys.readouterr()
    assert main(["generate", "hi", "--spec-type", "eagle3", "--model-draft", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "Traceback" not in err
