"""``triton_mods.autotune_picks``: the fused forward's autotuned configs, as the GPU benchmark records them."""
import json

import pytest

from loka_trainer.mods.triton_mods import autotune_picks


def test_each_tuned_key_is_named_and_its_config_kept():
    triton = pytest.importorskip("triton")

    class TunedKernel:  # what triton.autotune leaves on the kernel: key names, key tuple -> winning Config
        keys = ["M", "N", "K", "SPLIT_K"]
        cache = {(1024, 256, 7680, 8, "torch.bfloat16", "torch.bfloat16"):
                 triton.Config({"BLOCK_M": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
                 (1024, 2048, 4096, 1, "torch.float8_e4m3fn", "torch.float8_e4m3fn"):
                 triton.Config({"BLOCK_M": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3)}

    picks = autotune_picks(TunedKernel())
    assert [p["key"]["K"] for p in picks] == [7680, 4096] and picks[0]["key"]["SPLIT_K"] == 8
    assert picks[1]["key"]["dtypes"] == ["torch.float8_e4m3fn"] * 2
    assert picks[0]["config"]["BLOCK_K"] == 128 and picks[1]["config"]["num_warps"] == 8
    assert json.loads(json.dumps(picks)) == picks  # goes into the benchmark's JSON as is


def test_nothing_tuned_nothing_reported():
    class Untuned:
        keys, cache = ["M"], {}
    assert autotune_picks(Untuned()) == []


def test_short_k_forward_is_tuned_by_graph_replay_and_reported_with_the_rest():
    """K <= REPLAY_TUNED_MAX_K: the forward's configs are ranked by graph replay (its autotuner's do_bench), longer
    K by Triton's eager benchmarker; both autotuners wrap the same kernel, and the picks of both are reported."""
    triton = pytest.importorskip("triton")
    from loka_trainer.kernels.triton_autotune import graph_replay_bench
    from loka_trainer.mods import triton_mods
    short = triton_mods._forward_kernel(triton_mods.REPLAY_TUNED_MAX_K)
    long = triton_mods._forward_kernel(2 * triton_mods.REPLAY_TUNED_MAX_K)
    assert short is not long and short.fn is long.fn and short.fn.__name__ == "fused_fwd_kernel"
    # what triton.autotune(do_bench=...) stores (its do_bench property would start a GPU driver)
    assert short._do_bench is graph_replay_bench and long._do_bench is None
    assert short.keys == long.keys and "K" in short.keys
    key = (1024, 256, 256, False, False, True, 1, "torch.bfloat16", "torch.bfloat16")
    short.cache[key] = triton.Config({"BLOCK_M": 16, "BLOCK_K": 128}, num_warps=4, num_stages=4)
    try:
        assert any(p["key"]["K"] == 256 and p["config"]["BLOCK_M"] == 16 for p in autotune_picks())
    finally:
        del short.cache[key]
