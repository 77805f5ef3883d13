"""Models the planner knows by name, and :class:`ModelSpec`: what the planner needs to know about any model.

Presets (``--model NAME``; ``--model-arg key=value`` changes a config field):

- ``gpt``: the project's example GPT (``gpt.py``, the one definition ``examples/gpt_model.py`` imports), with its
  deliberately uneven default sizes; ``gpt-124m`` is the same code at GPT-2 small size.
- ``llama-1b``, ``llama-8b``, ``llama-70b``: Llama-3-shaped decoders with Hugging Face's module layout
  (``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, RMSNorm,
  rotary embeddings, grouped-query attention, SwiGLU); 1B ties the output head to the embedding like Llama 3.2 1B.
- ``moe``, ``moe-30b-a3b``: the same decoder with a mixture of experts in place of each MLP (a router, top-k
  routing, grouped SwiGLU experts as 3-D weights, torchtitan's layout); 30B-A3B has Qwen3-30B-A3B's sizes (128
  experts, 8 routed per token; heads of ``dim / n_heads``). Tokens go to their experts with a fixed capacity per
  expert (GShard's dispatch: shapes that do not depend on the routing, so a simulated rank moves exactly what a
  balanced real one does); with expert parallel (``--ep``) by an all-to-all over the ``ep`` ranks each way.

Every preset shards each block (``blocks[i]`` / ``model.layers[i]``) as a unit, then the root (the torchtitan
recipe), and has a tensor-parallel plan for ``--tp``: column-wise in-projections, row-wise out-projections (the MoE
presets: attention only). The MoE presets have an expert-parallel plan for ``--ep``: each rank holds ``1 / ep`` of
every layer's experts, which fully_shard then shards over their own data-parallel mesh (``efsdp``).
Builders only construct modules; the planner calls them under ``FakeTensorMode`` so no parameter memory is used.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "PRESETS", "GPTConfig", "Llama", "LlamaConfig", "MoEConfig", "ModelSpec", "load_model_spec"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class ModelSpec:
    """A model and what the planner needs to run a training step on it.

    ``units``: the submodules sharded first, each its own unit (the root takes the rest). ``make_batch(batch, seq)``
    returns ``(inputs, targets)`` for one data-parallel rank. ``tp_plan(model, tp_mesh)`` applies tensor parallelism
    (``None``: the model has no plan; planning with ``--tp`` then fails). ``ep_plan(model, ep_mesh)`` applies expert
    parallelism and returns the names of the parameters it distributed over ``ep_mesh`` (the experts, which are
    then sharded over their own data-parallel mesh; ``None``: no plan, planning with ``--ep`` fails).
    """

    model: nn.Module
    units: list[nn.Module]
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    ep_plan: Callable[[nn.Module, DeviceMesh], list[str]] | None = None
    description: dict[str, Any] = field(default_factory=dict)


def _token_batch(vocab: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def make(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        return tokens[:, :-1], tokens[:, 1:]

    return make


# ---------------------------------------------------------------------- GPT (gpt.py: the example's model)
def gpt_tp_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor-parallel MLPs in every block: ``fc`` column-wise, ``proj`` row-wise (attention stays replicated)."""
    assert isinstance(model, GPT)
    for block in model.blocks:
        assert isinstance(block, Block)
        parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


def gpt_spec(cfg: GPTConfig) -> ModelSpec:
    model = GPT(cfg)
    return ModelSpec(model, list(model.blocks), _token_batch(cfg.vocab_size), cross_entropy, gpt_tp_plan)


# ---------------------------------------------------------------------- Llama (Hugging Face layout)
@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama decoder whose MLPs are mixtures of ``num_experts`` experts, ``top_k`` per token (``ffn_dim`` unused).

    ``capacity_factor``: each expert takes at most ``ceil(tokens * top_k / num_experts * capacity_factor)`` tokens
    of a rank's batch (the rest are dropped, GShard's rule)."""

    num_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 512
    capacity_factor: float = 1.25


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.groups = cfg.n_heads // cfg.n_kv_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups > 1)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class GroupedExperts(nn.Module):
    """SwiGLU experts as 3-D weights, expert first (``w1``, ``w3``: ``[experts, hidden, dim]``; ``w2``:
    ``[experts, dim, hidden]``), applied with batched matmuls to ``[experts, tokens, dim]``. Under expert parallel the
    weights are DTensors sharded on the expert dim over the ``ep`` mesh, and each rank computes its own experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        shape = (cfg.num_experts, cfg.expert_ffn_dim, cfg.dim)
        self.w1 = nn.Parameter(torch.empty(shape))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim, cfg.expert_ffn_dim))
        self.w3 = nn.Parameter(torch.empty(shape))
        for weight in (self.w1, self.w2, self.w3):
            nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        hidden = F.silu(torch.bmm(x, w1.transpose(1, 2))) * torch.bmm(x, w3.transpose(1, 2))
        return torch.bmm(hidden, w2.transpose(1, 2))


class MoE(nn.Module):
    """Top-k routing over ``experts`` with a fixed capacity per expert; ``ep_group`` set by :func:`moe_ep_plan`."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = cfg.num_experts, cfg.top_k, cfg.capacity_factor
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg)
        self.ep_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dim = x.shape, x.shape[-1]
        tokens = x.reshape(-1, dim)
        scores = torch.softmax(self.router(tokens).float(), dim=-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        experts = self.num_experts
        capacity = math.ceil(tokens.shape[0] * self.top_k / experts * self.capacity_factor)
        flat = chosen.reshape(-1)
        one_hot = F.one_hot(flat, experts)
        position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
        # a token over its expert's capacity goes to a spare last row, dropped
        slot = torch.where(position < capacity, flat * capacity + position, experts * capacity)
        routed = tokens.new_zeros(experts * capacity + 1, dim).index_add(
            0, slot, tokens.repeat_interleave(self.top_k, 0)
        )
        out = self._run_experts(routed[:-1].view(experts, capacity, dim))
        picked = torch.cat([out.reshape(-1, dim), out.new_zeros(1, dim)])[slot]
        combined = (picked * weights.reshape(-1, 1).to(picked.dtype)).view(-1, self.top_k, dim).sum(1)
        return combined.view(shape)

    def _run_experts(self, dispatched: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.experts(dispatched)  # type: ignore[no-any-return]
        experts, capacity, dim = dispatched.shape
        ep = dist.get_world_size(self.ep_group)
        local = experts // ep
        # rank j's experts are rows [j * local, (j + 1) * local): an even all-to-all sends each rank its experts'
        # tokens and brings back, from every rank, the tokens routed to this rank's experts
        received = _AllToAll.apply(dispatched.reshape(-1, dim), self.ep_group)
        inputs = received.view(ep, local, capacity, dim).transpose(0, 1).reshape(local, ep * capacity, dim)
        outputs = self.experts(inputs).view(local, ep, capacity, dim).transpose(0, 1).reshape(-1, dim)
        return _AllToAll.apply(outputs, self.ep_group).view(experts, capacity, dim)  # type: ignore[no-any-return]


class _AllToAll(torch.autograd.Function):
    """An even all-to-all over ``group`` (its gradient: the same the other way), through ``dist.all_to_all_single``
    both ways so that a :class:`fsdp_compose.CollectiveRecorder` sees the backward's too (torch's autograd
    functional collective issues its backward from C++)."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(tokens, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(tokens: torch.Tensor, group: Any) -> torch.Tensor:
    out = torch.empty_like(tokens)
    dist.all_to_all_single(out, tokens.contiguous(), group=group)
    return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.checkpointing = cfg.activation_checkpointing
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if isinstance(cfg, MoEConfig) else LlamaMLP(cfg)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointing:
            return checkpoint(self._body, x, cos, sin, use_reentrant=False)  # type: ignore[no-any-return]
        return self._body(x, cos, sin)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def rotary(self, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles for positions ``0..t-1`` (computed per call, like Hugging Face's)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        angles = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        cos, sin = self.rotary(idx.shape[1], x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)  # type: ignore[no-any-return]


class Llama(nn.Module):
    """``LlamaForCausalLM``'s layout: ``model`` (embeddings, layers, final norm) and ``lm_head``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))  # type: ignore[no-any-return]


def llama_tp_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style: q/k/v and gate/up column-wise, o and down row-wise (embeddings and head replicated; a mixture
    of experts' router and experts too)."""
    assert isinstance(model, Llama)
    colwise = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        parallelize_module(layer.self_attn, tp_mesh, {**colwise, "o_proj": RowwiseParallel()})
        if isinstance(layer.mlp, LlamaMLP):
            mlp_plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
            parallelize_module(layer.mlp, tp_mesh, mlp_plan)


def llama_spec(cfg: LlamaConfig) -> ModelSpec:
    model = Llama(cfg)
    return ModelSpec(model, list(model.model.layers), _token_batch(cfg.vocab_size), cross_entropy, llama_tp_plan)


def moe_ep_plan(model: nn.Module, ep_mesh: DeviceMesh) -> list[str]:
    """Every layer's experts sharded on the expert dim over ``ep_mesh`` (``Shard(0)``), their tokens moved there and
    back by all-to-alls; returns the expert weights' names."""
    assert isinstance(model, Llama)
    names = []
    for path, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        if module.num_experts % ep_mesh.size():
            raise ValueError(f"{path}: {module.num_experts} experts do not split over {ep_mesh.size()} ep ranks")
        for name, weight in list(module.experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(weight.detach(), ep_mesh, [Shard(0)]))
            module.experts.register_parameter(name, sharded)
            names.append(f"{path}.experts.{name}")
        module.ep_group = ep_mesh.get_group()
    return names


def moe_spec(cfg: MoEConfig) -> ModelSpec:
    model = Llama(cfg)
    units = list(model.model.layers)
    return ModelSpec(model, units, _token_batch(cfg.vocab_size), cross_entropy, llama_tp_plan, moe_ep_plan)


# ---------------------------------------------------------------------- registry
_LLAMA_1B = LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True)
_LLAMA_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)
_LLAMA_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672)
_GPT_124M = GPTConfig(vocab_size=50304, seq_len=1024, dim=768, n_layers=12, n_heads=12)
_MOE = MoEConfig(vocab_size=32000, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, num_experts=8, top_k=2)
_MOE_30B_A3B = MoEConfig(
    vocab_size=151936,
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    num_experts=128,
    top_k=8,
    expert_ffn_dim=768,
    rope_theta=1000000.0,
    norm_eps=1e-6,
)

PRESETS: dict[str, tuple[Any, Callable[[Any], ModelSpec]]] = {
    "gpt": (GPTConfig(), gpt_spec),
    "gpt-124m": (_GPT_124M, gpt_spec),
    "llama-1b": (_LLAMA_1B, llama_spec),
    "llama-8b": (_LLAMA_8B, llama_spec),
    "llama-70b": (_LLAMA_70B, llama_spec),
    "moe": (_MOE, moe_spec),
    "moe-30b-a3b": (_MOE_30B_A3B, moe_spec),
}


def _coerce(value: Any, like: Any) -> Any:
    if isinstance(like, bool) and isinstance(value, str):
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"expected a boolean, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if isinstance(like, (int, float)) and isinstance(value, str):
        return type(like)(value)
    return value


def _auto_units(model: nn.Module) -> list[nn.Module]:
    return [child for module in model.modules() if isinstance(module, nn.ModuleList) for child in module]


def _as_spec(built: Any, name: str) -> ModelSpec:
    if isinstance(built, ModelSpec):
        return built
    if not isinstance(built, nn.Module):
        raise TypeError(f"model factory {name} returned {type(built).__name__}; expected an nn.Module or a ModelSpec")
    embedding = next((m for m in built.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise TypeError(
            f"model factory {name} returned a module without an nn.Embedding, so the planner cannot make its "
            "inputs; return a fsdp_compose.plan.ModelSpec with make_batch and loss instead"
        )
    return ModelSpec(built, _auto_units(built), _token_batch(embedding.num_embeddings), cross_entropy)


def load_model_spec(
    model: str, model_args: dict[str, Any] | None = None, *, activation_checkpointing: bool = False
) -> ModelSpec:
    """Build a preset (``"llama-8b"``) or call a factory (``"package.module:function"``) with ``model_args``.

    A factory returns an ``nn.Module`` (units: every child of every ``nn.ModuleList``; inputs: token ids for its
    first ``nn.Embedding``; loss: cross-entropy) or a :class:`ModelSpec`. ``activation_checkpointing`` is passed to
    presets (checkpointing inside each block); a factory receives it as a keyword argument when it is set.
    """
    args = dict(model_args or {})
    if model in PRESETS:
        config, build = PRESETS[model]
        known = {f.name: getattr(config, f.name) for f in fields(config)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"preset {model!r} has no config field(s) {unknown}; fields: {sorted(known)}")
        changes = {key: _coerce(value, known[key]) for key, value in args.items()}
        if activation_checkpointing:
            changes["activation_checkpointing"] = True
        built_config = replace(config, **changes)
        spec = build(built_config)
        spec.description = {"model": model, **asdict(built_config)}
        return spec
    if ":" not in model:
        raise ValueError(f"unknown model {model!r}: use a preset ({', '.join(PRESETS)}) or 'package.module:function'")
    module_name, _, attr = model.partition(":")
    factory: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    if activation_checkpointing:
        args["activation_checkpointing"] = True
    spec = _as_spec(factory(**args), model)
    spec.description = {"model": model, **args, **spec.description}
    return spec


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
