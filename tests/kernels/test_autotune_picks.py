"""``triton_mods.autotune_picks``: the fused forward's autotuned configs, as the GPU benchmark records them."""
import json

import pytest

from loka_trainer.kernels.triton_mods import autotune_picks


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
