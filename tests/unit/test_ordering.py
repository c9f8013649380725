"""The pieces that make a layout change nothing: random streams, ordered gradients and ordered buffer updates,
driven by hand in the order a pipeline stage might run them."""

from __future__ import annotations

import threading

import torch
from torch import nn

from lightning_mp.pipeline._grads import OrderedGradients
from lightning_mp.pipeline._rng import MicrobatchRNG, draws_no_random_numbers
from lightning_mp.pipeline._state import OrderedStateUpdates


def test_a_keyed_call_draws_its_own_stream_and_the_caller_continues():
    rng = MicrobatchRNG(seed=3)
    torch.manual_seed(0)
    rng.start_step(("training_step", 0))
    rng.resume("task", microbatch=1, name="forward:step")
    before = torch.rand(2)
    rng.enter(1, "block")
    inside = torch.rand(3)
    rng.exit()
    after = torch.rand(2)

    rng.start_step(("training_step", 0))  # same step again: same numbers, without the call in between
    rng.resume("task2", microbatch=1, name="forward:step")
    assert torch.equal(torch.rand(2), before)
    assert torch.equal(torch.rand(2), after), "a keyed call does not move its caller's stream"
    rng.enter(1, "block")
    assert torch.equal(torch.rand(3), inside), "the same call of the same step draws the same numbers"
    rng.exit()
    rng.enter(1, "block")
    assert not torch.equal(torch.rand(3), inside), "the second call of a module draws a new stream"
    rng.exit()
    rng.enter(1, "block", recompute=True)
    assert torch.equal(torch.rand(3), inside), "the first recompute draws what the first forward call drew"
    rng.exit()
    rng.end_step()


def test_only_calls_that_cannot_draw_random_numbers_go_unkeyed():
    """See [Note: calls that draw no random numbers]: exact deterministic torch.nn classes only."""

    class MyLinear(nn.Linear):  # a subclass may override forward (here it does not, and still counts as unknown)
        pass

    assert draws_no_random_numbers(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4), nn.BatchNorm1d(4)))
    assert not draws_no_random_numbers(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
    assert not draws_no_random_numbers(nn.RReLU())  # draws its slopes in training
    assert not draws_no_random_numbers(nn.TransformerEncoderLayer(4, 1))  # dropout inside
    assert not draws_no_random_numbers(MyLinear(4, 4))
    patched = nn.Linear(4, 4)
    patched.forward = lambda x: x + torch.randn_like(x)
    assert not draws_no_random_numbers(nn.Sequential(patched))
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda m, args, out: out + torch.rand_like(out))
    assert not draws_no_random_numbers(hooked)
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        assert not draws_no_random_numbers(nn.Linear(4, 4)), "a global forward hook may draw"
    finally:
        handle.remove()
    assert draws_no_random_numbers(nn.Linear(4, 4))


def test_recomputes_in_reverse_order_draw_the_forward_calls_they_repeat():
    """A checkpointed block run twice per microbatch: backward recomputes its second call first."""
    rng = MicrobatchRNG(seed=3)
    rng.start_step(("training_step", 0))
    drawn, regions = [], []
    for _ in range(2):  # forward: the block's call, then its keyed child's (a dropout in a Sequential)
        rng.enter(0, "block")
        regions.append(torch.get_rng_state())  # what the checkpoint saves and restores for the recompute
        rng.enter(0, "block.ff.2")
        drawn.append(torch.rand(3))
        rng.exit()
        rng.exit()
    for index in (1, 0):  # backward: the second call's recompute first
        torch.set_rng_state(regions[index])
        rng.enter(0, "block.ff.2", recompute=True)
        assert torch.equal(torch.rand(3), drawn[index]), index
        rng.exit()
    rng.end_step()


def test_outside_a_step_the_generator_is_left_as_the_step_found_it():
    rng = MicrobatchRNG(seed=3)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    rng.start_step("s")
    rng.resume("t", 0, "forward:step")
    torch.rand(100)
    rng.end_step()
    assert torch.equal(torch.rand(4), expected)


def test_a_suspended_task_resumes_its_stream_after_another_ran():
    rng = MicrobatchRNG(seed=1)
    rng.start_step("s")
    rng.resume("a", 0, "forward:step")
    first = torch.rand(2)
    rng.start_step("s")
    rng.resume("a", 0, "forward:step")
    torch.rand(1)
    rng.suspend("a")
    rng.resume("b", 1, "forward:step")  # another task draws meanwhile
    torch.rand(10)
    rng.suspend("b")
    rng.resume("a", 0, "forward:step")
    assert torch.equal(torch.rand(1), first[1:]), "task a goes on where it stopped"
    rng.end_step()


def test_gradients_are_summed_in_microbatch_order_whatever_order_backward_ran():
    torch.manual_seed(0)
    grads = [torch.randn(64) * 10 ** k for k in range(4)]  # magnitudes that make the summation order visible

    def accumulate(order: list[int]) -> torch.Tensor:
        param = nn.Parameter(torch.zeros(64))
        current = threading.local()
        ordered = OrderedGradients(lambda: getattr(current, "mb", None))
        ordered.register([param])
        ordered.start_step()
        for mb in order:
            current.mb = mb
            (param * grads[mb]).sum().backward()
        ordered.end_step()
        return param.grad

    in_order = accumulate([0, 1, 2, 3])
    plain = torch.zeros(64)
    for g in grads:
        plain = plain + g
    assert torch.equal(in_order, plain)
    for order in ([3, 2, 1, 0], [0, 2, 1, 3], [1, 3, 0, 2], [0, 2, 3]):
        expected = torch.zeros(64)
        for mb in sorted(order):
            expected = expected + grads[mb]
        assert torch.equal(accumulate(order), expected), order


def test_several_backwards_of_one_microbatch_sum_alike_whatever_the_interleaving():
    """A remote module called twice in a microbatch reaches its parameters in two backwards (call 2's, then call
    1's); other microbatches' backwards may come in between. Every interleaving that keeps each microbatch's own order
    gives the same bits: the first contributions in microbatch order, then the others, microbatch by microbatch."""
    torch.manual_seed(0)
    grads = {(mb, k): torch.randn(64) * 10 ** (mb + 2 * k) for mb in range(3) for k in range(2)}

    def accumulate(order: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        param = nn.Parameter(torch.zeros(64))
        current = threading.local()
        ordered = OrderedGradients(lambda: getattr(current, "mb", None))
        ordered.register([param])
        summed = []
        ordered.report([param], lambda p, n: summed.append(n))
        ordered.start_step()
        for mb, k in order:
            current.mb = mb
            (param * grads[(mb, k)]).sum().backward()
        ordered.end_step()
        return param.grad, summed

    expected = torch.zeros(64)
    for key in [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]:
        expected = expected + grads[key]
    chained, summed = accumulate([(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])
    assert torch.equal(chained, expected)
    # what the dp reducer is told: once microbatch 0's second backward is kept aside, no microbatch counts as whole in
    # .grad (the step's end adds it, then the reducer's flush sends the parameter)
    assert summed == [1, 0, 0, 0, 0, 0]
    for order in (
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)],
        [(1, 0), (2, 0), (0, 0), (1, 1), (2, 1), (0, 1)],
        [(0, 0), (1, 0), (0, 1), (2, 0), (2, 1), (1, 1)],
    ):
        assert torch.equal(accumulate(order)[0], expected), order


def test_buffer_updates_are_replayed_in_microbatch_order():
    torch.manual_seed(0)
    inputs = [torch.randn(6, 3) * (k + 1) + k for k in range(3)]
    reference = nn.BatchNorm1d(3)
    for x in inputs:
        reference(x)

    bn = nn.BatchNorm1d(3)
    updates = OrderedStateUpdates()
    updates.start_step()
    for mb in (2, 0, 1):  # the forwards ran out of order
        snapshot = updates.before(bn)
        bn(inputs[mb])
        updates.after(bn, snapshot, mb, (inputs[mb],), {})
    assert torch.equal(bn.running_mean, torch.zeros(3)), "each call's update is undone until its turn"
    updates.finalize(1)
    assert torch.equal(bn.running_mean, torch.zeros(3)), "microbatch 1 waits for microbatch 0"
    updates.finalize(0)
    updates.end_step()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(bn, name), getattr(reference, name)), name
