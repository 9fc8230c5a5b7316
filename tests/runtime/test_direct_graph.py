"""``DirectCalls``: a compiled step's graph called without dynamo once dynamo has called it for a cache."""

import torch

from lmpress.runtime.direct_graph import DirectCalls, RecordingBackend

PARAMS = ("model", "x", "cache", "pos")
NO_CPP = {"cpp_wrapper": False}  # the Python wrapper: these graphs compile in seconds


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 8))


def write_and_read(model, x, cache, pos):
    """A decode step's shape: write a row into the cache in place, read the filled cache."""
    cache.index_copy_(0, pos, model.proj(x) * model.gain)
    return (cache[: pos[0] + 1] * model.gain).sum(0, keepdim=True)


def direct(step, fixed=("model",)) -> DirectCalls:
    compiled = torch.compile(step, fullgraph=True, backend=RecordingBackend(NO_CPP), dynamic=False)
    return DirectCalls(compiled, PARAMS, fixed)


def run(calls, model, cache, steps, signature="one row"):
    outs = []
    for i in range(steps):
        x = torch.randn(1, 8, generator=torch.Generator().manual_seed(i))
        pos = torch.tensor([i])
        outs.append(calls(cache[0] if isinstance(cache, list) else cache, signature, model, x, cache, pos))
    return outs


def test_after_dynamos_first_call_the_graph_runs_directly_with_eagers_results_and_cache_writes():
    model = Tiny()
    calls = direct(write_and_read)
    cache, eager_cache = torch.zeros(6, 8), torch.zeros(6, 8)
    with torch.no_grad():
        got = run(calls, model, cache, 6)
        want = [
            write_and_read(
                model, torch.randn(1, 8, generator=torch.Generator().manual_seed(i)), eager_cache, torch.tensor([i])
            )
            for i in range(6)
        ]
    assert calls.direct == 5  # every call after the first
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(cache, eager_cache)


def test_a_new_cache_or_signature_goes_through_dynamo_again_then_directly():
    model = Tiny()
    calls = direct(write_and_read)
    with torch.no_grad():
        run(calls, model, torch.zeros(6, 8), 3)
        assert calls.direct == 2
        bigger = torch.zeros(9, 8)  # another anchor, another size: dynamo recompiles, then the new graph is bound
        got = run(calls, model, bigger, 9)
        assert calls.direct == 2 + 8
        eager = torch.zeros(9, 8)
        want = run(write_and_read_named, model, eager, 9)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        run(calls, model, bigger.zero_(), 2, signature="another")  # one binding per signature
        assert calls.direct == 2 + 8 + 1 and len(calls.bindings) == 2


def write_and_read_named(anchor, signature, model, x, cache, pos):
    return write_and_read(model, x, cache, pos)


def test_the_model_held_fixed_is_read_as_it_is_now():
    """The fixed inputs are the model's own tensors, not copies: a weight changed in place is seen."""
    model = Tiny()
    calls = direct(write_and_read)
    with torch.no_grad():
        run(calls, model, torch.zeros(4, 8), 2)
        model.gain.mul_(3)
        x, pos = torch.ones(1, 8), torch.tensor([2])
        cache, eager_cache = torch.zeros(4, 8), torch.zeros(4, 8)
        got = calls(cache, "one row", model, x, cache, pos)  # a new anchor: through dynamo
        got = calls(cache, "one row", model, x, cache, pos + 1)
        write_and_read(model, x, eager_cache, pos)
        torch.testing.assert_close(got, write_and_read(model, x, eager_cache, pos + 1))
    assert calls.direct == 2


def returns_a_count_too(model, x, cache, pos):
    cache.index_copy_(0, pos, model.proj(x))
    return cache.sum(0), 3


SCALE = torch.tensor(2.0)


def reads_a_global(model, x, cache, pos):
    cache.index_copy_(0, pos, model.proj(x) * SCALE)
    return cache.sum(0)


def test_a_step_a_direct_call_could_not_repeat_stays_with_dynamo():
    """A result that is not only graph outputs (a Python value beside them) or an input read from outside the
    arguments (a global) is left to dynamo at every call, with its results."""
    model = Tiny()
    for step in (returns_a_count_too, reads_a_global):
        calls = direct(step)
        cache, eager_cache = torch.zeros(4, 8), torch.zeros(4, 8)
        with torch.no_grad():
            got = run(calls, model, cache, 4)
            want = run(lambda a, s, *args, step=step: step(*args), model, eager_cache, 4)
        assert calls.direct == 0 and not calls.bindings
        assert str(got) == str(want)
        torch.testing.assert_close(cache, eager_cache)


def returns_its_cache(model, x, cache, pos):
    cache.index_copy_(0, pos, model.proj(x))
    return cache


def test_a_step_returning_its_cache_returns_that_cache_when_called_directly():
    model = Tiny()
    calls = direct(returns_its_cache)
    cache = torch.zeros(4, 8)
    with torch.no_grad():
        got = run(calls, model, cache, 4)
    assert calls.direct == 3 and all(out is cache for out in got)


def test_an_uncompiled_step_is_called_as_it_is():
    model = Tiny()
    calls = DirectCalls(write_and_read, PARAMS, ("model",))
    cache = torch.zeros(4, 8)
    with torch.no_grad():
        run(calls, model, cache, 3)
    assert calls.direct == 0 and cache[:3].abs().sum() > 0
