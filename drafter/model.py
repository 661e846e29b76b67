"""The EAGLE-3 draft model, parameter-for-parameter what SGLang serves as ``LlamaForCausalLMEagle3``.

One decoder layer reads ``[input_layernorm(token embedding), hidden_norm(hidden)]`` (2H wide) and keeps
``hidden`` as its residual stream. ``hidden`` is ``fc(aux)`` (3H -> H) on the first draft step and the
layer's own pre-norm output on every later one; logits come from ``lm_head(norm(pre-norm output))``
over the draft vocab, mapped back to target ids by ``target_id = i + d2t[i]``.

Attention is written once for both callers: eval drafts with a KV cache (``past`` keys plus a causal
mask), training-time test adds, for unroll step i, the same-position keys of steps 1..i (``diag``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class DrafterShape:
    """Plain numbers that fix the drafter's tensors (the config.json fields SGLang reads)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must name 3 target layers (fc reads 3H), got {list(self.aux_layer_ids)}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    def as_dict(self) -> dict:
        return asdict(self)


def rope_parameters(shape: DrafterShape) -> dict:
    """transformers' ``rope_parameters`` for the shape; a legacy ``type`` key becomes ``rope_type``."""
    params = {"rope_type": "default", **(shape.rope_scaling or {}), "rope_theta": shape.rope_theta}
    params["rope_type"] = params.pop("type", params["rope_type"])
    return params


def rope_inv_freq(shape: DrafterShape) -> tuple[Tensor, float]:
    """Inverse frequencies and attention scaling, via transformers' table of RoPE types (imported
    only for scaled RoPE: it costs seconds, e.g. in every `python -m drafter check`)."""
    params = rope_parameters(shape)
    if params["rope_type"] == "default":
        base = shape.rope_theta
        return 1.0 / (base ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float) / shape.head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                      head_dim=shape.head_dim, max_position_embeddings=shape.max_position_embeddings,
                      rope_parameters=params)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, heads, T, d); cos/sin: (B, T, d)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalised in fp32, out in ``x``'s dtype. Why the last cast: under bf16 autocast over fp32 master
        weights ``weight * x`` is fp32, and everything downstream inherited it: RoPE, q and k, attention, and the
        inputs of the routed matmuls (``train.shared_weight_grad``), each cast to bf16 before its matmul and its
        gradient back to fp32 after, eager kernels between the compiled step's graphs (52 of each a step at the
        K2.5 shape). The matmuls read the same bf16 values as before; RoPE and attention now run on bf16 q and k,
        as serving does (bf16 weights), and a norm's output gradients from its several matmuls sum in bf16."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype)).to(dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
              diag: Sequence[tuple[Tensor, Tensor]] = ()) -> Tensor:
    """Softmax attention of q over the keys ``k`` (under ``mask``) and, per query position, the extra
    same-position keys in ``diag`` — the training-time-test pattern; ``diag`` empty is plain attention.

    q: (B, h, T, d); k, v: (B, kv, S, d); mask: bool (B|1, 1, T, S), True = may attend;
    diag: pairs of (B, kv, T, d). Returns (B, h, T, d). Reference math (fp32 scores).
    """
    groups = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, h, T, S)
    if mask is not None:
        # A finite floor, not -inf: a query with every key masked (left padding) must give finite
        # output, or its NaN would leak through later steps' cached keys (0 * NaN = NaN).
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if not diag:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    dk = torch.stack([d[0].repeat_interleave(groups, 1) for d in diag], dim=3)  # (B, h, T, i, d)
    dv = torch.stack([d[1].repeat_interleave(groups, 1) for d in diag], dim=3)
    dscores = (q.float().unsqueeze(3) * dk.float()).sum(-1) * scale  # (B, h, T, i)
    probs = torch.cat([scores, dscores], dim=-1).softmax(-1)
    s = scores.shape[-1]
    out = torch.matmul(probs[..., :s], v.float()) + (probs[..., s:].unsqueeze(-1) * dv.float()).sum(3)
    return out.to(q.dtype)


def linear(x: Tensor, layer: nn.Linear, cols: slice = slice(None), add: Tensor | None = None) -> Tensor:
    """``x @ layer.weight[:, cols].T``, plus ``add`` in the same matmul (rounded once): every matmul of the drafter
    goes through here. Why one door: training attaches a ``route`` to a layer (``train.shared_weight_grad``)
    that computes the same product with a backward of its own, and the drafter must not know about it."""
    route = layer.__dict__.get("route")
    if route is not None:
        return route(x, cols, add)
    w = layer.weight if cols == slice(None) else layer.weight[:, cols]  # whole: autocast caches its cast
    if add is None:
        return F.linear(x, w)
    return add.reshape(-1, add.shape[-1]).addmm(x.reshape(-1, x.shape[-1]), w.t()).view(add.shape)


AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor | None, Sequence[tuple[Tensor, Tensor]]], Tensor]


class DraftAttention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Heads of q, k, v from x (B, T, 2H) = [normed embeddings, normed hidden], q and k rotated."""
        return self._heads(linear(x, self.q_proj), linear(x, self.k_proj), linear(x, self.v_proj), cos, sin)

    def embed_part(self, e: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The normed embeddings' share of q, k and v: each projection's first H input columns applied to e."""
        h = slice(None, e.shape[-1])
        return linear(e, self.q_proj, h), linear(e, self.k_proj, h), linear(e, self.v_proj, h)

    def qkv_split(self, embed_part: Sequence[Tensor], hidden: Tensor, cos: Tensor, sin: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """``qkv`` with the embeddings' share given (``embed_part``, computed once for several calls) and the
        normed hidden (B, T, H) projected here: one matmul adding into each share (rounded once, as ``qkv``)."""
        cols = slice(hidden.shape[-1], None)
        q, k, v = (linear(hidden, proj, cols, add=part)
                   for part, proj in zip(embed_part, (self.q_proj, self.k_proj, self.v_proj), strict=True))
        return self._heads(q, k, v, cos, sin)

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = q.shape
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, h, T, d)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, d)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: Tensor) -> Tensor:
        b, _, t, _ = o.shape
        return linear(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim), self.o_proj)


class DraftMLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj)


class DraftLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = DraftAttention(s)
        self.mlp = DraftMLP(s)


@dataclass
class StepOutput:
    prenorm: Tensor  # (B, T, H): next step's `hidden`, and the input of norm -> lm_head
    k: Tensor  # (B, kv, T, d) keys of this call's positions (for a cache or a later TTT step)
    v: Tensor


class Eagle3Drafter(nn.Module):
    """State-dict names equal SGLang's checkpoint keys (plus the frozen ``embed_tokens``)."""

    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * shape.hidden_size, shape.hidden_size, bias=False)
        self.midlayer = DraftLayer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
        t2d[: shape.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        inv_freq, self.rope_scaling_factor = rope_inv_freq(shape)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # fc reads aux * aux_scale once set_aux_scale ran (drafter.aux_scale); a save folds it into fc
        self.register_buffer("aux_scale", torch.ones(3 * shape.hidden_size), persistent=False)
        self.aux_scaled = False  # until then fc reads the aux states as they are (no pass over them per call)

    # -- pieces ------------------------------------------------------------------------------
    def set_vocab_map(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def set_embeddings(self, weight: Tensor) -> None:
        """Copy the target's input embedding (frozen: serving uses the target's own)."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(weight.shape)} does not fit the drafter's "
                             f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (torch's own signature)
        """Casts (eval's ``.to(target.dtype)``, DeepSpeed's bf16 engine) move ``inv_freq`` but never round it:
        a bf16 frequency is off by up to 2^-9 relative, a rotation error that grows with position (radians at a
        few thousand tokens). SGLang computes the frequencies in fp32 whatever the weights' dtype. ``aux_scale``
        stays fp32 too: it is folded into fc at every save."""
        before = {name: getattr(self, name) for name in ("inv_freq", "aux_scale")}
        super()._apply(fn, recurse)
        for name, old in before.items():
            if getattr(self, name).dtype != old.dtype:
                setattr(self, name, old.to(getattr(self, name).device))
        return self

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin at ``positions`` (B, T), computed in fp32 from fp32 frequencies, then cast to ``dtype``."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # (B, T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.rope_scaling_factor).to(dtype),
                (emb.sin() * self.rope_scaling_factor).to(dtype))

    def project_aux(self, aux: Tensor) -> Tensor:
        """(B, T, 3H) target aux states -> (B, T, H) first-step hidden."""
        return linear(aux * self.aux_scale.to(aux.dtype) if self.aux_scaled else aux, self.fc)

    @torch.no_grad()
    def set_aux_scale(self, scale: Tensor) -> None:
        """Let fc read ``aux * scale`` (3H,), its weight divided to match, so the drafter computes the same function
        and only the optimizer sees standardized inputs (each weight's step moves the output alike whatever its
        input's scale). SGLang reads fc alone: ``servable_fc_weight`` folds the scale back in."""
        scale = scale.to(self.aux_scale.device, torch.float32)
        self.fc.weight.copy_((self.fc.weight.float() * (self.aux_scale.float() / scale)).to(self.fc.weight.dtype))
        self.aux_scale.copy_(scale)
        self.aux_scaled = True

    def servable_fc_weight(self) -> Tensor:
        """fc's weight as SGLang applies it to the raw aux states: the scale folded in."""
        return (self.fc.weight.detach().float() * self.aux_scale.float()).to(self.fc.weight.dtype)

    def step(self, input_ids: Tensor | None, hidden: Tensor, positions: Tensor,
             past: tuple[Tensor, Tensor] | None = None, mask: Tensor | None = None,
             diag: Sequence[tuple[Tensor, Tensor]] = (), attn_fn: AttentionFn = attention,
             embed_part: Sequence[Tensor] | None = None) -> StepOutput:
        """One pass of the decoder layer.

        input_ids (B, T): the token after each hidden's position; hidden (B, T, H); positions (B, T).
        past: cached (k, v) of earlier positions, prepended to this call's keys; mask covers
        past + this call's keys; diag: same-position keys of earlier TTT steps. embed_part: the embeddings'
        share of q, k, v for these positions (``embed_projections``), in place of ``input_ids`` (then None): the
        TTT unroll's path. Drafting (eval) passes ``input_ids`` and projects the concatenation in one matmul, as
        SGLang computes it.
        """
        layer = self.midlayer
        if embed_part is None:
            embeds = self.embed_tokens(input_ids).to(hidden.dtype)
            x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # (B,T,2H)
            cos, sin = self.rope(positions, x.dtype)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
        else:
            normed = layer.hidden_norm(hidden)
            cos, sin = self.rope(positions, normed.dtype)
            q, k, v = layer.self_attn.qkv_split(embed_part, normed, cos, sin)
        keys, values = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past else (k, v)
        h = hidden + layer.self_attn.out(attn_fn(q, keys, values, mask, diag))
        prenorm = h + layer.mlp(layer.post_attention_layernorm(h))
        return StepOutput(prenorm, k, v)

    def embed_projections(self, input_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """The embeddings' share of q, k, v for ``input_ids`` (B, L), for ``step(embed_part=...)``. Why: TTT's
        draft step i reads the embeddings of the tokens step 0 reads i positions on, so the unroll computes this
        share once over all its positions and slices it, instead of once per draft step (at the K2.5 shape that
        share is a sixth of a draft step's matmul FLOPs)."""
        layer = self.midlayer
        return layer.self_attn.embed_part(layer.input_layernorm(self.embed_tokens(input_ids).to(dtype)))

    def step_layers(self) -> list[nn.Linear]:
        """The matmuls every draft step runs (all but ``fc``, which only the first step's hidden reads)."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                self.lm_head]

    def logits(self, prenorm: Tensor) -> Tensor:
        """Draft-vocab logits (B, T, draft_vocab_size)."""
        return linear(self.norm(prenorm), self.lm_head)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]


def causal_mask(q_len: int, past_len: int, key_padding: Tensor | None = None,
                device: torch.device | str = "cpu") -> Tensor:
    """Bool (B|1, 1, T, past+T): query t (at absolute past_len + t) sees keys <= itself.

    key_padding: bool (B, past+T), True where a key is real.
    """
    q_pos = torch.arange(q_len, device=device)[:, None] + past_len
    k_pos = torch.arange(past_len + q_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if key_padding is not None:
        mask = mask & key_padding[:, None, None, :]
    return mask
