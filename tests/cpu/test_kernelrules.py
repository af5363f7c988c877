"""kernelrules: the kernel families SAVE refuses, matched by the names the reference host's graphs held."""

from __future__ import annotations

import pytest

from graphpersist import kernelrules

# Kernel names from the size-8 piecewise graphs of vLLM's Qwen3-8B at TP=1 and from recipes/runtime-single-gpu at
# 36x4096 (2026-12-01): the split-K GEMMs and their reduction, and their neighbours that LOAD replays exactly.
SPLIT_K = [
    "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT",
    "nvjet_sm90_tst_128x8_64x12_4x1_v_bz_splitK_TNT",
    "nvjet_sm90_tst_64x32_64x16_2x1_v_bz_splitK_NNT",
    "_ZN8cublasLt19splitKreduce_kernelILi32ELi16Eif13__nv_bfloat16fS1_Lb0EfS1_S1_Lb1ELb0ELb0ELb0EEEvNS_18cublasSplitKPa"
    "ramsIT4_EEPKT2_PKT8_PT7_PT3_PKS3_SG_PKT9_S7_PSH_PvlPS3_PiSM_SM_SG_SG_SG_SG_SG_",
]
REPLAYED_EXACTLY = [
    "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT",
    "nvjet_sm90_tst_256x8_64x6_4x1_v_bz_TNT",
    "nvjet_sm90_tst_64x32_64x16_1x2_h_bz_NNT",
    "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_NNT",
    "triton_red_fused_fused_add_rms_norm_0",
    "_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_7MeanOpsIffffEEjfLi4ELi4EEEEEvT1_",
]


@pytest.mark.parametrize("name", SPLIT_K)
def test_split_k_kernels_are_refused_with_the_reason(name: str) -> None:
    why = kernelrules.unrestorable(name)
    assert why is not None and "split-K GEMM" in why and "SPLITK.md" in why and "SAVE refused" in why, why


@pytest.mark.parametrize("name", REPLAYED_EXACTLY)
def test_kernels_without_a_rule_pass(name: str) -> None:
    assert kernelrules.unrestorable(name) is None


def test_the_split_k_word_alone_is_not_enough() -> None:
    """Only cuBLASLt's own kernels: a kernel of another library that happens to say splitK is not named."""
    assert kernelrules.unrestorable("my_splitK_helper") is None
    assert kernelrules.unrestorable("triton_poi_splitK_0") is None


def test_the_diagnosis_switch_lifts_the_rules_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(kernelrules.DIAG_ALLOW, "1")
    assert kernelrules.unrestorable(SPLIT_K[0]) is None
    assert "WARNING: GP_DIAG_ALLOW_UNRESTORABLE=1" in capsys.readouterr().err
    monkeypatch.setenv(kernelrules.DIAG_ALLOW, "0")
    assert kernelrules.unrestorable(SPLIT_K[0]) is not None
