"""``CompileSwitch`` traces with no duck sizing: sizes that are equal at the first call (3 rows and 3 features) get
symbols of their own, so later sizes reuse the one graph instead of compiling again (seconds each on an H200)."""

from __future__ import annotations

import torch

from common.compile_guard import CompileSwitch, compile_seconds


def test_sizes_equal_at_the_first_call_do_not_make_a_second_graph() -> None:
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    torch._dynamo.reset()
    compiled = torch.compile(project, dynamic=True, backend=counting)
    switch = CompileSwitch("the test's projection")
    for rows in (3, 5, 4, 7):  # the first call's rows equal both of w's sizes' first, and x's second
        x, w = torch.ones(rows, 3), torch.ones(3, 3 if rows == 3 else 4)
        out = switch.run(lambda x=x, w=w: compiled(x, w), lambda x=x, w=w: project(x, w))
        assert torch.equal(out, project(x, w))  # exact: sums of three ones
    assert switch.state == "compiled" and len(graphs) == 1


def test_compile_seconds_grows_with_a_compile() -> None:
    before = sum(compile_seconds(top=100).values())
    torch.compile(lambda x: torch.sin(x) * 3 + 1, backend="eager")(torch.randn(5))
    after = compile_seconds(top=100)
    assert after and sum(after.values()) > before
