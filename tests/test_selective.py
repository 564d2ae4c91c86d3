"""The LCSB core against autograd references, on a toy residual stack (torch only, like the core)."""

import pytest
import torch
from torch import nn

from lcsb_cli.selective import (
    BlockSchedule,
    IdleMomentum,
    SelectiveLayers,
    forget_moments,
    gradient_shares,
    partition,
    rate_scales,
    surrogate_agreement,
)


class ToyLayer(nn.Module):
    """A residual layer with a frozen base product and a trainable low-rank adapter, like a LoRA'd block."""

    def __init__(self, width: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.up.weight, std=0.5)

    def forward(self, hidden):
        return hidden + torch.tanh(self.base(hidden) + self.up(self.down(hidden)))


def make_stack(num_layers=6, width=8, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(ToyLayer(width) for _ in range(num_layers))


def run(layers, x):
    for layer in layers:
        x = layer(x)
    return (x**2).mean()


def grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def test_partition_contiguous_and_balanced():
    blocks = partition(10, 4)
    assert [list(b) for b in blocks] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert partition(4, 1) == [range(0, 4)]
    with pytest.raises(ValueError):
        partition(4, 5)


@pytest.mark.parametrize("kind,expected", [("cyclic", [0, 1, 2, 0, 1, 2]), ("reverse", [2, 1, 0, 2, 1, 0])])
def test_deterministic_schedules(kind, expected):
    schedule = BlockSchedule(3, kind)
    assert [schedule.next_block() for _ in range(6)] == expected


def test_random_schedule_visits_every_block_each_cycle_and_resumes_exactly():
    schedule = BlockSchedule(4, "random", seed=3)
    first = [schedule.next_block() for _ in range(6)]
    assert sorted(first[:4]) == [0, 1, 2, 3]
    saved = schedule.state_dict()
    rest = [schedule.next_block() for _ in range(9)]
    resumed = BlockSchedule(4, "random", seed=99)
    resumed.load_state_dict(saved)
    assert [resumed.next_block() for _ in range(9)] == rest


@pytest.mark.parametrize("kind", ["cyclic", "random", "adaptive"])
def test_a_block_stays_for_switch_every_steps_and_resumes_mid_turn(kind):
    plain, held = BlockSchedule(4, kind, seed=5), BlockSchedule(4, kind, seed=5, switch_every=3)
    turns = [plain.next_block() for _ in range(6)]
    steps = [held.next_block() for _ in range(10)]
    assert steps == [block for block in turns for _ in range(3)][:10]
    saved = held.state_dict()
    rest = [held.next_block() for _ in range(8)]
    resumed = BlockSchedule(4, kind, seed=99, switch_every=3)
    resumed.load_state_dict(saved)
    assert [resumed.next_block() for _ in range(8)] == rest


def test_rate_scales_give_back_what_idle_steps_lose():
    assert rate_scales(gradient_shares(4, "exact"), "sqrt_k") == [2.0] * 4
    assert rate_scales(gradient_shares(4, "identity"), "k") == [4.0] * 4
    assert rate_scales(gradient_shares(4, "suffix"), "k") == [4.0, 2.0, 4 / 3, 1.0]
    assert rate_scales(gradient_shares(3, "suffix"), "none") == [1.0] * 3


def test_sqrt_k_rate_moves_an_idle_cycled_parameter_as_far_as_full_backprop():
    """A steady gradient on 1 step in 4 with idle momentum: over 200 steps the parameter travels 1/2 as far as one
    that gets the gradient every step, and as far once its rate is doubled (within 5%)."""

    def travel(every: int, lr: float) -> float:
        p = nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
        idle = IdleMomentum(optimizer, [[p], []])
        for step in range(200):
            if step % every == 0:
                p.grad = torch.ones(1)
            idle.before_step(0 if step % every == 0 else 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return -float(p.detach())

    full = travel(1, 1e-3)
    assert travel(4, 1e-3) / full == pytest.approx(0.5, rel=0.05)
    assert travel(4, 1e-3 * rate_scales(gradient_shares(4, "exact"), "sqrt_k")[0]) / full == pytest.approx(
        1.0, rel=0.05
    )


def test_forgotten_moments_restart_adamw_for_that_block_only():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([a, b], lr=0.1)
    for _ in range(2):
        a.grad, b.grad = torch.ones(2), torch.ones(2)
        optimizer.step()
    forget_moments(optimizer, [a])
    assert a not in optimizer.state and int(optimizer.state[b]["step"]) == 2


def test_suffix_path_trains_every_layer_from_the_active_block_up_with_true_gradients():
    layers = make_stack()
    trainable = [p for p in layers.parameters() if p.requires_grad]
    run(layers, X).backward()
    reference = grads(trainable)
    layers.zero_grad(set_to_none=True)
    blocks = partition(6, 3)
    selective = SelectiveLayers(layers, blocks, "suffix")
    for block in range(3):
        selective.activate(block)
        run(layers, X).backward()
        trained = {id(p) for b in range(block, 3) for p in selective.block_parameters(b)}
        for p, ref in zip(trainable, reference):
            if id(p) in trained:
                torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
            else:
                assert p.grad is None
        layers.zero_grad(set_to_none=True)


def test_forward_value_is_the_same_whatever_block_or_path():
    layers = make_stack()
    reference = run(layers, X)
    for upper in ("identity", "exact", "suffix"):
        selective = SelectiveLayers(layers, partition(6, 3), upper)
        for block in range(3):
            selective.activate(block)
            assert torch.equal(run(layers, X), reference)
        selective.remove()


def test_exact_upper_path_gives_the_true_gradient_of_the_active_block():
    layers = make_stack()
    trainable = [p for p in layers.parameters() if p.requires_grad]
    run(layers, X).backward()
    reference = grads(trainable)
    layers.zero_grad(set_to_none=True)
    selective = SelectiveLayers(layers, partition(6, 3), "exact")
    for block in range(3):
        selective.activate(block)
        run(layers, X).backward()
        active = set(map(id, selective.block_parameters(block)))
        for p, ref in zip(trainable, reference):
            if id(p) in active:
                torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
            else:
                assert p.grad is None
        layers.zero_grad(set_to_none=True)


def surrogate_reference(layers, blocks, block: int, exact_above: int):
    """The active block's gradient written out by hand: below no grad, the block and the `exact_above` layers just
    above it with autograd, every layer beyond h + (f(h) - h).detach()."""
    h = X
    active = blocks[block]
    for i, layer in enumerate(layers):
        if i < active.start:
            with torch.no_grad():
                h = layer(h)
        elif i < active.stop + exact_above:
            h = layer(h)
        else:
            h = h + (layer(h) - h).detach()
    params = [p for i in active for p in layers[i].parameters() if p.requires_grad]
    return torch.autograd.grad((h**2).mean(), params)


@pytest.mark.parametrize("exact_above", [0, 1, 3, 4])
def test_exact_above_backpropagates_through_that_many_layers_then_identity(exact_above):
    layers = make_stack()
    blocks = partition(6, 3)
    trainable = [p for p in layers.parameters() if p.requires_grad]
    selective = SelectiveLayers(layers, blocks, "identity", exact_above=exact_above)
    results = {}
    for block in range(3):
        selective.activate(block)
        run(layers, X).backward()
        active = selective.block_parameters(block)
        assert all(p.grad is None for p in trainable if all(p is not q for q in active))
        results[block] = [p.grad.clone() for p in active]
        layers.zero_grad(set_to_none=True)
    selective.remove()
    assert all(p.requires_grad for p in trainable)
    for block, got in results.items():
        want = surrogate_reference(layers, blocks, block, exact_above)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    # block 0 gets the true gradient once all 4 layers above it backpropagate exactly, and only then
    truth = make_stack()
    run(truth, X).backward()
    true_block0 = [p.grad for i in blocks[0] for p in truth[i].parameters() if p.requires_grad]
    matches = all(torch.allclose(g, t, rtol=1e-5, atol=1e-7) for g, t in zip(results[0], true_block0))
    assert matches == (exact_above >= 4)


def test_identity_upper_path_is_the_straight_through_gradient():
    layers = make_stack()
    trainable = [p for p in layers.parameters() if p.requires_grad]
    blocks = partition(6, 3)
    selective = SelectiveLayers(layers, blocks, "identity")
    selective.activate(1)
    run(layers, X).backward()
    got = grads(trainable)
    selective.remove()
    layers.zero_grad(set_to_none=True)

    # Reference written out by hand: below no grad, active block with grad, above h + (f(h) - h).detach().
    h = X
    with torch.no_grad():
        for i in blocks[0]:
            h = layers[i](h)
    for i in blocks[1]:
        h = layers[i](h)
    for i in blocks[2]:
        h = h + (layers[i](h) - h).detach()
    (h**2).mean().backward()
    active = set(map(id, [p for i in blocks[1] for p in layers[i].parameters() if p.requires_grad]))
    for p, g in zip(trainable, got):
        if id(p) in active:
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
            assert g.abs().sum() > 0
        else:
            assert g is None
    # The surrogate is not the true gradient: the layers above are nonlinear.
    truth = make_stack()
    run(truth, X).backward()
    index = next(i for i, p in enumerate(trainable) if p is layers[2].up.weight)
    assert not torch.allclose(got[index], truth[2].up.weight.grad)


@pytest.mark.parametrize("upper_path", ["identity", "exact", "suffix"])
def test_checkpointing_gives_identical_gradients(upper_path):
    plain, ckpt = make_stack(), make_stack()
    for layers, flag in ((plain, False), (ckpt, True)):
        selective = SelectiveLayers(layers, partition(6, 3), upper_path, checkpoint=flag)
        selective.activate(0)
        run(layers, X).backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)


def test_idle_momentum_is_adamw_on_a_zero_gradient():
    lr, wd, (b1, b2), eps = 0.1, 0.01, (0.9, 0.999), 1e-8
    active, idle = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([active, idle], lr=lr, weight_decay=wd, betas=(b1, b2), eps=eps)
    rule = IdleMomentum(optimizer, [[active], [idle]])
    g = torch.tensor([0.5, -1.0, 2.0])
    active.grad, idle.grad = g.clone(), g.clone()
    # both get moments
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    m, v, before = (
        optimizer.state[idle]["exp_avg"].clone(),
        optimizer.state[idle]["exp_avg_sq"].clone(),
        idle.detach().clone(),
    )

    active.grad = g.clone()
    rule.before_step(active=0)
    optimizer.step()
    s = 2
    m, v = b1 * m, b2 * v
    expected = before * (1 - lr * wd) - lr * (m / (1 - b1**s)) / ((v / (1 - b2**s)).sqrt() + eps)
    torch.testing.assert_close(idle.detach(), expected)
    assert not torch.equal(idle.detach(), before)


def test_idle_parameters_without_moments_are_untouched():
    active, never = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([active, never], lr=0.1)
    before = never.detach().clone()
    active.grad = torch.ones(3)
    IdleMomentum(optimizer, [[active], [never]]).before_step(active=0)
    optimizer.step()
    assert torch.equal(never.detach(), before) and never not in optimizer.state


def test_surrogate_agreement_measures_each_window_against_the_true_gradient():
    layers = make_stack()
    blocks = partition(6, 3)
    agreement = surrogate_agreement(layers, blocks, lambda: run(layers, X), [0, 1, 4])
    truth = make_stack()
    run(truth, X).backward()
    for block in range(3):
        true = torch.cat([p.grad.flatten() for i in blocks[block] for p in truth[i].parameters() if p.requires_grad])
        for window in (0, 1, 4):
            got = torch.cat([g.flatten() for g in surrogate_reference(layers, blocks, block, window)])
            cosine, ratio = agreement[block, window]
            assert cosine == pytest.approx(float(torch.nn.functional.cosine_similarity(got, true, dim=0)), abs=1e-6)
            assert ratio == pytest.approx(float(got.norm() / true.norm()), rel=1e-5)
    assert agreement[2, 0] == pytest.approx((1.0, 1.0)) and agreement[0, 4] == pytest.approx((1.0, 1.0))
    assert agreement[0, 0][0] < 0.999
    # restored
    assert all(layer.down.weight.requires_grad and layer.up.weight.requires_grad for layer in layers)
