"""The Probe callback's checkpointed state: a resume continues the statistics as the uninterrupted run would, and a
state saved under other Probe settings is refused with the layer named."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.probe import ProbeCallback, check_saved_state
from loka_trainer.callbacks.probe_config import to_probe_config
from loka_trainer.probe.stats_io import load_stats
from tests.probe.test_callback_probe import ROWS, Tower, run_plain_loop


def test_checkpoint_round_trip_resumes_statistics(tmp_path):
    first = ProbeCallback(interval=1, save_interval=100, out_dir=str(tmp_path / "a"), tensorboard=False)
    run_plain_loop(first, steps=3)
    state = first.state_dict()
    resumed = ProbeCallback(interval=1, save_interval=100, out_dir=str(tmp_path / "b"), tensorboard=False)
    resumed.load_state_dict(state)  # before attach: applied when the model is attached
    run_plain_loop(resumed, steps=2)
    assert float(resumed.layers["head"].activation.moments.count) == 5 * ROWS
    assert resumed.layers["head"].weight.count == 5
    other_rank = ProbeCallback(interval=1, tensorboard=False)
    other_rank.attach(Tower(), rank=1, world_size=2)
    other_rank.load_state_dict(state)  # rank 0's rows must not be counted again on rank 1
    assert float(other_rank.layers["head"].activation.moments.count) == 0
    assert other_rank.layers["head"].weight.count == 3


def test_a_run_resumed_past_its_last_observation_still_writes_the_checkpointed_statistics(tmp_path):
    killed = ProbeCallback(interval=5, save_interval=100, out_dir=str(tmp_path), tensorboard=False)
    run_plain_loop(killed, steps=3, end=False)  # observed at step 0, checkpointed after step 2, then killed
    state = killed.state_dict()
    killed.close()
    assert not (tmp_path / "stats.pt").exists()
    resumed = ProbeCallback(interval=5, save_interval=100, out_dir=str(tmp_path), tensorboard=False)
    resumed.load_state_dict(state)
    run_plain_loop(resumed, steps=5, start=3)  # steps 3 and 4: none observed
    stats = load_stats(tmp_path)
    assert stats["step"] == 4 and float(stats["layers"]["head"]["activation"]["count"]) == ROWS


@pytest.mark.parametrize("setting", [{"covariance_block": 4, "max_full_covariance": 4},
                                     {"max_full_weight_factor": 4}], ids=["activation", "weight"])
def test_a_checkpoint_of_other_probe_settings_is_refused_when_it_is_loaded(tmp_path, setting):
    first = ProbeCallback(interval=1, save_interval=100, out_dir=str(tmp_path), tensorboard=False)
    run_plain_loop(first, steps=2)
    resumed = ProbeCallback(interval=1, out_dir=str(tmp_path), tensorboard=False, **setting)
    resumed.load_state_dict(first.state_dict())  # not attached yet: as a trainer restores, before training starts
    with pytest.raises(ValueError, match="Probe statistics of layer 'inner.0' do not fit") as info:
        resumed.on_checkpoint_load(TrainState(model=Tower()))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("setting", [{"covariance_block": 4, "max_full_covariance": 4},
                                     {"max_full_weight_factor": 4}], ids=["activation", "weight"])
def test_a_saved_state_of_other_probe_settings_is_refused_from_its_shapes_alone(tmp_path, setting):
    """What train.py checks before it writes anything: the saved state alone, its tensors on the meta device."""
    first = ProbeCallback(interval=1, save_interval=100, out_dir=str(tmp_path), tensorboard=False)
    run_plain_loop(first, steps=2)
    saved = first.state_dict()
    check_saved_state(saved, to_probe_config({}))  # this run's own settings: fits
    with pytest.raises(ValueError, match="Probe statistics of layer 'inner.0' do not fit") as info:
        check_saved_state(saved, to_probe_config(setting))
    assert "\n" not in str(info.value)
    meta = {**saved, "layers": {f: {k: {n: t.to("meta") if torch.is_tensor(t) else t for n, t in part.items()}
                                    for k, part in entry.items()} for f, entry in saved["layers"].items()}}
    with pytest.raises(ValueError, match="do not fit"):  # shapes are all it reads
        check_saved_state(meta, to_probe_config(setting))
