"""scripts/fp8_layer_sensitivity refuses a --batch at which the backend cannot run the per-example Linears in FP8
(they would fall back to BF16 and report 0 error), before any model is built or file written."""
from __future__ import annotations

import pytest

from scripts import fp8_layer_sensitivity as sens


def test_an_unaligned_batch_is_refused_and_nothing_written(tmp_path, capsys):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as stop:
        sens.main(["--out", str(out), "--model", "dlrm", "--batch", "30", "--batches", "1"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "error: --batch 30: --backend scaled_mm_rowwise runs a GEMM in FP8 only when" in last
    assert "multiple of 16" in last and "e.g. 32" in last
    assert list(tmp_path.iterdir()) == []


def test_the_multiple_is_the_backends():
    assert sens.unaligned_batch(64, "scaled_mm_rowwise") is None
    assert sens.unaligned_batch(30, "bf16") is None
    assert "multiple of 128, e.g. 128" in sens.unaligned_batch(64, "triton_block1x128")


def test_an_aligned_batch_reaches_the_data_config(tmp_path):
    _, _, data_cfg = sens.parse_args(["--out", str(tmp_path / "x.json"), "--model", "dlrm", "--batch", "32"])
    assert data_cfg.batch_size == 32
