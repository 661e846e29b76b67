"""The TTT loss and attention against straight-from-the-definition loops (tiny shapes)."""

from __future__ import annotations

import math

import pytest
import torch

from drafter.model import attention, causal_mask
from drafter.vocab_map import build_vocab_map
from train.attention import ttt_flex_attention
from train.module import TTTModel
from train.ttt import sharpen, supervision, teacher_from_hidden, teacher_from_topk, ttt_forward

B, T, N, DECAY = 2, 7, 3, 0.7


def _rope(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (heads, d) at one absolute position, rotate-half convention."""
    ang = pos * inv_freq.double()
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _reference_loss(m, ids, aux, last_hidden, lm_head, loss_mask, argmax, n, decay):
    """Explicit loops: every step, every row, every key; teacher = full softmax restricted + renormalised."""
    m = m.double()
    s = m.shape
    layer, att = m.midlayer, m.midlayer.self_attn
    g = s.num_attention_heads // s.num_key_value_heads
    draft_ids = torch.nonzero(m.t2d).flatten()
    losses = [[0.0, 0] for _ in range(n)]
    for b in range(ids.shape[0]):
        hid = [m.fc(aux[b, t].double()) for t in range(T)]
        keys = {}  # (step, row) -> (k, v) each (kv, d)
        for i in range(n):
            new_hid = []
            qs = {}
            for t in range(T):
                tok = ids[b, t + 1 + i] if t + 1 + i < T else 0
                x = torch.cat([layer.input_layernorm(m.embed_tokens.weight[tok]), layer.hidden_norm(hid[t])])
                q = att.q_proj(x).view(s.num_attention_heads, s.head_dim)
                k = att.k_proj(x).view(s.num_key_value_heads, s.head_dim)
                v = att.v_proj(x).view(s.num_key_value_heads, s.head_dim)
                qs[t] = _rope(q, t + i, m.inv_freq)
                keys[(i, t)] = (_rope(k, t + i, m.inv_freq), v)
            for t in range(T):
                visible = [keys[(0, r)] for r in range(t + 1)] + [keys[(j, t)] for j in range(1, i + 1)]
                heads = []
                for h in range(s.num_attention_heads):
                    sc = torch.stack([qs[t][h] @ k[h // g] for k, _ in visible]) / math.sqrt(s.head_dim)
                    w = torch.softmax(sc, 0)
                    heads.append(sum(w[r] * visible[r][1][h // g] for r in range(len(visible))))
                o = att.o_proj(torch.cat(heads))
                h1 = hid[t] + o
                pre = h1 + layer.mlp(layer.post_attention_layernorm(h1))
                new_hid.append(pre)
                j = t + 1 + i
                if j + 1 >= T or not loss_mask[b, j + 1] or not m.t2d[argmax[b, j]]:
                    continue
                full = torch.softmax(last_hidden[b, j].double() @ lm_head.double().t(), 0)
                p = full[draft_ids] / full[draft_ids].sum()
                logq = torch.log_softmax(m.lm_head(m.norm(pre)), 0)
                losses[i][0] += float(-(p * logq).sum())
                losses[i][1] += 1
            hid = new_hid
    per_step = [c and s_ / c for s_, c in losses]
    total = sum(decay ** i * per_step[i] for i in range(n))
    return total, per_step


def _batch(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * shape.hidden_size, generator=g)
    last = torch.randn(B, T, shape.hidden_size, generator=g)
    lm_head = torch.randn(shape.vocab_size, shape.hidden_size, generator=g) * 0.3
    mask = torch.rand(B, T, generator=g) < 0.8
    return ids, aux, last, lm_head, mask


@pytest.fixture
def mapped(tiny_drafter):
    counts = torch.arange(tiny_drafter.shape.vocab_size).flip(0) % 13
    d2t, t2d = build_vocab_map(counts, tiny_drafter.shape.draft_vocab_size)
    tiny_drafter.set_vocab_map(d2t, t2d)
    return tiny_drafter


def test_ttt_loss_equals_definition(mapped):
    m = mapped
    ids, aux, last, lm_head, mask = _batch(m.shape)
    argmax = (last @ lm_head.t()).argmax(-1)  # mix of in- and out-of-draft-vocab targets
    assert 0 < int(m.t2d[argmax].sum()) < argmax.numel()
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
    sup = supervision(teacher_from_hidden(last, rows), argmax, mask, m.t2d)
    res = ttt_forward(m, ids, aux, sup, N, DECAY)
    want, want_steps = _reference_loss(m, ids, aux, last, lm_head, mask, argmax, N, DECAY)
    assert res.step_losses.tolist() == pytest.approx(want_steps, rel=1e-5, abs=1e-6)
    assert float(res.loss) == pytest.approx(want, rel=1e-5)
    # Row t of step i is scored when the token after j = t + 1 + i is supervised.
    for i in range(N):
        for t in range(T):
            j = t + 1 + i
            assert bool(res.scored[i, 0, t]) == (j + 1 < T and bool(mask[0, j + 1]))


def test_soft_ce_gradient_matches_autograd(mapped):
    m = mapped
    ids, aux, last, lm_head, mask = _batch(m.shape, seed=3)
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
    sup = supervision(teacher_from_hidden(last, rows), torch.zeros_like(ids) + int(m.to_target_ids(
        torch.tensor(0))), mask, m.t2d)
    ttt_forward(m, ids, aux, sup, N, DECAY).loss.backward()
    fast = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    import train.ttt as ttt

    def plain(logits, probs, weight, offset=0):
        probs = probs[:, offset:offset + logits.shape[1]]
        return (-(probs * torch.log_softmax(logits.float(), -1)).sum(-1) * weight).sum()

    orig, ttt.soft_cross_entropy = ttt.soft_cross_entropy, plain
    try:
        ttt_forward(m, ids, aux, sup, N, DECAY).loss.backward()
    finally:
        ttt.soft_cross_entropy = orig
    assert "embed_tokens.weight" not in fast
    for n, gr in fast.items():
        torch.testing.assert_close(gr, m.get_parameter(n).grad, rtol=1e-4, atol=1e-6, msg=n)


def test_topk_teacher_scatter_renormalises(mapped):
    m = mapped
    g = torch.Generator().manual_seed(5)
    k = 6
    topk_ids = torch.stack([torch.randperm(m.shape.vocab_size, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
    topk_lp = torch.log_softmax(torch.randn(B, T, k, generator=g), -1)
    got = teacher_from_topk(topk_ids, topk_lp, m.t2d)
    d2t_ids = m.to_target_ids(torch.arange(m.shape.draft_vocab_size))
    for b in range(B):
        for t in range(T):
            kept = {int(i): float(lp) for i, lp in zip(topk_ids[b, t], topk_lp[b, t], strict=True) if m.t2d[i]}
            want = torch.full((m.shape.draft_vocab_size,), float("-inf"), dtype=torch.float64)
            if kept:
                z = math.log(sum(math.exp(v) for v in kept.values()))
                for d, tid in enumerate(d2t_ids.tolist()):
                    if tid in kept:
                        want[d] = kept[tid] - z
            else:
                want[:] = -math.log(m.shape.draft_vocab_size)
            torch.testing.assert_close(got[b, t].double(), want, rtol=1e-5, atol=1e-6)


def test_ttt_attention_pattern_equals_loop():
    g = torch.Generator().manual_seed(0)
    b, h, kv, t, d = 1, 4, 2, 5, 8
    q = torch.randn(b, h, t, d, generator=g)
    k0, v0, k1, v1, k2, v2 = (torch.randn(b, kv, t, d, generator=g) for _ in range(6))
    mask = torch.cat([causal_mask(t, 0), torch.eye(t, dtype=torch.bool)[None, None]], -1)
    got = attention(q, torch.cat([k0, k2], 2), torch.cat([v0, v2], 2), mask, [(k1, v1)])
    for hh in range(h):
        for qi in range(t):
            ks = [k0[0, hh // 2, r] for r in range(qi + 1)] + [k1[0, hh // 2, qi], k2[0, hh // 2, qi]]
            vs = [v0[0, hh // 2, r] for r in range(qi + 1)] + [v1[0, hh // 2, qi], v2[0, hh // 2, qi]]
            w = torch.softmax(torch.stack([q[0, hh, qi] @ kk for kk in ks]) / math.sqrt(d), 0)
            want = sum(wi * vi for wi, vi in zip(w, vs, strict=True))
            torch.testing.assert_close(got[0, hh, qi], want, rtol=1e-5, atol=1e-6)


def test_flex_attention_matches_reference_forward(mapped):
    """The CUDA fast path's maths, run eagerly (CPU flex has no backward; test_train_ttt_cuda covers it)."""
    m = mapped
    ids, aux, last, lm_head, mask = _batch(m.shape, seed=2)
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
    sup = supervision(teacher_from_hidden(last, rows), (last @ lm_head.t()).argmax(-1), mask, m.t2d)
    with torch.no_grad():
        ref = ttt_forward(m, ids, aux, sup, 4, DECAY)
        fast = ttt_forward(m, ids, aux, sup, 4, DECAY, attn_fn=ttt_flex_attention)
    torch.testing.assert_close(fast.step_losses, ref.step_losses, rtol=1e-5, atol=1e-6)
    assert torch.equal(fast.correct, ref.correct)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs CUDA")
def test_flex_attention_gradients_match_reference_cuda():
    from drafter.model import DrafterShape, Eagle3Drafter

    shape = DrafterShape(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=97, draft_vocab_size=40, aux_layer_ids=(0, 1, 2))
    torch.manual_seed(0)
    m = Eagle3Drafter(shape)
    torch.nn.init.normal_(m.embed_tokens.weight, std=0.5)
    d2t, t2d = build_vocab_map(torch.arange(97).flip(0) % 13, 40)
    m.set_vocab_map(d2t, t2d)
    m = m.cuda()
    lm_head = torch.randn(97, 64, device="cuda") * 0.3
    t = 160  # > one 128-row flex block (compiled flex needs head_dim >= 16)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, m.shape.vocab_size, (B, t), device="cuda", generator=g)
    aux = torch.randn(B, t, 3 * m.shape.hidden_size, device="cuda", generator=g)
    last = torch.randn(B, t, m.shape.hidden_size, device="cuda", generator=g)
    mask = torch.ones(B, t, dtype=torch.bool, device="cuda")
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size, device="cuda"))]
    sup = supervision(teacher_from_hidden(last, rows), (last @ lm_head.t()).argmax(-1), mask, m.t2d)
    grads = []
    for fn in (attention, ttt_flex_attention):
        m.zero_grad()
        res = ttt_forward(m, ids, aux, sup, 5, DECAY, attn_fn=fn)
        res.loss.backward()
        grads.append((res.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-5)
    for n, gr in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][n], gr, rtol=1e-3, atol=1e-5, msg=n)


# Token-budget batches (train.batch_tokens over lengths rounded up to 16 on CUDA) as the sampler makes them:
# many rows of short samples, a few of long ones, a lone long one, one 128-token block, lengths that fill a
# flex block and lengths that end inside one.
BATCH_SHAPES = [(2, 272), (3, 384), (5, 528), (2, 1040), (7, 256), (6, 656), (16, 400), (1, 784), (4, 128),
                (9, 208), (4, 144)]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_flex_serves_every_batch_shape_with_a_few_graphs(cpu_flex):
    """Compiled statically, flex attention recompiled for every (rows, length) of a token-budget batch until
    torch's recompile limit, then ran unfused (seen on the H200). Compiled with dynamic shapes (what
    ``train.attention._flex`` returns; forward only and without the log-sum-exp here: CPU flex has neither),
    nine batch shapes take at most four graphs and every output equals eager flex attention."""
    from torch.nn.attention.flex_attention import flex_attention

    from train import attention as ta

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(b, 4, t, 16, generator=g), torch.randn(b, 2, t, 16, generator=g),
                torch.randn(b, 2, t, 16, generator=g), ta.causal_block_mask(t, "cpu")) for b, t in BATCH_SHAPES]
    want = [flex_attention(q, k, v, block_mask=mask, enable_gqa=True) for q, k, v, mask in batches]  # (it traces too)
    compiled, before = ta._flex(), _graphs()
    for (q, k, v, mask), w in zip(batches, want, strict=True):
        torch.testing.assert_close(compiled(q, k, v, block_mask=mask, enable_gqa=True), w, rtol=1e-4, atol=1e-5)
    assert _graphs() - before <= 4 < torch._dynamo.config.recompile_limit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs CUDA")
def test_compiled_flex_takes_lengths_of_any_multiple_of_16_cuda():
    """The loop rounds batch lengths to 16 on CUDA (``train.loop.pad_multiple``): the compiled kernel, forward with
    its log-sum-exp merge and backward, equals the materialised reference at lengths that end inside a flex block,
    and the shapes share a few graphs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    compiled = 0
    for b, t in BATCH_SHAPES:
        q = torch.randn(b, 4, t, 16, device="cuda", generator=g, requires_grad=True)
        k = torch.randn(b, 2, 2 * t, 16, device="cuda", generator=g, requires_grad=True)
        v = torch.randn(b, 2, 2 * t, 16, device="cuda", generator=g, requires_grad=True)
        grads = []
        # step 0's causal keys, then the step's own keys on the diagonal (the pattern ttt_flex_attention serves)
        mask = torch.cat([causal_mask(t, 0, device="cuda"), torch.eye(t, dtype=torch.bool, device="cuda")[None, None]],
                         -1)
        for fn in (attention, ttt_flex_attention):
            before = _graphs()
            out = fn(q, k, v, mask if fn is attention else None)
            compiled += _graphs() - before if fn is ttt_flex_attention else 0
            grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
        for fast, ref in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(fast, ref, rtol=1e-3, atol=2e-4, msg=f"{b} x {t}")
    assert compiled <= 4


def test_the_ttt_step_compiles_its_soft_ce_a_few_times_for_every_batch_shape(mapped, monkeypatch):
    """The TTT step's soft-CE kernels as CUDA compiles them (``train.ttt.compiled_kernels``, dynamic), forward and
    backward over batches of 1 to 6 rows and 12 to 90 positions, 3 TTT steps each, in chunks of 16 rows so that
    a step spans one chunk or several. Slices of the teacher at each step's offset gave a graph per step (their
    storage offsets) and hit torch's recompile limit; named by row indices, the whole run takes two graphs per
    kernel (a batch of one row specialises), with the eager kernels' per-step losses and gradients."""
    import train.ttt as ttt

    monkeypatch.setattr(ttt, "CE_CHUNK_ROWS", 16)
    m = mapped
    shape = m.shape
    compiled = 0
    for k, (b, t) in enumerate([(2, 48), (3, 64), (5, 33), (1, 50), (4, 17), (6, 90), (1, 12), (2, 16)]):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, shape.vocab_size, (b, t), generator=g)
        aux = torch.randn(b, t, 3 * shape.hidden_size, generator=g)
        last = torch.randn(b, t, shape.hidden_size, generator=g)
        lm_head = torch.randn(shape.vocab_size, shape.hidden_size, generator=g) * 0.3
        rows = lm_head[m.to_target_ids(torch.arange(shape.draft_vocab_size))]
        sup = supervision(teacher_from_hidden(last, rows), (last @ lm_head.t()).argmax(-1),
                          torch.rand(b, t, generator=g) < 0.8, m.t2d)
        results = {}
        for kind in ("eager", "compiled"):
            monkeypatch.setattr(ttt, "_kernels", (lambda device: ttt.compiled_kernels()) if kind == "compiled"
                                else (lambda device: (ttt._ce_rows, ttt._ce_grad)))
            m.zero_grad()
            before = _graphs()
            res = ttt_forward(m, ids, aux, sup, N, DECAY)
            res.loss.backward()
            compiled += _graphs() - before if kind == "compiled" else 0
            grads = {n: q.grad.clone() for n, q in m.named_parameters() if q.grad is not None}
            results[kind] = (res.step_losses, grads)
        torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=1e-5, atol=1e-6)
        for name, grad in results["eager"][1].items():
            torch.testing.assert_close(results["compiled"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert compiled <= 4


def test_a_sharper_teacher_is_the_target_distribution_at_that_temperature(mapped):
    """train.teacher_temperature: the TTT step trains toward softmax(target logits / T) over the draft vocab; its
    accuracy still counts the target's argmax, which sharpening keeps."""
    m = mapped
    ids, aux, last, lm_head, mask = _batch(m.shape)
    argmax = (last @ lm_head.t()).argmax(-1)
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
    logp = teacher_from_hidden(last, rows)
    assert sharpen(logp, 1.0) is logp
    sharp = sharpen(logp, 0.5)
    torch.testing.assert_close(sharp, torch.log_softmax((last @ rows.t()) / 0.5, dim=-1))
    assert torch.equal(sharp.argmax(-1), logp.argmax(-1)) and bool((sharp.max(-1).values > logp.max(-1).values).all())
    res = {t: TTTModel(m, rows, N, DECAY, teacher_temperature=t)(ids, mask, aux, argmax, last_hidden=last)
           for t in (1.0, 0.5)}
    want = ttt_forward(m, ids, aux, supervision(sharp, argmax, mask, m.t2d), N, DECAY)
    assert float(res[0.5].loss) == pytest.approx(float(want.loss), rel=1e-6)
    assert float(res[0.5].loss) != pytest.approx(float(res[1.0].loss), rel=1e-3)
    assert torch.equal(res[0.5].correct, res[1.0].correct)  # the same drafter: the same hits


def test_lk_objectives_equal_their_definition(mapped):
    """train.loss lk_alpha / lk_lambda: each TTT step's loss from the expected acceptance sum_v min(p, q) of the
    drafter's q under the target's p on the draft vocab (draft_mass times the renormalised teacher), as defined."""
    from train.ttt import Objective, draft_mass, expected_acceptance

    m = mapped
    ids, aux, last, lm_head, mask = _batch(m.shape)
    argmax = (last @ lm_head.t()).argmax(-1)
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
    mass = draft_mass(last, rows, lm_head, chunk_rows=5)  # several chunks
    full = torch.softmax(last.double() @ lm_head.double().t(), -1)
    torch.testing.assert_close(mass.double(), full[..., m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
                               .sum(-1), rtol=1e-5, atol=1e-6)
    assert 0 < float(mass.min()) and float(mass.max()) < 1  # the draft vocab holds part of the target's mass

    sup = supervision(teacher_from_hidden(last, rows), argmax, mask, m.t2d)
    kl = ttt_forward(m, ids, aux, sup, N, DECAY)
    # the steps' alphas by hand: q from the KL run's own logits is what ttt_forward scores; compute it per step here
    probs = sup.teacher_logp.exp()
    for kind in ("lk_alpha", "lk_lambda"):
        res = ttt_forward(m, ids, aux, sup, N, DECAY, objective=Objective(kind, 1.5, 2.0), mass=mass)
        assert torch.equal(res.step_losses, kl.step_losses)  # the logged CE is the same quantity
        assert float(res.loss.detach()) != pytest.approx(float(kl.loss.detach()), rel=1e-3)
    # step 0 alone (n = 1) pins the formula: one step, decay irrelevant
    hidden = m.project_aux(aux)
    t = ids.shape[1]
    out = m.step(None, hidden, torch.arange(t)[None], mask=causal_mask(t, 0), attn_fn=attention,
                 embed_part=[p[:, :t] for p in m.embed_projections(torch.nn.functional.pad(ids[:, 1:], (0, 1)),
                                                                    hidden.dtype)])
    logits = m.logits(out.prenorm[:, : t - 1])
    weight = (sup.label & sup.in_vocab)[:, 1:].float()
    alpha = expected_acceptance(logits, probs[:, 1:] * mass[:, 1:, None])
    count = weight.sum()
    want_alpha = -(torch.log(alpha) * weight).sum() / count
    got = ttt_forward(m, ids, aux, sup, 1, DECAY, objective=Objective("lk_alpha"), mass=mass)
    assert float(got.loss) == pytest.approx(float(want_alpha), rel=1e-5)
    mean_alpha = (alpha * weight).sum() / count
    w = 1.5 * math.exp(-2.0 * float(mean_alpha))
    ce = float(got.step_losses[0])
    got = ttt_forward(m, ids, aux, sup, 1, DECAY, objective=Objective("lk_lambda", 1.5, 2.0), mass=mass)
    assert float(got.loss) == pytest.approx(w * ce + (1 - w) * (1 - float(mean_alpha)), rel=1e-5)
    with pytest.raises(ValueError, match="needs the target's mass"):
        ttt_forward(m, ids, aux, sup, N, DECAY, objective=Objective("lk_alpha"))


def test_an_lk_step_raises_the_expected_acceptance(mapped):
    """A few plain gradient steps on lk_alpha raise the mean expected acceptance of step 0's drafts on the batch."""
    from train.ttt import Objective

    m = mapped
    ids, aux, last, lm_head, mask = _batch(m.shape, seed=5)
    argmax = (last @ lm_head.t()).argmax(-1)
    rows = lm_head[m.to_target_ids(torch.arange(m.shape.draft_vocab_size))]
    model = TTTModel(m, rows, 1, DECAY, objective=Objective("lk_alpha"), lm_head=lm_head)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(4):
        res = model(ids, mask, aux, argmax, last_hidden=last)
        losses.append(float(res.loss))
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    assert losses[-1] < losses[0], losses  # -mean log alpha falls: alpha rises
    with pytest.raises(ValueError, match="needs the target's last hidden state and lm_head"):
        TTTModel(m, rows, 1, DECAY, objective=Objective("lk_lambda"))
