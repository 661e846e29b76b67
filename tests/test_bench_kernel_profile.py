"""bench/kernel_profile.py's reading aids: real kernel names (Inductor's fused Triton kernels, cuBLAS/nvjet GEMMs,
ATen's fused AdamW and copy kernels) land in the class a reader of a profile expects, first match winning, and
``summarize`` adds up, ranks, cuts names and keeps each kernel's launches per step as recorded. A wrong class would
mislabel where a step's time goes."""

from __future__ import annotations

import pytest
import torch

from bench.kernel_profile import kernel_class, kernel_times, summarize

ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::_fused_adam::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, "
        "bool*, bool*>(long, int, at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, ...)")
COPY = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::"
        "operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)")


@pytest.mark.parametrize("name, cls", [
    ("triton_tem_fused_flex_attention_0", "attention"),
    ("triton_tem_fused_flex_attention_backward_1", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    (ADAM, "optimizer"),
    ("triton_red_fused__log_softmax__to_copy_1", "cross_entropy"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3", "norm"),
    (COPY, "cast_or_copy"),
    ("triton_poi_fused__to_copy_2", "cast_or_copy"),
    ("Memcpy DtoD (Device -> Device)", "cast_or_copy"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>(long, ...)",
     "gather_scatter"),
    ("Memset (Device)", "memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)", "memset"),
    ("triton_red_fused_sum_4", "reduction"),
    ("triton_poi_fused_mul_silu_0", "elementwise_other"),
])
def test_kernel_names_land_in_their_class(name: str, cls: str) -> None:
    assert kernel_class(name) == cls


def test_summarize_adds_up_ranks_and_cuts_names() -> None:
    long_gemm = "sm90_xmma_gemm_" + "x" * 300
    times = {"triton_poi_fused_mul_silu_0": (0.5, 7.0), long_gemm: (3.0, 14.0),
             "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": (2.0, 1.0), "triton_tem_fused_flex_attention_0": (1.25, 7.0),
             "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": (0.1234, 3.5)}
    s = summarize(times, top=3)
    assert s["profiled"] is True and s["kernels"] == 5
    assert s["kernel_ms"] == pytest.approx(6.873)
    assert s["by_class_ms"] == {"gemm": 5.0, "attention": 1.25, "elementwise_other": 0.5, "norm": 0.123}
    assert list(s["by_class_ms"]) == ["gemm", "attention", "elementwise_other", "norm"]  # largest first
    assert [k["ms"] for k in s["top_kernels"]] == [3.0, 2.0, 1.25]
    first = s["top_kernels"][0]
    assert first["name"] == long_gemm[:200] and len(first["name"]) == 200 and first["class"] == "gemm"
    assert first["calls"] == 14.0
    assert s["top_kernels"][2] == {"name": "triton_tem_fused_flex_attention_0", "class": "attention", "ms": 1.25,
                                   "calls": 7.0}


def test_nothing_profiled_says_so() -> None:
    assert summarize({}) == {"kernel_ms": 0, "kernels": 0, "by_class_ms": {}, "top_kernels": [], "profiled": False}


def test_on_a_cpu_the_step_runs_and_no_kernels_are_timed(monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    calls = []
    assert kernel_times(lambda: calls.append(1), 3) == {}
    assert len(calls) == 3


def test_host_times_names_the_ops_a_step_runs_and_their_calls_per_step() -> None:
    from bench.kernel_profile import host_times

    a = torch.randn(64, 64)

    def step() -> None:
        for _ in range(3):
            torch.mm(a, a)
        torch.add(a, 1)

    got = host_times(step, 2, top=50)
    calls = {row["name"]: row["calls"] for row in got["host_top"]}
    assert calls["aten::mm"] == 3 and calls["aten::add"] == 1
    rounding = 0.0005 * (len(got["host_top"]) + 1)  # each figure is rounded to 3 places, the total once
    assert got["host_profiled_ms"] >= sum(row["self_ms"] for row in got["host_top"]) - rounding
    assert got["launches"] == 0  # no CUDA here
